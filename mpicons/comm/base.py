"""The communicator protocol: the few operations mpicons needs from its ranks, and helpers over them.

Everything that talks between ranks goes through :class:`Communicator`: collectives on Python
objects and numpy arrays, a byte Alltoallv, non-blocking point-to-point on numpy buffers (one
ordered channel per pair of ranks and tag), a non-blocking barrier, duplication and abort. The
implementations are beside this module (:mod:`.single`, :mod:`.mpi`, :mod:`.torch_group`); numpy
is imported where it is used, so importing the protocol stays light.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import numpy as np  # imported where it is used: importing the communicator layer stays light

T = TypeVar("T")
#: Reductions every implementation supports, on numbers and numpy arrays (element-wise).
OPS = ("sum", "min", "max")

#: Point-to-point tags, one per conversation that runs beside others, all here so none collide.
TREE_REDUCTION_TAG = 7
PROGRESS_TAG = 17
EXCHANGE_TAG = 29


@runtime_checkable
class Request(Protocol):
    """A pending non-blocking operation."""

    def wait(self) -> None: ...
    def test(self) -> bool: ...


@runtime_checkable
class Communicator(Protocol):
    """What mpicons needs of a group of ranks. Every collective is called by every rank, in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order (picklable objects)."""
        ...

    def bcast(self, obj: T, root: int) -> T:
        """``root``'s ``obj`` on every rank."""
        ...

    def allreduce(self, value: Any, op: str) -> Any:
        """``op`` (``sum``/``min``/``max``) of a number over the ranks."""
        ...

    def allreduce_array(self, array: np.ndarray, op: str) -> None:
        """``op`` over the ranks, element-wise, in place (every rank's array has the same shape and dtype)."""
        ...

    def allreduce_object(self, obj: T, combine: Callable[[T, T], T]) -> T:
        """``combine`` of every rank's ``obj`` (associative and commutative), by a tree: no rank holds more than two at once."""
        ...

    def alltoallv(self, send: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Bytes to every rank: ``send`` (uint8) holds ``counts[r]`` bytes for rank r, in rank order; returns
        what every rank sent here, in rank order. Counts below 2**31 (callers split larger exchanges)."""
        ...

    def isend(self, array: np.ndarray, dest: int, tag: int) -> Request:
        """Send a contiguous numpy buffer without waiting (messages between two ranks with one tag keep their order)."""
        ...

    def irecv(self, array: np.ndarray, source: int, tag: int) -> Request:
        """Receive into a contiguous numpy buffer of exactly the sent size, without waiting."""
        ...

    def ibarrier(self) -> Request:
        """A barrier that does not block: poll its request."""
        ...

    def duplicate(self) -> Communicator:
        """The same ranks on a private channel (for traffic that must not mix with the caller's)."""
        ...

    def free(self) -> None: ...

    def abort(self, code: int) -> None:
        """End every rank of the job now (last resort)."""
        ...


def wait_all(requests: Sequence[Request]) -> None:
    for request in requests:
        request.wait()


def sleeping_wait(request: Request, poll: float = 0.002) -> None:
    """Wait for ``request`` while leaving the CPU to others (blocking MPI waits spin)."""
    while not request.test():
        time.sleep(poll)


def tree_allreduce(comm: Communicator, obj: T, combine: Callable[[T, T], T], tag: int = TREE_REDUCTION_TAG) -> T:
    """Recursive halving of any picklable object over point-to-point messages, then a broadcast:
    for implementations without a tree reduction of objects (each rank holds at most two at once)."""
    import numpy as np

    value = obj
    rank, size = comm.rank, comm.size
    step = 1
    while step < size:
        if rank % (2 * step) == step:  # send to the partner below, done
            payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            comm.isend(np.array([len(payload)], dtype=np.int64), rank - step, tag).wait()
            comm.isend(payload, rank - step, tag).wait()
            break
        if rank % (2 * step) == 0 and rank + step < size:
            length = np.zeros(1, dtype=np.int64)
            comm.irecv(length, rank + step, tag).wait()
            payload = np.empty(int(length[0]), dtype=np.uint8)
            comm.irecv(payload, rank + step, tag).wait()
            value = combine(value, pickle.loads(payload.tobytes()))
        step *= 2
    return comm.bcast(value if rank == 0 else None, root=0)  # type: ignore[return-value]


__all__ = [
    "Communicator",
    "Request",
    "OPS",
    "TREE_REDUCTION_TAG",
    "PROGRESS_TAG",
    "EXCHANGE_TAG",
    "wait_all",
    "sleeping_wait",
    "tree_allreduce",
]
