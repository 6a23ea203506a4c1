"""Block-FP8 checkpoints (DeepSeek-V3's layout: ``F8_E4M3`` weights, a float32 ``weight_scale_inv`` per
128×128 block), on the fixture torch's DCP wrote over 2 ranks with block rows split between them
(tests/fixtures/fp8). Consolidated exactly as they are; dequantized by ``--dtype``; a ``--keep-dtype`` that
would cast a weight or its scales without the other is refused, since the result would load and be wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import cli, load_tensors, reference_logits_reports

import mpicons
from mpicons.comm import SingleProcess
from mpicons.core.errors import InputError

CASE = Path(__file__).parent / "fixtures" / "fp8" / "llama-h192-dcp-2ranks"
SHARDS = CASE / "fp8" / "sharded"


def _output_tensors(out: Path) -> dict:
    tensors: dict = {}
    for path in sorted(out.glob("model*.safetensors")):
        tensors.update(load_tensors(path))
    return tensors


def test_fp8_weights_and_their_scales_are_consolidated_exactly(tmp_path: Path) -> None:
    mpicons.consolidate(SHARDS, tmp_path / "out", hf_assets=str(CASE / "fp8"), comm=SingleProcess())
    expected = load_tensors(CASE / "expected-fp8" / "model.safetensors")
    assert _output_tensors(tmp_path / "out") == expected
    assert sum(dtype == "F8_E4M3" for dtype, _, _ in expected.values()) == 14


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_dtype_dequantizes_block_fp8_with_scale_blocks_straddling_ranks(ranks: int, tmp_path: Path) -> None:
    """``--dtype bf16``: each weight becomes bf16(float32(q) × its block's scale), with global block indices
    although torch cut the block rows between the training ranks; the scales and the config's
    ``quantization_config`` are gone."""
    out = tmp_path / "out"
    proc, _ = cli(ranks, "consolidate", SHARDS, out, "--dtype", "bf16", "--hf-assets", CASE / "fp8")
    assert proc.returncode == 0, proc.stderr
    assert _output_tensors(out) == _output_tensors(CASE / "expected")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert "dequantized 14 block-FP8 weights to bf16" in " ".join(proc.stdout.split()), proc.stdout


def test_a_hugging_face_fp8_folder_with_scales_in_other_files_dequantizes(tmp_path: Path) -> None:
    """Three files, attention scales in another file than their weights: found by name; the folder's own
    config is published without ``quantization_config``, its index without the scales."""
    case, out = CASE.parent / "llama-h192-dequant", tmp_path / "out"
    mpicons.consolidate(case / "fp8", out, dtype="bf16", comm=SingleProcess())
    assert _output_tensors(out) == _output_tensors(case / "expected")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not [name for name in index["weight_map"] if name.endswith("_scale_inv")]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_inspect_shows_the_dequantized_model() -> None:
    report = mpicons.inspect(SHARDS, dtype="bf16", comm=SingleProcess())
    assert not report.problems
    assert {t.dtype for t in report.tensors} == {"BF16"} and not [t for t in report.tensors if t.name.endswith("_scale_inv")]


def test_one_of_a_weight_and_its_scales_kept_out_of_the_conversion_is_refused(tmp_path: Path) -> None:
    """``--keep-dtype`` for the FP8 weights alone: their scales would be cast and the weights not dequantized."""
    with pytest.raises(InputError, match=r"block-quantized FP8 \(its scales are '.*_scale_inv'\)") as caught:
        mpicons.consolidate(SHARDS, tmp_path / "out", dtype="bf16", keep_dtype=("*_proj.weight",), comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()
    proc, _ = cli(2, "consolidate", SHARDS, tmp_path / "cli", "--dtype", "bf16", "--keep-dtype", "*_proj.weight")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--keep-dtype" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_transformers_loads_the_outputs_with_the_reference_logits(tmp_path: Path) -> None:
    """Dequantized (DCP-sharded, and a folder with scales in other files): the fixtures' reference logits
    exactly. Quantized: transformers cannot dequantize these dimensions on CPU (tests/fixtures/fp8/FACTS.md),
    so the quantized output is dequantized by mpicons and loaded: the logits of the fixture's FP8 model."""
    mpicons.consolidate(SHARDS, tmp_path / "dcp", dtype="bf16", hf_assets=str(CASE / "fp8"), comm=SingleProcess())
    folder = CASE.parent / "llama-h192-dequant"
    mpicons.consolidate(folder / "fp8", tmp_path / "folder", dtype="bf16", comm=SingleProcess())
    mpicons.consolidate(QUANTIZE / "bf16", tmp_path / "fp8", dtype="fp8", comm=SingleProcess())
    mpicons.consolidate(tmp_path / "fp8", tmp_path / "back", dtype="bf16", comm=SingleProcess())
    pairs = [
        (tmp_path / "dcp", CASE / "ref_logits.pt"),
        (tmp_path / "folder", folder / "ref_logits.pt"),
        (tmp_path / "back", QUANTIZE / "ref_logits.pt"),
    ]
    for report in reference_logits_reports(pairs):
        assert report["equal"], report


def test_fp8_weights_kept_out_of_the_conversion_with_their_scales_pass(tmp_path: Path) -> None:
    """``--keep-dtype`` for the FP8 weights and their scales: they come out exactly, the rest converted."""
    out = tmp_path / "out"
    mpicons.consolidate(SHARDS, out, dtype="fp32", keep_dtype=("*_proj.weight", "*_scale_inv"), comm=SingleProcess())
    expected = load_tensors(CASE / "expected-fp8" / "model.safetensors")
    got = _output_tensors(out)
    assert {name: got[name] for name in got if name.endswith(("_proj.weight", "_scale_inv"))} == {
        name: expected[name] for name in expected if name.endswith(("_proj.weight", "_scale_inv"))
    }
    assert {kind for name, (kind, _, _) in got.items() if not name.endswith(("_proj.weight", "_scale_inv"))} == {"F32"}


QUANTIZE = CASE.parent / "llama-h192-quantize"


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_dtype_fp8_quantizes_the_decoder_linears_exactly(ranks: int, tmp_path: Path) -> None:
    """``--dtype fp8``: the FP8 bytes and scales of the fixture (amax / 448, ties to even, an all-zero block's
    scale 1.0, an outlier, partial edge blocks), with blocks whose rows are several ranks'; embeddings,
    norms and ``lm_head`` as saved; the config gains DeepSeek-V3's ``quantization_config``."""
    out = tmp_path / "out"
    proc, _ = cli(ranks, "consolidate", QUANTIZE / "bf16", out, "--dtype", "fp8")
    assert proc.returncode == 0, proc.stderr
    assert _output_tensors(out) == _output_tensors(QUANTIZE / "expected-fp8")
    expected_config = json.loads((QUANTIZE / "expected-fp8" / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["quantization_config"] == expected_config["quantization_config"]
    assert "quantized 14 weights to block FP8" in " ".join(proc.stdout.split()), proc.stdout


def test_dtype_fp8_keeps_what_keep_dtype_names(tmp_path: Path) -> None:
    out = tmp_path / "out"
    mpicons.consolidate(QUANTIZE / "bf16", out, dtype="fp8", keep_dtype=("*.mlp.*",), comm=SingleProcess())
    got, expected, saved = _output_tensors(out), _output_tensors(QUANTIZE / "expected-fp8"), _output_tensors(QUANTIZE / "bf16")
    assert {name: got[name] for name in got if ".mlp." in name} == {name: saved[name] for name in saved if ".mlp." in name}
    assert {name: got[name] for name in got if ".self_attn." in name} == {
        name: expected[name] for name in expected if ".self_attn." in name
    }


def test_inspect_shows_the_quantized_model() -> None:
    report = mpicons.inspect(QUANTIZE / "bf16", dtype="fp8", comm=SingleProcess())
    dtypes = {t.name: t.dtype for t in report.tensors}
    assert not report.problems and dtypes == {
        name: kind for name, (kind, _, _) in _output_tensors(QUANTIZE / "expected-fp8").items()
    }


def test_quantized_then_dequantized_is_the_fp8_model_dequantized(tmp_path: Path) -> None:
    """The two directions meet: what ``--dtype fp8`` wrote, dequantized, equals the fixture's FP8 model
    dequantized (both by mpicons, from different inputs: the bf16 weights and the expected FP8 bytes)."""
    mpicons.consolidate(QUANTIZE / "bf16", tmp_path / "fp8", dtype="fp8", comm=SingleProcess())
    mpicons.consolidate(tmp_path / "fp8", tmp_path / "back", dtype="bf16", comm=SingleProcess())
    mpicons.consolidate(QUANTIZE / "expected-fp8", tmp_path / "reference", dtype="bf16", comm=SingleProcess())
    assert _output_tensors(tmp_path / "back") == _output_tensors(tmp_path / "reference")


def test_verify_compares_with_the_input_quantized_the_same_way(tmp_path: Path) -> None:
    out = tmp_path / "out"
    mpicons.consolidate(QUANTIZE / "bf16", out, dtype="fp8", comm=SingleProcess())
    report = mpicons.verify(out, against=QUANTIZE / "bf16", dtype="fp8", comm=SingleProcess())
    assert report.ok and report.compared_tensors == 35, report.problems


def test_dtype_fp8_with_nothing_to_quantize_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--dtype fp8 found no weight to quantize") as caught:
        mpicons.consolidate(QUANTIZE / "bf16", tmp_path / "out", dtype="fp8", keep_dtype=("*",), comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()


def test_a_block_size_the_scales_do_not_have_is_refused(tmp_path: Path) -> None:
    """A config saying 64x64 blocks for scales of 128x128 ones would dequantize wrongly: exit 2 naming it."""
    case = tmp_path / "fp8"
    shutil.copytree(CASE.parent / "llama-h192-dequant" / "fp8", case)
    config = json.loads((case / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (case / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"weight_block_size is not the checkpoint's") as caught:
        mpicons.consolidate(case, tmp_path / "out", dtype="bf16", comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()
