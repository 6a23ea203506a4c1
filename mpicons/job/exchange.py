"""Writing a part when not every rank can read every shard file (node-local disks), or when one rank
writes everything (``--gather-to``): bytes a writer cannot read come from a rank that can, one
message per block per reader.

Before writing, each writer computes its blocks (:mod:`mpicons.core.blocks`), and for every block and
every rank holding some of its bytes, the coalesced reads that rank must do; one Alltoallv hands
every rank its requests. Large contiguous pieces are copied file to file by a rank that can read
them (delegated with a second Alltoallv) unless the output is gathered on one rank.

Blocks are numbered ``index · size + writer`` (the writers' blocks interleaved) and every rank
handles the blocks it takes part in, as writer or reader, in that order: the rank at the smallest
unfinished number can always progress, so the exchange cannot deadlock, and messages between two
ranks are sent and expected in the same order (one tag). A rank whose I/O fails, or that gets a
signal, keeps its part of the message pattern without doing I/O and raises at the end.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable

import numpy as np

from ..comm import Request, wait_all
from ..comm.agreement import Comm
from ..comm.base import EXCHANGE_TAG
from ..comm.interrupts import deferred, pending_signal, raise_pending, raising_inside
from ..core.blocks import Block, Direct, Segment, block_budget, blocks, direct_pieces, plan_item
from ..core.engine import Assembler, coalesce, place
from ..core.errors import Interrupted, MpiconsError
from ..core.layout import Layout
from ..core.parts import Part
from ..core.runs import Runs
from ..core.table import ShardFiles
from ..io.outputs import OutputBackend
from ..io.sources import SourceFiles
from .scan import Scanned, exchange

SEND_WINDOW = 2
_REQUEST = np.dtype([("key", "<i8"), ("writer", "<i4"), ("file", "<i4"), ("src", "<i8"), ("length", "<i8")])
_DIRECT = np.dtype([("file", "<i4"), ("out", "<i4"), ("src", "<i8"), ("offset", "<i8"), ("length", "<i8")])


class ExchangeWriter:
    """Writes (or hands to ``sink``) this rank's part and serves other ranks' reads (``comm``: a private duplicate)."""

    def __init__(
        self,
        layout: Layout,
        part: Part,
        files: ShardFiles,
        sources: SourceFiles,
        output: OutputBackend | None,
        buffer_size: int,
        comm: Comm,
        on_bytes: Callable[[int], None] | None = None,
        delegate: bool = True,
        sink: Callable[[Block, np.ndarray], None] | None = None,
        copies: bool = True,
    ) -> None:
        self.layout = layout
        #: What happens to a finished block (default: written to the output); ``copies=False`` assembles everything.
        self.sink = sink or self._write_out
        self.allow_copies = copies
        self.part = part
        self.sources = sources
        self.output = output
        self.comm = comm
        self.on_bytes = on_bytes or (lambda n: None)
        self.delegate = delegate
        # Buffers: two blocks to send, one received, one output, and the assembler's.
        self.block_bytes = block_budget(buffer_size, 4)
        self.assembler = Assembler(layout, part, self.block_bytes, sources.read_into)
        self.out = np.empty(self.block_bytes, dtype=np.uint8)
        self.inbox = np.empty(self.block_bytes, dtype=np.uint8)
        self.outbox = [np.empty(self.block_bytes, dtype=np.uint8) for _ in range(SEND_WINDOW)]
        self.in_flight: deque[tuple[Request, int]] = deque()
        me = comm.rank
        holders = files.holders
        self.readable = np.ones(len(files), dtype=bool) if holders is None else np.array([me in h for h in holders], dtype=bool)
        self.error: BaseException | None = None
        self.written = 0
        self.sent = 0

    def _write_out(self, block: Block, data: np.ndarray) -> None:
        assert self.output is not None
        self.output.write(block.file, block.offset, data.data)

    def _guard(self, action: Callable[[], None]) -> None:
        """Run an I/O action unless an earlier one failed; remember the first failure."""
        if self.error is not None:
            return
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - re-raised after the exchange completes
            self.error = exc

    # ---------------------------------------------------------------- the plan of messages

    def _local_and_remote(self, runs: Runs) -> tuple[Runs, list[tuple[int, Runs]]]:
        """The runs this rank reads itself, and per other holder (ascending) the runs it sends."""
        local = self.readable[runs.file]
        remote = runs.take(np.flatnonzero(~local))
        by_holder = [(int(h), remote.take(np.flatnonzero(remote.holder == h))) for h in np.unique(remote.holder)]
        return runs.take(np.flatnonzero(local)), by_holder

    def _prepare(self) -> tuple[list[Block], list[Direct], np.ndarray, np.ndarray]:
        direct = direct_pieces(self.layout, self.part) & self.allow_copies
        if not self.delegate:
            direct &= self.readable[self.part.pieces.file]
        copies, segments = [], []
        for item in self.part.items:
            item_copies, item_segments = plan_item(self.layout, self.part, item, direct)
            copies += item_copies
            segments += item_segments
        my_blocks: list[Block] = []
        size, me = self.comm.size, self.comm.rank
        requests, destinations = [], []
        for block, runs in (
            pair for whole in blocks(self.layout, segments, self.block_bytes) for pair in self.assembler.split(whole)
        ):
            index = len(my_blocks)
            my_blocks.append(block)
            _, remote = self._local_and_remote(runs)
            for holder, runs in remote:
                reads, _ = coalesce(runs, self.block_bytes // 4)
                rows = np.zeros(len(reads.file), dtype=_REQUEST)
                rows["key"], rows["writer"] = index * size + me, me
                rows["file"], rows["src"], rows["length"] = reads.file, reads.src, reads.length
                requests.append(rows)
                destinations.append(np.full(len(rows), holder, dtype=np.int32))
        own = [c for c in copies if self.readable[c.file]]
        handed = [c for c in copies if not self.readable[c.file]]
        delegated = np.zeros(len(handed), dtype=_DIRECT)
        for i, c in enumerate(handed):
            delegated[i] = (c.file, c.out, c.src, c.offset, c.length)
        incoming = exchange(
            self.comm,
            np.concatenate(requests) if requests else np.zeros(0, _REQUEST),
            np.concatenate(destinations) if destinations else np.zeros(0, np.int32),
        )
        received_copies = exchange(self.comm, delegated, np.array([c.holder for c in handed], dtype=np.int32))
        for row in received_copies:
            own.append(Direct(int(row["file"]), int(row["src"]), int(row["out"]), int(row["offset"]), int(row["length"])))
        return my_blocks, own, incoming, np.array([b.size for b in my_blocks], dtype=np.int64)

    # ---------------------------------------------------------------- running it

    def run(self) -> int:
        """Write this rank's blocks and copies, serve its reads; returns the bytes written here."""
        my_blocks, copies, incoming, _ = self._prepare()
        size, me = self.comm.size, self.comm.rank
        incoming = incoming[np.argsort(incoming["key"], kind="stable")]
        serve_keys, serve_start = np.unique(incoming["key"], return_index=True)
        serve_start = np.append(serve_start, len(incoming))
        own_keys = np.arange(len(my_blocks), dtype=np.int64) * size + me
        keys = np.union1d(own_keys, serve_keys)
        serve_of = {int(k): (int(serve_start[i]), int(serve_start[i + 1])) for i, k in enumerate(serve_keys)}
        for key in keys.tolist():
            signum = pending_signal()
            if signum is not None and self.error is None:
                self.error = Interrupted(f"interrupted by {signum.name}")
            if key % size == me and key // size < len(my_blocks):
                self._write_block(my_blocks[key // size])
            if key in serve_of:
                lo, hi = serve_of[key]
                self._serve(incoming[lo:hi])
        while self.in_flight:
            self.in_flight.popleft()[0].wait()
        for copy in copies:
            self._guard(functools.partial(self._copy, copy))
        if self.error is not None:
            raise self.error
        return self.written

    def _serve(self, reads: np.ndarray) -> None:
        """Read what a writer asked for (one message per block) and send it without waiting."""
        total = int(reads["length"].sum())
        if len(self.in_flight) == SEND_WINDOW:
            request, slot = self.in_flight.popleft()
            request.wait()
        else:
            used = {slot for _, slot in self.in_flight}
            slot = next(i for i in range(SEND_WINDOW) if i not in used)
        if len(self.outbox[slot]) < total:
            self.outbox[slot] = np.empty(total, dtype=np.uint8)
        buffer = self.outbox[slot][:total]
        position = 0
        for file, src, length in zip(reads["file"].tolist(), reads["src"].tolist(), reads["length"].tolist()):
            target = buffer[position : position + length].data
            self._guard(functools.partial(self.sources.read_into, file, src, target))
            position += length
        self.in_flight.append((self.comm.isend(buffer, int(reads["writer"][0]), EXCHANGE_TAG), slot))
        self.sent += total

    def _write_block(self, block: Block) -> None:
        runs = self.assembler.runs(block)
        local, remote = self._local_and_remote(runs)
        plans = [(holder, part_runs, coalesce(part_runs, self.block_bytes // 4)) for holder, part_runs in remote]
        total = sum(reads.total for _, _, (reads, _) in plans)
        inbox = self.inbox if total <= len(self.inbox) else np.empty(total, dtype=np.uint8)
        requests, received, position = [], [], 0
        for holder, part_runs, (reads, placed) in plans:
            message = inbox[position : position + reads.total]
            requests.append(self.comm.irecv(message, holder, EXCHANGE_TAG))
            received.append((part_runs, placed, message))
            position += reads.total
        target = self.assembler.target(block, self._out(block.size), runs)
        self._guard(lambda: self.assembler.fill(local, target))
        wait_all(requests)
        if self.error is None:
            for part_runs, placed, message in received:
                place(message, placed, target, part_runs)
            data = self.assembler.finish(block, target, self.out, runs)
            self._guard(lambda: self.sink(block, data))
        self.written += block.size
        self.on_bytes(block.size)

    def _out(self, size: int) -> np.ndarray:
        if len(self.out) < size:
            self.out = np.empty(size, dtype=np.uint8)
        return self.out

    def _copy(self, copy: Direct) -> None:
        assert self.output is not None
        self.output.copy(self.sources, copy.file, copy.src, copy.out, copy.offset, copy.length, self.out)
        self.written += copy.length
        self.on_bytes(copy.length)


def feed_blocks(
    comm: Comm,
    scanned: Scanned,
    layout: Layout,
    part: Part,
    sources: SourceFiles,
    buffer_size: int,
    sink: Callable[[Block, np.ndarray], None],
    on_error: Callable[[Block, BaseException], None] | None = None,
) -> None:
    """Assemble this rank's rows (``part.items``, in order) from the shards block by block, in at most
    ``buffer_size`` bytes of buffers, and hand each block to ``sink``: what ``verify`` compares and
    what a consolidation reads of entries it does not write.

    With shared input a rank assembles its own blocks; a failure to read or to take a block goes to
    ``on_error`` (raised without it). Otherwise the blocks come through the exchange (collective:
    every rank of ``comm`` calls this, in a phase agreed with ``collective=True``), which raises the first
    failure once its messages are done.
    """
    if scanned.shared:
        with raising_inside():  # no messages: a signal stops this rank's reading at once
            raise_pending()
            _feed_own_blocks(layout, part, sources, buffer_size, sink, on_error)
        return
    with deferred():  # a message pattern every rank must complete (the exchange polls for signals itself)
        channel = comm.duplicate()
        try:
            ExchangeWriter(
                layout, part, scanned.files, sources, None, buffer_size, channel, sink=sink, copies=False, delegate=False
            ).run()
        finally:
            channel.free()


def _feed_own_blocks(
    layout: Layout,
    part: Part,
    sources: SourceFiles,
    buffer_size: int,
    sink: Callable[[Block, np.ndarray], None],
    on_error: Callable[[Block, BaseException], None] | None,
) -> None:
    """:func:`feed_blocks` with shared input: this rank assembles its own blocks from the shards."""
    block_bytes = block_budget(buffer_size, 2)
    assembler = Assembler(layout, part, block_bytes, sources.read_into)
    buffer = np.empty(block_bytes, dtype=np.uint8)
    segments = [Segment(i.tensor, i.row_begin, i.row_end) for i in part.items]
    for whole in blocks(layout, segments, block_bytes):
        for block, runs in assembler.split(whole):
            if len(buffer) < block.size:
                buffer = np.empty(block.size, dtype=np.uint8)
            try:
                sink(block, assembler.assemble(block, buffer, runs))
            except (MpiconsError, OSError) as exc:
                if on_error is None:
                    raise
                on_error(block, exc)
