"""Blocks: a rank's rows of the output cut into stretches of one file of at most a few MB (pure).

A block is made of **segments** (rows of one tensor); a piece that is large, contiguous in the
output and unconverted (row-sharded matrices) is not assembled at all but copied file to file
(:class:`Direct`, :data:`DIRECT_MIN`). :mod:`.runs` says where each piece's bytes go in a block;
:mod:`.engine` assembles it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .layout import Layout, Tensor, WorkItem
from .parts import Part

#: A contiguous, unconverted piece at least this large is copied file to file instead of assembled.
DIRECT_MIN = 1 << 20
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


# ---------------------------------------------------------------- sizes


def _row_units(tensor: Tensor, level: int) -> int:
    return math.prod(tensor.storage[level + 1 :])


def segment_bytes(layout: Layout, segment: Segment) -> tuple[int, int]:
    """(source bytes, output bytes) of a segment."""
    tensor = layout.tensors[segment.tensor]
    units = (segment.row_end - segment.row_begin) * _row_units(tensor, len(segment.prefix))
    return units * tensor.source_unit, units * tensor.unit


def segment_span(layout: Layout, segment: Segment) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows and columns a segment of a 2-D tensor covers: whole rows, or a stretch of one row."""
    if segment.prefix:
        return (segment.prefix[0], segment.prefix[0] + 1), (segment.row_begin, segment.row_end)
    return (segment.row_begin, segment.row_end), (0, layout.tensors[segment.tensor].storage[1])


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


def block_budget(buffer_size: int, slots: int) -> int:
    """Block size such that ``slots`` output buffers, the source buffer and the assembly buffer fit ``buffer_size``."""
    return max(MIN_BLOCK, buffer_size // (slots + 3))


__all__ = [
    "DIRECT_MIN",
    "MIN_BLOCK",
    "Block",
    "Direct",
    "Segment",
    "block_budget",
    "blocks",
    "direct_pieces",
    "plan_item",
    "segment_bytes",
    "segment_offset",
    "split_segment",
]
