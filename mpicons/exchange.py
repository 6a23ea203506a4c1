"""Executing routed work (node-local shards): in-place copies, and blocks assembled from portions
read locally or received over MPI, in bounded buffers.

Every rank walks the blocks it takes part in in global order; as a reader it sends its portions
with non-blocking sends (a small window of buffers, so reading the next portion overlaps sending
the last), as a writer it posts every receive of a block first, reads its own portions while they
arrive, then assembles and writes. A rank that fails keeps playing its part without doing I/O, so
no other rank waits forever; the failure is raised when its share is done and agreed on as usual.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np
from mpi4py import MPI

from .convert import convert, numpy_dtype
from .copy import Executor, _Pieces, _Target
from .errors import Interrupted
from .io import MpiioOutput, PosixOutput, SourceFiles
from .interrupts import pending_signal
from .parallel import Comm
from .plan import Plan
from .routing import Routes

TAG = 29
SEND_WINDOW = 2


class ExchangeExecutor(Executor):
    """Runs this rank's part of :class:`~mpicons.routing.Routes` (``comm`` should be a private duplicate)."""

    def __init__(
        self,
        plan: Plan,
        routes: Routes,
        sources: SourceFiles,
        output: PosixOutput | MpiioOutput | None,
        block_bytes: int,
        comm: Comm,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(plan, sources, output, 2 * block_bytes, on_bytes)  # type: ignore[arg-type]
        self.block = np.empty(block_bytes, dtype=np.uint8)
        self.scratch = np.empty(block_bytes, dtype=np.uint8)
        converting = any(t.source_dtype != t.dtype for t in plan.tensors)
        self.converted = np.empty(block_bytes, dtype=np.uint8) if converting else self.block
        self.routes = routes
        self.comm = comm
        self.inbox = np.empty(len(self.block), dtype=np.uint8)
        self.outbox = [np.empty(len(self.block), dtype=np.uint8) for _ in range(SEND_WINDOW)]
        self.in_flight: deque[tuple[MPI.Request, int]] = deque()
        self.error: BaseException | None = None

    def _guard(self, action: Callable[[], None]) -> None:
        """Run an I/O action unless an earlier one failed; remember the first failure."""
        if self.error is not None:
            return
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - re-raised after the exchange completes
            self.error = exc

    def run_routes(self) -> int:
        me = self.comm.rank
        routes = self.routes
        written = 0
        for piece in routes.direct_piece[routes.direct_rank == me]:
            written += self._direct(int(piece))
        block_of_portion = np.repeat(np.arange(len(routes.block_writer)), np.diff(routes.portion_start))
        reading = np.unique(block_of_portion[routes.portion_reader == me])
        for block in np.union1d(np.nonzero(routes.block_writer == me)[0], reading):
            signum = pending_signal()
            if signum is not None and self.error is None:
                self.error = Interrupted(f"interrupted by {signum.name}")
            if routes.block_writer[block] == me:
                written += self._write_block(int(block))
            else:
                self._send_portions(int(block))
        while self.in_flight:
            self.in_flight.popleft()[0].Wait()
        if self.error is not None:
            raise self.error
        return written

    def _target(self, tensor_index: int) -> _Target:
        tensor = self.plan.tensors[tensor_index]
        dtypes = None
        if tensor.source_dtype != tensor.dtype:
            dtypes = (numpy_dtype(tensor.source_dtype), numpy_dtype(tensor.dtype))
        return _Target(tensor.file, tensor.source_unit, tensor.unit, dtypes)

    def _tensor_of_piece(self, piece: int) -> int:
        return int(np.searchsorted(self.plan.piece_start, piece, side="right") - 1)

    def _direct(self, piece: int) -> int:
        """A contiguous piece copied in place by a rank that can read it."""
        plan = self.plan
        t = self._tensor_of_piece(piece)
        tensor = plan.tensors[t]
        one = _Pieces(plan.piece_file[piece : piece + 1], plan.piece_begin[piece : piece + 1],
                      plan.piece_shape[piece : piece + 1], plan.piece_offset[piece : piece + 1])
        rows = int(one.shape[0, 0])
        start = int(one.offset[0, 0])
        row_elements = int(np.prod(tensor.storage[1:], dtype=np.int64))
        self._guard(lambda: self._copy_rows(self._target(t), tensor.offset, row_elements, one, start, start + rows))
        return rows * row_elements * tensor.unit

    def _portion(self, q: int) -> tuple[int, int, int, int]:
        """(source file, byte offset, byte length, first row) of portion ``q``."""
        plan, routes = self.plan, self.routes
        piece = int(routes.portion_piece[q])
        first, _ = routes.portion_rows[q]
        size = int(routes.portion_bytes[q])
        rows = int(routes.portion_rows[q, 1] - first)
        row_bytes = size // rows
        offset = int(plan.piece_begin[piece] + (first - plan.piece_offset[piece, 0]) * row_bytes)
        return int(plan.piece_file[piece]), offset, size, int(first)

    def _send_portions(self, block: int) -> None:
        routes = self.routes
        writer = int(routes.block_writer[block])
        for q in range(int(routes.portion_start[block]), int(routes.portion_start[block + 1])):
            if routes.portion_reader[q] != self.comm.rank:
                continue
            source, offset, size, _ = self._portion(q)
            if len(self.in_flight) == SEND_WINDOW:
                request, slot = self.in_flight.popleft()
                request.Wait()
            else:
                used = {slot for _, slot in self.in_flight}
                slot = next(i for i in range(SEND_WINDOW) if i not in used)
            buffer = _fit(self.outbox, slot, size)
            self._guard(lambda: self.sources.read_into(source, offset, memoryview(buffer)))
            self.in_flight.append((self.comm.Isend(buffer, dest=writer, tag=TAG), slot))

    def _write_block(self, block: int) -> int:
        plan, routes, me = self.plan, self.routes, self.comm.rank
        t = int(routes.block_tensor[block])
        tensor = plan.tensors[t]
        target = self._target(t)
        row_begin, row_end = (int(x) for x in routes.block_rows[block])
        rows = row_end - row_begin
        row_elements = int(np.prod(tensor.storage[1:], dtype=np.int64))
        portions = range(int(routes.portion_start[block]), int(routes.portion_start[block + 1]))
        total_in = sum(int(routes.portion_bytes[q]) for q in portions if routes.portion_reader[q] != me)
        inbox = self.inbox if total_in <= len(self.inbox) else np.empty(total_in, dtype=np.uint8)
        received, requests, position = {}, [], 0
        for q in portions:
            if routes.portion_reader[q] != me:
                size = int(routes.portion_bytes[q])
                received[q] = inbox[position : position + size]
                requests.append(self.comm.Irecv(received[q], source=int(routes.portion_reader[q]), tag=TAG))
                position += size
        size_in = rows * row_elements * target.unit_in
        block_buffer = self.block if size_in <= len(self.block) else np.empty(size_in, dtype=np.uint8)
        assembled = block_buffer[:size_in].reshape((rows, *tensor.storage[1:], target.unit_in))

        def place(q: int, chunk: np.ndarray) -> None:
            piece = int(routes.portion_piece[q])
            first, last = (int(x) for x in routes.portion_rows[q])
            shape, offset = plan.piece_shape[piece], plan.piece_offset[piece]
            region = (slice(first - row_begin, last - row_begin),) + tuple(
                slice(int(o), int(o + s)) for o, s in zip(offset[1:], shape[1:])
            )
            assembled[region] = chunk.reshape((last - first, *(int(s) for s in shape[1:]), target.unit_in))

        for q in portions:
            if routes.portion_reader[q] == me:
                source, offset, size, _ = self._portion(q)
                chunk = self.scratch[:size] if size <= len(self.scratch) else np.empty(size, dtype=np.uint8)
                self._guard(lambda: self.sources.read_into(source, offset, memoryview(chunk)))
                if self.error is None:
                    place(q, chunk)
        MPI.Request.Waitall(requests)
        for q, chunk in received.items():
            if self.error is None:
                place(q, chunk)
        out = block_buffer[:size_in]
        if target.dtypes is not None and self.error is None:
            size_out = rows * row_elements * target.unit_out
            converted = self.converted if size_out <= len(self.converted) else np.empty(size_out, dtype=np.uint8)
            out = converted[:size_out]
            convert(block_buffer[:size_in].view(target.dtypes[0]), out.view(target.dtypes[1]))
        base = tensor.offset + row_begin * row_elements * target.unit_out
        self._guard(lambda: self.output.write(target.file, base, memoryview(out)))  # type: ignore[union-attr]
        self.on_bytes(len(out))
        return len(out)


def _fit(pool: list[np.ndarray], slot: int, size: int) -> np.ndarray:
    """A send buffer of ``size`` bytes from ``pool[slot]``, grown for a single row larger than a block."""
    if size > len(pool[slot]):
        pool[slot] = np.empty(size, dtype=np.uint8)
    return pool[slot][:size]
