"""The communicator layer: how ranks talk, and nothing about what they say.

This package holds the :class:`Communicator` protocol (the few operations mpicons needs from its
ranks), :class:`SingleProcess`, the adapters at the edge (:mod:`.mpi` over mpi4py,
:mod:`.torch_group` over torch.distributed), the agreement of phases over the ranks
(:mod:`.agreement`) and the signal handlers (:mod:`.interrupts`). It may import only
:mod:`mpicons.core`. Importing it is light: no numpy, no MPI, no torch.

:func:`as_communicator` wraps what callers pass: an mpi4py communicator (or None for
``COMM_WORLD``), a torch.distributed process group, or an object that already implements this
interface. It finds the adapter in :data:`ADAPTERS` by the module of the object's type and imports
it only then, so this module names no communication library and importing mpicons never starts MPI.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import NamedTuple

from .base import OPS, Communicator, Request, sleeping_wait, tree_allreduce, wait_all
from .single import SingleProcess


class CommAdapter(NamedTuple):
    """A communication library mpicons can run over, wrapped by one module of this package."""

    #: The module of this package whose ``adapt(obj)`` wraps the library's communicators.
    module: str
    #: A module of the library that, once someone imported it, lets the adapter recognise objects
    #: of other types as its own (``recognises(obj)``); empty: only the library's own types.
    watch: str = ""


#: The adapters, by the module prefix of the communicator's type; imported only when one is passed.
ADAPTERS = {"mpi4py": CommAdapter(".mpi"), "torch": CommAdapter(".torch_group", watch="torch.distributed")}
#: The adapter for None: its ``default()`` is the job's whole world (``MPI.COMM_WORLD``).
DEFAULT_ADAPTER = ".mpi"


def as_communicator(comm: object | None) -> Communicator:
    """The communicator for ``comm``: None is ``MPI.COMM_WORLD``; an mpi4py intracommunicator is wrapped;
    a torch.distributed process group is wrapped (gloo); an object implementing :class:`Communicator`
    is used as it is."""
    if comm is None:
        result: Communicator = import_module(DEFAULT_ADAPTER, __name__).default()
        return result
    if isinstance(comm, Communicator):
        return comm
    module = type(comm).__module__
    for prefix, adapter in ADAPTERS.items():
        if module.startswith(prefix) or _recognised(adapter, comm):
            result = import_module(adapter.module, __name__).adapt(comm)
            return result
    raise TypeError(f"not a communicator: {comm!r} (an mpi4py intracommunicator, a torch.distributed process group, or None)")


def _recognised(adapter: CommAdapter, comm: object) -> bool:
    """Whether an adapter whose library is loaded already claims ``comm`` (torch's non-member marker, an int)."""
    if not adapter.watch or adapter.watch not in sys.modules:
        return False
    return bool(import_module(adapter.module, __name__).recognises(comm))


__all__ = [
    "Communicator",
    "Request",
    "SingleProcess",
    "as_communicator",
    "CommAdapter",
    "ADAPTERS",
    "wait_all",
    "sleeping_wait",
    "tree_allreduce",
    "OPS",
]
