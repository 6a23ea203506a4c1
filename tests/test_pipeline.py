"""``inspect`` shows what ``consolidate`` writes: both run the one pipeline (``mpicons/job/pipeline.py``),
checked here on a checkpoint of every trainer against the files the consolidation wrote, read back with
the safetensors library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import mpicons
from mpicons.comm import SingleProcess

FIXTURES = Path(__file__).parent / "fixtures"
INPUTS = {
    "dcp": (FIXTURES / "dcp" / "tp2d-4ranks" / "sharded", {}),
    "distcp": (FIXTURES / "distcp" / "fsdp-3ranks" / "dcp", {}),
    "torchtitan": (
        FIXTURES / "torchtitan" / "llama3-fsdp2" / "native",
        {"adapter": "torchtitan", "hf_assets": str(FIXTURES / "torchtitan" / "llama3-fsdp2" / "hf-assets")},
    ),
    "megatron": (FIXTURES / "megatron" / "qwen2-tp2" / "checkpoint", {}),
    "megatron moe": (FIXTURES / "megatron" / "deepseekv3-ep2" / "checkpoint", {}),
    "deepspeed zero2": (FIXTURES / "deepspeed" / "llama-zero2" / "checkpoint", {}),
    "deepspeed zero3": (FIXTURES / "deepspeed" / "llama-zero3" / "checkpoint", {}),
    "verl": (FIXTURES / "verl" / "llama-fsdp2" / "checkpoint", {}),
    "accelerate": (FIXTURES / "accelerate" / "checkpoint-2", {}),
    "verl lora": (FIXTURES / "lora" / "verl-llama-lora-fsdp2" / "checkpoint", {}),
    "peft lora": (
        FIXTURES / "lora" / "llama-lmhead-saved" / "base",
        {"lora": str(FIXTURES / "lora" / "llama-lmhead-saved" / "adapter")},
    ),
    "fp8 dequantized": (FIXTURES / "fp8" / "llama-h192-dequant" / "fp8", {"dtype": "bf16"}),
    "fp8 quantized": (FIXTURES / "fp8" / "llama-h192-quantize" / "bf16", {"dtype": "fp8"}),
}


def _written(out: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Every tensor of the output as its file, dtype and shape, read with safetensors."""
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    found = {}
    for name in files:
        with safe_open(out / name, framework="numpy") as handle:
            for tensor in handle.keys():
                view = handle.get_slice(tensor)
                found[tensor] = (name, view.get_dtype(), tuple(view.get_shape()))
    return found


@pytest.mark.parametrize("case", list(INPUTS))
def test_inspect_shows_what_consolidate_writes(case: str, tmp_path: Path) -> None:
    source, options = INPUTS[case]
    report = mpicons.inspect(source, comm=SingleProcess(), **options)
    assert report.ok, report.problems
    result = mpicons.consolidate(source, tmp_path / "out", comm=SingleProcess(), **options)
    written = _written(tmp_path / "out")
    shown = {t.name: (t.file, t.dtype, tuple(t.shape)) for t in report.tensors}
    assert shown == written
    assert [(f.name, f.size) for f in report.files] == [(name, (tmp_path / "out" / name).stat().st_size) for name in result.files]
    assert report.total_bytes == result.total_bytes
