"""One run's hold on the output directory: made if needed, locked, recovered, staged, published.

The lock (:mod:`.lock`) keeps other runs out; new files are staged privately and published as one
transaction (:mod:`.journal`), which the next run finishes or undoes after a crash. A directory
holding a sharded checkpoint is refused: it is some run's input.

No MPI here: the rank that owns the output directory calls these, inside agreed phases.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..core.errors import InputError, WriteError
from ..core.names import CHECKPOINT_FILE, INDEX_NAME, SHARD_FILE, plain_file_name
from . import journal
from .journal import (
    JOURNAL_NAME,
    STAGING_PREFIX,
    Transaction,
    describe_names,
    recover,
    remove_staging,
    settle,
    staging_directories,
)
from .lock import OutputLock
from .manifest import MANIFEST_NAME
from .regular_files import write_new_file
from .resume import BLOCKS_PREFIX, RESUME_NAME, RunIdentity, is_resumable, read_identity


def refuse_sharded(path: str) -> None:
    """Refuse an output directory that directly holds a sharded checkpoint: those are some run's input
    (mostly the two arguments swapped), and a checkpoint published among them would spoil both."""
    refuse_shards_among(path, os.listdir(path), "output directory")


def refuse_shards_among(location: str, names: Iterable[str], what: str) -> None:
    """:func:`refuse_sharded` for the entries ``names`` of the output ``location`` (a directory, an S3 prefix)."""
    shards = sorted(name for name in names if SHARD_FILE.match(name))
    if shards:
        raise InputError(
            f"{location}: the {what} holds a sharded checkpoint ({describe_names(shards)}), and mpicons "
            "never writes among shard files, with --force or without. The arguments look swapped: the shard "
            "directory comes first, the output directory second (mpicons consolidate INPUT_DIR OUTPUT_DIR)"
        )


def checkpoint_entries(path: str) -> list[str]:
    """The files (or links) of a Hugging Face checkpoint already in the directory ``path``: names of its
    pattern (``model-*-of-*.safetensors``, ``model.safetensors``, the index) and those its index lists."""
    listed = _indexed_files(path)
    return sorted(
        entry.name
        for entry in os.scandir(path)
        if (CHECKPOINT_FILE.match(entry.name) or entry.name in listed or entry.name == MANIFEST_NAME)
        and (entry.is_file(follow_symlinks=False) or entry.is_symlink())
    )


def directory_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` leads to, None when nothing is there: how two paths are compared."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def identities_up(path: str) -> list[tuple[str, tuple[int, int]]]:
    """``path`` (links resolved) and every directory above it, each that exists with its identity, ``path`` first:
    what an output directory must not be (an input directory) nor lie below (inside an input directory)."""
    chain = []
    current = os.path.realpath(path)
    while True:
        identity = directory_identity(current)
        if identity is not None:
            chain.append((current, identity))
        parent = os.path.dirname(current)
        if parent == current:
            return chain
        current = parent


@dataclass
class OutputDir:
    """The owner rank's hold on the output directory for one run."""

    path: str
    lock: OutputLock
    created: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    staging: str | None = None
    #: Existing entries the new checkpoint replaces (decided by :meth:`replaced_entries`).
    aside: list[str] = field(default_factory=list)
    published: bool = False
    #: Stopped runs' staging directories this run may continue from (decided by :meth:`stage`).
    partial: list[str] = field(default_factory=list)
    #: This run's staging directory is marked resumable: kept, not removed, when the run fails.
    keep_partial: bool = False
    #: The staging directory a failed run kept for the same command to continue from.
    kept: str | None = None

    @classmethod
    def open(cls, path: str, break_lock: bool = False, restart: bool = False) -> OutputDir:
        """Create ``path`` if needed, take its lock and recover what crashed runs left there.

        A stopped run's partial output (a resumable staging directory that never began publishing) is
        kept for :meth:`stage` to continue from, unless ``restart``. A directory of shard files is
        refused before anything is created in it.
        """
        created = _make_directories(path)
        try:
            refuse_sharded(path)
            lock, notes = OutputLock.acquire(path, break_lock)
        except BaseException:
            _remove_empty(created)
            raise
        session = cls(path, lock, created, notes)
        try:
            session.partial = [] if restart else [d for d in staging_directories(path) if _is_partial(d)]
            session.notes += recover(path, keep=session.partial)
        except BaseException:
            session.close()
            raise
        return session

    def replaced_entries(self, new: Sequence[str], force: bool, checkpoint: bool) -> list[str]:
        """Entries of the directory the new files replace (the old index first); refused without ``force``.

        ``checkpoint``: the output is a safetensors checkpoint, so files of an older checkpoint
        (its naming pattern, or named by its index) go too, even when no name collides.
        """
        clash = [n for n in new if os.path.lexists(os.path.join(self.path, n))]
        stale = [n for n in checkpoint_entries(self.path) if n not in new] if checkpoint else []
        for name in clash:
            if os.path.isdir(os.path.join(self.path, name)) and not os.path.islink(os.path.join(self.path, name)):
                raise InputError(f"{os.path.join(self.path, name)}: is a directory; mpicons never replaces a directory")
        entries = sorted(set(clash) | set(stale), key=lambda n: (n != INDEX_NAME, n))
        if entries and not force:
            raise InputError(
                f"{self.path}: already holds {describe_names(entries)} (use --force to replace "
                f"{'them' if len(entries) > 1 else 'it'}; force=True from Python)"
            )
        return entries

    def stage(self, identity: RunIdentity | None = None, weights: Sequence[str] = ()) -> tuple[str, bool]:
        """This run's private staging directory (named with its lock's token), where every new file is
        created; and whether it is a stopped earlier run's, continued.

        With an ``identity``, a stopped run's staging directory marked with the same one is taken over
        (renamed) and keeps its ``weights`` files and block logs; every other one is removed, with a
        note saying why it could not be continued.
        """
        staging = os.path.join(self.path, STAGING_PREFIX + self.lock.holder.token)
        adopted = None
        for earlier in self.partial:
            seen = read_identity(earlier)
            if seen is None:
                why: str | None = "it is not marked as mpicons marks one"
            elif identity is None:
                why = "this run cannot continue one (--no-sync, --io mpiio, HDF5, or inputs not on a shared file system)"
            else:
                why = identity.difference(seen)
            if why is None and adopted is None:
                adopted = earlier
                continue
            remove_staging(earlier)
            name = os.path.basename(earlier)
            self.notes.append(f"started afresh: an earlier run's partial output ({name}) was discarded: {why}")
        self.partial = []
        if adopted is not None:
            os.rename(adopted, staging)
            _keep_only(staging, set(weights) | {RESUME_NAME})
        else:
            os.mkdir(staging, 0o755)
            os.chmod(staging, 0o755)  # whatever the umask: every rank opens the files staged here
        self.staging = staging
        self.keep_partial = identity is not None
        return staging, adopted is not None

    def write_staged(self, name: str, data: bytes, durable: bool = True) -> None:
        """Create one small file (the index) in the staging directory."""
        if self.staging is None:
            raise RuntimeError("write_staged() before stage()")
        journal.step_hook(f"write {name}")
        write_new_file(os.path.join(self.staging, name), data, durable)

    def publish(self, new: list[str], aside: list[str], durable: bool, before_commit: Callable[[], None]) -> None:
        """Move the staged ``new`` files in (commit point: the last one), replacing ``aside`` entries."""
        if self.staging is None:
            raise RuntimeError("publish() before stage()")

        def check() -> None:
            if not self.lock.owned():
                raise WriteError(f"{self.lock.path}: this run's lock was broken by another run; nothing published")
            before_commit()

        check()
        Transaction.begin(self.path, self.staging, new, aside, durable).run(check)
        self.published = True
        self.staging = None

    def close(self) -> None:
        """End the run: unpublished staged files removed, lock released, directories this run made removed if empty."""
        try:
            if self.staging is not None and os.path.isdir(self.staging):
                if self._kept():
                    self.kept = self.staging
                else:
                    _abandon(self.path, self.staging)
            self.staging = None
        finally:
            self.lock.release()
            if not self.published:
                _remove_empty(self.created)

    def _kept(self) -> bool:
        """A failed run's staging directory stays for the same command to continue from: it is marked
        resumable and publishing never began."""
        assert self.staging is not None
        return self.keep_partial and _is_partial(self.staging)


def _is_partial(staging: str) -> bool:
    """A stopped run's resumable staging directory that never began publishing (no journal, nothing set
    aside: one holding set-aside files without a journal is left to recovery, which refuses to touch it)."""
    return (
        is_resumable(staging)
        and not os.path.lexists(os.path.join(staging, JOURNAL_NAME))
        and not journal.set_aside_folders(staging)
    )


def _keep_only(staging: str, names: set[str]) -> None:
    """Remove from a continued staging directory what a rerun makes again (assets, index, manifest)."""
    for entry in os.scandir(staging):
        if entry.name in names or entry.name.startswith(BLOCKS_PREFIX):
            continue
        shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)


def _abandon(directory: str, staging: str) -> None:
    """Remove an unpublished staging directory; if publishing had begun, finish it in its direction first.

    Old files set aside live in the staging directory until the transaction ends, so it is never
    simply deleted once a journal exists. If even that fails, it stays for the next run to recover.
    """
    try:
        settle(directory, staging)
    except (OSError, InputError):
        pass  # left in place: the next run that takes the lock recovers it, or says why it cannot


def _indexed_files(directory: str) -> set[str]:
    """Plain file names the directory's existing index lists (an older checkpoint's files)."""
    try:
        with open(os.path.join(directory, INDEX_NAME), "rb") as handle:
            weight_map = json.loads(handle.read()).get("weight_map")
    except (OSError, ValueError, AttributeError, RecursionError):
        return set()
    if not isinstance(weight_map, dict):
        return set()
    return {n for n in weight_map.values() if plain_file_name(n) and not n.startswith(".")}


def _make_directories(path: str) -> list[str]:
    """Create ``path`` and missing parents; returns those created (outermost first)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise InputError(f"{path}: output path exists and is not a directory")
    missing = []
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):
        if os.path.lexists(probe):
            raise InputError(f"{probe}: is not a directory, so the output directory {path} cannot be made there")
        missing.append(probe)
        probe = os.path.dirname(probe)
    created: list[str] = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue  # made by someone else meanwhile
        except OSError as exc:
            _remove_empty(created)
            raise WriteError(f"{directory}: cannot create output directory ({exc.strerror})") from None
        created.append(directory)
    return created


def _remove_empty(created: list[str]) -> None:
    for directory in reversed(created):
        try:
            os.rmdir(directory)
        except OSError:
            return
