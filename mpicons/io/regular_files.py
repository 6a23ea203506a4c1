"""Opening files mpicons did not make without trusting them: only regular files, bounded reads.

The output directory (its lock, a journal) and ``verify`` (a checkpoint's index and headers) read
entries someone else may have put there. Opening a FIFO blocks, opening a device may have side
effects and a symbolic link may lead anywhere, so an entry is opened only as a regular file: never
through a link (unless asked), never blocking, and checked again on the descriptor, so an entry
swapped after it was looked at is refused too. New small files are created exclusively, never
through an existing entry.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from .sources import MAX_TRANSFER

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

#: Writes bytes to a descriptor, returning the count written; tests replace it to inject a full disk.
write_bytes: Callable[[int, memoryview], int] = os.write


class NotRegular(Exception):
    """The descriptor opened is not a regular file (the entry changed after it was looked at)."""

    def __init__(self, path: str, mode: int, identity: tuple[int, int]) -> None:
        super().__init__(f"{path}: not a regular file")
        self.mode = mode
        self.identity = identity  # device, inode


def kind_of(mode: int) -> str:
    """What an entry is, as the output directory's messages name it."""
    if stat.S_ISREG(mode):
        return "regular file"
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a device")


def named(path: str, exc: OSError) -> OSError:
    """``exc`` with ``path`` as its file name (a write, fsync or close on a descriptor names none)."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), path)


def open_regular(path: str, follow_links: bool = False) -> int:
    """A read-only descriptor on the regular file at ``path``, opened without blocking.

    A link is never followed unless ``follow_links``; :class:`NotRegular` when what was opened is
    not a regular file (a link met meanwhile counts as one). Look at the entry with ``lstat``
    first: a FIFO or a device must not be opened at all.
    """
    try:
        fd = os.open(path, _READ_FLAGS | (0 if follow_links else _NOFOLLOW))
    except OSError as exc:
        if exc.errno != errno.ELOOP or follow_links:
            raise
        info = os.lstat(path)
        raise NotRegular(path, info.st_mode, (info.st_dev, info.st_ino)) from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise named(path, exc) from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegular(path, info.st_mode, (info.st_dev, info.st_ino))
    return fd


def read_at(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` (fewer only at the end of the file)."""
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, MAX_TRANSFER), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def read_bounded(fd: int, limit: int) -> bytes | None:
    """All of the file behind ``fd`` when it holds at most ``limit`` bytes; None when it holds more
    (it is not the small file it claims to be: an index, a config, a rule file)."""
    data = read_at(fd, limit + 1, 0)
    return None if len(data) > limit else data


@dataclass(frozen=True)
class Found:
    """What is at a path mpicons reads its own small files from (the lock, a journal)."""

    identity: tuple[int, int]  # device, inode
    kind: str  # "regular file", or what else is there ("a FIFO", "a directory", ...)
    data: bytes  # the first bytes of a regular file; empty for anything else


def read_own_file(path: str, limit: int) -> Found | None:
    """The first ``limit`` bytes of the regular file at ``path`` (None if absent), never following a
    link, never blocking on a FIFO and never opening a device: anything else is reported as found."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return Found((info.st_dev, info.st_ino), kind_of(info.st_mode), b"")
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except NotRegular as exc:
        return Found(exc.identity, kind_of(exc.mode), b"")
    try:
        info = os.fstat(fd)
        return Found((info.st_dev, info.st_ino), "regular file", os.read(fd, limit))
    except OSError as exc:
        raise named(path, exc) from None
    finally:
        os.close(fd)


def fsync_directory(path: str) -> None:
    """Make renames and creations in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        raise named(path, exc) from None
    finally:
        os.close(fd)


def write_new_file(path: str, data: bytes, durable: bool = True) -> None:
    """Create ``path`` exclusively (never through an existing entry or link) holding ``data``.

    Any failure (a full disk) names ``path``, and the partly written file is removed again.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[write_bytes(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        try:
            os.unlink(path)  # this run's own, just created
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise named(path, exc) from None
        raise
