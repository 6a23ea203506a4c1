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
import sys
import time
from pathlib import Path

from harness import PYTHON, REPO, Quiet, checked, machine, mpirun, run_timed, warm

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
KINDS = ["rows", "grid", "cols", "rows", "grid", "rows", "cols", "norm", "norm"]


def write_headers(directory: Path, training_ranks: int, tensors: int, outputs: int) -> None:
    """Header-only shards (``_headers`` worker, split over the MPI ranks that run it)."""
    from mpi4py import MPI

    sys.path.insert(0, str(REPO))
    from mpicons.format import build_header
    from mpicons.table import shard_file_name

    comm = MPI.COMM_WORLD
    directory.mkdir(parents=True, exist_ok=True)
    dp = 1 << (training_ranks.bit_length() // 2)
    while training_ranks % dp:
        dp //= 2
    tp = training_ranks // dp
    for f in range(comm.rank, training_ranks * outputs, comm.size):
        rank, index = divmod(f, outputs)
        pieces, info = [], {}
        for t in range(index * tensors // outputs, (index + 1) * tensors // outputs):
            kind = KINDS[t % len(KINDS)]
            name = f"model.layers.{t // len(KINDS)}.{kind}_{t % len(KINDS)}.weight"
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
        header, spans = build_header(sorted(pieces, key=lambda p: p[0]), metadata)
        with open(directory / shard_file_name(rank + 1, index + 1, outputs), "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + (spans[-1][1] if spans else 0))
    comm.Barrier()


def measure(directory: Path, result: Path) -> None:
    """``_measure`` worker: scan and plan under MPI; rank 0 writes the slowest times and the largest peak."""
    import resource

    from mpi4py import MPI

    sys.path.insert(0, str(REPO))
    from mpicons.comm import as_communicator
    from mpicons.plan import build_layout
    from mpicons.scan import distribute, scan

    comm = MPI.COMM_WORLD
    wrapped = as_communicator(comm)  # mpicons' communicator interface over the same MPI communicator
    comm.Barrier()
    began = time.perf_counter()
    scanned = scan(str(directory), wrapped)
    scanned_at = time.perf_counter()
    layout = build_layout(scanned.files, scanned.names, scanned.facts, comm.size)
    part = distribute(wrapped, scanned, layout)
    planned = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    values = comm.gather((scanned_at - began, planned - scanned_at, rss, len(part.pieces)), root=0)
    if comm.rank == 0:
        result.write_text(json.dumps({
            "scan_s": max(v[0] for v in values), "plan_s": max(v[1] for v in values),
            "peak_rss_mb": max(v[2] for v in values), "pieces_per_rank": [v[3] for v in values],
            "pieces": int(scanned.facts.count.sum()),
            "files": len(scanned.files), "tensors": len(scanned.names),
        }))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_headers":
        write_headers(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        measure(Path(sys.argv[2]), Path(sys.argv[3]))
        return
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
        checked(run_timed(mpirun(2, [PYTHON, __file__, "_headers", str(directory), str(args.training_ranks),
                                     str(args.tensors), str(args.outputs)]), env=ENV), "writing header-only shards")
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
            timed = checked(run_timed(mpirun(n, [PYTHON, __file__, "_measure", str(directory), str(result)]), env=ENV), "scan")
            got = json.loads(result.read_text()) | {"wall_s": timed.wall, "process_rss_mb": timed.rss_mb}
            if best is None or got["scan_s"] + got["plan_s"] < best["scan_s"] + best["plan_s"]:
                best = got
        rows[n] = best
    first = next(iter(rows.values()))
    print(f"planning: {first['files']:,} header-only shard files ({on_disk / 1e6:.0f} MB of headers), "
          f"{first['pieces']:,} pieces, {first['tensors']:,} tensors; best of {args.repeat}")
    print(f"{'ranks':>6}{'scan s':>9}{'plan s':>9}{'scan+plan':>11}{'wall s':>9}{'peak RSS/rank MB':>18}{'pieces/rank':>13}")
    for n, r in rows.items():
        print(f"{n:>6}{r['scan_s']:>9.2f}{r['plan_s']:>9.2f}{r['scan_s'] + r['plan_s']:>11.2f}{r['wall_s']:>9.2f}"
              f"{max(r['peak_rss_mb'], r['process_rss_mb']):>18.0f}{max(r['pieces_per_rank']):>13,}")
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "runs": rows, "busy_runs": quiet.busy_runs}, indent=1))


if __name__ == "__main__":
    main()
