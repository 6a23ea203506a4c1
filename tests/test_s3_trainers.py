"""Trainers' checkpoints read from ``s3://bucket/prefix``: recognised in the bucket as on disk.

The real libraries' checkpoints (tests/fixtures: DeepSpeed ZeRO, verl, Megatron-Core, accelerate)
are uploaded as they were saved, folders and trackers included, to the local moto server. The run
directory given as an ``s3://`` prefix must give the engine's weights (the fixtures' expected
tensors, in the bytes safetensors' serializer writes), as the same run on disk does; ``inspect``
must say the same of it; and what the trainers say of a damaged run must name the object.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import s3server
from helpers import load_tensors, reference_bytes
from mpi4py import MPI

import mpicons
from mpicons.core.errors import InputError
from mpicons.frontends.inspection import inspect
from mpicons.io.assets import read_assets
from mpicons.io.places import SMALL_FILE, LocalPlace
from mpicons.io.s3_sources import S3Place

FIXTURES = Path(__file__).parent / "fixtures"
#: case → (the run directory, what consolidating it needs besides, the expected weights, a phrase of its notes)
CASES = {
    "zero3": (
        "deepspeed/llama-zero3/checkpoint",
        {},
        "deepspeed/llama-zero3/expected-fp32/model.safetensors",
        "global_step2 (named by",
    ),
    "zero2": (
        "deepspeed/llama-zero2/checkpoint/global_step2",
        {},
        "deepspeed/llama-zero2/expected-fp32/model.safetensors",
        "ZeRO",
    ),
    "verl": ("verl/llama-fsdp2/checkpoint", {}, "verl/llama-fsdp2/expected-fp32/model.safetensors", "step 1 (named by"),
    "megatron": ("megatron/qwen3-pp2/checkpoint", {}, "megatron/qwen3-pp2/expected/model.safetensors", "iteration 10 (named by"),
    "accelerate": ("accelerate/checkpoint-2", {}, "accelerate/expected.safetensors", "'model.' prefix removed"),
    "verl-lora": (  # merged, with the alpha of lora_train_meta.json read from the bucket
        "lora/verl-llama-lora-fsdp2/checkpoint",
        {},
        "lora/verl-llama-lora-fsdp2/expected-fp32/model.safetensors",
        "merged LoRA into 14 weights",
    ),
}


def upload_tree(endpoint: str, bucket: str, directory: Path, prefix: str) -> str:
    """Every file below ``directory`` as an object under ``s3://bucket/prefix`` (folders as key paths); the URL."""
    client = s3server.client(endpoint)
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(directory).as_posix()}", Body=path.read_bytes())
    return f"s3://{bucket}/{prefix}"


def _assert_weights(out: Path, expected: Path) -> None:
    tensors = load_tensors(expected)
    assert load_tensors(out / "model.safetensors") == tensors
    assert (out / "model.safetensors").read_bytes() == reference_bytes(tensors), "bytes differ from safetensors' serializer"


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_in_a_bucket_gives_the_engines_weights(case: str, tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    run, options, expected, phrase = CASES[case]
    url = upload_tree(s3_endpoint, s3_bucket, FIXTURES / run, case)
    result = mpicons.consolidate(url, tmp_path / "out", s3_endpoint=s3_endpoint, **options)
    _assert_weights(tmp_path / "out", FIXTURES / expected)
    notes = "\n".join(result.input_notes)
    assert phrase in notes and url in notes, notes


def test_inspect_and_verify_read_a_run_in_a_bucket_as_on_disk(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    run = FIXTURES / CASES["zero3"][0]
    url = upload_tree(s3_endpoint, s3_bucket, run, "inspect")
    on_disk, in_bucket = inspect(run).to_dict(), inspect(url, s3_endpoint=s3_endpoint).to_dict()
    for report in (on_disk, in_bucket):
        report.pop("input_dir")
        report.pop("notes", None)
    assert in_bucket == on_disk and in_bucket["ok"]
    mpicons.consolidate(run, tmp_path / "out")
    report = mpicons.verify(tmp_path / "out", against=url, s3_endpoint=s3_endpoint)
    assert report.ok and not report.problems


def test_a_place_in_a_bucket_reads_as_the_directory(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """Names, files, folders and small files of the same tree, on disk and in the bucket, agree."""
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "latest").write_text("a")
    (tree / "a" / "x.pt").write_bytes(b"\0" * 10)
    (tree / "a" / "b" / "y.json").write_text("{}")
    (tree / "big").write_bytes(b"1" * (SMALL_FILE + 1))
    (tree / "empty").write_bytes(b"")
    url = upload_tree(s3_endpoint, s3_bucket, tree, "places/run")
    disk, bucket = LocalPlace(str(tree)), S3Place.at(url, s3_endpoint)
    assert bucket.path == url and bucket.name == "run"
    assert bucket.entries() == disk.entries() == ["a", "big", "empty", "latest"]
    for name in ["a", "latest", "big", "nothing"]:
        assert (bucket.is_file(name), bucket.is_dir(name)) == (disk.is_file(name), disk.is_dir(name)), name
    assert bucket.read_small("latest", "a tracker") == disk.read_small("latest", "a tracker") == b"a"
    assert bucket.read_small("empty", "a tracker") == b""
    with pytest.raises(InputError, match="larger than 1 MiB, not a tracker"):
        bucket.read_small("big", "a tracker")
    with pytest.raises(InputError, match=f"{url}/nothing: no such object, not a tracker"):
        bucket.read_small("nothing", "a tracker")
    inner, inner_disk = bucket.child("a"), disk.child("a")
    assert inner.entries() == inner_disk.entries() == ["b", "x.pt"]
    assert inner.child("b").entries() == ["y.json"] and inner.parent().entries() == bucket.entries()
    source = inner.open("x.pt")
    assert (source.size, source.read_at(2, 4), source.name) == (10, b"\0" * 4, f"{url}/a/x.pt")


def test_a_tracker_naming_a_step_not_in_the_bucket_is_bad_input(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    run = tmp_path / "run"
    (run / "global_step7").mkdir(parents=True)
    (run / "latest").write_text("global_step9")
    (run / "global_step7" / "mp_rank_00_model_states.pt").write_bytes(b"")
    url = upload_tree(s3_endpoint, s3_bucket, run, "dangling")
    with pytest.raises(InputError, match=rf"{url}/latest: names 'global_step9', but {url}/global_step9 is not there"):
        mpicons.consolidate(url, tmp_path / "out", s3_endpoint=s3_endpoint)
    assert not (tmp_path / "out").exists()


def test_megatron_iterations_without_their_tracker_are_named(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    iteration = FIXTURES / "megatron/qwen3-pp2/checkpoint/iter_0000010"
    client = s3server.client(s3_endpoint)
    for path in sorted(iteration.iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"untracked/iter_0000010/{path.name}", Body=path.read_bytes())
    with pytest.raises(InputError, match=r"holds Megatron iteration directories \(iter_0000010\) but no latest_checkpointed"):
        mpicons.consolidate(f"s3://{s3_bucket}/untracked", tmp_path / "out", s3_endpoint=s3_endpoint)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and not p.name.endswith(".safetensors")}


def test_verl_s_hugging_face_files_in_the_bucket_are_published(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    run = FIXTURES / "verl/llama-fsdp2/checkpoint"
    url = upload_tree(s3_endpoint, s3_bucket, run, "verl-assets")
    mpicons.consolidate(run, tmp_path / "from-disk")
    result = mpicons.consolidate(url, tmp_path / "from-bucket", s3_endpoint=s3_endpoint)
    published = _files(tmp_path / "from-bucket")
    assert published == _files(tmp_path / "from-disk") and "tokenizer.json" in published and "config.json" in published
    assert "SHA256SUMS" in published
    assert sorted(result.assets) == sorted(p for p in published if p not in ("model.safetensors.index.json", "SHA256SUMS"))


def test_hf_assets_from_a_bucket_into_files_and_into_a_bucket(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    """``--hf-assets s3://...``: the prefix's files published as a local directory's are, weights and
    sub-prefixes left out (and said), into a directory and into a bucket."""
    run = FIXTURES / CASES["zero3"][0]
    assets = tmp_path / "hf"
    shutil.copytree(FIXTURES / "deepspeed/llama-zero3/hf", assets)
    (assets / "model.safetensors").write_bytes(b"not copied")
    (assets / "extra").mkdir()
    (assets / "extra" / "notes.txt").write_text("not copied")
    url = upload_tree(s3_endpoint, s3_bucket, assets, "base/hf")
    local = mpicons.consolidate(run, tmp_path / "with-local", hf_assets=str(assets), dtype="bf16")
    remote = mpicons.consolidate(run, tmp_path / "with-remote", hf_assets=url, s3_endpoint=s3_endpoint, dtype="bf16")
    assert _files(tmp_path / "with-remote") == _files(tmp_path / "with-local")
    assert json.loads((tmp_path / "with-remote" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert remote.assets == local.assets == ["config.json", "generation_config.json"]
    read = read_assets(url, s3_endpoint)
    on_disk = [note.replace(str(assets), "HF") for note in read_assets(assets).notes]
    assert [note.replace(url, "HF") for note in read.notes] == on_disk
    assert "left out subdirectory 'extra/' of" in read.notes[0] and "model.safetensors" in read.notes[1], read.notes
    mpicons.consolidate(run, f"s3://{s3_bucket}/out", hf_assets=url, s3_endpoint=s3_endpoint, dtype="bf16")
    client = s3server.client(s3_endpoint)
    local_files = _files(tmp_path / "with-local")
    assert "SHA256SUMS" in local_files  # the bucket's the same: the same files, the same digests
    for name, data in local_files.items():
        assert client.get_object(Bucket=s3_bucket, Key=f"out/{name}")["Body"].read() == data, name


def test_hf_assets_naming_an_empty_prefix_is_bad_input(tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    with pytest.raises(InputError, match=f"s3://{s3_bucket}/nothing: no objects there"):
        run, nothing = FIXTURES / CASES["zero3"][0], f"s3://{s3_bucket}/nothing"
        mpicons.consolidate(run, tmp_path / "out", hf_assets=nothing, s3_endpoint=s3_endpoint)
    assert not (tmp_path / "out").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["zero3", "verl"])
def test_every_rank_reads_a_run_in_a_bucket(case: str, mpi_tmp_path: Path, s3_endpoint: str, s3_bucket: str) -> None:
    comm = MPI.COMM_WORLD
    run, options, expected, _ = CASES[case]
    error, url = None, None
    if comm.rank == 0:
        try:
            url = upload_tree(s3_endpoint, s3_bucket, FIXTURES / run, case)
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = repr(exc)
    error, url = comm.bcast((error, url), root=0)
    assert error is None
    result = mpicons.consolidate(url, mpi_tmp_path / "out", comm=comm, s3_endpoint=s3_endpoint, buffer_size=1 << 14, **options)
    assert sum(result.bytes_per_rank) == result.total_bytes
    if comm.rank == 0:
        _assert_weights(mpi_tmp_path / "out", FIXTURES / expected)
