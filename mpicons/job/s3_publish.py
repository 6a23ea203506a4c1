"""Writing a consolidation to ``s3://bucket/prefix``: the prefix held by the owner rank, every output file
one multipart upload with parts from every rank that writes its bytes, the commit by the owner.

Every step is a phase agreed over the communicator, so one rank's failure (or a signal) ends every
rank, and the owner then aborts every open upload (:meth:`S3Destination.abort`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..comm.agreement import Comm, agree, agree_on
from ..comm.interrupts import deferred, forget_pending, raise_pending
from ..core.errors import InputError, MpiconsError
from ..core.layout import Layout
from ..core.options import DTYPE_TARGETS, Options
from ..io.formats import output_format
from ..io.s3 import S3Client, S3Location
from ..io.s3_destination import S3Destination
from ..io.s3_output import S3Output
from ..io.s3_upload_plan import check_plan, plan_uploads

if TYPE_CHECKING:
    from ..io.assets import HFAssets
    from ..io.outputs import OutputBackend

#: The longest object key S3 accepts, in UTF-8 bytes.
MAX_KEY_BYTES = 1024


def check_s3_options(options: Options) -> None:
    """What an ``s3://`` output cannot do, refused before any work."""
    if options.io != "posix":
        raise InputError(f"--io {options.io} writes files; an s3:// output is uploaded in parts: leave --io out")
    if options.output_format != "safetensors":
        raise InputError(f"--format {options.output_format} writes a local file; an s3:// output is safetensors")
    if options.gather_to is not None:
        raise InputError("--gather-to writes on one rank's local disk; an s3:// output is uploaded by every rank: leave it out")


class S3Publish:
    """One run's S3 output, across the phases: the owner's hold on the prefix, the uploads' ids and ETags."""

    def __init__(self, comm: Comm, url: str, options: Options, owner: int = 0) -> None:
        self.comm = comm
        self.owner = owner
        self.options = options
        self.location = S3Location.parse(url)
        self.client = S3Client(self.location, options.s3_endpoint)
        self.destination: S3Destination | None = None
        self.upload_ids: list[str] = []
        self.names: list[str] = []
        self.etags: list[list[str]] = []

    def open(self) -> list[str]:
        """The owner checks access, refuses a prefix of shards and takes the lock; returns its notes."""

        def hold() -> list[str]:
            self.destination = S3Destination.open(self.client, self.options.break_lock)
            return self.destination.notes

        return agree_on(self.comm, self.owner, hold)

    def check_names(self, names: list[str]) -> None:
        """Refuse keys S3 cannot hold and a checkpoint under the prefix that ``--force`` does not allow replacing."""

        def check_keys() -> None:
            for name in names:
                if len(self.location.key(name).encode("utf-8")) > MAX_KEY_BYTES:
                    raise InputError(f"{self.location.url(name)}: the object key is longer than S3's {MAX_KEY_BYTES} bytes")

        agree(self.comm, check_keys)
        agree_on(self.comm, self.owner, lambda: self._destination().check_replacing(names, self.options.force))

    def write(self, layout: Layout, write_share: Callable[[OutputBackend], tuple[int, int]]) -> tuple[int, int]:
        """Create the uploads (owner), upload this rank's parts through ``write_share``, gather the ETags."""
        plan = plan_uploads(layout, layout.work, self.owner, self.options.s3_part_size)
        agree(self.comm, lambda: check_plan(layout, plan))
        names = self.names = [f.name for f in layout.files]
        self.upload_ids = agree_on(self.comm, self.owner, lambda: self._destination().create_uploads(names))
        output = S3Output(self.client, names, [f.header for f in layout.files], plan, self.upload_ids, self.comm.rank)
        try:
            agree(self.comm, output.create)
            written, moved = agree(self.comm, lambda: write_share(output))
            agree(self.comm, output.sync)
        finally:
            output.close()
        every = agree(self.comm, output.part_etags, gather=True)
        tags: list[dict[int, str]] = [{} for _ in layout.files]
        for rank_tags in every:
            for file, number, etag in rank_tags:
                tags[file][number] = etag
        self.etags = [[part_tags[n] for n in sorted(part_tags)] for part_tags in tags]
        return written, moved

    def _destination(self) -> S3Destination:
        assert self.destination is not None, "the owner holds the destination"
        return self.destination

    def commit(self, layout: Layout, assets: HFAssets | None) -> None:
        """The owner makes the checkpoint visible, index last; signals are held back meanwhile (one that
        arrived before the first visible change stops the run, which then aborts)."""

        def commit() -> None:
            from ..io.assets import asset_bytes

            target = None if self.options.dtype is None else DTYPE_TARGETS[self.options.dtype]
            payloads = {} if assets is None else asset_bytes(assets, target)
            index = output_format(self.options.output_format).index(layout)
            with deferred():
                raise_pending()
                self._destination().commit([f.name for f in layout.files], self.etags, index, payloads)
                forget_pending()

        agree_on(self.comm, self.owner, commit)

    def abort(self, everywhere: bool = False) -> None:
        """After a failure every rank has agreed on, the owner aborts the open uploads. ``everywhere``: a
        failure this rank alone has (a bug: the job is about to be aborted, the owner with it), so this
        rank aborts every upload of the run itself; every rank knows their ids."""
        if self.destination is not None:
            self.destination.abort()
            return
        if everywhere:
            for name, upload_id in zip(self.names, self.upload_ids):
                try:
                    self.client.abort_upload(name, upload_id)
                except MpiconsError:
                    pass

    def close(self) -> None:
        if self.destination is not None:
            self.destination.close()
