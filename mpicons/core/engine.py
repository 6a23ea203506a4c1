"""The geometry engine: placing pieces into output blocks, with cost per block, not per piece.

A rank's rows are cut into **blocks**: contiguous stretches of one output file of at most a few
MB, each made of **segments** (rows of one tensor). For a block the engine computes, with numpy
over all the pieces that cross it at once, the **runs**: contiguous byte ranges that go from a
shard file to a place in the block (a row-cut piece is one run; a column-cut piece one run per
row). The runs are coalesced into one large read per contiguous region of each shard file (the
pieces of consecutive tensors sit together in a shard), and placed into the block by one numpy
gather. Conversion (``--dtype``) then turns the block into output bytes. Writing the block, or
comparing it (``verify``), or sending portions of it (node-local shards) is the caller's business:
this module only knows geometry.

A piece that is large, contiguous in the output and unconverted (row-sharded matrices) is not
assembled at all: it is copied file to file (:data:`DIRECT_MIN`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .convert import convert, numpy_dtype
from .errors import InputError
from .layout import Layout, Tensor, WorkItem
from .parts import Part
from .table import Pieces

#: A contiguous, unconverted piece at least this large is copied file to file instead of assembled.
DIRECT_MIN = 1 << 20
#: Runs at least this long are copied one by one (a slice copy costs about a microsecond, so the loop
#: adds at most half to the copying); shorter ones go in one numpy gather per block.
LONG_RUN = 2 << 10
#: Shard reads of one block merge across gaps up to this size (less seeking, some bytes read twice).
READ_GAP = 64 << 10
#: Most runs one block may have; a block with more is split (bounds the index arrays).
MAX_RUNS = 1 << 18
#: Smallest useful block; keeps every storage unit (≤ 8 bytes) inside one block.
MIN_BLOCK = 1 << 12


@dataclass(frozen=True)
class Segment:
    """Rows ``[row_begin, row_end)`` along dimension ``len(prefix)`` of tensor ``tensor`` at index
    ``prefix`` of the dimensions before it (``prefix`` is empty except for rows larger than a block)."""

    tensor: int
    row_begin: int
    row_end: int
    prefix: tuple[int, ...] = ()


@dataclass
class Block:
    """Consecutive segments filling ``[offset, offset + size)`` of output file ``file``."""

    file: int
    offset: int
    segments: list[Segment] = field(default_factory=list)
    size: int = 0  # output bytes
    source_size: int = 0  # the same rows in shard bytes (differs when converting)


@dataclass(frozen=True)
class Direct:
    """Rows of one piece copied file to file: ``length`` bytes from ``src`` of shard ``file`` to ``offset`` of output ``out``."""

    file: int
    src: int
    out: int
    offset: int
    length: int
    holder: int = -1  # a rank that can read the shard file


@dataclass(frozen=True)
class Transpose:
    """A piece saved as a transposed view, placed in a block: its bytes were read in their saved order
    into ``scratch`` (bytes past the block's own, a box of ``saved_shape``); numpy moves them to
    ``dst`` with ``dst_strides`` (bytes per dim, the tensor's order), ``axes`` giving each dim's place
    in the saved order."""

    scratch: int
    saved_shape: tuple[int, ...]
    axes: tuple[int, ...]
    dst: int
    dst_strides: tuple[int, ...]
    unit: int


@dataclass
class Runs:
    """Byte ranges from shard files into a block: ``file``, ``src`` (absolute), ``dst`` (block, source layout),
    ``length``, and ``holder``, a rank that can read the file (the one that read its header).

    ``transposes``: pieces saved as transposed views, whose runs land past the block (``dst`` at
    least the block's source size, ``scratch`` bytes in all) and are moved in by :meth:`Assembler.finish`."""

    file: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    holder: np.ndarray
    transposes: tuple[Transpose, ...] = ()
    scratch: int = 0

    FIELDS = ("file", "src", "dst", "length", "holder")

    def __len__(self) -> int:
        return len(self.file)

    def take(self, index: np.ndarray) -> Runs:
        """Some of the runs (the transposes stay with the whole: they are the block's, not a reader's)."""
        return Runs(self.file[index], self.src[index], self.dst[index], self.length[index], self.holder[index])

    @classmethod
    def concat(cls, parts: list[Runs]) -> Runs:
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty, empty, empty)
        file, src, dst, length, holder = (np.concatenate([getattr(p, n) for p in parts]) for n in cls.FIELDS)
        transposes = tuple(t for p in parts for t in p.transposes)
        return cls(file, src, dst, length, holder, transposes, sum(p.scratch for p in parts))


# ---------------------------------------------------------------- sizes


def _row_units(tensor: Tensor, level: int) -> int:
    return math.prod(tensor.storage[level + 1 :])


def segment_bytes(layout: Layout, segment: Segment) -> tuple[int, int]:
    """(source bytes, output bytes) of a segment."""
    tensor = layout.tensors[segment.tensor]
    units = (segment.row_end - segment.row_begin) * _row_units(tensor, len(segment.prefix))
    return units * tensor.source_unit, units * tensor.unit


def segment_offset(layout: Layout, segment: Segment) -> int:
    """Where a segment starts in its output file."""
    tensor = layout.tensors[segment.tensor]
    linear = 0
    for d, index in enumerate(segment.prefix):
        linear += index * _row_units(tensor, d)
    return tensor.offset + (linear + segment.row_begin * _row_units(tensor, len(segment.prefix))) * tensor.unit


# ---------------------------------------------------------------- cutting a rank's rows into direct copies and blocks


def direct_pieces(layout: Layout, part: Part, shared: bool = True) -> np.ndarray:
    """Which of the part's pieces are copied file to file (vectorized): spanning the full trailing
    dimensions, unconverted, and at least :data:`DIRECT_MIN` bytes."""
    pieces = part.pieces
    if not len(pieces):
        return np.zeros(0, dtype=bool)
    arrays = layout.arrays
    storage, converting, unit = arrays.storage, arrays.converting, arrays.source_unit
    full = np.all((pieces.shape[:, 1:] == storage[pieces.tensor, 1:]) & (pieces.offset[:, 1:] == 0), axis=1)
    full &= arrays.same_from[pieces.tensor] == 0  # rows in another order are assembled
    full &= pieces.dense()  # so are views torch saved (transposed, sliced)
    nbytes = np.prod(pieces.shape, axis=1) * unit[pieces.tensor]
    return full & ~converting[pieces.tensor] & (nbytes >= DIRECT_MIN) & shared


def plan_item(layout: Layout, part: Part, item: WorkItem, direct: np.ndarray) -> tuple[list[Direct], list[Segment]]:
    """An item's rows: direct copies of its large contiguous pieces, and segments for everything else."""
    lo, hi = int(part.start[item.tensor]), int(part.start[item.tensor + 1])
    if not direct[lo:hi].any():
        return [], [Segment(item.tensor, item.row_begin, item.row_end)]
    tensor = layout.tensors[item.tensor]
    row_bytes = tensor.row_bytes
    copies, segments, row = [], [], item.row_begin
    pieces = part.pieces
    for i in range(lo, hi):  # only tensors with large pieces get here: few pieces
        first = max(int(pieces.offset[i, 0]), item.row_begin)
        last = min(int(pieces.offset[i, 0] + pieces.shape[i, 0]), item.row_end)
        if not direct[i] or last <= first:
            continue
        if first > row:
            segments.append(Segment(item.tensor, row, first))
        copies.append(
            Direct(
                int(pieces.file[i]),
                int(pieces.begin[i]) + (first - int(pieces.offset[i, 0])) * row_bytes,
                tensor.file,
                tensor.offset + first * row_bytes,
                (last - first) * row_bytes,
                int(pieces.holder[i]),
            )
        )
        row = last
    if row < item.row_end:
        segments.append(Segment(item.tensor, row, item.row_end))
    return copies, segments


def split_segment(layout: Layout, segment: Segment, block_bytes: int) -> Iterator[Segment]:
    """A segment cut into pieces of at most ``block_bytes`` (source and output), recursing into a dimension
    when a single row is larger than that."""
    tensor = layout.tensors[segment.tensor]
    level = len(segment.prefix)
    row = _row_units(tensor, level) * max(tensor.unit, tensor.source_unit)
    if row <= block_bytes or tensor.axes is not None:  # a reordered row (one head) is never cut: its block grows
        step = max(1, block_bytes // max(1, row))
        for begin in range(segment.row_begin, segment.row_end, step):
            yield Segment(segment.tensor, begin, min(segment.row_end, begin + step), segment.prefix)
        return
    for index in range(segment.row_begin, segment.row_end):
        inner = Segment(segment.tensor, 0, tensor.storage[level + 1], (*segment.prefix, index))
        yield from split_segment(layout, inner, block_bytes)


def blocks(layout: Layout, segments: list[Segment], block_bytes: int) -> Iterator[Block]:
    """Segments (in output order) grouped into blocks of consecutive output bytes, at most ``block_bytes``."""
    current: Block | None = None
    for whole in segments:
        for segment in split_segment(layout, whole, block_bytes):
            source, size = segment_bytes(layout, segment)
            file = layout.tensors[segment.tensor].file
            offset = segment_offset(layout, segment)
            if (
                current is None
                or current.file != file
                or current.offset + current.size != offset
                or max(current.size + size, current.source_size + source) > block_bytes
            ):
                if current is not None:
                    yield current
                current = Block(file, offset)
            current.segments.append(segment)
            current.size += size
            current.source_size += source
    if current is not None:
        yield current


# ---------------------------------------------------------------- runs: pieces placed in a block, vectorized


def _pairs(layout: Layout, part: Part, block: Block) -> tuple[np.ndarray, ...]:
    """(segment, piece) pairs of a block of whole-row segments, the rows each piece gives, each segment's
    first row and its byte position in the block (source layout)."""
    seg_tensor = np.fromiter((s.tensor for s in block.segments), dtype=np.int64, count=len(block.segments))
    seg_low = np.fromiter((s.row_begin for s in block.segments), dtype=np.int64, count=len(block.segments))
    seg_high = np.fromiter((s.row_end for s in block.segments), dtype=np.int64, count=len(block.segments))
    arrays = layout.arrays
    sizes = (seg_high - seg_low) * np.prod(arrays.storage[seg_tensor, 1:], axis=1) * arrays.source_unit[seg_tensor]
    counts = part.start[seg_tensor + 1] - part.start[seg_tensor]
    segment = np.repeat(np.arange(len(block.segments)), counts)
    piece = (
        np.repeat(part.start[seg_tensor], counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    low = np.maximum(part.pieces.offset[piece, 0], seg_low[segment])
    high = np.minimum(part.pieces.offset[piece, 0] + part.pieces.shape[piece, 0], seg_high[segment])
    keep = high > low
    return segment[keep], piece[keep], low[keep], high[keep], seg_low, np.cumsum(sizes) - sizes


def dense_from(shape: np.ndarray, stride: np.ndarray) -> np.ndarray:
    """Per piece, the first dim from which its saved bytes are row-major (its width: none, a transposed view)."""
    width = shape.shape[1]
    chained = np.ones(len(shape), dtype=bool)
    first = np.full(len(shape), width, dtype=np.int64)
    for d in range(width - 1, -1, -1):
        expected = 1 if d == width - 1 else stride[:, d + 1] * shape[:, d + 1]
        chained &= (stride[:, d] == expected) | (shape[:, d] <= 1)
        first = np.where(chained, d, first)
    return first


def check_saved_views(layout: Layout, part: Part, block_bytes: int) -> None:
    """Rows of a tensor with pieces saved transposed are never cut across blocks: refuse, before any
    writing, one larger than a block (every rank checks its own part; the caller agrees on it)."""
    pieces = part.pieces
    if pieces.stride is None or not len(pieces):
        return
    flipped = dense_from(pieces.shape, pieces.stride) == pieces.width
    for t in np.unique(pieces.tensor[flipped]).tolist():
        tensor = layout.tensors[t]
        row = tensor.row_units * max(tensor.unit, tensor.source_unit)
        if row > block_bytes:
            raise InputError(
                f"tensor {tensor.name!r}: one row ({row} bytes) is larger than a block ({block_bytes} bytes) and "
                "pieces of it were saved transposed: give a --buffer-size of at least seven of its rows"
            )


def _innermost(shape: np.ndarray, offset: np.ndarray, storage: np.ndarray) -> np.ndarray:
    """Per piece, the innermost dimension it does not span in full (0: it spans every trailing one)."""
    width = storage.shape[1]
    if width == 1:
        return np.zeros(len(shape), dtype=np.int64)
    partial = (shape[:, 1:] != storage[:, 1:]) | (offset[:, 1:] != 0)
    return np.where(partial.any(axis=1), width - 1 - np.argmax(partial[:, ::-1], axis=1), 0)


def runs_of(layout: Layout, part: Part, block: Block, limit: int | None = None) -> Runs | None:
    """Every run of a block, computed with numpy over all its (segment, piece) pairs; None when there
    would be more than ``limit`` (counted first, without making them)."""
    if any(s.prefix for s in block.segments):
        runs = Runs.concat([_prefixed_runs(layout, part, block, i) for i in range(len(block.segments))])
        return None if limit is not None and len(runs) > limit else runs
    segment, piece, low, high, seg_low, base = _pairs(layout, part, block)
    pieces = part.pieces
    transposes = None
    steps = None
    if pieces.stride is not None:  # views torch saved: runs follow their strides; transposed ones go apart
        steps = pieces.stride[piece]
        chain = dense_from(pieces.shape[piece], steps)
        flipped = chain == pieces.width
        if flipped.any():
            keep = np.flatnonzero(flipped)
            transposes = _transposed_runs(layout, block, pieces, segment[keep], piece[keep], low[keep], high[keep], seg_low, base)
            normal = np.flatnonzero(~flipped)
            segment, piece, low, high, steps, chain = (
                segment[normal],
                piece[normal],
                low[normal],
                high[normal],
                steps[normal],
                chain[normal],
            )
    tensor_ids = pieces.tensor[piece]
    storage = layout.arrays.storage[tensor_ids]
    shape, offset = pieces.shape[piece], pieces.offset[piece]
    # Reordered dims (an adapter's rotary rows) are never inside a run: runs start below them.
    innermost = np.maximum(_innermost(shape, offset, storage), layout.arrays.same_from[tensor_ids])
    if steps is not None:
        innermost = np.maximum(innermost, chain)
    extra = 0 if transposes is None else len(transposes)
    if limit is not None:
        per_row = np.ones(len(piece), dtype=np.int64)
        for d in range(1, storage.shape[1]):
            per_row *= np.where(d < innermost, shape[:, d], 1)
        if int(np.where(innermost == 0, 1, (high - low) * per_row).sum()) + extra > limit:
            return None
    runs = _runs(
        storage,
        offset,
        shape,
        pieces.file[piece].astype(np.int64),
        pieces.begin[piece],
        layout.arrays.source_unit[tensor_ids],
        low,
        high,
        seg_low[segment],
        base[segment],
        pieces.holder[piece].astype(np.int64),
        innermost,
        layout.arrays.axes[tensor_ids],
        steps,
    )
    return runs if transposes is None else Runs.concat([runs, transposes])


def _transposed_runs(
    layout: Layout,
    block: Block,
    pieces: Pieces,
    segment: np.ndarray,
    piece: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    seg_low: np.ndarray,
    base: np.ndarray,
) -> Runs:
    """Pieces saved as transposed views: per (segment, piece), the box read in its saved order (one run
    per saved row, merged where the box spans whole saved rows) into scratch past the block, and a
    :class:`Transpose` that puts it in place. Per piece, never per element."""
    arrays = layout.arrays
    scratch_at = block.source_size
    parts: list[Runs] = []
    assert pieces.stride is not None
    for s, p, lo, hi in zip(segment.tolist(), piece.tolist(), low.tolist(), high.tolist()):
        t = int(pieces.tensor[p])
        unit = int(arrays.source_unit[t])
        shape = pieces.shape[p].copy()
        shape[0] = hi - lo
        stride = pieces.stride[p]
        order = tuple(sorted(range(len(shape)), key=lambda d: (-int(stride[d]) if shape[d] > 1 else 1, d)))
        saved_shape = shape[list(order)]
        saved_stride = stride[list(order)]
        if saved_shape[-1] > 1 and saved_stride[-1] != 1:
            raise InputError(
                f"tensor {layout.tensors[t].name!r}: a piece saved with strides {stride.tolist()} has no contiguous "
                "dimension: mpicons cannot read this layout"
            )
        # Saved dims from the innermost that the box spans whole (and that follow on) merge into one run.
        inner = len(order) - 1
        while (
            inner > 0
            and saved_shape[inner] == pieces.shape[p][order[inner]]
            and saved_stride[inner - 1] == saved_stride[inner] * saved_shape[inner]
        ):
            inner -= 1
        outer = saved_shape[:inner]
        run_units = int(np.prod(saved_shape[inner:]))
        start = int(pieces.begin[p]) + (lo - int(pieces.offset[p, 0])) * int(stride[0]) * unit
        grid = np.indices(tuple(int(x) for x in outer)).reshape(len(outer), -1) if inner else np.zeros((0, 1), dtype=np.int64)
        src = start + (saved_stride[:inner] @ grid) * unit if inner else np.array([start], dtype=np.int64)
        count = len(src)
        dst = scratch_at + np.arange(count, dtype=np.int64) * run_units * unit
        storage = np.array(layout.tensors[t].storage, dtype=np.int64)[None, :]
        axes = arrays.axes[t][None, :]
        out_storage = np.take_along_axis(storage, axes, axis=1)[0]
        out_step = np.ones(len(out_storage), dtype=np.int64)
        for d in range(len(out_storage) - 2, -1, -1):
            out_step[d] = out_step[d + 1] * out_storage[d + 1]
        full_step = np.empty_like(out_step)
        full_step[arrays.axes[t]] = out_step
        first = np.array(pieces.offset[p], dtype=np.int64)
        first[0] = lo - int(seg_low[s])
        dst_at = int(base[s]) + int(first @ full_step) * unit
        placed = Transpose(
            scratch_at,
            tuple(int(x) for x in saved_shape),
            tuple(order.index(d) for d in range(len(order))),
            dst_at,
            tuple(int(x) * unit for x in full_step),
            unit,
        )
        runs = Runs(
            np.full(count, pieces.file[p], dtype=np.int64),
            src.astype(np.int64),
            dst,
            np.full(count, run_units * unit, dtype=np.int64),
            np.full(count, pieces.holder[p], dtype=np.int64),
            (placed,),
            count * run_units * unit,
        )
        parts.append(runs)
        scratch_at += count * run_units * unit
    return Runs.concat(parts)


def _prefixed_runs(layout: Layout, part: Part, block: Block, index: int) -> Runs:
    """Runs of one segment inside a row too large for a block: pieces holding the prefix, the box below it."""
    segment = block.segments[index]
    base = sum(segment_bytes(layout, s)[0] for s in block.segments[:index])
    level = len(segment.prefix)
    tensor = layout.tensors[segment.tensor]
    pieces = part.tensor_pieces(segment.tensor)
    prefix = np.array(segment.prefix, dtype=np.int64)
    holds = np.all((pieces.offset[:, :level] <= prefix) & (prefix < pieces.offset[:, :level] + pieces.shape[:, :level]), axis=1)
    holds &= (pieces.offset[:, level] < segment.row_end) & (pieces.offset[:, level] + pieces.shape[:, level] > segment.row_begin)
    chosen = pieces.take(np.flatnonzero(holds))
    n = len(chosen)
    if not n:
        return Runs.concat([])
    steps = chosen.strides()
    assert chosen.stride is None or not (dense_from(chosen.shape, steps) == chosen.width).any(), (
        "check_saved_views refuses, at plan time, rows of transposed pieces larger than a block"
    )
    # Where the prefix starts inside each piece's own box, in units.
    local = ((prefix - chosen.offset[:, :level]) * steps[:, :level]).sum(axis=1)
    begin = chosen.begin + local * tensor.source_unit
    storage = np.tile(np.array(tensor.storage[level:], dtype=np.int64), (n, 1))
    low = np.maximum(chosen.offset[:, level], segment.row_begin)
    high = np.minimum(chosen.offset[:, level] + chosen.shape[:, level], segment.row_end)
    return _runs(
        storage,
        chosen.offset[:, level:],
        chosen.shape[:, level:],
        chosen.file.astype(np.int64),
        begin,
        np.full(n, tensor.source_unit, dtype=np.int64),
        low,
        high,
        np.full(n, segment.row_begin, dtype=np.int64),
        np.full(n, base, dtype=np.int64),
        chosen.holder.astype(np.int64),
        None,
        None,
        None if chosen.stride is None else steps[:, level:],
    )


def _runs(
    storage: np.ndarray,
    offset: np.ndarray,
    shape: np.ndarray,
    file: np.ndarray,
    begin: np.ndarray,
    unit: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    seg_low: np.ndarray,
    base: np.ndarray,
    holder: np.ndarray,
    innermost: np.ndarray | None = None,
    axes: np.ndarray | None = None,
    strides: np.ndarray | None = None,
) -> Runs:
    """Runs of pieces (one row each) restricted to rows ``[low, high)`` of dimension 0.

    Dimensions after the innermost one a piece does not span in full are contiguous in both the
    piece and the output: one run per index of the dimensions between 0 and that one. With
    ``axes`` (output dim k is storage dim ``axes[:, k]``), a storage dim's step in the output is
    that of its place in the output's order. ``strides`` are the pieces' own (views torch saved), else
    row-major in their box.
    """
    width = storage.shape[1]
    if innermost is None:
        innermost = _innermost(shape, offset, storage)
    # Units per step of each dimension, in the piece's own box and in the full tensor.
    piece_step = np.ones_like(shape)
    full_step = np.ones_like(storage)
    out_storage = storage if axes is None else np.take_along_axis(storage, axes, axis=1)
    for d in range(width - 2, -1, -1):
        piece_step[:, d] = piece_step[:, d + 1] * shape[:, d + 1]
        full_step[:, d] = full_step[:, d + 1] * out_storage[:, d + 1]
    if strides is not None:
        piece_step = strides
    if axes is not None:  # the output's steps, re-indexed by storage dim
        by_storage = np.empty_like(full_step)
        np.put_along_axis(by_storage, axes, full_step, axis=1)
        full_step = by_storage

    def runs_at(which: np.ndarray, src_units: np.ndarray, dst_units: np.ndarray, length_units: np.ndarray) -> Runs:
        u = unit[which]
        return Runs(file[which], begin[which] + src_units * u, base[which] + dst_units * u, length_units * u, holder[which])

    out = []
    for k in np.unique(innermost):
        rows = np.flatnonzero(innermost == k)
        k = int(k)
        if k == 0:  # the piece spans every trailing dimension: its rows are one run
            src_units = (low[rows] - offset[rows, 0]) * piece_step[rows, 0]
            dst_units = (low[rows] - seg_low[rows]) * full_step[rows, 0]
            out.append(runs_at(rows, src_units, dst_units, (high[rows] - low[rows]) * full_step[rows, 0]))
            continue
        count = (high[rows] - low[rows]) * np.prod(shape[rows, 1:k], axis=1)
        pair = np.repeat(rows, count)
        q = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        src_units = np.zeros(len(q), dtype=np.int64)
        dst_units = offset[pair, k] * full_step[pair, k]
        for d in range(k - 1, 0, -1):
            index = q % shape[pair, d]
            q //= shape[pair, d]
            src_units += index * piece_step[pair, d]
            dst_units += (offset[pair, d] + index) * full_step[pair, d]
        row = low[pair] + q
        src_units += (row - offset[pair, 0]) * piece_step[pair, 0]
        dst_units += (row - seg_low[pair]) * full_step[pair, 0]
        out.append(runs_at(pair, src_units, dst_units, shape[pair, k] * full_step[pair, k]))
    return Runs.concat(out)


# ---------------------------------------------------------------- reading and placing


@dataclass
class Reads:
    """Coalesced shard reads of a block: ``file``, ``src``, ``length``, and where each lands in the source buffer."""

    file: np.ndarray
    src: np.ndarray
    length: np.ndarray
    position: np.ndarray

    @property
    def total(self) -> int:
        return int(self.length.sum())


def coalesce(runs: Runs, budget: int) -> tuple[Reads, np.ndarray]:
    """Merge runs into reads per contiguous shard region (across gaps up to :data:`READ_GAP` while the gap
    bytes stay within ``budget``); returns the reads and each run's position in the concatenated reads."""
    order = np.lexsort((runs.src, runs.file))
    file, src, end = runs.file[order], runs.src[order], runs.src[order] + runs.length[order]
    # How far the previous runs of the same file reach (the running maximum restarts at each file).
    dense = np.cumsum(np.r_[False, file[1:] != file[:-1]]) if len(file) else file
    shift = dense * (int(end.max()) + 1 if len(end) else 1)
    reach = np.maximum.accumulate(end + shift) - shift
    gap = np.zeros(len(order), dtype=np.int64)
    new = np.ones(len(order), dtype=bool)
    if len(order) > 1:
        gap[1:] = src[1:] - reach[:-1]
        new[1:] = (file[1:] != file[:-1]) | (gap[1:] > READ_GAP)
        # Merging across gaps costs the gap bytes: keep the smallest gaps within the budget.
        bridged = np.flatnonzero(~new & (gap > 0))
        if len(bridged):
            by_size = bridged[np.argsort(gap[bridged], kind="stable")]
            too_much = by_size[np.cumsum(gap[by_size]) > budget]
            new[too_much] = True
    read_id = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    read_src = src[starts]
    read_end = np.maximum.reduceat(end, starts) if len(starts) else end
    length = read_end - read_src
    position = np.cumsum(length) - length
    placed = np.empty(len(order), dtype=np.int64)
    placed[order] = position[read_id] + (src - read_src[read_id])
    return Reads(file[starts], read_src, length, position), placed


def _gcd_unit(*arrays: np.ndarray) -> int:
    unit = int(np.gcd.reduce(np.concatenate([a.astype(np.int64) for a in arrays]))) if len(arrays[0]) else 1
    unit = unit & -unit if unit else 1  # a power of two, so numpy has a type for it
    return min(unit, 1 << 12)


def _view(buffer: np.ndarray, unit: int) -> np.ndarray:
    usable = buffer[: len(buffer) // unit * unit]
    return usable.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(unit, np.dtype((np.void, unit))))


def place(source: np.ndarray, positions: np.ndarray, target: np.ndarray, runs: Runs) -> None:
    """``target[dst:dst+length] = source[position:position+length]`` for every run: long runs one by one,
    short ones in one numpy gather (in chunks of at most :data:`MAX_RUNS` index entries)."""
    long = runs.length >= LONG_RUN
    for s, d, n in zip(positions[long].tolist(), runs.dst[long].tolist(), runs.length[long].tolist()):
        target[d : d + n] = source[s : s + n]
    short = np.flatnonzero(~long)
    if not len(short):
        return
    pos, dst, length = positions[short], runs.dst[short], runs.length[short]
    unit = _gcd_unit(pos, dst, length)
    counts = length // unit
    src_view, dst_view = _view(source, unit), _view(target, unit)
    order = np.argsort(dst, kind="stable")
    pos, dst, counts = pos[order] // unit, dst[order] // unit, counts[order]
    contiguous = bool(np.all(dst[1:] == dst[:-1] + counts[:-1]))
    done = 0
    while done < len(counts):  # chunks of whole runs, at most MAX_RUNS units each (a longer run alone)
        cum = np.cumsum(counts[done:])
        stop = done + max(1, int(np.searchsorted(cum, MAX_RUNS, side="right")))
        c = counts[done:stop]
        n = int(c.sum())
        within = np.arange(n) - np.repeat(np.cumsum(c) - c, c)
        gather = np.repeat(pos[done:stop], c) + within
        if contiguous:
            start = int(dst[done])
            np.take(src_view, gather, out=dst_view[start : start + n])
        else:
            dst_view[np.repeat(dst[done:stop], c) + within] = src_view[gather]
        done = stop


# ---------------------------------------------------------------- the assembler


class Assembler:
    """Assembles blocks of a part in bounded buffers: shard bytes read through ``read``, placed, converted.

    ``read(file, offset, target)`` fills ``target`` from a shard file. The buffers grow only for a
    block larger than planned (a row of one unit bigger than a block): memory stays within about
    four blocks plus the index arrays of :data:`MAX_RUNS` runs.
    """

    def __init__(self, layout: Layout, part: Part, block_bytes: int, read: Callable[[int, int, memoryview], None]) -> None:
        self.layout = layout
        self.part = part
        self.block_bytes = block_bytes
        self.read = read
        self.source = np.empty(block_bytes + block_bytes // 4, dtype=np.uint8)
        self.assembled = np.empty(block_bytes, dtype=np.uint8)
        self.converting = any(t.converting for t in layout.tensors)

    def split(self, block: Block) -> list[tuple[Block, Runs]]:
        """The block with its runs, or smaller blocks when it has more than :data:`MAX_RUNS` runs."""
        runs = runs_of(self.layout, self.part, block, None if max(block.source_size, block.size) <= MIN_BLOCK else MAX_RUNS)
        if runs is not None:
            return [(block, runs)]
        smaller = max(MIN_BLOCK, max(block.source_size, block.size) // 2)
        return [pair for half in blocks(self.layout, block.segments, smaller) for pair in self.split(half)]

    def runs(self, block: Block) -> Runs:
        runs = runs_of(self.layout, self.part, block)
        assert runs is not None
        return runs

    def target(self, block: Block, output: np.ndarray, runs: Runs | None = None) -> np.ndarray:
        """Where the block's runs are placed: ``output`` itself, or the assembly buffer when converting
        or when transposed views need scratch past the block."""
        scratch = 0 if runs is None else runs.scratch
        if not self.converting and not scratch:
            return output
        return self._grow("assembled", block.source_size + scratch)

    def fill(self, runs: Runs, target: np.ndarray) -> None:
        """Read the runs' shard bytes (coalesced) and place them in ``target``."""
        if not len(runs):
            return
        reads, positions = coalesce(runs, self.block_bytes // 4)
        source = self._grow("source", reads.total)
        for f, s, n, p in zip(reads.file.tolist(), reads.src.tolist(), reads.length.tolist(), reads.position.tolist()):
            self.read(f, s, source[p : p + n].data)
        place(source, positions, target, runs)

    def finish(self, block: Block, target: np.ndarray, output: np.ndarray, runs: Runs | None = None) -> np.ndarray:
        """The block's output bytes (transposed views moved in, converted from ``target`` when converting)."""
        if runs is not None and runs.transposes:
            for placed in runs.transposes:
                _place_transposed(target, placed)
            if not self.converting:
                output[: block.size] = target[: block.size]
        if self.converting:
            self._convert(block, target, output)
        return output[: block.size]

    def assemble(self, block: Block, output: np.ndarray, runs: Runs | None = None) -> np.ndarray:
        """The block's output bytes in ``output[:block.size]``."""
        runs = self.runs(block) if runs is None else runs
        target = self.target(block, output, runs)
        self.fill(runs, target)
        return self.finish(block, target, output, runs)

    def _grow(self, name: str, size: int) -> np.ndarray:
        buffer: np.ndarray = getattr(self, name)
        if len(buffer) < size:
            buffer = np.empty(size, dtype=np.uint8)
            setattr(self, name, buffer)
        return buffer

    def _convert(self, block: Block, assembled: np.ndarray, output: np.ndarray) -> None:
        position_in = position_out = 0
        for segment in block.segments:
            tensor = self.layout.tensors[segment.tensor]
            size_in, size_out = segment_bytes(self.layout, segment)
            source = assembled[position_in : position_in + size_in]
            target = output[position_out : position_out + size_out]
            if tensor.converting:
                convert(source.view(numpy_dtype(tensor.source_dtype)), target.view(numpy_dtype(tensor.dtype)))
            else:
                target[:] = source
            position_in += size_in
            position_out += size_out


_UNIT_TYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _place_transposed(buffer: np.ndarray, placed: Transpose) -> None:
    """One numpy copy: the saved-order box in scratch, transposed, into its strided place in the block."""
    kind = _UNIT_TYPES[placed.unit]
    count = math.prod(placed.saved_shape)
    source = buffer[placed.scratch : placed.scratch + count * placed.unit].view(kind).reshape(placed.saved_shape)
    shape = tuple(placed.saved_shape[a] for a in placed.axes)
    span = sum((n - 1) * step for n, step in zip(shape, placed.dst_strides)) + placed.unit
    region = buffer[placed.dst : placed.dst + span].view(kind)
    view = np.lib.stride_tricks.as_strided(region, shape=shape, strides=placed.dst_strides, writeable=True)
    np.copyto(view, source.transpose(placed.axes))


def block_budget(buffer_size: int, slots: int) -> int:
    """Block size such that ``slots`` output buffers, the source buffer and the assembly buffer fit ``buffer_size``."""
    return max(MIN_BLOCK, buffer_size // (slots + 3))


__all__ = [
    "Segment",
    "Block",
    "Direct",
    "Runs",
    "Assembler",
    "plan_item",
    "blocks",
    "direct_pieces",
    "runs_of",
    "coalesce",
    "place",
    "segment_bytes",
    "segment_offset",
    "block_budget",
    "check_saved_views",
]
