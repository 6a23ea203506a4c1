"""Executing byte moves: reading shard files and writing preallocated outputs.

Two output backends with one interface: ``posix`` (pwrite, ``os.copy_file_range``) and
``mpiio`` (``MPI.File`` opened on the communicator, ``Write_at``, ROMIO hints). Every single
transfer stays below 2 GiB, the C ``int`` limit of many MPI builds and of some kernels.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np
from mpi4py import MPI

from .errors import WriteError
from .parallel import Comm

#: Largest single read, write or copy_file_range call.
MAX_TRANSFER = 1 << 30
#: Output files a rank keeps open at once (per backend), so thousands of outputs never exhaust descriptors.
MAX_OPEN_OUTPUTS = 128
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
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


class OutputBackend(Protocol):
    """What the writers need of an output backend (posix and mpiio implement it)."""

    name: str
    #: Whether writes may be issued from background threads.
    threaded: bool
    #: Called before a handle is closed to make room (the writer drains its background I/O there).
    before_close: Callable[[], None]

    def create(self) -> None: ...
    def open(self, file: int) -> None: ...
    def write(self, file: int, offset: int, data: memoryview) -> None: ...
    def copy(self, sources: "SourceFiles", src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...
    def hints_in_effect(self) -> dict[str, str]: ...


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
    threaded = True

    def __init__(self, *args: object, owner: int = 0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.owner = owner
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._copy_range = hasattr(os, "copy_file_range")
        #: Open output handles are bounded whatever the number of output files.
        self.max_open = MAX_OPEN_OUTPUTS
        #: Called before a handle is closed to make room, so background I/O never loses its file.
        self.before_close: Callable[[], None] = lambda: None

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
                if self.durable:
                    os.fsync(fd)
            except OSError as exc:
                raise WriteError(f"{path}: cannot size output to {size} bytes ({exc.strerror})") from None
            finally:
                os.close(fd)

    def hints_in_effect(self) -> dict[str, str]:
        return {}

    def open(self, file: int) -> None:
        """Open output ``file`` now (from the main thread, before background writes use it)."""
        self._fd(file)

    def _fd(self, file: int) -> int:
        fd = self._fds.get(file)
        if fd is not None:
            self._fds.move_to_end(file)
            return fd
        try:
            fd = os.open(self.paths[file], os.O_WRONLY | _NOFOLLOW)
        except OSError as exc:
            raise WriteError(f"{self.paths[file]}: cannot open output ({exc.strerror})") from None
        self._fds[file] = fd
        if len(self._fds) > self.max_open:
            self.before_close()
            self._retire(*self._fds.popitem(last=False))
        return fd

    def _retire(self, file: int, fd: int) -> None:
        """Close a handle; what was written through it is flushed first when outputs must be durable."""
        try:
            if self.durable:
                os.fsync(fd)
        except OSError as exc:
            raise WriteError(f"{self.paths[file]}: fsync failed ({exc.strerror})") from None
        finally:
            os.close(fd)

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
        """Flush what this rank wrote (handles closed earlier were flushed when they were closed)."""
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
    """Outputs created collectively with ``MPI.File`` on the communicator (hints such as striping apply
    there), then written with independent ``Write_at`` through per-rank handles opened when needed
    (at most ``MAX_OPEN_OUTPUTS`` at once)."""

    name = "mpiio"
    threaded = False

    def __init__(self, *args: object, hints: Mapping[str, str] | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hints = dict(hints or {})
        self._files: OrderedDict[int, MPI.File] = OrderedDict()
        self._in_effect: dict[str, str] = {}
        self.before_close: Callable[[], None] = lambda: None

    def _info(self) -> MPI.Info:
        info = MPI.Info.Create()
        for key, value in self.hints.items():
            info.Set(key, value)
        return info

    def create(self) -> None:
        """Collectively create every output exclusively, size it and write its header (rank 0), one at a time."""
        info = self._info()
        try:
            for path, header, size in zip(self.paths, self.headers, self.sizes):
                try:
                    mode = MPI.MODE_WRONLY | (0 if self.preallocated else MPI.MODE_CREATE | MPI.MODE_EXCL)
                    handle = MPI.File.Open(self.comm, path, mode, info)
                except MPI.Exception as exc:
                    raise WriteError(f"{path}: cannot create output with MPI-IO ({mpi_error_text(exc)})") from None
                try:
                    if not self._in_effect:
                        self._in_effect = _info_items(handle)
                    if not self.preallocated:
                        handle.Set_size(size)
                        if self.comm.rank == 0:
                            handle.Write_at(0, header)
                except MPI.Exception as exc:
                    raise WriteError(f"{path}: cannot size output with MPI-IO ({mpi_error_text(exc)})") from None
                finally:
                    handle.Close()
        finally:
            info.Free()

    def hints_in_effect(self) -> dict[str, str]:
        """The hints the MPI library reported for the first output (unknown hints are dropped silently)."""
        return dict(self._in_effect)

    def _handle(self, file: int) -> MPI.File:
        handle = self._files.get(file)
        if handle is not None:
            self._files.move_to_end(file)
            return handle
        info = self._info()
        try:
            handle = MPI.File.Open(MPI.COMM_SELF, self.paths[file], MPI.MODE_WRONLY, info)
        except MPI.Exception as exc:
            raise WriteError(f"{self.paths[file]}: cannot open output with MPI-IO ({mpi_error_text(exc)})") from None
        finally:
            info.Free()
        self._files[file] = handle
        if len(self._files) > MAX_OPEN_OUTPUTS:
            self.before_close()
            old, retired = self._files.popitem(last=False)
            self._sync_one(old, retired)
            retired.Close()
        return handle

    def open(self, file: int) -> None:
        self._handle(file)

    def write(self, file: int, offset: int, data: memoryview) -> None:
        handle = self._handle(file)
        for start in range(0, len(data), MAX_TRANSFER):
            try:
                handle.Write_at(offset + start, data[start : start + MAX_TRANSFER])
            except MPI.Exception as exc:
                raise WriteError(f"{self.paths[file]}: write failed at byte {offset + start} ({mpi_error_text(exc)})") from None

    def copy(self, sources: SourceFiles, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray) -> None:
        _bounce_copy(self, sources, src, src_offset, file, offset, length, bounce)

    def _sync_one(self, file: int, handle: MPI.File) -> None:
        if not self.durable:
            return
        try:
            handle.Sync()
        except MPI.Exception as exc:
            raise WriteError(f"{self.paths[file]}: sync failed ({mpi_error_text(exc)})") from None

    def sync(self) -> None:
        for file, handle in self._files.items():
            self._sync_one(file, handle)

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].Close()


def _info_items(handle: MPI.File) -> dict[str, str]:
    info = handle.Get_info()
    try:
        return {info.Get_nthkey(i): info.Get(info.Get_nthkey(i)) or "" for i in range(info.Get_nkeys())}
    finally:
        info.Free()


#: MPI error classes with a plain cause; others are reduced to the innermost line of the MPI error stack.
_MPI_CAUSES = {
    "ERR_NO_SPACE": "No space left on device",
    "ERR_QUOTA": "Disk quota exceeded",
    "ERR_READ_ONLY": "Read-only file system",
    "ERR_ACCESS": "Permission denied",
    "ERR_FILE_EXISTS": "File exists",
    "ERR_NO_SUCH_FILE": "No such file or directory",
    "ERR_FILE_IN_USE": "File in use",
}


def mpi_error_text(exc: MPI.Exception) -> str:
    """One line for an MPI error: the cause, not MPICH's multi-line error stack."""
    error_class = exc.Get_error_class()
    for name, text in _MPI_CAUSES.items():
        if error_class == getattr(MPI, name, None):
            return text
    lines = [line.strip(" ,") for line in exc.Get_error_string().splitlines() if line.strip()]
    return lines[-1] if lines else f"MPI error class {error_class}"


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
