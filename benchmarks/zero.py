#!/usr/bin/env python3
"""mpicons on a DeepSpeed ZeRO-3 checkpoint, at 1 and 2 ranks, against a plain consolidation of the same
tensors and against DeepSpeed's own ``zero_to_fp32.py``.

The input is the sample generator's ZeRO-3 kind (``mpicons.sample.write_zero_sample``,
``ZeroSampleConfig.sized``): a llama trained over 4 data-parallel ranks, saved as DeepSpeed saves it
(per rank a model-states file and an optimizer-states file holding Adam's two moments and the rank's
fp32 flat partition, every parameter cut into ``ceil(numel / 4)`` elements per rank, the padding
garbage). ``--size`` is the fp32 weights' bytes: the checkpoint on disk is about 3× that (the
moments), the output that. Interleaved rounds (the order of the cases rotates from round to round) of

    mpiexec -n N mpicons consolidate STEP OUT --no-sync               (zero-N: the ZeRO checkpoint)
    mpiexec -n N mpicons consolidate PLAIN OUT --no-sync              (plain-N: the same tensors, plain DCP)
    python zero_to_fp32.py RUN OUT --safe_serialization               (zero_to_fp32, where DeepSpeed is installed)

The plain baseline is the same fp32 tensors written by ``write_zero_plain`` as a DCP checkpoint in its
Hugging Face layout (``shard-*.safetensors``) of the same 4 training ranks, each holding its rows of
every parameter (FSDP's cut): the same bytes to read (the masters; the ZeRO files' moments are never
read), one piece per parameter per training rank as in ZeRO-3, the same bytes to write, and no
trainer layer (no archive scan, no unpickling, no flat-piece layout). So zero-N / plain-N is what
reading DeepSpeed's files costs over mpicons' plainest input. ``zero_to_fp32.py`` is one process
whatever N (it writes fp32 safetensors, as mpicons does by default); its output is checked too.

Reports each case's median wall time, the ratios zero-N / plain-N and zero_to_fp32 / zero-N (how many
times faster mpicons is), and the peak RSS per rank (mpicons' own ``peak_rss_mb.max``; for every case the
largest process as /usr/bin/time saw it).

    python benchmarks/zero.py                                   # ~2 GB of weights (6 GB on disk), 5 rounds
    python benchmarks/zero.py --size 200MB --repeat 1 --json benchmarks/work/zero.json   # a quick run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
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
    warm,
)

ENV_EXTRA = {"PYTHONPATH": str(REPO), "MPICONS_PROGRESS": "lines"}


def ensure_sample(workdir: Path, size: int, world: int, moments: bool) -> tuple[Path, Path, dict[str, Any]]:
    """Write the ZeRO-3 sample (run directory) and its plain twin once; reuse them while the config is
    unchanged. Returns (run directory, plain directory, the config as a dict)."""
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from mpicons.sample import ZeroSampleConfig, write_zero_plain, write_zero_sample

    config = ZeroSampleConfig.sized(size, world=world, moments=moments)
    name = f"zero3-{size}-{world}-{int(moments)}"
    run, plain, marker = workdir / name, workdir / f"{name}-plain", workdir / f"{name}.json"
    described = {"config": asdict(config)}
    if not (marker.exists() and json.loads(marker.read_text()) == described and plain.is_dir()):
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(plain, ignore_errors=True)
        began = time.perf_counter()
        write_zero_sample(run, config)
        write_zero_plain(plain, config)
        print(f"zero: wrote the sample and its plain twin in {time.perf_counter() - began:.1f} s")
        marker.write_text(json.dumps(described))
    return run, plain, described


def converter(workdir: Path) -> Path | None:
    """A copy of DeepSpeed's ``zero_to_fp32.py`` outside its package (its folder would shadow torch), as
    ``save_checkpoint`` copies it beside a checkpoint; None when DeepSpeed is not installed."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    script = Path(spec.origin).parent / "utils" / "zero_to_fp32.py"
    if not script.is_file():
        return None
    target = workdir / "zero_to_fp32.py"
    shutil.copy(script, target)
    return target


def check_outputs(workdir: Path, described: dict[str, Any], cases: list[str]) -> str:
    """mpicons' ZeRO output against the sample's weights; every other output against it, tensor by tensor."""
    from mpicons.core.safetensors_codec import read_header
    from mpicons.sample import ZeroSampleConfig, zero_expected_hf

    reference = workdir / f"out-{cases[0]}"
    files = sorted(reference.glob("*.safetensors"))
    entries = {}
    for file in files:
        header = read_header(file)
        entries.update({e.name: (file, e, header.data_start) for e in header.tensors})
    count = 0
    for name, value in zero_expected_hf(ZeroSampleConfig(**described["config"])):
        if name not in entries:
            raise SystemExit(f"zero: {reference} lacks {name}")
        file, entry, start = entries.pop(name)
        with open(file, "rb") as handle:
            handle.seek(start + entry.begin)
            if entry.dtype != "F32" or tuple(entry.shape) != value.shape or handle.read(value.nbytes) != value.tobytes():
                raise SystemExit(f"zero: {reference}: {name} differs from the sample's weights")
        count += 1
    if entries:
        raise SystemExit(f"zero: {reference} holds tensors the model does not: {sorted(entries)[:5]}")
    for name in cases[1:]:
        problem = same_tensors(reference, workdir / f"out-{name}")
        if problem:
            raise SystemExit(f"zero: out-{name} differs from out-{cases[0]}: {problem}")
    return f"{cases[0]}: {count} tensors equal the sample's fp32 weights; {', '.join(cases[1:])}: the same tensors"


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(2e9), help="fp32 weight bytes at least (default 2GB)")
    parser.add_argument("--ranks", default="1,2", help="mpicons rank counts, comma-separated (default 1,2)")
    parser.add_argument("--world", type=int, default=4, help="training (data-parallel) ranks of the checkpoint (default 4)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-moments", action="store_true", help="optimizer files without Adam's moments (1x on disk)")
    parser.add_argument("--no-plain", action="store_true", help="leave out the plain baseline")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave out zero_to_fp32.py even where it is installed")
    parser.add_argument("--sync", action="store_true", help="durable mpicons outputs (default --no-sync, as zero_to_fp32)")
    parser.add_argument("--no-check", action="store_true", help="skip checking the outputs' values")
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for an idle machine per run")
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "work" / "zero")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def _commands(args: argparse.Namespace, run_dir: Path, plain: Path, step: str, script: Path | None) -> dict[str, list[str]]:
    extra = [] if args.sync else ["--no-sync"]
    cases = {}
    for ranks in [int(r) for r in args.ranks.split(",")]:
        cases[f"zero-{ranks}"] = mpirun(ranks, [PYTHON, "-m", "mpicons", "consolidate", str(run_dir / step)])
        if not args.no_plain:
            cases[f"plain-{ranks}"] = mpirun(ranks, [PYTHON, "-m", "mpicons", "consolidate", str(plain)])
    for command in cases.values():
        command += ["OUT", "-q", "--stats-json", "STATS", *extra]
    if script is not None:
        cases["zero_to_fp32"] = [PYTHON, str(script), str(run_dir), "OUT", "--safe_serialization"]
    return cases


def main() -> None:
    import os

    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    run_dir, plain, described = ensure_sample(args.workdir, args.size, args.world, not args.no_moments)
    config = described["config"]
    step = f"global_step{config['step']}"
    script = None if args.no_deepspeed else converter(args.workdir)
    if script is None:
        print("zero: DeepSpeed is not installed here (or --no-deepspeed): no zero_to_fp32.py case")
    env = {**os.environ, **ENV_EXTRA}
    cases = _commands(args, run_dir, plain, step, script)
    quiet = Quiet(args.patience)
    runs: dict[str, list[Timed]] = {name: [] for name in cases}
    stats: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}

    def run(name: str) -> None:
        target, stats_file = args.workdir / f"out-{name}", args.workdir / f"stats-{name}.json"
        quiesce(target)
        warm(plain if name.startswith("plain") else run_dir / step)
        quiet.wait(name)
        command = [str(target) if a == "OUT" else str(stats_file) if a == "STATS" else a for a in cases[name]]
        runs[name].append(checked(run_timed(command, env=env), name))
        if stats_file.exists() and not name.startswith("zero_to"):
            stats[name].append(json.loads(stats_file.read_text()))

    names = list(cases)
    for round_ in range(args.repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            run(name)
    checks = "not checked" if args.no_check else check_outputs(args.workdir, described, names)
    on_disk = dir_bytes(run_dir / step)
    print(
        f"ZeRO-3 sample (llama): hidden {config['hidden']}, ffn {config['ffn']}, {config['layers']} layers, vocab "
        f"{config['vocab']}, {config['world']} training ranks; {on_disk / 1e9:.2f} GB on disk in {step} "
        f"({'with' if config['moments'] else 'without'} Adam moments), plain twin {dir_bytes(plain) / 1e9:.2f} GB; "
        f"{args.repeat} interleaved rounds" + ("" if args.sync else ", mpicons --no-sync")
    )
    medians = _table(runs, stats)
    ratios = _ratios(medians)
    for label, value in ratios.items():
        print(f"{label}: {value:.2f}x")
    print(f"outputs: {checks}")
    if quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(quiet.busy_runs))
    if args.json:
        numbers = {
            "machine": machine(args.workdir),
            "sample": described,
            "bytes_on_disk": on_disk,
            "mpiexec": MPIEXEC,
            "sync": args.sync,
            "zero_to_fp32": str(script) if script else None,
            "cases": {n: [t.__dict__ | {"log": ""} for t in ts] for n, ts in runs.items()},
            "stats": stats,
            "medians": medians,
            "ratios": ratios,
            "checks": checks,
            "busy_runs": quiet.busy_runs,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(numbers, indent=1))


def _ratios(medians: dict[str, float]) -> dict[str, float]:
    ratios = {}
    for name, wall in medians.items():
        if name.startswith("zero-") and f"plain-{name[5:]}" in medians:
            ratios[f"{name} / plain-{name[5:]} (medians)"] = wall / medians[f"plain-{name[5:]}"]
    for name, wall in medians.items():
        if name.startswith("zero-") and "zero_to_fp32" in medians:
            ratios[f"zero_to_fp32 / {name} (medians: mpicons is this many times faster)"] = medians["zero_to_fp32"] / wall
    return ratios


def _table(runs: dict[str, list[Timed]], stats: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Median, best and worst wall time per case, peak RSS (mpicons' own per rank, and the largest process
    as /usr/bin/time saw it), median slowest-rank phase times, bytes written."""
    columns = ("scan", "plan", "write")
    print(
        f"{'case':<14}{'median s':>10}{'best s':>9}{'worst s':>9}{'RSS/rank MB':>13}{'time RSS MB':>13}"
        + "".join(f"{c:>8}" for c in columns)
        + f"{'GB out':>8}"
    )
    medians = {}
    for name, timed in runs.items():
        walls = [t.wall for t in timed]
        medians[name] = statistics.median(walls)
        mine = stats.get(name) or []
        phases = [
            f"{statistics.median(s['phases'][p]['max'] for s in mine):>8.2f}"
            if mine and all(p in s.get("phases", {}) for s in mine)
            else f"{'':>8}"
            for p in columns
        ]
        own = max((s.get("peak_rss_mb", {}).get("max", 0.0) for s in mine), default=0.0)
        written = mine[-1].get("total_bytes", 0) / 1e9 if mine else None
        print(
            f"{name:<14}{medians[name]:>10.3f}{min(walls):>9.3f}{max(walls):>9.3f}"
            + (f"{own:>13.0f}" if mine else f"{'-':>13}")
            + f"{max(t.rss_mb for t in timed):>13.0f}"
            + "".join(phases)
            + (f"{written:>8.2f}" if written is not None else f"{'':>8}")
        )
    return medians


if __name__ == "__main__":
    main()
