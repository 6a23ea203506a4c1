"""Replicated pieces must hold the same bytes: each copy is hashed by one rank that can read it.

A piece saved more than once (a tensor replicated over a mesh dimension and written by several
ranks) is kept once by the plan. Before anything is written, every copy is hashed (SHA-256, in
blocks of the rank's buffer) by a rank that can read its file, the digests are gathered, and a
group whose copies differ is bad input naming the tensor, the region and both files. The cost is
one read of the replicated bytes; checkpoints written by torch's DCP store replicas once, so it
is usually nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .errors import InputError
from .io import SourceFiles
from .plan import Plan, Replicas, _region


def assign_readers(replicas: Replicas, holders: list[np.ndarray] | None, ranks: int) -> np.ndarray:
    """Which rank hashes each copy: the least loaded (by bytes) among those that can read its file (pure)."""
    load = np.zeros(ranks, dtype=np.int64)
    readers = np.empty(len(replicas.group), dtype=np.int32)
    everyone = np.arange(ranks)
    for row in np.argsort(-replicas.nbytes, kind="stable"):
        candidates = everyone if holders is None else holders[int(replicas.file[row])]
        reader = int(candidates[np.argmin(load[candidates])])
        load[reader] += int(replicas.nbytes[row])
        readers[row] = reader
    return readers


def hash_rows(replicas: Replicas, rows: np.ndarray, sources: SourceFiles, buffer: np.ndarray) -> dict[int, bytes]:
    """Digest of each copy in ``rows``, read in blocks of ``len(buffer)`` bytes."""
    result = {}
    view = memoryview(buffer)
    for row in rows:
        digest = hashlib.sha256()
        start, length = int(replicas.begin[row]), int(replicas.nbytes[row])
        for done in range(0, length, len(view)):
            chunk = view[: min(len(view), length - done)]
            sources.read_into(int(replicas.file[row]), start + done, chunk)
            digest.update(chunk)
        result[int(row)] = digest.digest()
    return result


def check_digests(plan: Plan, digests: dict[int, bytes]) -> None:
    """Raise InputError for the first group whose copies differ (pure)."""
    replicas = plan.replicas
    if replicas is None:
        return
    order = np.lexsort((np.arange(len(replicas.group)), replicas.group))
    for a, b in zip(order[:-1], order[1:]):
        if replicas.group[a] != replicas.group[b] or digests[int(a)] == digests[int(b)]:
            continue
        tensor = plan.tensors[int(replicas.tensor[a])]
        rank = int(replicas.ndim[a])
        region = _region(replicas.offset[a], replicas.offset[a] + replicas.shape[a], rank)
        raise InputError(
            f"tensor {tensor.name!r}: replicas differ: region {region} is stored in "
            f"{plan.source_files[int(replicas.file[a])]} and {plan.source_files[int(replicas.file[b])]} "
            "with different bytes (copies of a replicated tensor must be identical)"
        )
