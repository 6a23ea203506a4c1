#!/usr/bin/env python3
"""``--lora``, ``--dtype fp8`` and the dequantization of block FP8 against a plain consolidation.

The input is a synthetic Llama-shaped bf16 Hugging Face folder (hidden 2048, intermediate 5632, 16 heads
over 4 key-value heads, vocabulary 32000, untied ``lm_head``, as many layers as ``--size`` holds, up to 4
``model-*.safetensors`` files and an index) with a peft LoRA adapter (r 16, alpha 32, the seven
projections, float32), both written with numpy once and reused; its block-FP8 twin is made at every run,
untimed, by ``mpicons consolidate BF16 FP8 --dtype fp8``. mpicons is copied first (``--source``) and
every run imports that copy. Interleaved rounds (the order alternating from round to round) of

    mpiexec -n N mpicons consolidate BF16 OUT                  (plain)
    mpiexec -n N mpicons consolidate BF16 OUT --lora ADAPTER   (merge)
    mpiexec -n N mpicons consolidate BF16 OUT --dtype fp8      (quantize)
    mpiexec -n N mpicons consolidate FP8 OUT                   (plain-fp8)
    mpiexec -n N mpicons consolidate FP8 OUT --dtype bf16      (dequantize)

report medians of wall time and of mpicons' own ``elapsed.max``, the ratios merge/plain (target ≤ 1.2×),
quantize/plain and dequantize/plain-fp8, the peak RSS per rank (``peak_rss_mb.max``; the largest process
as ``/usr/bin/time`` saw it) and the merge's numpy arithmetic alone, step by step. Then the outputs are
checked (a wrong one stops the script): plain outputs and the quantized one equal their input and the FP8
twin tensor by tensor; three merged weights are ``bf16(W + (B @ A) * alpha / r)`` computed in float32 (at
most 1 ulp apart, in under 0.1% of the elements), the rest unchanged; every dequantized weight is
``bf16(q * scale)``, within E4M3's rounding of the original, its scales the block maxima over 448.

    python benchmarks/lora_fp8.py                          # ~1.5 GB, 2 ranks, 5 rounds, in /tmp
    python benchmarks/lora_fp8.py --size 200MB --repeat 1  # a quick run
    python benchmarks/lora_fp8.py --ranks 1 --workdir /scratch/bench --json lora_fp8.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: one BLAS thread, as mpicons gives each rank

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from harness import (  # noqa: E402
    MPIEXEC,
    PYTHON,
    Context,
    Quiet,
    Timed,
    checked,
    dir_bytes,
    machine,
    mpirun,
    parse_size,
    quiesce,
    same_tensors,
    snapshot_sources,
    warm,
)
from safetensors.numpy import save_file  # noqa: E402

TARGET = 1.2
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB, FILES = 2048, 5632, 16, 4, 32000, 4
RANK, ALPHA, BLOCK = 16, 32, 128
BF16 = ml_dtypes.bfloat16
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
NUMPY = {"BF16": BF16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32}


def layer_shapes(layer: int) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors, Hugging Face's names: [out, in] projections and two norms."""
    kv, p = HIDDEN // HEADS * KV_HEADS, f"model.layers.{layer}."
    out_in = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (kv, HIDDEN), "v_proj": (kv, HIDDEN), "o_proj": (HIDDEN, HIDDEN)}
    mlp = {"gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN), "down_proj": (HIDDEN, INTERMEDIATE)}
    shapes: dict[str, tuple[int, ...]] = {f"{p}input_layernorm.weight": (HIDDEN,)}
    shapes |= {f"{p}self_attn.{m}.weight": s for m, s in out_in.items()}
    shapes[f"{p}post_attention_layernorm.weight"] = (HIDDEN,)
    return shapes | {f"{p}mlp.{m}.weight": s for m, s in mlp.items()}


def model_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for layer in range(layers):
        shapes |= layer_shapes(layer)
    return shapes | {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def layers_for(size: int) -> int:
    """As many layers as make the model about ``size`` bytes of bf16 (at least one)."""
    per_layer = sum(int(np.prod(s)) for s in layer_shapes(0).values()) * 2
    return max(1, round((size - 4 * VOCAB * HIDDEN) / per_layer))


def hf_config(layers: int) -> dict[str, Any]:
    """A llama ``config.json`` of the folder's shapes (untied ``lm_head``)."""
    shapes = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "vocab_size": VOCAB}
    heads = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS}
    rest = {"hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0}
    tokens = {"tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | shapes | heads | rest | tokens


def write_model(directory: Path, layers: int, seed: int = 0) -> None:
    """The bf16 folder: weights normal(0, 0.02), norms about 1, in ``FILES`` files of about equal size."""
    rng = np.random.default_rng(seed)
    shapes = model_shapes(layers)
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    groups: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        if filled >= total / FILES * len(groups) and len(groups) < FILES:
            groups.append([])
        groups[-1].append(name)
        filled += int(np.prod(shape)) * 2
    directory.mkdir(parents=True)
    weight_map = {}
    for number, names in enumerate(groups, 1):
        file_name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        arrays = {}
        for name in names:
            values = rng.standard_normal(shapes[name], dtype=np.float32)
            arrays[name] = (values * 0.02 + (1.0 if len(shapes[name]) == 1 else 0.0)).astype(BF16)
            weight_map[name] = file_name
        save_file(arrays, str(directory / file_name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(hf_config(layers), indent=2))


def write_adapter(directory: Path, layers: int, seed: int = 1) -> None:
    """A peft LoRA folder: ``A`` uniform(±1/sqrt(in)) as peft initialises it, ``B`` normal(0, 0.02) (trained)."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, shape in model_shapes(layers).items():
        if not name.endswith("_proj.weight"):
            continue
        module = "base_model.model." + name.removesuffix(".weight")
        bound = 1.0 / np.sqrt(shape[1])
        arrays[f"{module}.lora_A.weight"] = rng.uniform(-bound, bound, (RANK, shape[1])).astype(np.float32)
        arrays[f"{module}.lora_B.weight"] = rng.standard_normal((shape[0], RANK), dtype=np.float32) * np.float32(0.02)
    directory.mkdir(parents=True)
    save_file(arrays, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "base", "bias": "none"}
    config |= {"r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": [*ATTENTION, *MLP]}
    config |= {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))


def ensure_inputs(workdir: Path, size: int) -> tuple[Path, Path, dict[str, Any]]:
    """The bf16 folder and its adapter, written once; reused while their description is unchanged."""
    layers = layers_for(size)
    base, adapter, marker = workdir / f"llama-{layers}-bf16", workdir / f"llama-{layers}-lora", workdir / f"llama-{layers}.json"
    described = {"layers": layers, "config": hf_config(layers), "rank": RANK, "alpha": ALPHA, "files": FILES}
    if not (marker.exists() and json.loads(marker.read_text()) == described and adapter.is_dir()):
        for directory in (base, adapter):
            shutil.rmtree(directory, ignore_errors=True)
        began = time.perf_counter()
        write_model(base, layers)
        write_adapter(adapter, layers)
        print(f"lora_fp8: wrote the bf16 folder and the adapter in {time.perf_counter() - began:.1f} s")
        marker.write_text(json.dumps(described))
    return base, adapter, described


def make_fp8(ctx: Context, base: Path, ranks: int) -> Path:
    """The FP8 twin of ``base``, made by the mpicons measured (``--dtype fp8``, untimed) at every run."""
    fp8 = base.with_name(base.name.replace("-bf16", "-fp8"))
    quiesce(fp8)
    command = [PYTHON, "-m", "mpicons", "consolidate", str(base), str(fp8), "-q", "--dtype", "fp8"]
    made = checked(ctx.run(mpirun(ranks, command)), "mpicons --dtype fp8 (the FP8 folder)")
    print(f"lora_fp8: wrote the FP8 folder in {made.wall:.1f} s")
    return fp8


# ---------------------------------------------------------------- reading and checking outputs


@functools.cache
def header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data begins, and its header."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        return 8 + length, json.loads(handle.read(length))


def tensor_files(directory: Path, single: str = "model.safetensors") -> dict[str, Path]:
    """Tensor name → the file holding it (from the index, or the one file ``single``)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return {n: directory / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    return {name: directory / single for name in header(directory / single)[1] if name != "__metadata__"}


def load(files: dict[str, Path], name: str) -> np.ndarray:
    """One tensor, read with numpy (ml_dtypes' bfloat16 and float8_e4m3fn)."""
    start, entries = header(files[name])
    entry = entries[name]
    dtype = np.dtype(NUMPY[entry["dtype"]])
    begin, end = entry["data_offsets"]
    values = np.fromfile(files[name], dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin)
    return values.reshape(entry["shape"])


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many bf16 steps apart each element of two bf16 arrays is."""

    def ordered(x: np.ndarray) -> np.ndarray:
        bits = x.view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, 0x8000 - bits, bits)

    return np.abs(ordered(a) - ordered(b))


def check_merge(base: Path, adapter: Path, output: Path, layers: int) -> str:
    """Three merged weights against numpy's float32 merge; the tensors no LoRA targets byte for byte."""
    ref, out = tensor_files(base), tensor_files(output)
    if set(ref) != set(out):
        raise SystemExit(f"lora_fp8: merge: tensor names differ: {sorted(set(ref) ^ set(out))[:5]}")
    lora = tensor_files(adapter, "adapter_model.safetensors")
    samples = ["model.layers.0.self_attn.q_proj.weight", f"model.layers.{layers // 2}.self_attn.k_proj.weight"]
    samples.append(f"model.layers.{layers - 1}.mlp.down_proj.weight")
    off = 0
    for name in samples:
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = load(lora, f"{module}.lora_A.weight"), load(lora, f"{module}.lora_B.weight")
        expected = (load(ref, name).astype(np.float32) + (b @ a) * np.float32(ALPHA / RANK)).astype(BF16)
        got = load(out, name)
        if got.dtype != BF16 or got.shape != expected.shape:
            raise SystemExit(f"lora_fp8: merge: {name} is {got.dtype}{list(got.shape)}, not bfloat16{list(expected.shape)}")
        apart = ulps(expected, got)
        if apart.max() > 1 or np.count_nonzero(apart) >= 1e-3 * apart.size:
            raise SystemExit(
                f"lora_fp8: merge: {name}: {np.count_nonzero(apart)} of {apart.size} elements differ from "
                f"bf16(W + B @ A * {ALPHA / RANK}), by up to {apart.max()} ulp"
            )
        if np.array_equal(got.view(np.uint16), load(ref, name).view(np.uint16)):
            raise SystemExit(f"lora_fp8: merge: {name} is the base's weight unchanged")
        off += np.count_nonzero(apart)
    unchanged = [n for n in ref if not n.endswith("_proj.weight")]
    for name in unchanged:
        if load(ref, name).tobytes() != load(out, name).tobytes():
            raise SystemExit(f"lora_fp8: merge: {name}, which no LoRA targets, differs from the base's")
    return f"3 merged weights equal numpy's float32 merge ({off} elements 1 ulp apart), {len(unchanged)} others unchanged"


def block_scales(weight: np.ndarray) -> np.ndarray:
    """Each 128x128 block's largest magnitude over 448 in float32 (1.0 for an all-zero block)."""
    rows, cols = weight.shape
    grid = np.abs(weight.astype(np.float32)).reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK).max(axis=(1, 3))
    return np.where(grid == 0, np.float32(1.0), grid / np.float32(448.0))


def dequantized_error(name: str, want: np.ndarray, got: np.ndarray, q: np.ndarray, scales: np.ndarray) -> float:
    """Checks one weight (original ``want``, dequantized ``got``, E4M3 ``q`` and its scales); its squared
    error relative to the original's."""
    if q.dtype != ml_dtypes.float8_e4m3fn or not np.array_equal(scales, block_scales(want)):
        raise SystemExit(f"lora_fp8: the FP8 folder's {name} is not E4M3 with its block maxima / 448 as scales")
    per_element = np.repeat(np.repeat(scales, BLOCK, axis=0), BLOCK, axis=1)
    if not np.array_equal((q.astype(np.float32) * per_element).astype(BF16).view(np.uint16), got.view(np.uint16)):
        raise SystemExit(f"lora_fp8: dequantize: {name} is not bf16(float32(q) * scale) of the FP8 folder's")
    w, d = want.astype(np.float32), got.astype(np.float32)
    bound = (2.0**-4 + 2.0**-8) * np.abs(w) + 2.0**-9 * per_element  # half an E4M3 step, then bf16's rounding
    if (np.abs(d - w) > bound).any():
        raise SystemExit(f"lora_fp8: dequantize: {name} differs from the original by more than E4M3's rounding")
    return float(np.sum((d - w) ** 2)) / float(np.sum(w**2))


def check_dequantize(base: Path, fp8: Path, output: Path) -> str:
    """Every dequantized weight within E4M3's rounding of the original bf16; its scales the block maxima
    over 448; the tensors FP8 left alone byte for byte; the same names, dtypes and shapes as the original."""
    ref, quantized, out = tensor_files(base), tensor_files(fp8), tensor_files(output)
    if set(ref) != set(out):
        raise SystemExit(f"lora_fp8: dequantize: tensor names differ: {sorted(set(ref) ^ set(out))[:5]}")
    if "quantization_config" in json.loads((output / "config.json").read_text()):
        raise SystemExit("lora_fp8: dequantize: config.json still has a quantization_config")
    weights = [n for n in ref if n + "_scale_inv" in quantized]
    if len(weights) != 7 * sum(n.endswith("input_layernorm.weight") for n in ref):
        raise SystemExit(f"lora_fp8: the FP8 folder quantized {len(weights)} weights, not the 7 projections of every layer")
    squared = 0.0
    for name in ref:
        want, got = load(ref, name), load(out, name)
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            raise SystemExit(f"lora_fp8: dequantize: {name} is {got.dtype}{list(got.shape)}, not {want.dtype}{list(want.shape)}")
        if name in weights:
            squared += dequantized_error(name, want, got, load(quantized, name), load(quantized, name + "_scale_inv"))
        elif got.tobytes() != want.tobytes():
            raise SystemExit(f"lora_fp8: dequantize: {name}, which FP8 leaves alone, differs from the original")
    rms, others = np.sqrt(squared / len(weights)), len(ref) - len(weights)
    return f"{len(weights)} dequantized weights within E4M3's rounding (relative RMS error {rms:.3f}), {others} others unchanged"


def merge_arithmetic(base: Path, adapter: Path) -> dict[str, float]:
    """Seconds of numpy (this process, one BLAS thread as every mpicons rank) for each step of
    ``bf16(float32(W) + (B @ A) * s)`` over every merged weight, whole: what a merge adds to a plain
    consolidation's copying, at least, before any tiling or chunking."""
    ref, lora = tensor_files(base), tensor_files(adapter, "adapter_model.safetensors")
    steps = dict.fromkeys(("bf16->f32", "B@A", "*s", "+W", "f32->bf16"), 0.0)
    for name in (n for n in ref if n.endswith("_proj.weight")):
        module = "base_model.model." + name.removesuffix(".weight")
        a, b, w = load(lora, f"{module}.lora_A.weight"), load(lora, f"{module}.lora_B.weight"), load(ref, name)
        times = [time.perf_counter()]
        weight = w.astype(np.float32)
        times.append(time.perf_counter())
        product = b @ a
        times.append(time.perf_counter())
        product *= np.float32(ALPHA / RANK)
        times.append(time.perf_counter())
        product += weight
        times.append(time.perf_counter())
        product.astype(BF16)
        times.append(time.perf_counter())
        for step, took in zip(steps, np.diff(times)):
            steps[step] += float(took)
    return steps


# ---------------------------------------------------------------- the timed runs


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=int(1.5e9), help="bytes of the bf16 model (default 1.5GB)")
    parser.add_argument("--ranks", type=int, default=2, help="mpicons ranks (default 2)")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--source", choices=("worktree", "head"), default="worktree", help="mpicons measured (copied first)")
    parser.add_argument("--sync", action="store_true", help="durable outputs (default --no-sync: the engine's work only)")
    parser.add_argument("--no-check", action="store_true", help="skip checking the outputs")
    parser.add_argument("--patience", type=float, default=60.0, help="seconds to wait for an idle machine per run")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mpicons-bench-lora-fp8")
    parser.add_argument("--json", type=Path, help="write every number here")
    return parser.parse_args()


def run_rounds(args: argparse.Namespace, cases: dict[str, tuple[Path, list[str]]], ctx: Context) -> tuple[dict, dict]:
    """Every case once per round, the order alternating; each from a warm cache, after the last one's writeback."""
    runs: dict[str, list[Timed]] = {name: [] for name in cases}
    stats: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    extra = [] if args.sync else ["--no-sync"]
    for round_ in range(args.repeat):
        for name in list(cases) if round_ % 2 == 0 else list(reversed(cases)):
            source, options = cases[name]
            target, stats_file = args.workdir / f"out-{name}", args.workdir / f"stats-{name}.json"
            quiesce(target)
            warm(source)
            ctx.quiet.wait(name)
            command = [PYTHON, "-m", "mpicons", "consolidate", str(source), str(target), "-q", "--stats-json", str(stats_file)]
            runs[name].append(checked(ctx.run(mpirun(args.ranks, command + options + extra)), f"mpicons {name}"))
            stats[name].append(json.loads(stats_file.read_text()))
    return runs, stats


def _table(runs: dict[str, list[Timed]], stats: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Median, best and worst wall time per case, peak RSS per rank, median slowest-rank phase times."""
    print(
        f"{'case':<12}{'median s':>10}{'best s':>9}{'worst s':>9}{'own s':>8}{'RSS/rank MB':>13}{'time RSS MB':>13}"
        + "".join(f"{c:>8}" for c in ("scan", "plan", "write", "GB out"))
    )
    medians = {}
    for name, timed in runs.items():
        walls = [t.wall for t in timed]
        medians[name] = statistics.median(walls)
        own, rss = statistics.median(s["elapsed"]["max"] for s in stats[name]), max(s["peak_rss_mb"]["max"] for s in stats[name])
        phases = "".join(
            f"{statistics.median(s['phases'][p]['max'] for s in stats[name]):>8.2f}" for p in ("scan", "plan", "write")
        )
        print(
            f"{name:<12}{medians[name]:>10.3f}{min(walls):>9.3f}{max(walls):>9.3f}{own:>8.3f}{rss:>13.0f}"
            f"{max(t.rss_mb for t in timed):>13.0f}{phases}{stats[name][-1]['total_bytes'] / 1e9:>8.2f}"
        )
    return medians


def _ratios(medians: dict[str, float]) -> dict[str, float]:
    pairs = (("merge", "plain"), ("quantize", "plain"), ("dequantize", "plain-fp8"))
    ratios = {f"{case} / {plain}": medians[case] / medians[plain] for case, plain in pairs}
    for what, ratio in ratios.items():
        verdict = f" ({'PASS' if ratio <= TARGET else 'FAIL'}: target <= {TARGET}x)" if what.startswith("merge") else ""
        print(f"{what} (medians): {ratio:.2f}x{verdict}")
    return ratios


def check_outputs(workdir: Path, base: Path, adapter: Path, fp8: Path, layers: int) -> list[str]:
    for name, reference in (("plain", base), ("quantize", fp8), ("plain-fp8", fp8)):
        if (problem := same_tensors(reference, workdir / f"out-{name}")) is not None:
            raise SystemExit(f"lora_fp8: {name}: {problem}")
    return [
        "plain and plain-fp8 hold their input's tensors, quantize the FP8 folder's",
        check_merge(base, adapter, workdir / "out-merge", layers),
        check_dequantize(base, fp8, workdir / "out-dequantize"),
    ]


def main() -> None:
    args = _arguments()
    args.workdir.mkdir(parents=True, exist_ok=True)
    base, adapter, described = ensure_inputs(args.workdir, args.size)
    root, sources = snapshot_sources(args.workdir, args.source)
    ctx = Context.on_snapshot(root, args.workdir, Quiet(args.patience), args.repeat)
    ctx.env["MPICONS_PROGRESS"] = "lines"
    fp8 = make_fp8(ctx, base, args.ranks)
    cases = {
        "plain": (base, []),
        "merge": (base, ["--lora", str(adapter)]),
        "quantize": (base, ["--dtype", "fp8"]),
        "plain-fp8": (fp8, []),
        "dequantize": (fp8, ["--dtype", "bf16"]),
    }
    warm(adapter)
    runs, stats = run_rounds(args, cases, ctx)
    print(f"command: {shlex.join(sys.argv)}; mpicons: {sources}")
    print(
        f"llama (bf16): hidden {HIDDEN}, intermediate {INTERMEDIATE}, {described['layers']} layers, {dir_bytes(base) / 1e6:.0f} "
        f"MB in {len(list(base.glob('model-*')))} files; FP8 twin {dir_bytes(fp8) / 1e6:.0f} MB; adapter r {RANK}, "
        f"alpha {ALPHA}, {dir_bytes(adapter) / 1e6:.0f} MB; {args.ranks} ranks, {args.repeat} interleaved rounds"
        + ("" if args.sync else ", --no-sync")
    )
    medians = _table(runs, stats)
    ratios = _ratios(medians)
    steps = merge_arithmetic(base, adapter)
    print(f"merge in numpy, 1 thread: {sum(steps.values()):.2f} s = " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    checks = ["not checked"] if args.no_check else check_outputs(args.workdir, base, adapter, fp8, described["layers"])
    print("outputs: " + "; ".join(checks))
    if ctx.quiet.busy_runs:
        print("runs that started on a busy machine:", "; ".join(ctx.quiet.busy_runs))
    if args.json:
        numbers = {"machine": machine(args.workdir), "command": sys.argv, "sources": sources, "model": described}
        numbers |= {"ranks": args.ranks, "mpiexec": MPIEXEC, "sync": args.sync, "stats": stats, "medians": medians}
        numbers |= {"cases": {n: [t.__dict__ | {"log": ""} for t in ts] for n, ts in runs.items()}, "ratios": ratios}
        numbers |= {"numpy_merge_s": steps, "checks": checks, "busy_runs": ctx.quiet.busy_runs}
        args.json.write_text(json.dumps(numbers, indent=1))


if __name__ == "__main__":
    main()
