"""DeepSpeed ZeRO and verl checkpoints consolidated at the communicator's size (the suite runs at 1-4
ranks): every output the bytes safetensors' serializer writes for the training engine's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_tensors, reference_bytes
from mpi4py import MPI

import mpicons

pytestmark = pytest.mark.mpi

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = {
    "zero2": FIXTURES / "deepspeed/llama-zero2",
    "zero3": FIXTURES / "deepspeed/llama-zero3",
    "verl": FIXTURES / "verl/llama-fsdp2",
}


@pytest.mark.parametrize("split", ["bytes", "files"])
@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_trainer_checkpoint_consolidates_to_the_engines_weights(case: str, split: str, mpi_tmp_path: Path) -> None:
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(CHECKPOINTS[case] / "checkpoint", out, comm=comm, split=split, buffer_size=1 << 16)
    expected = load_tensors(CHECKPOINTS[case] / "expected-fp32" / "model.safetensors")
    assert sum(result.bytes_per_rank) == result.total_bytes
    assert (out / "model.safetensors").read_bytes() == reference_bytes(expected)
