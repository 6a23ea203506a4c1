"""Continuing a stopped run: the run's identity, agreed over the ranks, and the writer's record of
what is durable (:mod:`mpicons.io.resume` keeps both on disk).

A rerun continues only what an identical run left: same mpicons version, same options that decide
the output, same output layout, and the same inputs (each file's size, modification time and first
64 KiB). Only a job whose blocks the plain writer writes can be continued: a shared input, the
posix backend, safetensors output, flushed writes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import fields

from ..comm.agreement import Comm, agree
from ..core.layout import Layout
from ..core.options import Options, Publishing, Selection
from ..core.version import __version__
from ..io.resume import BlockLog, DoneRanges, RunIdentity, digest_of
from ..io.s3 import is_s3
from .scan import Scanned

#: Bytes a rank writes between two records of what is durable (each costs one flush of its outputs):
#: a stopped run loses at most about this much per rank.
RECORD_EVERY = 512 << 20
#: The first bytes of every input file that go into the identity (its header, for a shard).
HEAD_BYTES = 64 << 10
#: Options that decide how a run goes, not what it writes.
_NOT_IDENTITY = {"force", "break_lock", "restart", "manifest", "sync"}


def resumable(scanned: Scanned, options: Options) -> bool:
    """Whether this job's blocks are recorded as they become durable (see the module's docstring)."""
    return (
        options.sync
        and options.io == "posix"
        and options.output_format == "safetensors"
        and options.gather_to is None
        and scanned.shared
        and not is_s3(scanned.directory)
    )


def run_identity(comm: Comm, scanned: Scanned, layout: Layout, options: Options) -> RunIdentity | None:
    """This run's identity (collective: the input files are looked at spread over the ranks); None
    when the job cannot be continued."""
    if not agree(comm, lambda: resumable(scanned, options)):
        return None
    names = scanned.files.names

    def look() -> list[tuple[int, str, int, int, str]]:
        return [_file_facts(i, os.path.join(scanned.directory, names[i])) for i in range(comm.rank, len(names), comm.size)]

    seen = sorted(entry for part in agree(comm, look, gather=True) for entry in part)
    chosen = [(f.name, repr(getattr(options, f.name))) for group in (Selection, Publishing) for f in fields(group)]
    return RunIdentity(
        version=__version__,
        options=digest_of(entry for entry in chosen if entry[0] not in _NOT_IDENTITY),
        inputs=digest_of([*seen, *agree(comm, lambda: _adapter_facts(options.lora))]),
        layout=digest_of((f.name, f.size, hashlib.sha256(f.header).hexdigest()) for f in layout.files),
    )


def _file_facts(index: int, path: str) -> tuple[int, str, int, int, str]:
    """What stands for one input file's content: size, modification time, its first bytes."""
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        head = handle.read(HEAD_BYTES)
    return index, os.path.basename(path), info.st_size, info.st_mtime_ns, hashlib.sha256(head).hexdigest()


def _adapter_facts(folder: str | os.PathLike[str] | None) -> list[tuple[int, str, int, int, str]]:
    """A ``--lora`` folder's files, which the merged weights depend on."""
    if folder is None or is_s3(folder) or not os.path.isdir(folder):
        return []
    directory = os.fspath(folder)
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    return [_file_facts(-1, os.path.join(directory, name)) for name in names]


class Resume:
    """What a rank's writer skips (durable already) and records (durable now), and the bytes it skipped."""

    def __init__(self, done: DoneRanges, log: BlockLog, flusher: Callable[[], Callable[[], None]]) -> None:
        self.done = done
        self.log = log
        self.flusher = flusher  # what flushes the outputs open now (``PosixOutput.flusher``)
        self.resumed = 0
        self.since_record = 0

    def skip(self, file: int, offset: int, length: int) -> bool:
        """Whether an earlier run's durable bytes hold this range already (then counted as resumed)."""
        if self.done.covers(file, offset, length):
            self.resumed += length
            return True
        return False

    def wrote(self, file: int, offset: int, length: int) -> bool:
        """Note a range submitted for writing; True when enough has been written since the last record."""
        self.log.wrote(file, offset, length)
        self.since_record += length
        if self.since_record < RECORD_EVERY:
            return False
        self.since_record = 0
        return True

    def record_task(self) -> Callable[[], None]:
        """What records the ranges noted so far: their bytes flushed, then the ranges appended to the log."""
        ranges, flush = self.log.take(), self.flusher()

        def record() -> None:
            flush()
            self.log.append(ranges)

        return record


__all__ = ["Resume", "RunIdentity", "run_identity", "resumable", "RECORD_EVERY"]
