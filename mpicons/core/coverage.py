"""Coverage of a part's rows: every element covered exactly once, else a hole or an overlap, named by
region and files and merged over ranks into one problem per tensor."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from .layout import Layout, Tensor, WorkItem
from .parts import Part
from .problems import Hole, Problems
from .reports import Problem, count_of
from .safetensors_codec import DTYPE_BY_NAME
from .table import Pieces
from .values import Computed

#: Above this many grid cells a tensor's coverage is checked pairwise instead of on a grid.
MAX_GRID_CELLS = 1 << 24


def region_text(low: Sequence[int], high: Sequence[int], rank: int) -> str:
    """``[0:2, 4:8]``: the first ``rank`` dimensions of a box."""
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(low[:rank], high[:rank])) + "]"


def element_region(tensor: Tensor, low: Sequence[int] | np.ndarray, high: Sequence[int] | np.ndarray) -> str:
    """A storage-unit box as the element region messages show (sub-byte last dimension in elements;
    for an adapter's rotary view, the box in the view's coordinates)."""
    rank = tensor.dims
    low, high = [int(x) for x in low[:rank]], [int(x) for x in high[:rank]]
    bits = DTYPE_BY_NAME[tensor.source_dtype].bits
    if bits % 8 and tensor.shape:
        low[-1], high[-1] = low[-1] * 8 // bits, high[-1] * 8 // bits
    return region_text(low, high, rank)


def check_coverage(layout: Layout, part: Part, problems: Problems) -> None:
    """Every element of the rows this part owns is covered exactly once, else a problem naming the region and files."""
    if not part.items:
        return
    item_tensor = np.array([i.tensor for i in part.items], dtype=np.int64)
    item_low = np.array([i.row_begin for i in part.items], dtype=np.int64)
    item_high = np.array([i.row_end for i in part.items], dtype=np.int64)
    pieces = part.pieces
    storage = layout.arrays.storage
    # Fast path, vectorized over every item: all pieces span the full trailing dimensions and tile the rows.
    counts = part.start[item_tensor + 1] - part.start[item_tensor]
    full_width = np.all((pieces.shape[:, 1:] == storage[pieces.tensor, 1:]) & (pieces.offset[:, 1:] == 0), axis=1)
    item_of_piece = np.repeat(np.arange(len(part.items)), counts)
    index = (
        np.repeat(part.start[item_tensor], counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    low = np.maximum(pieces.offset[index, 0], item_low[item_of_piece])
    high = np.minimum(pieces.offset[index, 0] + pieces.shape[index, 0], item_high[item_of_piece])
    crosses = high > low
    index, item_of_piece, low, high = index[crosses], item_of_piece[crosses], low[crosses], high[crosses]
    simple = np.ones(len(part.items), dtype=bool)
    np.logical_and.at(simple, item_of_piece, full_width[index])
    ok = simple.copy()
    if len(index):
        first_of_item = np.r_[True, item_of_piece[1:] != item_of_piece[:-1]]
        last_of_item = np.r_[item_of_piece[1:] != item_of_piece[:-1], True]
        gap = np.zeros(len(index), dtype=bool)
        gap[1:] = ~first_of_item[1:] & (low[1:] != high[:-1])
        gap |= first_of_item & (low != item_low[item_of_piece])
        gap |= last_of_item & (high != item_high[item_of_piece])
        np.logical_and.at(ok, item_of_piece, ~gap)
    ok &= np.bincount(item_of_piece, minlength=len(part.items)) > 0
    ok |= np.prod(storage[item_tensor], axis=1) == 0
    ok |= np.array([isinstance(layout.tensors[t].value, Computed) for t in item_tensor.tolist()], dtype=bool)  # no pieces
    for i in np.flatnonzero(~ok):
        item = part.items[i]
        _check_item(layout, part, item, problems)


def _check_item(layout: Layout, part: Part, item: WorkItem, problems: Problems) -> None:
    """The exact check of one item's rows on a grid of the pieces' cut points (or pairwise when huge)."""
    tensor = layout.tensors[item.tensor]
    pieces = part.tensor_pieces(item.tensor)
    rank = tensor.dims
    whole = (item.row_begin, item.row_end) == (0, tensor.rows)
    where = f"tensor {tensor.name!r} (shape {list(tensor.shape)})"
    scope = "overall" if whole else f"in rows {item.row_begin}:{item.row_end}"
    low_box = np.array([item.row_begin] + [0] * (rank - 1), dtype=np.int64)
    high_box = np.array([item.row_end] + list(tensor.storage[1:rank]), dtype=np.int64)
    offset = np.maximum(pieces.offset[:, :rank], low_box)
    end = np.minimum(pieces.offset[:, :rank] + pieces.shape[:, :rank], high_box)
    inside = np.all(end > offset, axis=1)
    offset, end, files = offset[inside], end[inside], pieces.file[inside]
    full_pieces = pieces.take(np.flatnonzero(inside))
    expected = int(np.prod(high_box - low_box))
    covered = int(np.prod(end - offset, axis=1).sum()) if len(offset) else 0
    if expected == 0:
        return
    if len(offset) == 0:
        if whole:
            problems.add(Problem(f"{where}: no piece holds any data", tensor.name, kind="no data"), item.tensor)
        else:
            hole = Hole(tuple(low_box.tolist()), tuple(high_box.tolist()), expected)
            problems.add(hole_problem(tensor, hole, scope), item.tensor, hole)
        return
    cuts = [np.unique(np.concatenate(([low_box[d], high_box[d]], offset[:, d], end[:, d]))) for d in range(rank)]
    grid = [len(c) - 1 for c in cuts]
    if int(np.prod(grid, dtype=np.int64)) > MAX_GRID_CELLS:
        _check_pairwise(layout, tensor, where, offset, end, files, covered, expected, scope, problems, item.tensor)
        return
    lo = np.stack([np.searchsorted(cuts[d], offset[:, d]) for d in range(rank)], axis=1)
    hi = np.stack([np.searchsorted(cuts[d], end[:, d]) for d in range(rank)], axis=1)
    dims = [g + 1 for g in grid]
    corners = list(itertools.product((0, 1), repeat=rank))
    flat = np.concatenate(
        [np.ravel_multi_index(tuple(np.where(c[d], hi[:, d], lo[:, d]) for d in range(rank)), dims) for c in corners]
    )
    signs = np.repeat([-1 if sum(c) % 2 else 1 for c in corners], len(lo))
    diff = np.bincount(flat, weights=signs, minlength=int(np.prod(dims))).astype(np.int64).reshape(dims)
    for d in range(rank):
        diff = np.cumsum(diff, axis=d)
    counts = diff[tuple(slice(0, g) for g in grid)]
    bad = np.argwhere(counts != 1)
    if len(bad) == 0:
        return
    cell = bad[0]
    if counts[tuple(cell)] == 0:
        low = tuple(int(cuts[d][cell[d]]) for d in range(rank))
        hole = Hole(low, tuple(int(cuts[d][cell[d] + 1]) for d in range(rank)), max(0, expected - covered))
        problems.add(hole_problem(tensor, hole, scope), item.tensor, hole)
        return
    holding = np.all((lo <= cell) & (cell < hi), axis=1)
    problems.add(_overlap_problem(layout, tensor, where, full_pieces.take(np.flatnonzero(holding)), rank), item.tensor)


def _overlap_problem(layout: Layout, tensor: Tensor, where: str, holders: Pieces, rank: int) -> Problem:
    """An overlap named by the region all ``holders`` share, whole (the same whatever rows the checking
    rank has, and so whatever the job size), and each holder's file and box."""
    offset, shape = holders.offset[:, :rank], holders.shape[:, :rank]
    region = element_region(tensor, offset.max(axis=0), (offset + shape).min(axis=0))
    files = [layout.source_files[f] for f in holders.file]
    named = ", ".join(f"{name} at {element_region(tensor, o, o + s)}" for name, o, s in zip(files, offset, shape))
    message = f"{where}: overlap: region {region} is covered by {len(files)} pieces: {named}"
    return Problem(message, tensor.name, kind="overlap", region=region, files=tuple(files))


def hole_problem(tensor: Tensor, hole: Hole, scope: str) -> Problem:
    """The problem of a region no piece covers, ``scope`` saying where the missing count was taken."""
    where = f"tensor {tensor.name!r} (shape {list(tensor.shape)})"
    missing = f" ({count_of(hole.missing, 'element')} missing {scope})" if hole.missing else ""
    region = element_region(tensor, hole.low, hole.high)
    return Problem(f"{where}: hole: no piece covers region {region}{missing}", tensor.name, kind="hole", region=region)


def merge_problems(layout: Layout, found: Sequence[tuple[dict[int, Problem], dict[int, Hole]]]) -> dict[int, Problem]:
    """One message per tensor from every rank's findings (in rank order), the same whatever the job size.

    A hole that crosses the rows of several ranks is found in pieces, one per rank: when each rank's
    finding is a hole over the same columns and their rows meet, the message names the whole hole.
    Otherwise the lowest rank's (the first rows') finding stands.
    """
    merged: dict[int, Problem] = {}
    holes: dict[int, list[Hole | None]] = {}
    for by_tensor, rank_holes in found:
        for t, problem in by_tensor.items():
            merged.setdefault(t, problem)
            holes.setdefault(t, []).append(rank_holes.get(t))
    for t, parts in holes.items():
        if len(parts) < 2 or not all(parts):
            continue
        pieces = sorted((h for h in parts if h is not None), key=lambda h: h.low[0])
        meet = zip(pieces, pieces[1:])
        joined = all(a.high[0] == b.low[0] and (a.low[1:], a.high[1:]) == (b.low[1:], b.high[1:]) for a, b in meet)
        if joined:  # every rank with a problem in this tensor found this hole: their counts add up to all that is missing
            whole = Hole(pieces[0].low, (pieces[-1].high[0], *pieces[0].high[1:]), sum(h.missing for h in pieces))
            merged[t] = hole_problem(layout.tensors[t], whole, "overall")
    return merged


def _check_pairwise(
    layout: Layout,
    tensor: Tensor,
    where: str,
    offset: np.ndarray,
    end: np.ndarray,
    files: np.ndarray,
    covered: int,
    expected: int,
    scope: str,
    problems: Problems,
    t: int,
) -> None:
    """Overlap check for irregular tilings too fine for a grid: blockwise pairwise box tests."""
    block = 512
    for i0 in range(0, len(offset), block):
        hit = np.all((offset[i0 : i0 + block, None] < end[None]) & (offset[None] < end[i0 : i0 + block, None]), axis=2)
        hit[np.arange(hit.shape[0]), np.arange(i0, i0 + hit.shape[0])] = False
        pairs = np.argwhere(hit)
        if len(pairs):
            i, j = i0 + pairs[0][0], pairs[0][1]
            first, second = layout.source_files[files[i]], layout.source_files[files[j]]
            region = element_region(tensor, offset[i], end[i])
            message = (
                f"{where}: overlap: piece {region} in {first} "
                f"overlaps piece {element_region(tensor, offset[j], end[j])} in {second}"
            )
            problems.add(Problem(message, tensor.name, kind="overlap", region=region, files=(first, second)), t)
            return
    if covered != expected:
        message = f"{where}: hole: pieces cover {covered} of {count_of(expected, 'element')} {scope}"
        problems.add(Problem(message, tensor.name, kind="hole"), t)
