"""The ``s3`` output backend: every output file is one multipart upload, each rank uploading the parts
it writes (:mod:`mpicons.io.s3_upload_plan` plans them).

A rank fills a part's buffer as the writer hands it blocks and uploads the part on a background
thread as soon as its last byte is in; at most ``in_flight`` uploads run at once, so a rank holds at
most ``in_flight + 1`` parts in memory. Nothing is visible in the bucket until the owner completes
the uploads (:mod:`mpicons.io.s3_destination`). No MPI here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..core.errors import WriteError
from .s3_upload_plan import UploadPart, UploadPlan

if TYPE_CHECKING:
    from .s3 import S3Client

#: Part uploads a rank keeps in flight while it assembles the next part.
IN_FLIGHT = 2


class ReadableSources(Protocol):
    """What a copy needs of the input files (local or S3)."""

    def read_into(self, file: int, offset: int, target: memoryview) -> None: ...


class S3Output:
    """One rank's side of the uploads: its parts' buffers, their uploads and the ETags they got."""

    name = "s3"
    #: Writes come from the main thread; the uploads have threads of their own.
    threaded = False
    #: A part is uploaded by the rank that planned it, filled in output order (at most a few in memory).
    any_rank_writes = False

    def __init__(
        self,
        client: S3Client,
        names: Sequence[str],
        headers: Sequence[bytes],
        plan: UploadPlan,
        upload_ids: Sequence[str],
        rank: int,
        in_flight: int = IN_FLIGHT,
    ) -> None:
        self.client = client
        self.names = names
        self.headers = headers
        self.upload_ids = upload_ids
        self.rank = rank
        self.before_close: Callable[[], None] = lambda: None
        self.mine: dict[int, list[UploadPart]] = {}
        for part in plan.of_rank(rank):
            self.mine.setdefault(part.file, []).append(part)
        self.buffers: dict[tuple[int, int], np.ndarray] = {}
        self.filled: dict[tuple[int, int], int] = {}
        self.etags: dict[tuple[int, int], str] = {}
        self.pool = ThreadPoolExecutor(max(1, in_flight), thread_name_prefix="mpicons-upload")
        self.in_flight = max(1, in_flight)
        self.pending: list[Future[None]] = []

    def create(self) -> None:
        """Upload now the parts that hold nothing but header bytes (a file without data); a part that
        also holds data gets its share of the header when its buffer is made (see :meth:`_buffer`)."""
        for file, parts in self.mine.items():
            header = self.headers[file]
            for part in parts:
                if part.end <= len(header):
                    self.write(file, part.begin, memoryview(header)[part.begin : part.end])

    def open(self, file: int) -> None:
        pass

    def hints_in_effect(self) -> dict[str, str]:
        return {}

    def _parts_crossing(self, file: int, begin: int, end: int) -> list[UploadPart]:
        parts = self.mine.get(file, ())
        crossing = [p for p in parts if p.begin < end and begin < p.end]
        if sum(min(p.end, end) - max(p.begin, begin) for p in crossing) != end - begin:
            raise WriteError(
                f"{self.client.location.url(self.names[file])}: bytes {begin}-{end} are not in this rank's parts "
                f"(rank {self.rank}); this is a planning error in mpicons, please report it"
            )
        return crossing

    def _buffer(self, part: UploadPart) -> np.ndarray:
        key = (part.file, part.number)
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = self.buffers[key] = np.empty(part.size, dtype=np.uint8)
            header = self.headers[part.file]
            self.filled[key] = 0
            if part.begin < len(header) < part.end:  # the header's bytes in this part: no writer sends them
                buffer[: len(header) - part.begin] = np.frombuffer(header, dtype=np.uint8)[part.begin :]
                self.filled[key] = len(header) - part.begin
        return buffer

    def write(self, file: int, offset: int, data: memoryview) -> None:
        """Copy ``data`` (at byte ``offset`` of output ``file``) into the parts it falls in; upload the full ones."""
        end = offset + len(data)
        source = np.frombuffer(data, dtype=np.uint8)
        for part in self._parts_crossing(file, offset, end):
            low, high = max(part.begin, offset), min(part.end, end)
            self._buffer(part)[low - part.begin : high - part.begin] = source[low - offset : high - offset]
            self._filled(part, high - low)

    def copy(
        self, sources: ReadableSources, src: int, src_offset: int, file: int, offset: int, length: int, bounce: np.ndarray
    ) -> None:
        """Read shard bytes straight into the parts' buffers (no bounce buffer needed)."""
        for part in self._parts_crossing(file, offset, offset + length):
            low, high = max(part.begin, offset), min(part.end, offset + length)
            target = self._buffer(part)[low - part.begin : high - part.begin]
            sources.read_into(src, src_offset + (low - offset), target.data)
            self._filled(part, high - low)

    def _filled(self, part: UploadPart, count: int) -> None:
        key = (part.file, part.number)
        self.filled[key] += count
        if self.filled[key] < part.size:
            return
        buffer = self.buffers.pop(key)
        self._throttle()
        self.pending.append(self.pool.submit(self._upload, part, buffer))

    def _throttle(self) -> None:
        """Wait for an upload to end while ``in_flight`` are running (raising the first failure)."""
        running = [f for f in self.pending if not f.done()]
        if len(running) >= self.in_flight:
            wait(running, return_when=FIRST_COMPLETED)
        self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        kept: list[Future[None]] = []
        for future in self.pending:
            if wait or future.done():
                future.result()
            else:
                kept.append(future)
        self.pending = kept

    def _upload(self, part: UploadPart, buffer: np.ndarray) -> None:
        name = self.names[part.file]
        self.etags[(part.file, part.number)] = self.client.upload_part(name, self.upload_ids[part.file], part.number, buffer.data)

    def sync(self) -> None:
        """Wait for every upload of this rank; every part it owns must have been filled and uploaded."""
        self._collect(wait=True)
        for file, parts in self.mine.items():
            for part in parts:
                if (file, part.number) not in self.etags:
                    written = self.filled.get((file, part.number), 0)
                    raise WriteError(
                        f"{self.client.location.url(self.names[file])}: part {part.number} got {written} of its "
                        f"{part.size} bytes on rank {self.rank}; this is a planning error in mpicons, please report it"
                    )

    def part_etags(self) -> list[tuple[int, int, str]]:
        """(file, part number, ETag) of every part this rank uploaded."""
        return sorted((file, number, etag) for (file, number), etag in self.etags.items())

    def close(self) -> None:
        """Wait for the uploads in flight (their failures were or will be reported), start no queued one,
        and drop the buffers."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.buffers.clear()
