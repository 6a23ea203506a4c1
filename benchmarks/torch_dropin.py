#!/usr/bin/env python3
"""mpicons' drop-in against torch's ``consolidate_safetensors_files_on_every_rank`` in a torchrun job.

Interleaved in one run (best of ``--repeat``), each a fresh ``torchrun --standalone`` job of
``--procs`` processes over gloo on the float-only dense sample (torch's function cannot read the
sample's integer and bool tensors): the drop-in (durable, as mpicons always is by default), the
drop-in with ``sync=False``, and torch's function (which does not fsync; its fsync is timed after).
``cp -r`` of the shards is the floor; ``mpiexec -n PROCS mpicons consolidate`` (the same engine over
MPI, its ``elapsed``) is the reference. Times are of the calls alone (imports and the group excluded).

    python benchmarks/torch_dropin.py                 # ~2 GB sample, 2 processes, best of 3
    python benchmarks/torch_dropin.py --size 500MB --repeat 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from dense import ensure_sample, sample_mapping
from harness import (
    BIN,
    PYTHON,
    REPO,
    Context,
    Quiet,
    checked,
    machine,
    mpirun,
    parse_size,
    quiesce,
    same_tensors,
    same_tree,
    warm,
)

TORCHRUN = str(BIN / "torchrun")
WORKER = str(Path(__file__).resolve().parent / "workers" / "torchrun_consolidate.py")
CASES = {"mpicons drop-in": "mpicons", "mpicons drop-in, sync=False": "mpicons-no-sync", "torch": "torch"}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(2e9), help="tensor bytes of the sample (default 2GB)")
    parser.add_argument("--procs", type=int, default=2, help="torchrun processes (default 2)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    ctx = Context({**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, str(args.workdir), Quiet(), args.repeat)
    source = ensure_sample(ctx, args.workdir, args.size, float_only=True)
    mapping_file = args.workdir / "mapping-float.json"
    mapping_file.write_text(json.dumps(sample_mapping(args.size, float_only=True)))
    total = warm(source)
    mpi_case = f"mpiexec -n {args.procs} mpicons"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ["cp -r", mpi_case, *CASES]}
    outputs = {name: args.workdir / f"dropin-{which}" for name, which in CASES.items()}
    copy = args.workdir / "dropin-cp"
    for _ in range(args.repeat):
        quiesce(copy)  # also lets the previous cases' writeback finish
        warm(source)
        ctx.quiet.wait("cp -r")
        runs["cp -r"].append({"call_s": checked(ctx.run(["cp", "-r", str(source), str(copy)]), "cp -r").wall})
        quiesce(copy)  # its writeback must not land in the next case's time
        runs[mpi_case].append(_mpiexec(ctx, source, args.workdir / "dropin-mpiexec", args.procs))
        for name, which in CASES.items():
            quiesce(outputs[name])
            warm(source)
            ctx.quiet.wait(name)
            result = args.workdir / "dropin-result.json"
            result.unlink(missing_ok=True)
            command = [TORCHRUN, "--standalone", "--nproc-per-node", str(args.procs), WORKER, which]
            timed = checked(ctx.run([*command, str(source), str(outputs[name]), str(mapping_file), str(result)]), name)
            runs[name].append(json.loads(result.read_text()) | {"torchrun_wall_s": timed.wall})
            print(f"torch_dropin: {name}: call {runs[name][-1]['call_s']:.2f} s")
    identical = same_tree(outputs["mpicons drop-in"], outputs["mpicons drop-in, sync=False"])
    agrees = same_tensors(outputs["mpicons drop-in"], outputs["torch"])
    quiesce(copy)
    _report(runs, total, args, identical, agrees)
    if args.json:
        numbers = {"machine": machine(), "size": args.size, "procs": args.procs, "runs": runs}
        numbers |= {"identical": identical is None, "same_tensors": agrees is None, "busy_runs": ctx.quiet.busy_runs}
        args.json.write_text(json.dumps(numbers, indent=1))


def _mpiexec(ctx: Context, source: Path, target: Path, procs: int) -> dict[str, Any]:
    """The same consolidation as an MPI job (its own ``elapsed``, imports excluded)."""
    quiesce(target)
    warm(source)
    ctx.quiet.wait("mpiexec")
    stats_file = target.with_suffix(".json")
    command = [PYTHON, "-m", "mpicons", "consolidate", str(source), str(target), "-q", "--stats-json", str(stats_file)]
    checked(ctx.run(mpirun(procs, command)), "mpiexec mpicons")
    stats = json.loads(stats_file.read_text())
    quiesce(target)
    return {"call_s": stats["elapsed"]["max"], "peak_rss_mb": stats["peak_rss_mb"]["max"]}


def _report(runs: dict[str, list[dict[str, Any]]], total: int, args: argparse.Namespace, identical: Any, agrees: Any) -> None:
    best = {name: min(r["call_s"] for r in rs) for name, rs in runs.items()}
    torch_durable = min(r["call_s"] + r["sync_s"] for r in runs["torch"])
    print(f"{total / 1e9:.2f} GB of shards, {args.procs} torchrun processes (gloo), best of {args.repeat}; {PYTHON}")
    print(f"{'case':<32}{'call s':>8}{'x cp -r':>9}{'RSS/proc MB':>13}{'mpi4py.MPI':>12}")
    for name, seconds in best.items():
        rss = max((r.get("peak_rss_mb", 0.0) for r in runs[name]), default=0.0)
        mpi = str(any(r["mpi_imported"] for r in runs[name])) if name in CASES else ""
        print(f"{name:<32}{seconds:>8.2f}{seconds / best['cp -r']:>9.2f}{rss:>13.0f}{mpi:>12}")
    print(f"torch + fsync of its outputs: {torch_durable:.2f} s")
    print(
        f"torch / drop-in: {best['torch'] / best['mpicons drop-in, sync=False']:.2f}x without fsync on either side, "
        f"{torch_durable / best['mpicons drop-in']:.2f}x both durable"
    )
    print(f"drop-in outputs byte-identical with and without sync: {identical is None}; torch's tensors equal: {agrees is None}")


if __name__ == "__main__":
    main()
