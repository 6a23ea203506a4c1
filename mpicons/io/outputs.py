"""Output backends: one interface (:class:`OutputBackend`) and the posix implementation.

``posix`` writes with ``pwrite`` and ``os.copy_file_range``; ``mpiio`` (:mod:`mpicons.io.mpiio`) opens
the files with ``MPI.File`` and shares this module's base class; :mod:`mpicons.io.backends` chooses
between them. Every single transfer stays below 2 GiB, the C ``int`` limit of many MPI builds and
of some kernels. No MPI here.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..comm import Communicator
from ..core.errors import WriteError
from .sources import MAX_TRANSFER, CachedHandles, HandleCache, SourceFiles

#: Output files a rank keeps open at once (per backend), so thousands of outputs never exhaust descriptors.
MAX_OPEN_OUTPUTS = 128
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


class OutputBackend(Protocol):
    """What the writers need of an output backend (posix and mpiio implement it)."""

    name: str
    #: Whether writes may be issued from background threads.
    threaded: bool
    #: Whether any rank may write any bytes (a rank holding a shard then copies its pieces in place for
    #: others); False: each rank writes only its own share, in output order (an object store's parts).
    any_rank_writes: bool
    #: Called before a handle is closed to make room (the writer drains its background I/O there).
    before_close: Callable[[], None]

    def create(self) -> None: ...
    def open(self, file: int) -> None: ...
    def write(self, file: int, offset: int, data: memoryview) -> None: ...
    def copy(
        self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray
    ) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...
    def hints_in_effect(self) -> dict[str, str]: ...


class _Output:
    """What both backends know: the outputs' paths, headers and final sizes."""

    any_rank_writes = True

    def __init__(
        self,
        comm: Communicator,
        paths: Sequence[str],
        headers: Sequence[bytes],
        sizes: Sequence[int],
        preallocated: bool = False,
        durable: bool = True,
    ) -> None:
        self.comm = comm
        self.paths = paths
        self.headers = headers
        self.sizes = sizes
        self.preallocated = preallocated  # already laid out (HDF5): open only
        self.durable = durable  # flush to stable storage before publishing


class PosixOutput(_Output, CachedHandles):
    """Outputs written with pwrite / copy_file_range; the owner rank creates them, every rank writes."""

    name = "posix"
    threaded = True

    def __init__(self, *args: object, owner: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.owner = owner
        self._copy_range = hasattr(os, "copy_file_range")
        self._cache: HandleCache[int] = HandleCache(self._open, self._retire, MAX_OPEN_OUTPUTS)

    def create(self) -> None:
        """The owner creates each file exclusively, writes its header and sizes it (others do nothing)."""
        if self.comm.rank != self.owner or self.preallocated:
            return
        for path, header, size in zip(self.paths, self.headers, self.sizes):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            except OSError as exc:
                raise WriteError(f"{path}: cannot create output ({exc.strerror})") from None
            try:
                _pwrite_all(fd, memoryview(header), 0, path)
                os.ftruncate(fd, size)
            except OSError as exc:
                raise WriteError(f"{path}: cannot size output to {size} bytes ({exc.strerror})") from None
            finally:
                self._retire_path(path, fd)

    def hints_in_effect(self) -> dict[str, str]:
        return {}

    def open(self, file: int) -> None:
        """Open output ``file`` now (from the main thread, before background writes use it)."""
        self._cache.get(file)

    def _fd(self, file: int) -> int:
        return self._cache.get(file)

    def _open(self, file: int) -> int:
        try:
            return os.open(self.paths[file], os.O_WRONLY | _NOFOLLOW)
        except OSError as exc:
            raise WriteError(f"{self.paths[file]}: cannot open output ({exc.strerror})") from None

    def _retire(self, file: int, fd: int) -> None:
        self._retire_path(self.paths[file], fd)

    def _retire_path(self, path: str, fd: int) -> None:
        """Close a handle; what was written through it is flushed first when outputs must be durable."""
        try:
            self._flush(path, fd)
        finally:
            os.close(fd)

    def _flush(self, path: str, fd: int) -> None:
        if self.durable:
            try:
                os.fsync(fd)
            except OSError as exc:
                raise WriteError(f"{path}: fsync failed ({exc.strerror})") from None

    def write(self, file: int, offset: int, data: memoryview) -> None:
        _pwrite_all(self._fd(file), data, offset, self.paths[file])
        self._start_writeback(file, offset, len(data))

    def _start_writeback(self, file: int, offset: int, length: int) -> None:
        """Ask the kernel to start writing these pages to disk now (asynchronously), so the final
        fsync overlaps the copying instead of following it (POSIX_FADV_DONTNEED starts writeback
        of dirty pages on Linux without waiting for it)."""
        if self.durable and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd(file), offset, length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def copy(
        self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray
    ) -> None:
        """Copy shard bytes straight into the output: in the kernel when it can, else through ``bounce``."""
        self._copy(sources, src, src_offset, file, offset, length, bounce)
        self._start_writeback(file, offset, length)

    def _copy(
        self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray
    ) -> None:
        if self._copy_range and sources.local:  # sources in an object store have no descriptor
            src_fd, dst_fd = sources.fd(src), self._fd(file)
            done = 0
            try:
                while done < length:
                    got = os.copy_file_range(src_fd, dst_fd, min(length - done, MAX_TRANSFER), src_offset + done, offset + done)
                    if got == 0:
                        raise WriteError(f"{sources.path(src)}: ends before byte {src_offset + length}")
                    done += got
                return
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise WriteError(f"{self.paths[file]}: copy from {sources.path(src)} failed ({exc.strerror})") from None
                self._copy_range = False
                src_offset, offset, length = src_offset + done, offset + done, length - done
        _bounce_copy(self, sources, src, src_offset, file, offset, length, bounce)

    def flusher(self) -> Callable[[], None]:
        """What flushes the outputs open now, callable from the I/O thread: a handle stays open until the
        writer's background calls are drained (:class:`HandleCache` drains before closing one)."""
        open_now = list(self._cache.handles.items())

        def flush() -> None:
            for file, fd in open_now:
                self._flush(self.paths[file], fd)

        return flush

    def sync(self) -> None:
        """Flush what this rank wrote (handles closed earlier were flushed when they were closed)."""
        for file, fd in self._cache.handles.items():
            self._flush(self.paths[file], fd)

    def close(self) -> None:
        while self._cache.handles:
            os.close(self._cache.handles.popitem()[1])


def _pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    done, total = 0, len(data)
    while done < total:
        try:
            done += os.pwrite(fd, data[done : done + MAX_TRANSFER], offset + done)
        except OSError as exc:
            raise WriteError(f"{path}: write failed at byte {offset + done} ({exc.strerror})") from None


def _bounce_copy(
    output: OutputBackend,
    sources: SourceFiles,
    src: int,
    src_offset: int,
    file: int,
    offset: int,
    length: int,
    bounce: np.ndarray,
) -> None:
    view = bounce.data
    for start in range(0, length, len(view)):
        chunk = view[: min(len(view), length - start)]
        sources.read_into(src, src_offset + start, chunk)
        output.write(file, offset + start, chunk)
