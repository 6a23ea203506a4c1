"""What ``bench.py`` prints: the machine, the table of cases with their ratios to ``cp -r`` and
torch, the notes, and the four targets, each PASS/FAIL with its number."""

from __future__ import annotations

import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dense import Case, DenseResult
from harness import BIN, PYTHON, dir_bytes, machine


def machine_info(workdir: Path) -> dict[str, Any]:
    """What the numbers were measured on: ``harness.machine`` and the details this benchmark reports."""

    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()

    return {
        **machine(workdir),
        "nproc": sh("nproc"),
        "cpu": sh("lscpu | grep -E 'Model name|^CPU\\(s\\)|Thread|Hypervisor' | sed 's/  */ /g'"),
        "memory": sh("free -g | head -2"),
        "mpi": sh(f"{BIN / 'mpichversion'} 2>/dev/null | head -1") or "unknown",
        "torch": sh(f"{PYTHON} -c 'import torch; print(torch.__version__)' 2>/dev/null") or "not installed",
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(cases: list[Case], cp: dict[str, float], torch_call: float | None, torch_ckpt: str) -> str:
    """The report: seconds, ratios to cp (wall/wall, same checkpoint) and torch (call/call).

    ``x cp`` and ``x torch`` are this case's time divided by the reference's: below 1 is faster.
    ``worst s`` is the slowest repeat, to show how noisy the machine was.
    """
    head = (
        f"{'case':<40}{'ckpt':>6}{'wall s':>9}{'call s':>9}{'x cp':>7}{'x torch':>9}"
        f"{'RSS/rank MB':>13}{'bytes/rank max/mean MB':>24}{'max/mean':>10}{'worst s':>9}"
    )
    lines = [head, "-" * len(head)]
    for c in cases:
        ref = cp.get(c.checkpoint)
        x_cp = c.wall / ref if ref else None
        x_torch = c.call / torch_call if (torch_call and c.call is not None and c.checkpoint == torch_ckpt) else None
        per_rank = "-" if c.bytes_max is None or c.bytes_mean is None else f"{c.bytes_max / 1e6:.0f} / {c.bytes_mean / 1e6:.0f}"
        lines.append(
            f"{c.name:<40}{c.checkpoint:>6}{c.wall:>9.2f}{_fmt(c.call, '.2f'):>9}{_fmt(x_cp, '.2f'):>7}"
            f"{_fmt(x_torch, '.3f'):>9}{_fmt(c.rss_mb, '.0f'):>13}{per_rank:>24}{_fmt(c.imbalance, '.3f'):>10}"
            f"{max(c.walls):>9.2f}"
        )
    return "\n".join(lines)


def targets(cases: list[Case], cp: dict[str, float], torch_call: float | None, torch_ckpt: str) -> list[str]:
    """The four goals, each PASS/FAIL with its number (and 'info' lines that put them in context)."""

    def find(checkpoint: str, name: str) -> Case | None:
        return next((c for c in cases if c.checkpoint == checkpoint and c.name == name), None)

    out = []
    one = find(torch_ckpt, "mpicons -n 1 bytes/posix")
    if one and one.call and torch_call:
        speedup = torch_call / one.call
        out.append(
            f"{'PASS' if speedup >= 4 else 'FAIL'}: mpicons -n 1 vs torch consolidate_safetensors_files "
            f"(call): {speedup:.1f}x faster (target >= 4x)"
        )
        torch_one = next(c for c in cases if c.name == "torch consolidate_safetensors_files")
        durable = torch_one.detail["call_plus_fsync_s"] / one.call
        out.append(
            f"info: the same with torch's outputs fsynced as mpicons' are (call + fsync "
            f"{torch_one.detail['call_plus_fsync_s']:.2f} s): {durable:.1f}x faster"
        )
        one_ns = find(torch_ckpt, "mpicons -n 1 bytes/posix no-sync")
        if one_ns and one_ns.call:
            out.append(f"info: mpicons -n 1 --no-sync vs torch (neither fsyncs): {torch_call / one_ns.call:.1f}x faster")
    else:
        out.append("n/a: mpicons -n 1 vs torch (torch not measured)")
    two = find("full", "mpicons -n 2 bytes/posix")
    if two and cp.get("full"):
        ratio = two.wall / cp["full"]
        out.append(f"{'PASS' if ratio <= 1.5 else 'FAIL'}: mpicons -n 2 whole process / cp -r: {ratio:.2f} (target <= 1.5)")
    two_ns = find("full", "mpicons -n 2 bytes/posix no-sync")
    if two_ns and cp.get("full"):
        out.append(f"info: the same without fsync (--no-sync, as cp writes): {two_ns.wall / cp['full']:.2f}")
    sync_cp = find("full", "cp -r + sync")
    if two and sync_cp:
        out.append(f"info: mpicons -n 2 whole process / (cp -r + sync), both durable: {two.wall / sync_cp.wall:.2f}")
    rss = max((c.rss_mb or 0.0) for c in cases if c.name.startswith("mpicons"))
    out.append(f"{'PASS' if rss < 200 else 'FAIL'}: mpicons peak RSS per rank, max over all runs: {rss:.0f} MB (target < 200)")
    four = find("full", "mpicons -n 4 bytes/posix")
    if four and four.imbalance is not None:
        out.append(
            f"{'PASS' if four.imbalance <= 1.10 else 'FAIL'}: bytes/rank max/mean at 4 ranks (split bytes): "
            f"{four.imbalance:.3f} (target <= 1.10)"
        )
    return out


def report(result: DenseResult, repeat: int, busy_runs: list[str]) -> dict[str, Any]:
    """Print the table, the notes and the targets; returns them with every number, for ``--json``."""
    cases, cp = result.cases, result.cp
    notes = list(result.notes)
    sample_bytes = dir_bytes(result.sample)
    print()
    print(
        f"sample: {sample_bytes / 1e9:.3f} GB in {len(list(result.sample.iterdir()))} shard files; best of {repeat}; "
        f"'call' = the consolidation itself (mpicons: stats elapsed.max; torch: timed around the call)"
    )
    print(table(cases, cp, result.torch_call, result.torch_checkpoint))
    if busy_runs:
        notes.append(f"{len(busy_runs)} runs started while other processes kept the CPUs busy: {'; '.join(busy_runs)}")
    mpicons_runs = sum(len(c.walls) for c in cases if c.name.startswith("mpicons"))
    notes.append(
        f"all {mpicons_runs} mpicons outputs are byte-identical (cmp of every file) to the first one "
        f"of their checkpoint ({len(result.identical)} compared + the references)"
    )
    print()
    for line in notes:
        print(f"note: {line}")
    print()
    goals = targets(cases, cp, result.torch_call, result.torch_checkpoint)
    for line in goals:
        print(line)
    return {
        "sample_bytes": sample_bytes,
        "cases": [asdict(c) for c in cases],
        "cp_s": cp,
        "torch_call_s": result.torch_call,
        "torch_checkpoint": result.torch_checkpoint,
        "notes": notes,
        "targets": goals,
        "busy_runs": busy_runs,
    }
