"""Shards on node-local disks: each rank sees only some files; data moves over MPI where needed."""

from __future__ import annotations

import shutil

import pytest
from helpers import assert_consolidated, sample_expected
from mpi4py import MPI

import mpicons
from mpicons.core.errors import InputError
from mpicons.sample import SampleConfig, expected_mapping, write_sample

pytestmark = pytest.mark.mpi

CONFIG = SampleConfig(layers=2, hidden=64, intermediate=136, vocab=301, files=3)


def _spread(root, comm, layout: str, drop: str | None = None) -> str:
    """Rank 0 writes the sample, then copies each shard into some ranks' directories ``in-{rank}``."""
    shared = root / "shared"
    write_sample(shared, CONFIG, comm)
    if comm.rank == 0:
        for rank in range(comm.size):
            (root / f"in-{rank}").mkdir()
        for i, path in enumerate(sorted(shared.iterdir())):
            if path.name == drop:
                continue
            owners = {i % comm.size}
            if layout == "overlapping" and i % 2 == 0:
                owners.add((i + 1) % comm.size)  # some files on two ranks, the rest on one
            for rank in owners:
                shutil.copy(path, root / f"in-{rank}" / path.name)
    comm.Barrier()
    return str(root / "in-{rank}")


@pytest.mark.parametrize("layout", ["exclusive", "overlapping"])
@pytest.mark.parametrize("gather_to", [None, "last"])
def test_local_shards_give_the_shared_filesystem_bytes(layout, gather_to, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    template = _spread(mpi_tmp_path, comm, layout)
    gather = None if gather_to is None else comm.size - 1
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(template, out, comm=comm, gather_to=gather, buffer_size=1 << 18)
    # The reference is made before any assertion: a rank failing first would leave the rest in its collectives.
    shared = mpicons.consolidate(mpi_tmp_path / "shared", mpi_tmp_path / "reference", comm=comm)
    assert result.shared_input == (comm.size == 1)
    assert sum(result.bytes_per_rank) == result.total_bytes
    if gather is not None:
        assert result.bytes_per_rank[gather] == result.total_bytes
    if gather is not None:
        sees_all = len(list((mpi_tmp_path / f"in-{gather}").iterdir())) == len(list((mpi_tmp_path / "shared").iterdir()))
        assert (result.moved_bytes == 0) == sees_all
    elif comm.size > 1:
        assert result.moved_bytes > 0  # column-sharded tensors need pieces from other ranks
    assert_consolidated(out, sample_expected(CONFIG), expected_mapping(CONFIG))
    for name in shared.files:
        assert (out / name).read_bytes() == (mpi_tmp_path / "reference" / name).read_bytes()


def test_local_shards_with_conversion_and_mpiio(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    template = _spread(mpi_tmp_path, comm, "overlapping")
    mpicons.consolidate(template, mpi_tmp_path / "a", comm=comm, dtype="fp32", io="mpiio", buffer_size=1 << 17)
    mpicons.consolidate(mpi_tmp_path / "shared", mpi_tmp_path / "b", comm=comm, dtype="fp32")
    for path in sorted((mpi_tmp_path / "b").iterdir()):
        assert (mpi_tmp_path / "a" / path.name).read_bytes() == path.read_bytes()


def test_a_file_no_rank_sees_is_named(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    missing = "shard-00002-model-00001-of-00003.safetensors"
    template = _spread(mpi_tmp_path, comm, "exclusive", drop=missing)
    with pytest.raises(InputError, match=missing):
        mpicons.consolidate(template, mpi_tmp_path / "out", comm=comm)
    assert not (mpi_tmp_path / "out").exists() or list((mpi_tmp_path / "out").iterdir()) == []


@pytest.mark.mpi(min_size=2)
def test_same_name_different_content_is_refused(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    template = _spread(mpi_tmp_path, comm, "exclusive")
    if comm.rank == 0:
        (mpi_tmp_path / "in-1" / "shard-00001-model-00001-of-00003.safetensors").write_bytes(b"\0" * 16)
    comm.Barrier()
    with pytest.raises(InputError, match="ranks see different files under this name"):
        mpicons.consolidate(template, mpi_tmp_path / "out", comm=comm)
