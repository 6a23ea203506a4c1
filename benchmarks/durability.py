#!/usr/bin/env python3
"""What durability costs: a durable mpicons run (flushed outputs, ``SHA256SUMS``, resume records) against
``cp -r`` + ``sync`` of the same shard files, and where the difference goes.

The input is the dense sample (``SampleConfig.sized``, 2 GB by default), written once and reused. mpicons
is copied first (``--source``) and every run imports that copy. Interleaved rounds (the order rotating
from round to round), each run from a warm page cache after the previous run's writeback, of

    cp -r IN OUT && sync OUT/*                                       (cp+sync)
    mpiexec -n N mpicons consolidate IN OUT                          (durable: the default)
    mpiexec -n N mpicons consolidate IN OUT --no-manifest            (no-manifest)
    mpiexec -n N python -c '...RECORD_EVERY = huge...' consolidate   (no-records: the same, no resume records)
    mpiexec -n N mpicons consolidate IN OUT --no-sync --no-manifest  (no-sync)
    mpiexec -n N python -c 'import mpicons.frontends.cli'            (start-up: the launcher, Python, the imports)

report medians of wall time and of mpicons' own phases (``--stats-json``), each durable variant's ratio to
``cp -r`` + ``sync`` (target ≤ 1.2×, and the manifest ≤ 1.1× of the same run without), and the outputs
checked: every mpicons output equal file for file, its ``SHA256SUMS`` right.

    python benchmarks/durability.py                         # 2 GB, 2 ranks, 5 rounds, in /tmp
    python benchmarks/durability.py --size 200MB --repeat 1  # a quick run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import (
    MPIEXEC,
    PYTHON,
    Context,
    Quiet,
    cached_sample,
    checked,
    machine,
    parse_size,
    quiesce,
    same_tree,
    snapshot_sources,
    warm,
)

NO_RECORDS = (
    "import sys, mpicons.job.resumption as r; r.RECORD_EVERY = 1 << 62; "
    "from mpicons.frontends.cli import run; sys.argv[0] = 'mpicons'; run()"
)
CASES = ("cp+sync", "durable", "no-manifest", "no-records", "no-sync", "start-up")


def command(case: str, ranks: int, src: Path, out: Path, stats: Path) -> list[str]:
    """The command line of one case."""
    launch = [MPIEXEC, "-n", str(ranks), PYTHON]
    job = ["consolidate", str(src), str(out), "-q", "--stats-json", str(stats)]
    if case == "cp+sync":
        return ["sh", "-c", 'cp -r "$1" "$2" && sync "$2"/*', "cp", str(src), str(out)]
    if case == "start-up":
        return [*launch, "-c", "import mpicons.frontends.cli"]
    if case == "no-records":
        return [*launch, "-c", NO_RECORDS, *job]
    more = {"durable": [], "no-manifest": ["--no-manifest"], "no-sync": ["--no-sync", "--no-manifest"]}[case]
    return [*launch, "-m", "mpicons", *job, *more]


def manifest_right(out: Path) -> bool:
    lines = (out / "SHA256SUMS").read_text().splitlines()
    pairs = (line.split("  ", 1) for line in lines)
    return all(hashlib.sha256((out / name).read_bytes()).hexdigest() == digest for digest, name in pairs)


def run_rounds(ctx: Context, args: argparse.Namespace, src: Path, work: Path) -> dict[str, list[dict[str, Any]]]:
    """Every case once per round, the order rotating; each run's wall seconds and mpicons' phases."""
    results: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    reference: Path | None = None
    for round_number in range(args.repeat):
        order = CASES[round_number % len(CASES) :] + CASES[: round_number % len(CASES)]
        for case in order:
            out, stats = work / "out", work / "stats.json"
            quiesce(out)
            stats.unlink(missing_ok=True)
            warm(src)
            ctx.quiet.wait(case)
            timed = checked(ctx.run(command(case, args.ranks, src, out, stats)), case)
            entry: dict[str, Any] = {"wall": timed.wall}
            if stats.exists():
                report = json.loads(stats.read_text())
                entry["phases"] = {name: spread["max"] for name, spread in report["phases"].items()}
                entry["elapsed"] = report["elapsed"]["max"]
            if case == "durable" and not manifest_right(out):
                raise SystemExit("durability: SHA256SUMS does not match the files")
            if case in ("durable", "no-manifest", "no-records", "no-sync"):
                weights = work / "reference"
                if reference is None:
                    shutil.rmtree(weights, ignore_errors=True)  # an earlier run's
                    shutil.copytree(out, weights, ignore=shutil.ignore_patterns("SHA256SUMS"))
                    reference = weights
                else:
                    (out / "SHA256SUMS").unlink(missing_ok=True)
                    difference = same_tree(reference, out)
                    if difference:
                        raise SystemExit(f"durability: {case} output differs: {difference}")
            results[case].append(entry)
            print(f"round {round_number + 1} {case:12s} {timed.wall:7.3f} s", flush=True)
    quiesce(work / "out", work / "reference")
    return results


def summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians, ratios to cp -r + sync, and the phases' medians per mpicons case."""
    median = {case: statistics.median(r["wall"] for r in runs) for case, runs in results.items()}
    phases = {
        case: {name: statistics.median(r["phases"][name] for r in runs) for name in runs[0]["phases"]}
        for case, runs in results.items()
        if runs and "phases" in runs[0]
    }
    return {
        "median_wall_s": median,
        "x_cp_sync": {case: median[case] / median["cp+sync"] for case in CASES if case not in ("cp+sync", "start-up")},
        "manifest_x": median["durable"] / median["no-manifest"],
        "records_x": median["durable"] / median["no-records"],
        "median_phases_s": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--source", default="worktree", choices=("worktree", "head"))
    parser.add_argument("--patience", type=float, default=30.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mpicons-bench-durability-"))
    work.mkdir(parents=True, exist_ok=True)
    root, label = snapshot_sources(work, args.source)
    ctx = Context.on_snapshot(root, work, Quiet(args.patience), args.repeat)
    from mpicons.sample import SampleConfig

    src = work / "sample"
    cached_sample(src, SampleConfig.sized(parse_size(args.size)), "durability")
    results = run_rounds(ctx, args, src, work)
    report = {"machine": machine(), "mpicons": label, "ranks": args.ranks, "size": args.size, "runs": results}
    report.update(summary(results))
    if ctx.quiet.busy_runs:
        report["busy_runs"] = ctx.quiet.busy_runs
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
