"""The communicator interface: the few operations mpicons needs from its ranks (no MPI imported here).

Everything that talks between ranks goes through :class:`Communicator`: collectives on Python
objects and numpy arrays, a byte Alltoallv, non-blocking point-to-point on numpy buffers (one
ordered channel per pair of ranks and tag), a non-blocking barrier, duplication and abort.
:func:`as_communicator` wraps what callers pass: an mpi4py communicator (or None for
``COMM_WORLD``), a torch.distributed process group, or an object that already implements this
interface (:class:`SingleProcess`: one process, no MPI). mpi4py is imported only
then, so importing mpicons never starts MPI.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

T = TypeVar("T")
#: Reductions every implementation supports, on numbers and numpy arrays (element-wise).
OPS = ("sum", "min", "max")


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


class _Done:
    """A request that is already complete."""

    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True


class SingleProcess:
    """:class:`Communicator` of one process, with no MPI and no torch.distributed: a job in this process alone."""

    rank = 0
    size = 1

    def allgather(self, obj: T) -> list[T]:
        return [obj]

    def bcast(self, obj: T, root: int) -> T:
        return obj

    def allreduce(self, value: Any, op: str) -> Any:
        return value

    def allreduce_array(self, array: np.ndarray, op: str) -> None:
        pass

    def allreduce_object(self, obj: T, combine: Callable[[T, T], T]) -> T:
        return obj

    def alltoallv(self, send: np.ndarray, counts: np.ndarray) -> np.ndarray:
        return np.array(send[: int(counts[0])], dtype=np.uint8)

    def isend(self, array: np.ndarray, dest: int, tag: int) -> Request:
        raise RuntimeError("a single process has no other rank to send to")

    def irecv(self, array: np.ndarray, source: int, tag: int) -> Request:
        raise RuntimeError("a single process has no other rank to receive from")

    def ibarrier(self) -> Request:
        return _Done()

    def duplicate(self) -> SingleProcess:
        return SingleProcess()

    def free(self) -> None:
        pass

    def abort(self, code: int) -> None:
        os._exit(code)


def as_communicator(comm: object | None) -> Communicator:
    """The communicator for ``comm``: None is ``MPI.COMM_WORLD``; an mpi4py intracommunicator is wrapped;
    a torch.distributed process group is wrapped (gloo); an object implementing :class:`Communicator`
    is used as it is."""
    if comm is None:
        from ._mpi import MPIComm, world

        return MPIComm(world())
    if isinstance(comm, Communicator):
        return comm
    module = type(comm).__module__
    if module.startswith("mpi4py"):
        from ._mpi import MPIComm

        mpi: Any = comm
        return MPIComm(mpi)
    if module.startswith("torch") or _torch_non_member(comm):
        torch_module: Any = import_module(".torch", __package__)  # explains a destroyed group or a non-member
        result: Communicator = torch_module.TorchComm(comm)
        return result
    raise TypeError(f"not a communicator: {comm!r} (an mpi4py intracommunicator, a torch.distributed process group, or None)")


def _torch_non_member(comm: object) -> bool:
    """Whether ``comm`` is what torch.distributed.new_group returns to the ranks it leaves out (an int)."""
    dist = sys.modules.get("torch.distributed")
    marker = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    return type(comm) is int and marker is not None and comm == marker


def wait_all(requests: Sequence[Request]) -> None:
    for request in requests:
        request.wait()


def sleeping_wait(request: Request, poll: float = 0.002) -> None:
    """Wait for ``request`` while leaving the CPU to others (blocking MPI waits spin)."""
    while not request.test():
        time.sleep(poll)


def tree_allreduce(comm: Communicator, obj: T, combine: Callable[[T, T], T], tag: int = 7) -> T:
    """Recursive halving of any picklable object over point-to-point messages, then a broadcast:
    for implementations without a tree reduction of objects (each rank holds at most two at once)."""
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


__all__ = ["Communicator", "Request", "SingleProcess", "as_communicator", "wait_all", "sleeping_wait", "tree_allreduce", "OPS"]
