"""The output directory: one run at a time, new files staged privately, published as one transaction.

No MPI here: the rank that owns the output directory calls these, inside agreed phases.

- **Lock.** ``OUT/.mpicons.lock`` is created atomically (written under a private name, then
  hard-linked into place, which fails if it exists: atomic on NFS and Lustre too). It names the
  holder: host, pid, Slurm job, start time. A second run stops at once. A lock whose holder is
  provably gone (same host and boot, same pid namespace, pid absent or now another process) is
  broken; any other lock, and anything at the lock's name mpicons cannot read as its own, only
  with ``--break-lock``.
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
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.errors import InputError, WriteError
from ..core.names import CHECKPOINT_FILE, INDEX_NAME, SHARD_FILE, plain_file_name

LOCK_NAME = ".mpicons.lock"
STAGING_PREFIX = ".mpicons-staging-"
#: Inside the staging directory. Hidden names: no output file can have them (mappings refuse them).
JOURNAL_NAME = ".journal.json"
#: Inside the staging directory: entries of the output directory that the new checkpoint replaces.
ASIDE_DIR = ".replaced"
JOURNAL_VERSION = 2
_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_LOCK_LIMIT = 1 << 16
_JOURNAL_LIMIT = 1 << 26
#: Largest pid Linux can give (PID_MAX_LIMIT); a lock claiming a larger one is not mpicons'.
_PID_LIMIT = 1 << 22


def _no_hook(label: str) -> None:
    pass


#: Called with a label before every step of publishing; tests replace it to inject failures.
step_hook: Callable[[str], None] = _no_hook
#: Writes bytes to a descriptor, returning the count written; tests replace it to inject a full disk.
write_bytes: Callable[[int, memoryview], int] = os.write


# ---------------------------------------------------------------- small file-system helpers


def _naming(path: str, exc: OSError) -> OSError:
    """``exc`` with ``path`` as its file name (a write, fsync or close on a descriptor names none)."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), path)


def fsync_directory(path: str) -> None:
    """Make renames and creations in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _naming(path, exc) from None
    finally:
        os.close(fd)


def write_new_file(path: str, data: bytes, durable: bool = True) -> None:
    """Create ``path`` exclusively (never through an existing entry or link) holding ``data``.

    Any failure (a full disk) names ``path``, and the partly written file is removed again.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[write_bytes(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        try:
            os.unlink(path)  # this run's own, just created
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _naming(path, exc) from None
        raise


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "regular file"
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a device")


@dataclass(frozen=True)
class Found:
    """What is at a path mpicons reads its own small files from (the lock, a journal)."""

    identity: tuple[int, int]  # device, inode
    kind: str  # "regular file", or what else is there ("a FIFO", "a directory", ...)
    data: bytes  # the first bytes of a regular file; empty for anything else


def read_own_file(path: str, limit: int) -> Found | None:
    """The first ``limit`` bytes of the regular file at ``path`` (None if absent), never following a
    link, never blocking on a FIFO and never opening a device: anything else is reported as found."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return Found((st.st_dev, st.st_ino), _kind(st.st_mode), b"")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        return Found((st.st_dev, st.st_ino), "a symbolic link", b"")  # replaced by a link meanwhile
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return Found((st.st_dev, st.st_ino), _kind(st.st_mode), b"")
        return Found((st.st_dev, st.st_ino), "regular file", os.read(fd, limit))
    except OSError as exc:
        raise _naming(path, exc) from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the lock


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _is_text(value: object, optional: bool = False) -> bool:
    """A short printable string (a lock's text fields go into one-line messages)."""
    if value is None:
        return optional
    return isinstance(value, str) and len(value) <= 256 and value.isprintable()


def _is_count(value: object, limit: int, optional: bool = False) -> bool:
    if value is None:
        return optional
    return type(value) is int and 0 <= value < limit


@dataclass(frozen=True)
class Holder:
    """Who holds an output directory's lock."""

    host: str
    pid: int
    job: str | None
    started: str
    boot_id: str = ""
    pid_namespace: int = 0
    process_start: int | None = None
    token: str = ""

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            job=os.environ.get("SLURM_JOB_ID"),
            started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            boot_id=_boot_id(),
            pid_namespace=_pid_namespace(),
            process_start=_process_start(pid),
            token=secrets.token_hex(8),
        )

    def describe(self) -> str:
        job = f", Slurm job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host}{job}, since {self.started}"

    def provably_gone(self) -> bool:
        """True only when this process certainly no longer runs: same machine, boot and pid namespace."""
        if (self.host, self.boot_id, self.pid_namespace) != (socket.gethostname(), _boot_id(), _pid_namespace()):
            return False
        if not self.boot_id or not self.pid_namespace:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # a process with this pid exists (another user's)
        now = _process_start(self.pid)
        return self.process_start is not None and now is not None and now != self.process_start

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    def well_formed(self) -> bool:
        """Every field of the type and range mpicons writes (a lock is read from a shared directory)."""
        return (
            _is_text(self.host) and bool(self.host) and type(self.pid) is int and 0 < self.pid <= _PID_LIMIT
            and _is_text(self.job, optional=True) and _is_text(self.started) and _is_text(self.boot_id)
            and _is_count(self.pid_namespace, 1 << 64) and _is_count(self.process_start, 1 << 63, optional=True)
            and isinstance(self.token, str) and bool(_TOKEN.match(self.token))
        )  # fmt: skip

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The holder a lock file names; None for anything mpicons did not write (damaged, hostile, foreign)."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or set(obj) != set(cls.__dataclass_fields__):
            return None
        holder = cls(**obj)
        return holder if holder.well_formed() else None


@dataclass(frozen=True)
class SeenLock:
    """What is at a lock's name: the entry, and the holder it names (None: not a lock mpicons can read)."""

    found: Found
    holder: Holder | None

    def describe(self, path: str) -> str:
        if self.holder is not None:
            return self.holder.describe()
        if self.found.kind != "regular file":
            return f"held by an unknown holder: {path} is {self.found.kind}, not a lock mpicons made"
        return f"held by an unknown holder: {path} is not a lock mpicons can read as its own"


def read_lock(directory: str) -> SeenLock | None:
    """The lock of the output directory ``directory``, if any; never follows, blocks or raises on hostile content."""
    found = read_own_file(os.path.join(directory, LOCK_NAME), _LOCK_LIMIT)
    if found is None:
        return None
    return SeenLock(found, Holder.parse(found.data) if found.kind == "regular file" else None)


class OutputLock:
    """``OUT/.mpicons.lock``, held for a whole run by the rank that owns the output directory."""

    def __init__(self, directory: str, holder: Holder) -> None:
        self.directory = directory
        self.holder = holder
        self.path = os.path.join(directory, LOCK_NAME)

    @classmethod
    def acquire(cls, directory: str, break_lock: bool = False) -> tuple[OutputLock, list[str]]:
        """Take the lock; returns it and notes about any lock broken on the way.

        Raises InputError naming the holder when another run (or an unknown holder) holds the directory.
        """
        lock = cls(directory, Holder.me())
        notes: list[str] = []
        for _ in range(8):
            if lock._create():
                return lock, notes
            seen = read_lock(directory)
            if seen is None:
                continue  # released meanwhile
            other = seen.holder
            if break_lock or (other is not None and other.provably_gone()):
                how = "as asked (--break-lock)" if break_lock else "its process is gone"
                notes.append(f"broke the lock of an earlier run ({seen.describe(lock.path)}): {how}")
                lock._break(seen)
                continue
            if other is None:
                raise InputError(
                    f"{directory}: the output directory is {seen.describe(lock.path)}. If no mpicons run is "
                    "using this directory, rerun with --break-lock"
                )
            raise InputError(
                f"{directory}: another mpicons run is using this output directory ({other.describe()}; lock file "
                f"{lock.path}). Wait for it to finish; if it is dead (killed on another node), rerun with --break-lock"
            )
        raise WriteError(f"{lock.path}: could not take the lock: it keeps changing hands")

    def _create(self) -> bool:
        """Create the lock with its content in one atomic step; False if it exists."""
        private = f"{self.path}.{self.holder.token}"
        write_new_file(private, self.holder.to_bytes())
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            # NFS may report a lost reply for a link that worked; a file system without hard links
            # gets an exclusive create instead (the lock may then be briefly empty).
            if os.stat(private).st_nlink == 2:
                return True
            try:
                write_new_file(self.path, self.holder.to_bytes())
                return True
            except FileExistsError:
                return False
        finally:
            os.unlink(private)

    def _break(self, seen: SeenLock) -> None:
        """Remove the entry ``seen`` at the lock's name, and only that one (another run may have replaced it).

        Whatever is there is removed as an entry (a link, never its target); a directory only when empty.
        """
        aside = f"{self.path}.broken-{self.holder.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = read_own_file(aside, _LOCK_LIMIT)
        if moved != seen.found:  # we moved a newer lock: put it back unless yet another took its place
            _put_back(aside, self.path)
            return
        if moved.kind != "a directory":
            os.unlink(aside)
            return
        try:
            os.rmdir(aside)
        except OSError:
            _put_back(aside, self.path)
            raise InputError(
                f"{self.path}: is a directory that is not empty, not a lock mpicons made; mpicons removes no "
                f"such directory: move it out of {self.directory} yourself if no run is using it"
            ) from None

    def owned(self) -> bool:
        seen = read_lock(self.directory)
        return seen is not None and seen.holder is not None and seen.holder.token == self.holder.token

    def release(self) -> None:
        if self.owned():
            os.unlink(self.path)


def _put_back(moved: str, path: str) -> None:
    """Return an entry renamed away from ``path``, unless yet another run's lock took ``path`` meanwhile
    (then the moved lock's holder finds its lock lost, and publishes nothing)."""
    try:
        os.link(moved, path)
    except FileExistsError:
        pass
    except OSError:  # a directory, or a file system without hard links
        if not os.path.lexists(path):
            os.rename(moved, path)
            return
        if os.path.isdir(moved) and not os.path.islink(moved):
            return  # left under its moved name: mpicons deletes no directory it did not make
    os.unlink(moved)


# ---------------------------------------------------------------- the transaction


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
        self.set_aside = _set_aside_folders(staging)
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


def _set_aside_folders(staging: str) -> list[str]:
    """The staging directory's folders that hold entries (set-aside files, also of older mpicons versions)."""
    try:
        entries = list(os.scandir(staging))
    except OSError:
        return []
    folders = []
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
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
        if not (_is_count(device, 1 << 64) and _is_count(inode, 1 << 64)):
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
                raise self._doubt(f"{kept} holds {_describe_names(unlisted)}, which its journal does not list")
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
        if _set_aside_folders(self.staging):
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


def _settle(directory: str, staging: str) -> str:
    """Finish or undo what one staging directory's run left; returns what was done.

    A staging directory without a journal holds only unpublished new files, unless files were set
    aside there: then it is not touched (:class:`UntrustedJournal`).
    """
    transaction = Transaction.recorded(directory, staging)
    name = os.path.basename(staging)
    if transaction is None:
        if _set_aside_folders(staging):
            raise UntrustedJournal(directory, staging, "it holds set-aside files but no journal")
        remove_staging(staging)
        return f"removed the unfinished files of an interrupted run ({name})"
    if transaction.committed():
        transaction.discard()
        return f"finished publishing an interrupted run's checkpoint ({name}: it was complete)"
    transaction.roll_back()
    return f"undid an interrupted run's half-done publishing ({name}): the directory is as it was before"


def recover(directory: str) -> list[str]:
    """Finish what crashed runs left (call with the lock held); returns one note per thing done.

    Raises :class:`UntrustedJournal` (exit 2) for a staging directory it cannot prove it may change.
    """
    notes = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False):
            notes.append(_settle(directory, entry.path))
    return notes


# ---------------------------------------------------------------- one run's use of the directory


def _describe_names(names: Sequence[str], show: int = 3) -> str:
    more = f" and {len(names) - show} more" if len(names) > show else ""
    return ", ".join(names[:show]) + more


def refuse_sharded(path: str) -> None:
    """Refuse an output directory that directly holds a sharded checkpoint: those are some run's input
    (mostly the two arguments swapped), and a checkpoint published among them would spoil both."""
    shards = sorted(name for name in os.listdir(path) if SHARD_FILE.match(name))
    if shards:
        raise InputError(
            f"{path}: the output directory holds a sharded checkpoint ({_describe_names(shards)}), and mpicons "
            "never writes among shard files, with --force or without. The arguments look swapped: the shard "
            "directory comes first, the output directory second (mpicons consolidate INPUT_DIR OUTPUT_DIR)"
        )


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

    @classmethod
    def open(cls, path: str, break_lock: bool = False) -> OutputDir:
        """Create ``path`` if needed, take its lock and recover what crashed runs left there.

        A directory of shard files is refused before anything is created in it.
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
            session.notes += recover(path)
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
        stale: list[str] = []
        if checkpoint:
            listed = _indexed_files(self.path)
            for entry in os.scandir(self.path):
                if entry.name in new or not (CHECKPOINT_FILE.match(entry.name) or entry.name in listed):
                    continue
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    stale.append(entry.name)
        for name in clash:
            if os.path.isdir(os.path.join(self.path, name)) and not os.path.islink(os.path.join(self.path, name)):
                raise InputError(f"{os.path.join(self.path, name)}: is a directory; mpicons never replaces a directory")
        entries = sorted(set(clash) | set(stale), key=lambda n: (n != INDEX_NAME, n))
        if entries and not force:
            raise InputError(
                f"{self.path}: already holds {_describe_names(entries)} (use --force to replace "
                f"{'them' if len(entries) > 1 else 'it'})"
            )
        return entries

    def stage(self) -> str:
        """Create this run's private staging directory (named with its lock's token); every new file is
        created inside it."""
        staging = os.path.join(self.path, STAGING_PREFIX + self.lock.holder.token)
        os.mkdir(staging, 0o755)
        os.chmod(staging, 0o755)  # whatever the umask: every rank opens the files staged here
        self.staging = staging
        return staging

    def write_staged(self, name: str, data: bytes, durable: bool = True) -> None:
        """Create one small file (the index) in the staging directory."""
        if self.staging is None:
            raise RuntimeError("write_staged() before stage()")
        step_hook(f"write {name}")
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
                _abandon(self.path, self.staging)
            self.staging = None
        finally:
            self.lock.release()
            if not self.published:
                _remove_empty(self.created)


def _abandon(directory: str, staging: str) -> None:
    """Remove an unpublished staging directory; if publishing had begun, finish it in its direction first.

    Old files set aside live in the staging directory until the transaction ends, so it is never
    simply deleted once a journal exists. If even that fails, it stays for the next run to recover.
    """
    try:
        _settle(directory, staging)
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
