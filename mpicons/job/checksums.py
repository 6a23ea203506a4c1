"""SHA-256 of many files, spread over the ranks by bytes: each file hashed whole by one rank.

Used to write ``SHA256SUMS`` right after the weights are written (read back from the page cache)
and by ``verify OUT`` to check one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from ..comm.agreement import Comm, agree
from ..io.manifest import HASH_STEP, hash_file, hash_own_file, spread_by_bytes

if TYPE_CHECKING:
    from ..io.s3 import S3Client

T = TypeVar("T")

#: What a rank does with a file it cannot hash: the path and the error → the digest to report, or raise.
OnError = Callable[[str, Exception], str | None]


def hash_over_ranks(
    comm: Comm,
    paths: Sequence[str],
    sizes: Sequence[int],
    follow_links: bool = False,
    on_error: OnError | None = None,
) -> list[str | None]:
    """Every file's hex SHA-256 (one collective phase; the same list on every rank).

    ``sizes`` spread the files over the ranks (largest first); each rank reads its files in
    :data:`~mpicons.io.manifest.HASH_STEP` steps through one buffer. ``on_error`` turns a file that
    cannot be read into an entry (None: not hashed) instead of a failure of the phase.
    """
    return digests_over_ranks(comm, lambda: hash_share(paths, sizes, comm.rank, comm.size, follow_links, on_error), len(paths))


def digests_over_ranks(comm: Comm, mine: Callable[[], dict[int, T]], count: int) -> list[T]:
    """Each rank's digests by file number (``mine``, one agreed phase), merged into one list on every rank."""
    merged: dict[int, T] = {}
    for part in agree(comm, mine, gather=True):
        merged.update(part)
    return [merged[file] for file in range(count)]


def hash_share(
    paths: Sequence[str],
    sizes: Sequence[int],
    rank: int,
    ranks: int,
    follow_links: bool = False,
    on_error: OnError | None = None,
    own: bool = False,
) -> dict[int, str | None]:
    """The digests of the files ``rank`` of ``ranks`` hashes (no communication: every rank computes the
    same spread), by file number. ``own``: files this run wrote, hashed through a mapping."""
    owners = spread_by_bytes(sizes, ranks)
    buffer = memoryview(bytearray(0 if own else HASH_STEP))
    digests: dict[int, str | None] = {}
    for file, owner in enumerate(owners):
        if owner != rank:
            continue
        try:
            digests[file] = hash_own_file(paths[file]) if own else hash_file(paths[file], buffer, follow_links)
        except Exception as exc:
            if on_error is None:
                raise
            digests[file] = on_error(paths[file], exc)
    return digests


def hash_objects(comm: Comm, client: S3Client, names: Sequence[str], sizes: Sequence[int]) -> list[str]:
    """Every object's hex SHA-256, read back in ranged GETs of HASH_STEP bytes (one collective phase): an
    object store's file is uploaded in parts by several ranks, so no rank ever holds it whole."""
    owners = spread_by_bytes(sizes, comm.size)

    def mine() -> dict[int, str]:
        buffer = memoryview(bytearray(HASH_STEP))
        digests: dict[int, str] = {}
        for file, owner in enumerate(owners):
            if owner == comm.rank:
                digest = hashlib.sha256()
                for offset in range(0, sizes[file], HASH_STEP):
                    step = buffer[: min(HASH_STEP, sizes[file] - offset)]
                    client.read_into(names[file], offset, step)
                    digest.update(step)
                digests[file] = digest.hexdigest()
        return digests

    return digests_over_ranks(comm, mine, len(names))


__all__ = ["digests_over_ranks", "hash_over_ranks", "hash_share", "hash_objects"]
