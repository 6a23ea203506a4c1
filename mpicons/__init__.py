"""mpicons: MPI-parallel consolidation of sharded (DCP) safetensors checkpoints.

Importing mpicons does not start MPI: the exports below and the public submodules (``mpicons.comm``,
``mpicons.sample``, ``mpicons.torch``) load on first use, and MPI starts only when a function is
given no communicator (COMM_WORLD) or one is created. No module is named like an exported name, so
``mpicons.verify`` is the function whatever has been imported.

The package is layered, lowest first: ``core`` (pure: foundations, plan, engine), ``adaptation``
(model adapters' rules), ``formats`` (what trainers write, read), ``comm`` (the ranks), ``io``
(files, object storage), ``trainers`` (one leaf each), ``job`` (consolidation), ``frontends``
(command line, inspect, verify, the sample, the torch drop-in); each may import only itself and
the layers below. This top level is above them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.version import __version__

_EXPORTS = {
    "consolidate": "job.consolidation",
    "ConsolidateResult": "job.consolidation",
    "inspect": "frontends.inspection",
    "InspectReport": "frontends.inspection",
    "verify": "frontends.verification",
    "VerifyReport": "frontends.verification",
    "shard": "job.sharding",
    "ShardOptions": "job.sharding",
    "ShardResult": "job.sharding",
    "Parallelism": "job.sharding",
    "Options": "core.options",
    "Communicator": "comm",
    "MpiconsError": "core.errors",
    "InputError": "core.errors",
    "WriteError": "core.errors",
}

#: Submodules reachable as attributes without an import of their own (``mpicons.comm.SingleProcess()``).
_SUBMODULES = ("comm", "sample", "torch")

if TYPE_CHECKING:
    from . import comm as comm  # submodules as attributes, not star-exported
    from . import sample as sample
    from . import torch as torch
    from .comm import Communicator
    from .core.errors import InputError, MpiconsError, WriteError
    from .core.options import Options
    from .frontends.inspection import InspectReport, inspect
    from .frontends.verification import VerifyReport, verify
    from .job.consolidation import ConsolidateResult, consolidate
    from .job.sharding import Parallelism, ShardOptions, ShardResult, shard


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
    "shard",
    "ShardOptions",
    "ShardResult",
    "Parallelism",
    "Options",
    "Communicator",
    "MpiconsError",
    "InputError",
    "WriteError",
    "__version__",
]
