"""The output directory's lock: one run at a time.

``OUT/.mpicons.lock`` is created atomically (written under a private name, then hard-linked into
place, which fails if it exists: atomic on NFS and Lustre too). It names the holder: host, pid,
Slurm job and restart count, start time. A second run stops at once. A lock whose holder is provably
gone (same host and boot, same pid namespace, pid absent or now another process) is broken, and so is
the lock of a requeued Slurm job's earlier attempt, on any node (Slurm ends an attempt before it starts
the next one). Any other lock, and anything at the lock's name mpicons cannot read as its own, is
broken only with ``--break-lock``.

No MPI here: the rank that owns the output directory calls these, inside agreed phases.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from dataclasses import asdict, dataclass

from ..core.errors import InputError, WriteError
from .regular_files import Found, read_own_file, write_new_file

LOCK_NAME = ".mpicons.lock"
_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")
_LOCK_LIMIT = 1 << 16
#: Largest pid Linux can give (PID_MAX_LIMIT); a lock claiming a larger one is not mpicons'.
_PID_LIMIT = 1 << 22
#: Far above any restart count Slurm keeps; a lock claiming more is not mpicons'.
_RESTART_LIMIT = 1 << 32


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


def _restart_count(job: str | None) -> int | None:
    """``SLURM_RESTART_COUNT`` (0 in a job's first attempt, which has none); None outside Slurm or unreadable,
    so that a lock without a trustworthy count is never taken over as an earlier attempt's."""
    if job is None:
        return None
    raw = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not raw.isascii() or not raw.isdigit() or int(raw) >= _RESTART_LIMIT:
        return None
    return int(raw)


def _is_text(value: object, optional: bool = False) -> bool:
    """A short printable string (a lock's text fields go into one-line messages)."""
    if value is None:
        return optional
    return isinstance(value, str) and len(value) <= 256 and value.isprintable()


def is_count(value: object, limit: int, optional: bool = False) -> bool:
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
    #: SLURM_RESTART_COUNT when the lock was taken; None outside Slurm, and in a lock of an older mpicons.
    job_restart: int | None = None

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        job = os.environ.get("SLURM_JOB_ID") or None
        return cls(
            host=socket.gethostname(),
            pid=pid,
            job=job,
            started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            boot_id=_boot_id(),
            pid_namespace=_pid_namespace(),
            process_start=_process_start(pid),
            token=secrets.token_hex(8),
            job_restart=_restart_count(job),
        )

    def describe(self) -> str:
        job = f", Slurm job {self.job}" if self.job else ""
        if self.job and self.job_restart:
            job += f" (restart {self.job_restart})"
        return f"pid {self.pid} on {self.host}{job}, since {self.started}"

    def requeue_of(self, other: Holder) -> bool:
        """True when this holder is a later attempt of ``other``'s Slurm job (requeued after preemption, a
        node failure or ``scontrol requeue``): Slurm has ended ``other``, on whichever node it ran. The same
        attempt is never taken over: it may be a second step of the job, running now."""
        return (
            bool(other.job) and other.job == self.job
            and self.job_restart is not None and other.job_restart is not None
            and self.job_restart > other.job_restart
        )  # fmt: skip

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
            and is_count(self.pid_namespace, 1 << 64) and is_count(self.process_start, 1 << 63, optional=True)
            and isinstance(self.token, str) and bool(_TOKEN.match(self.token))
            and is_count(self.job_restart, _RESTART_LIMIT, optional=True) and (bool(self.job) or self.job_restart is None)
        )  # fmt: skip

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The holder a lock file names; None for anything mpicons did not write (damaged, hostile, foreign).
        A lock of an older mpicons, without ``job_restart``, is read with None there (never a requeue's)."""
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        fields = set(cls.__dataclass_fields__)
        if not isinstance(obj, dict) or set(obj) not in (fields, fields - {"job_restart"}):
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
            if not break_lock and other is not None and lock.holder.requeue_of(other):
                notes.append(
                    f"took over the lock of this Slurm job's earlier attempt (job {other.job}, restart "
                    f"{other.job_restart} -> {lock.holder.job_restart}; {other.describe()})"
                )
                lock._break(seen)
                continue
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
