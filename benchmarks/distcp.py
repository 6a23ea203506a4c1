#!/usr/bin/env python3
"""DCP's default format (``.metadata`` + ``.distcp``) to a Hugging Face checkpoint.

Interleaved in one run (best of ``--repeat``): ``cp -r`` of the checkpoint directory (with and
without ``sync``), ``mpiexec -n N mpicons consolidate`` at each ``--ranks`` (``--no-sync`` and
durable), and torch's path (``dcp_to_torch_save``, ``torch.load``, ``safetensors`` save: one process,
the whole model in memory) with the Python that has torch (``--torch-python``). The input is the
project's own sample in the ``.distcp`` format (torch_save serialization); torch reads it too.

    python benchmarks/distcp.py                                   # 1.2 GB, 1 and 2 ranks
    python benchmarks/distcp.py --torch-python /path/to/venv-with-torch/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    MPIEXEC,
    PYTHON,
    REPO,
    Quiet,
    Timed,
    checked,
    dir_bytes,
    machine,
    mpirun,
    parse_size,
    quiesce,
    run_timed,
    same_tensors,
    same_tree,
    warm,
)

ENV = {**os.environ, "PYTHONPATH": str(REPO), "MPICONS_PROGRESS": "lines"}


def ensure_sample(workdir: Path, size: int) -> tuple[Path, dict[str, object]]:
    """Write the dense sample in the .distcp format once; reuse it while its config is unchanged."""
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from mpicons.sample import SampleConfig, tensor_specs, write_sample

    config = SampleConfig.sized(size)
    directory = workdir / f"distcp-{size}"
    marker = directory.with_suffix(".json")
    described = {"config": asdict(config), "tensors": len(tensor_specs(config)), "serialization": "torch_save"}
    if not (marker.exists() and json.loads(marker.read_text()) == described):
        shutil.rmtree(directory, ignore_errors=True)
        began = time.perf_counter()
        write_sample(directory, config, distcp="torch_save")
        print(f"distcp: wrote the sample in {time.perf_counter() - began:.1f} s")
        marker.write_text(json.dumps(described))
    return directory, described


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(1.2e9), help="tensor bytes of the sample (default 1.2GB)")
    parser.add_argument("--ranks", default="1,2", help="mpicons rank counts (default 1,2)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--torch-python", help="a Python with torch (default: this one, if it has torch)")
    parser.add_argument("--torch-repeat", type=int, default=1, help="runs of torch's path (slow; default 1)")
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def _torch_python(choice: str | None) -> str | None:
    candidate = choice or PYTHON
    probe = run_timed([candidate, "-c", "import torch"], timeout=300)
    return candidate if probe.code == 0 else None


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source, described = ensure_sample(args.workdir, args.size)
    ranks = [int(r) for r in args.ranks.split(",")]
    torch_python = _torch_python(args.torch_python)
    quiet = Quiet()
    total = warm(source)
    out = args.workdir / "distcp-out"
    cases: dict[str, list[Timed]] = {}
    stats: dict[str, dict[str, Any]] = {}
    torch_numbers: list[dict[str, Any]] = []

    def run(name: str, cmd: list[str], target: Path, env: dict[str, str] = ENV) -> Timed:
        quiesce(target)
        warm(source)
        quiet.wait(name)
        timed = checked(run_timed(cmd, env=env), name)
        cases.setdefault(name, []).append(timed)
        return timed

    for repeat in range(args.repeat):
        run("cp -r", ["cp", "-r", str(source), str(out)], out)
        run("cp -r + sync", ["sh", "-c", f"cp -r {source} {out} && sync -f {out}/*"], out)
        for n in ranks:
            for durable in (False, True):
                name = f"mpicons -n {n}" + ("" if durable else " --no-sync")
                target = args.workdir / f"distcp-mpicons-{n}-{int(durable)}"
                stats_file = args.workdir / f"distcp-stats-{n}-{int(durable)}.json"
                command = [
                    PYTHON,
                    "-m",
                    "mpicons",
                    "consolidate",
                    str(source),
                    str(target),
                    "-q",
                    "--stats-json",
                    str(stats_file),
                ]
                run(name, mpirun(n, command + ([] if durable else ["--no-sync"])), target)
                stats[name] = json.loads(stats_file.read_text())
        if torch_python and repeat < args.torch_repeat:
            target = args.workdir / "distcp-torch"
            result = args.workdir / "distcp-torch.json"
            worker = str(REPO / "benchmarks" / "workers" / "torch_distcp.py")
            run(
                "torch dcp_to_torch_save + save_file",
                [torch_python, worker, str(source), str(target), str(result)],
                target,
                os.environ.copy(),
            )
            torch_numbers.append(json.loads(result.read_text()))
    reference = args.workdir / f"distcp-mpicons-{ranks[0]}-1"
    differing = [f"{n}/{d}" for n in ranks for d in (0, 1) if same_tree(reference, args.workdir / f"distcp-mpicons-{n}-{d}")]
    from mpi4py import MPI

    from mpicons.sample import SampleConfig, check_sample

    checked_tensors = check_sample(str(reference), SampleConfig(**described["config"]), MPI.COMM_SELF)  # type: ignore[arg-type]
    torch_agrees = same_tensors(reference, args.workdir / "distcp-torch") if torch_numbers else "not run"
    best = {name: min(times, key=lambda t: t.wall) for name, times in cases.items()}
    print(
        f"distcp sample: {described['tensors']} tensors, {dir_bytes(source) / 1e6:.0f} MB of .distcp files "
        f"({total / 1e6:.0f} MB read warm), best of {args.repeat}"
    )
    _table(best, stats, torch_numbers)
    print(f"mpicons outputs byte-identical at every rank count and sync mode: {not differing}; {checked_tensors} tensors checked")
    print(
        f"torch's output holds the same tensors: {torch_agrees is None}" + ("" if torch_agrees is None else f" ({torch_agrees})")
    )
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        numbers = {
            "machine": machine(),
            "sample": described,
            "mpiexec": MPIEXEC,
            "cases": {n: [t.__dict__ | {"log": ""} for t in ts] for n, ts in cases.items()},
            "stats": stats,
            "torch": torch_numbers,
            "identical": not differing,
            "torch_same_tensors": torch_agrees is None,
            "busy_runs": quiet.busy_runs,
        }
        args.json.write_text(json.dumps(numbers, indent=1))


def _table(best: dict[str, Timed], stats: dict[str, dict[str, Any]], torch_numbers: list[dict[str, Any]]) -> None:
    """Best wall time per case as multiples of cp, peak RSS per rank, and torch's own call time."""
    cp, cp_sync = best["cp -r"].wall, best["cp -r + sync"].wall
    print(f"{'case':<38}{'wall s':>8}{'x cp -r':>9}{'x cp+sync':>10}{'RSS/rank MB':>13}")
    for name, timed in best.items():
        print(f"{name:<38}{timed.wall:>8.3f}{timed.wall / cp:>9.2f}{timed.wall / cp_sync:>10.2f}{timed.rss_mb:>13.0f}")
    if torch_numbers:
        call = min(t["call_s"] for t in torch_numbers)
        errors = {t["error"] for t in torch_numbers if t["error"]}
        print(
            f"torch's calls alone (import excluded): {call:.2f} s, + {torch_numbers[0]['sync_s']:.2f} s to fsync"
            + (f"; errors: {errors}" if errors else "")
        )
        for name in best:
            if name.startswith("mpicons"):
                print(f"  {name}: {call / best[name].wall:.1f}x faster than torch's calls alone")


if __name__ == "__main__":
    main()
