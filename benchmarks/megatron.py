#!/usr/bin/env python3
"""``--adapter megatron`` against a plain consolidation of the same Megatron-LM ``torch_dist`` checkpoint.

The input is the sample generator's Megatron kind (``mpicons.sample.write_megatron_sample``,
``MegatronSampleConfig.sized``): a llama saved as Megatron-LM saves it at TP 2 × PP 2 (layers stacked
on a leading axis, q/k/v fused by query group, ``linear_fc1`` as [gate; up] in two chunks per TP rank,
the vocabulary padded to 128 × TP, replicated norms written once, ``_extra_state`` bytes items,
``common.pt`` and Megatron's ``all_local_plans`` in ``.metadata``), with its Hugging Face config beside
it. Interleaved rounds (the order of the two cases alternates from round to round) of

    mpiexec -n N mpicons consolidate ITER OUT                                       (plain)
    mpiexec -n N mpicons consolidate ITER OUT --adapter megatron --hf-assets ASSETS  (adapter)

report each case's median wall time and the ratio adapter/plain (target ≤ 1.2×) and the peak RSS per
rank (mpicons' own ``peak_rss_mb.max``). The plain run writes Megatron's names and layouts, the adapter
run Hugging Face's, both the same bytes less the padding rows the adapter crops. Outputs are checked
afterwards: the plain one against the generator's on-disk values (``megatron_values``), the adapter's
against the Hugging Face tensors the sample was made from (``megatron_expected_hf``).

    python benchmarks/megatron.py                           # ~2.2 GB, 2 ranks, 5 rounds, in /tmp
    python benchmarks/megatron.py --size 100MB --repeat 1   # a quick run
    python benchmarks/megatron.py --no-plans --plain-only   # the plain half, readable without Megatron support
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
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


def ensure_sample(workdir: Path, size: int, plans: bool) -> tuple[Path, Path, dict[str, Any]]:
    """Write the Megatron sample (run directory) and its HF assets once; reuse them while the config is
    unchanged. Returns (run directory, assets directory, the config as a dict)."""
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from mpicons.sample import MegatronSampleConfig, write_megatron_sample

    config = MegatronSampleConfig.sized(size, plans=plans)
    name = f"megatron-{size}-{int(plans)}"
    run, assets, marker = workdir / name, workdir / f"{name}-hf-assets", workdir / f"{name}.json"
    described = {"config": asdict(config)}
    if not (marker.exists() and json.loads(marker.read_text()) == described and assets.is_dir()):
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(assets, ignore_errors=True)
        began = time.perf_counter()
        write_megatron_sample(run, config, assets_dir=assets)
        print(f"megatron: wrote the sample in {time.perf_counter() - began:.1f} s")
        marker.write_text(json.dumps(described))
    return run, assets, described


class Output:
    """Reads tensors of a consolidated directory (index or single file) by name, or a leading-axis slice."""

    def __init__(self, directory: Path) -> None:
        from mpicons.core.safetensors_codec import read_header

        index = directory / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
        self.entries: dict[str, tuple[Path, Any, int]] = {}
        for file in files:
            header = read_header(directory / file)
            for entry in header.tensors:
                self.entries[entry.name] = (directory / file, entry, header.data_start)

    def read(self, name: str, part: int | None = None, parts: int = 1) -> tuple[str, tuple[int, ...], bytes]:
        """(dtype, shape, bytes) of ``name``; with ``part``, of index ``part`` of its leading axis (``parts`` long)."""
        if name not in self.entries:
            raise SystemExit(f"megatron: the output lacks {name}")
        path, entry, start = self.entries[name]
        length = entry.end - entry.begin
        offset = start + entry.begin
        shape = tuple(entry.shape)
        if part is not None:
            length //= parts
            offset += part * length
            shape = shape[1:]
        with open(path, "rb") as handle:
            handle.seek(offset)
            return entry.dtype, shape, handle.read(length)


def _compare(output: Path, values: Iterator[tuple[str, int | None, Any]], layers: int, what: str) -> int:
    """Every (name, layer, value) equals the output's tensor (or its layer slice); returns how many were
    compared, raises SystemExit on the first that differs or on tensors the output holds beyond them."""
    out = Output(output)
    names, compared = set(), 0
    for name, layer, value in values:
        dtype, shape, data = out.read(name, layer, layers)
        if dtype != "BF16" or shape != value.shape or data != value.tobytes():
            where = name if layer is None else f"{name}[{layer}]"
            raise SystemExit(f"megatron: {output}: {where} is {dtype}{list(shape)}, differs from {what}")
        names.add(name)
        compared += 1
    if set(out.entries) != names:
        raise SystemExit(f"megatron: {output} holds tensors beyond {what}: {sorted(set(out.entries) - names)[:5]}")
    return compared


def check_outputs(workdir: Path, described: dict[str, Any], cases: list[str]) -> str:
    from mpicons.sample import MegatronSampleConfig, megatron_expected_hf, megatron_values

    config = MegatronSampleConfig(**described["config"])
    found = []
    if "plain" in cases:
        count = _compare(workdir / "out-plain", megatron_values(config), config.layers, "the checkpoint's values")
        found.append(f"plain: {count} tensors and layer slices equal the checkpoint's values")
    if "adapter" in cases:
        hf = ((name, None, value) for name, value in megatron_expected_hf(config))
        count = _compare(workdir / "out-adapter", hf, 1, "the Hugging Face model the sample was made from")
        if not (workdir / "out-adapter" / "config.json").is_file():
            raise SystemExit("megatron: the adapter's output has no config.json beside the weights")
        found.append(f"adapter: {count} tensors equal the Hugging Face model's")
    return "; ".join(found)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(2e9), help="checkpoint bytes at least (default 2GB)")
    parser.add_argument("--ranks", type=int, default=2, help="mpicons ranks (default 2)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--input", choices=("iter", "run"), default="iter", help="the iter_NNNNNNN directory (default) or the run directory"
    )
    parser.add_argument("--no-plans", action="store_true", help="write .metadata without Megatron's all_local_plans")
    parser.add_argument("--plain-only", action="store_true", help="only the plain case (no ratio)")
    parser.add_argument(
        "--plain-options", default="--adapter none", help="options of the plain run (default: the saved names and layouts)"
    )
    parser.add_argument("--sync", action="store_true", help="durable outputs (default --no-sync: the engine's work only)")
    parser.add_argument("--no-check", action="store_true", help="skip checking the outputs' values")
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for an idle machine per run")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mpicons-bench-megatron")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    run_dir, assets, described = ensure_sample(args.workdir, args.size, not args.no_plans)
    from mpicons.sample import MegatronSampleConfig

    config = described["config"]
    padded_vocab = MegatronSampleConfig(**config).padded_vocab
    iteration_dir = run_dir / f"iter_{config['iteration']:07d}"
    source = iteration_dir if args.input == "iter" else run_dir
    quiet = Quiet(args.patience)
    total = warm(iteration_dir)
    extra = [] if args.sync else ["--no-sync"]
    cases = {"plain": shlex.split(args.plain_options), "adapter": ["--adapter", "megatron", "--hf-assets", str(assets)]}
    if args.plain_only:
        del cases["adapter"]
    runs: dict[str, list[Timed]] = {name: [] for name in cases}
    stats: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}

    def run(name: str) -> None:
        target = args.workdir / f"out-{name}"
        stats_file = args.workdir / f"stats-{name}.json"
        quiesce(target)
        warm(iteration_dir)
        quiet.wait(name)
        command = [PYTHON, "-m", "mpicons", "consolidate", str(source), str(target), "-q", "--stats-json", str(stats_file)]
        timed = checked(run_timed(mpirun(args.ranks, command + cases[name] + extra), env=ENV), f"mpicons {name}")
        report = json.loads(stats_file.read_text())
        if name == "plain" and report.get("adapter"):
            raise SystemExit(f"megatron: the plain run was adapted ({report['adapter']}): turn that off with --plain-options")
        runs[name].append(timed)
        stats[name].append(report)

    for round_ in range(args.repeat):
        for name in list(cases) if round_ % 2 == 0 else list(reversed(cases)):
            run(name)
    checks = "not checked" if args.no_check else check_outputs(args.workdir, described, list(cases))
    print(
        f"Megatron sample (llama): hidden {config['hidden']}, ffn {config['ffn']}, {config['layers']} layers, "
        f"{config['heads']} heads in {config['query_groups']} query groups, vocab {config['vocab']} padded to "
        f"{padded_vocab}, "
        f"TP {config['tp']} x PP {config['pp']}, {dir_bytes(iteration_dir) / 1e6:.0f} MB in {iteration_dir.name} "
        f"({total / 1e6:.0f} MB read warm); {args.ranks} ranks, {args.repeat} interleaved rounds"
        + ("" if args.sync else ", --no-sync")
        + ("" if config["plans"] else ", no all_local_plans")
    )
    medians = _table(runs, stats)
    ratio = None
    if "adapter" in medians:
        ratio = medians["adapter"] / medians["plain"]
        print(f"adapter / plain (medians): {ratio:.2f}x ({'PASS' if ratio <= TARGET else 'FAIL'}: target <= {TARGET}x)")
    print(f"outputs: {checks}")
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        numbers = {
            "machine": machine(args.workdir),
            "sample": described,
            "input": str(source),
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
    """Median, best and worst wall time per case, peak RSS per rank (mpicons' own, and of the largest
    process as /usr/bin/time saw it), median slowest-rank phase times, bytes written."""
    columns = ("scan", "plan", "write", "GB out")
    print(
        f"{'case':<10}{'median s':>10}{'best s':>9}{'worst s':>9}{'RSS/rank MB':>13}{'time RSS MB':>13}"
        + "".join(f"{c:>8}" for c in columns)
    )
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
        own = max((s.get("peak_rss_mb", {}).get("max", 0.0) for s in stats[name]), default=0.0)
        written = stats[name][-1].get("total_bytes", 0) if stats[name] else 0
        print(
            f"{name:<10}{medians[name]:>10.3f}{min(walls):>9.3f}{max(walls):>9.3f}{own:>13.0f}"
            f"{max(t.rss_mb for t in timed):>13.0f}" + "".join(phases) + f"{written / 1e9:>8.2f}"
        )
    return medians


if __name__ == "__main__":
    main()
