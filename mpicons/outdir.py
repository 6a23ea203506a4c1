"""The output directory: one run at a time, new files staged privately, published as one transaction.

No MPI here: the rank that owns the output directory calls these, inside agreed phases.

- **Lock.** ``OUT/.mpicons.lock`` is created atomically (written under a private name, then
  hard-linked into place, which fails if it exists: atomic on NFS and Lustre too). It names the
  holder: host, pid, Slurm job, start time. A second run stops at once. A lock whose holder is
  provably gone (same host and boot, same pid namespace, pid absent or now another process) is
  broken; any other lock only with ``--break-lock``.
- **Staging.** Every new file is created exclusively inside ``OUT/.mpicons-staging-XXXXXXXX``, a
  directory this run made itself (``mkdtemp``), under its final name: nothing is ever opened
  through a pre-existing entry or a symbolic link, and temporary names are as short as final ones.
- **Publishing** is a journaled transaction: the journal (what goes in, what is set aside) is
  made durable first; existing entries that the new checkpoint replaces are moved into the
  staging directory (the old index first); the new files are moved in, the index last. Moving the
  index in is the commit point. A failure before it is rolled back (old files back, old index
  last); after a crash, the next run that takes the lock finds the journal and finishes the
  transaction in whichever direction it had reached. Either way the directory ends up holding
  exactly what it held before, or the complete new checkpoint with its index.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .errors import InputError, WriteError

LOCK_NAME = ".mpicons.lock"
STAGING_PREFIX = ".mpicons-staging-"
JOURNAL_NAME = "journal.json"
#: Inside the staging directory: entries of the output directory that the new checkpoint replaces.
ASIDE_DIR = "replaced"
INDEX_NAME = "model.safetensors.index.json"
#: File names a Hugging Face safetensors checkpoint is made of (beside the files its index names).
CHECKPOINT_FILE = re.compile(r"^(model-\d{5,}-of-\d{5,}\.safetensors|model\.safetensors|model\.safetensors\.index\.json)$")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _no_hook(label: str) -> None:
    pass


#: Called with a label before every step of publishing; tests replace it to inject failures.
step_hook: Callable[[str], None] = _no_hook


# ---------------------------------------------------------------- small file-system helpers


def fsync_directory(path: str) -> None:
    """Make renames and creations in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: str, data: bytes, durable: bool = True) -> None:
    """Create ``path`` exclusively (never through an existing entry or link) holding ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _read_small(path: str, limit: int = 1 << 16) -> bytes | None:
    """The first ``limit`` bytes of the regular file at ``path``; None if absent.

    Anything else there (a link, a directory, a pipe) is refused: only mpicons' own files are read.
    """
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(kind):
        raise InputError(f"{path}: mpicons did not make this (it is not a regular file); remove it and rerun")
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, limit)
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

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            obj = json.loads(raw)
            return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})
        except (ValueError, TypeError, KeyError):
            return None


class OutputLock:
    """``OUT/.mpicons.lock``, held for a whole run by the rank that owns the output directory."""

    def __init__(self, directory: str, holder: Holder) -> None:
        self.directory = directory
        self.holder = holder
        self.path = os.path.join(directory, LOCK_NAME)

    @classmethod
    def acquire(cls, directory: str, break_lock: bool = False) -> tuple[OutputLock, list[str]]:
        """Take the lock; returns it and notes about any lock broken on the way.

        Raises InputError naming the holder when another run holds the directory.
        """
        lock = cls(directory, Holder.me())
        notes: list[str] = []
        for _ in range(8):
            if lock._create():
                return lock, notes
            raw = _read_small(lock.path)
            if raw is None:
                continue  # released meanwhile
            other = Holder.parse(raw)
            if break_lock or (other is not None and other.provably_gone()):
                how = "as asked (--break-lock)" if break_lock else "its process is gone"
                notes.append(f"broke the lock of an earlier run ({other.describe() if other else 'unreadable lock'}): {how}")
                lock._break(raw)
                continue
            who = other.describe() if other else "an unknown run (the lock file is unreadable)"
            raise InputError(
                f"{directory}: another mpicons run is using this output directory ({who}; lock file {lock.path}). "
                "Wait for it to finish; if it is dead (killed on another node), rerun with --break-lock"
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

    def _break(self, raw: bytes) -> None:
        """Remove the lock whose content is ``raw``, and only that one (another run may have replaced it)."""
        aside = f"{self.path}.broken-{self.holder.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read_small(aside) != raw:  # we moved a newer lock: put it back unless yet another took its place
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.unlink(aside)

    def owned(self) -> bool:
        raw = _read_small(self.path)
        holder = Holder.parse(raw) if raw is not None else None
        return holder is not None and holder.token == self.holder.token

    def release(self) -> None:
        if self.owned():
            os.unlink(self.path)


# ---------------------------------------------------------------- the transaction


@dataclass
class Transaction:
    """Moving ``new`` (staged files, commit point last) into ``directory``, setting ``aside`` entries apart."""

    directory: str
    staging: str
    new: list[str]
    aside: list[str]
    durable: bool = True

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

    def write_journal(self) -> None:
        step_hook("journal")
        journal = {"version": 1, "new": self.new, "aside": self.aside}
        partial = self._staged(JOURNAL_NAME + ".partial")
        write_new_file(partial, json.dumps(journal, indent=1).encode(), self.durable)
        os.rename(partial, self._staged(JOURNAL_NAME))
        os.mkdir(self._staged(ASIDE_DIR))
        self._sync(self.staging, self.directory)

    def run(self, before_commit: Callable[[], None]) -> None:
        """Publish; on any failure before the commit point, roll back and re-raise."""
        self.write_journal()
        try:
            for name in self.aside:
                step_hook(f"aside {name}")
                os.rename(self._out(name), self._set_aside(name))
            if self.aside:
                self._sync(self.directory, self._staged(ASIDE_DIR))
            for name in self.new[:-1]:
                step_hook(f"publish {name}")
                os.rename(self._staged(name), self._out(name))
            self._sync(self.directory)
            before_commit()
            step_hook(f"commit {self.new[-1]}")
            os.rename(self._staged(self.new[-1]), self._out(self.new[-1]))
        except BaseException:
            try:
                self.roll_back()
            except OSError:
                pass  # the staging directory and its journal stay: the next run recovers them
            raise
        try:
            self._sync(self.directory)
            self.discard()
        except OSError:
            pass  # committed: what is left is cleaned up by the next run

    def committed(self) -> bool:
        last = self.new[-1]
        return not os.path.lexists(self._staged(last)) and os.path.lexists(self._out(last))

    def roll_back(self) -> None:
        """Undo whatever part of :meth:`run` happened (also after a crash): new files out, old ones back."""
        step_hook("roll back")
        for name in reversed(self.new):
            if os.path.lexists(self._out(name)) and not os.path.lexists(self._staged(name)):
                os.rename(self._out(name), self._staged(name))
        for name in reversed(self.aside):
            if os.path.lexists(self._set_aside(name)):
                os.rename(self._set_aside(name), self._out(name))
        self._sync(self.directory)
        self.discard()

    def discard(self) -> None:
        """Remove the staging directory (what it holds is either published or abandoned)."""
        step_hook("discard")
        shutil.rmtree(self.staging)

    @classmethod
    def from_journal(cls, directory: str, staging: str) -> Transaction | None:
        raw = _read_small(os.path.join(staging, JOURNAL_NAME), 1 << 30)
        if raw is None:
            return None
        try:
            obj = json.loads(raw)
            new, aside = list(obj["new"]), list(obj["aside"])
        except (ValueError, TypeError, KeyError):
            return None
        if not new or not all(plain_file_name(n) for n in new + aside):
            return None
        return cls(directory, staging, new, aside)


def plain_file_name(name: object) -> bool:
    """A file name that stays inside its directory: not empty, not ``.``/``..``, no separators or NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def recover(directory: str) -> list[str]:
    """Finish what crashed runs left (call with the lock held); returns one note per thing done."""
    notes = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not (entry.name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False)):
            continue
        staging = entry.path
        transaction = Transaction.from_journal(directory, staging)
        if transaction is None:
            shutil.rmtree(staging)
            notes.append(f"removed the unfinished files of an interrupted run ({entry.name})")
        elif transaction.committed():
            transaction.discard()
            notes.append(f"finished publishing an interrupted run's checkpoint ({entry.name}: it was complete)")
        else:
            transaction.roll_back()
            notes.append(f"undid an interrupted run's half-done publishing ({entry.name}): the directory is as it was before")
    return notes


# ---------------------------------------------------------------- one run's use of the directory


def _describe_names(names: Sequence[str], show: int = 3) -> str:
    more = f" and {len(names) - show} more" if len(names) > show else ""
    return ", ".join(names[:show]) + more


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
        """Create ``path`` if needed, take its lock and recover what crashed runs left there."""
        created = _make_directories(path)
        try:
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
        """Create this run's private staging directory; every new file is created inside it."""
        self.staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path)
        os.chmod(self.staging, 0o755)
        return self.staging

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
        Transaction(self.path, self.staging, list(new), list(aside), durable).run(check)
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
    transaction = Transaction.from_journal(directory, staging)
    try:
        if transaction is None:
            shutil.rmtree(staging)
        elif transaction.committed():
            transaction.discard()
        else:
            transaction.roll_back()
    except OSError:
        pass  # left in place: the next run that takes the lock recovers it


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
