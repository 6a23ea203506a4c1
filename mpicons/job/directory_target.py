"""A consolidation's output directory as the driver's target: checked before anything is made, held
by one rank (locked, recovered), staged, written by every rank, published as one transaction.

The checks here run before the output directory is touched: the output is no rank's input directory
nor inside one, its names fit the file system, the buffers fit the node's memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..comm.agreement import Comm, agree, agree_on, wait_for_all
from ..comm.interrupts import deferred, forget_pending, raise_pending
from ..core.errors import InputError, MpiconsError
from ..core.layout import Layout
from ..core.machine import check_buffer_size, check_names_fit, check_path_fits, host_name
from ..core.names import INDEX_NAME
from ..core.options import DTYPE_TARGETS, Options
from ..core.parts import Part
from ..core.reports import human_size
from ..io.backends import open_output
from ..io.manifest import HASH_STEP, MANIFEST_NAME, files_below, format_manifest, hash_file
from ..io.outdir import OutputDir, directory_identity, identities_up
from ..io.output_formats import output_format
from ..io.outputs import OutputBackend
from ..io.resume import BlockLog, DoneRanges, RunIdentity, read_done, write_identity
from ..io.sources import SourceFiles
from .adapter_setup import refuse_checkpoint_output
from .checksums import digests_over_ranks, hash_over_ranks, hash_share
from .pipeline import Start
from .resumption import Resume, run_identity
from .scan import Scanned, open_sources, rank_directory
from .writer import write_share

if TYPE_CHECKING:
    from ..io.assets import HFAssets

log = logging.getLogger("mpicons")


class DirectoryTarget:
    """The output directory of one run; every method is collective (the owner rank holds the directory)."""

    min_part = 0  # any rank may write any stretch of a file

    def __init__(self, comm: Comm, output_dir: str, options: Options, inside_input: bool = False) -> None:
        self.comm, self.output, self.inside_input = comm, output_dir, inside_input
        self.options, self.publishing, self.tuning = options, options.publishing, options.tuning
        self.owner = self.tuning.gather_to if self.tuning.gather_to is not None else 0
        self.held: OutputDir | None = None  # on the owner, once held
        self.token = ""  # the staging directory's (the owner's lock's), on every rank once staged
        self.digests: dict[str, str] = {}  # the weights' SHA-256 by file name, once written
        self.resumed = 0  # bytes an earlier run had made durable, kept (every rank's, summed)
        self.manifest = MANIFEST_NAME if self.publishing.manifest else ""
        self.notes: list[str] = []

    def check(self, begun: Start) -> None:
        """Before anything is made: the output is no trainer's checkpoint nor the input, its names fit,
        the machine has the memory."""
        agree_on(self.comm, 0, lambda: refuse_checkpoint_output(self.output, begun.input_dir, self.inside_input))
        self.check_names(mapped_names(begun.mapping))
        check_machine(self.comm, begun.directory, self.output, self.tuning.buffer_size, self.inside_input)

    def hold(self) -> list[str]:
        """The owner takes the directory (made if needed, locked, what a crashed run left recovered); its notes."""

        def open_directory() -> list[str]:
            self.held = OutputDir.open(self.output, self.publishing.break_lock, self.publishing.restart)
            return self.held.notes

        notes = agree_on(self.comm, self.owner, open_directory)
        if self.comm.rank == 0:
            for note in notes:
                log.info("%s: %s", self.output, note)
        self.notes = list(notes)  # the stage's notes are added to these
        return self.notes

    def check_names(self, names: dict[str, str]) -> None:
        check_output_names(self.comm, self.owner, self.output, names)

    def check_layout(self, layout: Layout, assets: HFAssets | None) -> None:
        self.check_names(layout_names(layout, self.publishing.output_format))

    def write(
        self, scanned: Scanned, layout: Layout, part: Part, assets: HFAssets | None
    ) -> tuple[Layout, int, int, dict[str, str]]:
        """Stage every output in the owner's private directory (a stopped identical run's, continued) and fill
        it; returns the (re-targeted) layout, the bytes this rank wrote and sent, and the MPI-IO hints in effect."""
        comm, publishing, tuning = self.comm, self.publishing, self.tuning
        fmt = output_format(publishing.output_format)
        layout = fmt.target(layout)
        identity = run_identity(comm, scanned, layout, self.options)
        staging, done = self._stage(layout, identity, assets)
        if fmt.preallocated:
            layout = agree_on(comm, self.owner, lambda: fmt.lay_out(staging, layout))
        paths = [os.path.join(staging, f.name) for f in layout.files]
        output = agree(
            comm,
            lambda: open_output(
                tuning.io, comm, paths, [f.header for f in layout.files], [f.size for f in layout.files], tuning.hints,
                preallocated=fmt.preallocated or done is not None, owner=self.owner, durable=publishing.sync,
            ),
        )  # fmt: skip
        sources = open_sources(scanned)
        resume = None
        try:
            agree(comm, output.create, collective=True)
            if identity is not None:
                if done is None:
                    agree_on(comm, self.owner, lambda: write_identity(staging, identity))
                resume = Resume(done or DoneRanges([], []), BlockLog(staging, self.token, comm.rank), output.flusher)
            written, moved = agree(
                comm, lambda: write_share(comm, scanned, layout, part, sources, output, tuning, resume), collective=True
            )
            self.digests = self._sync_and_hash(output, paths, layout)
            if resume is not None:
                agree(comm, lambda: resume.log.append(resume.log.take()))
            self.resumed = comm.allreduce(0 if resume is None else resume.resumed, "sum")
            return layout, written, moved, output.hints_in_effect()
        finally:
            if resume is not None:
                resume.log.close()
            _close_quietly(output, sources)

    def _stage(self, layout: Layout, identity: RunIdentity | None, assets: HFAssets | None) -> tuple[str, DoneRanges | None]:
        """The owner's staging directory, made or continued; with the earlier run's durable ranges when continued."""
        fmt, publishing = output_format(self.publishing.output_format), self.publishing
        names = fmt.final_names(layout) + ([] if assets is None else list(assets.published_names))
        names += [MANIFEST_NAME] if publishing.manifest else []
        weights = [f.name for f in layout.files]

        def stage() -> tuple[str, str, DoneRanges | None, list[str]]:
            session = self._held()
            session.aside = session.replaced_entries(names, publishing.force, checkpoint=fmt.checkpoint)
            before = len(session.notes)
            staging, continued = session.stage(identity, weights)
            done = read_done(staging, [f.size for f in layout.files]) if continued else None
            if done is not None:
                check_staged_sizes(staging, layout)
            return staging, session.lock.holder.token, done, session.notes[before:]

        staging, self.token, done, notes = agree_on(self.comm, self.owner, stage)
        if done is not None:
            notes.append(f"continuing a stopped earlier run of this command: {human_size(done.total)} it wrote are kept")
        if self.comm.rank == 0:
            for note in notes:
                log.info("%s: %s", self.output, note)
        self.notes += notes
        return staging, done

    def _sync_and_hash(self, output: OutputBackend, paths: list[str], layout: Layout) -> dict[str, str]:
        """Flush the outputs and hash them (``SHA256SUMS``), overlapped: the hashing reads them back from the
        page cache while the flush waits for the disk. Every file is hashed whole by one rank."""
        comm = self.comm
        if not self.publishing.manifest:
            agree(comm, output.sync, collective=True)
            return {}
        sizes = [f.size for f in layout.files]
        if not output.threaded:  # MPI-IO's flush is collective: not from a thread
            agree(comm, output.sync, collective=True)
            return {f.name: str(digest) for f, digest in zip(layout.files, hash_over_ranks(comm, paths, sizes))}

        def both() -> dict[int, str | None]:
            with ThreadPoolExecutor(1, thread_name_prefix="mpicons-sync") as pool:
                flushed = pool.submit(output.sync)
                mine = hash_share(paths, sizes, comm.rank, comm.size, own=True)
                flushed.result()
            return mine

        digests = digests_over_ranks(comm, both, len(layout.files))
        return {f.name: str(digest) for f, digest in zip(layout.files, digests)}

    def publish(self, layout: Layout, assets: HFAssets | None) -> None:
        """The owner stages the Hugging Face assets and the index, and publishes everything as one
        transaction (commit point: the index, last). Signals are held back meanwhile; one that arrived is
        honoured at the commit point (rolled back)."""
        fmt, options = output_format(self.publishing.output_format), self.publishing

        def publish() -> None:
            session, durable = self._held(), options.sync
            with deferred():
                staged: list[str] = []
                if assets is not None:
                    assert session.staging is not None
                    from ..io.assets import stage_assets

                    target = None if options.dtype is None else DTYPE_TARGETS.get(options.dtype)
                    staged = stage_assets(assets, session.staging, target, durable)
                index = fmt.index(layout)
                if index is not None:
                    session.write_staged(INDEX_NAME, index, durable)
                final = fmt.final_names(layout)
                if options.manifest:
                    session.write_staged(MANIFEST_NAME, self._manifest(session, staged, index), durable)
                    final = [*final[:-1], MANIFEST_NAME, final[-1]]  # the commit point stays last
                session.publish(staged + final, session.aside, durable, before_commit=raise_pending)
                forget_pending()

        agree_on(self.comm, self.owner, publish)

    def _manifest(self, session: OutputDir, staged: list[str], index: bytes | None) -> bytes:
        """``SHA256SUMS``: the weights' digests (hashed after writing), the staged assets' and the index's."""
        assert session.staging is not None
        digests = dict(self.digests)
        buffer = memoryview(bytearray(HASH_STEP))
        for name in files_below(session.staging, staged):
            digests[name] = hash_file(os.path.join(session.staging, name), buffer)
        if index is not None:
            digests[INDEX_NAME] = hashlib.sha256(index).hexdigest()
        return format_manifest(digests)

    def release(self, failure: BaseException | None) -> None:
        """The directory let go of (staging removed and the lock released unless published); after a
        failure every rank agreed on, every rank returns together."""
        if self.held is not None:
            self.held.close()
            if self.held.kept is not None:
                log.warning(
                    "%s: what this run wrote and made durable is kept in %s: run the same command again to continue "
                    "from it, or add --restart to discard it",
                    self.output,
                    self.held.kept,
                )
        if isinstance(failure, MpiconsError):
            wait_for_all(self.comm)

    def _held(self) -> OutputDir:
        assert self.held is not None, "the owner holds the output directory"
        return self.held


def check_staged_sizes(staging: str, layout: Layout) -> None:
    """A continued run's staged files are the regular files of the sizes its layout gives (else someone
    changed them: nothing of them is trusted)."""
    for file in layout.files:
        path = os.path.join(staging, file.name)
        info = os.lstat(path) if os.path.lexists(path) else None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_size != file.size:
            raise InputError(
                f"{path}: a stopped earlier run's output file is missing or not the size it was made with: rerun "
                "with --restart to discard what that run left"
            )


def check_machine(comm: Comm, input_dir: str, output_dir: str, buffer_size: int, inside_input: bool = False) -> None:
    """Before anything is created: the output is no rank's input directory nor inside one (``inside_input``:
    it may be inside one), and the buffers fit in memory.

    Each rank compares the output directory and every directory above it, as it sees them, with the
    input directory of every rank on the same host (``{rank}`` resolved), so no file can be written
    among or below any rank's shards.
    """
    seen = agree(comm, lambda: (host_name(), directory_identity(rank_directory(input_dir, comm.rank))), gather=True)

    def check() -> None:
        host = seen[comm.rank][0]
        here = {rank: identity for rank, (other, identity) in enumerate(seen) if other == host}
        refuse_output_in_inputs(output_dir, input_dir, here, inside_input)
        check_buffer_size(buffer_size, sum(1 for other_host, _ in seen if other_host == host))

    agree(comm, check)


def refuse_output_in_inputs(
    output_dir: str, input_dir: str, inputs: dict[int, tuple[int, int] | None], inside_input: bool = False
) -> None:
    """Bad input when ``output_dir`` (or, unless ``inside_input``, a directory above it) is one of ``inputs``:
    rank → the identity of its input directory, for the ranks on this host."""
    for path, identity in identities_up(output_dir):
        rank = next((r for r, other in inputs.items() if other == identity), None)
        if rank is None:
            continue
        whose = f" (rank {rank}'s {rank_directory(input_dir, rank)})" if "{rank}" in input_dir else ""
        if path == os.path.realpath(output_dir):
            raise InputError(f"{output_dir}: output directory is the input directory{whose}")
        if inside_input:
            continue
        raise InputError(
            f"{output_dir}: output directory is inside the input directory {path}{whose}: mpicons never writes among "
            f"or below the shards it reads; give a directory outside it (its parent, {os.path.dirname(path)}, may be the output)"
        )


def mapped_names(mapping: dict[str, str] | None) -> dict[str, str]:
    """The file names a mapping gives, each with the first tensor it holds and where the mapping came from."""
    source = getattr(mapping, "source", "mapping")
    names: dict[str, str] = {}
    for tensor, file_name in (mapping or {}).items():
        names.setdefault(file_name, f"output file name (of tensor {tensor!r} in {source})")
    return names


def layout_names(layout: Layout, output_format_name: str) -> dict[str, str]:
    """The output files' names in the given format, each said to be an output file's name."""
    return {name: "output file name" for name in output_format(output_format_name).final_names(layout)}


def check_output_names(comm: Comm, owner: int, output_dir: str, names: dict[str, str]) -> None:
    """Refuse, before anything is created or written, an output directory or file names the output file
    system cannot hold (too long, not plain names): bad input, not a create that fails mid-run."""

    def check() -> None:
        check_path_fits(output_dir, "output directory name")
        check_names_fit(output_dir, names)

    agree_on(comm, owner, check)


def _close_quietly(output: OutputBackend, sources: SourceFiles) -> None:
    sources.close()
    try:
        output.close()
    except Exception:  # noqa: BLE001 - cleanup after a failure already being reported
        pass


__all__ = ["DirectoryTarget", "check_machine", "check_output_names", "layout_names", "mapped_names", "refuse_output_in_inputs"]
