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


def test_every_option_is_in_exactly_one_group() -> None:
    """Each layer is handed only its group of the options (selection, publishing, storage, tuning): a new
    option must join one, or it would reach no layer that needs it."""
    from dataclasses import fields

    from mpicons.core.options import Options, Publishing, Selection, Storage, Tuning

    grouped = [f.name for group in (Selection, Publishing, Storage, Tuning) for f in fields(group)]
    assert sorted(grouped) == sorted(f.name for f in fields(Options))
    changed = Options(buffer_size=1 << 20, include=("a*",), s3_part_size=16 << 20, force=True)
    assert changed.tuning.buffer_size == 1 << 20 and changed.selection.include == ("a*",)
    assert changed.storage.s3_part_size == 16 << 20 and changed.publishing.force is True
