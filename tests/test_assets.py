"""``--hf-assets``: which files are copied, byte for byte or with the dtype recorded, and every refusal.

References are the fixture files themselves (read with ``json`` and compared byte for byte) and,
where installed, transformers reading the staged config.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from helpers import run_python

import mpicons.io.assets as assets_module
from mpicons.core.errors import InputError, WriteError
from mpicons.io.assets import HFAssets, asset_names, read_assets, stage_assets

TORCHTITAN = Path(__file__).parent / "fixtures" / "torchtitan"
CASES = sorted(p.name for p in TORCHTITAN.iterdir() if (p / "hf-assets").is_dir())
COPIED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
TORCH_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
TIMEOUT = 60


def assets_copy(tmp_path: Path, case: str = "llama3-fsdp2") -> Path:
    """A writable copy of a fixture's assets directory."""
    target = tmp_path / "assets"
    shutil.copytree(TORCHTITAN / case / "hf-assets", target)
    for entry in target.iterdir():
        entry.chmod(0o644)
    return target


def staging_dir(tmp_path: Path) -> Path:
    staging = tmp_path / "staging"
    staging.mkdir()
    return staging


def refused(directory: Path, named: Path | str) -> str:
    """The message of the InputError (exit 2) that reading ``directory`` raises; it must name ``named``."""
    with pytest.raises(InputError) as caught:
        read_assets(directory)
    assert caught.value.exit_code == 2
    assert str(named) in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("case", CASES)
def test_the_fixture_assets_are_copied_byte_for_byte(tmp_path, case):
    source = TORCHTITAN / case / "hf-assets"
    found = read_assets(source)
    assert found.directory == str(source)
    assert list(found.files) == COPIED == asset_names(found)
    assert found.config == json.loads((source / "config.json").read_text())
    assert found.weight_map == json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    staging = staging_dir(tmp_path)
    assert stage_assets(found, str(staging), None, durable=False) == COPIED
    assert sorted(p.name for p in staging.iterdir()) == COPIED
    for name in COPIED:
        assert (staging / name).read_bytes() == (source / name).read_bytes(), name
        assert oct((staging / name).stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.parametrize("dtype", sorted(TORCH_NAMES))
def test_the_config_records_the_dtype_the_weights_were_converted_to(tmp_path, dtype):
    source = TORCHTITAN / "llama3-fsdp2" / "hf-assets"
    original = json.loads((source / "config.json").read_text())
    assert original["dtype"] == "float32" and "torch_dtype" not in original  # what transformers 5 saved
    staging = staging_dir(tmp_path)
    stage_assets(read_assets(source), str(staging), dtype, durable=False)
    text = (staging / "config.json").read_text()
    written = json.loads(text)
    assert written == {**original, "dtype": TORCH_NAMES[dtype]}
    assert text.endswith("}\n") and text.startswith('{\n  "architectures": [\n    "LlamaForCausalLM"\n  ],\n')
    assert list(written) == sorted(written)
    for name in COPIED[1:]:
        assert (staging / name).read_bytes() == (source / name).read_bytes()


@pytest.mark.parametrize(
    "present, expected",
    [
        ({"dtype": "float32"}, {"dtype": "bfloat16"}),
        ({"torch_dtype": "float32"}, {"torch_dtype": "bfloat16"}),
        ({"dtype": "float32", "torch_dtype": "float16"}, {"dtype": "bfloat16", "torch_dtype": "bfloat16"}),
        ({}, {"dtype": "bfloat16", "torch_dtype": "bfloat16"}),
    ],
)
def test_every_dtype_key_there_is_set_and_both_when_neither_is(tmp_path, present, expected):
    directory = tmp_path / "assets"
    directory.mkdir()
    config = {"model_type": "llama", "hidden_size": 8, **present}
    (directory / "config.json").write_text(json.dumps(config))
    staging = staging_dir(tmp_path)
    stage_assets(read_assets(directory), str(staging), "BF16", durable=False)
    written = json.loads((staging / "config.json").read_text())
    assert written == {"model_type": "llama", "hidden_size": 8, **expected}


def test_transformers_reads_the_recorded_dtype(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    source = TORCHTITAN / "llama3-fsdp2" / "hf-assets"
    staging = staging_dir(tmp_path)
    stage_assets(read_assets(source), str(staging), "BF16", durable=False)
    config = transformers.AutoConfig.from_pretrained(str(staging))
    assert str(config.dtype) == "torch.bfloat16"
    assert config.num_key_value_heads == 2 and config.head_dim == 16


def test_without_a_dtype_the_config_is_copied_as_it_was_read(tmp_path):
    directory = assets_copy(tmp_path)
    raw = b'{"model_type":"llama",  "torch_dtype": "float32"}'
    (directory / "config.json").write_bytes(raw)
    found = read_assets(directory)
    (directory / "config.json").write_bytes(b'{"changed": true}')  # the run's rules read the first one
    staging = staging_dir(tmp_path)
    stage_assets(found, str(staging), None, durable=False)
    assert (staging / "config.json").read_bytes() == raw


def test_a_directory_without_config_or_index(tmp_path):
    directory = tmp_path / "assets"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    found = read_assets(directory)
    assert found == HFAssets(str(directory), None, None, ("tokenizer.json",), ())
    assert read_assets(tmp_path / "assets").files == ("tokenizer.json",)


def test_weights_hidden_entries_and_subdirectories_are_left_out_and_said(tmp_path):
    directory = assets_copy(tmp_path)
    left_out = [
        "model-00001-of-00002.safetensors",
        "model.safetensors",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "consolidated.00.pth",
        "weights.pt",
        "flax_model.msgpack",
        "tf_model.h5",
        "model.gguf",
        "last.ckpt",
        "__0_0.distcp",
        ".metadata",
        "MODEL.SAFETENSORS",
        ".gitattributes",
    ]
    for name in left_out:
        (directory / name).write_bytes(b"not copied")
    (directory / "original").mkdir()
    (directory / "original" / "params.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    (directory / "linked-dir").symlink_to(tmp_path / "elsewhere")
    os.mkfifo(directory / "x.safetensors")  # a weight is never opened, whatever it is
    (directory / "gone.bin").symlink_to(tmp_path / "missing")
    os.mkfifo(directory / ".hidden-fifo")
    (directory / "README.md").write_text("model card")
    found = read_assets(directory)
    assert list(found.files) == sorted([*COPIED, "README.md"])
    notes = "\n".join(found.notes)
    assert "left out subdirectory 'original/'" in notes and "left out subdirectory 'linked-dir/'" in notes
    assert "weights" in notes and ".gitattributes" in notes
    staging = staging_dir(tmp_path)
    stage_assets(found, str(staging), None, durable=False)
    assert sorted(p.name for p in staging.iterdir()) == sorted([*COPIED, "README.md"])


def test_links_to_regular_files_are_followed_as_in_a_hugging_face_cache(tmp_path):
    """A cache snapshot: every entry a relative link into ``blobs/``; the copies are regular files."""
    source = TORCHTITAN / "llama3-fsdp2" / "hf-assets"
    blobs = tmp_path / "repo" / "blobs"
    snapshot = tmp_path / "repo" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, entry in enumerate(sorted(source.iterdir())):
        shutil.copyfile(entry, blobs / f"blob{number}")
        (snapshot / entry.name).symlink_to(Path("..", "..", "blobs", f"blob{number}"))
    found = read_assets(snapshot)
    assert list(found.files) == COPIED
    assert found.weight_map == json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    staging = staging_dir(tmp_path)
    stage_assets(found, str(staging), None, durable=False)
    for name in COPIED:
        assert not (staging / name).is_symlink()
        assert (staging / name).read_bytes() == (source / name).read_bytes()


def test_a_missing_or_wrong_directory_is_refused(tmp_path):
    refused(tmp_path / "nowhere", tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refused(tmp_path / "file", tmp_path / "file")


@pytest.mark.parametrize(
    "content, says", [(b"{not json", "not valid JSON"), (b"[1, 2]", "not an object"), (b"\xff\xfe\xfa", "JSON")]
)
def test_a_config_that_is_not_a_json_object_is_refused(tmp_path, content, says):
    directory = assets_copy(tmp_path)
    (directory / "config.json").write_bytes(content)
    assert says in refused(directory, directory / "config.json")


@pytest.mark.parametrize(
    "content, says",
    [
        (b"{oops", "not valid JSON"),
        (b"[]", "weight_map"),
        (b'{"metadata": {}}', "weight_map"),
        (b'{"weight_map": []}', "weight_map"),
        (b'{"weight_map": {"a.weight": 3}}', "'a.weight'"),
        (b'{"weight_map": {"a.weight": "sub/model.safetensors"}}', "not a plain file name"),
        (b'{"weight_map": {"a.weight": "model.safetensors.index.json"}}', "not a plain file name"),
    ],
)
def test_an_index_without_a_weight_map_of_file_names_is_refused(tmp_path, content, says):
    directory = assets_copy(tmp_path)
    (directory / "model.safetensors.index.json").write_bytes(content)
    assert says in refused(directory, directory / "model.safetensors.index.json")


def test_a_config_too_large_to_read_is_refused(tmp_path):
    directory = assets_copy(tmp_path)
    with open(directory / "config.json", "r+b") as handle:
        handle.truncate(assets_module.READ_LIMIT + 1)  # sparse: costs no disk
    assert "MB" in refused(directory, directory / "config.json")


def test_dangling_links_and_devices_among_the_entries_are_refused(tmp_path):
    directory = assets_copy(tmp_path)
    (directory / "special_tokens_map.json").symlink_to(tmp_path / "missing-blob")
    assert "does not exist" in refused(directory, directory / "special_tokens_map.json")
    (directory / "special_tokens_map.json").unlink()
    (directory / "vocab.txt").symlink_to("/dev/null")
    assert "a device" in refused(directory, directory / "vocab.txt")
    (directory / "vocab.txt").unlink()
    os.symlink(directory / "missing", directory / "config.json.tmp")
    refused(directory, directory / "config.json.tmp")


def test_a_directory_where_the_index_should_be_is_refused(tmp_path):
    directory = assets_copy(tmp_path)
    (directory / "model.safetensors.index.json").unlink()
    (directory / "model.safetensors.index.json").mkdir()
    assert "a directory" in refused(directory, directory / "model.safetensors.index.json")


FIFO_SCRIPT = textwrap.dedent(
    """
    import sys
    from mpicons.core.errors import InputError
    from mpicons.io.assets import read_assets, stage_assets
    directory, staging, when = sys.argv[1:]
    try:
        if when == "read":
            read_assets(directory)
        else:
            found = read_assets(directory)
            import os
            os.unlink(os.path.join(directory, "tokenizer.json"))
            os.mkfifo(os.path.join(directory, "tokenizer.json"))
            stage_assets(found, staging, None, durable=False)
    except InputError as exc:
        print(exc)
        sys.exit(exc.exit_code)
    sys.exit(0)
    """
)


@pytest.mark.parametrize("fifo", ["tokenizer.json", "config.json", "model.safetensors.index.json", "chat_template.jinja"])
def test_a_fifo_is_refused_without_blocking(tmp_path, fifo):
    directory = assets_copy(tmp_path)
    if (directory / fifo).exists():
        (directory / fifo).unlink()
    os.mkfifo(directory / fifo)
    proc = run_python("-c", FIFO_SCRIPT, directory, staging_dir(tmp_path), "read", timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr
    assert str(directory / fifo) in proc.stdout and "a FIFO" in proc.stdout


def test_a_file_swapped_for_a_fifo_before_staging_is_refused_without_blocking(tmp_path):
    directory = assets_copy(tmp_path)
    staging = staging_dir(tmp_path)
    proc = run_python("-c", FIFO_SCRIPT, directory, staging, "stage", timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr
    assert str(directory / "tokenizer.json") in proc.stdout and "a FIFO" in proc.stdout
    assert list(staging.iterdir()) == []  # what was staged before it is removed again


def test_a_file_the_index_names_for_weights_is_refused(tmp_path):
    directory = assets_copy(tmp_path)
    index = {"weight_map": {"tok_embeddings.weight": "tokenizer.json"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "weight_map" in refused(directory, directory / "tokenizer.json")


def test_a_name_the_checkpoint_takes_is_refused_even_if_not_taken_for_a_weight(tmp_path, monkeypatch):
    """Naming rules and the weight patterns are separate lists: a checkpoint name never slips through."""
    directory = assets_copy(tmp_path)
    (directory / "model-00001-of-00002.safetensors").write_bytes(b"weights")
    monkeypatch.setattr(assets_module, "WEIGHT_PATTERNS", ())
    monkeypatch.setattr(assets_module, "MODEL_FILE_PATTERNS", ("*",))  # the allow-list is a third, separate list
    (directory / "model.safetensors.index.json").unlink()
    assert "checkpoint file" in refused(directory, directory / "model-00001-of-00002.safetensors")


def test_an_existing_name_in_staging_is_never_overwritten(tmp_path):
    directory = assets_copy(tmp_path)
    found = read_assets(directory)
    staging = staging_dir(tmp_path)
    (staging / "tokenizer.json").write_bytes(b"staged weights of the same name")
    with pytest.raises(InputError) as caught:
        stage_assets(found, str(staging), None, durable=False)
    assert str(staging / "tokenizer.json") in str(caught.value)
    assert (staging / "tokenizer.json").read_bytes() == b"staged weights of the same name"
    assert sorted(p.name for p in staging.iterdir()) == ["tokenizer.json"]  # the ones staged before it removed


def test_a_link_in_staging_is_not_followed(tmp_path):
    directory = assets_copy(tmp_path)
    staging = staging_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (staging / "config.json").symlink_to(victim)
    with pytest.raises(InputError, match="config.json"):
        stage_assets(read_assets(directory), str(staging), "BF16", durable=False)
    assert victim.read_bytes() == b"untouched"


def test_a_file_removed_before_staging_is_named(tmp_path):
    directory = assets_copy(tmp_path)
    found = read_assets(directory)
    (directory / "tokenizer_config.json").unlink()
    staging = staging_dir(tmp_path)
    with pytest.raises(InputError, match="tokenizer_config.json"):
        stage_assets(found, str(staging), None, durable=False)
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_large_files_are_copied_in_blocks(tmp_path, monkeypatch, kernel_copy):
    """A tokenizer larger than a copy block, by the kernel or (where it cannot) through one buffer."""
    directory = tmp_path / "assets"
    directory.mkdir()
    block = assets_module._COPY_BLOCK
    payload = os.urandom(1 << 16) * (2 * block // (1 << 16)) + b"tail"
    (directory / "tokenizer.json").write_bytes(payload)
    calls = []
    if not kernel_copy:

        def no_copy_range(*args: object) -> int:
            calls.append(args)
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", no_copy_range)
    reads = []
    real_pread = os.pread

    def pread(fd: int, size: int, offset: int) -> bytes:
        reads.append(size)
        return real_pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", pread)
    staging = staging_dir(tmp_path)
    stage_assets(read_assets(directory), str(staging), None, durable=False)
    assert (staging / "tokenizer.json").read_bytes() == payload
    assert all(size <= block for size in reads)
    assert bool(reads) == (not kernel_copy) and bool(calls) == (not kernel_copy)


def test_a_copy_that_fails_is_a_write_error_naming_both_files(tmp_path, monkeypatch):
    directory = assets_copy(tmp_path)
    found = read_assets(directory)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    staging = staging_dir(tmp_path)
    with pytest.raises(WriteError) as caught:
        stage_assets(found, str(staging), None, durable=False)
    assert caught.value.exit_code == 1
    assert str(staging / "generation_config.json") in str(caught.value) and "No space left" in str(caught.value)
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("durable", [True, False])
def test_staged_files_are_flushed_when_durable(tmp_path, monkeypatch, durable):
    flushed = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    staging = staging_dir(tmp_path)
    stage_assets(read_assets(assets_copy(tmp_path)), str(staging), "BF16", durable)
    assert sorted(flushed) == ([os.path.realpath(staging / name) for name in COPIED] if durable else [])


def test_only_a_models_files_are_published_and_the_rest_is_reported(tmp_path):
    """An HF-Trainer checkpoint folder as --hf-assets: config and tokenizer go out; DeepSpeed's and the
    trainer's files stay, named in the report."""
    directory = assets_copy(tmp_path)
    trainer_files = ["latest", "zero_to_fp32.py", "zero_to_torch.py", "trainer_state.json", "rng_state_0.pth"]
    trainer_files.append("training_args.bin")
    for name in [*trainer_files, "scheduler.pt", "notes.txt"]:
        (directory / name).write_bytes(b"a trainer's own")
    (directory / "global_step2").mkdir()
    found = read_assets(directory)
    assert not set(found.files) & {*trainer_files, "scheduler.pt", "notes.txt"}
    assert "config.json" in found.files and "tokenizer.json" in found.files
    said = " ".join(found.notes)
    assert "latest" in said and "zero_to_fp32.py" in said and "trainer_state.json" in said and "notes.txt" in said
    assert "global_step2/" in said
