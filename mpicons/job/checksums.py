"""SHA-256 of many files, spread over the ranks by bytes: each file hashed whole by one rank.

Used to write ``SHA256SUMS`` right after the weights are written (read back from the page cache)
and by ``verify OUT`` to check one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..comm.agreement import Comm, agree
from ..io.manifest import HASH_STEP, hash_file, spread_by_bytes

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
    merged: dict[int, str | None] = {}
    for part in agree(comm, lambda: hash_share(paths, sizes, comm.rank, comm.size, follow_links, on_error), gather=True):
        merged.update(part)
    return [merged[file] for file in range(len(paths))]


def hash_share(
    paths: Sequence[str],
    sizes: Sequence[int],
    rank: int,
    ranks: int,
    follow_links: bool = False,
    on_error: OnError | None = None,
) -> dict[int, str | None]:
    """The digests of the files ``rank`` of ``ranks`` hashes (no communication: every rank computes the
    same spread), by file number."""
    owners = spread_by_bytes(sizes, ranks)
    buffer = memoryview(bytearray(HASH_STEP))
    digests: dict[int, str | None] = {}
    for file, owner in enumerate(owners):
        if owner != rank:
            continue
        try:
            digests[file] = hash_file(paths[file], buffer, follow_links)
        except Exception as exc:
            if on_error is None:
                raise
            digests[file] = on_error(paths[file], exc)
    return digests


__all__ = ["hash_over_ranks", "hash_share"]
