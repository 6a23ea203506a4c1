"""Block-FP8 checkpoints (DeepSeek-V3's layout: ``F8_E4M3`` weights, a float32 ``weight_scale_inv`` per
128×128 block), on the fixture torch's DCP wrote over 2 ranks with block rows split between them
(tests/fixtures/fp8). Consolidated exactly as they are; a ``--dtype`` that would cast the FP8 values
without their scales is refused, since the result would load and be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import cli, load_tensors

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


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_dtype_that_would_cast_fp8_without_its_scales_is_refused(dtype: str, tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"block-quantized FP8 \(its scales are '.*_scale_inv'\)") as caught:
        mpicons.consolidate(SHARDS, tmp_path / "out", dtype=dtype, comm=SingleProcess())
    assert caught.value.exit_code == 2 and not (tmp_path / "out").exists()
    proc, _ = cli(2, "consolidate", SHARDS, tmp_path / "cli", "--dtype", dtype)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--keep-dtype" in proc.stderr, proc.stderr
    report = mpicons.inspect(SHARDS, dtype=dtype, comm=SingleProcess())
    assert sorted(p.tensor for p in report.problems if p.kind == "quantized") == sorted(
        name for name, (kind, _, _) in load_tensors(CASE / "expected-fp8" / "model.safetensors").items() if kind == "F8_E4M3"
    )


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
