"""One run's hold on an ``s3://bucket/prefix`` output: locked, checked, its uploads made, committed or aborted.

An object store has no rename and no directory, so the transaction is built from what it does have:

* the lock is an object created only if absent (``If-None-Match: *``): one run per prefix;
* every output file is a multipart upload, invisible until completed, so the weights are uploaded
  (hours, perhaps) while an old checkpoint under the prefix stays whole and readable;
* the commit is short: the old index is removed first (with ``--force``), the assets written, every
  upload completed, then the new index written, last; so an index under the prefix always names
  complete files of one run;
* any failure aborts every upload the run still has open, and removes what it had completed of a
  new checkpoint (nothing was there before); a run killed outright leaves its uploads open and its
  lock in place, and ``--break-lock`` aborts those uploads.

No MPI here: the rank that owns the output calls these, inside agreed phases.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.errors import InputError, WriteError
from ..core.names import CHECKPOINT_FILE, INDEX_NAME
from .journal import describe_names
from .lock import LOCK_NAME, Holder
from .outdir import refuse_shards_among

if TYPE_CHECKING:
    from .s3 import S3Client

log = logging.getLogger("mpicons")

#: Largest lock object mpicons reads back (it writes a few hundred bytes).
_LOCK_LIMIT = 1 << 16


@dataclass
class S3Destination:
    """The owner rank's hold on an S3 output prefix for one run."""

    client: S3Client
    holder: Holder
    #: What was under the prefix when the run took the lock: name → size.
    existing: dict[str, int]
    notes: list[str] = field(default_factory=list)
    #: Upload ids of this run's output files, by name, until completed or aborted.
    uploads: dict[str, str] = field(default_factory=dict)
    #: Objects this run has made visible (completed uploads, assets, the index).
    made: list[str] = field(default_factory=list)
    #: Old checkpoint files the new one does not have (deleted after the commit, with ``force``).
    stale: list[str] = field(default_factory=list)
    force: bool = False
    #: Whether a checkpoint was under the prefix (then a failed commit cannot undo what it replaced).
    replacing: bool = False
    locked: bool = False

    @classmethod
    def open(cls, client: S3Client, break_lock: bool = False) -> S3Destination:
        """Check access, refuse a prefix of shards and take the prefix's lock."""
        client.check_access(write=True)
        existing = dict(client.list())
        location = client.location
        refuse_shards_among(location.url(), existing, "output prefix")
        destination = cls(client, Holder.me(), existing)
        destination._lock(break_lock)
        return destination

    def _lock(self, break_lock: bool) -> None:
        from .s3 import ObjectExists

        url = self.client.location.url(LOCK_NAME)
        try:
            self.client.put(LOCK_NAME, self.holder.to_bytes(), if_absent=True)
        except ObjectExists:
            seen = self._seen_holder()
            if not break_lock:
                raise InputError(
                    f"{url}: the output is locked by {seen}. If that run has ended (killed, or its node lost), run "
                    "again with --break-lock: it takes the lock over and aborts the uploads that run left open"
                ) from None
            aborted = self._abort_left_open()
            self.client.delete(LOCK_NAME)
            try:
                self.client.put(LOCK_NAME, self.holder.to_bytes(), if_absent=True)
            except ObjectExists:
                raise InputError(f"{url}: another run took the lock while it was being broken; try again later") from None
            self.notes.append(f"broke the lock of {seen}" + (f"; aborted {aborted} upload(s) it left open" if aborted else ""))
        self.locked = True

    def _seen_holder(self) -> str:
        try:
            size = dict(self.client.list()).get(LOCK_NAME, 0)
            raw = self.client.read(LOCK_NAME, 0, size) if 0 < size <= _LOCK_LIMIT else b""
        except WriteError:
            return "an unknown holder (the lock object cannot be read)"
        holder = Holder.parse(raw)
        return holder.describe() if holder is not None else "an unknown holder (not a lock mpicons can read as its own)"

    def _abort_left_open(self) -> int:
        """Abort the multipart uploads open under the prefix (a broken lock's run left them)."""
        left = self.client.open_uploads()
        for name, upload_id in left:
            self.client.abort_upload(name, upload_id)
        return len(left)

    def check_replacing(self, new: Sequence[str], force: bool) -> None:
        """Refuse, unless ``force``, to replace a checkpoint or any object the new files would overwrite;
        with ``force``, note the old checkpoint's files the new one leaves out (removed after the commit)."""
        old = sorted(name for name in self.existing if CHECKPOINT_FILE.match(name))
        clashing = sorted(set(new) & set(self.existing))
        if not force and (old or clashing):
            what = describe_names(old or clashing)
            raise InputError(
                f"{self.client.location.url()}: already holds a checkpoint ({what}); pass --force to replace it "
                "(the old one stays whole until the new one is complete), or choose another prefix"
            )
        self.force = force
        self.replacing = bool(old or clashing)
        self.stale = [name for name in old if name not in set(new)]

    def create_uploads(self, names: Sequence[str]) -> list[str]:
        """One multipart upload per output file; their ids, in order."""
        for name in names:
            self.uploads[name] = self.client.create_upload(name)
        return [self.uploads[name] for name in names]

    def commit(self, names: Sequence[str], etags: Sequence[Sequence[str]], index: bytes | None, assets: dict[str, bytes]) -> None:
        """Make the new checkpoint visible: old index gone (``force``), assets, every file, the index last."""
        self.complete(names, etags, assets)
        self.finish(index, {})

    def complete(self, names: Sequence[str], etags: Sequence[Sequence[str]], assets: dict[str, bytes]) -> None:
        """The first half of :meth:`commit`: old index gone (``force``), assets, every file (no index yet:
        the checkpoint is not complete, and :meth:`abort` removes what this made)."""
        if self.force and INDEX_NAME in self.existing:
            self.client.delete(INDEX_NAME)
        for name, data in assets.items():
            self.client.put(name, data, if_absent=not self.force)
            self.made.append(name)
        for name, tags in zip(names, etags):
            self.client.complete_upload(name, self.uploads[name], list(tags), if_absent=not self.force)
            del self.uploads[name]
            self.made.append(name)

    def finish(self, index: bytes | None, before_index: dict[str, bytes]) -> None:
        """The second half: ``before_index`` (the manifest), then the index, the commit point; stale files go."""
        for name, data in [*before_index.items(), *([(INDEX_NAME, index)] if index is not None else [])]:
            self.client.put(name, data, if_absent=not self.force)
            self.made.append(name)
        for name in self.stale:
            self.client.delete(name)

    def abort(self) -> None:
        """After a failure: abort every open upload, remove what a new checkpoint had made visible.

        With ``force`` the old checkpoint's index was removed before any file was replaced, so what is
        left is plainly incomplete (no index), never a mix that looks whole.
        """
        failures: list[str] = []
        for name, upload_id in list(self.uploads.items()):
            try:
                self.client.abort_upload(name, upload_id)
                del self.uploads[name]
            except Exception as exc:  # noqa: BLE001 - every upload is tried; each failure is reported
                failures.append(str(exc))
        if not self.replacing:  # nothing was there before: what the run made goes again
            for name in reversed(self.made):
                try:
                    self.client.delete(name)
                except Exception as exc:  # noqa: BLE001 - as above
                    failures.append(str(exc))
            self.made.clear()
        for failure in failures:
            log.error("%s (abort it by hand, or rerun with --break-lock, which aborts what is left open)", failure)

    def close(self) -> None:
        """Release the lock (only if it is still this run's). Never raises: it runs after the outcome is
        decided (on the owner alone), and a lock left behind is stated with what to do."""
        if not self.locked:
            return
        self.locked = False
        url = self.client.location.url(LOCK_NAME)
        try:
            raw = self.client.read(LOCK_NAME, 0, len(self.holder.to_bytes()))
            holder = Holder.parse(raw)
            if holder is not None and holder.token == self.holder.token:
                self.client.delete(LOCK_NAME)
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("%s: the lock could not be released (%s): delete it, or pass --break-lock next time", url, exc)
