"""mpicons inside a torch.distributed job (the documented import path): a process group as the
communicator, without MPI, and the drop-in for torch's consolidation function.

``TorchComm`` lives in :mod:`mpicons.comm.torch_group` and
``consolidate_safetensors_files_on_every_rank`` in :mod:`mpicons.frontends.torch_dropin`; this
module names them where users import them from.
"""

from __future__ import annotations

from .comm.torch_group import TorchComm
from .frontends.torch_dropin import consolidate_safetensors_files_on_every_rank

__all__ = ["TorchComm", "consolidate_safetensors_files_on_every_rank"]
