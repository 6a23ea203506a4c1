#!/usr/bin/env python3
"""Where one consolidation spends its time: cProfile of ``mpicons.consolidate`` in one process.

Runs the consolidation once on ``SingleProcess`` (no MPI start-up) with ``sync=False`` and prints
the import time, mpicons' own phase times (scan, plan, write, finalize) and the functions that
took longest, by cumulative and by own time. Judge a change by these counts and phase times on a
shared machine, where wall-clock comparisons need interleaved runs.

    python benchmarks/profile_phases.py IN OUT [--top 30] [--save FILE.prof]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _count_collections() -> list[float]:
    """[seconds, count] of the cyclic garbage collector's passes from now on (updated in place)."""
    spent = [0.0, 0.0, 0.0]

    def tally(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            spent[2] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - spent[2]
            spent[1] += 1

    gc.callbacks.append(tally)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="the sharded checkpoint")
    parser.add_argument("output", help="the output directory (removed first)")
    parser.add_argument("--top", type=int, default=30, help="functions listed per ordering")
    parser.add_argument("--save", type=Path, help="write the raw profile here (pstats format)")
    args = parser.parse_args()
    began = time.perf_counter()
    from mpicons.comm.single import SingleProcess
    from mpicons.job.consolidation import consolidate

    imported = time.perf_counter() - began
    collections = _count_collections()
    shutil.rmtree(args.output, ignore_errors=True)
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    result = consolidate(args.input, args.output, comm=SingleProcess(), sync=False)
    profile.disable()
    elapsed = time.perf_counter() - began
    phases = ", ".join(f"{name} {spread.max:.3f}" for name, spread in result.stats.phases.items())
    print(f"imports {imported:.3f} s; consolidate {elapsed:.3f} s (under the profiler): {phases}")
    print(f"cyclic garbage collections: {collections[1]:.0f}, {collections[0]:.3f} s")
    if args.save:
        profile.dump_stats(args.save)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())


if __name__ == "__main__":
    main()
