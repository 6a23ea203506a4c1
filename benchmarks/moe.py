#!/usr/bin/env python3
"""MoE-shaped checkpoints: many small tensors, every one cut over many training ranks.

Measures, interleaved in one run (best of ``--repeat``): ``cp -r`` of the shard directory (with
and without ``sync``), and ``mpiexec -n N mpicons consolidate`` with ``--no-sync`` (like ``cp -r``)
and durable (like ``cp -r + sync``), with peak RSS per rank and byte-identical outputs. torch's
consolidator runs too when torch is importable (``--torch``).

    python benchmarks/moe.py                                  # ~280 MB, 64 training ranks, 1/2/4 ranks
    python benchmarks/moe.py --size 1GB --training-ranks 128 --ranks 2 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from harness import (
    MPIEXEC,
    PYTHON,
    REPO,
    Quiet,
    Timed,
    cached_sample,
    checked,
    dir_bytes,
    machine,
    mpirun,
    parse_size,
    quiesce,
    run_timed,
    same_tree,
    warm,
)

ENV = {**os.environ, "PYTHONPATH": str(REPO), "MPICONS_PROGRESS": "lines"}


def ensure_sample(workdir: Path, size: int, training_ranks: int) -> tuple[Path, dict[str, object]]:
    """Write the MoE sample once; reuse it while its config is unchanged."""
    sys.path.insert(0, str(REPO))
    from mpicons.sample import SampleConfig

    directory = workdir / f"moe-{size}-{training_ranks}"
    return directory, cached_sample(directory, SampleConfig.moe(size, training_ranks=training_ranks), "moe")


def pieces(directory: Path) -> int:
    from mpicons.formats.shard_headers import read_table

    return len(read_table(str(directory)).pieces)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(280e6), help="tensor bytes of the sample (default 280MB)")
    parser.add_argument("--training-ranks", type=int, default=64)
    parser.add_argument("--ranks", default="1,2,4", help="mpicons rank counts (default 1,2,4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="also torch's consolidate_safetensors_files (slow)")
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source, described = ensure_sample(args.workdir, args.size, args.training_ranks)
    ranks = [int(r) for r in args.ranks.split(",")]
    quiet = Quiet()
    total = warm(source)
    count = pieces(source)
    out = args.workdir / "moe-out"
    cases: dict[str, list[Timed]] = {}
    stats: dict[str, dict[str, object]] = {}

    def run(name: str, cmd: list[str], target: Path) -> None:
        quiesce(target)
        warm(source)
        quiet.wait(name)
        timed = checked(run_timed(cmd, env=ENV), name)
        cases.setdefault(name, []).append(timed)

    for _ in range(args.repeat):
        run("cp -r", ["cp", "-r", str(source), str(out)], out)
        run("cp -r + sync", ["sh", "-c", f"cp -r {source} {out} && sync -f {out}/*"], out)
        for n in ranks:
            for durable in (False, True):
                name = f"mpicons -n {n}" + ("" if durable else " --no-sync")
                target = args.workdir / f"moe-mpicons-{n}-{int(durable)}"
                stats_file = args.workdir / f"moe-stats-{n}-{int(durable)}.json"
                cmd = mpirun(
                    n,
                    [PYTHON, "-m", "mpicons", "consolidate", str(source), str(target), "-q", "--stats-json", str(stats_file)]
                    + ([] if durable else ["--no-sync"]),
                )
                run(name, cmd, target)
                stats[name] = json.loads(stats_file.read_text())
        if args.torch:
            torch_out = args.workdir / "moe-torch"
            script = (
                f"import time, json; from torch.distributed.checkpoint._consolidate_hf_safetensors import "
                f"consolidate_safetensors_files as c; c({str(source)!r}, {str(torch_out)!r}, "
                f"fqn_to_index_mapping=None, num_threads=1)"
            )
            run("torch consolidate_safetensors_files", [PYTHON, "-c", script], torch_out)
    reference = args.workdir / f"moe-mpicons-{ranks[0]}-1"
    differing = [n for n in ranks for d in (0, 1) if same_tree(reference, args.workdir / f"moe-mpicons-{n}-{d}")]
    from mpi4py import MPI  # noqa: F401 - check_sample runs on COMM_SELF

    from mpicons.sample import SampleConfig, check_sample

    checked_tensors = check_sample(str(reference), SampleConfig(**described["config"]), MPI.COMM_SELF)  # type: ignore[arg-type]
    best = {name: min(times, key=lambda t: t.wall) for name, times in cases.items()}
    print(
        f"MoE sample: {count:,} pieces, {described['tensors']:,} tensors, {args.training_ranks} training ranks, "
        f"{dir_bytes(source) / 1e6:.0f} MB of shards ({total / 1e6:.0f} MB read warm); best of {args.repeat}"
    )
    _table(best, stats)
    print(
        f"outputs byte-identical across rank counts and sync modes: {not differing}; "
        f"{checked_tensors} tensors equal the sample's values"
    )
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        numbers = {
            "machine": machine(),
            "pieces": count,
            "sample": described,
            "mpiexec": MPIEXEC,
            "cases": {n: [t.__dict__ | {"log": ""} for t in ts] for n, ts in cases.items()},
            "stats": stats,
            "identical": not differing,
            "busy_runs": quiet.busy_runs,
        }
        args.json.write_text(json.dumps(numbers, indent=1))


def _table(best: dict[str, Timed], stats: dict[str, dict[str, object]]) -> None:
    """Best wall time per case, as multiples of cp, with mpicons' slowest-rank phase times."""
    cp, cp_sync = best["cp -r"].wall, best["cp -r + sync"].wall
    print(f"{'case':<34}{'wall s':>8}{'x cp -r':>9}{'x cp+sync':>10}{'RSS/rank MB':>13}{'scan':>7}{'plan':>7}{'write':>7}")
    for name, timed in best.items():
        phases: Any = stats.get(name, {}).get("phases", {})
        cols = "".join(f"{phases[p]['max']:>7.2f}" if p in phases else f"{'':>7}" for p in ("scan", "plan", "write"))
        print(f"{name:<34}{timed.wall:>8.3f}{timed.wall / cp:>9.2f}{timed.wall / cp_sync:>10.2f}{timed.rss_mb:>13.0f}{cols}")


if __name__ == "__main__":
    main()
