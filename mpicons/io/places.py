"""Where a checkpoint was given, as the trainers look at it (no MPI here): a directory of this machine
(:class:`LocalPlace`) or an ``s3://`` prefix (:class:`~mpicons.io.s3_sources.S3Place`).

A trainer recognises its checkpoints by the names in a location, a small file or two (a tracker
naming the newest step, a backend record) and the folders beside them. A :class:`Place` gives
exactly that, read-only, so that one trainer leaf reads a run directory on a filesystem and the
same run uploaded to a bucket.
"""

from __future__ import annotations

import os
from typing import Protocol

from ..core.errors import InputError
from ..formats.byte_sources import ByteSource, PosixSource
from .regular_files import NotRegular, kind_of, open_regular, read_bounded

#: The largest small file of a checkpoint read (a tracker, a config).
SMALL_FILE = 1 << 20


class Place(Protocol):
    """A read-only location: a directory, or a prefix of an object store."""

    #: The path or URL, for messages and for the scan of a checkpoint found here.
    path: str
    #: Its last component (``iter_0000010``, ``actor``).
    name: str

    def entries(self) -> list[str]:
        """The names of the files and folders directly in it, sorted (none when it cannot be listed)."""
        ...

    def is_file(self, name: str) -> bool:
        """Whether ``name`` is a file directly in it."""
        ...

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a folder directly in it (on object storage: a prefix holding objects)."""
        ...

    def child(self, name: str) -> Place:
        """The folder ``name`` in it."""
        ...

    def parent(self) -> Place:
        """The folder holding it."""
        ...

    def join(self, name: str) -> str:
        """The path or URL of ``name`` in it, for messages."""
        ...

    def read_small(self, name: str, what: str, limit: int = SMALL_FILE) -> bytes:
        """File ``name`` (at most ``limit`` bytes), described as ``what`` in errors."""
        ...

    def open(self, name: str) -> ByteSource:
        """File ``name`` for ranged reads (the caller closes it)."""
        ...


def read_small(path: str, what: str, named: str | None = None, limit: int = SMALL_FILE) -> bytes:
    """A small file (at most ``limit`` bytes: a tracker, a config, a rule file), opened only as a regular
    file (links followed); errors call it ``named`` (default: its path) and say it is not ``what``."""
    named = path if named is None else named
    try:
        fd = open_regular(path, follow_links=True)
    except NotRegular as exc:
        raise InputError(f"{named}: {kind_of(exc.mode)}, not {what}") from None
    except OSError as exc:
        raise InputError(f"{named}: cannot read {what} ({exc.strerror})") from None
    try:
        data = read_bounded(fd, limit)
    finally:
        os.close(fd)
    if data is None:
        raise InputError(f"{named}: larger than {limit >> 20} MiB, not {what}")
    return data


class LocalPlace:
    """A directory of this machine."""

    def __init__(self, directory: str) -> None:
        self.path = directory
        self.name = os.path.basename(os.path.normpath(directory))

    def entries(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except OSError:
            return []

    def is_file(self, name: str) -> bool:
        return os.path.isfile(self.join(name))

    def is_dir(self, name: str) -> bool:
        return os.path.isdir(self.join(name))

    def child(self, name: str) -> LocalPlace:
        return LocalPlace(self.join(name))

    def parent(self) -> LocalPlace:
        return LocalPlace(os.path.dirname(os.path.normpath(self.path)))

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_small(self, name: str, what: str, limit: int = SMALL_FILE) -> bytes:
        return read_small(self.join(name), what, limit=limit)

    def open(self, name: str) -> ByteSource:
        return PosixSource(self.join(name))


__all__ = ["SMALL_FILE", "LocalPlace", "Place", "read_small"]
