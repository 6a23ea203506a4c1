"""``SHA256SUMS``: the checksums of every file a run publishes, in ``sha256sum``'s format.

One line per file, ``<64 hex digits>  <name>`` (two spaces; ``name`` relative to the output
directory, ``/`` between folders), sorted by name, so ``sha256sum -c SHA256SUMS`` run inside the
directory checks it. Written with the weights and published in the same transaction; read by
``mpicons verify OUT``. Files are hashed in large reads through one reused buffer.

No MPI here: :mod:`mpicons.job.checksums` spreads the hashing over the ranks.
"""

from __future__ import annotations

import hashlib
import heapq
import mmap
import os
import re
from collections.abc import Iterable, Sequence

from ..core.errors import WriteError
from .regular_files import NotRegular, kind_of, open_regular

MANIFEST_NAME = "SHA256SUMS"
#: Bytes read per step while hashing (a reused buffer: memory per rank stays this, whatever the file).
HASH_STEP = 8 << 20
#: The largest manifest verify reads (a million files' lines).
MANIFEST_LIMIT = 1 << 27
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")


def format_manifest(digests: dict[str, str]) -> bytes:
    """The manifest's bytes: ``name → hex digest``, one line each, sorted by name."""
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests)).encode()


def manifest_name_problem(name: str) -> str | None:
    """Why ``name`` cannot stand in a manifest (absolute, ``..``, empty parts, control characters), or None."""
    if not name or name.startswith("/") or "\\" in name or not name.isprintable():
        return "it is not a plain relative path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "it leaves the directory or has an empty part"
    return None


def parse_manifest(raw: bytes) -> dict[str, str] | str:
    """``name → lowercase hex digest`` from a manifest's bytes, or why it is not one (pure)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "it is not UTF-8 text"
    digests: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            return f"line {number} is not '<64 hex digits>  <file name>'"
        digest, name = match.group(1).lower(), match.group(2)
        problem = manifest_name_problem(name)
        if problem is not None:
            return f"line {number} names {name!r}: {problem}"
        if name in digests:
            return f"line {number} lists {name!r} a second time"
        digests[name] = digest
    if not digests:
        return "it lists no files"
    return digests


def hash_file(path: str, buffer: memoryview | None = None, follow_links: bool = False) -> str:
    """The SHA-256 of the regular file ``path`` (never through a link unless ``follow_links``), read in
    large steps into ``buffer``; an unreadable file is a :class:`WriteError` naming it."""
    view = buffer if buffer is not None else memoryview(bytearray(HASH_STEP))
    digest = hashlib.sha256()
    try:
        fd = open_regular(path, follow_links)
    except NotRegular as exc:  # a link (not followed), a FIFO, a device: never read
        raise WriteError(f"{path}: is {kind_of(exc.mode)}, not a regular file; not hashed") from None
    except OSError as exc:
        raise WriteError(f"{path}: cannot open to hash it ({exc.strerror})") from None
    try:
        offset = 0
        while True:
            got = os.preadv(fd, [view], offset)
            if got == 0:
                return digest.hexdigest()
            digest.update(view[:got])
            offset += got
    except OSError as exc:
        raise WriteError(f"{path}: cannot read to hash it ({exc.strerror})") from None
    finally:
        os.close(fd)


def hash_own_file(path: str) -> str:
    """The SHA-256 of a file this run wrote and nobody else changes (a staged output), hashed through
    read-only mappings of HASH_STEP bytes at a time: no copy of its pages, and no more of them mapped at
    once than a read buffer would hold (a file truncated meanwhile would fault, so never for files others
    may change: :func:`hash_file` reads those)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            for offset in range(0, size, HASH_STEP):
                length = min(HASH_STEP, size - offset)
                with mmap.mmap(handle.fileno(), length, prot=mmap.PROT_READ, offset=offset) as window:
                    digest.update(window)
    except OSError as exc:
        raise WriteError(f"{path}: cannot read to hash it ({exc.strerror})") from None
    return digest.hexdigest()


def spread_by_bytes(sizes: Sequence[int], ranks: int) -> list[int]:
    """Which rank hashes each file: largest first, each to the rank with the fewest bytes so far
    (pure and deterministic: every rank computes the same)."""
    loads = [(0, rank) for rank in range(ranks)]  # a heap of (bytes so far, rank)
    owners = [0] * len(sizes)
    for file in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owners[file] = rank
        heapq.heappush(loads, (load + sizes[file], rank))
    return owners


def files_below(directory: str, names: Iterable[str]) -> list[str]:
    """``names`` (entries of ``directory``) with every folder among them replaced by the files inside it,
    as ``folder/file`` (a folder's files are hashed and listed one by one)."""
    found: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            found += files_below(directory, [f"{name}/{entry}" for entry in sorted(os.listdir(path))])
        else:
            found.append(name)
    return found


__all__ = [
    "MANIFEST_NAME",
    "HASH_STEP",
    "MANIFEST_LIMIT",
    "format_manifest",
    "parse_manifest",
    "manifest_name_problem",
    "hash_file",
    "hash_own_file",
    "spread_by_bytes",
    "files_below",
]
