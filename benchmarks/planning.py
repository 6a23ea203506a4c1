#!/usr/bin/env python3
"""Scan + plan of a huge header-only checkpoint, and memory per rank against the number of ranks.

The default is shaped like a 405B model saved by 2,048 training ranks: 1,137 tensors, each cut over
every training rank (rows, columns, a dp × tp grid, or 1-D norms), 4 output files, so 8,192 shard
files and 2.3 million pieces. The shards' data sections are sparse (holes): only the headers are
real, which is all scan and plan read.

    python benchmarks/planning.py                       # 2,048 × 1,137 × 4, at 1/2/4/8 ranks, best of 2
    python benchmarks/planning.py --training-ranks 512 --ranks 1,2,4 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from harness import PYTHON, REPO, Quiet, checked, machine, mpirun, run_timed, warm

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
WORKERS = Path(__file__).resolve().parent / "workers"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--training-ranks", type=int, default=2048)
    parser.add_argument("--tensors", type=int, default=1137)
    parser.add_argument("--outputs", type=int, default=4)
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    directory = args.workdir / f"headers-{args.training_ranks}x{args.tensors}x{args.outputs}"
    marker = directory.with_suffix(".done")
    if not marker.exists():
        began = time.perf_counter()
        checked(
            run_timed(
                mpirun(
                    2,
                    [
                        PYTHON,
                        str(WORKERS / "headers.py"),
                        str(directory),
                        str(args.training_ranks),
                        str(args.tensors),
                        str(args.outputs),
                    ],
                ),
                env=ENV,
            ),
            "writing header-only shards",
        )
        marker.write_text("")
        print(f"planning: wrote {args.training_ranks * args.outputs} header-only shards in {time.perf_counter() - began:.0f} s")
    on_disk = warm(directory)
    quiet = Quiet()
    rows = {}
    for n in [int(r) for r in args.ranks.split(",")]:
        best = None
        for _ in range(args.repeat):
            quiet.wait(f"-n {n}")
            result = args.workdir / f"planning-{n}.json"
            command = mpirun(n, [PYTHON, str(WORKERS / "scan_plan.py"), str(directory), str(result)])
            timed = checked(run_timed(command, env=ENV), "scan")
            got = json.loads(result.read_text()) | {"wall_s": timed.wall, "process_rss_mb": timed.rss_mb}
            if best is None or got["scan_s"] + got["plan_s"] < best["scan_s"] + best["plan_s"]:
                best = got
        rows[n] = best
    first = next(iter(rows.values()))
    print(
        f"planning: {first['files']:,} header-only shard files ({on_disk / 1e6:.0f} MB of headers), "
        f"{first['pieces']:,} pieces, {first['tensors']:,} tensors; best of {args.repeat}"
    )
    print(f"{'ranks':>6}{'scan s':>9}{'plan s':>9}{'scan+plan':>11}{'wall s':>9}{'peak RSS/rank MB':>18}{'pieces/rank':>13}")
    for n, r in rows.items():
        print(
            f"{n:>6}{r['scan_s']:>9.2f}{r['plan_s']:>9.2f}{r['scan_s'] + r['plan_s']:>11.2f}{r['wall_s']:>9.2f}"
            f"{max(r['peak_rss_mb'], r['process_rss_mb']):>18.0f}{max(r['pieces_per_rank']):>13,}"
        )
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "runs": rows, "busy_runs": quiet.busy_runs}, indent=1))


if __name__ == "__main__":
    main()
