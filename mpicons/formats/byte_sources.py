"""Random access to one input file, wherever it is stored (no MPI here).

The header readers (:mod:`~mpicons.formats.shard_headers`, :mod:`~mpicons.formats.distcp_metadata`,
:mod:`~mpicons.formats.distcp_items`) read through a :class:`ByteSource`, so the same code reads a file
on a filesystem (:class:`PosixSource`: ``pread``) and an object in a bucket (the S3 source of
:mod:`mpicons.io.s3_sources`: ranged GETs). Every read costs a system call or a request, so the
readers ask for few, large ranges: callers pass what they will need at once, never byte by byte.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ..core.errors import InputError

#: Largest single ``pread`` (Linux moves at most about 2 GiB per call).
_MAX_PREAD = 1 << 30


class ByteSource(Protocol):
    """One input file's bytes: its name for messages (a path or an ``s3://`` URL), its size, ranged reads."""

    name: str
    size: int

    def read_at(self, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset``; fewer only where the source ends."""
        ...

    def close(self) -> None: ...


class SeekableBytes(io.RawIOBase):
    """A stretch of bytes as a seekable, read-only file, for the libraries that take files (zipfile,
    botocore, which rewinds a body when it retries); a subclass says how bytes at a position are copied."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self._length, self._position = length, 0

    def __len__(self) -> int:
        return self._length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the bytes")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        count = max(0, min(len(target), self._length - self._position))
        copied = self._copy(self._position, target[:count]) if count else 0
        self._position += copied
        return copied

    def _copy(self, at: int, target: memoryview) -> int:
        """Copy the bytes at ``at`` into ``target``; how many there were."""
        raise NotImplementedError


class SourceWindow(SeekableBytes):
    """Bytes ``[start, start + length)`` of a source as a seekable file of their own (for zipfile)."""

    def __init__(self, source: ByteSource, start: int, length: int) -> None:
        super().__init__(length)
        self._source, self._start = source, start

    def _copy(self, at: int, target: memoryview) -> int:
        data = self._source.read_at(self._start + at, len(target))
        target[: len(data)] = data
        return len(data)


class MemoryBytes(SeekableBytes):
    """Bytes in memory as a seekable file, without copying them first (botocore takes bytes or a file, not a memoryview)."""

    def __init__(self, view: memoryview) -> None:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        super().__init__(len(view))
        self._view = view

    def _copy(self, at: int, target: memoryview) -> int:
        target[:] = self._view[at : at + len(target)]
        return len(target)

    def read(self, size: int | None = -1) -> bytes:
        end = self._length if size is None or size < 0 else min(self._length, self._position + size)
        start, self._position = self._position, max(self._position, end)
        return bytes(self._view[start:end])


#: Opens an input by its file name (inside the location a reader was given).
Opener = Callable[[str], ByteSource]


class PosixSource:
    """A file on a filesystem, read with ``pread`` through one read-only descriptor."""

    def __init__(self, path: str) -> None:
        self.name = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise InputError(f"{path}: cannot read ({exc.strerror})") from None
        try:
            self.size = os.fstat(self._fd).st_size
        except OSError as exc:
            os.close(self._fd)
            raise InputError(f"{path}: cannot read ({exc.strerror})") from None

    def read_at(self, offset: int, length: int) -> bytes:
        parts, done = [], 0
        while done < length:
            try:
                got = os.pread(self._fd, min(length - done, _MAX_PREAD), offset + done)
            except OSError as exc:
                raise InputError(f"{self.name}: cannot read at byte {offset + done} ({exc.strerror})") from None
            if not got:
                break
            parts.append(got)
            done += len(got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PosixSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def opened(source: ByteSource | str) -> Iterator[ByteSource]:
    """``source`` itself (its owner closes it), or the file at a path, opened here and closed after."""
    if not isinstance(source, str):
        yield source
        return
    with PosixSource(source) as posix:
        yield posix


def posix_opener(directory: str) -> Opener:
    """Opens the files of a directory as :class:`PosixSource`."""
    return lambda name: PosixSource(os.path.join(directory, name))


__all__ = ["ByteSource", "MemoryBytes", "Opener", "PosixSource", "SeekableBytes", "SourceWindow", "opened", "posix_opener"]
