#!/usr/bin/env python3
"""mpicons' drop-ins against torch's two consolidation functions, in torchrun jobs.

For each process count (``--procs``, default 2 and 4) a checkpoint is saved by torch's own
``HuggingFaceStorageWriter`` in a torchrun job, then consolidated into each number of output files
(``--files``; default: 1, fewer than the processes, and twice the processes: torch's worst and best
cases) by each case, interleaved, each a fresh ``torchrun --standalone`` job over gloo: torch's
``consolidate_safetensors_files_on_every_rank`` and mpicons' (durable by default, and ``sync=False``),
then torch's ``consolidate_safetensors_files`` and mpicons' on rank 0 alone while the others wait
(``num_threads``: ``--threads``). Times are of the calls alone (barrier to barrier, slowest process;
imports and the group excluded); torch does not fsync, so its fsync is timed after. Peak RSS per process.

    python benchmarks/torch_dropin.py                          # ~2 GB, 2 and 4 processes, best of 3
    python benchmarks/torch_dropin.py --size 64MB --procs 2 --repeat 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from harness import BIN, PYTHON, REPO, Context, Quiet, checked, machine, parse_size, quiesce, same_tensors, same_tree, warm
from safetensors import safe_open

TORCHRUN = str(BIN / "torchrun")
WORKER = str(Path(__file__).resolve().parent / "workers" / "torchrun_consolidate.py")
#: case name → the worker's mode; pairs compared: (torch's, mpicons').
CASES = {
    "torch on every rank": "torch",
    "mpicons on every rank": "mpicons",
    "mpicons on every rank, sync=False": "mpicons-no-sync",
    "torch, rank 0 alone": "torch-one",
    "mpicons, rank 0 alone": "mpicons-one",
}
PAIRS = [("torch on every rank", "mpicons on every rank"), ("torch, rank 0 alone", "mpicons, rank 0 alone")]


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(2e9), help="tensor bytes of the checkpoint (default 2GB)")
    parser.add_argument("--tensors", type=int, default=48, help="tensors in the checkpoint (default 48)")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="torchrun processes (default 2 4)")
    parser.add_argument("--files", type=int, nargs="+", help="output file counts (default: 1, procs - 1 if > 1, 2 x procs)")
    parser.add_argument("--threads", type=int, default=4, help="num_threads of the calls (default 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def _torchrun(ctx: Context, procs: int, args: list[str], what: str) -> float:
    return checked(ctx.run([TORCHRUN, "--standalone", "--nproc-per-node", str(procs), WORKER, *args]), what).wall


def _checkpoint(ctx: Context, workdir: Path, procs: int, size: int, tensors: int) -> Path:
    """torch's writer saves the checkpoint once per process count (kept between runs of the script)."""
    path = workdir / f"dropin-torch-{procs}p-{size}-{tensors}"
    if not (path / ".complete").exists():
        quiesce(path)
        _torchrun(ctx, procs, ["save", str(path), str(size), str(tensors)], "torch's save")
        (path / ".complete").write_text("")
    return path


def _names(checkpoint: Path) -> list[str]:
    names: set[str] = set()
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "np") as handle:
            names.update(handle.keys())
    return sorted(names, key=lambda n: int(n.split(".")[1]))


def _file_counts(procs: int, given: list[int] | None) -> list[int]:
    return given or sorted({1, max(1, procs - 1), 2 * procs})


def _run_case(ctx: Context, procs: int, mode: str, source: Path, output: Path, mapping: Path, threads: int) -> dict[str, Any]:
    quiesce(output)
    warm(source)
    ctx.quiet.wait(mode)
    result = output.with_suffix(".json")
    result.unlink(missing_ok=True)
    wall = _torchrun(ctx, procs, [mode, str(source), str(output), str(mapping), str(result), "--threads", str(threads)], mode)
    return json.loads(result.read_text()) | {"torchrun_wall_s": wall}


def measure(ctx: Context, args: argparse.Namespace, procs: int) -> dict[str, Any]:
    """Every case at every file count for ``procs`` processes, interleaved; outputs compared."""
    source = _checkpoint(ctx, args.workdir, procs, args.size, args.tensors)
    total = warm(source)
    names = _names(source)
    numbers: dict[str, Any] = {"procs": procs, "shard_bytes": total, "files": {}}
    for files in _file_counts(procs, args.files):
        mapping = args.workdir / f"dropin-mapping-{files}.json"
        mapping.write_text(json.dumps({name: 1 + i % files for i, name in enumerate(names)}))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CASES}
        outputs = {name: args.workdir / f"dropin-out-{mode}" for name, mode in CASES.items()}
        for _ in range(args.repeat):
            for name, mode in CASES.items():
                runs[name].append(_run_case(ctx, procs, mode, source, outputs[name], mapping, args.threads))
                print(f"torch_dropin: {procs} procs, {files} files, {name}: {runs[name][-1]['call_s']:.2f} s", flush=True)
        ours = outputs["mpicons on every rank"]
        checks = {
            "same bytes, both mpicons functions": same_tree(ours, outputs["mpicons, rank 0 alone"]),
            "same bytes, with and without sync": same_tree(ours, outputs["mpicons on every rank, sync=False"]),
            "torch's tensors": same_tensors(ours, outputs["torch on every rank"]),
        }
        failed = {k: v for k, v in checks.items() if v is not None}
        if failed:  # a benchmark of outputs that differ measures nothing
            raise SystemExit(f"torch_dropin: {procs} procs, {files} files: outputs differ: {failed}")
        numbers["files"][files] = {"runs": runs, "checks": {k: v is None for k, v in checks.items()}}
        quiesce(*outputs.values())
    return numbers


def _report(all_numbers: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{PYTHON}; num_threads={args.threads}; best of {args.repeat}; times of the call alone")
    print(f"{'procs':>5}{'files':>6}  {'case':<36}{'best s':>8}{'median s':>10}{'RSS per process MB':>22}")
    for numbers in all_numbers:
        for files, entry in numbers["files"].items():
            for name, runs in entry["runs"].items():
                calls = [r["call_s"] + r["sync_s"] for r in runs]
                rss = "/".join(f"{m:.0f}" for m in max((r["rss_mb"] for r in runs), key=max))
                print(f"{numbers['procs']:>5}{files:>6}  {name:<36}{min(calls):>8.2f}{statistics.median(calls):>10.2f}{rss:>22}")
            for theirs, ours in PAIRS:
                ratios = [(t["call_s"] + t["sync_s"]) / o["call_s"] for t, o in zip(entry["runs"][theirs], entry["runs"][ours])]
                print(f"{'':>11}  ratio {theirs} (+ fsync) / mpicons: {statistics.median(ratios):.2f}x (median of runs)")
            print(f"{'':>11}  checks: {entry['checks']}")


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = Context({**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, str(args.workdir), Quiet(), args.repeat)
    all_numbers = [measure(ctx, args, procs) for procs in args.procs]
    _report(all_numbers, args)
    if args.json:
        document = {"machine": machine(), "size": args.size, "threads": args.threads, "results": all_numbers}
        args.json.write_text(json.dumps(document | {"busy_runs": ctx.quiet.busy_runs}, indent=1))


if __name__ == "__main__":
    main()
