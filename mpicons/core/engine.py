"""The geometry engine: a block's shard bytes read, placed and converted, with cost per block, not per piece.

A rank's rows are cut into blocks (:mod:`.blocks`); for each, :mod:`.runs` gives the contiguous
byte ranges from shard files into it. Here the runs are coalesced into one large read per
contiguous region of each shard file (the pieces of consecutive tensors sit together in a shard),
and placed into the block by one numpy gather (long runs one by one). Conversion (``--dtype``) then
turns the block into output bytes. Writing the block, or comparing it (``verify``), or sending
portions of it (node-local shards) is the caller's business: this module only knows geometry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .blocks import MIN_BLOCK, Block, Segment, blocks, segment_bytes, segment_span
from .convert import convert, numpy_dtype
from .layout import Layout, Tensor
from .parts import Part
from .runs import MAX_RUNS, Runs, Transpose, runs_of
from .values import Merge, Scratch, apply_value, value_regions

#: Runs at least this long are copied one by one (a slice copy costs about a microsecond, so the loop
#: adds at most half to the copying); shorter ones go in one numpy gather per block.
LONG_RUN = 2 << 10
#: Shard reads of one block merge across gaps up to this size (less seeking, some bytes read twice).
READ_GAP = 64 << 10


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
        self.scratch = Scratch()  # the value ops' work arrays, kept from block to block

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
            if tensor.value is not None:
                self._apply(tensor, segment, source, target)
            elif tensor.converting:
                convert(source.view(numpy_dtype(tensor.source_dtype)), target.view(numpy_dtype(tensor.dtype)))
            else:
                target[:] = source
            position_in += size_in
            position_out += size_out

    def _apply(self, tensor: Tensor, segment: Segment, source: np.ndarray, target: np.ndarray) -> None:
        """The segment's values through the tensor's value op (a 2-D tensor: rows, or a stretch of one row)."""
        assert tensor.value is not None and self.part.auxiliary is not None, tensor.name
        width = tensor.storage[1]
        rows, cols = segment_span(self.layout, segment)
        values = source.view(numpy_dtype(tensor.source_dtype)).reshape(rows[1] - rows[0], cols[1] - cols[0])
        output = target.view(numpy_dtype(tensor.dtype)).reshape(values.shape)
        whole_rows = isinstance(tensor.value, Merge) and tensor.value.magnitude is not None
        for (r0, r1), (c0, c1) in value_regions(rows, cols, width, whole_rows):
            region = (slice(r0 - rows[0], r1 - rows[0]), slice(c0 - cols[0], c1 - cols[0]))
            apply_value(tensor.value, values[region], (r0, r1), (c0, c1), self.part.auxiliary, output[region], self.scratch)


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


__all__ = ["LONG_RUN", "READ_GAP", "Assembler", "Reads", "coalesce", "place"]
