"""The communicator interface over an mpi4py intracommunicator (importing this module starts MPI).

MPI starts at the import of ``mpi4py.MPI`` (``mpi4py.rc.initialize``; if a caller turned that off,
here) with room left for it under an address-space limit, and with the job's end (SIGTERM, SIGUSR1)
ending the process at once: a rank waiting in MPI_Init for a peer must not ignore it. Ctrl-C is
recorded as at any other moment and stops every rank cleanly once MPI has started.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..core.machine import MPI_START_ROOM, check_room_to_start
from .interrupts import ending_at_once

if "mpi4py.MPI" not in sys.modules:
    check_room_to_start("MPI", MPI_START_ROOM)
with ending_at_once():
    from mpi4py import MPI

    if not MPI.Is_initialized():
        MPI.Init_thread()
        atexit.register(lambda: None if MPI.Is_finalized() else MPI.Finalize())

T = TypeVar("T")
_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


def world() -> MPI.Intracomm:
    return MPI.COMM_WORLD


class _Request:
    __slots__ = ("request",)

    def __init__(self, request: MPI.Request) -> None:
        self.request = request

    def wait(self) -> None:
        self.request.Wait()

    def test(self) -> bool:
        return bool(self.request.Test())


class MPIComm:
    """:class:`~mpicons.comm.Communicator` over ``mpi``; ``mpi`` stays available for MPI-IO."""

    def __init__(self, mpi: MPI.Intracomm) -> None:
        if not isinstance(mpi, MPI.Intracomm):
            raise TypeError(f"mpicons needs an intracommunicator, not {type(mpi).__name__}")
        self.mpi = mpi

    @property
    def rank(self) -> int:
        return self.mpi.Get_rank()

    @property
    def size(self) -> int:
        return self.mpi.Get_size()

    def allgather(self, obj: T) -> list[T]:
        return self.mpi.allgather(obj)

    def bcast(self, obj: T, root: int) -> T:
        return self.mpi.bcast(obj, root=root)

    def allreduce(self, value: Any, op: str) -> Any:
        return self.mpi.allreduce(value, op=_OPS[op])

    def allreduce_array(self, array: np.ndarray, op: str) -> None:
        self.mpi.Allreduce(MPI.IN_PLACE, array, op=_OPS[op])

    def allreduce_object(self, obj: T, combine: Callable[[T, T], T]) -> T:
        return self.mpi.allreduce(obj, op=lambda a, b, *_: combine(a, b))  # mpi4py reduces objects along a tree

    def alltoallv(self, send: np.ndarray, counts: np.ndarray) -> np.ndarray:
        send_counts = np.asarray(counts, dtype=np.int64)
        recv_counts = np.empty_like(send_counts)
        self.mpi.Alltoall(send_counts, recv_counts)
        recv = np.empty(int(recv_counts.sum()), dtype=np.uint8)
        self.mpi.Alltoallv(
            [send, (send_counts, np.cumsum(send_counts) - send_counts), MPI.BYTE],
            [recv, (recv_counts, np.cumsum(recv_counts) - recv_counts), MPI.BYTE],
        )
        return recv

    def isend(self, array: np.ndarray, dest: int, tag: int) -> _Request:
        return _Request(self.mpi.Isend(array, dest=dest, tag=tag))

    def irecv(self, array: np.ndarray, source: int, tag: int) -> _Request:
        return _Request(self.mpi.Irecv(array, source=source, tag=tag))

    def ibarrier(self) -> _Request:
        return _Request(self.mpi.Ibarrier())

    def duplicate(self) -> MPIComm:
        return MPIComm(self.mpi.Dup())

    def free(self) -> None:
        self.mpi.Free()

    def abort(self, code: int) -> None:
        self.mpi.Abort(code)


def default() -> MPIComm:
    """The communicator for ``comm=None``: every rank of the MPI job (``COMM_WORLD``)."""
    return MPIComm(world())


def adapt(comm: Any) -> MPIComm:
    """An mpi4py communicator as mpicons' :class:`~mpicons.comm.Communicator` (see :data:`mpicons.comm.ADAPTERS`)."""
    return MPIComm(comm)
