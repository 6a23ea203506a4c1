"""``mpicons inspect``: what it reports is checked against facts that do not come from mpicons.

The MPI tests (run at 1-4 ranks) compare the report with the fixtures' full tensors as safetensors
reads them, with the bytes safetensors' own serializer writes, and with what ``consolidate`` really
does; only rank 0 changes shared directories, then every rank synchronises. The command line is
run in subprocesses under ``mpiexec`` from serial tests.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import FIXTURE_NAMES, FIXTURES, cli, fixture_expected, index_weight_map, mpirun, reference_bytes, run_python
from mpi4py import MPI

import mpicons
from mpicons.frontends.inspection import InspectReport, inspect

mpi = pytest.mark.mpi
EDGE = FIXTURES / "edge-3ranks" / "sharded"
FSDP2 = FIXTURES / "fsdp2-3ranks" / "sharded"
# A middle training rank's file: its pieces sit between the others', so deleting it leaves holes.
VICTIM = "shard-00002-model-00001-of-00003.safetensors"


def _inspect(comm: MPI.Intracomm, path: Path, **kwargs: object) -> InspectReport:
    """inspect() on every rank; the report must be the same everywhere."""
    report = inspect(path, comm=comm, **kwargs)
    gathered = comm.allgather(json.dumps(report.to_dict(), sort_keys=True))
    assert all(g == gathered[0] for g in gathered)
    return report


def _shared_copy(comm: MPI.Intracomm, source: Path, target: Path, delete: str | None = None) -> None:
    """Rank 0 copies (and damages) the checkpoint; every rank learns whether that worked and waits for it."""
    error = None
    if comm.rank == 0:
        try:
            shutil.copytree(source, target)
            if delete:
                (target / delete).unlink()
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = repr(exc)
    assert comm.bcast(error, root=0) is None


def _dcp_header(path: Path) -> dict[str, tuple[list[int], list[int]]]:
    """name → (piece shape, saved offsets), read straight from the file's JSON header."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    info = json.loads(header.pop("__metadata__")["DCP_SHARDING_INFO"])
    return {name: (entry["shape"], info[name]["saved_offsets"]) for name, entry in header.items()}


# ---------------------------------------------------------------- MPI: numbers against independent facts


@mpi
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_report_matches_the_fixture(fixture):
    comm = MPI.COMM_WORLD
    sharded = FIXTURES / fixture / "sharded"
    report = _inspect(comm, sharded)
    expected, mapping = fixture_expected(fixture)
    weight_map = index_weight_map(mapping)
    assert report.ok and report.problems == []

    assert report.total_bytes == sum(len(data) for _, _, data in expected.values())
    got = {t.name: (t.dtype, list(t.shape), t.bytes, t.file, t.status) for t in report.tensors}
    assert got == {name: (d, s, len(b), weight_map[name], "ok") for name, (d, s, b) in expected.items()}

    assert [f.name for f in report.files] == sorted(set(weight_map.values()))
    for out in report.files:
        members = {n: expected[n] for n, f in weight_map.items() if f == out.name}
        assert out.tensors == len(members)
        assert out.tensor_bytes == sum(len(b) for _, _, b in members.values())
        assert out.size == len(reference_bytes(members))

    files = sorted(p.name for p in sharded.iterdir())
    assert [s.name for s in report.shards] == files
    assert [s.size for s in report.shards] == [(sharded / f).stat().st_size for f in files]
    assert [s.pieces for s in report.shards] == [len(_dcp_header(sharded / f)) for f in files]
    origin = json.loads((FIXTURES / fixture / "expected" / "origin.json").read_text())
    assert len(report.training_ranks) == origin["world_size"]

    assert len(report.per_rank) == comm.size
    assert sum(report.bytes_per_rank) == report.total_bytes
    assert report.imbalance == pytest.approx(max(report.bytes_per_rank) * comm.size / report.total_bytes)
    summary = report.to_dict()["summary"]
    assert summary["tensors"] == len(expected) and summary["output_files"] == len(set(weight_map.values()))
    assert summary["shard_files"] == len(files) and summary["total_bytes"] == report.total_bytes


@mpi
@pytest.mark.parametrize("split", ["bytes", "files"])
def test_preview_for_a_bigger_job(split):
    """``ranks=7`` from any job size: seven shares that write every row of every tensor exactly once."""
    comm = MPI.COMM_WORLD
    report = _inspect(comm, EDGE, ranks=7, split=split)
    expected, mapping = fixture_expected("edge-3ranks")
    assert report.ranks == 7 and report.job_ranks == comm.size
    assert [r.rank for r in report.per_rank] == list(range(7))
    assert sum(report.bytes_per_rank) == report.total_bytes
    rows: dict[str, list[tuple[int, int]]] = {}
    written: dict[str, int] = {}
    for share in report.per_rank:
        assert share.bytes == sum(size for _, _, _, size in share.work)
        for name, begin, end, size in share.work:
            rows.setdefault(name, []).append((begin, end))
            written[name] = written.get(name, 0) + size
    assert written == {name: len(data) for name, (_, _, data) in expected.items() if data}
    for name, ranges in rows.items():
        ranges.sort()
        shape = expected[name][1]
        assert ranges[0][0] == 0 and ranges[-1][1] == (shape[0] if shape else 1)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if split == "files":
        busy = [r for r in report.per_rank if r.bytes]
        assert len(busy) == len(set(mapping.values()))  # whole files: only as many busy ranks as files


@mpi
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
@pytest.mark.parametrize("split", ["bytes", pytest.param("files", marks=pytest.mark.slow)])
def test_per_rank_work_is_what_consolidate_does(fixture, split, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    report = _inspect(comm, FIXTURES / fixture / "sharded", split=split)
    result = mpicons.consolidate(FIXTURES / fixture / "sharded", mpi_tmp_path / "out", comm=comm, split=split)
    plan = result.layout
    assert report.bytes_per_rank == plan.bytes_per_rank()
    assert [[(n, a, b) for n, a, b, _ in share.work] for share in report.per_rank] == [
        [(plan.tensors[i.tensor].name, i.row_begin, i.row_end) for i in items] for items in plan.work
    ]
    # The bytes each rank actually wrote, reduced by the job's own statistics.
    assert result.stats.bytes_per_rank.max == max(report.bytes_per_rank)
    assert result.stats.bytes_per_rank.min == min(report.bytes_per_rank)
    assert [f.name for f in report.files] == result.files
    assert [f.size for f in report.files] == [(mpi_tmp_path / "out" / f).stat().st_size for f in result.files]


@mpi
def test_missing_shard_lists_every_hole(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    broken = mpi_tmp_path / "sharded"
    _shared_copy(comm, FSDP2, broken, delete=VICTIM)
    report = _inspect(comm, broken, ranks=5)
    expected, mapping = fixture_expected("fsdp2-3ranks")

    # Pieces of the deleted file that end before their tensor does leave a hole (FSDP2 cuts along dim 0).
    lost = _dcp_header(FSDP2 / VICTIM)
    holes = {
        name
        for name, (shape, offsets) in lost.items()
        if np.prod(shape) > 0 and any(o + s < f for o, s, f in zip(offsets, shape, expected[name][1]))
    }
    assert holes
    assert not report.ok and report.layout is None and report.per_rank == []
    assert {p.tensor for p in report.problems} == holes
    for problem in report.problems:
        assert f"tensor {problem.tensor!r}" in problem.what and ": hole:" in problem.what
    assert {t.name: t.status for t in report.tensors} == {n: "hole" if n in holes else "ok" for n in expected}
    # Still a full description: every tensor, every remaining shard, the output files from the names.
    assert len(report.shards) == len(list(FSDP2.iterdir())) - 1
    assert {f.name for f in report.files} == set(index_weight_map(mapping).values())
    assert any(VICTIM in note for note in report.notes)
    text = report.table(limit=0)
    assert VICTIM in text and text.count(": hole:") == len(holes)
    assert f"{len(holes)} problems" in text


@mpi
def test_mapping_that_does_not_match_is_a_problem_not_a_crash(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    expected, mapping = fixture_expected("edge-3ranks")
    partial = dict(sorted(mapping.items())[1:])
    report = _inspect(comm, EDGE, mapping=partial)
    assert not report.ok
    assert [p.tensor for p in report.problems] == [None]
    dropped = sorted(mapping)[0]
    assert "mapping" in report.problems[0].what and repr(dropped) in report.problems[0].what
    assert all(t.status == "ok" for t in report.tensors)  # the tensors themselves are fine
    assert len(report.tensors) == len(expected)

    path = mpi_tmp_path / "mapping.json"
    if comm.rank == 0:
        path.write_text(json.dumps({name: 1 + i % 3 for i, name in enumerate(sorted(expected))}))
    comm.Barrier()
    report = _inspect(comm, EDGE, mapping=str(path))
    assert report.ok and report.mapping == str(path)
    assert [f.name for f in report.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


# ---------------------------------------------------------------- serial: table layout


def _write_plain(folder: Path, count: int) -> list[str]:
    """A plain (non-DCP) safetensors file with ``count`` long-named tensors."""
    folder.mkdir()
    names = [f"model.layers.{i}.block_sparse_moe.experts.{i * 7}.an_unusually_long_projection_name.weight" for i in range(count)]
    tensors = {name: ("BF16", [3, 5], bytes(range(30))) for name in names}
    (folder / "weights.safetensors").write_bytes(reference_bytes(tensors))
    return names


def test_table_fits_100_columns_and_respects_the_limit(tmp_path):
    names = _write_plain(tmp_path / "plain", 60)
    report = inspect(tmp_path / "plain", comm=MPI.COMM_SELF, ranks=64)
    assert report.ok and len(report.tensors) == 60 and report.training_ranks == []
    text = report.table()
    assert all(len(line) <= 100 for line in text.splitlines()), max(text.splitlines(), key=len)
    assert "tensors (first 50 of 60;" in text and "... and 10 more tensors" in text
    assert "(first 50 of 64;" in text and "... and 14 more ranks" in text
    assert "64 ranks (this run has 1)" in text
    full = report.table(limit=0)
    assert "more tensors" not in full and len(full.splitlines()) > len(text.splitlines())
    # Natural order: layers.2 before layers.10.
    assert [t.name for t in report.tensors] == names


# ---------------------------------------------------------------- the command line


def test_cli_broken_checkpoint_prints_the_report_and_exits_2(tmp_path):
    broken = tmp_path / "sharded"
    shutil.copytree(FSDP2, broken)
    (broken / VICTIM).unlink()
    proc, _ = mpirun(3, ["-m", "mpicons", "inspect", str(broken), "--limit", "5"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.count("mpicons inspect:") == 1  # rank 0 alone prints
    assert ": hole:" in proc.stdout and "problems (first 5 of" in proc.stdout and VICTIM in proc.stdout
    assert "Traceback" not in proc.stderr

    proc, _ = mpirun(2, ["-m", "mpicons", "inspect", str(broken), "--json", "-"])
    assert proc.returncode == 2, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["summary"]["planned"] is False
    assert report["problems"] and all(": hole:" in p["what"] for p in report["problems"])
    assert len(report["tensors"]) == len(fixture_expected("fsdp2-3ranks")[0])


def test_cli_preview_writes_json(tmp_path):
    out = tmp_path / "report.json"
    proc, _ = mpirun(2, ["-m", "mpicons", "inspect", str(EDGE), "--ranks", "7", "--split", "files", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "status   OK" in proc.stdout
    report = json.loads(out.read_text())
    expected, _ = fixture_expected("edge-3ranks")
    assert report["ok"] is True and report["ranks"] == 7 and report["job_ranks"] == 2 and report["split"] == "files"
    assert len(report["per_rank"]) == 7
    assert sum(r["bytes"] for r in report["per_rank"]) == report["summary"]["total_bytes"]
    assert report["summary"]["total_bytes"] == sum(len(d) for _, _, d in expected.values())
    assert {t["name"] for t in report["tensors"]} == set(expected)


def test_cli_without_a_launcher(tmp_path):
    proc = run_python("-m", "mpicons", "inspect", EDGE, "--limit", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert all(len(line) <= 100 for line in proc.stdout.splitlines())
    assert "... and 24 more tensors" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written in the working directory


def test_cli_a_shard_reaching_past_2_to_the_63_bytes_is_one_line_exit_2(tmp_path):
    """One F32 piece at offsets [2**40, 2**40]: its full tensor would be 2**82 bytes."""
    sharding = json.dumps({"w": {"saved_offsets": [2**40, 2**40]}})
    header = json.dumps(
        {
            "__metadata__": {"format": "pt", "DCP_SHARDING_INFO": sharding},
            "w": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]},
        }
    ).encode()
    (tmp_path / "shard-00001-model-00001-of-00001.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    proc, _ = cli(1, "inspect", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "2**63 bytes or more" in proc.stderr, proc.stderr
