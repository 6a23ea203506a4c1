"""Bad input gets one clear error (exit 2), never a traceback, a hang or partial output.

Each case copies a real torch-written checkpoint, breaks one thing, and runs the command line
under ``mpiexec`` at 1 and 3 ranks. At 3 ranks rank r reads files r, r+3, ... of the sorted list,
so the broken file is chosen to be read by a rank other than 0: its error must still end every
rank. The last part fuzzes ``headers.read_table`` (and the plan built from it) with mutated
``DCP_SHARDING_INFO``.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import DISTCP_FIXTURES, FIXTURES, mpirun, reference_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpicons.core.errors import InputError
from mpicons.formats.shard_headers import read_table
from mpicons.frontends.cli import main
from mpicons.testing import build_plan

SOURCE = FIXTURES / "edge-3ranks" / "sharded"
MAPPING = FIXTURES / "edge-3ranks" / "expected" / "mapping.json"
# Sorted index 4 and 2 of the six files: read by rank 1 and rank 2 at 3 ranks.
V1 = "shard-00003-model-00001-of-00002.safetensors"
V2 = "shard-00002-model-00001-of-00002.safetensors"
# A column-cut matrix held by V1 and V2 (and shard-00001): [0:1003, 0:22 | 22:44 | 44:64].
COLS = "lm_head.weight"
SAFETENSORS_MAX_HEADER = 100_000_000  # MAX_HEADER_SIZE in safetensors' reader
INFO = "DCP_SHARDING_INFO"


# ---------------------------------------------------------------- rewriting shard files


def read_st(path: Path) -> tuple[dict, bytes]:
    """The header as a dict (key order kept) and the data section's bytes."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def write_st(path: Path, header: dict | bytes, data: bytes, *, length: int | None = None) -> None:
    """Serialize like safetensors (compact JSON padded to 8) with a correct prefix unless ``length`` overrides it."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def edit_header(path: Path, change: Callable[[dict], None]) -> None:
    header, data = read_st(path)
    change(header)
    write_st(path, header, data)


def edit_info(path: Path, change: Callable[[dict], None]) -> None:
    """Edit the parsed DCP_SHARDING_INFO (a JSON string inside ``__metadata__``)."""

    def apply(header: dict) -> None:
        info = json.loads(header["__metadata__"][INFO])
        change(info)
        header["__metadata__"][INFO] = json.dumps(info)

    edit_header(path, apply)


def entries(header: dict) -> list[tuple[str, dict]]:
    """Tensor entries in data order."""
    return sorted(((n, e) for n, e in header.items() if n != "__metadata__"), key=lambda item: item[1]["data_offsets"])


# ---------------------------------------------------------------- the cases


@dataclass
class Expect:
    """What the single error line must say.

    ``reader``: the shard file whose reader finds the error (its rank is named); None means the
    error is found by every rank alike (the plan) and rank 0's report is printed.
    ``starts``: what the message begins with after the rank prefix (a path, file or tensor).
    """

    phrase: str
    starts: str
    mentions: tuple[str, ...] = ()
    reader: str | None = None
    args: list[str] = field(default_factory=list)


def missing_dir(inp: Path) -> Expect:
    shutil.rmtree(inp)
    return Expect("input directory does not exist", str(inp))


def empty_dir(inp: Path) -> Expect:
    for path in inp.iterdir():
        path.unlink()
    (inp / "README.txt").write_text("no shards here\n")  # a non-safetensors file is not a shard
    return Expect(r"no \*\.safetensors files found", str(inp))


def shards_one_level_down(inp: Path) -> Expect:
    """``ckpt/`` given for ``ckpt/sharded/``: the message names the subdirectory to pass."""
    (inp / "sharded").mkdir()
    for path in inp.glob("*.safetensors"):
        path.rename(inp / "sharded" / path.name)
    said = f"no *.safetensors files found; its subdirectory 'sharded' holds a checkpoint's files: pass {inp / 'sharded'}"
    return Expect(re.escape(said), str(inp))


def not_safetensors(inp: Path) -> Expect:
    name = "shard-00002-notes.safetensors"  # sorts after V2's sibling: read by a rank other than 0
    (inp / name).write_text("these are my notes, not a checkpoint\n")
    return Expect(r"not a safetensors file", str(inp / name), reader=name)


def too_short(inp: Path) -> Expect:
    (inp / V1).write_bytes((inp / V1).read_bytes()[:5])
    return Expect("5 bytes, too short", str(inp / V1), reader=V1)


def truncated_data(inp: Path) -> Expect:
    header, data = read_st(inp / V1)
    keep = len(data) - 100
    first_cut = next(name for name, e in entries(header) if e["data_offsets"][1] > keep)
    (inp / V1).write_bytes((inp / V1).read_bytes()[:-100])
    return Expect(r"runs? past the end of the file.*truncated", str(inp / V1), (repr(first_cut),), reader=V1)


def truncated_header(inp: Path) -> Expect:
    (inp / V2).write_bytes((inp / V2).read_bytes()[:108])
    return Expect(r"header length \d+ runs past the end of the 108-byte file", str(inp / V2), reader=V2)


def header_length_past_file(inp: Path) -> Expect:
    header, data = read_st(inp / V1)
    size = (inp / V1).stat().st_size
    write_st(inp / V1, header, data, length=size)
    return Expect(rf"header length {size} runs past the end", str(inp / V1), reader=V1)


def header_length_over_cap(inp: Path) -> Expect:
    header, data = read_st(inp / V2)
    write_st(inp / V2, header, data, length=SAFETENSORS_MAX_HEADER + 1)
    return Expect(rf"header length {SAFETENSORS_MAX_HEADER + 1} exceeds the safetensors limit", str(inp / V2), reader=V2)


def header_not_utf8(inp: Path) -> Expect:
    _, data = read_st(inp / V1)
    write_st(inp / V1, b'{"\xff\xfe":1}', data)
    return Expect("header is not UTF-8", str(inp / V1), reader=V1)


def header_not_json(inp: Path) -> Expect:
    _, data = read_st(inp / V1)
    write_st(inp / V1, b'{"lm_head.weight": {"dtype": ', data)
    return Expect("header is not valid JSON", str(inp / V1), reader=V1)


def header_not_object(inp: Path) -> Expect:
    _, data = read_st(inp / V2)
    write_st(inp / V2, b"[1, 2, 3]", data)
    return Expect("header is not a JSON object", str(inp / V2), reader=V2)


def info_missing(inp: Path) -> Expect:
    edit_header(inp / V1, lambda h: h["__metadata__"].pop(INFO))
    return Expect(f"named like a DCP shard but its header has no {INFO}", str(inp / V1), reader=V1)


def info_not_json(inp: Path) -> Expect:
    edit_header(inp / V1, lambda h: h["__metadata__"].update({INFO: '{"lm_head.weight": {"saved_offsets": [0,'}))
    return Expect(f"{INFO} is not valid JSON", str(inp / V1), reader=V1)


def info_entry_malformed(inp: Path) -> Expect:
    edit_info(inp / V2, lambda info: info.update({COLS: {"offsets": [0, 22]}}))
    return Expect(rf"{INFO} entry for tensor '{COLS}' has invalid saved_offsets None", str(inp / V2), reader=V2)


def info_lacks_tensor(inp: Path) -> Expect:
    edit_info(inp / V1, lambda info: info.pop(COLS))
    return Expect(rf"tensor '{COLS}' is missing from {INFO}", str(inp / V1), reader=V1)


def info_offsets_wrong_length(inp: Path) -> Expect:
    edit_info(inp / V1, lambda info: info.update({COLS: {"saved_offsets": [44]}}))
    return Expect(rf"tensor '{COLS}' has 2 dimensions but saved_offsets \[44\] has 1", str(inp / V1), reader=V1)


def piece_at_negative_offset(inp: Path) -> Expect:
    edit_info(inp / V1, lambda info: info.update({COLS: {"saved_offsets": [0, -20]}}))
    return Expect(rf"tensor '{COLS}' has invalid saved_offsets \[0, -20\]", str(inp / V1), reader=V1)


def piece_beyond_int64(inp: Path) -> Expect:
    edit_info(inp / V1, lambda info: info.update({COLS: {"saved_offsets": [0, 2**63]}}))
    return Expect(rf"tensor '{COLS}' has invalid saved_offsets \[0, {2**63}\]", str(inp / V1), reader=V1)


def unknown_dtype(inp: Path) -> Expect:
    edit_header(inp / V1, lambda h: h[COLS].update(dtype="F12"))
    return Expect(rf"tensor '{COLS}': unknown dtype 'F12'", str(inp / V1), reader=V1)


def offsets_disagree_with_shape(inp: Path) -> Expect:
    edit_header(inp / V2, lambda h: h[COLS]["shape"].__setitem__(1, h[COLS]["shape"][1] + 1))
    return Expect(rf"tensor '{COLS}': data_offsets span \d+ bytes but shape .* needs \d+", str(inp / V2), reader=V2)


def offsets_overlap(inp: Path) -> Expect:
    """The tensor after the largest one starts 8 bytes inside it (its own length unchanged)."""
    header, data = read_st(inp / V1)
    ordered = entries(header)
    size = lambda e: e["data_offsets"][1] - e["data_offsets"][0]  # noqa: E731
    (_, big), (victim, after) = max(zip(ordered, ordered[1:]), key=lambda pair: size(pair[0][1]))
    start = big["data_offsets"][1] - 8
    after["data_offsets"] = [start, start + size(after)]
    write_st(inp / V1, header, data)
    return Expect(rf"tensor '{re.escape(victim)}': data_offsets .* overlaps the previous tensor", str(inp / V1), reader=V1)


def offsets_gap(inp: Path) -> Expect:
    header, data = read_st(inp / V1)
    victim, last = entries(header)[-1]
    last["data_offsets"] = [o + 8 for o in last["data_offsets"]]
    write_st(inp / V1, header, data + bytes(8))
    return Expect(rf"tensor '{re.escape(victim)}': data_offsets .* leaves a gap before it", str(inp / V1), reader=V1)


def offsets_past_file(inp: Path) -> Expect:
    header, data = read_st(inp / V2)
    victim, last = entries(header)[-1]
    begin, end = last["data_offsets"]
    last["data_offsets"][1] = end + (end - begin) // last["shape"][0]  # one more row
    last["shape"][0] += 1
    write_st(inp / V2, header, data)
    return Expect(rf"tensor '{re.escape(victim)}': data_offsets .* run past the end of the file", str(inp / V2), reader=V2)


def pieces_imply_a_tensor_past_2_to_the_62_bytes(inp: Path) -> Expect:
    # each piece is fine alone; together their extents make a tensor too large to address
    edit_info(inp / V1, lambda info: info[COLS]["saved_offsets"].__setitem__(0, 3 * 2**29))
    edit_info(inp / V2, lambda info: info[COLS]["saved_offsets"].__setitem__(1, 3 * 2**29))
    return Expect("hole: ", f"tensor '{COLS}'")


def pieces_overlap(inp: Path) -> Expect:
    edit_info(inp / V1, lambda info: info[COLS]["saved_offsets"].__setitem__(1, 40))
    rows = read_st(inp / V1)[0][COLS]["shape"][0]
    return Expect(rf"overlap: region \[0:{rows}, 40:44\] is covered by 2 pieces", f"tensor '{COLS}'", (V1, V2))


def pieces_leave_hole(inp: Path) -> Expect:
    edit_info(inp / V1, lambda info: info[COLS]["saved_offsets"].__setitem__(1, 46))
    rows = read_st(inp / V1)[0][COLS]["shape"][0]
    return Expect(rf"hole: no piece covers region \[0:{rows}, 44:46\]", f"tensor '{COLS}'")


def shard_file_missing(inp: Path) -> Expect:
    """A middle rank's file lost: its pieces leave holes (a lost last rank only shrinks tensors, undetectably)."""
    (inp / V2).unlink()
    return Expect(r"hole: no piece covers region", "tensor '")


def pieces_disagree_on_dtype(inp: Path) -> Expect:
    edit_header(inp / V1, lambda h: h[COLS].update(dtype="F16"))  # same size as BF16: only the dtype differs
    return Expect(r"pieces disagree on dtype: BF16 in \S+ but F16 in " + re.escape(V1), f"tensor '{COLS}'")


def pieces_disagree_on_rank(inp: Path) -> Expect:
    edit_header(inp / V1, lambda h: h[COLS]["shape"].append(1))
    edit_info(inp / V1, lambda info: info[COLS]["saved_offsets"].append(0))
    return Expect(r"pieces disagree on number of dimensions: 2 in \S+ but 3 in " + re.escape(V1), f"tensor '{COLS}'")


def same_pieces_in_two_files(inp: Path) -> Expect:
    copy = "shard-00004-model-00001-of-00002.safetensors"
    shutil.copyfile(inp / V2, inp / copy)
    return Expect(r"every piece in it duplicates a piece of another shard file", copy, (V2,))


def stray_plain_safetensors(inp: Path) -> Expect:
    name = "extra.safetensors"
    (inp / name).write_bytes(reference_bytes({"extra.weight": ("F32", [2], bytes(8))}))
    return Expect(f"has no {INFO}, unlike the other shard files", name)


def renamed_shard(inp: Path) -> Expect:
    name = "rank-2.safetensors"
    (inp / V1).rename(inp / name)
    return Expect(r"not named like a DCP shard \(shard-RRRRR-model-IIIII-of-NNNNN\.safetensors\)", name)


def output_counts_disagree(inp: Path) -> Expect:
    renamed = V1.replace("-of-00002", "-of-00003")
    (inp / V1).rename(inp / renamed)
    return Expect(r"names 3 output files but \S+ names 2", renamed)


def _mapping(inp: Path, mapping: object) -> Path:
    path = inp.parent / "mapping.json"
    path.write_text(json.dumps(mapping))
    return path


def mapping_misses_tensor(inp: Path) -> Expect:
    """The tied-weights case: a mapping written for a model whose lm_head is tied to the embedding."""
    mapping = json.loads(MAPPING.read_text())
    del mapping[COLS]
    path = _mapping(inp, mapping)
    return Expect(rf"no entry for tensor '{COLS}'", str(path), args=["--mapping", str(path)])


def mapping_names_absent_tensor(inp: Path) -> Expect:
    mapping = {**json.loads(MAPPING.read_text()), "model.lm_head_tied.weight": 1}
    path = _mapping(inp, mapping)
    return Expect(
        r"names tensor 'model.lm_head_tied.weight', which the checkpoint does not hold", str(path), args=["--mapping", str(path)]
    )


def mapping_escapes_directory(inp: Path) -> Expect:
    weight_map = {name: f"model-{index:05d}-of-00002.safetensors" for name, index in json.loads(MAPPING.read_text()).items()}
    weight_map[COLS] = "../model-00001-of-00002.safetensors"
    path = _mapping(inp, {"metadata": {}, "weight_map": weight_map})
    return Expect(rf"tensor '{COLS}' maps to .*, which is not a plain file name", str(path), args=["--mapping", str(path)])


def mapping_names_a_file_too_long(inp: Path) -> Expect:
    """A name the file system cannot hold (255 bytes on common ones) is bad input, found before any work."""
    weight_map = {name: f"model-{index:05d}-of-00002.safetensors" for name, index in json.loads(MAPPING.read_text()).items()}
    weight_map[COLS] = "m" * 300 + ".safetensors"
    path = _mapping(inp, {"metadata": {}, "weight_map": weight_map})
    return Expect(
        r"is 312 bytes long; the file system there holds names of at most \d+ bytes: choose a shorter name",
        str(inp.parent / "out"),
        mentions=(f"tensor '{COLS}'", str(path)),
        args=["--mapping", str(path)],
    )


def mapping_names_the_parent(inp: Path) -> Expect:
    weight_map = {name: f"model-{index:05d}-of-00002.safetensors" for name, index in json.loads(MAPPING.read_text()).items()}
    weight_map[COLS] = ".."
    path = _mapping(inp, {"metadata": {}, "weight_map": weight_map})
    return Expect(rf"tensor '{COLS}' maps to '..', which is not a plain file name", str(path), args=["--mapping", str(path)])


def shard_number_out_of_range(inp: Path) -> Expect:
    name = "shard-00004-model-00001-of-99999999999.safetensors"
    (inp / V1).rename(inp / name)
    return Expect("the numbers in this shard name are out of range", str(inp / name), reader=name)


NORM = "model.norm.weight"
NORM_HOLDER = "shard-00002-model-00002-of-00002.safetensors"
NORM_TWIN = "shard-00003-model-00002-of-00002.safetensors"


def add_norm_replica(inp: Path, change: Callable[[bytes], bytes] = lambda data: data) -> None:
    """Give a second training rank's file a copy of the replicated norm, its bytes passed through ``change``."""
    original_header, original_data = read_st(inp / NORM_HOLDER)
    begin, end = original_header[NORM]["data_offsets"]
    header, data = read_st(inp / NORM_TWIN)
    copy = change(original_data[begin:end])
    header[NORM] = {**original_header[NORM], "data_offsets": [len(data), len(data) + len(copy)]}
    info = json.loads(header["__metadata__"][INFO])
    info[NORM] = {"saved_offsets": [0]}
    header["__metadata__"][INFO] = json.dumps(info)
    write_st(inp / NORM_TWIN, header, data + copy)


def replica_differs(inp: Path) -> Expect:
    add_norm_replica(inp, lambda data: bytes([data[0] ^ 1]) + data[1:])
    return Expect(
        rf"replicas differ: region \[0:64\] is stored in {NORM_HOLDER} and {NORM_TWIN} with different bytes", f"tensor '{NORM}'"
    )


CASES = [
    missing_dir,
    empty_dir,
    shards_one_level_down,
    not_safetensors,
    too_short,
    truncated_data,
    truncated_header,
    header_length_past_file,
    header_length_over_cap,
    header_not_utf8,
    header_not_json,
    header_not_object,
    info_missing,
    info_not_json,
    info_entry_malformed,
    info_lacks_tensor,
    info_offsets_wrong_length,
    piece_at_negative_offset,
    piece_beyond_int64,
    pieces_imply_a_tensor_past_2_to_the_62_bytes,
    unknown_dtype,
    offsets_disagree_with_shape,
    offsets_overlap,
    offsets_gap,
    offsets_past_file,
    pieces_overlap,
    pieces_leave_hole,
    shard_file_missing,
    pieces_disagree_on_dtype,
    pieces_disagree_on_rank,
    same_pieces_in_two_files,
    stray_plain_safetensors,
    renamed_shard,
    output_counts_disagree,
    mapping_misses_tensor,
    mapping_names_absent_tensor,
    mapping_escapes_directory,
    mapping_names_a_file_too_long,
    mapping_names_the_parent,
    shard_number_out_of_range,
    replica_differs,
]


def _reading_rank(inp: Path, name: str, ranks: int) -> int:
    return sorted(p.name for p in inp.iterdir() if p.name.endswith(".safetensors")).index(name) % ranks


def _error_line(stderr: str, expect: Expect, rank: int) -> str:
    """The single error line, checked against what the case expects."""
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mpicons: error:")]
    assert len(errors) == 1, stderr
    # An error one rank found names that rank; one every rank finds alike may name rank 0 or none.
    tag = rf"\[rank {rank}\] " if expect.reader is not None else r"(\[rank 0\] )?"
    prefix = rf"mpicons: error: {tag}{re.escape(expect.starts)}"
    assert re.match(prefix, errors[0]), f"{errors[0]!r} does not start with {prefix!r}"
    assert re.search(expect.phrase, errors[0]), errors[0]
    for text in expect.mentions:
        assert text in errors[0], errors[0]
    return errors[0]


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_clear_error(mpi_tmp_path: Path, case: Callable[[Path], Expect], capsys) -> None:
    """The command line in-process on the test job's ranks: exit 2 everywhere, one line from rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    inp, out = mpi_tmp_path / "sharded", mpi_tmp_path / "out"
    expect = None
    if comm.rank == 0:
        shutil.copytree(SOURCE, inp)
        expect = case(inp)
    expect = comm.bcast(expect, root=0)
    rank = 0 if expect.reader is None else comm.bcast(_reading_rank(inp, expect.reader, comm.size) if comm.rank == 0 else None)
    code = main(["consolidate", str(inp), str(out), *expect.args], comm=comm)
    stderr = capsys.readouterr().err
    verdict = None
    try:
        assert code == 2, stderr
        if comm.rank == 0:
            _error_line(stderr, expect, rank)
            assert not out.exists() or list(out.iterdir()) == []
        else:
            assert stderr == "", stderr
    except AssertionError as exc:
        verdict = f"rank {comm.rank}: {exc}"
    verdicts = [v for v in comm.allgather(verdict) if v]
    assert not verdicts, "\n".join(verdicts)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_clear_error_under_mpiexec(tmp_path: Path, case: Callable[[Path], Expect], ranks: int) -> None:
    """The same through ``python -m mpicons`` under the launcher: no hang, no traceback, one line."""
    inp, out = tmp_path / "sharded", tmp_path / "out"
    shutil.copytree(SOURCE, inp)
    expect = case(inp)
    rank = 0 if expect.reader is None else _reading_rank(inp, expect.reader, ranks)
    if ranks == 3 and expect.reader is not None:
        assert rank != 0, "choose a broken file that rank 0 does not read"
    proc, _ = mpirun(ranks, ["-m", "mpicons", "consolidate", str(inp), str(out), *expect.args], timeout=30)
    assert proc.returncode == 2, proc.stderr
    _error_line(proc.stderr, expect, rank)
    assert not out.exists() or list(out.iterdir()) == []


def test_a_directory_above_checkpoints_names_them(tmp_path: Path) -> None:
    """No shards in the directory, some in its subdirectories: consolidate and inspect name what to pass."""
    shards = tmp_path / "ckpt" / "sharded"
    shutil.copytree(SOURCE, shards)
    for command in (["consolidate", tmp_path / "ckpt", tmp_path / "out"], ["inspect", tmp_path / "ckpt"]):
        proc, _ = mpirun(2, ["-m", "mpicons", *map(str, command)], timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert f"its subdirectory 'sharded' holds a checkpoint's files: pass {shards}" in proc.stderr
    shutil.copytree(DISTCP_FIXTURES / "fsdp-3ranks" / "dcp", tmp_path / "ckpt" / "step-2")  # .metadata and .distcp
    (tmp_path / "ckpt" / "notes").mkdir()
    proc, _ = mpirun(1, ["-m", "mpicons", "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")], timeout=60)
    assert proc.returncode == 2 and "its subdirectories 'sharded', 'step-2' hold checkpoints' files" in proc.stderr
    assert not (tmp_path / "out").exists()


LONG = "n" * 300  # longer than any common file system's name limit (255 bytes)


@pytest.mark.parametrize(
    "where, args",
    [
        ("output directory name", lambda tmp: [str(tmp / LONG / "out")]),
        ("output directory name", lambda tmp: [str(tmp / "out" / LONG)]),
        ("report path name", lambda tmp: [str(tmp / "out"), "--stats-json", str(tmp / LONG)]),
        ("report path name", lambda tmp: [str(tmp / "out"), "--stats-json", str(tmp / LONG / "s.json")]),
    ],
)
def test_names_the_file_system_cannot_hold_are_refused_before_any_work(
    tmp_path: Path, capsys, where: str, args: Callable[[Path], list[str]]
) -> None:
    from mpicons.comm import SingleProcess

    code = main(["consolidate", str(SOURCE), *args(tmp_path)], comm=SingleProcess())
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert re.fullmatch(
        rf"mpicons: error: (\[rank 0\] )?\S+: {where} 'n+\.\.\.' is 300 bytes long; .* choose a shorter name\n", stderr
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ranks", [1, 3])
def test_the_rewriting_helpers_alone_break_nothing(tmp_path: Path, ranks: int) -> None:
    """Control: a shard re-serialized unchanged by the helpers above still consolidates."""
    inp, out = tmp_path / "sharded", tmp_path / "out"
    shutil.copytree(SOURCE, inp)
    for name in (V1, V2):
        edit_info(inp / name, lambda info: None)
    add_norm_replica(inp)  # an identical replica is fine
    (inp / "notes.txt").write_text("not a shard, ignored\n")
    proc, _ = mpirun(ranks, ["-m", "mpicons", "consolidate", "-q", str(inp), str(out)], timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "SHA256SUMS",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


# ---------------------------------------------------------------- fuzzing DCP_SHARDING_INFO

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_offset = st.one_of(st.integers(0, 70), st.integers(2**61, 2**65), st.integers(-3, -1))
offsets = st.lists(_offset, min_size=2, max_size=2) | st.lists(_offset, max_size=4)


@st.composite
def mutated_info(draw: st.DrawFn, tensors: list[str]) -> str:
    """DCP_SHARDING_INFO text: mostly valid, with one entry, the whole object or its text damaged."""
    info = {name: {"saved_offsets": [0] * 2} for name in tensors}
    kind = draw(st.sampled_from(["offsets", "entry", "drop", "add", "object", "text"]))
    name = draw(st.sampled_from(tensors))
    if kind == "offsets":
        info[name]["saved_offsets"] = draw(offsets)
    elif kind == "entry":
        info[name] = draw(json_values)
    elif kind == "drop":
        del info[name]
    elif kind == "add":
        info[draw(st.text(max_size=8))] = {"saved_offsets": draw(offsets)}
    elif kind == "object":
        return json.dumps(draw(json_values))
    else:
        return draw(st.text(max_size=40))
    return json.dumps(info)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


TENSORS = ["a", "b", "c"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutated_info(TENSORS), st.lists(st.integers(0, 3), min_size=2, max_size=2))
def test_read_table_and_plan_survive_any_sharding_info(fuzz_dir: Path, info: str, shape: list[int]) -> None:
    """Whatever DCP_SHARDING_INFO says, reading and planning give a table and plan or an InputError."""
    name = "shard-00001-model-00001-of-00001.safetensors"
    tensors = {t: ("BF16", shape, bytes(2 * shape[0] * shape[1])) for t in TENSORS}
    blob = reference_bytes(tensors, {"format": "pt", INFO: info})
    (fuzz_dir / name).write_bytes(blob)
    try:
        table = read_table(str(fuzz_dir), [name])
    except InputError as exc:
        assert str(exc).startswith(str(fuzz_dir / name) + ": ")
        return
    assert len(table.pieces) == len(TENSORS)
    try:
        plan = build_plan(table, 2)
    except InputError:
        return
    assert sorted(t.name for t in plan.tensors) == TENSORS
