"""Trainer files made to break the readers: numbers too long to read, JSON nested too deep. Each is
exit 2 with one line naming the file, never a traceback, on copies of the real fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import cli, run_python
from trainer_saves import write_zero

FIXTURES = Path(__file__).parent / "fixtures"
RUNS = {
    "megatron": FIXTURES / "megatron" / "llama-tp2" / "checkpoint",
    "verl": FIXTURES / "verl" / "llama-fsdp2" / "checkpoint",
}
TIMEOUT = 120


def refused(proc, *said: str) -> None:  # type: ignore[no-untyped-def]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("mpicons: error:") == 1, proc.stderr
    words = " ".join(proc.stderr.split())
    for text in said:
        assert text in words, proc.stderr


@pytest.mark.parametrize("trainer", list(RUNS))
@pytest.mark.parametrize("text", ["9" * 5000, "\u0661\u0660", "10 11"])
def test_a_tracker_file_that_is_no_plain_number_is_refused(trainer: str, text: str, tmp_path: Path) -> None:
    """5000 digits (past int()'s limit), digits of another script (which int() reads), two numbers."""
    run = tmp_path / "run"
    shutil.copytree(RUNS[trainer], run)
    (run / "latest_checkpointed_iteration.txt").write_text(text)
    proc = cli(1, "consolidate", run, tmp_path / "out", timeout=TIMEOUT)[0]
    # verl's run folder names no step of verl's then, and the tracker file is read as Megatron's: either way, named.
    refused(proc, "latest_checkpointed_iteration.txt: holds", "neither an iteration number nor 'release'")
    assert not (tmp_path / "out").exists()


def test_a_config_nested_too_deep_is_refused(tmp_path: Path) -> None:
    actor = tmp_path / "step" / "actor"
    shutil.copytree(RUNS["verl"] / "global_step_1" / "actor", actor)
    (actor / "fsdp_config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(cli(1, "consolidate", actor, tmp_path / "out", timeout=TIMEOUT)[0], "fsdp_config.json: not valid JSON")


def test_zero_partitions_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    """Rank 0's fp32 partition one element short, rank 1's one longer: the totals agree, every parameter
    after the cut would be shifted by one element. DeepSpeed gives every rank the same partition: exit 2."""
    rng = np.random.default_rng(7)
    params = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((6, 5)).astype(np.float32) for i in range(3)}
    write_zero(tmp_path / "run" / "global_step1", params, 2, 2, shift=1)
    proc = cli(2, "consolidate", tmp_path / "run", tmp_path / "out", timeout=TIMEOUT)[0]
    said = "parameter group 0: its fp32 partition holds 45 elements, DeepSpeed gives rank 0 of 2 46"
    refused(proc, f"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt: {said}")
    assert not (tmp_path / "out").exists()
    write_zero(tmp_path / "good" / "global_step1", params, 2, 2)
    assert cli(1, "consolidate", tmp_path / "good", tmp_path / "out", timeout=TIMEOUT)[0].returncode == 0


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, more than any model has"),
        ({"num_hidden_layers": 90_000, "num_local_experts": 90_000}, "more tensors than any model has"),
    ],
)
def test_a_config_sized_past_any_model_is_refused_at_once(fields: dict, said: str, tmp_path: Path) -> None:
    """A layer count of 10**9 in config.json would size loops and lists by it: exit 2 before that."""
    assets = tmp_path / "assets"
    shutil.copytree(FIXTURES / "deepspeed" / "llama-zero3" / "hf", assets)
    config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, **fields}))
    run = FIXTURES / "deepspeed" / "llama-zero3" / "checkpoint"
    refused(cli(1, "consolidate", run, tmp_path / "out", "--hf-assets", assets, timeout=TIMEOUT)[0], said)
    refused(cli(1, "inspect", run, "--hf-assets", assets, timeout=TIMEOUT)[0], said)


def test_a_pickle_of_empty_containers_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """Two bytes make an empty set (about 200 bytes of memory): a few MB of them in a DeepSpeed archive's
    data.pkl would take a hundred times the file. The pre-scan counts them first: exit 2, nothing built."""
    import pickle
    import tracemalloc

    from mpicons.core.errors import InputError
    from mpicons.formats.pickle_scan import BYTES_PER_CONTAINER
    from mpicons.formats.unpickling import NOTHING, RestrictedUnpickler, unpickle

    bomb = pickle.dumps([set() for _ in range(300_000)], protocol=4)
    assert len(bomb) < 300_000 * 3
    tracemalloc.start()
    with pytest.raises(InputError, match=f"containers from {len(bomb)} bytes .* {BYTES_PER_CONTAINER} bytes or more"):
        unpickle(bomb, RestrictedUnpickler, "bomb.pkl", "its data.pkl", NOTHING)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * len(bomb), peak  # the pre-scan's own bookkeeping only
    # What checkpoints write passes: a record-like structure of strings, numbers and small containers.
    plain = pickle.dumps({f"layers.{i}.weight": ([i, i + 1], {"dtype": "bf16"}) for i in range(20_000)}, protocol=4)
    assert len(unpickle(plain, RestrictedUnpickler, "plain.pkl", "its data.pkl", NOTHING)) == 20_000  # type: ignore[arg-type]


def _nested_key(levels: int) -> bytes:
    """A pickle of ``{t: 1}`` where ``t`` is ``levels`` tuples, each of two of the one before: a few
    hundred bytes whose key Python would hash in 2**levels steps (written opcode by opcode)."""
    body = b"\x80\x02}\x94)\x94"
    for level in range(1, levels + 1):
        body += b"h" + bytes([level]) + b"h" + bytes([level]) + b"\x86\x94"
    return body + b"h\x00h" + bytes([levels + 1]) + b"K\x01s."


def _colliding_keys(count: int) -> bytes:
    """A pickle of a dict of ``count`` integer keys that all hash alike (``3 + k * (2**61 - 1)``)."""
    body = b"\x80\x02}\x94("
    for k in range(1, count + 1):
        value = (3 + k * (2**61 - 1)).to_bytes(16, "little", signed=True)
        body += b"\x8a\x10" + value + b"N"
    return body + b"u."


def _with_data_pkl(archive: Path, data_pkl: bytes) -> None:
    """Replace the pickle of a ``torch.save`` archive, keeping its other members."""
    import zipfile

    with zipfile.ZipFile(archive) as source:
        members = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(archive, "w") as target:
        for name, data in members:
            target.writestr(name, data_pkl if name.endswith("/data.pkl") else data)


@pytest.mark.parametrize("bomb", ["nested key", "colliding keys"])
@pytest.mark.parametrize("where", ["megatron .metadata", "megatron common.pt", "deepspeed model states"])
def test_dict_keys_costly_to_hash_are_refused_before_they_are_built(bomb: str, where: str, tmp_path: Path) -> None:
    """A 2**40-step key or 20,000 colliding integer keys would keep Python in C code for hours (no signal
    handled meanwhile); the pre-scan weighs every key first: exit 2 at once, naming the file."""
    data_pkl = _nested_key(40) if bomb == "nested key" else _colliding_keys(20_000)
    trainer, name = where.split(" ", 1)
    source = RUNS["megatron"] if trainer == "megatron" else FIXTURES / "deepspeed" / "llama-zero2" / "checkpoint"
    run = tmp_path / "run"
    shutil.copytree(source, run)
    if name == ".metadata":
        target = next(run.rglob(".metadata"))
        target.write_bytes(data_pkl)
    else:
        target = next(run.rglob("common.pt" if name == "common.pt" else "mp_rank_00_model_states.pt"))
        _with_data_pkl(target, data_pkl)
    said = "steps to hash" if bomb == "nested key" else "8 bytes"
    refused(cli(1, "consolidate", run, tmp_path / "out", timeout=TIMEOUT)[0], target.name, said)


def _padded_directory(archive: Path, extra: int) -> int:
    """Append ``extra`` copies of the archive's last central-directory entry (ZIP64 end records then
    count them): a directory far larger than its members need. Returns the new file's size."""
    import struct
    import zipfile

    data = archive.read_bytes()
    with zipfile.ZipFile(archive) as source:
        start, last = source.start_dir, source.infolist()[-1]
    end = data.rfind(b"PK\x06\x06")  # torch.save writes ZIP64 end records after the directory
    directory = data[start:end]
    entry = directory[directory.rfind(b"PK\x01\x02") :]
    assert entry[46 : 46 + len(last.filename)] == last.filename.encode()
    entries = directory + entry * extra
    count = entries.count(b"PK\x01\x02")
    record64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(entries), start)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, start + len(entries), 1)
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    archive.write_bytes(data[:start] + entries + record64 + locator + eocd)
    return archive.stat().st_size


def test_a_central_directory_larger_than_its_members_need_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """300,000 made-up directory entries (a 25 MB file) would cost zipfile a few hundred MB and many
    seconds; the directory is streamed first, and refused since its data.pkl names a handful of storages."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "deepspeed" / "llama-zero2" / "checkpoint", run)
    states = next(run.rglob("mp_rank_00_model_states.pt"))
    assert _padded_directory(states, 300_000) > 20_000_000
    proc, _ = cli(1, "consolidate", run, tmp_path / "out", timeout=TIMEOUT)
    refused(proc, states.name, "central directory lists 300007 entries", "at most")
    # A control: the same archive padded within what its data.pkl allows is read as before.
    shutil.rmtree(run)
    shutil.copytree(FIXTURES / "deepspeed" / "llama-zero2" / "checkpoint", run)
    _padded_directory(next(run.rglob("mp_rank_00_model_states.pt")), 10)
    assert cli(1, "consolidate", run, tmp_path / "out2", timeout=TIMEOUT)[0].returncode == 0


@pytest.mark.parametrize("layers", [2, 4])
def test_common_pt_args_that_contradict_the_tensors_are_refused(layers: int, tmp_path: Path) -> None:
    """The llama-tp2 run stacks 3 layers; its common.pt made to say 2 or 4 would derive a config that
    transformers loads with warnings and wrong logits. Refused, naming the args and the layers found."""
    import zipfile

    run = tmp_path / "run"
    shutil.copytree(RUNS["megatron"], run)
    common = next(run.rglob("common.pt"))
    with zipfile.ZipFile(common) as archive:
        data_pkl = archive.read("common/data.pkl")
    field = b"\x00\x00num_layersq-K"  # the args' num_layers field, memoized, then BININT1
    assert data_pkl.count(field + b"\x03") == 1
    _with_data_pkl(common, data_pkl.replace(field + b"\x03", field + bytes([layers])))
    proc = cli(1, "consolidate", run, tmp_path / "out", timeout=TIMEOUT)[0]
    refused(proc, "the config derived from", "common.pt's args", f"num_hidden_layers is {layers}", "3 layers")
    assert not (tmp_path / "out").exists()


def test_an_end_record_cut_short_is_left_to_zipfile_to_refuse() -> None:
    """The signature of the end record in the archive's last 21 bytes (a record cut short): no struct
    error escapes the directory check; there is no directory to bound, and zipfile then says what is wrong."""
    from mpicons.formats.zip_directory import check_directory

    for data in (b"x" * 100 + b"PK\x05\x06" + b"\x00" * 3, b"PK\x05\x06", b"x" * 40 + b"PK\x05\x06" + b"\x00" * 30):
        check_directory(lambda at, length, data=data: data[at : at + length], len(data), "cut.pt")


def test_an_ordered_dict_built_from_pairs_weighs_its_keys_too() -> None:
    """``OrderedDict([(key, value)])``: the pairs sit in a list, which the pre-scan does not hash, so the
    stand-in takes only names and 8-byte integers as keys; a 2**40-step key is refused, not hashed."""
    body = b"\x80\x02)\x940"
    for level in range(1, 41):
        body += b"h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"\x86\x940"
    body += b"ccollections\nOrderedDict\n](h" + bytes([40]) + b"K\x01\x86e\x85R."
    code = (
        "import sys\n"
        "from mpicons.core.errors import InputError\n"
        "from mpicons.formats.torch_archive import _ArchiveUnpickler\n"
        "from mpicons.formats.unpickling import NOTHING, unpickle\n"
        f"data = {body!r}\n"
        "try:\n"
        "    unpickle(data, _ArchiveUnpickler, 'bomb.pt', 'its data.pkl', NOTHING)\n"
        "except InputError as exc:\n"
        "    print(exc)\n"
    )
    proc = run_python("-c", code, timeout=60)
    assert proc.returncode == 0 and "OrderedDict of" in proc.stdout, proc.stdout + proc.stderr
    plain = "from mpicons.formats.torch_archive import _ordered_dict\nfrom mpicons.formats.unpickling import Budget\n"
    plain += "print(dict(_ordered_dict(Budget(100), [('a', 1), (2, 3)])))\n"
    assert run_python("-c", plain).stdout.strip() == "{'a': 1, 2: 3}"
