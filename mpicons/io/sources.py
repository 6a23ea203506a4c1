"""Reading shard files: read-only handles in a bounded cache, reads below 2 GiB each (no MPI here)."""

from __future__ import annotations

import inspect
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ..core.errors import WriteError

#: Largest single read, write or copy_file_range call (below the C ``int`` limit of many MPI builds and kernels).
MAX_TRANSFER = 1 << 30


H = TypeVar("H")


class HandleCache(Generic[H]):
    """At most ``max_open`` open handles, least recently used closed first, so thousands of files never
    exhaust descriptors. ``before_close`` runs before a handle is closed to make room (a writer drains
    its background I/O there), ``retire`` closes one."""

    def __init__(self, open_one: Callable[[int], H], retire: Callable[[int, H], None], max_open: int) -> None:
        # Methods of the cache's owner are held weakly: a cycle would keep the owner (and what it holds,
        # such as a torch.distributed group) alive until the interpreter's shutdown.
        self._open_one = _held_weakly(open_one)
        self._retire = _held_weakly(retire)
        self.max_open = max_open
        self.handles: OrderedDict[int, H] = OrderedDict()
        self.before_close: Callable[[], None] = lambda: None

    def get(self, key: int) -> H:
        handle = self.handles.get(key)
        if handle is not None:
            self.handles.move_to_end(key)
            return handle
        handle = self.handles[key] = self._open_one()(key)
        if len(self.handles) > self.max_open:
            self.before_close()
            self._retire()(*self.handles.popitem(last=False))
        return handle

    def close(self) -> None:
        """Close every handle (the first failure is raised once all are closed)."""
        first: BaseException | None = None
        while self.handles:
            try:
                self._retire()(*self.handles.popitem())
            except BaseException as exc:  # noqa: BLE001 - every handle is closed before raising
                first = first or exc
        if first is not None:
            raise first


def _held_weakly(function: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
    """A callable returning ``function``, holding it weakly when it is a bound method."""
    if inspect.ismethod(function):
        method = weakref.WeakMethod(function)
        return lambda: method() or _gone
    return lambda: function


def _gone(*args: object) -> Any:
    raise ValueError("the handles' owner was garbage-collected")


class CachedHandles:
    """Something that keeps its handles in a :class:`HandleCache` (and lets its user hook ``before_close``)."""

    _cache: HandleCache[Any]

    @property
    def before_close(self) -> Callable[[], None]:
        return self._cache.before_close

    @before_close.setter
    def before_close(self, hook: Callable[[], None]) -> None:
        self._cache.before_close = hook


class SourceFiles(CachedHandles):
    """Read-only handles on the shard files, opened on first use and kept in a bounded cache."""

    #: Files of this machine's filesystems, with descriptors (``fd``) the kernel can copy from.
    local = True

    def __init__(self, directory: str, names: Sequence[str], max_open: int = 256) -> None:
        self.directory = directory
        self.names = names
        self._cache: HandleCache[int] = HandleCache(self._open, lambda _, fd: os.close(fd), max_open)

    def path(self, file: int) -> str:
        return os.path.join(self.directory, self.names[file])

    def _open(self, file: int) -> int:
        try:
            return os.open(self.path(file), os.O_RDONLY)
        except OSError as exc:
            raise WriteError(f"{self.path(file)}: cannot open shard ({exc.strerror})") from None

    def fd(self, file: int) -> int:
        return self._cache.get(file)

    def read_into(self, file: int, offset: int, target: memoryview) -> None:
        """Fill ``target`` with the bytes at ``offset`` of shard ``file``."""
        fd = self.fd(file)
        done, total = 0, len(target)
        while done < total:
            try:
                got = os.preadv(fd, [target[done : done + MAX_TRANSFER]], offset + done)
            except OSError as exc:
                raise WriteError(f"{self.path(file)}: read failed at byte {offset + done} ({exc.strerror})") from None
            if got == 0:
                raise WriteError(f"{self.path(file)}: ends before byte {offset + total} (file truncated since the scan?)")
            done += got

    def close(self) -> None:
        self._cache.close()
