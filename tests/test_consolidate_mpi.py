"""Consolidation at the communicator's size (the suite runs at 1, 2, 3 and 4 ranks)."""

from __future__ import annotations

import json

import pytest
from helpers import FIXTURE_NAMES, FIXTURES, assert_consolidated, fixture_expected, index_weight_map, sample_expected, slow_beyond
from mpi4py import MPI

import mpicons
from mpicons.sample import SampleConfig, expected_mapping, write_sample

pytestmark = pytest.mark.mpi


def _shared_path(mpi_tmp_path):
    return mpi_tmp_path


@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
@pytest.mark.parametrize(
    "split, io", [("bytes", "posix"), ("files", "mpiio"), *slow_beyond([("bytes", "mpiio"), ("files", "posix")], 0)]
)
def test_fixture_consolidates_to_reference_bytes(fixture, split, io, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(FIXTURES / fixture / "sharded", out, comm=comm, split=split, io=io, buffer_size=1 << 16)
    expected, mapping = fixture_expected(fixture)
    assert result.total_bytes == sum(len(d) for _, _, d in expected.values())
    assert sum(result.bytes_per_rank) == result.total_bytes
    assert_consolidated(out, expected, index_weight_map(mapping))


@pytest.mark.parametrize("form", ["fqn", "weight_map"])
def test_mapping_overrides_file_assignment(form, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    fixture = "fsdp2-3ranks"
    expected, mapping = fixture_expected(fixture)
    names = sorted(expected)
    if form == "fqn":
        override = {name: 1 + i % 4 for i, name in enumerate(names)}
        weight_map = index_weight_map(override)
    else:
        weight_map = {name: ("weights-a.safetensors" if i % 3 else "weights-b.safetensors") for i, name in enumerate(names)}
        override = {"metadata": {}, "weight_map": weight_map}
    path = mpi_tmp_path / "mapping.json"
    if comm.rank == 0:
        path.write_text(json.dumps(override))
    comm.Barrier()
    out = mpi_tmp_path / "out"
    mpicons.consolidate(FIXTURES / fixture / "sharded", out, comm=comm, mapping=str(path))
    assert_consolidated(out, expected, weight_map)


@pytest.mark.parametrize("buffer_size", [1 << 16, 32 << 20])
def test_sample_consolidates(buffer_size, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    config = SampleConfig(layers=3, hidden=80, intermediate=200, vocab=517, files=3)
    write_sample(mpi_tmp_path / "sharded", config, comm)
    out = mpi_tmp_path / "out"
    mpicons.consolidate(mpi_tmp_path / "sharded", out, comm=comm, buffer_size=buffer_size)
    assert_consolidated(out, sample_expected(config), expected_mapping(config))


def test_rows_larger_than_the_buffer(mpi_tmp_path):
    """Column-sharded rows bigger than the buffer are assembled piecewise, still byte-exact."""
    comm = MPI.COMM_WORLD
    config = SampleConfig(layers=1, hidden=512, intermediate=40, kv_dim=8, vocab=20, files=1, experts=1)
    write_sample(mpi_tmp_path / "sharded", config, comm)
    out = mpi_tmp_path / "out"
    mpicons.consolidate(mpi_tmp_path / "sharded", out, comm=comm, buffer_size=512)  # a row of 512 BF16 is 1 KiB
    assert_consolidated(out, sample_expected(config), expected_mapping(config))


def test_sub_communicator_leaves_the_rest_alone(mpi_tmp_path):
    """Each half of the job consolidates on its own sub-communicator, with identical results.

    Asserted only after the last collective (``Free``, ``Barrier``): a rank failing before them would
    leave the others waiting there."""
    world = MPI.COMM_WORLD
    color = world.rank % 2
    sub = world.Split(color, world.rank)
    size = sub.size
    try:
        out = mpi_tmp_path / f"out-{color}"
        result = mpicons.consolidate(FIXTURES / "tp2d-4ranks" / "sharded", out, comm=sub)
    finally:
        sub.Free()
    world.Barrier()
    assert result.stats.ranks == size
    expected, mapping = fixture_expected("tp2d-4ranks")
    assert_consolidated(mpi_tmp_path / f"out-{color}", expected, index_weight_map(mapping))


def test_stats_are_reduced_over_ranks(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    result = mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", mpi_tmp_path / "out", comm=comm)
    stats = result.stats
    gathered = comm.allgather(stats.to_dict())  # before any assertion: a rank failing first would leave the rest here
    assert all(g == gathered[0] for g in gathered)
    assert stats.ranks == comm.size
    assert set(stats.phases) == {"scan", "plan", "write", "finalize"}
    for spread in stats.phases.values():
        assert 0 <= spread.min <= spread.mean <= spread.max
    assert stats.bytes_per_rank.mean * comm.size == pytest.approx(stats.total_bytes)


def test_balanced_split_on_one_output_file(mpi_tmp_path):
    """A single output file still gets shared by every rank (max/mean bytes ≤ 1.10)."""
    comm = MPI.COMM_WORLD
    config = SampleConfig(layers=2, hidden=128, intermediate=344, vocab=2000, files=1)
    write_sample(mpi_tmp_path / "sharded", config, comm)
    result = mpicons.consolidate(mpi_tmp_path / "sharded", mpi_tmp_path / "out", comm=comm)
    assert result.stats.imbalance <= 1.10
    assert_consolidated(mpi_tmp_path / "out", sample_expected(config), expected_mapping(config))


@pytest.mark.parametrize("io_threads", [0, 1, 3])
def test_background_io_threads_and_no_sync_give_the_same_bytes(io_threads, mpi_tmp_path, monkeypatch):
    monkeypatch.setenv("MPICONS_IO_THREADS", str(io_threads))  # read when the options are made
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", out, comm=comm, sync=False, buffer_size=1 << 16)
    expected, mapping = fixture_expected("edge-3ranks")
    assert_consolidated(out, expected, index_weight_map(mapping))
