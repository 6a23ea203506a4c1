"""mpicons: MPI-parallel consolidation of sharded (DCP) safetensors checkpoints.

Importing mpicons does not start MPI: the exports below and the public submodules (``mpicons.comm``,
``mpicons.sample``, ``mpicons.torch``) load on first use, and MPI starts only when a function is
given no communicator (COMM_WORLD) or one is created. No module is named like an exported name, so
``mpicons.verify`` is the function whatever has been imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "consolidate": "consolidation",
    "ConsolidateResult": "consolidation",
    "inspect": "inspection",
    "InspectReport": "inspection",
    "verify": "verification",
    "VerifyReport": "verification",
    "Options": "options",
    "Communicator": "comm",
    "MpiconsError": "errors",
    "InputError": "errors",
    "WriteError": "errors",
}

#: Submodules reachable as attributes without an import of their own (``mpicons.comm.SingleProcess()``).
_SUBMODULES = ("comm", "sample", "torch")

if TYPE_CHECKING:
    from . import comm as comm  # submodules as attributes, not star-exported
    from . import sample as sample
    from . import torch as torch
    from .comm import Communicator
    from .consolidation import ConsolidateResult, consolidate
    from .errors import InputError, MpiconsError, WriteError
    from .inspection import InspectReport, inspect
    from .options import Options
    from .verification import VerifyReport, verify


def __getattr__(name: str) -> Any:
    from importlib import import_module

    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)  # the import binds the attribute itself
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mpicons' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


__all__ = [
    "consolidate",
    "ConsolidateResult",
    "inspect",
    "InspectReport",
    "verify",
    "VerifyReport",
    "Options",
    "Communicator",
    "MpiconsError",
    "InputError",
    "WriteError",
    "__version__",
]
