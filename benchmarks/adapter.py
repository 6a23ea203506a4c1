#!/usr/bin/env python3
"""``--adapter torchtitan`` against a plain consolidation of the same torchtitan-native checkpoint.

The input is the sample generator's torchtitan kind (``SampleConfig.torchtitan``): a llama3 (or, with
``--experts``, a qwen3_moe) model under torchtitan's own names in DCP's default format, cut by FSDP2
over 3 training ranks inside TP over 2, so q/k pieces end inside heads and the rotary permutation
crosses pieces; its Hugging Face assets are written beside it. Interleaved rounds (the order of the two
cases alternates from round to round) of

    mpiexec -n N mpicons consolidate NATIVE OUT                                         (plain)
    mpiexec -n N mpicons consolidate NATIVE OUT --adapter torchtitan --hf-assets ASSETS  (adapter)

report each case's median wall time and the ratio adapter/plain (target ≤ 1.2×). Both write the same
tensor bytes: with ``--optimizer`` the plain run excludes ``optimizer.*``, which the adapter skips.
Outputs are checked afterwards: the plain one against the sample's values, the adapter's against
torchtitan's ``to_hf`` of them (``mpicons.frontends.sample.torchtitan_to_hf``).

    python benchmarks/adapter.py                          # ~2 GB, 2 ranks, 5 rounds, in /tmp
    python benchmarks/adapter.py --size 50MB --repeat 1   # a quick run
    python benchmarks/adapter.py --experts 16 --optimizer --workdir /scratch/bench --json adapter.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
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
    warm,
)

ENV = {**os.environ, "PYTHONPATH": str(REPO), "MPICONS_PROGRESS": "lines"}
TARGET = 1.2


def ensure_sample(workdir: Path, size: int, experts: int, optimizer: bool) -> tuple[Path, Path, dict[str, Any]]:
    """Write the torchtitan sample and its assets once; reuse them while the config is unchanged."""
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from mpicons.sample import SampleConfig, tensor_specs, write_sample

    config = SampleConfig.torchtitan(size, experts=experts, optimizer=optimizer)
    name = f"torchtitan-{size}-{experts}-{int(optimizer)}"
    directory, assets = workdir / name, workdir / f"{name}-hf-assets"
    marker = workdir / f"{name}.json"
    described = {"config": asdict(config), "tensors": len(tensor_specs(config))}
    if not (marker.exists() and json.loads(marker.read_text()) == described and assets.is_dir()):
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(assets, ignore_errors=True)
        began = time.perf_counter()
        write_sample(directory, config, assets_dir=assets)
        print(f"adapter: wrote the sample in {time.perf_counter() - began:.1f} s")
        marker.write_text(json.dumps(described))
    return directory, assets, described


def check_adapter_output(output: Path, described: dict[str, Any]) -> int:
    """Every tensor of the adapter's output equals torchtitan's ``to_hf`` of the sample's value, one
    source tensor at a time; returns how many were compared, raises SystemExit on the first that differs."""
    import numpy as np

    from mpicons.core.safetensors_codec import read_header
    from mpicons.frontends.sample import hf_config, torchtitan_to_hf
    from mpicons.sample import SampleConfig, full_tensor, tensor_specs

    config = SampleConfig(**described["config"])
    hf = hf_config(config)
    index = output / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    headers: dict[Path, Any] = {}
    compared = 0
    for name, dtype, shape, _, _ in tensor_specs(config):
        for hf_name, value in torchtitan_to_hf({name: full_tensor(config, name, dtype, shape)}, hf).items():
            path = output / (weight_map[hf_name] if weight_map else "model.safetensors")
            header = headers.get(path) or headers.setdefault(path, read_header(path))
            entry = next((e for e in header.tensors if e.name == hf_name), None)
            if entry is None:
                raise SystemExit(f"adapter: {path} lacks {hf_name}")
            with open(path, "rb") as handle:
                handle.seek(header.data_start + entry.begin)
                data = handle.read(entry.end - entry.begin)
            if entry.shape != value.shape or data != np.ascontiguousarray(value).tobytes():
                raise SystemExit(f"adapter: {path}: {hf_name} differs from to_hf of {name}")
            compared += 1
    expected = compared
    found = len(weight_map) if weight_map else len(read_header(output / "model.safetensors").tensors)
    if found != expected:
        raise SystemExit(f"adapter: the output holds {found} tensors, to_hf makes {expected}")
    return compared


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(2e9), help="model bytes of the sample (default 2GB)")
    parser.add_argument("--ranks", type=int, default=2, help="mpicons ranks (default 2)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--experts", type=int, default=0, help="qwen3_moe with this many experts per layer (default: llama3)")
    parser.add_argument("--optimizer", action="store_true", help="with exp_avg optimizer state (plain excludes it)")
    parser.add_argument("--sync", action="store_true", help="durable outputs (default --no-sync: the engine's work only)")
    parser.add_argument("--no-check", action="store_true", help="skip checking the outputs' values")
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for an idle machine per run")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mpicons-bench-adapter")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source, assets, described = ensure_sample(args.workdir, args.size, args.experts, args.optimizer)
    quiet = Quiet(args.patience)
    total = warm(source)
    extra = [] if args.sync else ["--no-sync"]
    cases = {
        "plain": ["--exclude", "optimizer.*"] if args.optimizer else [],
        "adapter": ["--adapter", "torchtitan", "--hf-assets", str(assets)],
    }
    runs: dict[str, list[Timed]] = {name: [] for name in cases}
    stats: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}

    def run(name: str) -> None:
        target = args.workdir / f"out-{name}"
        stats_file = args.workdir / f"stats-{name}.json"
        quiesce(target)
        warm(source)
        quiet.wait(name)
        command = [PYTHON, "-m", "mpicons", "consolidate", str(source), str(target), "-q", "--stats-json", str(stats_file)]
        timed = checked(run_timed(mpirun(args.ranks, command + cases[name] + extra), env=ENV), f"mpicons {name}")
        runs[name].append(timed)
        stats[name].append(json.loads(stats_file.read_text()))

    for round_ in range(args.repeat):
        for name in list(cases) if round_ % 2 == 0 else list(reversed(cases)):
            run(name)
    checks = "not checked"
    if not args.no_check:
        from mpi4py import MPI

        from mpicons.sample import SampleConfig, check_sample

        model = None if not args.optimizer else (lambda name, dtype: not name.startswith("optimizer."))
        plain = check_sample(str(args.workdir / "out-plain"), SampleConfig(**described["config"]), MPI.COMM_SELF, model)
        adapted = check_adapter_output(args.workdir / "out-adapter", described)
        checks = f"{plain} plain tensors equal the sample's values, {adapted} adapter tensors equal to_hf's"
    config = described["config"]
    family = f"qwen3_moe, {config['experts']} experts" if config["experts"] else "llama3"
    print(
        f"torchtitan sample ({family}): hidden {config['hidden']}, {config['layers']} layers, {described['tensors']} "
        f"tensors, {dir_bytes(source) / 1e6:.0f} MB of .distcp files ({total / 1e6:.0f} MB read warm), "
        f"{config['dp'] * config['tp']} training ranks; {args.ranks} ranks, {args.repeat} interleaved rounds"
        + ("" if args.sync else ", --no-sync")
    )
    medians = _table(runs, stats)
    ratio = medians["adapter"] / medians["plain"]
    print(f"adapter / plain (medians): {ratio:.2f}x ({'PASS' if ratio <= TARGET else 'FAIL'}: target <= {TARGET}x)")
    print(f"outputs: {checks}")
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        numbers = {
            "machine": machine(args.workdir),
            "sample": described,
            "ranks": args.ranks,
            "mpiexec": MPIEXEC,
            "sync": args.sync,
            "cases": {n: [t.__dict__ | {"log": ""} for t in ts] for n, ts in runs.items()},
            "stats": stats,
            "medians": medians,
            "ratio": ratio,
            "checks": checks,
            "busy_runs": quiet.busy_runs,
        }
        args.json.write_text(json.dumps(numbers, indent=1))


def _table(runs: dict[str, list[Timed]], stats: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Median, best and worst wall time per case, peak RSS per rank, and median slowest-rank phase times."""
    columns = ("scan", "plan", "write", "GB out")
    print(f"{'case':<10}{'median s':>10}{'best s':>9}{'worst s':>9}{'RSS/rank MB':>13}" + "".join(f"{c:>8}" for c in columns))
    medians = {}
    for name, timed in runs.items():
        walls = [t.wall for t in timed]
        medians[name] = statistics.median(walls)
        phases = [
            f"{statistics.median(s['phases'][p]['max'] for s in stats[name]):>8.2f}"
            if all(p in s.get("phases", {}) for s in stats[name])
            else f"{'':>8}"
            for p in ("scan", "plan", "write")
        ]
        written = stats[name][-1].get("total_bytes", 0) if stats[name] else 0
        print(
            f"{name:<10}{medians[name]:>10.3f}{min(walls):>9.3f}{max(walls):>9.3f}{max(t.rss_mb for t in timed):>13.0f}"
            + "".join(phases)
            + f"{written / 1e9:>8.2f}"
        )
    return medians


if __name__ == "__main__":
    main()
