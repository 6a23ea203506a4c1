"""mpicons: MPI-parallel consolidation of sharded (DCP) safetensors checkpoints.

Importing mpicons does not start MPI: the exports below load on first use, and MPI starts only
when a function is given no communicator (COMM_WORLD) or one is created.
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

if TYPE_CHECKING:
    from .comm import Communicator
    from .consolidation import ConsolidateResult, consolidate
    from .errors import InputError, MpiconsError, WriteError
    from .inspection import InspectReport, inspect
    from .options import Options
    from .verification import VerifyReport, verify


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mpicons' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


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
