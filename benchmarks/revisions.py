#!/usr/bin/env python3
"""Two revisions of mpicons against each other on the same checkpoints, interleaved in one run.

For a change that must not change speed (a refactor): each revision's ``mpicons`` package is
extracted with ``git archive`` into the work directory and run from there (``PYTHONPATH``), in
alternating rounds, on the dense sample (DCP's Hugging Face layout) and the MoE sample (many small
row-cut pieces). Reported: the median wall time per case and the ratio NEW/OLD, with both outputs
checked byte for byte against each other.

    python benchmarks/revisions.py e6561c4 HEAD                        # 1 GB dense, 280 MB MoE, 2 ranks, 5 rounds
    python benchmarks/revisions.py OLD NEW --dense 2GB --moe 0 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from harness import PYTHON, REPO, Quiet, byte_compile, checked, machine, mpirun, parse_size, quiesce, run_timed, same_tree, warm


def extract(revision: str, workdir: Path) -> tuple[Path, str]:
    """The revision's package under ``workdir/rev-<commit>``; returns (root, short commit)."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", revision], capture_output=True, text=True, check=True
    ).stdout.strip()
    root = workdir / f"rev-{commit}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "mpicons"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    byte_compile(root / "mpicons")
    return root, commit


def samples(workdir: Path, dense: int, moe: int) -> dict[str, Path]:
    """The samples, written once with the current revision's generator (both revisions read them)."""
    sys.path.insert(0, str(REPO))
    from mpicons.comm import SingleProcess
    from mpicons.sample import SampleConfig, write_sample

    made = {}
    for name, size, config in (
        ("dense", dense, SampleConfig.sized(dense) if dense else None),
        ("moe", moe, SampleConfig.moe(moe) if moe else None),
    ):
        if config is None:
            continue
        directory = workdir / f"{name}-{size}"
        if not directory.exists():
            write_sample(directory, config, comm=SingleProcess())
        made[name] = directory
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--dense", type=parse_size, default=int(1e9), help="dense sample bytes (0: none; default 1GB)")
    parser.add_argument("--moe", type=parse_size, default=int(280e6), help="MoE sample bytes (0: none; default 280MB)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work" / "revisions")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    revisions = [extract(args.old, args.workdir), extract(args.new, args.workdir)]
    inputs = samples(args.workdir, args.dense, args.moe)
    quiet = Quiet()
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        order = revisions if round_ % 2 == 0 else revisions[::-1]  # alternate who goes first
        for name, source in inputs.items():
            for root, commit in order:
                out = args.workdir / f"out-{name}-{commit}"
                shutil.rmtree(out, ignore_errors=True)
                quiesce(out)
                warm(source)
                quiet.wait(f"{name} {commit}")
                env = {**os.environ, "PYTHONPATH": str(root), "MPICONS_PROGRESS": "lines"}
                cmd = mpirun(args.ranks, [PYTHON, "-m", "mpicons", "consolidate", str(source), str(out), "--no-sync", "-q"])
                timed = checked(run_timed(cmd, env=env, cwd=str(args.workdir)), f"{name} {commit}")
                times.setdefault((name, commit), []).append(timed.wall)
    info = machine()
    print(f"machine: {info.get('cpu', '?')}, {info.get('memory', '?')}; {args.ranks} ranks, {args.rounds} rounds, --no-sync")
    (_, old), (_, new) = revisions
    print(f"{'case':8} {old + ' median s':>16} {new + ' median s':>16} {'new/old':>8}  outputs")
    for name in inputs:
        a, b = statistics.median(times[(name, old)]), statistics.median(times[(name, new)])
        differs = same_tree(args.workdir / f"out-{name}-{old}", args.workdir / f"out-{name}-{new}")
        print(f"{name:8} {a:16.2f} {b:16.2f} {b / a:8.2f}  {'identical' if differs is None else 'DIFFER: ' + differs}")
    for busy in quiet.busy_runs:
        print(f"started on a busy machine: {busy}")


if __name__ == "__main__":
    main()
