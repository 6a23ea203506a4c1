"""``mpicons shard``: a Hugging Face model written as a Megatron-Core ``torch_dist`` checkpoint.

Every check compares with something mpicons did not make: the Megatron fixtures' expected Hugging Face
weights (a round trip through ``consolidate`` gives them back byte for byte), the tensors Megatron-LM
saved (restated with numpy from FACTS.md in tests/megatron_cases.py, read back with torch's own DCP
reader), the ``_extra_state`` keys Megatron-LM wrote (the fixtures' verify.json), Python's zipfile."""

from __future__ import annotations

import io
import json
import shutil
import signal
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, cli, start
from megatron_cases import CASES, expected_dir, hf_assets, saved_tensors, shape_of, verify_record

import mpicons
from mpicons.comm import SingleProcess
from mpicons.formats.torch_zip import archive_around
from mpicons.job.sharding import Copy, share_of

EXPECTED = "model.safetensors"


def mesh(case: str) -> mpicons.Parallelism:
    """The fixture's mesh and layer spec: Megatron-LM wrote the fixtures with the local spec."""
    facts = shape_of(case)
    return mpicons.Parallelism(tp=facts["tp"], pp=facts["pp"], ep=facts.get("ep", 1), spec="local")


def padding_bytes(case: str) -> int:
    """The vocabulary padding rows of the embedding and the output layer: zero, never copied."""
    facts, arrays = shape_of(case), saved_tensors(case)
    names = [n for n in ("embedding.word_embeddings.weight", "output_layer.weight") if n in arrays]
    return sum((facts["padded_vocab"] - facts["vocab"]) * arrays[n].nbytes // arrays[n].shape[0] for n in names)


def shard_case(case: str, out: Path) -> mpicons.ShardResult:
    options = mpicons.ShardOptions(mesh(case), hf_assets=str(hf_assets(case)))
    return mpicons.shard(expected_dir(case), out, options, comm=SingleProcess())


@pytest.mark.parametrize("case", CASES)
def test_shard_then_consolidate_gives_the_model_back(tmp_path, case):
    """With the model's config, and with only what shard wrote (the config derived from common.pt's args)."""
    result = shard_case(case, tmp_path / "megatron")
    assert (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert result.checkpoint == str(tmp_path / "megatron" / "release")
    original = (expected_dir(case) / EXPECTED).read_bytes()
    back = mpicons.consolidate(tmp_path / "megatron", tmp_path / "back", comm=SingleProcess(), hf_assets=str(hf_assets(case)))
    assert (tmp_path / "back" / EXPECTED).read_bytes() == original, back.files
    mpicons.consolidate(tmp_path / "megatron", tmp_path / "derived", comm=SingleProcess())
    assert (tmp_path / "derived" / EXPECTED).read_bytes() == original
    derived = json.loads((tmp_path / "derived" / "config.json").read_text())
    config = json.loads((hf_assets(case) / "config.json").read_text())
    assert {k: v for k, v in derived.items() if k in config and v != config[k]} == {}


@pytest.mark.parametrize("case", CASES)
def test_torch_reads_what_megatron_saved(tmp_path, case):
    """torch's DCP reader finds every tensor Megatron-LM saved for the model, and its _extra_state items."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shard_case(case, tmp_path / "megatron")
    dcp_to_torch_save(tmp_path / "megatron" / "release", tmp_path / "all.pt")
    state = torch.load(tmp_path / "all.pt", weights_only=False)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    expected = saved_tensors(case)
    assert sorted(tensors) == sorted(expected)
    for name, array in expected.items():
        got = tensors[name].view(torch.int16) if tensors[name].dtype == torch.bfloat16 else tensors[name]
        assert tuple(tensors[name].shape) == array.shape, name
        assert got.numpy().tobytes() == np.ascontiguousarray(array).tobytes(), name
    assert sorted(k for k in state if k not in tensors) == sorted(verify_record(case)["dcp_nontensor_keys"])
    common = torch.load(tmp_path / "megatron" / "release" / "common.pt", weights_only=False)
    assert common["checkpoint_version"] == 3.0 and common["args"].padded_vocab_size == shape_of(case)["padded_vocab"]


def test_the_files_are_the_same_at_any_rank_count(tmp_path):
    case = "qwen3moe-ep2"
    args = [expected_dir(case), "--hf-assets", hf_assets(case), "--ep", "2", "--spec", "local", "-q"]
    for ranks in (1, 3):
        proc, _ = cli(ranks, "shard", args[0], tmp_path / f"out{ranks}", *args[1:])
        assert proc.returncode == 0, proc.stderr
    for name in ("__0_0.distcp", "common.pt", "metadata.json"):
        assert (tmp_path / "out1" / "release" / name).read_bytes() == (tmp_path / "out3" / "release" / name).read_bytes()


def test_the_vocabulary_is_padded_for_the_tensor_parallel_size(tmp_path):
    """Megatron-LM pads to make_vocab_size_divisible_by x TP: 1000 rows -> 1024 at TP 2, 1152 at 128 x 3 ..."""
    case = "llama-tp2"
    options = mpicons.ShardOptions(mpicons.Parallelism(tp=2, divisible_by=200), hf_assets=str(hf_assets(case)))
    mpicons.shard(expected_dir(case), tmp_path / "m", options, comm=SingleProcess())
    back = tmp_path / "back"
    mpicons.consolidate(tmp_path / "m", back, comm=SingleProcess(), hf_assets=str(hf_assets(case)))
    assert (back / EXPECTED).read_bytes() == (expected_dir(case) / EXPECTED).read_bytes()
    metadata = (tmp_path / "m" / "release" / ".metadata").read_bytes()
    assert b"embedding.word_embeddings.weight" in metadata
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader

    shape = FileSystemReader(str(tmp_path / "m" / "release")).read_metadata().state_dict_metadata
    assert tuple(shape["embedding.word_embeddings.weight"].size) == (1200, 64)
    del torch


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--tp", "3"], "num_key_value_heads (2) is not a multiple of --tp 3"),
        (["--pp", "2"], "num_hidden_layers (3) is not a multiple of --pp 2"),
    ],
)
def test_a_mesh_megatron_cannot_build_is_refused(tmp_path, change, message):
    proc, _ = cli(1, "shard", expected_dir("llama-tp2"), tmp_path / "m", "--hf-assets", hf_assets("llama-tp2"), *change)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()


def test_an_existing_checkpoint_is_never_replaced(tmp_path):
    args = ["shard", expected_dir("llama-tp2"), tmp_path / "m", "--hf-assets", hf_assets("llama-tp2"), "-q"]
    assert cli(1, *args)[0].returncode == 0
    before = (tmp_path / "m" / "release" / "__0_0.distcp").read_bytes()
    proc, _ = cli(2, *args)
    assert proc.returncode == 2 and "a checkpoint is there already" in proc.stderr and "remove it" in proc.stderr
    assert (tmp_path / "m" / "release" / "__0_0.distcp").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["latest_checkpointed_iteration.txt", "release"]


def test_a_model_without_its_config_or_of_another_family_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(expected_dir("llama-tp2") / EXPECTED, model / EXPECTED)
    proc, _ = cli(1, "shard", model, tmp_path / "m")
    assert proc.returncode == 2 and "config.json: not found; give the model's Hugging Face files with --hf-assets" in proc.stderr
    assert not (tmp_path / "m").exists()
    shutil.copytree(hf_assets("llama-tp2"), model, dirs_exist_ok=True)
    shutil.copy(expected_dir("qwen3-pp2") / EXPECTED, model / EXPECTED)
    proc, _ = cli(1, "shard", model, tmp_path / "m2")
    assert proc.returncode == 2 and "no rule gives" in proc.stderr, proc.stderr
    assert not (tmp_path / "m2").exists()


def test_the_shares_are_the_copies_byte_balanced():
    rng = np.random.default_rng(3)
    copies, at = [], 0
    for i in range(200):
        length = int(rng.integers(1, 5000))
        copies.append(Copy(i % 3, int(rng.integers(0, 10**6)), at, length))
        at += length + int(rng.integers(0, 100))
    total = sum(c.length for c in copies)
    for size in (1, 2, 3, 7):
        shares = [share_of(copies, rank, size) for rank in range(size)]
        assert all(abs(sum(c.length for c in s) - total / size) <= 1 for s in shares)
        joined = [c for s in shares for c in s]
        covered = {(c.file, c.source + k, c.offset + k) for c in joined for k in range(0, c.length, 97)}
        wanted = {(c.file, c.source + k, c.offset + k) for c in copies for k in range(c.length)}
        assert covered <= wanted and sum(c.length for c in joined) == total


def test_an_archive_around_data_is_what_zip_and_torch_read(tmp_path):
    data = np.arange(300, dtype=np.float32).tobytes()
    before, after = archive_around(b"\x80\x02N.", len(data))
    assert len(before) % 64 == 0  # data/0 aligned as torch aligns it
    archive = zipfile.ZipFile(io.BytesIO(before + data + after))
    assert [(i.filename, i.file_size) for i in archive.infolist()] == [
        ("archive/data.pkl", 4), ("archive/byteorder", 6), ("archive/data/0", len(data)), ("archive/version", 2),
    ]  # fmt: skip
    assert archive.read("archive/byteorder") == b"little" and archive.read("archive/version") == b"3\n"
    big = 5 << 30  # zip64: a sparse file, the data never written
    before, after = archive_around(b"\x80\x02N.", big)
    with open(tmp_path / "big.zip", "wb") as handle:
        handle.write(before)
        handle.seek(len(before) + big)
        handle.write(after)
    with zipfile.ZipFile(tmp_path / "big.zip") as archive:
        info = archive.getinfo("archive/data/0")
        assert info.file_size == big and archive.read("archive/version") == b"3\n"
        assert archive.getinfo("archive/version").header_offset > big


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["deepseekv3-ep2", "qwen2-tp2"])
def test_shard_over_the_world_then_consolidate_gives_the_model_back(mpi_tmp_path, case):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = mpicons.shard(expected_dir(case), mpi_tmp_path / "m", mpicons.ShardOptions(mesh(case)), comm=comm)
    assert result.tensors == len(saved_tensors(case))
    assert len(result.bytes_per_rank) == comm.size and max(result.bytes_per_rank) - min(result.bytes_per_rank) <= 1
    assert result.bytes == sum(a.nbytes for a in saved_tensors(case).values()) - padding_bytes(case)
    mpicons.consolidate(mpi_tmp_path / "m", mpi_tmp_path / "back", comm=comm)
    assert (mpi_tmp_path / "back" / EXPECTED).read_bytes() == (expected_dir(case) / EXPECTED).read_bytes()


@pytest.mark.parametrize(
    ("family", "ep"),
    [("LlamaForCausalLM", 1), ("Qwen3ForCausalLM", 1), ("Qwen3MoeForCausalLM", 2), ("Qwen3MoeForCausalLM+dense", 1),
     ("MixtralForCausalLM", 4)],
)  # fmt: skip
def test_a_model_transformers_saved_round_trips(tmp_path, family, ep):
    """Families without a Megatron fixture too (Mixtral): a tiny model transformers made and saved,
    sharded, and consolidated back to the same tensors."""
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=40, tie_word_embeddings=family == "LlamaForCausalLM")  # fmt: skip
    configs = {
        "LlamaForCausalLM": lambda: transformers.LlamaConfig(**common),
        "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**common),
        "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                                   moe_intermediate_size=24),
        "MixtralForCausalLM": lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        # layer 1 dense: the layers differ, so Megatron saves one key per layer; norm_topk_prob true
        "Qwen3MoeForCausalLM+dense": lambda: transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                                         moe_intermediate_size=24, mlp_only_layers=[1],
                                                                         norm_topk_prob=True),
    }  # fmt: skip
    model_class = getattr(transformers, family.split("+")[0])
    model_class(configs[family]()).save_pretrained(tmp_path / "model")
    proc, _ = cli(2, "shard", tmp_path / "model", tmp_path / "m", "--ep", ep, "-q")
    assert proc.returncode == 0, proc.stderr
    proc, _ = cli(2, "consolidate", tmp_path / "m", tmp_path / "back", "--hf-assets", tmp_path / "model", "-q")
    assert proc.returncode == 0, proc.stderr
    original = load_file(tmp_path / "model" / EXPECTED)
    back = load_file(tmp_path / "back" / EXPECTED)
    if common["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)  # transformers may save the tied head; Megatron keeps the embedding
    assert sorted(back) == sorted(original)
    assert all(back[name].tobytes() == original[name].tobytes() for name in original)


def test_a_signal_mid_copy_ends_every_rank_and_publishes_nothing(tmp_path):
    """What Slurm sends at a time limit, while the ranks copy: every rank stops, nothing is published, the
    staging directory and the output directory the run made are removed."""
    out = tmp_path / "m"
    inject = ROOT / "tests" / "scripts" / "inject.py"
    proc = start(2, inject, "slow-shard", "0", "--", "shard", expected_dir("llama-tp2"), out, "--tp", "2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not list(out.glob(".mpicons-staging-*/release/__0_0.distcp")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "interrupted by SIGTERM" in stderr, stderr
    assert not out.exists()


@pytest.mark.parametrize("case", ["qwen3moe-ep2", "llama-tp2"])
def test_a_model_in_s3_is_sharded_with_ranged_reads(tmp_path, case, s3_endpoint, s3_bucket):
    """The model's files in a bucket (config.json beside them): read with ranged GETs, the same checkpoint."""
    import s3server

    client = s3server.client(s3_endpoint)
    for path in sorted(expected_dir(case).iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"models/{case}/{path.name}", Body=path.read_bytes())
    options = mpicons.ShardOptions(mesh(case), s3_endpoint=s3_endpoint)
    mpicons.shard(f"s3://{s3_bucket}/models/{case}", tmp_path / "from-s3", options, comm=SingleProcess())
    shard_case(case, tmp_path / "local")
    for name in ("__0_0.distcp", "common.pt", "metadata.json"):
        assert (tmp_path / "from-s3" / "release" / name).read_bytes() == (tmp_path / "local" / "release" / name).read_bytes()


def test_the_transformer_engine_spec_names_the_norms_as_megatron_lm_builds_them(tmp_path):
    """The default spec, Megatron-LM's default build (FACTS.md §4, §15): MoE layers keep pre_mlp_layernorm;
    with multi-latent attention the latent norms are fused into the up projections, input_layernorm kept,
    a dense layer's pre-MLP norm fused into linear_fc1. Consolidated back, the same model."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader

    keys = {}
    for case in ("qwen3moe-ep2", "deepseekv3-ep2"):
        out = tmp_path / case
        mpicons.shard(expected_dir(case), out, mpicons.ShardOptions(mpicons.Parallelism(ep=2)), comm=SingleProcess())
        keys[case] = set(FileSystemReader(str(out / "release")).read_metadata().state_dict_metadata)
        mpicons.consolidate(out, tmp_path / f"{case}-back", comm=SingleProcess(), hf_assets=str(hf_assets(case)))
        assert (tmp_path / f"{case}-back" / EXPECTED).read_bytes() == (expected_dir(case) / EXPECTED).read_bytes()
    moe = keys["qwen3moe-ep2"]
    assert "decoder.layers.pre_mlp_layernorm.weight" in moe
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in moe
    assert not any("mlp.linear_fc1.layer_norm_weight" in k for k in moe)
    mla = keys["deepseekv3-ep2"]
    dense, routed = "decoder.layers.0.", "decoder.layers.1."
    assert {dense + "mlp.linear_fc1.layer_norm_weight", routed + "pre_mlp_layernorm.weight"} <= mla
    assert {p + "input_layernorm.weight" for p in (dense, routed)} <= mla
    assert {p + f"self_attention.linear_{x}_up_proj.layer_norm_weight" for p in (dense, routed) for x in ("q", "kv")} <= mla
    assert not any(k.endswith(("q_layernorm.weight", "kv_layernorm.weight", dense + "pre_mlp_layernorm.weight")) for k in mla)
    assert routed + "mlp.linear_fc1.layer_norm_weight" not in mla
