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
    python benchmarks/bench.py --size 200MB --repeat 1 --json benchmarks/work/result.json

Planning at scale (scan + plan of a 2,048-training-rank, 2.3-million-piece header-only
checkpoint, memory per rank against ranks) is ``benchmarks/planning.py``; MoE-shaped checkpoints
are ``benchmarks/moe.py``, node-local shards ``benchmarks/local_shards.py``.

The pieces: ``dense.py`` runs the cases, ``report.py`` prints the table and the targets,
``harness.py`` times, waits and compares. ``dense.py`` starts two worker scripts as processes of
their own: ``workers/sample.py`` (writes the sample, under mpiexec) and
``workers/torch_consolidate.py`` (runs torch's consolidator: one process, or under mpiexec).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dense import run_dense
from harness import PYTHON, REPO, Context, Quiet, parse_size, snapshot_sources
from report import machine_info, report

THIS = str(Path(__file__).resolve())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(2e9), help="sample checkpoint size, e.g. 2GB (default)")
    parser.add_argument(
        "--workdir", type=Path, default=REPO / "benchmarks" / "work", help="samples and outputs (default: %(default)s)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per case, best reported (default: %(default)s)")
    parser.add_argument("--ranks", default="1,2,4", help="mpicons rank counts (default: %(default)s)")
    parser.add_argument("--splits", default="bytes,files", help="mpicons --split values (default: %(default)s)")
    parser.add_argument("--ios", default="posix,mpiio", help="mpicons --io values (default: %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=1, help="num_threads for torch (default: %(default)s)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch even when it is installed")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every number as JSON")
    parser.add_argument(
        "--source",
        choices=("worktree", "head"),
        default="worktree",
        help="mpicons to benchmark: the working tree as it is at the start, or the last commit "
        "(either is copied first, so edits during the run do not mix versions; default: %(default)s)",
    )
    parser.add_argument(
        "--patience",
        type=float,
        default=60.0,
        help="seconds each run waits for idle CPUs and disk before starting anyway (default: %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    root, label = snapshot_sources(workdir, args.source)
    ctx = Context.on_snapshot(root, workdir, Quiet(args.patience), args.repeat)
    info = machine_info(workdir)
    info["mpicons"] = label
    command = " ".join([os.path.relpath(PYTHON), os.path.relpath(THIS), *argv])
    print(f"bench: {command}")
    print(f"machine: {info['nproc']} cores, kernel {info['kernel']}, {info['filesystem']} at {workdir}, torch {info['torch']}")
    print(f"mpicons: {label}")
    dense = run_dense(
        ctx,
        workdir,
        args.size,
        [int(x) for x in args.ranks.split(",")],
        args.splits.split(","),
        args.ios.split(","),
        torch=not args.no_torch,
        torch_threads=args.torch_threads,
    )
    result = report(dense, args.repeat, ctx.quiet.busy_runs)
    total = time.perf_counter() - began
    print(f"\nbench: done in {total:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": info, "total_s": total, **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
