"""What this node can give: its name, the memory a rank may use, the file names its file systems hold (no MPI here)."""

from __future__ import annotations

import errno
import os
import resource
import socket
from collections.abc import Mapping

from .errors import OUT_OF_MEMORY, InputError
from .reports import count_of, human_bytes, human_size

#: Address space the libraries mpicons loads need to start. With less left under ``ulimit -v`` they end
#: the process themselves with their own messages (OpenBLAS exits, MPI_Init aborts), so it is checked first.
NUMPY_START_ROOM = 96 << 20  # numpy with one OpenBLAS thread: about 86 MB
MPI_START_ROOM = 64 << 20  # MPICH with UCX: about 45 MB of pools and thread stacks
#: How the dynamic loader reports an ``mmap`` refused for want of memory (it raises no MemoryError),
#: and how Python reports a thread whose stack could not be mapped.
_OUT_OF_MEMORY_REASONS = ("failed to map segment from shared object", "cannot allocate memory", "can't start new thread")


def host_name() -> str:
    return socket.gethostname()


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _cgroup_room() -> int | None:
    """Memory left under this process's cgroup v2 limit (Slurm confines jobs this way), if any."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as handle:
            path = next((line.split(":", 2)[2].strip() for line in handle if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="ascii") as handle:
            limit = handle.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="ascii") as handle:
            return max(0, int(limit) - int(handle.read().strip()))
    except (OSError, ValueError, StopIteration):
        return None


def available_memory() -> int | None:
    """Bytes this node can still give its processes (the smallest of free memory and cgroup room)."""
    known = [m for m in (_meminfo_available(), _cgroup_room()) if m is not None]
    return min(known) if known else None


def check_buffer_size(buffer_size: int, ranks_on_node: int, parts: int = 0) -> None:
    """Refuse a ``--buffer-size`` the node cannot give every rank on it, before any work starts;
    ``parts``: the bytes of upload parts a rank holds besides (an ``s3://`` output)."""
    if parts:
        total = buffer_size + parts
        available = available_memory()
        if available is not None and total * ranks_on_node > available:
            raise InputError(
                f"--buffer-size {human_size(buffer_size)} plus {human_size(parts)} of upload parts (3 × --s3-part-size) per "
                f"rank × {count_of(ranks_on_node, 'rank')} on {host_name()} is more than the {human_bytes(available)} of "
                "memory available there; choose a smaller --s3-part-size (default 64M) or --buffer-size"
            )
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and buffer_size >= soft:
        raise InputError(
            f"--buffer-size {human_size(buffer_size)} is above this process's address-space limit ({human_bytes(soft)})"
        )
    available = available_memory()
    if available is not None and buffer_size * ranks_on_node > available:
        raise InputError(
            f"--buffer-size {human_size(buffer_size)} per rank × {count_of(ranks_on_node, 'rank')} on {host_name()} is more than "
            f"the {human_bytes(available)} of memory available there; choose a smaller size (default 32M)"
        )


def address_space_limit() -> int | None:
    """This process's address-space limit (``ulimit -v``), if it has one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _address_space_used() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_room_to_start(library: str, room: int) -> None:
    """Raise MemoryError before loading ``library`` when the address-space limit leaves it less than
    ``room``: the library would end the process with its own messages instead of failing."""
    limit, used = address_space_limit(), _address_space_used()
    if limit is not None and used is not None and limit - used < room:
        raise MemoryError(f"{human_bytes(max(0, limit - used))} of address space left to start {library}")


def memory_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is memory running out: a MemoryError, ENOMEM, a library the
    loader could not map (an ImportError or RuntimeError naming the loader's reason), or a thread that
    could not start (its stack is mapped like any memory: under ``ulimit -v`` it is what fails first)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError):
            return True
        if isinstance(current, OSError) and current.errno == errno.ENOMEM:
            return True
        if isinstance(current, (ImportError, RuntimeError, OSError)):
            text = str(current).lower()
            if any(reason in text for reason in _OUT_OF_MEMORY_REASONS):
                return True
        current = current.__cause__ or current.__context__
    return False


def out_of_memory_line() -> str:
    """:data:`OUT_OF_MEMORY`, naming the address-space limit when there is one (the usual cause then)."""
    limit = address_space_limit()
    return OUT_OF_MEMORY if limit is None else f"{OUT_OF_MEMORY}; the address-space limit (ulimit -v) is {human_size(limit)}"


def _nearest_existing(path: str) -> str:
    probe = os.path.abspath(path)
    while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def name_limit(directory: str) -> int:
    """The longest file name (in bytes) the file system of ``directory``, or of its nearest existing
    parent when it does not exist yet, can hold."""
    try:
        return os.pathconf(_nearest_existing(directory), "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255  # what every common Linux file system holds


def check_names_fit(directory: str, names: Mapping[str, str]) -> None:
    """Refuse, before any work, file names the file system of ``directory`` cannot hold: longer than its
    limit, or not plain names. ``names`` maps each name to what it is (``output file name (tensor ...)``)."""
    limit = name_limit(directory)
    for name, what in names.items():
        try:
            size = len(os.fsencode(name))
        except UnicodeEncodeError:
            size = -1
        if size <= 0 or "\0" in name or "/" in name or name in (".", ".."):
            raise InputError(f"{directory}: {what} {name!r} is not a plain file name (empty, '.', '..', '/' or NUL)")
        if size > limit:
            shown = name if len(name) <= 40 else name[:37] + "..."
            raise InputError(
                f"{directory}: {what} {shown!r} is {size} bytes long; the file system there holds names of at most "
                f"{limit} bytes: choose a shorter name"
            )


def check_path_fits(path: str, what: str) -> None:
    """Refuse a path with a component (one that does not exist yet) its file system cannot hold."""
    missing: list[str] = []
    probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        missing.append(os.path.basename(probe))
        probe = os.path.dirname(probe)
    for name in reversed(missing):
        check_names_fit(probe, {name: what})
        probe = os.path.join(probe, name)
