"""Whole ``torch.save`` archives read without torch (mpicons.formats.torch_archive).

The archives are the ones DeepSpeed and verl wrote (tests/fixtures/deepspeed, tests/fixtures/verl);
every storage's bytes are checked against Python's own zip reader. Then the archives are broken:
hostile pickles (classes nobody allowed, payloads, memo and nesting bombs), truncated and damaged
zips. Each must be one InputError (exit 2) naming the file, with nothing run and nothing read whole.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mpicons.core.errors import InputError
from mpicons.core.safetensors_codec import DTYPE_BY_NAME
from mpicons.formats.byte_sources import PosixSource
from mpicons.formats.torch_archive import MAX_PICKLE, read_archive
from mpicons.formats.unpickling import AllowList, EnumMember, record_class
from mpicons.trainers.deepspeed import records as deepspeed
from mpicons.trainers.verl import records as verl

FIXTURES = Path(__file__).parent / "fixtures"
DEEPSPEED = sorted((FIXTURES / "deepspeed").glob("*/checkpoint/global_step*/*.pt"))
VERL = sorted((FIXTURES / "verl").glob("*/checkpoint/global_step_*/actor/*.pt"))
ZERO2_OPTIM = FIXTURES / "deepspeed/llama-zero2/checkpoint/global_step2/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _allowed(path: Path) -> AllowList:
    return verl.ALLOWED if path in VERL else deepspeed.ALLOWED


class CountingSource(PosixSource):
    """A file that remembers every read asked of it."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.reads: list[int] = []

    def read_at(self, offset: int, length: int) -> bytes:
        self.reads.append(length)
        return super().read_at(offset, length)


@pytest.mark.parametrize("fast", [True, False], ids=["direct", "zipfile"])
@pytest.mark.parametrize("path", DEEPSPEED + VERL, ids=lambda p: f"{p.parts[-4]}/{p.name}")
def test_every_tensor_is_found_where_pythons_zip_reader_finds_its_storage(path: Path, fast: bool) -> None:
    with zipfile.ZipFile(path) as archive, PosixSource(str(path)) as source:
        found = read_archive(source, _allowed(path), "test checkpoints", fast=fast)
        tensors = found.tensors()
        begins = found.locate(tensors)
        raw = path.read_bytes()
        assert tensors
        for tensor, begin in zip(tensors, begins.tolist()):
            unit = DTYPE_BY_NAME[tensor.dtype].bits // 8
            storage = archive.read(f"{found.root}/data/{tensor.storage.key}")
            start = tensor.storage_offset * unit
            assert raw[begin : begin + len(storage) - start] == storage[start:]


@pytest.mark.parametrize("path", [ZERO2_OPTIM, VERL[0]], ids=["zero2 optimizer states", "verl model"])
def test_reading_an_archive_reads_its_records_never_its_storages(path: Path) -> None:
    source = CountingSource(str(path))
    with source:
        found = read_archive(source, _allowed(path), "test checkpoints")
        opened = len(source.reads)
        found.locate(found.tensors())
    pickled = zipfile.ZipFile(path).getinfo(f"{found.root}/data.pkl").file_size
    assert opened == 2, source.reads  # the tail (central directory), then data.pkl with its neighbours
    # Then the storages' records: nearby ones together (small storages between them read along),
    # never a read of more than 1 MiB; the big storages of the optimizer states are never read.
    assert len(source.reads) <= 6 and max(source.reads[2:]) <= 1 << 20, source.reads
    assert source.reads[1] <= pickled + 1024
    if path == ZERO2_OPTIM:
        assert sum(source.reads) < pickled + (1 << 17), source.reads


def test_reading_imports_neither_torch_nor_the_trainers() -> None:
    code = (
        "import sys\n"
        "from mpicons.formats.byte_sources import PosixSource\n"
        "from mpicons.formats.torch_archive import read_archive\n"
        "from mpicons.trainers.deepspeed.records import ALLOWED as D\n"
        "from mpicons.trainers.verl.records import ALLOWED as V\n"
        f"for p in {[str(p) for p in DEEPSPEED + VERL]!r}:\n"
        "    with PosixSource(p) as s:\n"
        "        a = read_archive(s, D | V, 'x')\n"
        "        a.locate(a.tensors())\n"
        "assert not {'torch', 'deepspeed', 'verl'} & set(sys.modules), sorted(sys.modules)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# ---------------------------------------------------------------- broken archives


def _rewrite(source: Path, target: Path, replace: dict[str, bytes] | None = None, compress: str | None = None) -> Path:
    """A copy of the archive at ``source`` with members (by name suffix) replaced or compressed."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            data = next((v for k, v in (replace or {}).items() if info.filename.endswith(k)), old.read(info))
            method = zipfile.ZIP_DEFLATED if compress and info.filename.endswith(compress) else zipfile.ZIP_STORED
            new.writestr(info.filename, data, compress_type=method)
    return target


def _read(path: Path) -> object:
    with PosixSource(str(path)) as source:
        found = read_archive(source, deepspeed.ALLOWED, deepspeed.KIND)
        found.locate(found.tensors())
        return found.value


class _Payload:
    def __init__(self, function: object, *args: object) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.function, self.args


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _amplifying_size(copies: int) -> bytes:
    """``torch.Size`` of one memoized 64-item tuple, ``copies`` times: 7 bytes of pickle each, 65 values built."""
    items = b"(" + b"K\x01" * 64 + b"tq\x00"
    return b"\x80\x02" + items + _global("torch", "Size") + b"q\x010(" + b"h\x01h\x00\x85R0" * copies + b"1N."


_SLOT_STATE = b"N}X\x04\x00\x00\x00kindK\x01s\x86"  # (None, {"kind": 1}): BUILD sets attributes
_HOSTILE = {
    "os.system": (lambda marker: pickle.dumps(_Payload(os.system, f"touch {marker}"), protocol=2), "refused without running"),
    "a class no one allowed": (lambda marker: b"\x80\x02" + _global("torch.distributed.tensor", "DTensor") + b".", "DTensor"),
    "memo index 2**27": (lambda marker: b"\x80\x02K\x01r" + struct.pack("<I", 1 << 27) + b".", "memo entry"),
    "nested 1000 deep": (lambda marker: b"\x80\x02]" + b"]" * 1000 + b"a" * 1000 + b".", "nests values"),
    "a size far larger than the file": (lambda marker: _amplifying_size(20000), "far larger than the file"),
    "BUILD on an allowed class": (
        lambda marker: (
            b"\x80\x02" + _global("deepspeed.runtime.zero.config", "ZeroStageEnum") + b"N}X\x04\x00\x00\x00kindK\x01s\x86b."
        ),
        "not a readable pickle",
    ),
    "BUILD twice on a record": (
        lambda marker: b"\x80\x02" + _global("deepspeed.runtime.fp16.loss_scaler", "LossScaler") + b")\x81}b}b.",
        "twice",
    ),
    "BUILD twice on a state dict": (lambda marker: b"\x80\x02" + _global("collections", "OrderedDict") + b")R}b}b.", "twice"),
    "truncated": (lambda marker: pickle.dumps({"module": {}, "x": list(range(100))}, protocol=2)[:-7], "not a readable pickle"),
}


@pytest.mark.parametrize("case", list(_HOSTILE))
def test_a_hostile_data_pkl_is_one_input_error_and_nothing_runs(tmp_path: Path, case: str) -> None:
    marker = tmp_path / "ran"
    make, phrase = _HOSTILE[case]
    broken = _rewrite(ZERO2_OPTIM, tmp_path / "broken.pt", {"/data.pkl": make(marker)})
    with pytest.raises(InputError) as error:
        _read(broken)
    assert str(broken) in str(error.value) and phrase in str(error.value), str(error.value)
    assert error.value.exit_code == 2 and not marker.exists()
    assert "DeepSpeed ZeRO checkpoints" in str(error.value) or case not in ("os.system", "a class no one allowed")


def _storage_records(path: Path) -> tuple[zipfile.ZipInfo, bytes]:
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        return info, archive.read(info)


def test_a_storage_shorter_than_its_pickle_says_is_named(tmp_path: Path) -> None:
    info, data = _storage_records(ZERO2_OPTIM)
    broken = _rewrite(ZERO2_OPTIM, tmp_path / "short.pt", {info.filename: data[:-40]})
    with pytest.raises(
        InputError, match=rf"storage '{info.filename.rsplit('/', 1)[1]}' is {len(data) - 40} bytes in the archive"
    ):
        _read(broken)


def test_a_tensor_past_the_end_of_its_storage_is_named(tmp_path: Path) -> None:
    with zipfile.ZipFile(ZERO2_OPTIM) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    # exp_avg (storage '1', 125664 floats) saved at storage offset 0: move it to offset 9.
    moved = pickled.replace(b"tq\x1eQK\x00J\xe0\xea\x01\x00", b"tq\x1eQK\tJ\xe0\xea\x01\x00", 1)
    assert moved != pickled
    broken = _rewrite(ZERO2_OPTIM, tmp_path / "moved.pt", {"/data.pkl": moved})
    with pytest.raises(InputError, match="runs past the end of its 502656-byte storage '1'"):
        _read(broken)


@pytest.mark.parametrize(
    "damage, phrase",
    [
        ("truncated", "not a readable torch.save archive"),
        ("compressed storage", "compressed"),
        ("compressed data.pkl", "compressed"),
        ("huge central directory", "not a readable torch.save archive"),
        ("big-endian", "not little-endian"),
        ("not a zip", "not a readable torch.save archive"),
    ],
)
def test_a_damaged_archive_is_one_input_error_naming_it(tmp_path: Path, damage: str, phrase: str) -> None:
    broken = tmp_path / "damaged.pt"
    raw = ZERO2_OPTIM.read_bytes()
    if damage == "truncated":
        broken.write_bytes(raw[: len(raw) - 100])
    elif damage == "compressed storage":
        _rewrite(ZERO2_OPTIM, broken, compress="/data/3")
    elif damage == "compressed data.pkl":
        _rewrite(ZERO2_OPTIM, broken, compress="/data.pkl")
    elif damage == "huge central directory":  # the end records claim a central directory of 2 GiB
        end, end64 = raw.rindex(b"PK\x05\x06"), raw.rindex(b"PK\x06\x06")
        raw = raw[: end + 12] + struct.pack("<L", 1 << 31) + raw[end + 16 :]
        broken.write_bytes(raw[: end64 + 40] + struct.pack("<Q", 1 << 31) + raw[end64 + 48 :])
    elif damage == "big-endian":
        _rewrite(ZERO2_OPTIM, broken, {"/byteorder": b"big"})
    else:
        broken.write_bytes(b"\0" * 5000)
    with pytest.raises(InputError) as error:
        _read(broken)
    assert str(broken) in str(error.value) and phrase in str(error.value), str(error.value)


def test_a_hostile_archive_changes_nothing_for_the_next_one(tmp_path: Path) -> None:
    """Archives that try to set state on every record class and stand-in, then the real one, read as before."""
    before = _read(ZERO2_OPTIM)
    states = [b"}X\x04\x00\x00\x00kindX\x01\x00\x00\x00xs", b"N}X\x04\x00\x00\x00kindX\x01\x00\x00\x00xs\x86"]
    allowed = [tuple(n.rsplit(".", 1)) for n in deepspeed.ALLOWED.names()]
    names = [*allowed, ("torch", "FloatStorage"), ("torch", "float32"), ("collections", "OrderedDict")]
    for module, name in names:
        for state in states:
            broken = _rewrite(
                ZERO2_OPTIM, tmp_path / "broken.pt", {"/data.pkl": b"\x80\x02" + _global(module, name) + state + b"b."}
            )
            with pytest.raises(InputError):
                _read(broken)
    kind = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert record_class(kind).kind == kind
    after = _read(ZERO2_OPTIM)
    assert repr(after) == repr(before)
    stage = after["optimizer_state_dict"]["zero_stage"]  # type: ignore[index]
    assert isinstance(stage, EnumMember) and stage.value == 2


def test_the_bound_on_one_read_is_far_above_what_trainers_write() -> None:
    sizes = [zipfile.ZipFile(p).infolist()[0].file_size for p in DEEPSPEED + VERL]
    assert max(sizes) * 1000 < MAX_PICKLE


def test_an_empty_tensor_far_past_its_storage_is_named(tmp_path: Path) -> None:
    """Empty, so no element lies outside: its start still must (2**62 elements in would overflow offsets)."""
    with zipfile.ZipFile(ZERO2_OPTIM) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    # exp_avg (storage '1') at storage offset 0 with 125664 elements: offset 2**62 (LONG1), no elements.
    far = b"\x8a\x08" + (2**62).to_bytes(8, "little")
    moved = pickled.replace(b"tq\x1eQK\x00J\xe0\xea\x01\x00", b"tq\x1eQ" + far + b"J\x00\x00\x00\x00", 1)
    assert moved != pickled
    broken = _rewrite(ZERO2_OPTIM, tmp_path / "far.pt", {"/data.pkl": moved})
    with pytest.raises(InputError, match=r"starts at element 4611686018427387904, outside its 502656-byte storage '1'"):
        _read(broken)
