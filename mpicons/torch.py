"""mpicons inside a torch.distributed job (the documented import path): a process group as the
communicator, without MPI, drop-ins for torch's two consolidation functions, and the switch that puts
them in torch's place.

``TorchComm`` lives in :mod:`mpicons.comm.torch_group`, the drop-ins and the switch in
:mod:`mpicons.frontends.torch_dropin`; this module names them where users import them from.
"""

from __future__ import annotations

from .comm.torch_group import TorchComm
from .frontends.torch_dropin import (
    REPLACED,
    MissingOutputDirectory,
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
    install,
    installed,
    uninstall,
)

__all__ = [
    "TorchComm",
    "consolidate_safetensors_files",
    "consolidate_safetensors_files_on_every_rank",
    "install",
    "uninstall",
    "installed",
    "MissingOutputDirectory",
    "REPLACED",
]
