"""Executing byte moves: reading shard files and writing preallocated outputs.

Two output backends with one interface: ``posix`` (pwrite, ``os.copy_file_range``) and
``mpiio`` (``MPI.File`` opened on the communicator, ``Write_at``, ROMIO hints). Every single
transfer stays below 2 GiB, the C ``int`` limit of many MPI builds and of some kernels.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from .errors import WriteError
from .parallel import Comm

#: Largest single read, write or copy_file_range call.
MAX_TRANSFER = 1 << 30
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}


class SourceFiles:
    """Read-only handles on the shard files, opened on first use and kept in a bounded cache."""

    def __init__(self, directory: str, names: Sequence[str], max_open: int = 256) -> None:
        self.directory = directory
        self.names = names
        self.max_open = max_open
        self._open: OrderedDict[int, int] = OrderedDict()
        #: Called before a handle is closed to make room, so background I/O never loses its file.
        self.before_close: Callable[[], None] = lambda: None

    def path(self, file: int) -> str:
        return os.path.join(self.directory, self.names[file])

    def fd(self, file: int) -> int:
        fd = self._open.get(file)
        if fd is not None:
            self._open.move_to_end(file)
            return fd
        try:
            fd = os.open(self.path(file), os.O_RDONLY)
        except OSError as exc:
            raise WriteError(f"{self.path(file)}: cannot open shard ({exc.strerror})") from None
        self._open[file] = fd
        if len(self._open) > self.max_open:
            self.before_close()
            _, old = self._open.popitem(last=False)
            os.close(old)
        return fd

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
        while self._open:
            os.close(self._open.popitem()[1])


class _Output:
    """What both backends know: the outputs' paths, headers and final sizes."""

    def __init__(
        self,
        comm: Comm,
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


class PosixOutput(_Output):
    """Outputs written with pwrite / copy_file_range; the owner rank creates them, every rank writes."""

    name = "posix"

    def __init__(self, *args: object, owner: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.owner = owner
        self._fds: dict[int, int] = {}
        self._copy_range = hasattr(os, "copy_file_range")

    def create(self) -> None:
        """The owner writes each header and sizes each file to its final length (others do nothing)."""
        if self.comm.rank != self.owner or self.preallocated:
            return
        for path, header, size in zip(self.paths, self.headers, self.sizes):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            except OSError as exc:
                raise WriteError(f"{path}: cannot create output ({exc.strerror})") from None
            try:
                _pwrite_all(fd, memoryview(header), 0, path)
                os.ftruncate(fd, size)
                if self.durable:
                    os.fsync(fd)
            except OSError as exc:
                raise WriteError(f"{path}: cannot size output to {size} bytes ({exc.strerror})") from None
            finally:
                os.close(fd)

    def open(self, file: int) -> None:
        """Open output ``file`` now (from the main thread, before background writes use it)."""
        self._fd(file)

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is None:
            try:
                fd = self._fds[file] = os.open(self.paths[file], os.O_WRONLY)
            except OSError as exc:
                raise WriteError(f"{self.paths[file]}: cannot open output ({exc.strerror})") from None
        return fd

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

    def copy(self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray) -> None:
        """Copy shard bytes straight into the output: in the kernel when it can, else through ``bounce``."""
        self._copy(sources, src, src_offset, file, offset, length, bounce)
        self._start_writeback(file, offset, length)

    def _copy(self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray) -> None:
        if self._copy_range:
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

    def sync(self) -> None:
        if not self.durable:
            return
        for file, fd in self._fds.items():
            try:
                os.fsync(fd)
            except OSError as exc:
                raise WriteError(f"{self.paths[file]}: fsync failed ({exc.strerror})") from None

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


class MpiioOutput(_Output):
    """Outputs opened with ``MPI.File`` on the communicator; collective create, independent writes."""

    name = "mpiio"

    def __init__(self, *args: object, hints: Mapping[str, str] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hints = dict(hints or {})
        self._files: list[MPI.File] = []

    def create(self) -> None:
        """Collectively create every output (hints such as striping apply here), header by rank 0."""
        info = MPI.Info.Create()
        for key, value in self.hints.items():
            info.Set(key, value)
        try:
            for path, header, size in zip(self.paths, self.headers, self.sizes):
                try:
                    mode = MPI.MODE_WRONLY | (0 if self.preallocated else MPI.MODE_CREATE)
                    handle = MPI.File.Open(self.comm, path, mode, info)
                    self._files.append(handle)
                    if not self.preallocated:
                        handle.Set_size(size)
                        if self.comm.rank == 0:
                            handle.Write_at(0, header)
                except MPI.Exception as exc:
                    raise WriteError(f"{path}: cannot create output with MPI-IO ({exc.Get_error_string()})") from None
        finally:
            info.Free()

    def hints_in_effect(self) -> dict[str, str]:
        """The hints the MPI library reports for the first output (unknown hints are dropped silently)."""
        if not self._files:
            return {}
        info = self._files[0].Get_info()
        try:
            return {info.Get_nthkey(i): info.Get(info.Get_nthkey(i)) or "" for i in range(info.Get_nkeys())}
        finally:
            info.Free()

    def write(self, file: int, offset: int, data: memoryview) -> None:
        handle = self._files[file]
        for start in range(0, len(data), MAX_TRANSFER):
            try:
                handle.Write_at(offset + start, data[start : start + MAX_TRANSFER])
            except MPI.Exception as exc:
                raise WriteError(f"{self.paths[file]}: MPI write failed ({exc.Get_error_string()})") from None

    def copy(self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray) -> None:
        _bounce_copy(self, sources, src, src_offset, file, offset, length, bounce)

    def sync(self) -> None:
        if not self.durable:
            return
        for path, handle in zip(self.paths, self._files):
            try:
                handle.Sync()
            except MPI.Exception as exc:
                raise WriteError(f"{path}: MPI sync failed ({exc.Get_error_string()})") from None

    def close(self) -> None:
        while self._files:
            self._files.pop().Close()


def _pwrite_all(fd: int, data: memoryview, offset: int, path: str) -> None:
    done, total = 0, len(data)
    while done < total:
        try:
            done += os.pwrite(fd, data[done : done + MAX_TRANSFER], offset + done)
        except OSError as exc:
            raise WriteError(f"{path}: write failed at byte {offset + done} ({exc.strerror})") from None


def _bounce_copy(
    output: PosixOutput | MpiioOutput,
    sources: SourceFiles,
    src: int,
    src_offset: int,
    file: int,
    offset: int,
    length: int,
    bounce: np.ndarray,
) -> None:
    view = memoryview(bounce)
    for start in range(0, length, len(view)):
        chunk = view[: min(len(view), length - start)]
        sources.read_into(src, src_offset + start, chunk)
        output.write(file, offset + start, chunk)


BACKENDS = ("posix", "mpiio")


def open_output(
    kind: str,
    comm: Comm,
    paths: Sequence[str],
    headers: Sequence[bytes],
    sizes: Sequence[int],
    hints: Mapping[str, str] | None = None,
    preallocated: bool = False,
    owner: int = 0,
    durable: bool = True,
) -> PosixOutput | MpiioOutput:
    """An output backend; ``preallocated`` outputs already exist with their layout (HDF5) and are only opened.

    ``owner`` creates the posix outputs (the rank whose disk holds them with ``gather_to``);
    ``durable=False`` skips flushing to stable storage.
    """
    if kind == "posix":
        return PosixOutput(comm, paths, headers, sizes, preallocated, durable, owner=owner)
    if kind == "mpiio":
        return MpiioOutput(comm, paths, headers, sizes, preallocated, durable, hints=hints)
    raise ValueError(f"unknown I/O backend {kind!r} (choose from {', '.join(BACKENDS)})")
