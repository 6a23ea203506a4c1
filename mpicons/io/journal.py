"""Publishing as one journaled transaction, and recovering what a crashed run left.

- **Staging.** Every new file is created exclusively inside ``OUT/.mpicons-staging-TOKEN``, a
  directory this run made itself (``TOKEN`` is its lock's random token), under its final name:
  nothing is ever opened through a pre-existing entry or a symbolic link, and temporary names are
  as short as final ones.
- **Publishing** is a journaled transaction: the journal (what goes in, what is set aside, and the
  device and inode of each) is made durable first, always; existing entries that the new
  checkpoint replaces are moved into the staging directory's ``.replaced`` (the old index first);
  the new files are moved in, the index last. Moving the index in is the commit point. A failure
  before it is rolled back (old files back, old index last); after a crash, the next run that
  takes the lock finds the journal and finishes the transaction in whichever direction it had
  reached. Either way the directory ends up holding exactly what it held before, or the complete
  new checkpoint with its index.
- **Recovery trusts only what it can prove.** It moves an entry only when the journal (checksummed,
  written for this very staging directory) records it and the file there is the one recorded
  (same device and inode). A journal it cannot read or trust, or set-aside files without one,
  stop the run with :class:`UntrustedJournal` (exit 2): nothing is moved or deleted, and the
  message says how to restore the old checkpoint from ``.replaced`` by hand.

No MPI here: the rank that owns the output directory calls these, with its lock held.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..core.errors import InputError
from ..core.names import plain_file_name
from .lock import is_count
from .regular_files import fsync_directory, read_own_file, write_new_file

STAGING_PREFIX = ".mpicons-staging-"
#: Inside the staging directory. Hidden names: no output file can have them (mappings refuse them).
JOURNAL_NAME = ".journal.json"
#: Inside the staging directory: entries of the output directory that the new checkpoint replaces.
ASIDE_DIR = ".replaced"
JOURNAL_VERSION = 2
_JOURNAL_LIMIT = 1 << 26


def _no_hook(label: str) -> None:
    pass


#: Called with a label before every step of publishing; tests replace it to inject failures.
step_hook: Callable[[str], None] = _no_hook


def describe_names(names: Sequence[str], show: int = 3) -> str:
    """The first ``show`` names and how many more, for one-line messages."""
    more = f" and {len(names) - show} more" if len(names) > show else ""
    return ", ".join(names[:show]) + more


@dataclass(frozen=True)
class Entry:
    """A name the transaction moves, and its file's identity when the journal was written (renames keep it)."""

    name: str
    device: int
    inode: int

    @classmethod
    def of(cls, name: str, path: str) -> Entry:
        st = os.lstat(path)
        return cls(name, st.st_dev, st.st_ino)

    def is_at(self, path: str) -> bool:
        """``path`` is this very file: the proof that mpicons put it there."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (self.device, self.inode)


class UntrustedJournal(InputError):
    """A staging directory whose publishing mpicons cannot prove it made: nothing in it, and nothing it
    names, is moved or deleted; the message says how to restore the old checkpoint by hand."""

    def __init__(self, directory: str, staging: str, reason: str) -> None:
        self.directory, self.staging, self.reason = directory, staging, reason
        self.set_aside = set_aside_folders(staging)
        super().__init__(self._message())

    def _message(self) -> str:
        head = (
            f"{self.staging}: an interrupted run's publishing cannot be trusted ({self.reason}), so mpicons "
            "moved and deleted nothing. "
        )
        quote = shlex.quote
        if not self.set_aside:
            return head + f"It set no files aside: remove {self.staging} and rerun"
        folders = " and ".join(self.set_aside)
        moves = "; ".join(f"mv -f {quote(folder)}/* {quote(self.directory)}/" for folder in self.set_aside)
        return head + (
            f"The files it set aside (the old checkpoint) are in {folders}, under their own names: to restore the "
            f"old checkpoint, move them back into {self.directory} ({moves}), then remove {self.staging} and rerun "
            "(new files already moved in are not in the restored index, and may be deleted)"
        )


#: The folders set-aside files have been kept in (``replaced`` by earlier revisions): other folders of a
#: staging directory are staged outputs (``--no-merge``'s adapter folder), never the old checkpoint.
_ASIDE_NAMES = (ASIDE_DIR, "replaced")


def set_aside_folders(staging: str) -> list[str]:
    """The staging directory's folders that hold set-aside entries (also of older mpicons versions)."""
    try:
        entries = list(os.scandir(staging))
    except OSError:
        return []
    folders = []
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.name in _ASIDE_NAMES and entry.is_dir(follow_symlinks=False):
            try:
                if os.listdir(entry.path):
                    folders.append(entry.path)
            except OSError:
                folders.append(entry.path)
    return folders


def _journal_checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _entries(value: object, what: str) -> list[Entry] | str:
    """A journal's list of entries, or why it is not one (names must stay inside the directory)."""
    if not isinstance(value, list):
        return f"its {what} entries are not a list"
    entries: list[Entry] = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"name", "device", "inode"}:
            return f"it lists a {what} entry that is not a file record"
        name, device, inode = item["name"], item["device"], item["inode"]
        if not plain_file_name(name) or name.startswith(".") or len(name.encode("utf-8", "replace")) > 255:
            return f"it names {name!r}, which is not a file name inside the output directory"
        if not (is_count(device, 1 << 64) and is_count(inode, 1 << 64)):
            return f"its record of {name!r} is damaged"
        entries.append(Entry(name, device, inode))
    if len({e.name for e in entries}) != len(entries):
        return f"it lists a {what} name twice"
    return entries


def parse_journal(raw: bytes, token: str) -> tuple[list[Entry], list[Entry]] | str:
    """The new and set-aside entries a journal records, or why it cannot be trusted (pure)."""
    if not raw.strip():
        return "its journal is empty"
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return "its journal is not valid JSON: truncated or damaged"
    if (
        not isinstance(obj, dict)
        or obj.get("version") != JOURNAL_VERSION
        or set(obj) != {"version", "token", "new", "aside", "sha256"}
    ):
        return "its journal is not one this mpicons version writes"
    if obj["token"] != token:
        return "its journal was written for another staging directory"
    new = _entries(obj["new"], "new")
    if isinstance(new, str):
        return new
    aside = _entries(obj["aside"], "set-aside")
    if isinstance(aside, str):
        return aside
    if obj["sha256"] != _journal_checksum({k: v for k, v in obj.items() if k != "sha256"}):
        return "its journal's checksum does not match: it is damaged"
    if not new:
        return "its journal lists no new files"
    return new, aside


@dataclass
class Transaction:
    """Moving ``new`` (staged files, commit point last) into ``directory``, setting ``aside`` entries apart."""

    directory: str
    staging: str
    new: list[Entry]
    aside: list[Entry]
    durable: bool = True

    @classmethod
    def begin(cls, directory: str, staging: str, new: Sequence[str], aside: Sequence[str], durable: bool) -> Transaction:
        """The transaction of publishing the staged ``new`` files, replacing the ``aside`` entries."""
        return cls(
            directory,
            staging,
            [Entry.of(name, os.path.join(staging, name)) for name in new],
            [Entry.of(name, os.path.join(directory, name)) for name in aside],
            durable,
        )

    def _out(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _staged(self, name: str) -> str:
        return os.path.join(self.staging, name)

    def _set_aside(self, name: str) -> str:
        return os.path.join(self.staging, ASIDE_DIR, name)

    def _sync(self, *paths: str) -> None:
        if self.durable:
            for path in paths:
                fsync_directory(path)

    def _doubt(self, reason: str) -> UntrustedJournal:
        return UntrustedJournal(self.directory, self.staging, reason)

    def write_journal(self) -> None:
        """Record the transaction, durably even with ``--no-sync``: recovery acts only on what it records."""
        step_hook("journal")
        os.mkdir(self._staged(ASIDE_DIR))
        body = {
            "version": JOURNAL_VERSION,
            "token": staging_token(self.staging),
            "new": [asdict(entry) for entry in self.new],
            "aside": [asdict(entry) for entry in self.aside],
        }
        partial = self._staged(JOURNAL_NAME + ".partial")
        write_new_file(partial, json.dumps({**body, "sha256": _journal_checksum(body)}, indent=1).encode())
        os.rename(partial, self._staged(JOURNAL_NAME))
        fsync_directory(self.staging)
        fsync_directory(self.directory)

    def run(self, before_commit: Callable[[], None]) -> None:
        """Publish; on any failure before the commit point, roll back and re-raise."""
        self.write_journal()
        try:
            for entry in self.aside:
                step_hook(f"aside {entry.name}")
                os.rename(self._out(entry.name), self._set_aside(entry.name))
            if self.aside:
                self._sync(self.directory, self._staged(ASIDE_DIR))
            for entry in self.new[:-1]:
                step_hook(f"publish {entry.name}")
                os.rename(self._staged(entry.name), self._out(entry.name))
            self._sync(self.directory)
            before_commit()
            last = self.new[-1].name
            step_hook(f"commit {last}")
            os.rename(self._staged(last), self._out(last))
        except BaseException:
            try:
                self.roll_back()
            except (OSError, InputError):
                pass  # the staging directory and its journal stay: the next run recovers them
            raise
        try:
            self._sync(self.directory)
            self.discard()
        except OSError:
            pass  # committed: what is left is cleaned up by the next run

    def committed(self) -> bool:
        """The commit point was passed: the last new file (the index) is in place, and it is ours."""
        last = self.new[-1]
        return not os.path.lexists(self._staged(last.name)) and last.is_at(self._out(last.name))

    def check_on_disk(self) -> None:
        """Raise :class:`UntrustedJournal` unless what is on disk is a state this transaction passes through."""
        aside_by_name = {entry.name: entry for entry in self.aside}
        for entry in self.new:
            staged, out = self._staged(entry.name), self._out(entry.name)
            if os.path.lexists(staged):
                if not entry.is_at(staged):
                    raise self._doubt(f"{staged} is not the file its journal recorded")
            elif os.path.lexists(out) and not entry.is_at(out):
                old = aside_by_name.get(entry.name)
                if old is None or not old.is_at(out):
                    raise self._doubt(f"its journal names {out} as new, and that file is not one it made")
        for entry in self.aside:
            if os.path.lexists(self._set_aside(entry.name)) and not entry.is_at(self._set_aside(entry.name)):
                raise self._doubt(f"{self._set_aside(entry.name)} is not the file its journal recorded")
        kept = self._staged(ASIDE_DIR)
        if os.path.lexists(kept):
            if not os.path.isdir(kept) or os.path.islink(kept):
                raise self._doubt(f"{kept} is not the directory it made")
            unlisted = sorted(set(os.listdir(kept)) - set(aside_by_name))
            if unlisted:
                raise self._doubt(f"{kept} holds {describe_names(unlisted)}, which its journal does not list")
        if self.committed() and not all(entry.is_at(self._out(entry.name)) for entry in self.new):
            raise self._doubt("its index is in place but not every file of its checkpoint is")

    def roll_back(self) -> None:
        """Undo whatever part of :meth:`run` happened (also after a crash): new files out, old ones back.

        Moves only files it recorded; whatever would be overwritten, or would stay set aside, stops it
        (:class:`UntrustedJournal`) before anything is deleted.
        """
        step_hook("roll back")
        for entry in reversed(self.new):
            out = self._out(entry.name)
            if entry.is_at(out) and not os.path.lexists(self._staged(entry.name)):
                os.rename(out, self._staged(entry.name))
        for entry in reversed(self.aside):
            kept, out = self._set_aside(entry.name), self._out(entry.name)
            if entry.is_at(kept):
                if os.path.lexists(out):
                    raise self._doubt(f"{out} is in the way of the set-aside file {kept}")
                os.rename(kept, out)
        self._sync(self.directory)
        if set_aside_folders(self.staging):
            raise self._doubt(f"files remain set aside in {self._staged(ASIDE_DIR)} after undoing")
        self.discard()

    def discard(self) -> None:
        """Remove the staging directory (what it holds is either published or abandoned)."""
        step_hook("discard")
        remove_staging(self.staging)

    @classmethod
    def recorded(cls, directory: str, staging: str) -> Transaction | None:
        """The transaction a staging directory's journal records (None: it has no journal), checked
        against the disk; :class:`UntrustedJournal` when the journal cannot be read or trusted."""
        try:
            found = read_own_file(os.path.join(staging, JOURNAL_NAME), _JOURNAL_LIMIT)
        except OSError as exc:
            raise UntrustedJournal(directory, staging, f"its journal cannot be read: {exc.strerror}") from None
        if found is None:
            return None
        if found.kind != "regular file":
            raise UntrustedJournal(directory, staging, f"its journal is {found.kind}")
        parsed = parse_journal(found.data, staging_token(staging))
        if isinstance(parsed, str):
            raise UntrustedJournal(directory, staging, parsed)
        transaction = cls(directory, staging, *parsed)
        transaction.check_on_disk()
        return transaction


def staging_token(staging: str) -> str:
    """The token a staging directory's name carries: its run's, recorded in its journal."""
    return os.path.basename(staging)[len(STAGING_PREFIX) :]


def remove_staging(staging: str) -> None:
    """Delete a staging directory, the set-aside files first and the journal last, so that a crash
    meanwhile never leaves set-aside files without their journal."""
    kept = os.path.join(staging, ASIDE_DIR)
    if os.path.lexists(kept):
        shutil.rmtree(kept)
    for entry in os.scandir(staging):
        if entry.name != JOURNAL_NAME:
            shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
    if os.path.lexists(os.path.join(staging, JOURNAL_NAME)):
        os.unlink(os.path.join(staging, JOURNAL_NAME))
    os.rmdir(staging)


def settle(directory: str, staging: str) -> str:
    """Finish or undo what one staging directory's run left; returns what was done.

    A staging directory without a journal holds only unpublished new files, unless files were set
    aside there: then it is not touched (:class:`UntrustedJournal`).
    """
    transaction = Transaction.recorded(directory, staging)
    name = os.path.basename(staging)
    if transaction is None:
        if set_aside_folders(staging):
            raise UntrustedJournal(directory, staging, "it holds set-aside files but no journal")
        remove_staging(staging)
        return f"removed the unfinished files of an interrupted run ({name})"
    if transaction.committed():
        transaction.discard()
        return f"finished publishing an interrupted run's checkpoint ({name}: it was complete)"
    transaction.roll_back()
    return f"undid an interrupted run's half-done publishing ({name}): the directory is as it was before"


def staging_directories(directory: str) -> list[str]:
    """The staging directories runs left in ``directory``, by name."""
    return [
        entry.path
        for entry in sorted(os.scandir(directory), key=lambda e: e.name)
        if entry.name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False)
    ]


def recover(directory: str, keep: Sequence[str] = ()) -> list[str]:
    """Finish what crashed runs left (call with the lock held); returns one note per thing done.
    ``keep``: staging directories left as they are (a stopped run's partial output, to continue from).

    Raises :class:`UntrustedJournal` (exit 2) for a staging directory it cannot prove it may change.
    """
    return [settle(directory, staging) for staging in staging_directories(directory) if staging not in keep]
