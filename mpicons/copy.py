"""Executing one rank's share of a plan: every output byte written once, memory bounded.

A piece that lands contiguously in the output (it spans the full trailing dimensions, e.g.
row-sharded or whole) is copied file to file. Anything else (column- or 2-D-sharded, or a
dtype conversion) is assembled block of rows by block of rows in a reusable buffer with numpy
strided copies, then written as one large write. Rows larger than the buffer are split recursively.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .convert import convert, numpy_dtype
from .io import MpiioOutput, PosixOutput, SourceFiles
from .plan import Plan, WorkItem

#: Smallest useful assembly buffer; keeps every storage unit (≤ 8 bytes) inside one block.
MIN_BUFFER = 1 << 16
#: Contiguous copies are issued in steps of this size so progress and signals are seen often.
COPY_CHUNK = 256 << 20


@dataclass(frozen=True)
class _Target:
    """Where one tensor goes and how its units change on the way."""

    file: int
    unit_in: int
    unit_out: int
    dtypes: tuple[np.dtype, np.dtype] | None  # (source, output) when converting


@dataclass(frozen=True)
class _Pieces:
    """Pieces (or row slices of pieces) of one region, in storage units; ``begin`` in source bytes."""

    src: np.ndarray
    begin: np.ndarray
    shape: np.ndarray
    offset: np.ndarray

    def select(self, mask: np.ndarray) -> "_Pieces":
        return _Pieces(self.src[mask], self.begin[mask], self.shape[mask], self.offset[mask])


class _Background:
    """Up to ``workers`` posix I/O calls in flight on threads (the syscalls release the GIL).

    With no workers every call runs inline. ``drain`` waits for everything submitted and raises the
    first failure.
    """

    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="mpicons-io") if workers else None
        self.pending: deque[Future[None]] = deque()

    def submit(self, action: Callable[..., None], *args: object) -> Future[None] | None:
        if self.pool is None:
            action(*args)
            return None
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()
        future = self.pool.submit(action, *args)
        self.pending.append(future)
        return future

    def drain(self) -> None:
        first: BaseException | None = None
        while self.pending:
            try:
                self.pending.popleft().result()
            except BaseException as exc:  # noqa: BLE001 - every call is waited for before raising
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)


class Executor:
    """Writes work items of a plan through an output backend, within ``buffer_size`` of buffers.

    With the posix backend, writes and kernel copies run on ``io_threads`` background threads
    while the main thread reads and assembles the next block (two assembly buffers alternate).
    """

    def __init__(
        self,
        plan: Plan,
        sources: SourceFiles,
        output: PosixOutput | MpiioOutput,
        buffer_size: int,
        on_bytes: Callable[[int], None] | None = None,
        io_threads: int = 0,
    ) -> None:
        converting = any(t.source_dtype != t.dtype for t in plan.tensors)
        threads = io_threads if output.name == "posix" else 0
        slots = 2 if threads else 1
        share = max(MIN_BUFFER, buffer_size // (1 + slots * (2 if converting else 1)))
        self.plan = plan
        self.sources = sources
        self.output = output
        self.blocks = [np.empty(share, dtype=np.uint8) for _ in range(slots)]
        self.outs = [np.empty(share, dtype=np.uint8) for _ in range(slots)] if converting else self.blocks
        self.slot_busy: list[Future[None] | None] = [None] * slots
        self.slot = 0
        self.block = self.blocks[0]
        self.scratch = np.empty(share, dtype=np.uint8)
        self.converted = self.outs[0]
        self.on_bytes = on_bytes or (lambda n: None)
        self.background = _Background(threads)
        self._bounce = threading.local()
        sources.before_close = self.background.drain
        output.before_close = self.background.drain

    def run(self, items: list[WorkItem]) -> int:
        """Write ``items``; returns the number of output bytes written."""
        written = 0
        try:
            for item in items:
                self.write_item(item)
                written += self.plan.item_bytes(item)
        finally:
            self.background.close()
        return written

    def _bounce_buffer(self) -> np.ndarray:
        """A per-thread buffer for copies the kernel cannot do (allocated only if needed)."""
        if threading.current_thread() is threading.main_thread():
            return self.scratch
        buffer = getattr(self._bounce, "buffer", None)
        if buffer is None:
            buffer = self._bounce.buffer = np.empty(len(self.scratch), dtype=np.uint8)
        return buffer

    def _copy(self, src: int, source: int, file: int, destination: int, length: int) -> None:
        self.output.copy(self.sources, src, source, file, destination, length, self._bounce_buffer())

    def write_item(self, item: WorkItem) -> None:
        plan = self.plan
        tensor = plan.tensors[item.tensor]
        lo, hi = plan.piece_start[item.tensor], plan.piece_start[item.tensor + 1]
        dtypes = None
        if tensor.source_dtype != tensor.dtype:
            dtypes = (numpy_dtype(tensor.source_dtype), numpy_dtype(tensor.dtype))
        target = _Target(tensor.file, tensor.source_unit, tensor.unit, dtypes)
        pieces = _Pieces(plan.piece_file[lo:hi], plan.piece_begin[lo:hi], plan.piece_shape[lo:hi], plan.piece_offset[lo:hi])
        self._fill(target, tensor.offset, tensor.storage, pieces, item.row_begin, item.row_end)

    def _fill(self, target: _Target, base: int, storage: tuple[int, ...], pieces: _Pieces, row_begin: int, row_end: int) -> None:
        """Write rows [row_begin, row_end) of a region of shape ``storage`` whose row 0 is at ``base``."""
        row_elements = int(np.prod(storage[1:], dtype=np.int64))
        hit = (pieces.offset[:, 0] < row_end) & (pieces.offset[:, 0] + pieces.shape[:, 0] > row_begin)
        pieces = pieces.select(hit)
        full_width = bool(np.all(pieces.shape[:, 1:] == np.asarray(storage[1:])))
        if full_width and target.dtypes is None:
            self._copy_rows(target, base, row_elements, pieces, row_begin, row_end)
        elif row_elements * max(target.unit_in, target.unit_out) <= len(self.block):
            self._assemble(target, base, storage, pieces, row_begin, row_end)
        else:
            piece_row_bytes = np.prod(pieces.shape[:, 1:], axis=1) * target.unit_in
            for row in range(row_begin, row_end):
                inside = (pieces.offset[:, 0] <= row) & (row < pieces.offset[:, 0] + pieces.shape[:, 0])
                part = pieces.select(inside)
                sliced = _Pieces(
                    part.src,
                    part.begin + (row - part.offset[:, 0]) * piece_row_bytes[inside],
                    part.shape[:, 1:],
                    part.offset[:, 1:],
                )
                self._fill(target, base + row * row_elements * target.unit_out, storage[1:], sliced, 0, storage[1])

    def _copy_rows(self, target: _Target, base: int, row_elements: int, pieces: _Pieces, row_begin: int, row_end: int) -> None:
        """Pieces spanning the full trailing dimensions, same dtype: one file-to-file copy each."""
        row_bytes = row_elements * target.unit_in
        first = np.maximum(pieces.offset[:, 0], row_begin)
        last = np.minimum(pieces.offset[:, 0] + pieces.shape[:, 0], row_end)
        for i in range(len(pieces.src)):
            length = int(last[i] - first[i]) * row_bytes
            source = int(pieces.begin[i] + (first[i] - pieces.offset[i, 0]) * row_bytes)
            destination = base + int(first[i]) * row_bytes
            if self.background.pool is not None:  # handles are opened here, not on the I/O threads
                self.sources.fd(int(pieces.src[i]))
                self.output.open(target.file)  # type: ignore[union-attr]
            for start in range(0, length, COPY_CHUNK):
                step = min(COPY_CHUNK, length - start)
                self.background.submit(self._copy, int(pieces.src[i]), source + start, target.file, destination + start, step)
                self.on_bytes(step)

    def _assemble(self, target: _Target, base: int, storage: tuple[int, ...], pieces: _Pieces, row_begin: int, row_end: int) -> None:
        """Blocks of rows built in the buffer from every piece they cross, then one write per block."""
        row_elements = int(np.prod(storage[1:], dtype=np.int64))
        rows_per_block = len(self.block) // (row_elements * max(target.unit_in, target.unit_out))
        piece_row_bytes = np.prod(pieces.shape[:, 1:], axis=1) * target.unit_in
        for block_begin in range(row_begin, row_end, rows_per_block):
            block_end = min(row_end, block_begin + rows_per_block)
            rows = block_end - block_begin
            size_in = rows * row_elements * target.unit_in
            self._next_slot()
            block = self.block[:size_in].reshape((rows, *storage[1:], target.unit_in))
            first = np.maximum(pieces.offset[:, 0], block_begin)
            last = np.minimum(pieces.offset[:, 0] + pieces.shape[:, 0], block_end)
            for i in np.nonzero(last > first)[0]:
                count = int(last[i] - first[i])
                chunk = self.scratch[: count * int(piece_row_bytes[i])]
                offset = int(pieces.begin[i] + (first[i] - pieces.offset[i, 0]) * piece_row_bytes[i])
                self.sources.read_into(int(pieces.src[i]), offset, memoryview(chunk))
                region = (slice(int(first[i]) - block_begin, int(last[i]) - block_begin),) + tuple(
                    slice(int(o), int(o + s)) for o, s in zip(pieces.offset[i, 1:], pieces.shape[i, 1:])
                )
                block[region] = chunk.reshape((count, *(int(s) for s in pieces.shape[i, 1:]), target.unit_in))
            out = self.block[:size_in]
            if target.dtypes is not None:
                source_dtype, output_dtype = target.dtypes
                out = self.converted[: rows * row_elements * target.unit_out]
                convert(self.block[:size_in].view(source_dtype), out.view(output_dtype))
            if self.background.pool is not None:
                self.output.open(target.file)  # type: ignore[union-attr]
            self.slot_busy[self.slot] = self.background.submit(
                self.output.write, target.file, base + block_begin * row_elements * target.unit_out, memoryview(out)
            )
            self.on_bytes(len(out))

    def _next_slot(self) -> None:
        """Switch to the other assembly buffer, waiting until its last write has finished."""
        self.slot = (self.slot + 1) % len(self.blocks)
        busy = self.slot_busy[self.slot]
        if busy is not None:
            busy.result()
            self.slot_busy[self.slot] = None
        self.block = self.blocks[self.slot]
        self.converted = self.outs[self.slot]
