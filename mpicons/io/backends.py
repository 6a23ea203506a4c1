"""The output backend a job asks for, by name: ``posix`` here, ``mpiio`` imported only when chosen (no MPI otherwise).

Above both backends (:mod:`mpicons.io.outputs`, :mod:`mpicons.io.mpiio`), so that neither imports the other's chooser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..comm import Communicator
from ..core.errors import InputError
from ..core.options import BACKENDS, check_choice
from .outputs import OutputBackend, PosixOutput


def open_output(
    kind: str,
    comm: Communicator,
    paths: Sequence[str],
    headers: Sequence[bytes],
    sizes: Sequence[int],
    hints: Mapping[str, str] | None = None,
    preallocated: bool = False,
    owner: int = 0,
    durable: bool = True,
) -> OutputBackend:
    """An output backend; ``preallocated`` outputs already exist with their layout (HDF5) and are only opened.

    ``owner`` creates the posix outputs (the rank whose disk holds them with ``gather_to``);
    ``durable=False`` skips flushing to stable storage. ``mpiio`` needs an MPI communicator.
    """
    if kind == "posix":
        return PosixOutput(comm, paths, headers, sizes, preallocated, durable, owner=owner)
    if kind == "mpiio":
        if not hasattr(comm, "mpi"):
            raise InputError("--io mpiio needs an MPI communicator (this job's communicator is not MPI): use --io posix")
        from .mpiio import MpiioOutput

        return MpiioOutput(comm, paths, headers, sizes, preallocated, durable, hints=hints)
    check_choice(kind, BACKENDS, "I/O backend")
    raise AssertionError(f"backend {kind!r} is listed but has no implementation")


__all__ = ["BACKENDS", "open_output"]
