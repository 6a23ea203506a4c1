#!/usr/bin/env python3
"""A dense checkpoint larger than memory, consolidated from a cold page cache against ``cp -r`` + ``sync``.

On a cluster the shards are not in the page cache: the storage's bandwidth is the limit, and the
ratio to the disk's own copy is the figure users see. This script writes the dense sample at
``--size`` (default 32 GB: more than this machine's 23 GiB of RAM, so no run can be served from the
cache), then runs, interleaved and alternating which goes first, ``cp -r IN OUT && sync`` and
``mpiexec -n N mpicons consolidate IN OUT`` (durable, its default). Before every run the previous
output is removed, writeback is drained and the inputs are evicted from the page cache:
``echo 3 > /proc/sys/vm/drop_caches`` when permitted (root), else (or with ``--evict inputs``)
``posix_fadvise(DONTNEED)`` on every input file (which evicts clean pages of those files only). It needs free disk for the input
and one output; it checks that first.

    python benchmarks/bigger_than_memory.py                    # 32 GB, 2 ranks, 3 pairs: tens of minutes
    python benchmarks/bigger_than_memory.py --size 1GB --repeat 2   # a check that it runs
    python benchmarks/bigger_than_memory.py --size 2GB --evict inputs   # only the shards cold, not Python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness import MPIEXEC, PYTHON, REPO, checked, dir_bytes, machine, mpirun, parse_size, quiesce, run_timed

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
WORKERS = Path(__file__).resolve().parent / "workers"


def meminfo_mb(field: str) -> float:
    """A /proc/meminfo field in MB (0 where it is missing)."""
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
    except OSError:
        return 0.0
    return int(fields.get(field, "0 kB").split()[0]) / 1024 * 1.048576


def ensure_sample(directory: Path, size: int, ranks: int) -> None:
    """Write the dense sample once with ``ranks`` MPI ranks (``workers/sample.py``); reuse it while its size is unchanged."""
    marker = directory.with_suffix(".json")
    if marker.exists() and directory.is_dir() and json.loads(marker.read_text()).get("size") == size:
        return
    shutil.rmtree(directory, ignore_errors=True)
    began = time.perf_counter()
    worker = [PYTHON, str(WORKERS / "sample.py"), str(directory), str(size)]
    checked(run_timed(mpirun(ranks, worker), env=ENV, timeout=6 * 3600), "writing the sample")
    marker.write_text(json.dumps({"size": size}))
    print(f"bigger: wrote {directory} ({dir_bytes(directory) / 1e9:.2f} GB) in {time.perf_counter() - began:.0f} s")


def check_space(workdir: Path, size: int, have_input: bool) -> None:
    """Refuse to start without room for the input (unless written already) and one output, plus 5%."""
    need = int(size * (1.05 if have_input else 2.1))
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise SystemExit(f"bigger: {workdir} has {free / 1e9:.1f} GB free; this run needs {need / 1e9:.1f} GB")


def evict(directory: Path, everything: bool) -> str:
    """Drop the inputs from the page cache (after writing back everything dirty); returns the method used.

    ``everything`` drops the whole page cache when permitted, the programs' own files too (Python,
    numpy, the MPI libraries: about 40 MB read again at each start); otherwise only the input files
    are evicted, so the figure is the checkpoint's reading alone.
    """
    os.sync()
    if everything:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as handle:
                handle.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return "fadvise"


def run_case(name: str, cmd: list[str], source: Path, out: Path, everything: bool, stats: Path) -> dict[str, float | str]:
    """One cold run: output removed, writeback drained, inputs evicted, then timed."""
    quiesce(out)
    method = evict(source, everything)
    cached = meminfo_mb("Cached")
    stats.unlink(missing_ok=True)
    timed = checked(run_timed(cmd, env=ENV, timeout=6 * 3600), name)
    # mpicons' own elapsed time (its report): the wall time less the start-up (mpiexec, imports, MPI).
    inside = json.loads(stats.read_text())["elapsed"]["max"] if stats.exists() else timed.wall
    print(
        f"bigger: {name}: {timed.wall:.2f} s, {inside:.2f} s after start-up "
        f"(cache {method}, {cached:.0f} MB cached before, RSS {timed.rss_mb:.0f} MB)"
    )
    return {"wall": timed.wall, "inside": inside, "rss_mb": timed.rss_mb, "evicted_by": method, "cached_mb_before": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(32e9), help="tensor bytes of the sample (default 32GB)")
    parser.add_argument("--ranks", type=int, default=2, help="mpicons ranks (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (default 3)")
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work", help="where the sample and outputs go")
    parser.add_argument(
        "--evict",
        choices=("all", "inputs"),
        default="all",
        help="before each run drop the whole page cache (all, when permitted: the programs start cold too) "
        "or only the input files (inputs)",
    )
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source, out = args.workdir / f"bigger-{args.size}", args.workdir / "bigger-out"
    stats = args.workdir / "bigger-stats.json"
    quiesce(out)
    check_space(args.workdir, args.size, source.is_dir())
    ensure_sample(source, args.size, args.ranks)
    total = dir_bytes(source)
    memory = meminfo_mb("MemTotal")
    cases = {
        "cp -r + sync": ["sh", "-c", 'cp -r "$1" "$2" && sync "$2"/*', "sh", str(source), str(out)],
        f"mpicons -n {args.ranks}": mpirun(
            args.ranks, [PYTHON, "-m", "mpicons", "consolidate", str(source), str(out), "-q", "--stats-json", str(stats)]
        ),
    }
    runs: dict[str, list[dict[str, float | str]]] = {name: [] for name in cases}
    for repeat in range(args.repeat):
        order = list(cases) if repeat % 2 == 0 else list(reversed(cases))
        for name in order:
            runs[name].append(run_case(name, cases[name], source, out, args.evict == "all", stats))
    quiesce(out)
    medians = {name: statistics.median(float(r["wall"]) for r in results) for name, results in runs.items()}
    inside = statistics.median(float(r["inside"]) for r in runs[f"mpicons -n {args.ranks}"])
    cp, ours = medians["cp -r + sync"], medians[f"mpicons -n {args.ranks}"]
    print(
        f"{total / 1e9:.2f} GB of shards, {memory / 1e3:.1f} GB of RAM ({'larger' if total / 1e6 > memory else 'SMALLER'} "
        f"than memory); medians of {args.repeat}: cp -r + sync {cp:.2f} s ({total / cp / 1e6:.0f} MB/s), "
        f"mpicons -n {args.ranks} {ours:.2f} s ({total / ours / 1e6:.0f} MB/s): {ours / cp:.2f}x; "
        f"after start-up {inside:.2f} s: {inside / cp:.2f}x"
    )
    if args.json:
        numbers = {"machine": machine(), "bytes": total, "mem_mb": memory, "mpiexec": MPIEXEC, "runs": runs}
        numbers |= {"medians": medians, "inside": inside}
        args.json.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    sys.exit(main())
