#!/usr/bin/env python3
"""Benchmark mpicons against ``cp -r`` (the physical limit) and torch's consolidator, in one run.

Every ratio is computed from measurements taken in the same run on the same machine, so the
numbers are comparable even when the machine is noisy from one day to the next. Each case runs
as a subprocess timed with the wall clock (best of ``--repeat``), with the peak RSS of the
largest process of its tree (``/usr/bin/time``, else ``wait4``). mpicons' own per-phase timings
come from its ``--stats-json``. Runs wait for idle CPUs (the machine may be shared) and for
writeback of the previous run to finish, and runs that could not are reported.

Run it with the project's venv interpreter (it needs mpi4py and mpicons; torch is optional).

    python benchmarks/bench.py                       # 2 GB sample, ranks 1/2/4, best of 3
    python benchmarks/bench.py --size 200MB --repeat 1 --json result.json
    python benchmarks/bench.py --planning            # planning time for 2,048 ranks, 2M pieces

The script also has internal worker modes (``_sample``, ``_torch``, ``_scan``, ``_headers``)
that it starts itself under ``mpiexec``; they are not meant to be called by hand.
"""

from __future__ import annotations

import argparse
import filecmp
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BIN = Path(PYTHON).parent
MPIEXEC = str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else (shutil.which("mpiexec") or "mpiexec")
MPICONS = [str(BIN / "mpicons")] if (BIN / "mpicons").exists() else [PYTHON, "-m", "mpicons"]
THIS = str(Path(__file__).resolve())
TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
#: Environment of every child: PYTHONPATH names the mpicons snapshot under test (see snapshot_sources).
CHILD_ENV: dict[str, str] = dict(os.environ)
CHILD_CWD: str | None = None
SAMPLE_RANKS = 2  # ranks used to write the sample checkpoints (generation is not timed)


# ---------------------------------------------------------------- running and timing subprocesses


@dataclass
class Timed:
    """One subprocess run: wall seconds, peak RSS (MB) of the largest process in its tree, exit code."""

    wall: float
    rss_mb: float
    code: int
    log: str


def _parse_size(text: str) -> int:
    """``2GB`` = 2e9, ``200MB`` = 2e8, ``1GiB`` = 2^30; plain numbers are bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(float(match.group(1)) * units[match.group(2).lower()])


def run_timed(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 1800.0) -> Timed:
    """Run ``cmd`` and time it, with the peak RSS of the largest process in its tree.

    ``ru_maxrss`` of a reaped child is the largest RSS among it and the descendants it reaped
    (under mpiexec: the largest rank, not a sum). A child forked from this Python process
    starts with this process's RSS on its books, so the command runs under ``/usr/bin/time``
    (a small process) when it exists; otherwise ``wait4``'s figure is a floor, not a peak.
    """
    with tempfile.NamedTemporaryFile(mode="w+") as log, tempfile.NamedTemporaryFile(mode="w+") as rss:
        wrapped = [TIME, "-f", "%M", "-o", rss.name, *cmd] if TIME else list(cmd)
        start = time.perf_counter()
        proc = subprocess.Popen(wrapped, env=CHILD_ENV if env is None else env, cwd=CHILD_CWD, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, lambda: _kill_group(proc.pid))
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


def _kill_group(pid: int) -> None:
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


def quiesce(*paths: Path) -> None:
    """Remove previous outputs and let writeback finish, so no run pays for the previous one's.

    ``cp -r`` leaves its copy dirty in the page cache; without this, the next case would
    pay for flushing it (and ext4's discard of the freed blocks) inside its own time.
    """
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and _dirty_kib() > 16 << 10:
        time.sleep(0.05)


def _activity(window: float = 0.5) -> tuple[float, float]:
    """(fraction of CPU time busy, MB/s read+written on block devices) over ``window`` seconds.

    This script only sleeps meanwhile, so both measure everything else on the machine.
    """

    def sample() -> tuple[int, int, int]:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        sectors = 0
        with open("/proc/diskstats") as handle:
            for line in handle:
                fields = line.split()
                # whole disks only (vda, sda, nvme0n1), not their partitions, nor loop/ram devices
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


BUSY_RUNS: list[str] = []


PATIENCE = 60.0  # seconds a run waits for idle CPUs (--patience)


def wait_quiet(what: str, cpu: float = 0.2, disk_mbs: float = 20.0, patience: float | None = None) -> None:
    """Start a measurement only when nothing else uses the CPUs or the disk (the machine may be shared).

    Waits up to ``patience`` seconds for CPU busy < ``cpu`` and disk traffic < ``disk_mbs``; a run
    that had to start anyway is recorded in BUSY_RUNS and reported, so noisy numbers are never
    silently mixed in.
    """
    deadline = time.monotonic() + (PATIENCE if patience is None else patience)
    while True:
        busy, mbs = _activity()
        if busy < cpu and mbs < disk_mbs:
            return
        if time.monotonic() > deadline:
            BUSY_RUNS.append(f"{what} (CPU {busy:.0%} busy, disk {mbs:.0f} MB/s)")
            return
        time.sleep(2.0)


def _dirty_kib() -> int:
    """Dirty + Writeback pages in KiB (Linux), 0 where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
    except OSError:
        return 0
    return sum(int(fields.get(k, "0 kB").split()[0]) for k in ("Dirty", "Writeback"))


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

    torch's consolidator writes different file bytes (no padding, no ``__metadata__``, its own
    order), so its output is compared tensor by tensor rather than with cmp.
    """
    from mpicons.format import read_header

    def tensors(directory: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
        index = json.loads((directory / "model.safetensors.index.json").read_text())
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


# ---------------------------------------------------------------- sample checkpoints


def write_float_sample(directory: str, config: Any, comm: Any = None) -> None:
    """The mpicons sample without its integer/bool buffers, for torch's consolidator.

    torch's consolidator calls ``torch.finfo`` on every dtype and so crashes on integer and
    bool tensors; the float tensors here are cut and valued exactly as in the full sample.
    """
    from mpicons.format import DTYPE_BY_NAME
    from mpicons.sample import write_sample

    write_sample(directory, config, comm, keep=lambda name, dtype: DTYPE_BY_NAME[dtype].is_float)


def sample_worker(argv: Sequence[str]) -> None:
    """``_sample DIR SIZE [--float-only]``: write a sample checkpoint, split over COMM_WORLD."""
    parser = argparse.ArgumentParser(prog="bench.py _sample")
    parser.add_argument("directory")
    parser.add_argument("size", type=int)
    parser.add_argument("--float-only", action="store_true")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from mpicons.sample import SampleConfig, write_sample

    config = SampleConfig.sized(args.size)
    if args.float_only:
        write_float_sample(args.directory, config, MPI.COMM_WORLD)
    else:
        write_sample(args.directory, config, MPI.COMM_WORLD)


def sample_mapping(size: int, float_only: bool) -> dict[str, int]:
    """torch's ``fqn_to_index_mapping`` for the sample: tensor name → output file index from 1."""
    from mpicons.format import DTYPE_BY_NAME
    from mpicons.sample import SampleConfig, tensor_specs

    specs = tensor_specs(SampleConfig.sized(size))
    return {name: index for name, dtype, _, _, index in specs if not float_only or DTYPE_BY_NAME[dtype].is_float}


def ensure_sample(workdir: Path, size: int, float_only: bool) -> Path:
    """Build the sample checkpoint once; reuse it while its config and files are unchanged."""
    from mpicons.sample import SampleConfig

    config = asdict(SampleConfig.sized(size))
    name = "sharded-float" if float_only else "sharded"
    directory = workdir / name
    marker = workdir / f"{name}.json"
    if marker.exists() and directory.is_dir():
        saved = json.loads(marker.read_text())
        files = {p.name: p.stat().st_size for p in directory.iterdir()}
        if saved.get("config") == config and saved.get("files") == files:
            return directory
    shutil.rmtree(directory, ignore_errors=True)
    marker.unlink(missing_ok=True)
    began = time.perf_counter()
    cmd = mpirun(SAMPLE_RANKS, [PYTHON, THIS, "_sample", str(directory), str(size)] + (["--float-only"] if float_only else []))
    checked(run_timed(cmd), f"writing the {name} sample")
    files = {p.name: p.stat().st_size for p in directory.iterdir()}
    marker.write_text(json.dumps({"config": config, "files": files}, indent=1))
    print(f"bench: wrote {directory} ({sum(files.values()) / 1e9:.3f} GB, {len(files)} files) in {time.perf_counter() - began:.1f} s")
    return directory


# ---------------------------------------------------------------- the cases


@dataclass
class Case:
    """Best-of-N result of one benchmark case (seconds are minima over the repeats)."""

    name: str
    checkpoint: str
    wall: float
    call: float | None = None  # the consolidation itself, measured inside the process
    rss_mb: float | None = None  # peak RSS of the largest process (per rank), max over repeats
    bytes_max: float | None = None
    bytes_mean: float | None = None
    imbalance: float | None = None
    ranks: int = 1
    walls: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


def bench_cp(src: Path, out: Path, repeat: int, checkpoint: str, sync: bool) -> Case:
    """``cp -r`` of the shard directory, from a warm page cache; ``sync`` adds an fsync of the copies.

    mpicons fsyncs its outputs before it reports success and cp does not, so the synced
    variant shows how much of any gap is durability rather than copying.
    """
    case = Case("cp -r + sync" if sync else "cp -r", checkpoint, 0.0)
    script = f'cp -r "$1" "$2" && sync "$2"/*' if sync else None
    for _ in range(repeat):
        warm(src)
        quiesce(out)
        wait_quiet(case.name)
        cmd = ["sh", "-c", script, "sh", str(src), str(out)] if script else ["cp", "-r", str(src), str(out)]
        timed = checked(run_timed(cmd), "cp -r")
        case.walls.append(timed.wall)
        case.rss_mb = max(case.rss_mb or 0.0, timed.rss_mb)
    quiesce(out)
    case.wall = min(case.walls)
    return case


def bench_mpicons(
    src: Path,
    out: Path,
    reference: Path,
    stats_dir: Path,
    ranks: int,
    split: str,
    io: str,
    repeat: int,
    checkpoint: str,
    identical: list[str],
    extra: Sequence[str] = (),
) -> Case:
    """``mpicons consolidate`` under ``mpiexec -n ranks``; each output is cmp'd against the first one."""
    suffix = "".join(" " + a.lstrip("-") for a in extra)
    case = Case(f"mpicons -n {ranks} {split}/{io}{suffix}", checkpoint, 0.0, ranks=ranks)
    stats_file = stats_dir / f"{checkpoint}-{ranks}-{split}-{io}{suffix.replace(' ', '-')}.json"
    best_call = float("inf")
    for _ in range(repeat):
        warm(src)
        quiesce(out)
        wait_quiet(case.name)
        stats_file.unlink(missing_ok=True)
        cmd = mpirun(ranks, [*MPICONS, "consolidate", str(src), str(out), "--force", "--stats-json", str(stats_file), "-q",
                             "--split", split, "--io", io, *extra])
        timed = checked(run_timed(cmd), case.name)
        stats = json.loads(stats_file.read_text())
        case.walls.append(timed.wall)
        call = stats["elapsed"]["max"]
        case.calls.append(call)
        case.rss_mb = max(case.rss_mb or 0.0, stats["peak_rss_mb"]["max"], timed.rss_mb)
        if call < best_call:
            best_call = call
            case.detail = {
                "phases_max": {k: v["max"] for k, v in stats["phases"].items()},
                "bytes_per_rank": stats["bytes_per_rank"],
                "imbalance": stats["imbalance"],
                "peak_rss_mb_stats": stats["peak_rss_mb"]["max"],
                "peak_rss_mb_tree": timed.rss_mb,
                "total_bytes": stats["total_bytes"],
            }
        if not reference.exists():
            out.rename(reference)
        else:
            problem = same_tree(reference, out)
            if problem:
                raise SystemExit(f"bench: {case.name} output differs from the first mpicons output: {problem}")
            identical.append(f"{checkpoint}: {case.name}")
    quiesce(out)
    case.wall, case.call = min(case.walls), min(case.calls)
    spread = case.detail["bytes_per_rank"]
    case.bytes_max, case.bytes_mean, case.imbalance = spread["max"], spread["mean"], case.detail["imbalance"]
    return case


def mpicons_has(option: str) -> bool:
    """Whether this mpicons' consolidate command knows ``option`` (newer options are benchmarked when present)."""
    text = subprocess.run([*MPICONS, "consolidate", "--help"], capture_output=True, text=True, env=CHILD_ENV,
                          cwd=CHILD_CWD).stdout
    return option in text


NO_SYNC = ("--no-sync",)


def torch_available() -> bool:
    """Whether torch imports in the benchmark's interpreter (checked in a child: torch stays optional)."""
    return subprocess.run([PYTHON, "-c", "import torch.distributed.checkpoint._consolidate_hf_safetensors"],
                          capture_output=True, cwd=CHILD_CWD).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_once(src: Path, out: Path, mapping_file: Path, ranks: int, threads: int) -> tuple[Timed, dict[str, Any]]:
    """One run of torch's consolidator (1 process, or ``ranks`` gloo ranks under mpiexec)."""
    result_file = out.parent / f"torch-result-{ranks}.json"
    result_file.unlink(missing_ok=True)
    args = [PYTHON, THIS, "_torch", str(src), str(out), str(mapping_file), str(result_file), "--threads", str(threads)]
    env = dict(CHILD_ENV)
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
        cmd = mpirun(ranks, args + ["--every-rank"])
    else:
        cmd = args
    timed = run_timed(cmd, env=env)
    result = json.loads(result_file.read_text()) if result_file.exists() else {"error": timed.log[-2000:]}
    return timed, result


def bench_torch(src: Path, out: Path, mapping_file: Path, reference: Path, ranks: int, repeat: int, threads: int,
                checkpoint: str) -> Case:
    """torch's consolidate_safetensors_files (1 process) or ..._on_every_rank (gloo, ``ranks`` ranks)."""
    label = "consolidate_safetensors_files" if ranks == 1 else f"..._on_every_rank -n {ranks}"
    case = Case(f"torch {label}", checkpoint, 0.0, ranks=ranks)
    durable = []
    for _ in range(repeat):
        warm(src)
        quiesce(out)
        out.mkdir(parents=True)
        wait_quiet(case.name)
        timed, result = run_torch_once(src, out, mapping_file, ranks, threads)
        if timed.code != 0 or result.get("error"):
            raise SystemExit(f"bench: {case.name} failed: {result.get('error') or timed.log[-3000:]}")
        case.walls.append(timed.wall)
        case.calls.append(result["call_s"])
        durable.append(result["call_s"] + result["sync_s"])
        case.rss_mb = max(case.rss_mb or 0.0, result["peak_rss_mb"], timed.rss_mb)
        case.detail = {"import_s": result["import_s"], "peak_rss_mb_tree": timed.rss_mb, "threads": threads}
    case.detail["call_plus_fsync_s"] = min(durable)
    case.detail["calls_plus_fsync_s"] = durable
    problem = same_tensors(reference, out)
    case.detail["same_tensors_as_mpicons"] = problem is None
    if problem:
        case.detail["difference"] = problem
    quiesce(out)
    case.wall, case.call = min(case.walls), min(case.calls)
    return case


def torch_worker(argv: Sequence[str]) -> None:
    """``_torch IN OUT MAPPING RESULT``: time torch's consolidation call itself, import excluded."""
    parser = argparse.ArgumentParser(prog="bench.py _torch")
    parser.add_argument("input_dir")
    parser.add_argument("output_dir")
    parser.add_argument("mapping")
    parser.add_argument("result")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every-rank", action="store_true")
    args = parser.parse_args(argv)
    import resource

    began = time.perf_counter()
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as hf

    import_s = time.perf_counter() - began
    mapping = {k: int(v) for k, v in json.loads(Path(args.mapping).read_text()).items()}
    rank, size = 0, 1
    if args.every_rank:
        rank, size = int(os.environ.get("PMI_RANK", "0")), int(os.environ.get("PMI_SIZE", "1"))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        dist.barrier()
    error = ""
    began = time.perf_counter()
    try:
        if args.every_rank:
            hf.consolidate_safetensors_files_on_every_rank(args.input_dir, args.output_dir, mapping, num_threads=args.threads)
        else:
            hf.consolidate_safetensors_files(args.input_dir, args.output_dir, fqn_to_index_mapping=mapping, num_threads=args.threads)
    except Exception as exc:  # noqa: BLE001 - reported to the driver (e.g. torch.finfo on int tensors)
        error = f"{type(exc).__name__}: {exc}"
    call_s = time.perf_counter() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.every_rank:
        values = torch.tensor([call_s, rss, float(bool(error))], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        call_s, rss = float(values[0]), float(values[1])
        dist.destroy_process_group()
    if rank == 0:
        # torch does not fsync its outputs (mpicons does): time that separately for a durable comparison.
        began = time.perf_counter()
        for path in sorted(Path(args.output_dir).iterdir()):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_s = time.perf_counter() - began
        Path(args.result).write_text(json.dumps({"import_s": import_s, "call_s": call_s, "sync_s": sync_s,
                                                 "peak_rss_mb": rss, "error": error}))


# ---------------------------------------------------------------- planning at scale


def synthetic_table(train_ranks: int = 2048, tensors: int = 1000, outputs: int = 4, parts: int = 1) -> list[Any]:
    """Header-only PieceTables of a ``train_ranks`` job, built in numpy (no files).

    Every tensor is cut over every training rank (rows, columns or a dp × tp grid; 1-D norms),
    so there are ``tensors × train_ranks`` pieces. Files are ``shard-R-model-I`` in sorted
    order; with ``parts > 1`` the files are dealt ``p::parts`` as mpicons' scan deals them.
    """
    import numpy as np

    from mpicons.format import DTYPE_ORDER
    from mpicons.scan import PieceTable

    dp = 1 << (train_ranks.bit_length() // 2)
    while train_ranks % dp:
        dp //= 2
    tp = train_ranks // dp
    hidden = 16 * train_ranks  # every cut even
    r = np.arange(train_ranks, dtype=np.int64)
    zeros = np.zeros(train_ranks, dtype=np.int64)
    full_h = np.full(train_ranks, hidden, dtype=np.int64)
    kinds = {
        # (ndim, dtype, shape columns, offset columns, element bytes)
        "rows": (2, "BF16", [full_h // train_ranks, full_h], [r * (hidden // train_ranks), zeros], 2),
        "cols": (2, "BF16", [full_h, full_h // train_ranks], [zeros, r * (hidden // train_ranks)], 2),
        "grid": (2, "BF16", [full_h // dp, full_h // tp], [(r // tp) * (hidden // dp), (r % tp) * (hidden // tp)], 2),
        "norm": (1, "F32", [full_h // train_ranks, np.ones_like(r)], [r * (hidden // train_ranks), zeros], 4),
    }
    order = ["rows", "grid", "cols", "rows", "grid", "rows", "cols", "norm", "norm"]
    t_kind = [order[t % len(order)] for t in range(tensors)]
    t_index = [t * outputs // tensors for t in range(tensors)]  # output index - 1
    names = [f"model.layers.{t // len(order)}.{t_kind[t]}_{t % len(order)}.weight" for t in range(tensors)]

    p_tensor = np.repeat(np.arange(tensors, dtype=np.int32), train_ranks)
    p_rank = np.tile(r, tensors)
    p_file = (p_rank * outputs + np.repeat(np.array(t_index, dtype=np.int64), train_ranks)).astype(np.int32)
    shape = np.concatenate([np.stack(kinds[k][2], axis=1) for k in t_kind])
    offset = np.concatenate([np.stack(kinds[k][3], axis=1) for k in t_kind])
    ndim = np.repeat(np.array([kinds[k][0] for k in t_kind], dtype=np.int8), train_ranks)
    dtype = np.repeat(np.array([DTYPE_ORDER[kinds[k][1]] for k in t_kind], dtype=np.int8), train_ranks)
    nbytes = shape.prod(axis=1) * np.repeat(np.array([kinds[k][4] for k in t_kind], dtype=np.int64), train_ranks)

    # Pieces in file order, then tensor order within a file (as one header lists them).
    sort = np.lexsort((p_tensor, p_file))
    p_tensor, p_file, shape, offset, ndim, dtype, nbytes = (a[sort] for a in (p_tensor, p_file, shape, offset, ndim, dtype, nbytes))
    num_files = train_ranks * outputs
    per_file = np.bincount(p_file, minlength=num_files)
    data_start = 8 + ((per_file * 150 + 7) // 8) * 8  # about what such a header takes
    ends = np.cumsum(nbytes)
    file_first = np.concatenate(([0], np.cumsum(per_file)[:-1]))
    base = np.where(per_file > 0, ends[np.minimum(file_first, len(ends) - 1)] - nbytes[np.minimum(file_first, len(ends) - 1)], 0)
    begin = data_start[p_file] + ends - nbytes - base[p_file]
    file_bytes = np.bincount(p_file, weights=nbytes, minlength=num_files).astype(np.int64)
    file_names = [f"shard-{f // outputs + 1:05d}-model-{f % outputs + 1:05d}-of-{outputs:05d}.safetensors" for f in range(num_files)]

    tables = []
    for part in range(parts):
        mine = np.arange(part, num_files, parts)
        local_file = np.full(num_files, -1, dtype=np.int64)
        local_file[mine] = np.arange(len(mine))
        rows = np.nonzero(local_file[p_file] >= 0)[0]
        used, first = np.unique(p_tensor[rows], return_index=True)
        used = used[np.argsort(first)]  # names in order of first appearance, as read_table builds them
        local_tensor = np.full(tensors, -1, dtype=np.int64)
        local_tensor[used] = np.arange(len(used))
        tables.append(
            PieceTable(
                files=[file_names[f] for f in mine],
                file_size=(data_start + file_bytes)[mine],
                file_data_start=data_start[mine],
                file_out_index=(mine % outputs + 1).astype(np.int32),
                file_out_count=np.full(len(mine), outputs, dtype=np.int32),
                file_is_dcp=np.ones(len(mine), dtype=bool),
                names=[names[t] for t in used],
                piece_file=local_file[p_file[rows]].astype(np.int32),
                piece_tensor=local_tensor[p_tensor[rows]].astype(np.int32),
                piece_dtype=dtype[rows],
                piece_ndim=ndim[rows],
                piece_shape=np.ascontiguousarray(shape[rows]),
                piece_offset=np.ascontiguousarray(offset[rows]),
                piece_begin=begin[rows],
            )
        )
    return tables


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    times, value = [], None
    for _ in range(repeat):
        began = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - began)
    return min(times), value


def bench_planning_memory(repeat: int, train_ranks: int, tensors: int, ranks: int) -> dict[str, Any]:
    """Planning time alone: merge_tables of per-rank parts, then build_plan, on a synthetic table."""
    from mpicons import plan as plan_mod
    from mpicons import scan as scan_mod

    began = time.perf_counter()
    parts = synthetic_table(train_ranks, tensors, parts=ranks)
    build_s = time.perf_counter() - began
    pieces = sum(p.num_pieces for p in parts)
    files = sum(len(p.files) for p in parts)
    merge_s, table = best_of(repeat, lambda: scan_mod.merge_tables(parts))
    result: dict[str, Any] = {"train_ranks": train_ranks, "tensors": tensors, "pieces": pieces, "files": files,
                              "ranks": ranks, "table_build_s": build_s, "merge_tables_s": merge_s}
    reorder = getattr(scan_mod, "_reorder_files", None)
    if reorder is not None:  # what scan() does after the merge: sorted file order on every rank
        total = len(table.files)
        order = [i for r in range(ranks) for i in range(r, total, ranks)]
        result["reorder_files_s"], table = best_of(1, lambda: reorder(table, order))
    for split in ("bytes", "files"):
        seconds, plan = best_of(repeat, lambda: plan_mod.build_plan(table, ranks, split=split))
        counts = plan.bytes_per_rank()
        result[f"build_plan_{split}_s"] = seconds
        result[f"imbalance_{split}"] = max(counts) / (sum(counts) / len(counts))
    result["output_files"] = len(plan.files)
    result["output_bytes"] = plan.total_bytes
    return result


def headers_worker(argv: Sequence[str]) -> None:
    """``_headers DIR TRAIN_RANKS TENSORS OUTPUTS``: write tiny-data shard files (headers dominate)."""
    parser = argparse.ArgumentParser(prog="bench.py _headers")
    parser.add_argument("directory")
    parser.add_argument("train_ranks", type=int)
    parser.add_argument("tensors", type=int)
    parser.add_argument("outputs", type=int)
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from mpicons.format import build_header

    comm = MPI.COMM_WORLD
    os.makedirs(args.directory, exist_ok=True)
    n, outputs = args.train_ranks, args.outputs
    dp = 1 << (n.bit_length() // 2)
    while n % dp:
        dp //= 2
    tp = n // dp
    kinds = ["rows", "grid", "cols", "rows", "grid", "rows", "cols", "norm", "norm"]
    # Each piece is 1 x 4 elements (or 4 for norms): full shapes follow from the cut.
    for f in range(comm.rank, n * outputs, comm.size):
        rank, index = divmod(f, outputs)
        pieces, info = [], {}
        for t in range(index * args.tensors // outputs, (index + 1) * args.tensors // outputs):
            kind = kinds[t % len(kinds)]
            name = f"model.layers.{t // len(kinds)}.{kind}_{t % len(kinds)}.weight"
            if kind == "rows":
                dtype, shape, offsets = "BF16", (1, 4), (rank, 0)
            elif kind == "cols":
                dtype, shape, offsets = "BF16", (1, 4), (0, 4 * rank)
            elif kind == "grid":
                dtype, shape, offsets = "BF16", (1, 4), (rank // tp, 4 * (rank % tp))
            else:
                dtype, shape, offsets = "F32", (4,), (4 * rank,)
            pieces.append((name, dtype, shape))
            info[name] = {"saved_offsets": list(offsets)}
        metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
        header, spans = build_header(pieces, metadata)
        path = os.path.join(args.directory, f"shard-{rank + 1:05d}-model-{index + 1:05d}-of-{outputs:05d}.safetensors")
        with open(path, "wb") as handle:
            handle.write(header)
            handle.write(bytes(spans[-1][1] if spans else 0))
    comm.Barrier()


def scan_worker(argv: Sequence[str]) -> None:
    """``_scan DIR RESULT``: time mpicons' scan (all headers, split over the ranks) and plan."""
    parser = argparse.ArgumentParser(prog="bench.py _scan")
    parser.add_argument("directory")
    parser.add_argument("result")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    from mpicons.plan import build_plan
    from mpicons.scan import scan
    from mpicons.stats import peak_rss_mb

    comm = MPI.COMM_WORLD
    comm.Barrier()
    began = time.perf_counter()
    table = scan(args.directory, comm)
    scanned = time.perf_counter()
    build_plan(table, comm.size)
    planned = time.perf_counter()
    values = comm.allreduce((scanned - began, planned - scanned, peak_rss_mb()), op=_tuple_max)
    if comm.rank == 0:
        Path(args.result).write_text(json.dumps({"scan_s": values[0], "plan_s": values[1], "peak_rss_mb": values[2],
                                                 "pieces": table.num_pieces, "files": len(table.files)}))


def _tuple_max(a: tuple[float, ...], b: tuple[float, ...], _: Any = None) -> tuple[float, ...]:
    return tuple(max(x, y) for x, y in zip(a, b))


def bench_planning_disk(workdir: Path, repeat: int, train_ranks: int, tensors: int, outputs: int,
                        ranks: Iterable[int]) -> dict[str, Any]:
    """Full scan of real header-only shard files (``train_ranks × outputs`` of them) at each rank count."""
    directory = workdir / f"headers-{train_ranks}x{outputs}-{tensors}"
    marker = workdir / f"{directory.name}.done"
    if not marker.exists():
        shutil.rmtree(directory, ignore_errors=True)
        began = time.perf_counter()
        checked(run_timed(mpirun(SAMPLE_RANKS, [PYTHON, THIS, "_headers", str(directory), str(train_ranks), str(tensors),
                                                str(outputs)])), "writing header-only shards")
        marker.write_text("")
        print(f"bench: wrote {train_ranks * outputs} header-only shards in {time.perf_counter() - began:.1f} s")
    total = warm(directory)
    result: dict[str, Any] = {"files": train_ranks * outputs, "train_ranks": train_ranks, "tensors": tensors,
                              "bytes_on_disk": total, "runs": {}}
    for n in ranks:
        result_file = workdir / f"scan-{n}.json"
        walls, scans, plans, rss = [], [], [], 0.0
        for _ in range(repeat):
            wait_quiet(f"scan -n {n}")
            timed = checked(run_timed(mpirun(n, [PYTHON, THIS, "_scan", str(directory), str(result_file)])), "scan")
            got = json.loads(result_file.read_text())
            walls.append(timed.wall)
            scans.append(got["scan_s"])
            plans.append(got["plan_s"])
            rss = max(rss, got["peak_rss_mb"])
            result["pieces"] = got["pieces"]
        result["runs"][n] = {"wall_s": min(walls), "scan_s": min(scans), "plan_s": min(plans), "peak_rss_mb": rss}
    return result


# ---------------------------------------------------------------- the sources under test


def snapshot_sources(workdir: Path, source: str) -> tuple[Path, str]:
    """Freeze the mpicons package for the whole run; returns (snapshot root, label).

    The working tree may change while a long run is going (someone editing, a branch switch):
    every process of the run imports this copy instead, through PYTHONPATH, so all the numbers
    come from one version. ``source`` is ``worktree`` (the files as they are now) or ``head``
    (the last commit, whatever the working tree holds).
    """
    import hashlib

    root = workdir / "src"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if source == "head":
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "mpicons"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
        label = f"commit {commit}"
    else:
        shutil.copytree(REPO / "mpicons", root / "mpicons", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "mpicons"], capture_output=True,
                                text=True).stdout.strip()
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown"
        label = f"working tree at {commit}" + (" with uncommitted changes" if status else "")
    files = sorted((root / "mpicons").glob("*.py"))
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()[:12]
    return root, f"{label} (sources sha256 {digest})"


def use_snapshot(root: Path, workdir: Path) -> None:
    """Make this process and every child import mpicons from ``root``."""
    global CHILD_CWD
    sys.path.insert(0, str(root))
    CHILD_ENV["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    CHILD_CWD = str(workdir)  # not the repository: '' on sys.path would find its mpicons first


# ---------------------------------------------------------------- machine and reporting


def machine_info(workdir: Path) -> dict[str, Any]:
    """What the numbers were measured on."""

    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    return {
        "nproc": sh("nproc"),
        "cpu": sh("lscpu | grep -E 'Model name|^CPU\\(s\\)|Thread|Hypervisor' | sed 's/  */ /g'"),
        "memory": sh("free -g | head -2"),
        "kernel": platform.release(),
        "filesystem": sh(f"df -T {workdir} | tail -1 | awk '{{print $2}}'"),
        "python": platform.python_version(),
        "mpi": sh(f"{BIN / 'mpichversion'} 2>/dev/null | head -1") or "unknown",
        "torch": sh(f"{PYTHON} -c 'import torch; print(torch.__version__)' 2>/dev/null") or "not installed",
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(cases: list[Case], cp: dict[str, float], torch_call: float | None, torch_ckpt: str) -> str:
    """The report: seconds, ratios to cp (wall/wall, same checkpoint) and torch (call/call).

    ``x cp`` and ``x torch`` are this case's time divided by the reference's: below 1 is faster.
    ``worst s`` is the slowest repeat, to show how noisy the machine was.
    """
    head = (f"{'case':<40}{'ckpt':>6}{'wall s':>9}{'call s':>9}{'x cp':>7}{'x torch':>9}"
            f"{'RSS/rank MB':>13}{'bytes/rank max/mean MB':>24}{'max/mean':>10}{'worst s':>9}")
    lines = [head, "-" * len(head)]
    for c in cases:
        ref = cp.get(c.checkpoint)
        x_cp = c.wall / ref if ref else None
        x_torch = c.call / torch_call if (torch_call and c.call is not None and c.checkpoint == torch_ckpt) else None
        per_rank = "-" if c.bytes_max is None else f"{c.bytes_max / 1e6:.0f} / {c.bytes_mean / 1e6:.0f}"
        lines.append(
            f"{c.name:<40}{c.checkpoint:>6}{c.wall:>9.2f}{_fmt(c.call, '.2f'):>9}{_fmt(x_cp, '.2f'):>7}"
            f"{_fmt(x_torch, '.3f'):>9}{_fmt(c.rss_mb, '.0f'):>13}{per_rank:>24}{_fmt(c.imbalance, '.3f'):>10}"
            f"{max(c.walls):>9.2f}"
        )
    return "\n".join(lines)


def targets(cases: list[Case], cp: dict[str, float], torch_call: float | None, torch_ckpt: str) -> list[str]:
    """The four goals, each PASS/FAIL with its number."""

    def find(checkpoint: str, name: str) -> Case | None:
        return next((c for c in cases if c.checkpoint == checkpoint and c.name == name), None)

    out = []
    one = find(torch_ckpt, "mpicons -n 1 bytes/posix")
    if one and torch_call:
        speedup = torch_call / one.call
        out.append(f"{'PASS' if speedup >= 4 else 'FAIL'}: mpicons -n 1 vs torch consolidate_safetensors_files "
                   f"(call): {speedup:.1f}x faster (target >= 4x)")
        torch_one = next(c for c in cases if c.name == "torch consolidate_safetensors_files")
        durable = torch_one.detail["call_plus_fsync_s"] / one.call
        out.append(f"info: the same with torch's outputs fsynced as mpicons' are (call + fsync "
                   f"{torch_one.detail['call_plus_fsync_s']:.2f} s): {durable:.1f}x faster")
        one_ns = find(torch_ckpt, "mpicons -n 1 bytes/posix no-sync")
        if one_ns:
            out.append(f"info: mpicons -n 1 --no-sync vs torch (neither fsyncs): {torch_call / one_ns.call:.1f}x faster")
    else:
        out.append("n/a: mpicons -n 1 vs torch (torch not measured)")
    two = find("full", "mpicons -n 2 bytes/posix")
    if two and cp.get("full"):
        ratio = two.wall / cp["full"]
        out.append(f"{'PASS' if ratio <= 1.5 else 'FAIL'}: mpicons -n 2 whole process / cp -r: {ratio:.2f} (target <= 1.5)")
    two_ns = find("full", "mpicons -n 2 bytes/posix no-sync")
    if two_ns and cp.get("full"):
        out.append(f"info: the same without fsync (--no-sync, as cp writes): {two_ns.wall / cp['full']:.2f}")
    sync_cp = next((c for c in cases if c.checkpoint == "full" and c.name == "cp -r + sync"), None)
    if two and sync_cp:
        out.append(f"info: mpicons -n 2 whole process / (cp -r + sync), both durable: {two.wall / sync_cp.wall:.2f}")
    rss = max((c.rss_mb or 0.0) for c in cases if c.name.startswith("mpicons"))
    out.append(f"{'PASS' if rss < 200 else 'FAIL'}: mpicons peak RSS per rank, max over all runs: {rss:.0f} MB (target < 200)")
    four = find("full", "mpicons -n 4 bytes/posix")
    if four:
        out.append(f"{'PASS' if four.imbalance <= 1.10 else 'FAIL'}: bytes/rank max/mean at 4 ranks (split bytes): "
                   f"{four.imbalance:.3f} (target <= 1.10)")
    return out


def planning_report(memory: dict[str, Any], disk: dict[str, Any] | None) -> str:
    lines = [
        f"planning, in memory: {memory['train_ranks']} training ranks, {memory['tensors']} tensors, "
        f"{memory['pieces']:,} pieces in {memory['files']:,} files -> {memory['output_files']} outputs "
        f"({memory['output_bytes'] / 1e12:.2f} TB), {memory['ranks']} ranks",
        f"  {'merge_tables of ' + str(memory['ranks']) + ' parts':<26}{memory['merge_tables_s']:8.3f} s",
    ]
    if "reorder_files_s" in memory:
        lines.append(f"  {'scan file reorder':<26}{memory['reorder_files_s']:8.3f} s")
    for split in ("bytes", "files"):
        lines.append(f"  {'build_plan split=' + split:<26}{memory[f'build_plan_{split}_s']:8.3f} s   "
                     f"(bytes/rank max/mean {memory[f'imbalance_{split}']:.3f})")
    if disk:
        lines.append(f"planning, on disk: {disk['files']:,} header-only shard files ({disk['bytes_on_disk'] / 1e6:.0f} MB), "
                     f"{disk.get('pieces', 0):,} pieces")
        for n, run in disk["runs"].items():
            lines.append(f"  -n {n}: scan {run['scan_s']:7.2f} s, plan {run['plan_s']:6.2f} s, whole process "
                         f"{run['wall_s']:7.2f} s, peak RSS/rank {run['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=_parse_size, default=int(2e9), help="sample checkpoint size, e.g. 2GB (default)")
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work", help="samples and outputs (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per case, best reported (default: %(default)s)")
    parser.add_argument("--ranks", default="1,2,4", help="mpicons rank counts (default: %(default)s)")
    parser.add_argument("--splits", default="bytes,files", help="mpicons --split values (default: %(default)s)")
    parser.add_argument("--ios", default="posix,mpiio", help="mpicons --io values (default: %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=1, help="num_threads for torch (default: %(default)s)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch even when it is installed")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every number as JSON")
    parser.add_argument("--source", choices=("worktree", "head"), default="worktree",
                        help="mpicons to benchmark: the working tree as it is at the start, or the last commit "
                             "(either is copied first, so edits during the run do not mix versions; default: %(default)s)")
    parser.add_argument("--patience", type=float, default=PATIENCE,
                        help="seconds each run waits for idle CPUs and disk before starting anyway (default: %(default)s)")
    parser.add_argument("--planning", action="store_true", help="planning benchmark instead (2,048 ranks, 2M pieces)")
    parser.add_argument("--train-ranks", type=int, default=2048, help="planning: training ranks (default: %(default)s)")
    parser.add_argument("--tensors", type=int, default=1000, help="planning: tensors (default: %(default)s)")
    parser.add_argument("--disk-files", type=int, default=20000,
                        help="planning: header-only shard files on disk, 0 to skip (default: %(default)s)")
    return parser.parse_args(argv)


def main_planning(args: argparse.Namespace) -> dict[str, Any]:
    memory = bench_planning_memory(args.repeat, args.train_ranks, args.tensors, 4)
    disk = None
    if args.disk_files:
        outputs = 10
        train_ranks = max(1, args.disk_files // outputs)
        disk = bench_planning_disk(args.workdir, args.repeat, train_ranks, args.tensors, outputs, [1, 2, 4])
    print(planning_report(memory, disk))
    if BUSY_RUNS:
        print(f"note: {len(BUSY_RUNS)} runs started while other processes kept the CPUs busy: {'; '.join(BUSY_RUNS)}")
    return {"planning_memory": memory, "planning_disk": disk, "busy_runs": BUSY_RUNS}


def main_consolidate(args: argparse.Namespace) -> dict[str, Any]:
    workdir = args.workdir
    ranks = [int(x) for x in args.ranks.split(",")]
    splits, ios = args.splits.split(","), args.ios.split(",")
    out, stats_dir = workdir / "out", workdir / "stats"
    stats_dir.mkdir(parents=True, exist_ok=True)
    full = ensure_sample(workdir, args.size, float_only=False)
    cases: list[Case] = []
    identical: list[str] = []
    notes: list[str] = []

    cases.append(bench_cp(full, out, args.repeat, "full", sync=False))
    cases.append(bench_cp(full, out, args.repeat, "full", sync=True))
    reference = workdir / "ref-full"
    quiesce(reference)
    for n in ranks:
        for split in splits:
            for io in ios:
                cases.append(bench_mpicons(full, out, reference, stats_dir, n, split, io, args.repeat, "full", identical))
                print(f"bench: {cases[-1].name}: {cases[-1].wall:.2f} s")
    no_sync = mpicons_has(NO_SYNC[0])
    if no_sync:  # without fsync, as cp -r and torch write: the copying alone
        for n in (1, 2):
            cases.append(bench_mpicons(full, out, reference, stats_dir, n, "bytes", "posix", args.repeat, "full", identical,
                                       NO_SYNC))
            print(f"bench: {cases[-1].name}: {cases[-1].wall:.2f} s")

    torch_call, checkpoint = None, "full"
    if args.no_torch:
        notes.append("torch: skipped (--no-torch)")
    elif not torch_available():
        notes.append("torch: not importable, torch cases skipped")
    else:
        # torch's consolidator is tried on the full sample once; it cannot read int/bool tensors.
        mapping_file = workdir / "mapping-full.json"
        mapping_file.write_text(json.dumps(sample_mapping(args.size, float_only=False)))
        warm(full)
        quiesce(out)
        out.mkdir(parents=True)
        timed, result = run_torch_once(full, out, mapping_file, 1, args.torch_threads)
        quiesce(out)
        checkpoint, src = "full", full
        if timed.code != 0 or result.get("error"):
            error = (result.get("error") or timed.log).strip().splitlines()[-1]
            notes.append(f"torch on the full sample failed ({error}); torch and the mpicons rows marked 'float' use a "
                         "float-only variant of the sample (the same tensors without its int/bool buffers)")
            checkpoint, src = "float", ensure_sample(workdir, args.size, float_only=True)
            mapping_file = workdir / "mapping-float.json"
            mapping_file.write_text(json.dumps(sample_mapping(args.size, float_only=True)))
            cases.append(bench_cp(src, out, args.repeat, checkpoint, sync=False))
        reference_t = workdir / f"ref-{checkpoint}"
        if checkpoint == "float":
            quiesce(reference_t)
            for n in (1, 2):
                cases.append(bench_mpicons(src, out, reference_t, stats_dir, n, "bytes", "posix", args.repeat, checkpoint, identical))
            if no_sync:
                cases.append(bench_mpicons(src, out, reference_t, stats_dir, 1, "bytes", "posix", args.repeat, checkpoint,
                                           identical, NO_SYNC))
        for n in (1, 2):
            case = bench_torch(src, out, mapping_file, reference_t, n, args.repeat, args.torch_threads, checkpoint)
            cases.append(case)
            print(f"bench: {case.name}: {case.wall:.2f} s (call {case.call:.2f} s)")
            if n == 1:
                torch_call = case.call
            notes.append(f"{case.name}: output tensors {'equal' if case.detail['same_tensors_as_mpicons'] else 'DIFFER FROM'} "
                         f"mpicons' ({case.detail.get('difference', 'name, dtype, shape and bytes')})")

    cp = {c.checkpoint: c.wall for c in cases if c.name == "cp -r"}
    sample_bytes = dir_bytes(full)
    print()
    print(f"sample: {sample_bytes / 1e9:.3f} GB in {len(list(full.iterdir()))} shard files; best of {args.repeat}; "
          f"'call' = the consolidation itself (mpicons: stats elapsed.max; torch: timed around the call)")
    print(table(cases, cp, torch_call, checkpoint))
    if BUSY_RUNS:
        notes.append(f"{len(BUSY_RUNS)} runs started while other processes kept the CPUs busy: {'; '.join(BUSY_RUNS)}")
    mpicons_runs = sum(len(c.walls) for c in cases if c.name.startswith("mpicons"))
    notes.append(f"all {mpicons_runs} mpicons outputs are byte-identical (cmp of every file) to the first one "
                 f"of their checkpoint ({len(identical)} compared + the references)")
    print()
    for line in notes:
        print(f"note: {line}")
    print()
    goals = targets(cases, cp, torch_call, checkpoint)
    for line in goals:
        print(line)
    return {"sample_bytes": sample_bytes, "cases": [asdict(c) for c in cases], "cp_s": cp, "torch_call_s": torch_call,
            "torch_checkpoint": checkpoint, "notes": notes, "targets": goals, "busy_runs": BUSY_RUNS}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    workers = {"_sample": sample_worker, "_torch": torch_worker, "_scan": scan_worker, "_headers": headers_worker}
    if argv and argv[0] in workers:
        workers[argv[0]](argv[1:])
        return 0
    args = parse_args(argv)
    global PATIENCE
    PATIENCE = args.patience
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    root, label = snapshot_sources(args.workdir, args.source)
    use_snapshot(root, args.workdir)
    info = machine_info(args.workdir)
    info["mpicons"] = label
    command = " ".join([os.path.relpath(PYTHON), os.path.relpath(THIS), *argv])
    print(f"bench: {command}")
    print(f"machine: {info['nproc']} cores, kernel {info['kernel']}, {info['filesystem']} at {args.workdir}, torch {info['torch']}")
    print(f"mpicons: {label}")
    result = main_planning(args) if args.planning else main_consolidate(args)
    total = time.perf_counter() - began
    print(f"\nbench: done in {total:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": info, "total_s": total, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
