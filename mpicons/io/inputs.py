"""Where the checkpoint is read from: a directory or an ``s3://bucket/prefix`` (no MPI here).

An :class:`InputStore` lists the input files of one location, opens one as a
:class:`~mpicons.formats.byte_sources.ByteSource` for the header readers, and gives the engine its
source files (:class:`~mpicons.io.sources.SourceFiles`: ``read_into`` / ``path`` / ``close``). The
scan and the writers ask the store, never the filesystem, so an object store is one more store
(:mod:`mpicons.io.s3_sources`, imported only for an ``s3://`` location).
"""

from __future__ import annotations

import builtins
import os
import re
from collections.abc import Sequence
from typing import Protocol

from ..core.errors import InputError
from ..core.names import METADATA_NAME
from ..formats.byte_sources import ByteSource, PosixSource
from ..formats.shard_headers import INPUT_SUFFIXES, list_shards
from .s3 import is_s3
from .sources import SourceFiles


class InputStore(Protocol):
    """The input files of one location (a directory, a bucket's prefix)."""

    #: The directory or URL, for messages.
    location: str
    #: Every rank sees the same files (an object store): one rank lists them. False: each host lists
    #: what it sees (node-local disks), and the listings are merged.
    shared: bool

    def path(self, name: str) -> str:
        """The path or URL of input file ``name``, for messages."""
        ...

    def check_access(self) -> None:
        """Bad input (InputError) when the location cannot be read at all: before any work."""
        ...

    def list(self) -> tuple[list[str], list[int]]:
        """The input files' names and sizes: ``*.safetensors``, ``*.distcp``, and ``.metadata`` first when there is one."""
        ...

    def open(self, name: str, size: int | None = None) -> ByteSource:
        """Input file ``name`` for ranged reads; ``size`` is its listed size (an object store needs it)."""
        ...

    def list_suffixed(self, suffixes: tuple[str, ...]) -> tuple[builtins.list[str], builtins.list[int]]:
        """The files (names and sizes) directly in the location whose names end with one of ``suffixes``,
        sorted: the per-rank archives of a trainer's checkpoint and what lies beside them."""
        ...

    def nested(self) -> builtins.list[str]:
        """The subdirectories (sub-prefixes) directly below that hold input files, by name: a bounded look,
        for the hint when the location itself holds none (``ckpt/`` given for ``ckpt/sharded/``)."""
        ...

    def sources(self, names: Sequence[str]) -> SourceFiles:
        """The engine's source files: ``names`` by their index (the scan's file ids)."""
        ...


class PosixInputs:
    """A directory of a filesystem (each rank's own when ``{rank}`` was resolved in it)."""

    shared = False

    def __init__(self, directory: str) -> None:
        self.location = directory

    def path(self, name: str) -> str:
        return os.path.join(self.location, name)

    def check_access(self) -> None:
        """Nothing to check beforehand: listing the directory says what is wrong with it."""

    def list(self) -> tuple[list[str], list[int]]:
        """The directory's input files (which of them is the checkpoint is decided once every rank's
        listing is in: node-local disks may hold ``.metadata`` on one node)."""
        names = list_shards(self.location, allow_empty=True, suffixes=INPUT_SUFFIXES)
        if os.path.isfile(self.path(METADATA_NAME)):
            names.insert(0, METADATA_NAME)
        return names, [os.path.getsize(self.path(n)) for n in names]

    def open(self, name: str, size: int | None = None) -> ByteSource:
        return PosixSource(self.path(name))

    def list_suffixed(self, suffixes: tuple[str, ...]) -> tuple[builtins.list[str], builtins.list[int]]:
        names = list_shards(self.location, allow_empty=True, suffixes=suffixes)
        return names, [os.path.getsize(self.path(n)) for n in names]

    def nested(self) -> builtins.list[str]:
        try:
            below = sorted(e.name for e in os.scandir(self.location) if not e.name.startswith(".") and e.is_dir())
        except OSError:
            return []
        return [name for name in below[:NESTED_LOOKS] if PosixInputs(self.path(name)).holds_inputs()]

    def holds_inputs(self) -> bool:
        try:
            return bool(self.list()[0])
        except (InputError, OSError):
            return False

    def sources(self, names: Sequence[str]) -> SourceFiles:
        return SourceFiles(self.location, names)


#: Subdirectories looked into for the hint of :meth:`InputStore.nested` (a directory of many runs is not read whole).
NESTED_LOOKS = 64
#: A rank number in a ``{rank}`` path, as ``str(rank)`` writes it (no sign, no leading zero).
_RANK_NUMBER = "(0|[1-9][0-9]*)"
#: Ranks probed one by one beyond the job's when the directory holding the ``{rank}`` directories cannot be listed.
PROBED_RANKS = 8


def rank_directory(input_dir: str, rank: int) -> str:
    """``input_dir`` with ``{rank}`` replaced: each rank's own directory of node-local shards."""
    return input_dir.replace("{rank}", str(rank))


def rank_directories_beyond(input_dir: str, ranks: int) -> list[tuple[int, str]]:
    """The directories a ``{rank}`` path names for ranks ``ranks`` and above that exist here, sorted by rank.

    The directory holding the first ``{rank}`` component is listed once (``/local/ckpt-{rank}``: ``/local``)
    and the names matching the pattern kept; if it cannot be listed, the next few ranks are probed.
    """
    parts = input_dir.split(os.sep)
    at = next(i for i, part in enumerate(parts) if "{rank}" in part)
    parent = os.sep.join(parts[:at]) or (os.sep if input_dir.startswith(os.sep) else os.curdir)
    pattern = re.compile("^" + _RANK_NUMBER.join(re.escape(text) for text in parts[at].split("{rank}")) + "$")
    try:
        numbers = sorted({int(m.group(1)) for m in map(pattern.match, os.listdir(parent)) if m and len(set(m.groups())) == 1})
    except OSError:
        numbers = list(range(ranks, ranks + PROBED_RANKS))
    return [(n, rank_directory(input_dir, n)) for n in numbers if n >= ranks and os.path.isdir(rank_directory(input_dir, n))]


def open_inputs(location: str, endpoint: str | None = None) -> InputStore:
    """The store of ``location``: an ``s3://`` URL (``endpoint``: the S3 API's, else boto3's own
    variables), else a directory ({rank} already resolved)."""
    if is_s3(location):
        from .s3_sources import S3Inputs

        return S3Inputs(location, endpoint)
    return PosixInputs(location)


__all__ = ["InputStore", "PosixInputs", "open_inputs", "rank_directory", "rank_directories_beyond"]
