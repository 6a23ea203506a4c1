#!/usr/bin/env python3
"""What comparing replicated pieces costs: one checkpoint with a replicated tensor stored once, and
the same checkpoint with every training rank storing its own copy, consolidated interleaved.

The outputs are identical; the difference in time is the replica check (reading and hashing every
copy) plus reading the extra copies' headers. Run with the project's venv interpreter:

    python benchmarks/replicas.py                  # 256 MB replicated tensor, 2 ranks, best of 3
    python benchmarks/replicas.py --replicated 64MB --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mpicons.core.names import shard_file_name  # noqa: E402
from mpicons.core.safetensors_codec import build_header  # noqa: E402
from mpicons.frontends.arguments import parse_size  # noqa: E402

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def write_shard(path: Path, pieces: list[tuple[str, np.ndarray, tuple[int, ...]]]) -> None:
    info = {name: {"saved_offsets": list(offsets)} for name, _, offsets in pieces}
    metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
    header, _ = build_header([(name, "F32", data.shape) for name, data, _ in pieces], metadata)
    with open(path, "wb") as handle:
        handle.write(header)
        for _, data, _ in pieces:
            handle.write(data.tobytes())


def make(directory: Path, replicated_bytes: int, ranks: int, copies: int) -> None:
    """``ranks`` training ranks; a row-sharded matrix, and one replicated tensor saved by ``copies`` of them."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    rows = replicated_bytes // (4 * 1024)
    shared = rng.random((rows, 1024), dtype=np.float32)
    matrix = rng.random((rows, 1024), dtype=np.float32)
    step = -(-rows // ranks)
    for rank in range(ranks):
        pieces = [("matrix", matrix[rank * step : (rank + 1) * step], (rank * step, 0))]
        if rank < copies:
            pieces.append(("shared", shared, (0, 0)))
        write_shard(directory / shard_file_name(rank + 1, 1, 1), pieces)


def consolidate(source: Path, out: Path, ranks: int) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    stats = out.parent / f"{out.name}.json"
    start = time.perf_counter()
    subprocess.run(
        [
            MPIEXEC,
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "mpicons",
            "consolidate",
            str(source),
            str(out),
            "-q",
            "--no-sync",
            "--stats-json",
            str(stats),
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    wall = time.perf_counter() - start
    return wall, json.loads(stats.read_text())["elapsed"]["max"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicated", type=parse_size, default=256 << 20, help="size of the replicated tensor (default 256M)")
    parser.add_argument("--ranks", type=int, default=2, help="mpicons ranks (default 2)")
    parser.add_argument("--training-ranks", type=int, default=4, help="training ranks in the checkpoint (default 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work" / "replicas")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    once, every = args.workdir / "once", args.workdir / "every"
    make(once, args.replicated, args.training_ranks, 1)
    make(every, args.replicated, args.training_ranks, args.training_ranks)
    for path in (*once.iterdir(), *every.iterdir()):
        path.read_bytes()  # warm the page cache: the check's cost, not the disk's
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeat):
        for name, source in (("once", once), ("every", every)):
            wall, call = consolidate(source, args.workdir / f"out-{name}", args.ranks)
            best[name] = min(best.get(name, (wall, call)), (wall, call))
    outputs = [(args.workdir / f"out-{name}" / "model.safetensors.index.json").exists() for name in best]
    same = all(outputs) and all(
        (args.workdir / "out-once" / p.name).read_bytes() == p.read_bytes() for p in (args.workdir / "out-every").iterdir()
    )
    extra = (args.training_ranks - 1) * args.replicated
    hashed = args.training_ranks * args.replicated
    print(
        f"replicated tensor {args.replicated / 1e6:.0f} MB, {args.training_ranks} training ranks, {args.ranks} mpicons ranks, "
        f"best of {args.repeat}; outputs identical: {same}"
    )
    for name, (wall, call) in best.items():
        print(f"  stored {name:<5}  wall {wall:6.3f} s   consolidation {call:6.3f} s")
    cost = best["every"][1] - best["once"][1]
    print(
        f"  check: {cost:.3f} s for {hashed / 1e6:.0f} MB of copies hashed ({extra / 1e6:.0f} MB more read than stored once): "
        f"{hashed / 1e9 / cost if cost > 0 else float('inf'):.2f} GB/s over {args.ranks} ranks"
    )


if __name__ == "__main__":
    main()
