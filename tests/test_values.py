"""The value ops by themselves (serial): block maxima and scales against a loop over the blocks, a row's
stretches against the whole row, peft's rules that no fixture exercises (``fan_in_fan_out``,
``alpha_pattern``) against the formula, and what is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import load_tensors
from safetensors.numpy import load_file, save_file

import mpicons
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError
from mpicons.core.values import Dequantize, Merge, Quantize, apply_value, block_amax, merge_delta, scales_of

LORA = Path(__file__).parent / "fixtures" / "lora"


class _Aux:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def whole(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def rows(self, name: str, begin: int, end: int) -> np.ndarray:
        return self.arrays[name][begin:end]


@pytest.mark.parametrize("seed", range(6))
def test_block_maxima_of_any_stretch_are_the_blocks_maxima(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, cols, block = (
        int(rng.integers(1, 300)),
        int(rng.integers(1, 300)),
        (int(rng.integers(1, 130)), int(rng.integers(1, 130))),
    )
    weight = rng.standard_normal((rows, cols)).astype(np.float32)
    i0, i1 = sorted(int(x) for x in rng.integers(0, rows + 1, 2))
    j0, j1 = sorted(int(x) for x in rng.integers(0, cols + 1, 2))
    if i1 == i0 or j1 == j0:
        return
    row_blocks, col_blocks, grid = block_amax(weight[i0:i1, j0:j1], (i0, i1), (j0, j1), block)
    for bi in range(row_blocks.start, row_blocks.stop):
        for bj in range(col_blocks.start, col_blocks.stop):
            inside = weight[
                max(i0, bi * block[0]) : min(i1, (bi + 1) * block[0]), max(j0, bj * block[1]) : min(j1, (bj + 1) * block[1])
            ]
            assert grid[bi - row_blocks.start, bj - col_blocks.start] == np.abs(inside).max()


def test_an_all_zero_block_gets_scale_one() -> None:
    amax = np.array([[0.0, 448.0], [4.48, 0.0]], dtype=np.float32)
    assert scales_of(amax).tolist() == [[1.0, 1.0], [np.float32(4.48) / np.float32(448), 1.0]]


def _applied(op, values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], aux: _Aux) -> np.ndarray:
    out = np.empty(values.shape, dtype=np.float32)
    apply_value(op, values, rows, cols, aux, out)
    return out


@pytest.mark.parametrize("make", ["dequantize", "quantize", "merge", "dora"])
def test_a_stretch_of_a_row_gives_what_the_whole_row_gives(make: str) -> None:
    """Rows larger than a block come to the ops in stretches (a prefix segment): each stretch must equal the
    same columns of the whole rows."""
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((5, 300)).astype(np.float32)
    aux = _Aux({
        "s": rng.random((1, 3)).astype(np.float32) + 0.5,
        "a": rng.standard_normal((4, 300)).astype(np.float32),
        "b": rng.standard_normal((5, 4)).astype(np.float32),
        "m": rng.random(5).astype(np.float32),
    })  # fmt: skip
    ops = {
        "dequantize": Dequantize("s"),
        "quantize": Quantize("s"),
        "merge": Merge("a", "b", 2.0),
        "dora": Merge("a", "b", 2.0, magnitude="m"),
    }
    op = ops[make]
    whole = _applied(op, weight, (0, 5), (0, 300), aux)
    if make == "dora":
        with pytest.raises(InputError, match="DoRA needs whole rows"):
            _applied(op, weight[2:3, 100:250], (2, 3), (100, 250), aux)
        return
    assert np.array_equal(_applied(op, weight[2:3, 100:250], (2, 3), (100, 250), aux), whole[2:3, 100:250])


def test_dequantized_and_quantized_values_follow_the_formulas() -> None:
    """``float32(q) × s[i // 128, j // 128]`` and ``clamp(x / s, ±448)``, element by element, with partial
    edge blocks and a region that starts inside a block."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((300, 200)).astype(np.float32)
    scales = rng.random((3, 2)).astype(np.float32) + 0.01
    grid = scales[np.arange(300)[:, None] // 128, np.arange(200)[None, :] // 128]
    aux = _Aux({"s": scales})
    assert np.array_equal(_applied(Dequantize("s"), weight, (0, 300), (0, 200), aux), weight * grid)
    assert np.array_equal(_applied(Quantize("s"), weight, (0, 300), (0, 200), aux), np.clip(weight / grid, -448, 448))
    inner = _applied(Dequantize("s"), weight[100:260, 60:190], (100, 260), (60, 190), aux)
    assert np.array_equal(inner, (weight * grid)[100:260, 60:190])


def _fp32_base(tmp_path: Path) -> tuple[Path, Path]:
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(LORA / "llama-fp32" / "base", base)
    shutil.copytree(LORA / "llama-fp32" / "adapter", adapter)
    return base, adapter


def _config(adapter: Path, **changes: object) -> None:
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_alpha_pattern_gives_the_modules_it_matches_their_own_alpha(tmp_path: Path) -> None:
    base, adapter = _fp32_base(tmp_path)
    _config(adapter, alpha_pattern={"q_proj": 64, r"layers\.1\.mlp\.down_proj": 4})
    mpicons.consolidate(base, tmp_path / "out", lora=str(adapter), comm=SingleProcess())
    got, saved, lora = (
        load_file(tmp_path / "out" / "model.safetensors"),
        load_file(base / "model.safetensors"),
        load_file(adapter / "adapter_model.safetensors"),
    )
    for module, alpha in [
        ("model.layers.0.self_attn.q_proj", 64),
        ("model.layers.1.mlp.down_proj", 4),
        ("model.layers.1.mlp.up_proj", 16),
    ]:
        a, b = lora[f"base_model.model.{module}.lora_A.weight"], lora[f"base_model.model.{module}.lora_B.weight"]
        expected = saved[f"{module}.weight"] + (b @ a) * np.float32(alpha / a.shape[0])
        assert np.array_equal(got[f"{module}.weight"], expected), module


def test_fan_in_fan_out_merges_the_transposed_product(tmp_path: Path) -> None:
    """GPT-2's Conv1D keeps weights as [in, out]: peft merges (B @ A)ᵀ."""
    rng = np.random.default_rng(3)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    weight = rng.standard_normal((6, 10)).astype(np.float32)  # [in 6, out 10]
    a, b = rng.standard_normal((2, 6)).astype(np.float32), rng.standard_normal((10, 2)).astype(np.float32)
    save_file(
        {"h.0.attn.c_attn.weight": weight, "h.0.ln_1.weight": np.ones(6, np.float32)},
        base / "model.safetensors",
        {"format": "pt"},
    )
    save_file(
        {"base_model.model.h.0.attn.c_attn.lora_A.weight": a, "base_model.model.h.0.attn.c_attn.lora_B.weight": b},
        adapter / "adapter_model.safetensors",
        {"format": "pt"},
    )
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "fan_in_fan_out": True})
    )
    mpicons.consolidate(base, tmp_path / "out", lora=str(adapter), comm=SingleProcess())
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert np.array_equal(got["h.0.attn.c_attn.weight"], weight + (b @ a).T * np.float32(2.0))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"alpha_pattern": {"(a+)+$": 8}}, "not a module name or a simple pattern"),
        ({"lora_alpha": "16"}, "lora_alpha is '16', not a number"),
        ({"peft_type": "IA3"}, "merges LoRA adapters only"),
        ({"lora_bias": True}, "lora_bias is set"),
        ({"use_dora": True, "fan_in_fan_out": True}, None),
    ],
)
def test_adapter_configs_mpicons_cannot_merge_are_refused(tmp_path: Path, changes: dict, message: str | None) -> None:
    base, adapter = _fp32_base(tmp_path)
    _config(adapter, **changes)
    if message is None:  # no magnitude in this adapter: fan_in_fan_out then fails on the shapes
        message = "does not make its weight's shape"
    with pytest.raises(InputError, match=message) as caught:
        mpicons.consolidate(base, tmp_path / "out", lora=str(adapter), comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()


def test_an_fp8_base_is_dequantized_before_a_merge(tmp_path: Path) -> None:
    fp8 = tmp_path / "fp8"
    mpicons.consolidate(LORA / "llama-bf16" / "base", fp8, dtype="fp8", comm=SingleProcess())
    with pytest.raises(InputError, match="dequantize it first with --dtype bf16"):
        mpicons.consolidate(fp8, tmp_path / "out", lora=str(LORA / "llama-bf16" / "adapter"), comm=SingleProcess())


def test_bf16_merge_rounds_the_float32_sum_once(tmp_path: Path) -> None:
    """The bf16 fixture's merge is bf16(float32(W) + (B @ A) * s): one rounding (not ΔW rounded first)."""
    case = LORA / "llama-bf16"
    mpicons.consolidate(case / "base", tmp_path / "out", lora=str(case / "adapter"), comm=SingleProcess())
    got = load_tensors(tmp_path / "out" / "model.safetensors")
    saved, lora = load_file(case / "base" / "model.safetensors"), load_file(case / "adapter" / "adapter_model.safetensors")
    module = "model.layers.0.mlp.up_proj"
    a, b = lora[f"base_model.model.{module}.lora_A.weight"], lora[f"base_model.model.{module}.lora_B.weight"]
    twice = (
        saved[f"{module}.weight"].astype(np.float32) + ((b @ a) * np.float32(2)).astype(ml_dtypes.bfloat16).astype(np.float32)
    ).astype(ml_dtypes.bfloat16)
    assert got[f"{module}.weight"][2] != twice.tobytes()  # the fixture's expected is the single rounding (tests/test_lora.py)


@pytest.mark.parametrize("rank", [16, 64])
def test_a_merge_is_the_same_whatever_the_blocks(rank: int, tmp_path: Path) -> None:
    """BLAS rounds some elements of a product differently for other shapes (seen at r 32 and 64): the merge
    computes each element in the same tile whatever rows a block holds, so small and large buffers (and
    so any rank count) write the same bytes."""
    rng = np.random.default_rng(rank)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir()
    adapter.mkdir()
    shapes = {"model.layers.0.mlp.up_proj": (700, 300), "model.layers.0.mlp.down_proj": (300, 700)}
    save_file({f"{m}.weight": rng.standard_normal(s).astype(np.float32) for m, s in shapes.items()}, base / "model.safetensors")
    lora = {}
    for module, (out_features, in_features) in shapes.items():
        lora[f"base_model.model.{module}.lora_A.weight"] = rng.standard_normal((rank, in_features)).astype(np.float32)
        lora[f"base_model.model.{module}.lora_B.weight"] = rng.standard_normal((out_features, rank)).astype(np.float32)
    save_file(lora, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    outputs = []
    for buffer_size in (1 << 16, 1 << 25):
        out = tmp_path / f"out-{buffer_size}"
        mpicons.consolidate(base, out, lora=str(adapter), buffer_size=buffer_size, comm=SingleProcess())
        outputs.append((out / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("seed", range(4))
def test_the_lora_product_of_any_rows_is_those_rows_of_the_whole(seed: int) -> None:
    """Cut into random stretches of rows (as blocks and ranks cut a weight), the product is the same bytes."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        rows, rank, cols = int(rng.integers(2, 600)), int(rng.choice([8, 16, 32, 64])), int(rng.integers(2, 900))
        aux = _Aux(
            {"a": rng.standard_normal((rank, cols)).astype(np.float32), "b": rng.standard_normal((rows, rank)).astype(np.float32)}
        )
        op = Merge("a", "b", 1.0)
        whole = merge_delta(op, (0, rows), (0, cols), aux)
        cuts = sorted({0, rows, *(int(x) for x in rng.integers(1, rows, 3))})
        pieces = [merge_delta(op, (low, high), (0, cols), aux) for low, high in zip(cuts, cuts[1:])]
        assert np.concatenate(pieces).tobytes() == whole.tobytes(), (rows, rank, cols, cuts)


def test_the_lora_product_is_torchs_at_model_shapes() -> None:
    """peft merges with torch's float32 ``B @ A``: at a model's shapes the tiled product is the same bytes."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for rows, rank, cols in [(1024, 32, 4096), (2816, 16, 1024)]:
        a = (rng.standard_normal((rank, cols)) * 0.02).astype(np.float32)
        b = (rng.standard_normal((rows, rank)) * 0.02).astype(np.float32)
        ours = merge_delta(Merge("a", "b", 2.0), (0, rows), (0, cols), _Aux({"a": a, "b": b}))
        assert ours.tobytes() == ((torch.from_numpy(b) @ torch.from_numpy(a)) * 2.0).numpy().tobytes()


def test_an_adapter_of_rank_zero_is_refused(tmp_path: Path) -> None:
    base, adapter = _fp32_base(tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    module = "base_model.model.model.layers.0.mlp.up_proj"
    tensors[f"{module}.lora_A.weight"] = tensors[f"{module}.lora_A.weight"][:0].copy()
    tensors[f"{module}.lora_B.weight"] = tensors[f"{module}.lora_B.weight"][:, :0].copy()
    save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(InputError, match=r"lora_A has no rows \(r 0\)"):
        mpicons.consolidate(base, tmp_path / "out", lora=str(adapter), comm=SingleProcess())
