"""Writing one rank's part: large contiguous pieces copied file to file, everything else assembled
block by block (:mod:`mpicons.core.blocks`, :mod:`mpicons.core.engine`) and written with one large write per block.

With the posix backend, writes and kernel copies run on background threads while the main
thread reads and assembles the next block (two output buffers alternate), so reading, placing
and writing overlap.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..comm.agreement import Comm, wait_for_all
from ..comm.interrupts import deferred, raise_pending, raising_inside
from ..core.blocks import Direct, Segment, block_budget, blocks, direct_pieces, plan_item
from ..core.engine import Assembler
from ..core.layout import Layout
from ..core.options import Tuning
from ..core.parts import Part
from ..io.outputs import OutputBackend
from ..io.sources import SourceFiles
from .exchange import ExchangeWriter
from .progress import Progress
from .resumption import Resume
from .scan import Scanned

#: Contiguous copies are issued in steps of this size so progress and signals are seen often.
COPY_CHUNK = 256 << 20


def _no_hook(size: int) -> None:
    pass


#: Called with each assembled block's size before it is assembled; tests replace it to slow, hold or
#: stop a rank mid-write.
block_hook: Callable[[int], None] = _no_hook


class Background:
    """Up to ``workers`` I/O calls in flight on threads (the syscalls release the GIL).

    With no workers every call runs inline. ``drain`` waits for everything submitted and raises the
    first failure.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
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


class Writer:
    """Writes a part of a layout through an output backend, within about ``buffer_size`` bytes of buffers."""

    def __init__(
        self,
        layout: Layout,
        part: Part,
        sources: SourceFiles,
        output: OutputBackend,
        buffer_size: int,
        on_bytes: Callable[[int], None] | None = None,
        io_threads: int = 0,
        resume: Resume | None = None,
    ) -> None:
        threads = io_threads if output.threaded else 0
        self.resume = resume
        slots = 2 if threads else 1
        self.layout = layout
        self.part = part
        self.sources = sources
        self.output = output
        self.block_bytes = block_budget(buffer_size, slots)
        self.assembler = Assembler(layout, part, self.block_bytes, sources.read_into)
        self.slots = [np.empty(self.block_bytes, dtype=np.uint8) for _ in range(slots)]
        self.busy: list[Future[None] | None] = [None] * slots
        self.slot = 0
        self.on_bytes = on_bytes or (lambda n: None)
        self.background = Background(threads)
        self._bounce = threading.local()
        sources.before_close = self.background.drain
        output.before_close = self.background.drain
        self.written = 0

    def run(self) -> int:
        """Write every item of the part; returns the number of output bytes written."""
        direct = direct_pieces(self.layout, self.part)
        pending: list[Segment] = []
        try:
            for item in self.part.items:
                copies, segments = plan_item(self.layout, self.part, item, direct)
                if copies:  # keep output order: what came before goes first
                    ordered = sorted(
                        [(c.offset, c) for c in copies] + [(self._offset(s), s) for s in segments], key=lambda x: x[0]
                    )
                    for _, unit in ordered:
                        if isinstance(unit, Direct):
                            self._write_segments(pending)
                            pending = []
                            self._copy(unit)
                        else:
                            pending.append(unit)
                else:
                    pending.extend(segments)
            self._write_segments(pending)
        finally:
            self.background.close()
        return self.written

    def _offset(self, segment: Segment) -> int:
        tensor = self.layout.tensors[segment.tensor]
        return tensor.offset + segment.row_begin * tensor.row_bytes

    def _write_segments(self, segments: list[Segment]) -> None:
        for whole in blocks(self.layout, segments, self.block_bytes):
            for block, runs in self.assembler.split(whole):
                if self.resume is not None and self.resume.skip(block.file, block.offset, block.size):
                    self.on_bytes(block.size)
                    continue
                block_hook(block.size)
                buffer = self._next_slot(block.size)
                data = self.assembler.assemble(block, buffer, runs)
                if self.background.pool is not None:
                    self.output.open(block.file)
                self.busy[self.slot] = self.background.submit(self.output.write, block.file, block.offset, data.data)
                self.on_bytes(block.size)
                self.written += block.size
                self._wrote(block.file, block.offset, block.size)

    def _wrote(self, file: int, offset: int, length: int) -> None:
        """Note a range submitted for writing; now and then record what is durable (write-ahead: the
        bytes are flushed first, by the I/O thread after the writes before it, or here after a drain)."""
        if self.resume is None or not self.resume.wrote(file, offset, length):
            return
        record = self.resume.record_task()
        if self.background.workers == 1:
            self.background.submit(record)  # one I/O thread runs its calls in order
        else:
            self.background.drain()
            record()

    def _next_slot(self, size: int) -> np.ndarray:
        """The other output buffer, once its last write has finished (grown for an oversized block)."""
        self.slot = (self.slot + 1) % len(self.slots)
        busy = self.busy[self.slot]
        if busy is not None:
            busy.result()
            self.busy[self.slot] = None
        if len(self.slots[self.slot]) < size:
            self.slots[self.slot] = np.empty(size, dtype=np.uint8)
        return self.slots[self.slot]

    def _bounce_buffer(self) -> np.ndarray:
        """A per-thread buffer for copies the kernel cannot do (allocated only if needed)."""
        buffer = getattr(self._bounce, "buffer", None)
        if buffer is None:
            buffer = self._bounce.buffer = np.empty(self.block_bytes, dtype=np.uint8)
        return buffer

    def _copy(self, copy: Direct) -> None:
        if self.background.pool is not None:  # handles are opened here, not on the I/O threads
            if self.sources.local:
                self.sources.fd(copy.file)
            self.output.open(copy.out)
        for start in range(0, copy.length, COPY_CHUNK):
            step = min(COPY_CHUNK, copy.length - start)
            if self.resume is not None and self.resume.skip(copy.out, copy.offset + start, step):
                self.on_bytes(step)
                continue
            self.background.submit(self._copy_step, copy.file, copy.src + start, copy.out, copy.offset + start, step)
            self.on_bytes(step)
            self.written += step
            self._wrote(copy.out, copy.offset + start, step)

    def _copy_step(self, file: int, src: int, out: int, offset: int, length: int) -> None:
        self.output.copy(self.sources, file, src, out, offset, length, self._bounce_buffer())


def write_share(
    comm: Comm,
    scanned: Scanned,
    layout: Layout,
    part: Part,
    sources: SourceFiles,
    output: OutputBackend,
    tuning: Tuning,
    resume: Resume | None = None,
) -> tuple[int, int]:
    """This rank's share of the writing (bytes written, bytes sent); with progress, reports flow to rank 0
    meanwhile. ``resume``: blocks an earlier run made durable are skipped, and what is durable is recorded
    (the plain writer only: an exchanging job is never continued). Every rank calls this, in a phase
    agreed with ``collective=True``: making the progress channel is a collective call."""
    exchanging = not scanned.shared or tuning.gather_to is not None
    # Making the channel and the reporter, and their teardown, are a protocol every rank must complete:
    # a signal stops only the writing itself (the exchange polls for signals between its blocks).
    with deferred():
        channel = comm.duplicate() if tuning.progress or exchanging else comm
        reporter = Progress(channel, layout.total_bytes, tuning.progress, verbose=tuning.verbose) if tuning.progress else None
        on_bytes = reporter.add if reporter is not None else None
        stopped = True  # until the share is done: a signal or an error on the way is no completion
        try:
            if not exchanging:
                with raising_inside():
                    raise_pending()
                    written = Writer(layout, part, sources, output, tuning.buffer_size, on_bytes, tuning.io_threads, resume).run()
                stopped = False
                return written, 0
            writer = ExchangeWriter(
                layout,
                part,
                scanned.files,
                sources,
                output,
                tuning.buffer_size,
                channel,
                on_bytes,
                # An object store's parts are each one rank's, filled in order: no copies handed to
                # another rank, none left for the end (a part's buffer would wait for them).
                delegate=tuning.gather_to is None and output.any_rank_writes,
                copies=output.any_rank_writes,
            )
            written = writer.run()
            stopped = False
            return written, writer.sent
        finally:
            # Always report the end, also after a failure, so rank 0 never waits for a report that will not come.
            if reporter is not None:
                reporter.finish(stopped)
            wait_for_all(channel)
            if channel is not comm:
                channel.free()
