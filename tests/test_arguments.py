"""Every rank of a collective call passes the same arguments: a mismatch is one InputError on every rank."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

import mpicons
from mpicons.core.errors import InputError


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_output_directories_all_raise(mpi_tmp_path):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mine = mpi_tmp_path / f"out-{comm.rank}"
    outcome = None
    try:
        mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", mine, comm=comm)
    except InputError as exc:
        outcome = str(exc)
    outcomes = comm.allgather(outcome)
    assert all(o is not None and o.startswith("[rank 1] consolidate: argument output differs between ranks") for o in outcomes)
    assert str(mpi_tmp_path / "out-1") in outcomes[0] and str(mpi_tmp_path / "out-0") in outcomes[0]
    assert not any(p.name.startswith("out-") for p in mpi_tmp_path.iterdir())


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_verify_options_all_raise(mpi_tmp_path):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    outcome = None
    try:
        mpicons.verify(mpi_tmp_path, comm=comm, dtype="bf16" if comm.rank == comm.size - 1 else None)
    except InputError as exc:
        outcome = str(exc)
    outcomes = comm.allgather(outcome)
    assert all(o is not None and f"[rank {comm.size - 1}] verify: argument dtype differs" in o for o in outcomes)
