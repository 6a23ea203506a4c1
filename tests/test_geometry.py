"""The geometry engine on random checkpoints: every output file equals safetensors' own serializer's
bytes for the full tensors, at the communicator's size (1-4 ranks), with the shards on a shared
directory or spread over per-rank directories, with small buffers (many blocks, rows split inside)
and with dtype conversion.

The checkpoints come from :func:`helpers.random_checkpoint`: row, column, 2-D and 3-D cuts, empty
pieces, replicas, many one-row pieces, every dtype, written with safetensors itself.
"""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
from helpers import FLOATS, assert_consolidated, random_checkpoint, slow_beyond
from mpi4py import MPI

import mpicons

pytestmark = pytest.mark.mpi
SEEDS = slow_beyond(list(range(8)), 3)  # all eight in slow runs
NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def _prepare(comm, tmp_path, seed: int, spread: str):
    """Rank 0 writes the checkpoint (and spreads it over per-rank directories); every rank gets the paths."""
    rng = np.random.default_rng(seed)
    training_ranks = int(rng.integers(1, 9))
    source = tmp_path / "shared"
    expected = weight_map = None
    if comm.rank == 0:
        expected, weight_map = random_checkpoint(rng, source, training_ranks, files=int(rng.integers(1, 4)))
        if spread != "shared":
            files = sorted(source.iterdir())
            for rank in range(comm.size):
                (tmp_path / f"local-{rank}").mkdir()
            for i, path in enumerate(files):
                holders = {i % comm.size} | ({(i + 1) % comm.size} if spread == "overlapping" else set())
                for holder in holders:
                    shutil.copy(path, tmp_path / f"local-{holder}" / path.name)
    expected, weight_map = comm.bcast((expected, weight_map), root=0)
    return (str(source) if spread == "shared" else str(tmp_path / "local-{rank}")), expected, weight_map


def _check(comm, out, expected, weight_map) -> str | None:
    """Rank 0 compares; every rank learns the verdict (a failed assert on one rank must not hang the rest)."""
    verdict = None
    if comm.rank == 0:
        try:
            assert_consolidated(out, expected, weight_map)
        except AssertionError as exc:
            verdict = str(exc) or "differs"
    return comm.bcast(verdict, root=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spread", ["shared", "exclusive", "overlapping"])
def test_random_geometry_is_byte_identical(seed, spread, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    source, expected, weight_map = _prepare(comm, mpi_tmp_path, seed, spread)
    buffer_size = [4096, 1 << 16, 32 << 20][seed % 3]
    out = mpi_tmp_path / "out"
    mpicons.consolidate(source, out, comm=comm, buffer_size=buffer_size, sync=False)
    assert _check(comm, out, expected, weight_map) is None


@pytest.mark.parametrize("seed", SEEDS)
def test_random_geometry_gathered_on_one_rank(seed, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    source, expected, weight_map = _prepare(comm, mpi_tmp_path, seed, "exclusive")
    out = mpi_tmp_path / "out"
    mpicons.consolidate(source, out, comm=comm, buffer_size=1 << 16, gather_to=comm.size - 1, sync=False)
    comm.Barrier()
    assert _check(comm, out, expected, weight_map) is None


@pytest.mark.parametrize("seed", SEEDS)
def test_random_geometry_converted_to_fp32(seed, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    source, expected, weight_map = _prepare(comm, mpi_tmp_path, seed, "shared")
    converted = {}
    for name, (dtype, shape, data) in expected.items():
        if dtype in FLOATS:
            with np.errstate(over="ignore", invalid="ignore"):
                values = np.frombuffer(data, dtype=NUMPY[dtype]).astype(np.float32)
            converted[name] = ("F32", shape, values.tobytes())
        else:
            converted[name] = (dtype, shape, data)
    out = mpi_tmp_path / "out"
    mpicons.consolidate(source, out, comm=comm, buffer_size=1 << 14, dtype="fp32", io="mpiio")
    assert _check(comm, out, converted, weight_map) is None
