"""DCP's default format (``.metadata`` + ``.distcp``), read without torch.

The fixtures were written by torch (tests/fixtures/distcp/README.md); the expected tensors are
torch's own. Serial tests read them and break them; the MPI tests consolidate them at 1-4 ranks
and compare every output byte with safetensors' serializer.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    DISTCP_FIXTURES,
    DISTCP_NAMES,
    Tensors,
    assert_consolidated,
    cli,
    load_tensors,
    reference_bytes,
    sample_expected,
    slow_beyond,
)
from mpi4py import MPI
from safetensors.numpy import save_file

import mpicons
from mpicons.core.errors import InputError
from mpicons.core.safetensors_codec import DTYPES
from mpicons.formats.distcp_items import Item, locate
from mpicons.formats.distcp_metadata import read_metadata
from mpicons.formats.pickle_writer import Call, Global, Obj, dumps
from mpicons.sample import SampleConfig, check_sample, tensor_specs, write_sample

TORCH_SAVE = "dtypes-2ranks"
SAFETENSORS = "dtypes-2ranks-safetensors"


# ---------------------------------------------------------------- an independent look at the metadata


class _Stub:
    """Anything the pickle names: keeps its state and arguments (the test's own reading, not mpicons')."""

    def __init__(self, *args: object) -> None:
        self.args = args

    def __setstate__(self, state: object) -> None:
        self.state = state


class _Permissive(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        if (module, name) == ("torch", "Size"):
            return tuple  # type: ignore[return-value]
        return type(name, (_Stub,), {"module": module})


def saved_order(fixture: str) -> tuple[list[str], list[str]]:
    """(tensor names in the order they were saved, non-tensor names), read with a permissive unpickler."""
    with open(DISTCP_FIXTURES / fixture / "dcp" / ".metadata", "rb") as handle:
        metadata = _Permissive(handle).load().state
    entries = metadata["state_dict_metadata"]
    tensors = [n for n in metadata["planner_data"] if type(entries[n]).__name__ == "TensorStorageMetadata"]
    return tensors, sorted(n for n in entries if type(entries[n]).__name__ == "BytesStorageMetadata")


def expected(fixture: str) -> Tensors:
    return load_tensors(DISTCP_FIXTURES / fixture / "expected" / "full.safetensors")


def hf_shards(order: list[str], tensors: Tensors, max_size: int) -> dict[str, str]:
    """Hugging Face's greedy sharding (huggingface_hub's split_state_dict_into_shards) of ``order``."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for name in order:
        nbytes = len(tensors[name][2])
        if nbytes > max_size:
            shards.append([name])
            continue
        if current and size + nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    if len(shards) == 1:
        return dict.fromkeys(shards[0], "model.safetensors")
    return {n: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, shard in enumerate(shards, 1) for n in shard}


def copy_fixture(fixture: str, tmp_path: Path) -> Path:
    target = tmp_path / fixture
    shutil.copytree(DISTCP_FIXTURES / fixture / "dcp", target)
    for path in target.iterdir():
        path.chmod(0o644)
    return target


# ---------------------------------------------------------------- reading


@pytest.mark.parametrize("fixture", DISTCP_NAMES)
def test_metadata_is_read_without_torch(fixture: str) -> None:
    table = read_metadata(str(DISTCP_FIXTURES / fixture / "dcp" / ".metadata"))
    order, non_tensors = saved_order(fixture)
    tensors = expected(fixture)
    assert table.names == sorted(tensors) == sorted(order)
    assert [table.names[t] for t in sorted(range(len(table.names)), key=lambda t: table.order[t])] == order
    assert table.skipped == non_tensors
    for t, name in enumerate(table.names):
        dtype, shape, _ = tensors[name]
        assert (DTYPES[table.dtype[t]].name, list(table.size[t][: table.ndim[t]])) == (dtype, shape)


def test_the_fixtures_cover_every_dtype_dcp_writes() -> None:
    dtypes = {dtype for fixture in DISTCP_NAMES for dtype, _, _ in expected(fixture).values()}
    assert dtypes >= {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"}
    assert dtypes >= {"U16", "U32", "U64", "C64"}


class _Payload:
    """Pickles to a call of ``function(*args)``: what a hostile ``.metadata`` would hold."""

    def __init__(self, function: object, *args: object) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.function, self.args


def _hostile(marker: Path) -> dict[str, bytes]:
    touch = f"touch {marker}"
    return {
        "os.system": pickle.dumps(_Payload(os.system, touch), protocol=0),
        "eval (protocol 4)": pickle.dumps(_Payload(eval, f"open({str(marker)!r}, 'w')"), protocol=4),
        "subprocess": pickle.dumps(_Payload(__import__("subprocess").call, ["touch", str(marker)]), protocol=2),
        "nested in a dict": pickle.dumps({"state_dict_metadata": _Payload(os.system, touch)}, protocol=4),
        "torch.load": b"\x80\x04\x8c\x05torch\x8c\x04load\x93\x8c\x01x\x85R.",
        "persistent id": b"\x80\x02X\x01\x00\x00\x00xQ.",
        "not a pickle": b"\x00\x01 definitely not a pickle",
        "truncated": pickle.dumps({"a": [1, 2, 3]}, protocol=4)[:-5],
        "a plain dict": pickle.dumps({"state_dict_metadata": {}}, protocol=4),
    }


@pytest.mark.parametrize("case", list(_hostile(Path("x"))))
def test_a_hostile_metadata_is_refused_and_nothing_in_it_runs(tmp_path: Path, case: str) -> None:
    marker = tmp_path / "ran"
    checkpoint = copy_fixture("fsdp-3ranks", tmp_path)
    (checkpoint / ".metadata").write_bytes(_hostile(marker)[case])
    with pytest.raises(InputError) as error:
        mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    assert str(checkpoint / ".metadata") in str(error.value)
    if case in ("os.system", "eval (protocol 4)", "subprocess", "nested in a dict", "torch.load"):
        assert "unsupported" in str(error.value) and "refused without running anything" in str(error.value)
    assert not marker.exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_the_command_line_refuses_a_hostile_metadata_with_exit_2(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    checkpoint = copy_fixture("fsdp-3ranks", tmp_path)
    (checkpoint / ".metadata").write_bytes(_hostile(marker)["os.system"])
    proc, _ = cli(2, "consolidate", checkpoint, tmp_path / "out")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("mpicons: error:") == 1 and "Traceback" not in proc.stderr
    assert "unsupported: the metadata names posix.system" in proc.stderr, proc.stderr
    assert not marker.exists()


def _replace_item(checkpoint: Path, members: dict[str, bytes], compress: int = zipfile.ZIP_STORED) -> None:
    """Rewrite the one item of a one-tensor checkpoint as an archive of ``members``, padded to the recorded length."""
    data_file = checkpoint / "__0_0.distcp"
    length = data_file.stat().st_size
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=compress) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    blob = buffer.getvalue()
    assert len(blob) <= length - 22
    # The archive's comment pads it to the item's recorded length (EOCD stays at the item's end).
    comment = b"x" * (length - len(blob))
    assert struct.unpack("<H", blob[-2:])[0] == 0
    data_file.write_bytes(blob[:-2] + struct.pack("<H", len(comment)) + comment)


def _data_pkl(pickled_storage: str, offset: int, size: tuple[int, ...], stride: tuple[int, ...], numel: int = 12) -> bytes:
    """A ``torch.save``-style data.pkl rebuilding a tensor (written opcode by opcode, no torch)."""

    def ints(values: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(b"K" + bytes([v]) for v in values) + b"t"

    return (
        b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(("
        + b"X\x07\x00\x00\x00storage"
        + f"ctorch\n{pickled_storage}\n".encode()
        + b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK"
        + bytes([numel])
        + b"tQ"
        + b"K"
        + bytes([offset])
        + ints(size)
        + ints(stride)
        + b"\x89ccollections\nOrderedDict\n)RtR."
    )


@pytest.mark.parametrize(
    "case, phrase",
    [
        ("hostile data.pkl", "refused without running anything"),
        ("compressed storage", "compressed"),
        ("wrong dtype", "the archive holds F64, the metadata says F32"),
        ("wrong shape", "the archive holds shape [3, 4], the metadata says [4, 3]"),
        ("offset storage", None),
        ("not an archive", "neither a torch.save archive nor a safetensors blob"),
        ("truncated", "runs past the end"),
    ],
)
def test_an_item_that_is_not_what_the_metadata_says_is_named(tmp_path: Path, case: str, phrase: str | None) -> None:
    """On the ``transposed`` fixture (one F32 tensor [4, 3] that torch saved with strides (1, 4)), items altered."""
    checkpoint = copy_fixture("transposed", tmp_path)
    values = struct.pack("<12f", *range(12))
    if case == "hostile data.pkl":
        _replace_item(checkpoint, {"archive/data.pkl": pickle.dumps(_Payload(os.system, "true")), "archive/data/0": values})
    elif case == "compressed storage":
        members = {"archive/data.pkl": _data_pkl("FloatStorage", 0, (4, 3), (3, 1)), "archive/data/0": values}
        _replace_item(checkpoint, members, zipfile.ZIP_DEFLATED)
    elif case == "wrong dtype":
        members = {"archive/data.pkl": _data_pkl("DoubleStorage", 0, (4, 3), (3, 1)), "archive/data/0": values * 2}
        _replace_item(checkpoint, members)
    elif case == "wrong shape":  # same element count, other shape: [3, 4]
        _replace_item(checkpoint, {"archive/data.pkl": _data_pkl("FloatStorage", 0, (3, 4), (4, 1)), "archive/data/0": values})
    elif case == "offset storage":  # a view at element 2 of a 14-element storage: read exactly
        storage = struct.pack("<2f", -1, -1) + values
        _replace_item(
            checkpoint, {"archive/data.pkl": _data_pkl("FloatStorage", 2, (4, 3), (3, 1), numel=14), "archive/data/0": storage}
        )
    elif case == "not an archive":
        data = bytearray((checkpoint / "__0_0.distcp").read_bytes())
        data[:4] = b"JUNK"
        (checkpoint / "__0_0.distcp").write_bytes(bytes(data))
    elif case == "truncated":
        os.truncate(checkpoint / "__0_0.distcp", 1000)
    out = tmp_path / "out"
    if phrase is None:
        mpicons.consolidate(checkpoint, out, comm=MPI.COMM_SELF)
        assert load_tensors(out / "model.safetensors") == {"weight": ("F32", [4, 3], values)}
        return
    with pytest.raises(InputError) as error:
        mpicons.consolidate(checkpoint, out, comm=MPI.COMM_SELF)
    message = str(error.value)
    assert "__0_0.distcp" in message and "'weight'" in message and phrase in message, message


def test_a_data_file_no_rank_sees_is_named(tmp_path: Path) -> None:
    checkpoint = copy_fixture("fsdp-3ranks", tmp_path)
    (checkpoint / "__1_0.distcp").unlink()
    proc, _ = cli(2, "consolidate", checkpoint, tmp_path / "out")
    assert proc.returncode == 2
    assert "names data file '__1_0.distcp', which no rank sees" in proc.stderr


def test_inspect_lists_the_tensors_of_a_data_file_no_rank_sees_and_describes_the_rest(tmp_path: Path) -> None:
    checkpoint = copy_fixture("fsdp-3ranks", tmp_path)
    (checkpoint / "__1_0.distcp").unlink()
    report = mpicons.inspect(checkpoint, comm=MPI.COMM_SELF)
    assert not report.ok and report.problems
    assert all("'__1_0.distcp', which no rank sees" in p.what and p.tensor and repr(p.tensor) in p.what for p in report.problems)
    assert len({p.tensor for p in report.problems}) == len(report.problems)  # one line per tensor
    assert {s.name for s in report.shards} == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}


def test_non_tensor_entries_are_skipped_and_listed(tmp_path: Path) -> None:
    fixture = "tp2d-4ranks-optim"
    proc, _ = cli(1, "consolidate", DISTCP_FIXTURES / fixture / "dcp", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 entry that is not a tensor: optim.step" in proc.stdout
    tensors = expected(fixture)
    assert_consolidated(tmp_path / "out", tensors, dict.fromkeys(tensors, "model.safetensors"))
    report = tmp_path / "inspect.json"
    proc, _ = cli(1, "inspect", DISTCP_FIXTURES / fixture / "dcp", "--json", report)
    assert proc.returncode == 0, proc.stderr
    described = json.loads(report.read_text())
    assert described["skipped"] == ["optim.step"] and described["format"] == "distcp"
    assert "optim.step" in proc.stdout


def test_include_exclude_and_strip_prefix_choose_and_rename(tmp_path: Path) -> None:
    fixture = "tp2d-4ranks-optim"
    out = tmp_path / "out"
    args = ["--include", "model.*", "--include", "lm_head.*", "--exclude", "*norm*", "--strip-prefix", "model."]
    proc, _ = cli(2, "consolidate", DISTCP_FIXTURES / fixture / "dcp", out, "-q", *args)
    assert proc.returncode == 0, proc.stderr
    chosen = {
        (name[len("model.") :] if name.startswith("model.") else name): value
        for name, value in expected(fixture).items()
        if (name.startswith("model.") or name.startswith("lm_head.")) and "norm" not in name
    }
    assert chosen and not any(name.startswith("optim.") for name in chosen)
    assert_consolidated(out, chosen, dict.fromkeys(chosen, "model.safetensors"))
    assert (out / "model.safetensors").read_bytes() == reference_bytes(chosen)


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--include", "nothing.*"], "leave none of the 63 tensors"),
        (["--include", "lm_head.weight", "--strip-prefix", "lm_head.weight"], "would have no name left"),
        (["--strip-prefix", ""], "--strip-prefix must be a non-empty string"),
    ],
)
def test_selection_mistakes_are_bad_input(tmp_path: Path, args: list[str], phrase: str) -> None:
    proc, _ = cli(1, "consolidate", DISTCP_FIXTURES / "tp2d-4ranks-optim" / "dcp", tmp_path / "out", "-q", *args)
    assert proc.returncode == 2 and phrase in proc.stderr, proc.stderr


def test_names_that_a_stripped_prefix_makes_equal_are_bad_input(tmp_path: Path) -> None:
    """Selection works on every input format: here two plain safetensors files."""
    shards = tmp_path / "plain"
    shards.mkdir()
    (shards / "a.safetensors").write_bytes(reference_bytes({"model.w": ("F32", [2], bytes(8))}))
    (shards / "b.safetensors").write_bytes(reference_bytes({"w": ("F32", [2], bytes(8))}))
    proc, _ = cli(1, "consolidate", shards, tmp_path / "out", "--strip-prefix", "model.")
    assert proc.returncode == 2
    assert "tensors 'model.w' and 'w' would both be 'w'" in proc.stderr, proc.stderr
    proc, _ = cli(1, "consolidate", shards, tmp_path / "out", "--strip-prefix", "model.", "--exclude", "w", "-q")
    assert proc.returncode == 0, proc.stderr
    assert load_tensors(tmp_path / "out" / "a.safetensors") == {"w": ("F32", [2], bytes(8))}


def test_sharded_like_save_pretrained(tmp_path: Path) -> None:
    """No names to follow: Hugging Face's sharding, in the order the tensors were saved."""
    fixture = "fsdp-3ranks"
    tensors = expected(fixture)
    order, _ = saved_order(fixture)
    out = tmp_path / "out"
    proc, _ = cli(1, "consolidate", DISTCP_FIXTURES / fixture / "dcp", out, "-q", "--max-shard-size", "100KB")
    assert proc.returncode == 0, proc.stderr
    weight_map = hf_shards(order, tensors, 100_000)
    assert len(set(weight_map.values())) > 2
    assert_consolidated(out, tensors, weight_map)


def test_verify_against_a_distcp_checkpoint(tmp_path: Path) -> None:
    dcp = DISTCP_FIXTURES / TORCH_SAVE / "dcp"
    out = tmp_path / "out"
    assert cli(1, "consolidate", dcp, out, "-q")[0].returncode == 0
    good, _ = cli(2, "verify", out, "--against", dcp)
    assert good.returncode == 0, good.stdout + good.stderr
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    bad, _ = cli(2, "verify", out, "--against", dcp)
    assert bad.returncode == 1 and "differs from the shards" in bad.stdout, bad.stdout


# ---------------------------------------------------------------- consolidation at 1-4 ranks


_SMALL_BLOCKS = [(fixture, "bytes", "posix", 1 << 10) for fixture in DISTCP_NAMES]
_FILES_MPIIO = [(fixture, "files", "mpiio", 1 << 20) for fixture in DISTCP_NAMES]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "fixture, split, io, buffer_size",
    _SMALL_BLOCKS + slow_beyond(sorted(_FILES_MPIIO, key=lambda case: case[0] != TORCH_SAVE), 1),
)
def test_distcp_consolidates_to_reference_bytes(fixture: str, split: str, io: str, buffer_size: int, mpi_tmp_path: Path) -> None:
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(
        DISTCP_FIXTURES / fixture / "dcp", out, comm=MPI.COMM_WORLD, split=split, io=io, buffer_size=buffer_size
    )
    tensors = expected(fixture)
    assert result.files == ["model.safetensors"] and result.index_file == ""
    assert result.skipped == saved_order(fixture)[1]
    assert_consolidated(out, tensors, dict.fromkeys(tensors, "model.safetensors"))


@pytest.mark.mpi
@pytest.mark.parametrize("fixture", ["fsdp-3ranks", SAFETENSORS])
def test_distcp_on_node_local_disks(fixture: str, mpi_tmp_path: Path) -> None:
    """Data files spread over per-rank directories; only rank 0's has ``.metadata``."""
    comm = MPI.COMM_WORLD
    source = DISTCP_FIXTURES / fixture / "dcp"
    if comm.rank == 0:
        data_files = sorted(p for p in source.iterdir() if p.suffix == ".distcp")
        for rank in range(comm.size):
            (mpi_tmp_path / f"local-{rank}").mkdir()
        shutil.copy(source / ".metadata", mpi_tmp_path / "local-0" / ".metadata")
        for i, path in enumerate(data_files):
            shutil.copy(path, mpi_tmp_path / f"local-{(i + 1) % comm.size}" / path.name)
    comm.Barrier()
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(str(mpi_tmp_path / "local-{rank}"), out, comm=comm)
    tensors = expected(fixture)
    assert result.shared_input == (comm.size == 1)
    assert_consolidated(out, tensors, dict.fromkeys(tensors, "model.safetensors"))


@pytest.mark.mpi
@pytest.mark.parametrize("serialization", ["torch_save", "safetensors"])
def test_the_distcp_sample_consolidates_like_save_pretrained(serialization: str, mpi_tmp_path: Path) -> None:
    """The sample generator's .distcp checkpoint (written by this job's ranks), sharded at 200 kB."""
    comm = MPI.COMM_WORLD
    config = SampleConfig(layers=3, hidden=64, intermediate=136, vocab=301, dp=3, tp=2)
    write_sample(mpi_tmp_path / "in", config, comm, distcp=serialization)
    out = mpi_tmp_path / "out"
    result = mpicons.consolidate(mpi_tmp_path / "in", out, comm=comm, max_shard_size=200_000, buffer_size=1 << 14)
    tensors = sample_expected(config)
    weight_map = hf_shards([spec[0] for spec in tensor_specs(config)], tensors, 200_000)
    assert len(set(weight_map.values())) > 1 and result.skipped == ["train.step"]
    assert_consolidated(out, tensors, weight_map)
    assert check_sample(out, config, comm) == len(tensors)


def test_demo_in_the_distcp_format(tmp_path: Path) -> None:
    proc, _ = cli(2, "demo", tmp_path / "demo", "--distcp", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "demo" / "distcp-torch_save" / ".metadata").is_file()
    assert (tmp_path / "demo" / "consolidated" / "model.safetensors").is_file()


def _items_by_file(checkpoint: Path) -> dict[str, list[Item]]:
    table = read_metadata(str(checkpoint / ".metadata"))
    found: dict[str, list[Item]] = {}
    for i, t in enumerate(table.tensor):
        rank = int(table.ndim[t])
        found.setdefault(table.files[table.file[i]], []).append(
            Item(
                table.names[t],
                DTYPES[table.dtype[t]].name,
                tuple(int(x) for x in table.shape[i, :rank]),
                tuple(int(x) for x in table.offset[i, :rank]),
                int(table.item_offset[i]),
                int(table.item_length[i]),
            )
        )
    return found


@pytest.mark.parametrize("fixture", [*DISTCP_NAMES, "sample"])
def test_reading_archives_directly_agrees_with_zipfile(fixture: str, tmp_path: Path) -> None:
    """The two-read path for torch.save's archive layout finds every piece where zipfile does."""
    if fixture == "sample":
        checkpoint = tmp_path / "sample"
        write_sample(checkpoint, SampleConfig(layers=2, hidden=64, intermediate=136, vocab=301), distcp="torch_save")
    else:
        checkpoint = DISTCP_FIXTURES / fixture / "dcp"
    for name, items in _items_by_file(checkpoint).items():
        assert list(locate(str(checkpoint / name), items)) == list(locate(str(checkpoint / name), items, fast=False))


_ITEM = {"relative_path": "__0_0.distcp", "offset": 0, "length": 1577}  # the transposed fixture's one item


def _one_tensor_metadata(storage: dict[str, object], chunk: tuple[int, ...] = (0, 0), size: tuple[int, ...] = (4, 3)) -> bytes:
    """DCP metadata for the ``transposed`` fixture's one tensor, with ``storage`` in its _StorageInfo."""
    module, full = "torch.distributed.checkpoint.metadata", size

    def Size(dims: tuple[int, ...]) -> Call:  # noqa: N802
        return Call(Global("torch", "Size"), (dims,))

    properties = Obj(Global(module, "TensorProperties"), (Global("torch", "float32"), "torch.strided", False, 0, False))
    box = Obj(Global(module, "ChunkStorageMetadata"), {"offsets": Size(chunk), "sizes": Size((4, 3))})
    tensor = Obj(Global(module, "TensorStorageMetadata"), {"properties": properties, "size": Size(full), "chunks": [box]})
    key = Obj(Global(module, "MetadataIndex"), {"fqn": "weight", "offset": Size((0, 0)), "index": 0})
    info = Obj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), storage)
    return dumps(Obj(Global(module, "Metadata"), {"state_dict_metadata": {"weight": tensor}, "storage_data": {key: info}}))


@pytest.mark.parametrize(
    "storage, chunk, phrase",
    [
        (
            {"relative_path": "__0_0.distcp", "offset": 0, "length": 1577, "transform_descriptors": ["zstd"]},
            (0, 0),
            "stream transforms",
        ),
        ({"relative_path": "../__0_0.distcp", "offset": 0, "length": 1577}, (0, 0), "not a file name inside"),
        ({"relative_path": "__0_0.distcp", "offset": 0, "length": 1577}, (1, 0), "the piece at [1, 0] has no storage entry"),
        ({"relative_path": "__0_0.distcp", "offset": -1, "length": 1577}, (0, 0), "storage entry of tensor 'weight'"),
    ],
)
def test_metadata_that_cannot_be_followed_is_refused(
    tmp_path: Path, storage: dict[str, object], chunk: tuple[int, ...], phrase: str
) -> None:
    checkpoint = copy_fixture("transposed", tmp_path)
    (checkpoint / ".metadata").write_bytes(_one_tensor_metadata(storage, chunk))
    with pytest.raises(InputError) as error:
        mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    assert phrase in str(error.value), str(error.value)


def test_the_metadata_written_here_is_read_the_same_with_properties_as_a_tuple(tmp_path: Path) -> None:
    """Control for the cases above: the same metadata, followable, is read to the end."""
    checkpoint = copy_fixture("transposed", tmp_path)
    (checkpoint / ".metadata").write_bytes(_one_tensor_metadata({"relative_path": "__0_0.distcp", "offset": 0, "length": 1577}))
    mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_piece_torch_saved_transposed_is_read_in_its_order(tmp_path: Path) -> None:
    """The ``transposed`` fixture: torch saved the transpose of arange(12).reshape(3, 4) with strides (1, 4)."""
    checkpoint = copy_fixture("transposed", tmp_path)
    mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    expected = np.ascontiguousarray(np.arange(12, dtype=np.float32).reshape(3, 4).T)
    save_file({"weight": expected}, tmp_path / "expected.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


# ---------------------------------------------------------------- item extents agree with the archive's records


def _patch_member_size(blob: bytes, name: bytes, size: int, local_too: bool) -> bytes:
    """``blob`` (a zip archive) with member ``name``'s recorded size set to ``size`` in its central
    directory (and its local header): records that claim more bytes than the member holds."""
    data = bytearray(blob)
    at = 0
    while True:
        at = data.index(b"PK\x01\x02", at)
        names = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + names] == name:
            struct.pack_into("<LL", data, at + 20, size, size)
            local = struct.unpack_from("<L", data, at + 42)[0]
            if local_too:
                struct.pack_into("<LL", data, local + 18, size, size)
            return bytes(data)
        at += 46


@pytest.mark.parametrize("local_too", [False, True], ids=["central directory only", "local header too"])
@pytest.mark.parametrize("fast", [True, False], ids=["direct", "zipfile"])
def test_a_storage_record_longer_than_its_member_is_refused(tmp_path: Path, local_too: bool, fast: bool) -> None:
    """The storage's records claim 112 bytes, the member holds 48: reading 112 would publish the next
    member's header inside the tensor."""
    checkpoint = copy_fixture("transposed", tmp_path)
    values = struct.pack("<12f", *range(12))
    members = {"archive/data.pkl": _data_pkl("FloatStorage", 0, (4, 3), (3, 1), numel=28), "archive/data/0": values}
    _replace_item(checkpoint, {**members, "archive/version": b"3\n"})
    data_file = checkpoint / "__0_0.distcp"
    data_file.write_bytes(_patch_member_size(data_file.read_bytes(), b"archive/data/0", 112, local_too))
    (item,) = _items_by_file(checkpoint)["__0_0.distcp"]
    with pytest.raises(InputError) as error:
        locate(str(data_file), [item], fast=fast)
    message = str(error.value)
    assert "__0_0.distcp" in message and "'weight'" in message, message
    assert ("runs into the next record" if local_too else "records of archive/data/0 disagree") in message, message


def test_an_overlapping_storage_is_refused_by_consolidate(tmp_path: Path) -> None:
    checkpoint = copy_fixture("transposed", tmp_path)
    values = struct.pack("<12f", *range(12))
    members = {"archive/data.pkl": _data_pkl("FloatStorage", 0, (4, 3), (3, 1), numel=28), "archive/data/0": values}
    _replace_item(checkpoint, {**members, "archive/version": b"3\n"})
    data_file = checkpoint / "__0_0.distcp"
    data_file.write_bytes(_patch_member_size(data_file.read_bytes(), b"archive/data/0", 112, True))
    with pytest.raises(InputError, match="runs into the next record"):
        mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_blob_piece_whose_recorded_length_differs_is_refused() -> None:
    checkpoint = DISTCP_FIXTURES / SAFETENSORS / "dcp"
    name, items = next(iter(_items_by_file(checkpoint).items()))
    wrong = [dataclasses.replace(items[0], item_length=items[0].item_length + 64), *items[1:]]
    with pytest.raises(InputError, match="the metadata records"):
        locate(str(checkpoint / name), wrong)


# ---------------------------------------------------------------- bounded, poison-free unpicklers


def _deep_key(depth: int) -> bytes:
    """A dict whose key is a tuple nested ``depth`` deep: hashing it recurses once per level."""
    return b"\x80\x04}K\x01" + b"\x85" * depth + b"K\x02s."


def _amplifying_path(copies: int, length: int) -> bytes:
    """``PosixPath(s, s, ..., s)`` of one memoized ``length``-character string: a small file, a huge value."""
    return (
        b"\x80\x04\x8c\x07pathlib\x8c\x09PosixPath\x93\x94X"
        + struct.pack("<I", length)
        + b"x" * length
        + b"\x940("
        + b"h\x01" * copies
        + b"tR."
    )


def _build_on(module: str, name: str, state: bytes = b"}X\x04\x00\x00\x00nameX\x03\x00\x00\x00F16s") -> bytes:
    """BUILD (set state) applied to the global ``module.name`` itself."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + state + b"b."


def _hostile_metadata(case: str) -> bytes:
    storage = {"relative_path": "__0_0.distcp", "offset": 0, "length": 1577}
    if case == "memo index 2**27":
        return b"\x80\x02K\x01r" + struct.pack("<I", 1 << 27) + b"."
    if case == "memo index by PUT":
        return b"\x80\x02K\x01p4000000000\n."
    if case == "tuple key nested 200,000 deep":
        return _deep_key(200_000)
    if case == "a path far larger than the file":
        return _amplifying_path(200, 100_000)
    if case == "a size nested 40 deep":
        nested: object = 1
        for _ in range(40):
            nested = (nested,)
        return _one_tensor_metadata(storage, size=(nested, 3))  # type: ignore[arg-type]
    if case == "offset 2**63":
        return _one_tensor_metadata({**storage, "offset": 1 << 63})
    if case == "length 2**64":
        return _one_tensor_metadata({**storage, "length": 1 << 64})
    if case == "BUILD on a dtype":
        return _build_on("torch", "float32")
    if case == "BUILD with slot state on a stand-in function":
        return _build_on("torch", "Size", b"N}X\x0c\x00\x00\x00__defaults__K\x01\x85\x85s\x86")
    if case == "a lone surrogate in a name":
        return _one_tensor_metadata(storage).replace(b"X\x06\x00\x00\x00weight", b"X\x06\x00\x00\x00wei\xed\xa0\x80")
    if case == "2**80 elements":
        return _one_tensor_metadata(storage, size=(1 << 40, 1 << 40))
    raise AssertionError(case)


_HOSTILE_METADATA = {
    "memo index 2**27": "memo entry 134217728",
    "memo index by PUT": "memo entry 4000000000",
    "tuple key nested 200,000 deep": "nests values more than 64 deep",
    "a path far larger than the file": "far larger than the file",
    "a size nested 40 deep": "size",
    "offset 2**63": "below 2**63",
    "length 2**64": "below 2**63",
    "BUILD on a dtype": "sets state",
    "BUILD with slot state on a stand-in function": "sets state",
    "a lone surrogate in a name": "lone surrogate",
    "2**80 elements": "2**63 bytes or more",
}


@pytest.mark.parametrize("case", list(_HOSTILE_METADATA))
def test_metadata_past_the_reader_bounds_is_bad_input(tmp_path: Path, case: str) -> None:
    checkpoint = copy_fixture("transposed", tmp_path)
    (checkpoint / ".metadata").write_bytes(_hostile_metadata(case))
    with pytest.raises(InputError) as error:
        read_metadata(str(checkpoint / ".metadata"))
    assert str(checkpoint / ".metadata") in str(error.value) and _HOSTILE_METADATA[case] in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "case, command",
    [
        ("memo index 2**27", "consolidate"),
        ("tuple key nested 200,000 deep", "consolidate"),
        ("BUILD on a dtype", "consolidate"),
        ("a lone surrogate in a name", "consolidate"),
        pytest.param("offset 2**63", "consolidate", marks=pytest.mark.slow),
        ("2**80 elements", "inspect"),
    ],
)
def test_the_command_line_says_one_line_and_exits_2_past_a_bound(tmp_path: Path, case: str, command: str) -> None:
    checkpoint = copy_fixture("transposed", tmp_path)
    (checkpoint / ".metadata").write_bytes(_hostile_metadata(case))
    args = [command, checkpoint] if command == "inspect" else [command, checkpoint, tmp_path / "out"]
    proc, _ = cli(1, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("mpicons: error:") == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and ".metadata" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "data_pkl, phrase",
    [
        (b"\x80\x02K\x01r" + struct.pack("<I", 1 << 27) + b".", "memo entry"),
        (_deep_key(1000), "nests values"),
        (_build_on("torch", "FloatStorage", b"}X\x05\x00\x00\x00dtypeX\x03\x00\x00\x00F16s"), "sets state"),
        (_build_on("torch._utils", "_rebuild_tensor_v2"), "sets state"),
    ],
    ids=["memo index", "deep key", "BUILD on a storage class", "BUILD on a function"],
)
def test_a_hostile_data_pkl_is_bounded(tmp_path: Path, data_pkl: bytes, phrase: str) -> None:
    checkpoint = copy_fixture("transposed", tmp_path)
    _replace_item(checkpoint, {"archive/data.pkl": data_pkl, "archive/data/0": struct.pack("<12f", *range(12))})
    with pytest.raises(InputError, match=phrase):
        mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)


def test_a_hostile_checkpoint_changes_nothing_for_the_next_one(tmp_path: Path) -> None:
    """In one process: archives that try to set state on every stand-in either unpickler hands out,
    then well-formed checkpoints, which must read as if nothing had come before."""
    from mpicons.formats import distcp_items, distcp_metadata

    hostile = copy_fixture("transposed", tmp_path / "hostile")
    values = struct.pack("<12f", *range(12))
    names = [
        *distcp_items._TENSOR_FUNCTIONS,
        *distcp_items._STORAGE_TYPES,
        *distcp_metadata._METADATA_FUNCTIONS,
        *distcp_metadata._RECORDS,
        ("torch", "bfloat16"),
    ]
    states = [b"}X\x05\x00\x00\x00dtypeX\x03\x00\x00\x00F16s", b"N}X\x05\x00\x00\x00dtypeX\x03\x00\x00\x00F16s\x86"]
    for module, name in names:
        for state in states:
            _replace_item(hostile, {"archive/data.pkl": _build_on(module, name, state), "archive/data/0": values})
            with pytest.raises(InputError):
                mpicons.consolidate(hostile, tmp_path / "refused", comm=MPI.COMM_SELF)
            (hostile / ".metadata").write_bytes(_build_on(module, name, state))
            with pytest.raises(InputError):
                read_metadata(str(hostile / ".metadata"))
            shutil.copy(DISTCP_FIXTURES / "transposed" / "dcp" / ".metadata", hostile / ".metadata")
    for fixture in (TORCH_SAVE, "fsdp-3ranks"):
        out = tmp_path / f"out-{fixture}"
        mpicons.consolidate(copy_fixture(fixture, tmp_path), out, comm=MPI.COMM_SELF)
        assert load_tensors(out / "model.safetensors") == expected(fixture)


def test_the_opcode_check_passes_what_torch_and_the_sample_write(tmp_path: Path) -> None:
    """Control for the bounds: every pickle of the fixtures and of the sample is read."""
    from mpicons.formats.pickle_scan import check_opcodes

    write_sample(tmp_path / "sample", SampleConfig(layers=1, hidden=16, intermediate=40, vocab=50), distcp="torch_save")
    directories = [DISTCP_FIXTURES / name / "dcp" for name in DISTCP_NAMES] + [tmp_path / "sample"]
    for directory in directories:
        check_opcodes((directory / ".metadata").read_bytes())
        for items in _items_by_file(directory).values():
            assert items


# ---------------------------------------------------------------- layouts not read: named, with what to do


def _strided_checkpoint(tmp_path: Path, strided: list[str], good: list[str]) -> Path:
    """Tensors [4, 3] of F32, one data file each: ``strided`` ones saved as a view with no contiguous dim
    (strides (2, 8) into 24 elements, as ``x[::2, ::2]`` of a [8, 6] tensor's transpose), ``good`` row-major."""
    module = "torch.distributed.checkpoint.metadata"
    checkpoint = tmp_path / "strided"
    checkpoint.mkdir()
    source = DISTCP_FIXTURES / "transposed" / "dcp" / "__0_0.distcp"
    length = source.stat().st_size

    def size(dims: tuple[int, ...]) -> Call:
        return Call(Global("torch", "Size"), (dims,))

    entries, storage = {}, {}
    for rank, name in enumerate(strided + good):
        data_file = f"__{rank}_0.distcp"
        shutil.copy(source, checkpoint / data_file)
        (checkpoint / data_file).chmod(0o644)
        properties = Obj(Global(module, "TensorProperties"), (Global("torch", "float32"), "torch.strided", False, 0, False))
        box = Obj(Global(module, "ChunkStorageMetadata"), {"offsets": size((0, 0)), "sizes": size((4, 3))})
        entries[name] = Obj(
            Global(module, "TensorStorageMetadata"), {"properties": properties, "size": size((4, 3)), "chunks": [box]}
        )
        key = Obj(Global(module, "MetadataIndex"), {"fqn": name, "offset": size((0, 0)), "index": 0})
        where = {"relative_path": data_file, "offset": 0, "length": length}
        storage[key] = Obj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), where)
    (checkpoint / ".metadata").write_bytes(
        dumps(Obj(Global(module, "Metadata"), {"state_dict_metadata": entries, "storage_data": storage}))
    )
    for rank, name in enumerate(strided + good):
        one = tmp_path / f"item-{rank}"
        one.mkdir()
        shutil.copy(checkpoint / f"__{rank}_0.distcp", one / "__0_0.distcp")
        if name in strided:
            members = {
                "archive/data.pkl": _data_pkl("FloatStorage", 0, (4, 3), (2, 8), numel=24),
                "archive/data/0": struct.pack("<24f", *range(24)),
            }
        else:
            members = {
                "archive/data.pkl": _data_pkl("FloatStorage", 0, (4, 3), (3, 1)),
                "archive/data/0": struct.pack("<12f", *range(12)),
            }
        _replace_item(one, members)
        shutil.copy(one / "__0_0.distcp", checkpoint / f"__{rank}_0.distcp")
    return checkpoint


def test_inspect_lists_every_strided_tensor_and_what_to_do(tmp_path: Path) -> None:
    checkpoint = _strided_checkpoint(tmp_path, ["a.weight", "b.weight", "c.weight"], ["d.weight"])
    report = mpicons.inspect(checkpoint, comm=MPI.COMM_SELF)
    assert not report.ok
    assert sorted(p.tensor for p in report.problems) == ["a.weight", "b.weight", "c.weight"]
    for problem in report.problems:
        assert "strides [2, 8]" in problem.what and f"--exclude {problem.tensor}" in problem.what, problem.what
        assert "no dimension is contiguous" in problem.what and "__" in problem.what, problem.what
    assert {t.name: t.status for t in report.tensors}["d.weight"] == "ok"


def test_consolidate_names_every_strided_tensor_and_exclude_leaves_them_out(tmp_path: Path) -> None:
    checkpoint = _strided_checkpoint(tmp_path, ["a.weight", "b.weight"], ["d.weight"])
    with pytest.raises(InputError) as error:
        mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    message = str(error.value)
    assert "'a.weight'" in message and "'b.weight'" in message and "--exclude a.weight" in message, message
    out = tmp_path / "kept"
    mpicons.consolidate(checkpoint, out, comm=MPI.COMM_SELF, exclude=["a.weight", "b.weight"])
    assert load_tensors(out / "model.safetensors") == {"d.weight": ("F32", [4, 3], struct.pack("<12f", *range(12)))}


def test_the_command_line_lists_the_strided_tensors_in_one_line(tmp_path: Path) -> None:
    checkpoint = _strided_checkpoint(tmp_path, ["a.weight", "b.weight"], [])
    proc, _ = cli(1, "consolidate", checkpoint, tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--exclude" in proc.stderr and "b.weight" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- tensors with no elements: any strides


def _checkpoint_of(tmp_path: Path, tensors: dict[str, tuple[tuple[int, ...], tuple[int, ...], np.ndarray]]) -> Path:
    """One data file of F32 tensors, each one ``torch.save`` item of ``(shape, strides, storage values)``,
    each tensor one chunk at offset 0 (the items written by the sample's own archive writer)."""
    from mpicons.trainers.sample_distcp import tensor_pickle, torch_archive

    module = "torch.distributed.checkpoint.metadata"
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()

    def size(dims: tuple[int, ...]) -> Call:
        return Call(Global("torch", "Size"), (dims,))

    entries, storage, data = {}, {}, b""
    for name, (shape, stride, values) in tensors.items():
        item = torch_archive(tensor_pickle("F32", shape, stride, values.size), values.astype("<f4").tobytes())
        properties = Obj(Global(module, "TensorProperties"), (Global("torch", "float32"), "torch.strided", False, 0, False))
        zero = size((0,) * len(shape))
        box = Obj(Global(module, "ChunkStorageMetadata"), {"offsets": zero, "sizes": size(shape)})
        entries[name] = Obj(
            Global(module, "TensorStorageMetadata"), {"properties": properties, "size": size(shape), "chunks": [box]}
        )
        key = Obj(Global(module, "MetadataIndex"), {"fqn": name, "offset": zero, "index": 0})
        where = {"relative_path": "__0_0.distcp", "offset": len(data), "length": len(item)}
        storage[key] = Obj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), where)
        data += item
    (checkpoint / "__0_0.distcp").write_bytes(data)
    (checkpoint / ".metadata").write_bytes(
        dumps(Obj(Global(module, "Metadata"), {"state_dict_metadata": entries, "storage_data": storage}))
    )
    return checkpoint


@pytest.mark.parametrize(
    "shape, stride",
    [((4, 0), (1, 1)), ((0, 5), (1, 1)), ((4, 0), (1, 4)), ((2, 0, 3), (9, 9, 9)), ((0,), (7,))],
    ids=["(4, 0) strides [1, 1]", "(0, 5) strides [1, 1]", "(4, 0) transposed", "(2, 0, 3) strides [9, 9, 9]", "(0,)"],
)
def test_a_tensor_with_no_elements_is_read_whatever_its_strides(
    tmp_path: Path, shape: tuple[int, ...], stride: tuple[int, ...]
) -> None:
    """torch saves a zero-size tensor with the strides it had (``(4, 0)`` with ``[1, 1]``): they mean nothing
    without elements. The output is what safetensors writes for the same tensors, beside a plain one."""
    weight = np.arange(12, dtype=np.float32).reshape(4, 3)
    checkpoint = _checkpoint_of(
        tmp_path, {"empty": (shape, stride, np.zeros(0, np.float32)), "weight": ((4, 3), (3, 1), weight.ravel())}
    )
    report = mpicons.inspect(checkpoint, comm=MPI.COMM_SELF)
    assert report.ok, report.problems
    out = tmp_path / "out"
    mpicons.consolidate(checkpoint, out, comm=MPI.COMM_SELF, sync=False)
    save_file(
        {"empty": np.zeros(shape, np.float32), "weight": weight}, tmp_path / "expected.safetensors", metadata={"format": "pt"}
    )
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()
    proc, _ = cli(2, "verify", out, "--against", checkpoint)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_tensor_with_elements_still_needs_strides_that_fit_its_storage(tmp_path: Path) -> None:
    """Control for the case above: strides [1, 1] on a (4, 2) tensor with elements make them overlap."""
    checkpoint = _checkpoint_of(tmp_path, {"w": ((4, 2), (1, 1), np.zeros(5, np.float32))})
    with pytest.raises(InputError) as error:
        mpicons.consolidate(checkpoint, tmp_path / "out", comm=MPI.COMM_SELF)
    assert "'w'" in str(error.value) and "strides [1, 1]" in str(error.value), str(error.value)


def test_a_metadata_beside_safetensors_shards_and_no_distcp_file_says_which_is_read(tmp_path: Path) -> None:
    """A .metadata makes the directory DCP's default format; beside DCP's Hugging Face layout shards and
    no .distcp file it is refused naming both, with what to move, before anything is written."""
    from helpers import FIXTURES, cli

    shards = tmp_path / "shards"
    shutil.copytree(FIXTURES / "fsdp2-3ranks" / "sharded", shards)
    shutil.copy(DISTCP_FIXTURES / "fsdp-3ranks" / "dcp" / ".metadata", shards / ".metadata")
    out = tmp_path / "out"
    with pytest.raises(mpicons.InputError, match=r"\.metadata .*beside .*safetensors files.*move the \.metadata"):
        mpicons.consolidate(shards, out)
    assert not out.exists()
    proc, _ = cli(1, "inspect", shards)
    assert proc.returncode == 2 and "move the .metadata" in proc.stderr, proc.stderr
