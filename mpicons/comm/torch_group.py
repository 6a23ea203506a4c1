"""The communicator interface over a torch.distributed process group, without MPI.

``TorchComm`` implements :class:`~mpicons.comm.Communicator` over a ``torch.distributed`` process
group, so ``mpicons.consolidate(..., comm=group)`` runs on the group's members only and never
starts MPI. CPU collectives need gloo: a group whose backend cannot move CPU tensors (NCCL) gets a
gloo group over the same ranks, made once; no GPU is touched. The drop-in for torch's
consolidation function is in :mod:`mpicons.frontends.torch_dropin` (above the job it calls).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..core.errors import InputError, WriteError
from .base import tree_allreduce

T = TypeVar("T")
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_PYTHON_OPS: dict[str, Callable[[Any], Any]] = {"sum": sum, "min": min, "max": max}
#: Every rank's tensor concatenated (torch 2.13 renamed all_gather_into_tensor).
_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: Tags of duplicated communicators are offset by this much (they share the process group).
_TAG_SPAN = 1 << 16
#: The tag of :meth:`TorchComm.alltoallv`'s messages, at the top of each communicator's range.
_ALLTOALL_TAG = _TAG_SPAN - 1
#: What gloo says when the other end of a connection has gone (the process died or was killed).
_LOST_CONTACT = ("Connection closed", "Connection reset", "Connection refused", "Broken pipe", "Read error", "Write error")
#: Groups that lost a member: the message every later call on them raises at once (gloo would wait or fail again).
_BROKEN: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
#: The gloo group made for each group that cannot move CPU tensors; held no longer than that group
#: (a group object outliving destroy_process_group until the interpreter's shutdown can abort the process).
_CPU_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _cpu_group(group: Any) -> Any:
    """``group`` if its backend moves CPU tensors (gloo, or a mixed ``cpu:gloo,cuda:nccl``), else a gloo
    group over the same ranks, made once (only the members take part in making it)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return group
    partner = _CPU_GROUPS.get(group)
    if partner is None:
        ranks = dist.get_process_group_ranks(group)
        partner = _CPU_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return partner


def _lost_contact(group: Any, rank: int, peer: int | None, exc: BaseException) -> BaseException:
    """mpicons' error for gloo's report of a member gone (``exc`` itself for anything else); the group
    is marked broken so that every later call on it fails at once instead of waiting."""
    if not isinstance(exc, RuntimeError) or not any(words in str(exc) for words in _LOST_CONTACT):
        return exc
    detail = str(exc).split("] ", 1)[-1].split(". This is typically", 1)[0]
    who = f"group member {peer}" if peer is not None else "a member of the process group"
    message = (
        f"[rank {rank}] lost contact with {who} (it died or was killed; gloo: {detail}): nothing was published; "
        "look at that member's log for why it ended, then rerun the job"
    )
    _BROKEN.setdefault(group, message)
    return WriteError(_BROKEN[group])


class _Work:
    """A torch.distributed async work handle as a :class:`~mpicons.comm.Request`.

    gloo's point-to-point work never reports completion until someone waits on it, so the first
    ``test()`` that finds it unfinished hands the wait to a thread and watches that thread instead.
    A member lost meanwhile is reported through ``lost`` (see :func:`_lost_contact`).
    """

    __slots__ = ("work", "keep", "polls", "lost", "_waiter", "_error")

    def __init__(
        self, work: Any, lost: Callable[[BaseException], BaseException], keep: object = None, polls: bool = False
    ) -> None:
        self.work, self.keep = work, keep  # ``keep``: the tensor must live until the work is done
        self.polls = polls  # whether ``is_completed`` tells the truth (collectives) or not (p2p)
        self.lost = lost
        self._waiter: threading.Thread | None = None
        self._error: BaseException | None = None

    def _wait_in_thread(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits or tests next
            self._error = exc

    def _raise(self, exc: BaseException) -> None:
        translated = self.lost(exc)
        if translated is exc:
            raise exc
        raise translated from None

    def wait(self) -> None:
        if self._waiter is None:
            try:
                self.work.wait()
            except RuntimeError as exc:
                self._raise(exc)
            return
        self._waiter.join()
        if self._error is not None:
            self._raise(self._error)

    def test(self) -> bool:
        if self._waiter is None:
            try:
                if self.work.is_completed():
                    return True
            except RuntimeError as exc:
                self._raise(exc)
            if self.polls:
                return False
            self._waiter = threading.Thread(target=self._wait_in_thread, name="mpicons-torch-wait", daemon=True)
            self._waiter.start()
        if self._waiter.is_alive():
            return False
        if self._error is not None:
            self._raise(self._error)
        return True


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor on ``array``'s memory (a copy when it is read-only or not contiguous: only sends get those)."""
    return torch.from_numpy(np.require(array, requirements=["C", "W"]))


def _usable_group(group: Any) -> Any:
    """``group`` if this process can talk through it; an :class:`InputError` saying why not otherwise."""
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise InputError(
            "this process is not a member of the process group it passed (torch.distributed.new_group returns "
            "GroupMember.NON_GROUP_MEMBER to the ranks it leaves out): call mpicons only on the group's members"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise InputError(f"not a torch.distributed process group: {group!r}")
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, KeyError, RuntimeError):
        raise InputError(
            "the process group passed as comm was destroyed (torch.distributed.destroy_process_group) or never "
            "registered: pass a live group, made with init_process_group or new_group"
        ) from None
    return group


class TorchComm:
    """:class:`~mpicons.comm.Communicator` over a torch.distributed process group.

    Parameters:
        group: the process group (default: the default group). Every member calls mpicons with
            the same arguments; other ranks of the job are untouched.
        cpu_group: a gloo group over the same ranks to use for the collectives (default: ``group``
            itself if it moves CPU tensors, else one made once).

    A member that dies ends the others' calls with a :class:`~mpicons.core.errors.WriteError` naming it
    where it can be known (point-to-point), not with gloo's connection error or a timeout.
    """

    def __init__(self, group: Any = None, cpu_group: Any = None, _tag: int = 0) -> None:
        group = _usable_group(group)
        self.group = _usable_group(cpu_group) if cpu_group is not None else _cpu_group(group)
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        if self._rank < 0:
            raise InputError("this process is not a member of the process group it passed: call mpicons only on its members")
        self._tag = _tag

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _lost(self, peer: int | None = None) -> Callable[[BaseException], BaseException]:
        group, rank = self.group, self._rank  # not ``self``: a request must not keep the communicator alive
        return lambda exc: _lost_contact(group, rank, peer, exc)

    @contextmanager
    def _talking(self, peer: int | None = None) -> Iterator[None]:
        """Around every call into gloo: a group already broken fails at once; a member lost now is named."""
        broken = _BROKEN.get(self.group)
        if broken is not None:
            raise WriteError(broken)
        try:
            yield
        except RuntimeError as exc:
            translated = _lost_contact(self.group, self._rank, peer, exc)
            if translated is exc:
                raise
            raise translated from None

    def allgather(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self._size
        with self._talking():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def bcast(self, obj: T, root: int) -> T:
        box = [obj]
        with self._talking():
            dist.broadcast_object_list(box, group=self.group, group_src=root)
        return box[0]

    def allreduce(self, value: Any, op: str) -> Any:
        return _PYTHON_OPS[op](self.allgather(value))  # Python numbers of any size, exactly

    def allreduce_array(self, array: np.ndarray, op: str) -> None:
        if array.dtype == np.bool_:
            widened = array.astype(np.int64)
            self.allreduce_array(widened, op)
            array[...] = widened.astype(bool)
            return
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        with self._talking():
            dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        if not np.shares_memory(tensor.numpy(), array):
            array[...] = tensor.numpy()

    def allreduce_object(self, obj: T, combine: Callable[[T, T], T]) -> T:
        return tree_allreduce(self, obj, combine)

    def alltoallv(self, send: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Point-to-point sends and receives rather than gloo's ``all_to_all_single``: a process that made
        that call can abort at exit ("terminate called without an active exception") in gloo's teardown."""
        send_counts = np.asarray(counts, dtype=np.int64)
        matrix = torch.empty(self._size * self._size, dtype=torch.int64)  # row r: what rank r sends to each
        with self._talking():
            _gather_single(matrix, torch.from_numpy(send_counts.copy()), group=self.group)
        recv_counts = matrix.numpy().reshape(self._size, self._size)[:, self._rank]
        send_offsets = np.concatenate([[0], np.cumsum(send_counts)])
        recv_offsets = np.concatenate([[0], np.cumsum(recv_counts)])
        payload = send.view(np.uint8)
        recv = np.empty(int(recv_offsets[-1]), dtype=np.uint8)
        me = self._rank
        recv[recv_offsets[me] : recv_offsets[me + 1]] = payload[send_offsets[me] : send_offsets[me + 1]]
        requests = []
        for peer in range(self._size):
            if peer != me and recv_counts[peer]:
                requests.append(self.irecv(recv[recv_offsets[peer] : recv_offsets[peer + 1]], peer, _ALLTOALL_TAG))
            if peer != me and send_counts[peer]:
                requests.append(self.isend(payload[send_offsets[peer] : send_offsets[peer + 1]], peer, _ALLTOALL_TAG))
        for request in requests:
            request.wait()
        return recv

    def isend(self, array: np.ndarray, dest: int, tag: int) -> _Work:
        tensor = _tensor(array)
        with self._talking(dest):
            work = dist.isend(tensor, group=self.group, group_dst=dest, tag=self._tag + tag)
        return _Work(work, self._lost(dest), tensor)

    def irecv(self, array: np.ndarray, source: int, tag: int) -> _Work:
        tensor = _tensor(array)
        with self._talking(source):
            work = dist.irecv(tensor, group=self.group, group_src=source, tag=self._tag + tag)
        return _Work(work, self._lost(source), tensor)

    def ibarrier(self) -> _Work:
        with self._talking():
            work = dist.barrier(group=self.group, async_op=True)
        return _Work(work, self._lost(), polls=True)

    def duplicate(self) -> TorchComm:
        """The same group with its own range of message tags (collectives stay in program order)."""
        return TorchComm(cpu_group=self.group, _tag=self._tag + _TAG_SPAN)

    def free(self) -> None:
        pass

    def abort(self, code: int) -> None:
        """End this process now; torchrun's agent then stops the other members."""
        sys.stderr.flush()
        os._exit(code)


def adapt(group: Any) -> TorchComm:
    """A torch.distributed process group as mpicons' :class:`~mpicons.comm.Communicator` (see :data:`mpicons.comm.ADAPTERS`)."""
    return TorchComm(group)


def recognises(obj: object) -> bool:
    """Whether ``obj`` is what torch.distributed.new_group returns to the ranks it leaves out (an int):
    :func:`adapt` then explains that this process is not a member."""
    return type(obj) is int and obj == dist.GroupMember.NON_GROUP_MEMBER


__all__ = ["TorchComm", "adapt", "recognises"]
