"""Executing one rank's share of a plan: every output byte written once, memory bounded.

A piece that lands contiguously in the output (it spans the full trailing dimensions, e.g.
row-sharded or whole) is copied file to file. Anything else (column- or 2-D-sharded) is
assembled block of rows by block of rows in a reusable buffer with numpy strided copies,
then written as one large write. Rows larger than the buffer are split recursively.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .io import MpiioOutput, PosixOutput, SourceFiles
from .plan import Plan, WorkItem

#: Smallest useful assembly buffer; keeps every storage unit (≤ 8 bytes) inside one block.
MIN_BUFFER = 1 << 16
#: Contiguous copies are issued in steps of this size so progress and signals are seen often.
COPY_CHUNK = 256 << 20


class Executor:
    """Writes work items of a plan through an output backend, with two buffers of ``buffer_size / 2``."""

    def __init__(
        self,
        plan: Plan,
        sources: SourceFiles,
        output: PosixOutput | MpiioOutput,
        buffer_size: int,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        half = max(MIN_BUFFER, buffer_size // 2)
        self.plan = plan
        self.sources = sources
        self.output = output
        self.block = np.empty(half, dtype=np.uint8)
        self.scratch = np.empty(half, dtype=np.uint8)
        self.on_bytes = on_bytes or (lambda n: None)

    def run(self, items: list[WorkItem]) -> int:
        """Write ``items``; returns the number of output bytes written."""
        written = 0
        for item in items:
            self.write_item(item)
            written += self.plan.item_bytes(item)
        return written

    def write_item(self, item: WorkItem) -> None:
        plan = self.plan
        tensor = plan.tensors[item.tensor]
        lo, hi = plan.piece_start[item.tensor], plan.piece_start[item.tensor + 1]
        self._fill(
            tensor.file,
            tensor.offset,
            tensor.storage,
            tensor.unit,
            plan.piece_file[lo:hi],
            plan.piece_begin[lo:hi],
            plan.piece_shape[lo:hi],
            plan.piece_offset[lo:hi],
            item.row_begin,
            item.row_end,
        )

    def _fill(
        self,
        file: int,
        base: int,
        storage: tuple[int, ...],
        unit: int,
        src: np.ndarray,
        begin: np.ndarray,
        shape: np.ndarray,
        offset: np.ndarray,
        row_begin: int,
        row_end: int,
    ) -> None:
        """Write rows [row_begin, row_end) of a region of shape ``storage`` whose row 0 is at ``base``."""
        row_bytes = int(np.prod(storage[1:], dtype=np.int64)) * unit
        piece_row_bytes = np.prod(shape[:, 1:], axis=1) * unit
        hit = (offset[:, 0] < row_end) & (offset[:, 0] + shape[:, 0] > row_begin)
        src, begin, shape, offset, piece_row_bytes = src[hit], begin[hit], shape[hit], offset[hit], piece_row_bytes[hit]
        if np.all(shape[:, 1:] == np.asarray(storage[1:])):
            self._copy_rows(file, base, row_bytes, src, begin, shape, offset, piece_row_bytes, row_begin, row_end)
        elif row_bytes <= len(self.block):
            self._assemble(file, base, storage, unit, row_bytes, src, begin, shape, offset, piece_row_bytes, row_begin, row_end)
        else:
            for row in range(row_begin, row_end):
                inside = (offset[:, 0] <= row) & (row < offset[:, 0] + shape[:, 0])
                self._fill(
                    file,
                    base + row * row_bytes,
                    storage[1:],
                    unit,
                    src[inside],
                    begin[inside] + (row - offset[inside, 0]) * piece_row_bytes[inside],
                    shape[inside, 1:],
                    offset[inside, 1:],
                    0,
                    storage[1],
                )

    def _copy_rows(
        self,
        file: int,
        base: int,
        row_bytes: int,
        src: np.ndarray,
        begin: np.ndarray,
        shape: np.ndarray,
        offset: np.ndarray,
        piece_row_bytes: np.ndarray,
        row_begin: int,
        row_end: int,
    ) -> None:
        """Pieces spanning the full trailing dimensions: one file-to-file copy each."""
        first = np.maximum(offset[:, 0], row_begin)
        last = np.minimum(offset[:, 0] + shape[:, 0], row_end)
        for i in range(len(src)):
            length = int(last[i] - first[i]) * row_bytes
            source = int(begin[i] + (first[i] - offset[i, 0]) * piece_row_bytes[i])
            target = base + int(first[i]) * row_bytes
            for start in range(0, length, COPY_CHUNK):
                step = min(COPY_CHUNK, length - start)
                self.output.copy(self.sources, int(src[i]), source + start, file, target + start, step, self.scratch)
                self.on_bytes(step)

    def _assemble(
        self,
        file: int,
        base: int,
        storage: tuple[int, ...],
        unit: int,
        row_bytes: int,
        src: np.ndarray,
        begin: np.ndarray,
        shape: np.ndarray,
        offset: np.ndarray,
        piece_row_bytes: np.ndarray,
        row_begin: int,
        row_end: int,
    ) -> None:
        """Blocks of rows built in the buffer from every piece they cross, then one write per block."""
        rows_per_block = len(self.block) // row_bytes
        for block_begin in range(row_begin, row_end, rows_per_block):
            block_end = min(row_end, block_begin + rows_per_block)
            rows = block_end - block_begin
            block = self.block[: rows * row_bytes].reshape((rows, *storage[1:], unit))
            first = np.maximum(offset[:, 0], block_begin)
            last = np.minimum(offset[:, 0] + shape[:, 0], block_end)
            for i in np.nonzero(last > first)[0]:
                count = int(last[i] - first[i])
                nbytes = count * int(piece_row_bytes[i])
                chunk = self.scratch[:nbytes]
                self.sources.read_into(int(src[i]), int(begin[i] + (first[i] - offset[i, 0]) * piece_row_bytes[i]), memoryview(chunk))
                target = (slice(int(first[i]) - block_begin, int(last[i]) - block_begin),) + tuple(
                    slice(int(o), int(o + s)) for o, s in zip(offset[i, 1:], shape[i, 1:])
                )
                block[target] = chunk.reshape((count, *(int(s) for s in shape[i, 1:]), unit))
            self.output.write(file, base + block_begin * row_bytes, memoryview(self.block[: rows * row_bytes]))
            self.on_bytes(rows * row_bytes)
