#!/usr/bin/env python3
"""``mpicons shard`` (a Hugging Face model → Megatron ``torch_dist``) against ``mpicons consolidate`` of the
same model the other way, at 1 and 2 ranks.

The model is the Megatron sample (``MegatronSampleConfig.sized``, 2 GB by default, a llama at TP 2 × PP 2)
consolidated once into a Hugging Face directory (not timed). Interleaved rounds (the order rotating from
round to round) of

    mpiexec -n N mpicons consolidate RUN OUT -q          (consolidate: Megatron → Hugging Face)
    mpiexec -n N mpicons shard HF OUT --tp 2 --pp 2 -q    (shard: Hugging Face → Megatron)
    cp -r HF OUT && sync OUT/*                            (cp+sync: the same bytes copied)

for each rank count, report medians of wall time, the ratio shard/consolidate (target ≤ 1.3×), each to
``cp -r`` + ``sync``, and the peak RSS of the largest rank. Every shard output is checked: consolidated
back, it gives the Hugging Face model's bytes.

    python benchmarks/shard.py                            # 2 GB, 1 and 2 ranks, 3 rounds, in /tmp
    python benchmarks/shard.py --size 200MB --repeat 1    # a quick run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness import MPIEXEC, PYTHON, Context, Quiet, checked, machine, parse_size, quiesce, snapshot_sources, warm

CASES = ("consolidate", "shard", "cp+sync")


def command(case: str, ranks: int, run: Path, hf: Path, out: Path) -> list[str]:
    launch = [MPIEXEC, "-n", str(ranks), PYTHON, "-m", "mpicons"]
    if case == "consolidate":
        return [*launch, "consolidate", str(run), str(out), "-q"]
    if case == "shard":
        return [*launch, "shard", str(hf), str(out), "--tp", "2", "--pp", "2", "-q"]
    return ["sh", "-c", 'cp -r "$1" "$2" && sync "$2"/*', "cp", str(hf), str(out)]


def prepare(ctx: Context, work: Path, size: int) -> tuple[Path, Path]:
    """The Megatron sample and its Hugging Face model, made once per size."""
    from mpicons.sample import MegatronSampleConfig, write_megatron_sample

    run, hf, marker = work / "run", work / "hf", work / "model.json"
    if marker.exists() and json.loads(marker.read_text()) == {"size": size} and (hf / "config.json").exists():
        return run, hf
    quiesce(run, hf)
    write_megatron_sample(run, MegatronSampleConfig.sized(size))
    checked(ctx.run([MPIEXEC, "-n", "2", PYTHON, "-m", "mpicons", "consolidate", str(run), str(hf), "-q"]), "setup")
    marker.write_text(json.dumps({"size": size}))
    return run, hf


def round_trip_right(ctx: Context, out: Path, hf: Path, work: Path) -> bool:
    """The shard output consolidated back is the model, file for file."""
    back = work / "back"
    quiesce(back)
    checked(ctx.run([MPIEXEC, "-n", "2", PYTHON, "-m", "mpicons", "consolidate", str(out), str(back), "-q"]), "check")
    same = all((back / f.name).read_bytes() == f.read_bytes() for f in hf.glob("model*.safetensors"))
    quiesce(back)
    return same


def run_rounds(ctx: Context, args: argparse.Namespace, run: Path, hf: Path, work: Path) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    for ranks in args.ranks:
        for case in CASES:
            results[f"{case}@{ranks}"] = []
    checked_once = False
    for number in range(args.repeat):
        for ranks in args.ranks:
            order = CASES[number % len(CASES) :] + CASES[: number % len(CASES)]
            for case in order:
                if case == "cp+sync" and ranks != args.ranks[0]:
                    continue  # one rank count is enough for cp
                out = work / "out"
                quiesce(out)
                warm(hf if case != "consolidate" else run)
                ctx.quiet.wait(case)
                timed = checked(ctx.run(command(case, ranks, run, hf, out)), f"{case} at {ranks} ranks")
                results[f"{case}@{ranks}"].append({"wall": timed.wall, "rss_mb": timed.rss_mb})
                print(f"round {number + 1} {case:12s} {ranks} ranks {timed.wall:7.3f} s {timed.rss_mb:7.1f} MB", flush=True)
                if case == "shard" and not checked_once:
                    if not round_trip_right(ctx, out, hf, work):
                        raise SystemExit("shard: the output consolidated back is not the model")
                    checked_once = True
    quiesce(work / "out")
    return results


def summary(results: dict[str, list[dict[str, Any]]], ranks: list[int]) -> dict[str, Any]:
    median = {key: statistics.median(r["wall"] for r in runs) for key, runs in results.items() if runs}
    rss = {key: max(r["rss_mb"] for r in runs) for key, runs in results.items() if runs}
    cp = median[f"cp+sync@{ranks[0]}"]
    return {
        "median_wall_s": median,
        "shard_x_consolidate": {n: median[f"shard@{n}"] / median[f"consolidate@{n}"] for n in ranks},
        "x_cp_sync": {key: value / cp for key, value in median.items() if not key.startswith("cp")},
        "peak_rss_mb": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--source", default="worktree", choices=("worktree", "head"))
    parser.add_argument("--patience", type=float, default=30.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mpicons-bench-shard-"))
    work.mkdir(parents=True, exist_ok=True)
    root, label = snapshot_sources(work, args.source)
    ctx = Context.on_snapshot(root, work, Quiet(args.patience), args.repeat)
    run, hf = prepare(ctx, work, parse_size(args.size))
    results = run_rounds(ctx, args, run, hf, work)
    report = {"machine": machine(), "mpicons": label, "size": args.size, "runs": results}
    report.update(summary(results, args.ranks))
    if ctx.quiet.busy_runs:
        report["busy_runs"] = ctx.quiet.busy_runs
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
