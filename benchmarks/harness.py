"""What every benchmark here needs: timing subprocesses with their peak memory, waiting for a quiet
machine, warming and quiescing the page cache, comparing outputs. No mpicons imports at module level;
importing this module byte-compiles the mpicons package the benchmarks run (:func:`byte_compile`).

Every number of a benchmark comes from runs taken minutes apart in one process of one script, so
ratios are comparable even when the machine is noisy from one day to the next.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else (shutil.which("mpiexec") or "mpiexec")
TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None


def byte_compile(root: Path) -> None:
    """Write the byte code of every module under ``root``, as an installed package has it.

    Python reads byte code it finds even when ``PYTHONDONTWRITEBYTECODE`` stops it writing any; without
    it every process compiles mpicons' modules again, about 0.25 s of start-up per process on the
    benchmark machine, which no installed copy pays.
    """
    subprocess.run([PYTHON, "-m", "compileall", "-q", str(root)], check=True)


byte_compile(REPO / "mpicons")


@dataclass
class Timed:
    """One subprocess run: wall seconds, peak RSS (MB) of the largest process in its tree, exit code, output."""

    wall: float
    rss_mb: float
    code: int
    log: str


def cached_sample(directory: Path, config: object, label: str) -> dict[str, object]:
    """Write the sample of ``config`` into ``directory`` once; reuse it while its config is unchanged
    (a marker beside it records the config). Returns that record."""
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from mpicons.sample import tensor_specs, write_sample

    marker = directory.with_suffix(".json")
    described = {"config": asdict(config), "tensors": len(tensor_specs(config))}  # type: ignore[call-overload]
    if not (marker.exists() and json.loads(marker.read_text()) == described):
        shutil.rmtree(directory, ignore_errors=True)
        began = time.perf_counter()
        write_sample(directory, config)  # type: ignore[arg-type]
        print(f"{label}: wrote the sample in {time.perf_counter() - began:.1f} s")
        marker.write_text(json.dumps(described))
    return described


def parse_size(text: str) -> int:
    """``2GB`` = 2e9, ``200MB`` = 2e8, ``1GiB`` = 2^30; plain numbers are bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match.group(1)) * units[match.group(2).lower()])


def run_timed(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None, timeout: float = 1800.0) -> Timed:
    """Run ``cmd`` and time it, with the peak RSS of the largest process in its tree.

    ``ru_maxrss`` of a reaped child is the largest RSS among it and the descendants it reaped
    (under mpiexec: the largest rank, not a sum). A child forked from this Python process starts
    with this process's RSS on its books, so the command runs under ``/usr/bin/time`` (a small
    process) when it exists; otherwise ``wait4``'s figure is a floor, not a peak.
    """
    with tempfile.NamedTemporaryFile(mode="w+") as log, tempfile.NamedTemporaryFile(mode="w+") as rss:
        wrapped = [TIME, "-f", "%M", "-o", rss.name, *cmd] if TIME else list(cmd)
        start = time.perf_counter()
        proc = subprocess.Popen(wrapped, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, lambda: kill_group(proc.pid))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()
        rss.seek(0)
        lines = rss.read().split()
        kib = int(lines[-1]) if TIME and lines and lines[-1].isdigit() else usage.ru_maxrss
    return Timed(wall, kib / 1024, proc.returncode, text)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def mpirun(ranks: int, args: Sequence[str]) -> list[str]:
    return [MPIEXEC, "-n", str(ranks), *args]


def checked(timed: Timed, what: str) -> Timed:
    """Fail loudly: a benchmark number from a failed run would be meaningless."""
    if timed.code != 0:
        raise SystemExit(f"bench: {what} failed with exit code {timed.code}:\n{timed.log[-4000:]}")
    return timed


def warm(directory: Path) -> int:
    """Read every file once so runs start from a warm page cache (as ``cat files > /dev/null``)."""
    total = 0
    buffer = bytearray(16 << 20)
    for path in sorted(directory.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as handle:
                while got := handle.readinto(buffer):
                    total += got
    return total


def dirty_kib() -> int:
    """Dirty + Writeback pages in KiB (Linux), 0 where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
    except OSError:
        return 0
    return sum(int(fields.get(k, "0 kB").split()[0]) for k in ("Dirty", "Writeback"))


def quiesce(*paths: Path) -> None:
    """Remove previous outputs and let writeback finish, so no run pays for the previous one's.

    ``cp -r`` leaves its copy dirty in the page cache; without this, the next case would pay for
    flushing it (and ext4's discard of the freed blocks) inside its own time.
    """
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and dirty_kib() > 16 << 10:
        time.sleep(0.05)


def activity(window: float = 0.5) -> tuple[float, float]:
    """(fraction of CPU time busy, MB/s read+written on block devices) over ``window`` seconds."""

    def sample() -> tuple[int, int, int]:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        sectors = 0
        with open("/proc/diskstats") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 9 and re.fullmatch(r"(vd|sd|xvd)[a-z]+|nvme\d+n\d+", fields[2]):
                    sectors += int(fields[5]) + int(fields[9])
        return sum(values), values[3] + (values[4] if len(values) > 4 else 0), sectors

    try:
        total0, idle0, sectors0 = sample()
        time.sleep(window)
        total1, idle1, sectors1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    return busy, (sectors1 - sectors0) * 512 / 1e6 / window


class Quiet:
    """Waits for an idle machine before each run and remembers the runs that could not wait."""

    def __init__(self, patience: float = 60.0) -> None:
        self.patience = patience
        self.busy_runs: list[str] = []

    def wait(self, what: str, cpu: float = 0.2, disk_mbs: float = 20.0) -> None:
        deadline = time.monotonic() + self.patience
        while True:
            busy, mbs = activity()
            if busy < cpu and mbs < disk_mbs:
                return
            if time.monotonic() > deadline:
                self.busy_runs.append(f"{what} (CPU {busy:.0%} busy, disk {mbs:.0f} MB/s)")
                return
            time.sleep(2.0)


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def same_tree(reference: Path, other: Path) -> str | None:
    """None when both directories hold the same file names with byte-identical contents (cmp)."""
    names_a = sorted(p.name for p in reference.iterdir())
    names_b = sorted(p.name for p in other.iterdir())
    if names_a != names_b:
        return f"file names differ: {names_a} vs {names_b}"
    for name in names_a:
        if not filecmp.cmp(reference / name, other / name, shallow=False):
            return f"{name} differs"
    return None


def same_tensors(reference: Path, other: Path) -> str | None:
    """None when two HF checkpoints hold the same tensors (name, dtype, shape, bytes), layout aside.

    A consolidator other than mpicons (torch's) writes different file bytes (no padding, no
    ``__metadata__``, its own order), so its output is compared tensor by tensor rather than with cmp.
    """
    from mpicons.core.safetensors_codec import read_header

    def tensors(directory: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
        if (directory / "model.safetensors.index.json").exists():
            index = json.loads((directory / "model.safetensors.index.json").read_text())
        else:  # one model.safetensors, no index (as save_pretrained writes a small model)
            index = {"weight_map": {}}
            for entry in read_header(directory / "model.safetensors").tensors:
                index["weight_map"][entry.name] = "model.safetensors"
        found: dict[str, tuple[Path, str, tuple[int, ...], int, int]] = {}
        for file_name in sorted(set(index["weight_map"].values())):
            path = directory / file_name
            header = read_header(path)
            for entry in header.tensors:
                found[entry.name] = (path, entry.dtype, entry.shape, header.data_start + entry.begin, entry.end - entry.begin)
        missing = set(index["weight_map"]) - set(found)
        if missing:
            raise ValueError(f"{directory}: index names tensors no file holds, e.g. {sorted(missing)[0]}")
        return found

    try:
        a, b = tensors(reference), tensors(other)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"cannot read: {exc}"
    if set(a) != set(b):
        return f"tensor names differ: {sorted(set(a) ^ set(b))[:5]}"
    for name in sorted(a):
        pa, da, sa, oa, na = a[name]
        pb, db, sb, ob, nb = b[name]
        if (da, sa, na) != (db, sb, nb):
            return f"{name}: {da}{list(sa)} vs {db}{list(sb)}"
        with open(pa, "rb") as fa, open(pb, "rb") as fb:
            fa.seek(oa)
            fb.seek(ob)
            if fa.read(na) != fb.read(nb):
                return f"{name}: data differs"
    return None


def machine(where: Path = REPO) -> dict[str, str]:
    """What the numbers were measured on (``filesystem``: the one holding ``where``)."""

    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "host": socket.gethostname(),
        "cpus": str(os.cpu_count()),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
        "memory": sh("free -g | awk '/Mem:/ {print $2\" GiB\"}'"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": sh(f"df -T {where} | tail -1 | awk '{{print $2}}'"),
        "commit": sh(f"git -C {REPO} rev-parse --short HEAD"),
        "date": time.strftime("%Y-%m-%d"),
    }


def best(times: Sequence[Timed]) -> Timed:
    return min(times, key=lambda t: t.wall)


# ---------------------------------------------------------------- the sources under test


def snapshot_sources(workdir: Path, source: str, package: str = "mpicons") -> tuple[Path, str]:
    """Freeze ``package`` for a whole run into ``workdir/src``; returns (snapshot root, label).

    The working tree may change while a long run is going (someone editing, a branch switch):
    every process of the run imports this copy instead (see ``Context.on_snapshot``), so all the
    numbers come from one version. ``source`` is ``worktree`` (the files as they are now) or
    ``head`` (the last commit, whatever the working tree holds).
    """
    root = workdir / "src"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def git(*args: str, check: bool = False) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=check).stdout.strip()

    if source == "head":
        commit = git("rev-parse", "--short", "HEAD", check=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", package], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
        label = f"commit {commit}"
    elif source == "worktree":
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        status = git("status", "--porcelain", "--", package)
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        label = f"working tree at {commit}" + (" with uncommitted changes" if status else "")
    else:
        raise ValueError(f"source is 'worktree' or 'head', not {source!r}")
    byte_compile(root / package)
    files = sorted((root / package).glob("*.py"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:12]
    return root, f"{label} (sources sha256 {digest})"


@dataclass
class Context:
    """How a benchmark runs its children: their environment and directory, the wait for an idle
    machine before each measurement, and the number of runs per case (the best is reported)."""

    env: dict[str, str]
    cwd: str | None
    quiet: Quiet
    repeat: int = 1

    @classmethod
    def on_snapshot(cls, root: Path, workdir: Path, quiet: Quiet, repeat: int) -> Context:
        """Children import packages from ``root`` first (PYTHONPATH) and run in ``workdir``, not in the
        repository, where '' on ``sys.path`` would find the working tree's package first.

        This process imports from ``root`` too (it is put first on ``sys.path``).
        """
        sys.path.insert(0, str(root))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
        return cls(env, str(workdir), quiet, repeat)

    def run(self, cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 1800.0) -> Timed:
        """``run_timed`` in this context (``env`` replaces the context's environment for this run)."""
        return run_timed(cmd, env=self.env if env is None else env, cwd=self.cwd, timeout=timeout)
