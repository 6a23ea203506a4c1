"""What a stopped run leaves for the same command to continue from, and what a rerun may trust.

A resumable run's staging directory holds, beside the staged weights:

- ``.resume.json``: the run's :class:`RunIdentity` (mpicons version, options, inputs, output layout,
  each as a digest), written durably only once every output file exists with its header and size;
- ``.blocks-TOKEN-RANK``: each rank's append-only log of byte ranges of the staged files that are
  durable. Write-ahead order: a range is appended (and the log flushed) only after its bytes were
  flushed. Every record carries its own check, so a torn last record is ignored, never trusted.

A rerun keeps such a directory only when its identity equals the rerun's; it then skips every block
the logs cover. No MPI here: the owner rank reads and adopts; each rank writes its own log.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields

from ..core.errors import WriteError
from .regular_files import fsync_directory, read_own_file, write_new_file

RESUME_NAME = ".resume.json"
BLOCKS_PREFIX = ".blocks-"
#: One record: output file, offset, length, and the first 8 bytes of the SHA-256 of those 20 bytes.
_RECORD = struct.Struct("<IQQ8s")
_BODY = struct.Struct("<IQQ")
_RESUME_LIMIT = 1 << 16
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class RunIdentity:
    """What makes two runs the same job: equal identities write equal bytes to equal places."""

    version: str
    options: str
    inputs: str
    layout: str

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes) -> RunIdentity | None:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        names = [f.name for f in fields(cls)]
        if not isinstance(obj, dict) or sorted(obj) != sorted(names) or not all(isinstance(obj[n], str) for n in names):
            return None
        return cls(**obj)

    def difference(self, earlier: RunIdentity) -> str | None:
        """Why an ``earlier`` run's blocks cannot be trusted by this one, in a few words; None: they can."""
        if earlier.version != self.version:
            return f"it was made by mpicons {earlier.version}, this is {self.version}"
        if earlier.inputs != self.inputs:
            return "the input files changed since (size, modification time or first bytes)"
        if earlier.options != self.options:
            return "it was made with other options"
        if earlier.layout != self.layout:
            return "its output files are laid out differently"
        return None


def digest_of(parts: Iterable[object]) -> str:
    """A short stable digest of a sequence of printable values."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(repr(part).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()[:32]


def write_identity(staging: str, identity: RunIdentity) -> None:
    """Mark ``staging`` resumable: call once its files exist, sized, with their headers flushed."""
    fsync_directory(staging)
    write_new_file(os.path.join(staging, RESUME_NAME), identity.to_bytes(), durable=True)
    fsync_directory(staging)


def read_identity(staging: str) -> RunIdentity | None:
    """The identity a staging directory was marked with; None: not resumable (no mark, or not one mpicons wrote)."""
    try:
        found = read_own_file(os.path.join(staging, RESUME_NAME), _RESUME_LIMIT)
    except OSError:
        return None
    if found is None or found.kind != "regular file":
        return None
    return RunIdentity.parse(found.data)


def pack_records(ranges: Iterable[tuple[int, int, int]]) -> bytes:
    """Records of ``(file, offset, length)`` ranges, each with its check."""
    out = bytearray()
    for file, offset, length in ranges:
        body = _BODY.pack(file, offset, length)
        out += body + hashlib.sha256(body).digest()[:8]
    return bytes(out)


def unpack_records(raw: bytes) -> list[tuple[int, int, int]]:
    """The records of a log whose check holds; reading stops at the first that does not (a torn end)."""
    ranges = []
    for start in range(0, len(raw) - _RECORD.size + 1, _RECORD.size):
        file, offset, length, check = _RECORD.unpack_from(raw, start)
        if hashlib.sha256(raw[start : start + _BODY.size]).digest()[:8] != check:
            break
        ranges.append((file, offset, length))
    return ranges


class DoneRanges:
    """The durable byte ranges of each output file, merged: a block is skipped only when fully inside one."""

    def __init__(self, ranges: Iterable[tuple[int, int, int]], sizes: Sequence[int]) -> None:
        per_file: dict[int, list[tuple[int, int]]] = {}
        for file, offset, length in ranges:
            if 0 <= file < len(sizes) and length > 0 and offset + length <= sizes[file]:
                per_file.setdefault(file, []).append((offset, offset + length))
        self.begins: dict[int, list[int]] = {}
        self.ends: dict[int, list[int]] = {}
        for file, spans in per_file.items():
            merged: list[list[int]] = []
            for begin, end in sorted(spans):
                if merged and begin <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([begin, end])
            self.begins[file] = [b for b, _ in merged]
            self.ends[file] = [e for _, e in merged]

    def covers(self, file: int, offset: int, length: int) -> bool:
        begins = self.begins.get(file)
        if not begins:
            return False
        at = bisect_right(begins, offset) - 1
        return at >= 0 and self.ends[file][at] >= offset + length

    @property
    def total(self) -> int:
        return sum(e - b for file in self.begins for b, e in zip(self.begins[file], self.ends[file]))


def read_done(staging: str, sizes: Sequence[int]) -> DoneRanges:
    """Every rank's log of an adopted staging directory, merged (records outside the files ignored)."""
    ranges: list[tuple[int, int, int]] = []
    for entry in sorted(os.scandir(staging), key=lambda e: e.name):
        if entry.name.startswith(BLOCKS_PREFIX) and entry.is_file(follow_symlinks=False):
            with open(entry.path, "rb") as handle:
                ranges += unpack_records(handle.read())
    return DoneRanges(ranges, sizes)


class BlockLog:
    """One rank's log of durable ranges: ranges are noted as written and appended once flushed."""

    def __init__(self, staging: str, token: str, rank: int) -> None:
        self.path = os.path.join(staging, f"{BLOCKS_PREFIX}{token}-{rank}")
        self.fd: int | None = None
        self.pending: list[tuple[int, int, int]] = []

    def wrote(self, file: int, offset: int, length: int) -> None:
        self.pending.append((file, offset, length))

    def take(self) -> list[tuple[int, int, int]]:
        """The ranges noted since the last take (to be appended after their bytes are flushed)."""
        taken, self.pending = self.pending, []
        return taken

    def append(self, ranges: list[tuple[int, int, int]]) -> None:
        """Append records of ranges whose bytes are already durable, and flush them."""
        if not ranges:
            return
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o644)
                fsync_directory(os.path.dirname(self.path))
            os.write(self.fd, pack_records(ranges))
            os.fsync(self.fd)
        except OSError as exc:
            raise WriteError(f"{self.path}: cannot record the blocks written ({exc.strerror})") from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def is_resumable(staging: str) -> bool:
    """A staging directory an earlier run marked resumable and recorded durable blocks in (it may still
    differ from this run): one with nothing durable is not worth keeping."""
    if not os.path.isfile(os.path.join(staging, RESUME_NAME)):
        return False
    try:
        entries = list(os.scandir(staging))
    except OSError:
        return False
    return any(
        e.name.startswith(BLOCKS_PREFIX) and e.is_file(follow_symlinks=False) and e.stat().st_size >= _RECORD.size
        for e in entries
    )


__all__ = [
    "RESUME_NAME",
    "BLOCKS_PREFIX",
    "RunIdentity",
    "digest_of",
    "write_identity",
    "read_identity",
    "pack_records",
    "unpack_records",
    "DoneRanges",
    "read_done",
    "BlockLog",
    "is_resumable",
]
