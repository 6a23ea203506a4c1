"""Runs: where the bytes of the pieces crossing a block come from and go to, vectorized (pure).

For a block, numpy computes over all the pieces that cross it at once the **runs**: contiguous byte
ranges that go from a shard file to a place in the block (a row-cut piece is one run; a column-cut
piece one run per row; a piece saved as a transposed view one box read in its saved order,
:class:`Transpose`). The cost is per block, never per piece in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .blocks import Block, segment_bytes
from .errors import InputError
from .layout import Layout
from .parts import Part
from .table import Pieces

#: Most runs one block may have; a block with more is split (bounds the index arrays).
MAX_RUNS = 1 << 18


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
    scratch_at = block.source_size
    parts: list[Runs] = []
    for s, p, lo, hi in zip(segment.tolist(), piece.tolist(), low.tolist(), high.tolist()):
        runs = _transposed_piece(layout, pieces, p, lo, hi, int(seg_low[s]), int(base[s]), scratch_at)
        parts.append(runs)
        scratch_at += runs.scratch
    return Runs.concat(parts)


def _transposed_piece(layout: Layout, pieces: Pieces, p: int, lo: int, hi: int, seg_low: int, base: int, scratch_at: int) -> Runs:
    """One transposed piece's rows ``[lo, hi)``: read in its saved order into scratch at ``scratch_at``,
    then put in place at ``base`` (the segment's first row being ``seg_low``)."""
    t = int(pieces.tensor[p])
    unit = int(layout.arrays.source_unit[t])
    shape = pieces.shape[p].copy()
    shape[0] = hi - lo
    assert pieces.stride is not None
    stride = pieces.stride[p]
    order, inner = _saved_order(layout, pieces, p, shape, stride)
    saved_shape, saved_stride = shape[list(order)], stride[list(order)]
    outer = saved_shape[:inner]
    run_units = int(np.prod(saved_shape[inner:]))
    start = int(pieces.begin[p]) + (lo - int(pieces.offset[p, 0])) * int(stride[0]) * unit
    grid = np.indices(tuple(int(x) for x in outer)).reshape(len(outer), -1) if inner else np.zeros((0, 1), dtype=np.int64)
    src = start + (saved_stride[:inner] @ grid) * unit if inner else np.array([start], dtype=np.int64)
    count = len(src)
    full_step = _output_steps(layout, t)
    first = np.array(pieces.offset[p], dtype=np.int64)
    first[0] = lo - seg_low
    placed = Transpose(
        scratch_at,
        tuple(int(x) for x in saved_shape),
        tuple(order.index(d) for d in range(len(order))),
        base + int(first @ full_step) * unit,
        tuple(int(x) * unit for x in full_step),
        unit,
    )
    return Runs(
        np.full(count, pieces.file[p], dtype=np.int64),
        src.astype(np.int64),
        scratch_at + np.arange(count, dtype=np.int64) * run_units * unit,
        np.full(count, run_units * unit, dtype=np.int64),
        np.full(count, pieces.holder[p], dtype=np.int64),
        (placed,),
        count * run_units * unit,
    )


def _saved_order(layout: Layout, pieces: Pieces, p: int, shape: np.ndarray, stride: np.ndarray) -> tuple[tuple[int, ...], int]:
    """The piece's dims from outermost to innermost as saved, and how many outer ones are read one run per
    index: saved dims from the innermost that the box spans whole (and that follow on) merge into one run."""
    order = tuple(sorted(range(len(shape)), key=lambda d: (-int(stride[d]) if shape[d] > 1 else 1, d)))
    saved_shape, saved_stride = shape[list(order)], stride[list(order)]
    if saved_shape[-1] > 1 and saved_stride[-1] != 1:
        raise InputError(
            f"tensor {layout.tensors[int(pieces.tensor[p])].name!r}: a piece saved with strides {stride.tolist()} has "
            "no contiguous dimension: mpicons cannot read this layout"
        )
    inner = len(order) - 1
    while (
        inner > 0
        and saved_shape[inner] == pieces.shape[p][order[inner]]
        and saved_stride[inner - 1] == saved_stride[inner] * saved_shape[inner]
    ):
        inner -= 1
    return order, inner


def _output_steps(layout: Layout, t: int) -> np.ndarray:
    """Units per step of each storage dim of tensor ``t`` in the output (its dims in the output's order)."""
    arrays = layout.arrays
    storage = np.array(layout.tensors[t].storage, dtype=np.int64)[None, :]
    out_storage = np.take_along_axis(storage, arrays.axes[t][None, :], axis=1)[0]
    out_step = np.ones(len(out_storage), dtype=np.int64)
    for d in range(len(out_storage) - 2, -1, -1):
        out_step[d] = out_step[d + 1] * out_storage[d + 1]
    full_step = np.empty_like(out_step)
    full_step[arrays.axes[t]] = out_step
    return full_step


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
    if innermost is None:
        innermost = _innermost(shape, offset, storage)
    piece_step, full_step = _steps(storage, shape, axes, strides)

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


def _steps(
    storage: np.ndarray, shape: np.ndarray, axes: np.ndarray | None, strides: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Units per step of each dimension, in each piece's own box (its ``strides`` when saved as a view)
    and in the full tensor (by storage dim, the output's order given by ``axes``)."""
    piece_step = np.ones_like(shape)
    full_step = np.ones_like(storage)
    out_storage = storage if axes is None else np.take_along_axis(storage, axes, axis=1)
    for d in range(storage.shape[1] - 2, -1, -1):
        piece_step[:, d] = piece_step[:, d + 1] * shape[:, d + 1]
        full_step[:, d] = full_step[:, d + 1] * out_storage[:, d + 1]
    if strides is not None:
        piece_step = strides
    if axes is not None:  # the output's steps, re-indexed by storage dim
        by_storage = np.empty_like(full_step)
        np.put_along_axis(by_storage, axes, full_step, axis=1)
        full_step = by_storage
    return piece_step, full_step


__all__ = ["MAX_RUNS", "Runs", "Transpose", "check_saved_views", "dense_from", "runs_of"]
