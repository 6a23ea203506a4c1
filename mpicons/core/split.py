"""Split policies: which rows of which tensors each rank writes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .layout import Layout, WorkItem


def split_by_files(layout: Layout, ranks: int) -> list[list[WorkItem]]:
    """Whole output files dealt round-robin to ranks (torch's policy; idle ranks when files < ranks)."""
    work: list[list[WorkItem]] = [[] for _ in range(ranks)]
    for index, out in enumerate(layout.files):
        work[index % ranks].extend(WorkItem(t, 0, layout.tensors[t].rows) for t in out.tensors if layout.tensors[t].nbytes)
    return work


def split_by_bytes(layout: Layout, ranks: int) -> list[list[WorkItem]]:
    """Equal byte ranges of the concatenated output data, cut at row boundaries.

    Each rank gets one contiguous stretch of the output, so max/mean bytes per rank stays
    near 1 whatever the number and sizes of files (up to one row of the cut tensors).
    """
    ordered = [t for out in layout.files for t in out.tensors if layout.tensors[t].nbytes]
    sizes = np.array([layout.tensors[t].nbytes for t in ordered], dtype=np.int64)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    total = int(ends[-1]) if len(ends) else 0
    cuts = [0]
    for k in range(1, ranks):
        target = total * k // ranks
        i = int(np.searchsorted(ends, target, side="right"))
        if i >= len(ordered):
            cuts.append(total)
            continue
        row_bytes = layout.tensors[ordered[i]].row_bytes
        rows = round((target - int(begins[i])) / row_bytes)
        cuts.append(max(cuts[-1], int(begins[i]) + rows * row_bytes))
    cuts.append(total)
    work: list[list[WorkItem]] = [[] for _ in range(ranks)]
    for rank in range(ranks):
        low, high = cuts[rank], cuts[rank + 1]
        if low >= high:
            continue
        first = int(np.searchsorted(ends, low, side="right"))
        last = int(np.searchsorted(begins, high, side="left"))
        for i in range(first, last):
            info = layout.tensors[ordered[i]]
            row_low = max(0, (low - int(begins[i])) // info.row_bytes)
            row_high = min(info.rows, -(-(high - int(begins[i])) // info.row_bytes))
            if row_high > row_low:
                work[rank].append(WorkItem(ordered[i], int(row_low), int(row_high)))
    return work


SPLITS: dict[str, Callable[[Layout, int], list[list[WorkItem]]]] = {"bytes": split_by_bytes, "files": split_by_files}


def split_work(layout: Layout, ranks: int, split: str = "bytes", gather_to: int | None = None) -> list[list[WorkItem]]:
    """The work of ``ranks`` writers under the ``split`` policy; with ``gather_to``, every item of that
    split goes to that one rank (in the same order), the others write nothing."""
    work = SPLITS[split](layout, ranks)
    if gather_to is None:
        return work
    everything = [item for items in work for item in items]
    return [everything if rank == gather_to else [] for rank in range(ranks)]
