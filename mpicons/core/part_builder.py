"""One rank's part built from the pieces routed to it: replicas kept once, coverage checked, and
shard files that only repeat others found."""

from __future__ import annotations

import numpy as np

from .coverage import check_coverage, element_region
from .layout import Layout
from .owners import RowOwners
from .parts import Part, Replicas
from .problems import Problems
from .reports import Problem
from .table import Pieces


def _first_identical(order: np.ndarray, columns: list[np.ndarray]) -> np.ndarray:
    """For every position of ``order`` (rows sorted by ``columns``), the position of the first row equal to it
    in all of them (one column at a time, so no key matrix is built)."""
    same = np.ones(max(0, len(order) - 1), dtype=bool)
    for column in columns:
        ordered = column[order]
        same &= ordered[1:] == ordered[:-1]
    starts_group = np.r_[True, ~same] if len(order) else np.zeros(0, dtype=bool)
    return np.flatnonzero(starts_group)[np.cumsum(starts_group) - 1]


def build_part(
    layout: Layout,
    rank: int,
    received: Pieces,
    owners: RowOwners,
    problems: Problems | None = None,
) -> Part:
    """Check and order the pieces routed to ``rank``: replicas, coverage of its rows, copied files.

    ``received`` holds every non-empty piece that crosses the rows ``rank`` owns (storage units).
    Coverage problems are raised (strict) or collected per tensor.
    """
    problems = Problems(strict=True) if problems is None else problems
    items = layout.work[rank] if rank < len(layout.work) else []
    width = received.width
    order = np.lexsort(
        (
            received.file,
            *[received.shape[:, d] for d in reversed(range(width))],
            *[received.offset[:, d] for d in reversed(range(width))],
            received.tensor,
        )
    )
    # Identical boxes are adjacent in this order, the lowest file first: that copy is kept.
    first_copy = _first_identical(order, [received.tensor, *received.offset.T, *received.shape.T])
    repeat = first_copy != np.arange(len(order))
    held, repeated, examples, replicas = _repeats(layout, received, order, first_copy, repeat, owners, rank)
    kept = received.take(order[~repeat])
    start = np.searchsorted(kept.tensor, np.arange(len(layout.tensors) + 1)).astype(np.int64)
    part = Part(rank, items, kept, start, replicas, held, repeated, examples)
    check_coverage(layout, part, problems)
    return part


def _repeats(
    layout: Layout, received: Pieces, order: np.ndarray, first_copy: np.ndarray, repeat: np.ndarray, owners: RowOwners, rank: int
) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]], Replicas | None]:
    """Per-file counts of the pieces this rank counts (it owns their first row) and of repeats among them,
    an example repeat per file, and the replica groups (every copy) for the byte comparison."""
    num_files = len(layout.source_files)
    primary = owners.primary(received, rank)[order]
    files = received.file[order]
    held = np.bincount(files[primary], minlength=num_files).astype(np.int64)
    repeated = np.bincount(files[primary & repeat], minlength=num_files).astype(np.int64)
    examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]] = {}
    if not repeat.any():
        return held, repeated, examples, None
    for i in np.flatnonzero(primary & repeat):
        f = int(files[i])
        if f not in examples:
            p, q = int(order[i]), int(order[first_copy[i]])
            examples[f] = (
                int(received.tensor[p]),
                tuple(int(x) for x in received.offset[p]),
                tuple(int(x) for x in received.shape[p]),
                int(received.file[q]),
            )
    rows = np.unique(np.concatenate([np.flatnonzero(repeat), first_copy[repeat]]))
    return held, repeated, examples, _replicas(received.take(order[rows]), first_copy[rows], layout)


def _replicas(copies: Pieces, group: np.ndarray, layout: Layout) -> Replicas:
    """Every copy of a replicated box, to hash. Groups with a copy torch saved as a view (its bytes in
    another order) are left unhashed: hashing saved bytes would call a transposed copy divergent."""
    nbytes = np.prod(copies.shape, axis=1) * layout.arrays.source_unit[copies.tensor]
    if copies.stride is not None:
        views = np.unique(group[~copies.dense()])
        nbytes = np.where(np.isin(group, views), 0, nbytes)
    return Replicas(
        group=group.astype(np.int64),
        file=copies.file,
        begin=copies.begin,
        nbytes=nbytes,
        tensor=copies.tensor,
        holder=copies.holder,
        offset=copies.offset,
        shape=copies.shape,
    )


def copied_file_problem(
    layout: Layout,
    names: list[str],
    held: np.ndarray,
    repeated: np.ndarray,
    examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]],
) -> Problem | None:
    """A shard file whose every non-empty piece repeats a piece of another file is a copy, not a rank's share.

    torch writes replicated tensors once, so a file of nothing but repeats was saved twice (e.g. under
    another rank number), which can hide the loss of the file it replaced. ``held``/``repeated`` are
    summed over all ranks; ``examples`` are merged from them.
    """
    copies = np.flatnonzero((held > 0) & (repeated == held))
    if not len(copies):
        return None
    f = int(copies[0])
    tensor, offset, shape, original = examples[f]
    info = layout.tensors[tensor]
    region = element_region(info, offset, np.add(offset, shape))
    message = (
        f"{layout.source_files[f]}: every piece in it duplicates a piece of another shard file (tensor "
        f"{names[tensor]!r} at {region} is also in {layout.source_files[original]}); is it a copy saved under another name?"
    )
    return Problem(message, kind="copy", region=region, files=(layout.source_files[f], layout.source_files[original]))
