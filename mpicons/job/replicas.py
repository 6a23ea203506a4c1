"""Replicated pieces must hold the same bytes: every copy is hashed by the rank that read its header.

A piece saved more than once (a tensor replicated over a mesh dimension and written by several
ranks) is kept once by the rank that owns its rows. Before anything is written, that rank asks the
ranks that can read each copy for a SHA-256 of it (one exchange of small requests and one of
digests), and copies that differ are bad input naming the tensor, the region and both files. The
cost is one read of the replicated bytes; torch's DCP writer stores replicas once, so on its
checkpoints it is nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..comm.agreement import Comm, agree
from ..core.coverage import element_region
from ..core.errors import InputError
from ..core.layout import Layout
from ..core.parts import Part, Replicas
from ..io.sources import SourceFiles
from .scan import Scanned, exchange, open_sources

_REQUEST = np.dtype([("row", "<i8"), ("owner", "<i4"), ("file", "<i4"), ("begin", "<i8"), ("nbytes", "<i8")])
_REPLY = np.dtype([("row", "<i8"), ("digest", "u1", (32,))])


def hash_ranges(sources: SourceFiles, requests: np.ndarray, buffer: np.ndarray) -> np.ndarray:
    """SHA-256 of each requested byte range, read in blocks of ``len(buffer)``."""
    replies = np.empty(len(requests), dtype=_REPLY)
    view = buffer.data
    for i, (file, begin, nbytes) in enumerate(
        zip(requests["file"].tolist(), requests["begin"].tolist(), requests["nbytes"].tolist())
    ):
        digest = hashlib.sha256()
        for done in range(0, nbytes, len(view)):
            chunk = view[: min(len(view), nbytes - done)]
            sources.read_into(file, begin + done, chunk)
            digest.update(chunk)
        replies["row"][i] = requests["row"][i]
        replies["digest"][i] = np.frombuffer(digest.digest(), dtype=np.uint8)
    return replies


def divergence(layout: Layout, replicas: Replicas, digests: dict[int, bytes]) -> str | None:
    """The first group whose copies differ, as a message (pure)."""
    order = np.lexsort((np.arange(len(replicas.group)), replicas.group))
    for a, b in zip(order[:-1], order[1:]):
        if replicas.group[a] != replicas.group[b] or digests[int(a)] == digests[int(b)]:
            continue
        tensor = layout.tensors[int(replicas.tensor[a])]
        region = element_region(tensor, replicas.offset[a], replicas.offset[a] + replicas.shape[a])
        return (
            f"tensor {tensor.name!r}: replicas differ: region {region} is stored in "
            f"{layout.source_files[int(replicas.file[a])]} and {layout.source_files[int(replicas.file[b])]} "
            "with different bytes (copies of a replicated tensor must be identical)"
        )
    return None


def check_replicas(comm: Comm, scanned: Scanned, layout: Layout, part: Part, buffer_size: int) -> None:
    """Compare every copy of every replicated piece (a no-op, after one Allreduce, when there are none)."""
    replicas = part.replicas
    if not comm.allreduce(int(replicas is not None), "max"):
        return
    requests = np.zeros(0 if replicas is None else len(replicas.group), dtype=_REQUEST)
    if replicas is not None:
        requests["row"] = np.arange(len(requests))
        requests["owner"] = comm.rank
        requests["file"], requests["begin"], requests["nbytes"] = replicas.file, replicas.begin, replicas.nbytes
    mine = exchange(comm, requests, replicas.holder if replicas is not None else np.zeros(0, dtype=np.int32))

    def digest_mine() -> np.ndarray:
        sources = open_sources(scanned)
        try:
            return hash_ranges(sources, mine, np.empty(max(1 << 16, buffer_size // 2), dtype=np.uint8))
        finally:
            sources.close()

    replies = exchange(comm, agree(comm, digest_mine), mine["owner"])
    digests = {int(row): digest.tobytes() for row, digest in zip(replies["row"], replies["digest"])}
    problem = divergence(layout, replicas, digests) if replicas is not None else None
    found = comm.allgather(problem)
    first = next((p for p in found if p), None)
    if first:
        raise InputError(first)
