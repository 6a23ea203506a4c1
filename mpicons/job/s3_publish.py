"""A consolidation's ``s3://bucket/prefix`` output as the driver's target: the prefix held by the owner
rank, every output file one multipart upload with parts from every rank that writes its bytes, the
commit by the owner.

Every step is a phase agreed over the communicator, so one rank's failure (or a signal) ends every
rank, and the owner then aborts every open upload (:meth:`S3Destination.abort`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..comm.agreement import Comm, agree, agree_on, wait_for_all
from ..comm.interrupts import deferred, forget_pending, raise_pending
from ..core.errors import InputError, MpiconsError
from ..core.layout import Layout
from ..core.names import INDEX_NAME
from ..core.options import DTYPE_TARGETS, MIN_PART, Options, Publishing, Storage, Tuning
from ..core.parts import Part
from ..io.manifest import MANIFEST_NAME, format_manifest
from ..io.output_formats import output_format
from ..io.s3 import S3Client, S3Location, is_s3
from ..io.s3_destination import S3Destination
from ..io.s3_output import IN_FLIGHT, S3Output
from ..io.s3_upload_plan import check_plan, plan_uploads
from .checksums import hash_objects
from .pipeline import Start, check_buffer_fits
from .scan import Scanned, open_sources
from .writer import write_share

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


def refuse_the_input_as_output(input_dir: str, url: str) -> None:
    """Bad input: an ``s3://`` output at the very location of the input, or below it (compared as parsed, so
    ``s3://b//p`` is ``s3://b/p``), as for a directory (:func:`~mpicons.job.directory_target.refuse_output_in_inputs`)."""
    if not is_s3(input_dir):
        return
    source, target = S3Location.parse(input_dir), S3Location.parse(url)
    if source == target:
        raise InputError(f"{url}: the output is the input; give another prefix for the consolidated checkpoint")
    if source.bucket == target.bucket and (not source.prefix or target.prefix.startswith(source.prefix + "/")):
        raise InputError(
            f"{url}: the output is inside the input {source.url()}: mpicons never writes among or below the shards it "
            "reads; give a prefix outside it (the input's parent may be the output)"
        )


class S3Target:
    """One run's ``s3://`` output as the driver's target, across the phases: the owner's hold on the prefix,
    the uploads' ids and ETags; every method is collective."""

    min_part = MIN_PART  # every part but a file's last is at least S3's smallest
    resumed = 0  # an object-store output is never continued: a stopped run's uploads are aborted or expire

    def __init__(self, comm: Comm, url: str, publishing: Publishing, storage: Storage, tuning: Tuning, owner: int = 0) -> None:
        self.comm = comm
        self.owner = owner
        self.publishing, self.storage, self.tuning = publishing, storage, tuning
        self.output = url
        self.location = S3Location.parse(url)
        self.client = S3Client(self.location, storage.s3_endpoint)
        self.destination: S3Destination | None = None
        self.upload_ids: list[str] = []
        self.names: list[str] = []
        self.etags: list[list[str]] = []
        self.manifest = MANIFEST_NAME if publishing.manifest else ""

    @classmethod
    def open(cls, comm: Comm, input_dir: str, url: str, options: Options) -> S3Target:
        """The target, once the options an upload needs are there and the output is not the input."""
        agree(comm, lambda: check_s3_options(options))
        agree(comm, lambda: refuse_the_input_as_output(input_dir, url))
        return agree(comm, lambda: cls(comm, url, options.publishing, options.storage, options.tuning))

    def check(self, begun: Start) -> None:
        """Before anything is made: the memory for the buffers and the parts in flight."""
        check_buffer_fits(self.comm, self.tuning.buffer_size, (IN_FLIGHT + 1) * self.storage.s3_part_size)

    def hold(self) -> list[str]:
        """The owner checks access, refuses a prefix of shards and takes the lock; returns its notes."""

        def hold() -> list[str]:
            self.destination = S3Destination.open(self.client, self.publishing.break_lock)
            return self.destination.notes

        return agree_on(self.comm, self.owner, hold)

    def check_names(self, names: Iterable[str]) -> None:
        """Refuse keys S3 cannot hold."""

        def check_keys() -> None:
            for name in names:
                if len(self.location.key(name).encode("utf-8")) > MAX_KEY_BYTES:
                    raise InputError(f"{self.location.url(name)}: the object key is longer than S3's {MAX_KEY_BYTES} bytes")

        agree(self.comm, check_keys)

    def check_layout(self, layout: Layout, assets: HFAssets | None) -> None:
        """The keys of every object the run publishes, and a checkpoint under the prefix that ``--force``
        does not allow replacing."""
        names = [f.name for f in layout.files] + [INDEX_NAME] + ([] if assets is None else list(assets.published_names))
        names += [self.manifest] if self.manifest else []
        self.check_names(names)
        agree_on(self.comm, self.owner, lambda: self._destination().check_replacing(names, self.publishing.force))

    def write(
        self, scanned: Scanned, layout: Layout, part: Part, assets: HFAssets | None
    ) -> tuple[Layout, int, int, dict[str, str]]:
        """Create the uploads (owner), upload this rank's parts, gather the ETags; the layout, the bytes
        this rank wrote and sent, and no MPI-IO hints."""
        sources = open_sources(scanned)
        try:
            written, moved = self._upload(
                layout, lambda output: write_share(self.comm, scanned, layout, part, sources, output, self.tuning)
            )
        finally:
            sources.close()
        return layout, written, moved, {}

    def _upload(self, layout: Layout, write_share: Callable[[OutputBackend], tuple[int, int]]) -> tuple[int, int]:
        plan = plan_uploads(layout, layout.work, self.owner, self.storage.s3_part_size)
        agree(self.comm, lambda: check_plan(layout, plan))
        names = self.names = [f.name for f in layout.files]
        self.upload_ids = agree_on(self.comm, self.owner, lambda: self._destination().create_uploads(names))
        output = S3Output(self.client, names, [f.header for f in layout.files], plan, self.upload_ids, self.comm.rank)
        try:
            agree(self.comm, output.create)
            written, moved = agree(self.comm, lambda: write_share(output), collective=True)
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

    def publish(self, layout: Layout, assets: HFAssets | None) -> None:
        """The owner makes the checkpoint visible, index last; signals are held back meanwhile (one that
        arrived before the first visible change stops the run, which then aborts). With a manifest, the
        completed objects are read back and hashed over the ranks before ``SHA256SUMS`` and the index go in."""
        names = [f.name for f in layout.files]

        def complete() -> dict[str, str]:
            from ..io.assets import asset_bytes

            target = None if self.publishing.dtype is None else DTYPE_TARGETS.get(self.publishing.dtype)
            payloads = {} if assets is None else asset_bytes(assets, target)
            with deferred():
                raise_pending()
                self._destination().complete(names, self.etags, payloads)
            return {name: hashlib.sha256(data).hexdigest() for name, data in payloads.items()}

        digests = agree_on(self.comm, self.owner, complete)
        if self.publishing.manifest:
            sizes = [f.size for f in layout.files]
            digests.update(zip(names, hash_objects(self.comm, self.client, names, sizes)))

        def finish() -> None:
            index = output_format(self.publishing.output_format).index(layout)
            if index is not None:
                digests[INDEX_NAME] = hashlib.sha256(index).hexdigest()
            manifest = {MANIFEST_NAME: format_manifest(digests)} if self.publishing.manifest else {}
            with deferred():
                self._destination().finish(index, manifest)
                forget_pending()

        agree_on(self.comm, self.owner, finish)

    def release(self, failure: BaseException | None) -> None:
        """After a failure every rank agreed on, every rank stops uploading before the owner aborts the
        uploads; after one this rank alone has, it aborts them itself. Then the lock is let go of."""
        if failure is not None:
            agreed = isinstance(failure, MpiconsError)
            if agreed:
                wait_for_all(self.comm)
            self.abort(everywhere=not agreed)
        self.close()

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
