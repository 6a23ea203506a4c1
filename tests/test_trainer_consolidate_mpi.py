"""DeepSpeed ZeRO and verl checkpoints consolidated at the communicator's size (the suite runs at 1-4
ranks): every output the bytes safetensors' serializer writes for the training engine's weights, in
fp32 and rounded to bf16 with the Hugging Face assets beside them; and the ZeRO-3 sample (tied
embeddings, padding on the last rank) written by rank 0."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import load_tensors, reference_bytes
from mpi4py import MPI

import mpicons
from mpicons.sample import ZeroSampleConfig, write_zero_sample, zero_expected_hf

pytestmark = pytest.mark.mpi

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = {
    "zero2": FIXTURES / "deepspeed/llama-zero2",
    "zero3": FIXTURES / "deepspeed/llama-zero3",
    "verl": FIXTURES / "verl/llama-fsdp2",
}


def _bf16(tensors: dict[str, tuple[str, list[int], bytes]]) -> dict[str, tuple[str, list[int], bytes]]:
    """fp32 tensors rounded to bf16 by numpy (round to nearest even)."""
    rounded = {}
    for name, (dtype, shape, data) in tensors.items():
        assert dtype == "F32", name
        rounded[name] = ("BF16", shape, np.frombuffer(data, dtype=np.float32).astype(ml_dtypes.bfloat16).tobytes())
    return rounded


@pytest.mark.parametrize("split", ["bytes", "files"])
@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_trainer_checkpoint_consolidates_to_the_engines_weights(case: str, split: str, mpi_tmp_path: Path) -> None:
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(CHECKPOINTS[case] / "checkpoint", out, comm=comm, split=split, buffer_size=1 << 16)
    expected = load_tensors(CHECKPOINTS[case] / "expected-fp32" / "model.safetensors")
    assert sum(result.bytes_per_rank) == result.total_bytes
    assert (out / "model.safetensors").read_bytes() == reference_bytes(expected)


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_bf16_with_the_hf_assets(case: str, mpi_tmp_path: Path) -> None:
    """``--dtype bf16 --hf-assets HF`` (verl: its own huggingface/ folder, found by itself)."""
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    assets = CHECKPOINTS[case] / "hf"
    mpicons.consolidate(
        CHECKPOINTS[case] / "checkpoint", out, comm=comm, dtype="bf16", hf_assets=str(assets) if assets.is_dir() else None
    )
    expected = _bf16(load_tensors(CHECKPOINTS[case] / "expected-fp32" / "model.safetensors"))
    assert (out / "model.safetensors").read_bytes() == reference_bytes(expected)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_zero3_sample_with_tied_embeddings(mpi_tmp_path: Path) -> None:
    comm = MPI.COMM_WORLD
    config = ZeroSampleConfig(layers=1, hidden=48, ffn=40, heads=4, kv_heads=1, head_dim=12, vocab=131, world=3, tied=True)
    if comm.rank == 0:
        write_zero_sample(mpi_tmp_path / "run", config)
    comm.barrier()
    mpicons.consolidate(mpi_tmp_path / "run", mpi_tmp_path / "out", comm=comm, sync=False)
    expected = {name: ("F32", list(value.shape), value.tobytes()) for name, value in zero_expected_hf(config)}
    assert "lm_head.weight" not in expected
    assert (mpi_tmp_path / "out" / "model.safetensors").read_bytes() == reference_bytes(expected)
