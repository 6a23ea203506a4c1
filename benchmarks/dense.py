"""The dense-sample cases of ``bench.py``: ``cp -r`` (with and without ``sync``), the mpicons
matrix over ranks, ``--split`` and ``--io`` (and ``--no-sync`` rows), and torch's consolidators.

Every case is best of ``Context.repeat`` runs, each from a warm page cache, after the previous
run's writeback, on an idle machine (``harness.Quiet``). No mpicons imports at module level: the
driver first puts the snapshot of the sources under test on ``sys.path``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import BIN, PYTHON, Context, Timed, checked, mpirun, quiesce, same_tensors, same_tree, warm

MPICONS = [str(BIN / "mpicons")] if (BIN / "mpicons").exists() else [PYTHON, "-m", "mpicons"]
WORKERS = Path(__file__).resolve().parent / "workers"
SAMPLE_RANKS = 2  # ranks used to write the sample checkpoints (generation is not timed)
NO_SYNC = ("--no-sync",)


@dataclass
class Case:
    """Best-of-N result of one benchmark case (seconds are minima over the repeats)."""

    name: str
    checkpoint: str
    wall: float
    call: float | None = None  # the consolidation itself, measured inside the process
    rss_mb: float | None = None  # peak RSS of the largest process (per rank), max over repeats
    bytes_max: float | None = None
    bytes_mean: float | None = None
    imbalance: float | None = None
    ranks: int = 1
    walls: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Workspace:
    """Where the cases write: the output directory (removed before each run), mpicons' stats files,
    and the record of mpicons outputs found byte-identical to the first one of their checkpoint."""

    out: Path
    stats_dir: Path
    identical: list[str] = field(default_factory=list)


@dataclass
class DenseResult:
    """Everything the report needs."""

    sample: Path  # the full sample
    cases: list[Case]
    identical: list[str]
    notes: list[str]
    torch_call: float | None  # torch consolidate_safetensors_files' call, the reference of 'x torch'
    torch_checkpoint: str  # the checkpoint torch ran on: 'full', or 'float' when it cannot read the full one

    @property
    def cp(self) -> dict[str, float]:
        """``cp -r`` wall seconds per checkpoint, the reference of 'x cp'."""
        return {c.checkpoint: c.wall for c in self.cases if c.name == "cp -r"}


# ---------------------------------------------------------------- sample checkpoints


def sample_mapping(size: int, float_only: bool) -> dict[str, int]:
    """torch's ``fqn_to_index_mapping`` for the sample: tensor name → output file index from 1."""
    from mpicons.core.safetensors_codec import DTYPE_BY_NAME
    from mpicons.sample import SampleConfig, tensor_specs

    specs = tensor_specs(SampleConfig.sized(size))
    return {name: index for name, dtype, _, _, index in specs if not float_only or DTYPE_BY_NAME[dtype].is_float}


def ensure_sample(ctx: Context, workdir: Path, size: int, float_only: bool) -> Path:
    """Build the sample checkpoint once (``workers/sample.py``); reuse it while its config and files are unchanged."""
    from mpicons.sample import SampleConfig

    config = asdict(SampleConfig.sized(size))
    name = "sharded-float" if float_only else "sharded"
    directory = workdir / name
    marker = workdir / f"{name}.json"
    if marker.exists() and directory.is_dir():
        saved = json.loads(marker.read_text())
        files = {p.name: p.stat().st_size for p in directory.iterdir()}
        if saved.get("config") == config and saved.get("files") == files:
            return directory
    shutil.rmtree(directory, ignore_errors=True)
    marker.unlink(missing_ok=True)
    began = time.perf_counter()
    worker = [PYTHON, str(WORKERS / "sample.py"), str(directory), str(size), *(["--float-only"] if float_only else [])]
    checked(ctx.run(mpirun(SAMPLE_RANKS, worker)), f"writing the {name} sample")
    files = {p.name: p.stat().st_size for p in directory.iterdir()}
    marker.write_text(json.dumps({"config": config, "files": files}, indent=1))
    print(
        f"bench: wrote {directory} ({sum(files.values()) / 1e9:.3f} GB, {len(files)} files) "
        f"in {time.perf_counter() - began:.1f} s"
    )
    return directory


# ---------------------------------------------------------------- cp -r and mpicons


def bench_cp(ctx: Context, ws: Workspace, src: Path, checkpoint: str, sync: bool) -> Case:
    """``cp -r`` of the shard directory, from a warm page cache; ``sync`` adds an fsync of the copies.

    mpicons fsyncs its outputs before it reports success and cp does not, so the synced
    variant shows how much of any gap is durability rather than copying.
    """
    case = Case("cp -r + sync" if sync else "cp -r", checkpoint, 0.0)
    script = 'cp -r "$1" "$2" && sync "$2"/*' if sync else None
    for _ in range(ctx.repeat):
        warm(src)
        quiesce(ws.out)
        ctx.quiet.wait(case.name)
        cmd = ["sh", "-c", script, "sh", str(src), str(ws.out)] if script else ["cp", "-r", str(src), str(ws.out)]
        timed = checked(ctx.run(cmd), "cp -r")
        case.walls.append(timed.wall)
        case.rss_mb = max(case.rss_mb or 0.0, timed.rss_mb)
    quiesce(ws.out)
    case.wall = min(case.walls)
    return case


def bench_mpicons(
    ctx: Context,
    ws: Workspace,
    src: Path,
    reference: Path,
    checkpoint: str,
    ranks: int,
    split: str,
    io: str,
    extra: Sequence[str] = (),
) -> Case:
    """``mpicons consolidate`` under ``mpiexec -n ranks``; each output is cmp'd against the first one.

    The first output of a checkpoint becomes its ``reference`` (renamed, not copied).
    """
    suffix = "".join(" " + a.lstrip("-") for a in extra)
    case = Case(f"mpicons -n {ranks} {split}/{io}{suffix}", checkpoint, 0.0, ranks=ranks)
    stats_file = ws.stats_dir / f"{checkpoint}-{ranks}-{split}-{io}{suffix.replace(' ', '-')}.json"
    best_call = float("inf")
    for _ in range(ctx.repeat):
        warm(src)
        quiesce(ws.out)
        ctx.quiet.wait(case.name)
        stats_file.unlink(missing_ok=True)
        cmd = mpirun(
            ranks,
            [
                *MPICONS,
                "consolidate",
                str(src),
                str(ws.out),
                "--force",
                "--stats-json",
                str(stats_file),
                "-q",
                "--split",
                split,
                "--io",
                io,
                *extra,
            ],
        )
        timed = checked(ctx.run(cmd), case.name)
        stats = json.loads(stats_file.read_text())
        case.walls.append(timed.wall)
        call = stats["elapsed"]["max"]
        case.calls.append(call)
        case.rss_mb = max(case.rss_mb or 0.0, stats["peak_rss_mb"]["max"], timed.rss_mb)
        if call < best_call:
            best_call = call
            case.detail = {
                "phases_max": {k: v["max"] for k, v in stats["phases"].items()},
                "bytes_per_rank": stats["bytes_per_rank"],
                "imbalance": stats["imbalance"],
                "peak_rss_mb_stats": stats["peak_rss_mb"]["max"],
                "peak_rss_mb_tree": timed.rss_mb,
                "total_bytes": stats["total_bytes"],
            }
        if not reference.exists():
            ws.out.rename(reference)
        else:
            problem = same_tree(reference, ws.out)
            if problem:
                raise SystemExit(f"bench: {case.name} output differs from the first mpicons output: {problem}")
            ws.identical.append(f"{checkpoint}: {case.name}")
    quiesce(ws.out)
    case.wall, case.call = min(case.walls), min(case.calls)
    spread = case.detail["bytes_per_rank"]
    case.bytes_max, case.bytes_mean, case.imbalance = spread["max"], spread["mean"], case.detail["imbalance"]
    return case


def mpicons_has(ctx: Context, option: str) -> bool:
    """Whether this mpicons' consolidate command knows ``option`` (newer options are benchmarked when present)."""
    text = subprocess.run([*MPICONS, "consolidate", "--help"], capture_output=True, text=True, env=ctx.env, cwd=ctx.cwd).stdout
    return option in text


# ---------------------------------------------------------------- torch


def torch_available(ctx: Context) -> bool:
    """Whether torch imports in the benchmark's interpreter (checked in a child: torch stays optional)."""
    return (
        subprocess.run(
            [PYTHON, "-c", "import torch.distributed.checkpoint._consolidate_hf_safetensors"], capture_output=True, cwd=ctx.cwd
        ).returncode
        == 0
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_once(
    ctx: Context, src: Path, out: Path, mapping_file: Path, ranks: int, threads: int
) -> tuple[Timed, dict[str, Any]]:
    """One run of torch's consolidator (``workers/torch_consolidate.py``): 1 process, or ``ranks`` gloo ranks under mpiexec."""
    result_file = out.parent / f"torch-result-{ranks}.json"
    result_file.unlink(missing_ok=True)
    args = [
        PYTHON,
        str(WORKERS / "torch_consolidate.py"),
        str(src),
        str(out),
        str(mapping_file),
        str(result_file),
        "--threads",
        str(threads),
    ]
    env = dict(ctx.env)
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
        cmd = mpirun(ranks, [*args, "--every-rank"])
    else:
        cmd = args
    timed = ctx.run(cmd, env=env)
    result = json.loads(result_file.read_text()) if result_file.exists() else {"error": timed.log[-2000:]}
    return timed, result


def bench_torch(
    ctx: Context, ws: Workspace, src: Path, mapping_file: Path, reference: Path, checkpoint: str, ranks: int, threads: int
) -> Case:
    """torch's consolidate_safetensors_files (1 process) or ..._on_every_rank (gloo, ``ranks`` ranks)."""
    label = "consolidate_safetensors_files" if ranks == 1 else f"..._on_every_rank -n {ranks}"
    case = Case(f"torch {label}", checkpoint, 0.0, ranks=ranks)
    durable = []
    for _ in range(ctx.repeat):
        warm(src)
        quiesce(ws.out)
        ws.out.mkdir(parents=True)
        ctx.quiet.wait(case.name)
        timed, result = run_torch_once(ctx, src, ws.out, mapping_file, ranks, threads)
        if timed.code != 0 or result.get("error"):
            raise SystemExit(f"bench: {case.name} failed: {result.get('error') or timed.log[-3000:]}")
        case.walls.append(timed.wall)
        case.calls.append(result["call_s"])
        durable.append(result["call_s"] + result["sync_s"])
        case.rss_mb = max(case.rss_mb or 0.0, result["peak_rss_mb"], timed.rss_mb)
        case.detail = {"import_s": result["import_s"], "peak_rss_mb_tree": timed.rss_mb, "threads": threads}
    case.detail["call_plus_fsync_s"] = min(durable)
    case.detail["calls_plus_fsync_s"] = durable
    problem = same_tensors(reference, ws.out)
    case.detail["same_tensors_as_mpicons"] = problem is None
    if problem:  # a benchmark of outputs that differ measures nothing
        raise SystemExit(f"bench: {case.name}: output tensors differ from mpicons': {problem}")
    quiesce(ws.out)
    case.wall, case.call = min(case.walls), min(case.calls)
    return case


def torch_cases(
    ctx: Context,
    ws: Workspace,
    workdir: Path,
    full: Path,
    size: int,
    threads: int,
    no_sync: bool,
    cases: list[Case],
    notes: list[str],
) -> tuple[float | None, str]:
    """torch's two consolidators, and what they need: appends to ``cases`` and ``notes``.

    torch's consolidator is tried on the full sample once; it cannot read int/bool tensors, and
    when it fails, torch and a few mpicons rows (checkpoint 'float') run on the float-only variant.
    Returns (torch consolidate_safetensors_files' call seconds, the checkpoint torch ran on).
    """
    mapping_file = workdir / "mapping-full.json"
    mapping_file.write_text(json.dumps(sample_mapping(size, float_only=False)))
    warm(full)
    quiesce(ws.out)
    ws.out.mkdir(parents=True)
    timed, result = run_torch_once(ctx, full, ws.out, mapping_file, 1, threads)
    quiesce(ws.out)
    checkpoint, src = "full", full
    if timed.code != 0 or result.get("error"):
        error = (result.get("error") or timed.log).strip().splitlines()[-1]
        notes.append(
            f"torch on the full sample failed ({error}); torch and the mpicons rows marked 'float' use a "
            "float-only variant of the sample (the same tensors without its int/bool buffers)"
        )
        checkpoint, src = "float", ensure_sample(ctx, workdir, size, float_only=True)
        mapping_file = workdir / "mapping-float.json"
        mapping_file.write_text(json.dumps(sample_mapping(size, float_only=True)))
        cases.append(bench_cp(ctx, ws, src, checkpoint, sync=False))
    reference = workdir / f"ref-{checkpoint}"
    if checkpoint == "float":
        quiesce(reference)
        for n in (1, 2):
            cases.append(bench_mpicons(ctx, ws, src, reference, checkpoint, n, "bytes", "posix"))
        if no_sync:
            cases.append(bench_mpicons(ctx, ws, src, reference, checkpoint, 1, "bytes", "posix", NO_SYNC))
    torch_call = None
    for n in (1, 2):
        case = bench_torch(ctx, ws, src, mapping_file, reference, checkpoint, n, threads)
        cases.append(case)
        print(f"bench: {case.name}: {case.wall:.2f} s (call {case.call:.2f} s)")
        if n == 1:
            torch_call = case.call
        notes.append(
            f"{case.name}: output tensors {'equal' if case.detail['same_tensors_as_mpicons'] else 'DIFFER FROM'} "
            f"mpicons' ({case.detail.get('difference', 'name, dtype, shape and bytes')})"
        )
    return torch_call, checkpoint


# ---------------------------------------------------------------- the whole dense benchmark


def run_dense(
    ctx: Context,
    workdir: Path,
    size: int,
    ranks: Sequence[int],
    splits: Sequence[str],
    ios: Sequence[str],
    torch: bool,
    torch_threads: int,
) -> DenseResult:
    """cp -r, cp -r + sync, the mpicons matrix, its --no-sync rows, then torch (unless ``torch`` is False)."""
    ws = Workspace(workdir / "out", workdir / "stats")
    ws.stats_dir.mkdir(parents=True, exist_ok=True)
    full = ensure_sample(ctx, workdir, size, float_only=False)
    cases: list[Case] = []
    notes: list[str] = []

    cases.append(bench_cp(ctx, ws, full, "full", sync=False))
    cases.append(bench_cp(ctx, ws, full, "full", sync=True))
    reference = workdir / "ref-full"
    quiesce(reference)
    for n in ranks:
        for split in splits:
            for io in ios:
                cases.append(bench_mpicons(ctx, ws, full, reference, "full", n, split, io))
                print(f"bench: {cases[-1].name}: {cases[-1].wall:.2f} s")
    no_sync = mpicons_has(ctx, NO_SYNC[0])
    if no_sync:  # without fsync, as cp -r and torch write: the copying alone
        for n in (1, 2):
            cases.append(bench_mpicons(ctx, ws, full, reference, "full", n, "bytes", "posix", NO_SYNC))
            print(f"bench: {cases[-1].name}: {cases[-1].wall:.2f} s")

    torch_call, checkpoint = None, "full"
    if not torch:
        notes.append("torch: skipped (--no-torch)")
    elif not torch_available(ctx):
        notes.append("torch: not importable, torch cases skipped")
    else:
        torch_call, checkpoint = torch_cases(ctx, ws, workdir, full, size, torch_threads, no_sync, cases, notes)
    return DenseResult(full, cases, ws.identical, notes, torch_call, checkpoint)
