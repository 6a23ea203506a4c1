"""A job of one process: :class:`SingleProcess`, with neither MPI nor torch.distributed."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .base import Request

if TYPE_CHECKING:
    import numpy as np

T = TypeVar("T")


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
        import numpy as np

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


__all__ = ["SingleProcess"]
