"""LoRA merges and block FP8 at the communicator's size (the suite runs at 1-4 ranks, so blocks and a
module's rows fall to several ranks, and with 4 ranks some get no rows of a tensor): every output equals
the fixture's expected tensors, byte for byte, with a small buffer (many blocks per tensor)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tensors
from mpi4py import MPI

import mpicons

pytestmark = pytest.mark.mpi

FIXTURES = Path(__file__).parent / "fixtures"
LORA, FP8 = FIXTURES / "lora", FIXTURES / "fp8"


def _tensors(directory: Path) -> dict:
    found: dict = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_tensors(path))
    return found


@pytest.mark.parametrize("case", ["llama-bf16", "llama-dora", "llama-lmhead-saved"])
def test_a_peft_adapter_merges_at_any_rank_count(case: str, mpi_tmp_path: Path) -> None:
    out = mpi_tmp_path / "out"
    mpicons.consolidate(LORA / case / "base", out, lora=str(LORA / case / "adapter"), comm=MPI.COMM_WORLD, buffer_size=1 << 16)
    assert _tensors(out) == _tensors(LORA / case / "expected")


def test_a_verl_lora_actor_merges_at_any_rank_count(mpi_tmp_path: Path) -> None:
    case = LORA / "verl-llama-lora-fsdp2"
    out = mpi_tmp_path / "out"
    mpicons.consolidate(case / "checkpoint", out, dtype="bf16", comm=MPI.COMM_WORLD, buffer_size=1 << 16)
    assert _tensors(out) == _tensors(case / "expected")


def test_dcp_sharded_fp8_dequantizes_at_any_rank_count(mpi_tmp_path: Path) -> None:
    case = FP8 / "llama-h192-dcp-2ranks"
    out = mpi_tmp_path / "out"
    mpicons.consolidate(case / "fp8" / "sharded", out, dtype="bf16", comm=MPI.COMM_WORLD, buffer_size=1 << 16)
    assert _tensors(out) == _tensors(case / "expected")


def test_quantizes_at_any_rank_count(mpi_tmp_path: Path) -> None:
    case = FP8 / "llama-h192-quantize"
    out = mpi_tmp_path / "out"
    mpicons.consolidate(case / "bf16", out, dtype="fp8", comm=MPI.COMM_WORLD, buffer_size=1 << 16)
    assert _tensors(out) == _tensors(case / "expected-fp8")
