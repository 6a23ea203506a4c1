"""What this node can give: its name and the memory a rank may use (no MPI here)."""

from __future__ import annotations

import os
import resource
import socket

from .errors import InputError
from .reports import count_of, human_bytes, human_size


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


def check_buffer_size(buffer_size: int, ranks_on_node: int) -> None:
    """Refuse a ``--buffer-size`` the node cannot give every rank on it, before any work starts."""
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
