"""``mpicons verify``: a sound checkpoint passes, and every kind of damage is reported with its place.

The MPI tests run on every rank at once on a shared directory: only rank 0 damages files (then all
ranks synchronise), every rank calls ``verify`` alike, and assertions are made on the report after
checking it is the same on every rank, so a failure fails every rank together instead of hanging.
Outputs to be damaged are written without SHA256SUMS (``manifest=False``), so each test sees the
structure and value checks alone; ``test_manifest.py`` holds the manifest's check to account.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import FIXTURE_NAMES, FIXTURES, cli, reference_bytes
from mpi4py import MPI

import mpicons
from mpicons.core.reports import KINDS
from mpicons.core.safetensors_codec import DTYPE_BY_NAME, read_header
from mpicons.frontends.verification import VerifyReport, verify

HERE = Path(__file__).parent
EDGE = FIXTURES / "edge-3ranks" / "sharded"
FILE1 = "model-00001-of-00002.safetensors"
FILE2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
TINY = 128  # comparison buffer small enough to split rows of the fixtures' matrices


def _mutate(comm: MPI.Intracomm, fn: Callable[[], None]) -> None:
    """Rank 0 changes the shared files; every rank learns whether that worked (and waits for it)."""
    error = None
    if comm.rank == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = repr(exc)
    error = comm.bcast(error, root=0)
    assert error is None, error


def _verify(comm: MPI.Intracomm, out: Path, **kwargs: object) -> VerifyReport:
    """verify() on every rank; the report, problem kinds included, must be the same everywhere, every kind documented."""
    report = verify(out, comm=comm, **kwargs)
    gathered = comm.allgather((report.to_dict(), [p.kind for p in report.problems]))
    assert all(g == gathered[0] for g in gathered)
    assert all(p.kind in KINDS for p in report.problems), [p.kind for p in report.problems]
    return report


def _consolidated(comm: MPI.Intracomm, tmp: Path, fixture: str = "edge-3ranks", manifest: bool = False) -> Path:
    out = tmp / "out"
    mpicons.consolidate(FIXTURES / fixture / "sharded", out, comm=comm, manifest=manifest)
    return out


def _element_position(path: Path, tensor: str, index: tuple[int, ...]) -> int:
    """Absolute file offset of element ``index`` of ``tensor``."""
    header = read_header(path)
    entry = next(e for e in header.tensors if e.name == tensor)
    size = DTYPE_BY_NAME[entry.dtype].bits // 8
    return header.data_start + entry.begin + int(np.ravel_multi_index(index, entry.shape)) * size


def _flip(path: Path, position: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(position)
        byte = handle.read(1)
        handle.seek(position)
        handle.write(bytes([byte[0] ^ 0x04]))


#: Matches any tensor field (header errors name the tensor they found wrong, or none).
ANY = object()


def _has(report: VerifyReport, file_name: str | None, tensor: object, text: str, kind: str | None = None) -> bool:
    return any(
        (file_name is None or os.path.basename(p.path) == file_name)
        and tensor in (ANY, p.tensor)
        and text in p.what
        and kind in (None, p.kind)
        for p in report.problems
    )


def test_every_kind_the_package_gives_a_problem_is_documented():
    """Each ``kind="..."`` given to ``Problem`` or ``file_problem`` in mpicons is in KINDS."""
    import ast

    def constants(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.IfExp):
            return constants(node.body) + constants(node.orelse)
        return []

    used: dict[str, str] = {}
    for path in sorted(Path(mpicons.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Problem", "file_problem"):
                for keyword in node.keywords:
                    if keyword.arg == "kind":
                        used.update((k, f"{path.name}:{node.lineno}") for k in constants(keyword.value))
    assert {"hole", "header", "values"} <= set(used), sorted(used)  # the walk finds what it should
    assert {k: where for k, where in used.items() if k not in KINDS} == {}


# ---------------------------------------------------------------- sound checkpoints


@pytest.mark.mpi
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
@pytest.mark.parametrize("buffer_size", [TINY, pytest.param(32 << 20, marks=pytest.mark.slow)])
def test_consolidated_checkpoint_verifies(fixture, buffer_size, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path, fixture, manifest=True)
    plain = _verify(comm, out)
    full = _verify(comm, out, against=FIXTURES / fixture / "sharded", buffer_size=buffer_size)
    index = json.loads((out / INDEX).read_text())
    for report in (plain, full):
        assert report.ok, report.lines()
        assert report.files == sorted(set(index["weight_map"].values()))
        assert report.tensors == len(index["weight_map"])
        assert report.total_bytes == index["metadata"]["total_size"]
        assert report.ranks == comm.size
        published = [p for p in out.iterdir() if p.name != "SHA256SUMS"]
        assert report.manifest is not None and report.checksummed == report.manifest_files == len(published)
    assert full.compared_tensors == full.shard_tensors == full.tensors
    assert full.compared_bytes == full.total_bytes
    assert "OK" in full.summary()


@pytest.mark.mpi
def test_default_communicator_is_world(mpi_tmp_path):
    out = _consolidated(MPI.COMM_WORLD, mpi_tmp_path)
    report = verify(out, against=EDGE)
    assert MPI.COMM_WORLD.allgather(report.ok) == [True] * MPI.COMM_WORLD.size
    assert report.ranks == MPI.COMM_WORLD.size


# ---------------------------------------------------------------- values


@pytest.mark.mpi
@pytest.mark.parametrize("buffer_size", [TINY, 1 << 16, 32 << 20])
def test_flipped_bytes_are_found_with_their_first_element(buffer_size, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)
    # A column-cut matrix (two differences), a 3-D tensor cut along its last dim, an int64 buffer.
    flips = [
        (FILE1, "model.layers.0.mlp.down_proj.weight", (40, 3)),
        (FILE1, "model.layers.0.mlp.down_proj.weight", (37, 150)),
        (FILE2, "moe.experts.w1", (2, 10, 30)),
        (FILE1, "buffers.step", (4,)),
    ]

    def damage() -> None:
        for file_name, tensor, index in flips:
            _flip(out / file_name, _element_position(out / file_name, tensor, index) + 1)

    _mutate(comm, damage)
    assert _verify(comm, out).ok  # structure is intact: only --against can see it
    report = _verify(comm, out, against=EDGE, buffer_size=buffer_size)
    assert len(report.problems) == 3, report.lines()
    assert _has(
        report, FILE1, "model.layers.0.mlp.down_proj.weight", "differs from the shards in 2 of 11968 elements; first at [37, 150]"
    )
    assert _has(report, FILE2, "moe.experts.w1", "in 1 of 8448 elements; first at [2, 10, 30]")
    assert _has(report, FILE1, "buffers.step", "in 1 of 5 elements; first at [4]")
    line = next(line for line in report.lines() if "buffers.step" in line)
    assert line.startswith(f"{out / FILE1}: tensor 'buffers.step': differs")
    assert report.compared_tensors == report.tensors
    assert "3 problems" in report.summary()


@pytest.mark.mpi
def test_dtype_and_shape_are_compared_with_the_shards(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)

    def damage() -> None:
        # Same header length, still valid safetensors: a [1003, 64] matrix now claims [64, 1003];
        # and the F64 bias claims to be I64 (same size).
        data = (out / FILE1).read_bytes().replace(b'"shape":[1003,64]', b'"shape":[64,1003]', 1)
        (out / FILE1).write_bytes(data)
        data = (out / FILE2).read_bytes().replace(b'{"dtype":"F64","shape":[3]', b'{"dtype":"I64","shape":[3]', 1)
        (out / FILE2).write_bytes(data)

    _mutate(comm, damage)
    assert _verify(comm, out).ok
    report = _verify(comm, out, against=EDGE)
    assert _has(report, FILE1, "lm_head.weight", "is BF16[64, 1003] but the shards hold BF16[1003, 64]", "mismatch")
    assert _has(report, FILE2, "moe.router.bias", "is I64[3] but the shards hold F64[3]", "mismatch"), report.lines()
    assert len(report.problems) == 2
    assert report.compared_tensors == report.tensors - 2


@pytest.mark.mpi
def test_against_node_local_shards(mpi_tmp_path):
    """Shards in per-rank directories: blocks are compared by the rank that owns them, with the pieces it cannot
    read sent by ranks that can."""
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)

    def spread(by: int) -> Callable[[], None]:
        # shard-RRRRR-model-IIIII-of-NNNNN: field 1 is the training rank, field 3 the output file.
        def copy() -> None:
            for rank in range(comm.size):
                (mpi_tmp_path / f"{by}-{rank}").mkdir()
            for path in sorted(EDGE.iterdir()):
                owner = (int(path.name.split("-")[by]) - 1) % comm.size
                shutil.copy(path, mpi_tmp_path / f"{by}-{owner}" / path.name)

        return copy

    _mutate(comm, spread(3))
    report = _verify(comm, out, against=str(mpi_tmp_path / "3-{rank}"), buffer_size=TINY)
    assert report.ok, report.lines()
    assert report.compared_tensors == report.tensors
    _mutate(comm, lambda: _flip(out / FILE2, _element_position(out / FILE2, "moe.experts.w1", (3, 63, 32))))
    report = _verify(comm, out, against=str(mpi_tmp_path / "3-{rank}"))
    assert len(report.problems) == 1 and _has(report, FILE2, "moe.experts.w1", "first at [3, 63, 32]"), report.lines()
    # Every training rank's pieces on a different rank: no rank sees a whole tensor; pieces move over MPI.
    _mutate(comm, spread(1))
    report = _verify(comm, out, against=str(mpi_tmp_path / "1-{rank}"), buffer_size=TINY)
    assert len(report.problems) == 1 and _has(report, FILE2, "moe.experts.w1", "first at [3, 63, 32]"), report.lines()


# ---------------------------------------------------------------- structure


def _edit_index(out: Path, change: Callable[[dict], None]) -> None:
    index = json.loads((out / INDEX).read_text())
    change(index)
    (out / INDEX).write_text(json.dumps(index, indent=2))


def _write_stray(out: Path) -> None:
    (out / "extra.safetensors").write_bytes(reference_bytes({"ghost.weight": ("U8", [3], b"abc")}))


def _lock(out: Path, pid: int | None = None) -> None:
    """A lock as a run of this host writes it: this process's (a run going on), or ``pid``'s."""
    import dataclasses
    import subprocess
    import sys

    from mpicons.io.lock import LOCK_NAME, Holder

    holder = Holder.me()
    if pid is None:  # a process of this host that has ended
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        holder = dataclasses.replace(holder, pid=int(ended.stdout))
    (out / LOCK_NAME).write_bytes(holder.to_bytes())


#: name → (damage, [(file or None, tensor, text, kind)] that must be reported, and nothing else without --against)
BREAKAGES: dict[str, tuple[Callable[[Path], None], list[tuple[str | None, object, str, str]]]] = {
    "truncated": (lambda o: os.truncate(o / FILE2, (o / FILE2).stat().st_size - 10), [(FILE2, ANY, "truncated?", "header")]),
    "trailing-bytes": (lambda o: open(o / FILE1, "ab").write(b"\0" * 8), [(FILE1, ANY, "trailing bytes", "header")]),
    "corrupt-header": (
        lambda o: (o / FILE1).write_bytes((o / FILE1).read_bytes().replace(b'{"__metadata__"', b'["__metadata__"', 1)),
        [(FILE1, None, "header is not a JSON object", "header")],
    ),
    "header-too-long": (
        lambda o: (o / FILE2).write_bytes(b"\xff" * 8 + (o / FILE2).read_bytes()[8:]),
        [(FILE2, None, "exceeds the safetensors limit", "header")],
    ),
    "format-not-pt": (
        lambda o: (o / FILE1).write_bytes((o / FILE1).read_bytes().replace(b'"format":"pt"', b'"format":"tf"', 1)),
        [(FILE1, None, "'format' is 'tf'", "metadata")],
    ),
    "index-drops-tensor": (
        lambda o: _edit_index(o, lambda i: i["weight_map"].pop("buffers.step")),
        [(FILE1, "buffers.step", "not in the index's weight_map", "index mismatch")],
    ),
    "index-wrong-file": (
        lambda o: _edit_index(o, lambda i: i["weight_map"].update({"tiny.u8": FILE1})),
        [(INDEX, "tiny.u8", f"weight_map names {FILE1} but the tensor is in {FILE2}", "index mismatch")],
    ),
    "index-extra-tensor": (
        lambda o: _edit_index(o, lambda i: i["weight_map"].update({"ghost": FILE1})),
        [(INDEX, "ghost", f"weight_map names {FILE1}, which does not hold the tensor", "index mismatch")],
    ),
    "index-total-size": (
        lambda o: _edit_index(o, lambda i: i["metadata"].update({"total_size": i["metadata"]["total_size"] + 1})),
        [(INDEX, None, "metadata.total_size is", "index mismatch")],
    ),
    "index-missing": (lambda o: os.unlink(o / INDEX), [(INDEX, None, "index is missing", "index")]),
    "index-not-json": (lambda o: (o / INDEX).write_text("{"), [(INDEX, None, "index is not valid JSON", "index")]),
    "file-missing": (
        lambda o: os.unlink(o / FILE2),
        [(FILE2, None, "listed in the index for 13 tensors but missing", "missing file")],
    ),
    "stray-file": (_write_stray, [("extra.safetensors", None, "not listed in the index (stray file)", "extra file")]),
    "lock-of-a-live-run": (
        lambda o: _lock(o, os.getpid()),
        [(".mpicons.lock", None, "a consolidation holds this directory (pid", "locked")],
    ),
    "lock-of-a-dead-run": (
        _lock,
        [(".mpicons.lock", None, "left by a consolidation that is no longer running (pid", "leftover")],
    ),
    "staging-left": (
        lambda o: (o / ".mpicons-staging-x1y2z3").mkdir(),
        [(".mpicons-staging-x1y2z3", None, "left by an interrupted consolidation", "leftover")],
    ),
}


@pytest.mark.mpi
@pytest.mark.parametrize("against", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_each_kind_of_damage_is_reported(breakage, against, mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)
    damage, expected = BREAKAGES[breakage]
    _mutate(comm, lambda: damage(out))
    report = _verify(comm, out, against=EDGE if against else None)
    assert not report.ok
    for file_name, tensor, text, kind in expected:
        assert _has(report, file_name, tensor, text, kind), [(p.kind, str(p)) for p in report.problems]
    if not against:
        assert len(report.problems) == len(expected), report.lines()
    else:
        # Values of readable tensors still match: only the stray tensor is foreign to the shards.
        assert not any(p.kind == "values" for p in report.problems), report.lines()


@pytest.mark.mpi
def test_every_problem_is_reported_not_just_the_first(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path, "fsdp2-3ranks")
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]

    def damage() -> None:
        os.truncate(out / files[0], (out / files[0]).stat().st_size - 1)
        (out / files[1]).write_bytes((out / files[1]).read_bytes().replace(b'"format":"pt"', b'"format":"xx"', 1))
        header = read_header(out / files[2])
        entry = header.tensors[-1]
        _flip(out / files[2], header.data_start + entry.end - 1)
        _write_stray(out)
        _edit_index(out, lambda i: i["metadata"].update({"total_size": 1}))

    _mutate(comm, damage)
    report = _verify(comm, out, against=FIXTURES / "fsdp2-3ranks" / "sharded")
    entry_name = comm.bcast(read_header(out / files[2]).tensors[-1].name if comm.rank == 0 else None)
    assert _has(report, files[0], ANY, "truncated?", "header"), report.lines()
    assert _has(report, files[1], None, "'format' is 'xx'", "metadata"), report.lines()
    assert _has(report, files[2], entry_name, "differs from the shards in 1 of", "values"), report.lines()
    assert _has(report, "extra.safetensors", None, "stray file", "extra file"), report.lines()
    assert _has(report, "extra.safetensors", "ghost.weight", "not in the shards", "extra tensor"), report.lines()
    # total_size cannot be checked while a listed file is unreadable; the truncation explains it.
    assert len(report.problems) == 5, report.lines()
    assert [p.path for p in report.problems] == sorted(p.path for p in report.problems)


# ---------------------------------------------------------------- command line


def test_cli_exit_codes_at_3_ranks(tmp_path):
    out = tmp_path / "out"
    mpicons.consolidate(EDGE, out, comm=MPI.COMM_SELF, manifest=False)
    report_path = tmp_path / "report.json"

    good, _ = cli(3, "verify", str(out), "--against", str(EDGE), "--json", str(report_path))
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.count("mpicons verify: OK") == 1  # rank 0 only
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["ranks"] == 3 and report["problems"] == []

    _flip(out / FILE2, _element_position(out / FILE2, "moe.experts.w1", (1, 2, 3)))
    (out / "extra.safetensors").write_bytes(b"not safetensors at all")
    bad, _ = cli(3, "verify", str(out), "--against", str(EDGE), "--json", str(report_path), "--buffer-size", "1K")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    lines = bad.stdout.splitlines()
    assert (
        f"{out / FILE2}: tensor 'moe.experts.w1': differs from the shards in 1 of 8448 elements; first at [1, 2, 3]"
        in "\n".join(lines)
    )
    assert f"{out / 'extra.safetensors'}: not listed in the index (stray file)" in lines
    assert lines[-1].startswith("mpicons verify: 3 problems")
    assert "mpicons: error" not in bad.stderr
    assert len(json.loads(report_path.read_text())["problems"]) == 3

    quiet, _ = cli(3, "verify", str(out), "-q")
    assert quiet.returncode == 1
    assert all(line.startswith(str(out)) for line in quiet.stdout.splitlines())

    missing, _ = cli(3, "verify", str(tmp_path / "missing"))
    assert missing.returncode == 2
    assert missing.stderr.count("mpicons: error:") == 1 and "output directory does not exist" in missing.stderr

    no_shards, _ = cli(3, "verify", str(out), "--against", str(tmp_path / "missing"))
    assert no_shards.returncode == 2
    assert "input directory does not exist" in no_shards.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("option", ["bf16", "fp32"])
def test_verify_against_shards_of_a_converted_output(option, mpi_tmp_path):
    """--dtype outputs are checked against the shards converted the same way; a flipped byte is still found."""
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "out"
    mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", out, comm=comm, dtype=option, manifest=False)
    clean = verify(out, against=FIXTURES / "edge-3ranks" / "sharded", comm=comm, dtype=option, buffer_size=1 << 10)
    plain = verify(out, against=FIXTURES / "edge-3ranks" / "sharded", comm=comm)
    if comm.rank == 0:
        path = out / "model-00001-of-00002.safetensors"
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF
        path.write_bytes(bytes(data))
    comm.Barrier()
    broken = verify(out, against=FIXTURES / "edge-3ranks" / "sharded", comm=comm, dtype=option)
    plain_kinds = [p.kind for p in plain.problems]
    results = comm.allgather((clean.ok, plain_kinds, len(broken.problems), [p.what for p in broken.problems]))
    assert all(r == results[0] for r in results)
    clean_ok, plain_kinds, broken_count, broken_what = results[0]
    assert clean_ok
    assert plain_kinds == ["dtype option"]  # without --dtype: one hint, not a mismatch per converted tensor
    assert broken_count == 1 and "differs from the shards" in broken_what[0]


# ---------------------------------------------------------------- only regular files inside the directory


def _replace_with_link(path: Path, target: str | Path) -> None:
    path.unlink()
    path.symlink_to(target)


@pytest.mark.mpi
def test_a_link_to_a_file_outside_is_reported_with_its_target_not_read(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)
    copy = mpi_tmp_path / "elsewhere" / FILE1  # an identical copy: reading it would find nothing wrong

    def plant() -> None:
        copy.parent.mkdir()
        shutil.copy(out / FILE1, copy)
        _replace_with_link(out / FILE1, copy)
        (out / "extra.safetensors").symlink_to("/etc/passwd")

    _mutate(comm, plant)
    report = _verify(comm, out, against=EDGE)
    assert not report.ok
    assert _has(report, FILE1, None, f"is a symbolic link to {copy}; verify reads only regular files inside the directory")
    assert _has(report, "extra.safetensors", None, "is a symbolic link to /etc/passwd"), report.lines()
    assert "--follow-links" in report.lines()[0]
    assert len(report.problems) == 2, report.lines()  # neither is opened: no header problem, no stray, no values
    assert report.refused == sorted([str(out / FILE1), str(out / "extra.safetensors")])
    assert FILE1 not in report.files and report.compared_tensors < report.shard_tensors
    assert "2 entries not read" in report.summary()
    assert report.to_dict()["refused"] == report.refused

    followed = _verify(comm, out, against=EDGE, follow_links=True)
    # Followed, the copy verifies; /etc/passwd is a regular file too, read as what it is: not safetensors.
    assert followed.refused == [] and FILE1 in followed.files
    assert [os.path.basename(p.path) for p in followed.problems] == ["extra.safetensors"] * 2, followed.lines()
    assert _has(followed, "extra.safetensors", None, "not listed in the index (stray file)")
    assert followed.compared_tensors == followed.shard_tensors


@pytest.mark.mpi
def test_follow_links_accepts_a_cache_snapshot_of_links_into_blobs(mpi_tmp_path):
    """A Hugging Face cache snapshot: every file a relative link into ``blobs/``."""
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)
    snapshot = mpi_tmp_path / "models--x" / "snapshots" / "abc123"

    def cache() -> None:
        blobs = mpi_tmp_path / "models--x" / "blobs"
        blobs.mkdir(parents=True)
        snapshot.mkdir(parents=True)
        for number, path in enumerate(sorted(out.iterdir())):
            shutil.copy(path, blobs / f"blob{number}")
            (snapshot / path.name).symlink_to(f"../../blobs/blob{number}")

    _mutate(comm, cache)
    plain = _verify(comm, snapshot)
    assert len(plain.refused) == 3 and not plain.files, plain.lines()
    assert _has(plain, INDEX, None, "is a symbolic link to ../../blobs/blob2"), plain.lines()
    followed = _verify(comm, snapshot, against=EDGE, follow_links=True)
    assert followed.ok, followed.lines()
    assert followed.files == [FILE1, FILE2] and followed.compared_tensors == followed.shard_tensors

    def dangle() -> None:  # links to anything but a regular file stay refused when followed
        _replace_with_link(snapshot / FILE2, "../../blobs/gone")
        _replace_with_link(snapshot / INDEX, "/dev/zero")

    _mutate(comm, dangle)
    broken = _verify(comm, snapshot, follow_links=True)
    assert _has(broken, FILE2, None, "is a symbolic link to ../../blobs/gone, which cannot be followed"), broken.lines()
    assert _has(broken, INDEX, None, "is a symbolic link to /dev/zero, which is a character device"), broken.lines()
    assert broken.refused == [str(snapshot / FILE2), str(snapshot / INDEX)]


@pytest.mark.mpi
def test_fifos_and_directories_in_place_of_files_are_reported_unopened(mpi_tmp_path):
    comm = MPI.COMM_WORLD
    out = _consolidated(comm, mpi_tmp_path)

    def plant() -> None:
        (out / FILE2).unlink()
        os.mkfifo(out / FILE2)  # opening it for reading would block until a writer comes
        (out / "extra.safetensors").mkdir()

    _mutate(comm, plant)
    report = _verify(comm, out, against=EDGE, follow_links=True)
    assert _has(report, FILE2, None, "is a FIFO (named pipe), not a regular file", "refused"), report.lines()
    assert _has(report, "extra.safetensors", None, "is a directory, not a regular file", "refused"), report.lines()
    assert len(report.problems) == 2, report.lines()
    assert report.refused == [str(out / "extra.safetensors"), str(out / FILE2)]


def test_an_index_over_the_size_limit_is_not_read(tmp_path, monkeypatch):
    from mpicons.comm import SingleProcess
    from mpicons.frontends import output_reading

    out = tmp_path / "out"
    mpicons.consolidate(EDGE, out, comm=SingleProcess())
    monkeypatch.setattr(output_reading, "MAX_INDEX_SIZE", 100)
    report = verify(out, comm=SingleProcess())
    assert [(os.path.basename(p.path), p.what, p.kind) for p in report.problems] == [
        (INDEX, "index is larger than the 100-byte limit (not an index?)", "index")
    ]


#: name → how the entry is planted in a consolidated directory, what verify must say, verify's extra options
UNREADABLE = {
    "fifo-index": (lambda o: (os.unlink(o / INDEX), os.mkfifo(o / INDEX)), INDEX, "is a FIFO (named pipe)", []),
    "fifo-lock": (lambda o: os.mkfifo(o / ".mpicons.lock"), ".mpicons.lock", "is a FIFO, not a lock mpicons made", []),
    "index-to-dev-zero": (
        lambda o: _replace_with_link(o / INDEX, "/dev/zero"),
        INDEX,
        "is a symbolic link to /dev/zero, which is a character device",
        ["--follow-links"],
    ),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_cli_ends_with_exit_2_naming_an_entry_it_will_not_read(case, tmp_path):
    """A FIFO would block the open forever, /dev/zero would be read until memory runs out."""
    out = tmp_path / "out"
    mpicons.consolidate(EDGE, out, comm=MPI.COMM_SELF)
    plant, name, what, options = UNREADABLE[case]
    plant(out)
    proc, _ = cli(2, "verify", out, "--against", EDGE, *options, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{out / name}: " in proc.stdout and what in proc.stdout
    assert "1 entry not read (see above)" in proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_cli_follow_links_accepts_a_link_to_a_regular_file(tmp_path):
    out = tmp_path / "out"
    mpicons.consolidate(EDGE, out, comm=MPI.COMM_SELF)
    copy = tmp_path / "copy.safetensors"
    shutil.copy(out / FILE1, copy)
    _replace_with_link(out / FILE1, copy)
    refused, _ = cli(2, "verify", out, timeout=60)
    assert refused.returncode == 2 and f"{out / FILE1}: is a symbolic link to {copy}" in refused.stdout
    followed, _ = cli(2, "verify", out, "--against", EDGE, "--follow-links", timeout=60)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert followed.stdout.count("mpicons verify: OK") == 1


# ---------------------------------------------------------------- HDF5 output


@pytest.mark.mpi
def test_hdf5_output_is_verified_against_the_shards(mpi_tmp_path):
    h5py = pytest.importorskip("h5py")
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "h5"
    mpicons.consolidate(EDGE, out, comm=comm, output_format="hdf5", manifest=False)
    plain = _verify(comm, out)
    full = _verify(comm, out, against=EDGE, buffer_size=TINY)
    for report in (plain, full):
        assert report.ok, report.lines()
        assert report.files == ["model.h5"] and report.tensors == 27
    assert full.compared_tensors == full.shard_tensors == 27 and full.compared_bytes == full.total_bytes

    def damage() -> None:
        with h5py.File(out / "model.h5", "r") as handle:
            dataset = handle["/model/layers/0/mlp/down_proj/weight"]
            position = dataset.id.get_offset() + (37 * dataset.shape[1] + 150) * dataset.dtype.itemsize
        _flip(out / "model.h5", position)

    _mutate(comm, damage)
    assert _verify(comm, out).ok  # the file's structure is intact: only the shards can tell
    report = _verify(comm, out, against=EDGE, buffer_size=TINY)
    assert len(report.problems) == 1, report.lines()
    what = "differs from the shards in 1 of 11968 elements; first at [37, 150]"
    assert _has(report, "model.h5", "model.layers.0.mlp.down_proj.weight", what)


@pytest.mark.mpi
def test_hdf5_output_with_dtype_and_a_broken_file(mpi_tmp_path):
    pytest.importorskip("h5py")
    comm = MPI.COMM_WORLD
    out = mpi_tmp_path / "h5"
    mpicons.consolidate(EDGE, out, comm=comm, output_format="hdf5", dtype="fp32")
    assert _verify(comm, out, against=EDGE, dtype="fp32").ok
    without = _verify(comm, out, against=EDGE)  # the converted tensors: one hint, not a mismatch each
    assert [p.kind for p in without.problems] == ["dtype option"] and "verify with --dtype fp32" in without.problems[0].what
    _mutate(comm, lambda: (out / "model.h5").write_bytes(b"not HDF5 at all"))
    report = _verify(comm, out, against=EDGE)
    assert _has(report, "model.h5", None, "is not an HDF5 file h5py can read", "hdf5"), report.lines()
    assert not any(p.kind == "missing tensor" for p in report.problems)


def test_verify_takes_the_options_of_the_consolidation(tmp_path):
    """The Options a checkpoint was written with verify it; keyword arguments change single fields."""
    from mpicons.comm import SingleProcess
    from mpicons.core.options import Options

    out = tmp_path / "out"
    written = Options(dtype="bf16", exclude=("*bias*",))
    mpicons.consolidate(EDGE, out, written, comm=SingleProcess())
    assert verify(out, written, against=EDGE, comm=SingleProcess()).ok
    assert verify(out, against=EDGE, comm=SingleProcess(), dtype="bf16", exclude="*bias*").ok
    changed = verify(out, written, against=EDGE, comm=SingleProcess(), exclude=())
    assert not changed.ok  # the excluded tensors are in the shards but in no output file
    with pytest.raises(TypeError, match="unknown option"):
        verify(out, comm=SingleProcess(), buffer=1)
