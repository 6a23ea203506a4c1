"""The Megatron-shaped sample, read without mpicons' reader: torch's own DCP reader loads it, and the
Megatron → Hugging Face mapping written here from the Megatron fixtures' FACTS.md (sections 5, 6, 8, 11;
torch operations, nothing of the generator's) gives back the generator's expected Hugging Face tensors.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file

import mpicons
from mpicons.comm import SingleProcess
from mpicons.sample import (
    MegatronSampleConfig,
    megatron_expected_hf,
    megatron_hf_config,
    megatron_values,
    write_megatron_sample,
)

#: Meshes and shapes: TP × PP with padding; TP 4 (one query group per rank) with the vocab a multiple
#: already; one rank, tied embeddings, multi-query attention.
CONFIGS = {
    "tp2-pp2": MegatronSampleConfig(),
    "tp4-unpadded": MegatronSampleConfig(layers=2, hidden=64, ffn=96, heads=8, query_groups=4, head_dim=8, vocab=512,
                                         tp=4, pp=1, seed=3),
    "tp1-pp2-tied-mqa": MegatronSampleConfig(layers=2, hidden=48, ffn=40, heads=4, query_groups=1, head_dim=12,
                                             vocab=130, tp=1, pp=2, tied=True, seed=7),
}  # fmt: skip


def torch_state_dict(iteration_dir: str, tmp_path: Path) -> dict[str, Any]:
    """The whole checkpoint as torch's ``dcp_to_torch_save`` reads it (tensors and bytes items)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(iteration_dir, tmp_path / "whole.pt")
    return torch.load(tmp_path / "whole.pt", weights_only=False)  # type: ignore[no-any-return]


def facts_to_hf(state: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """FACTS.md §11 with §5 (QKV by query group), §6 (fc1 = [gate; up]) and §8 (padded vocab)."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    heads, groups, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}  # fmt: skip
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    stacked = "decoder.layers."
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = state[stacked + "self_attention.linear_qkv.weight"][i].reshape(groups, -1, hidden)
        q, k, v = qkv.split([heads // groups * d, d, d], dim=1)
        gate, up = state[stacked + "mlp.linear_fc1.weight"][i].chunk(2)
        out.update({
            p + "input_layernorm.weight": state[stacked + "self_attention.linear_qkv.layer_norm_weight"][i],
            p + "self_attn.q_proj.weight": q.reshape(-1, hidden),
            p + "self_attn.k_proj.weight": k.reshape(-1, hidden),
            p + "self_attn.v_proj.weight": v.reshape(-1, hidden),
            p + "self_attn.o_proj.weight": state[stacked + "self_attention.linear_proj.weight"][i],
            p + "post_attention_layernorm.weight": state[stacked + "mlp.linear_fc1.layer_norm_weight"][i],
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": state[stacked + "mlp.linear_fc2.weight"][i],
        })  # fmt: skip
    return out


def raw(tensor: Any) -> bytes:
    """A torch tensor's bytes in row-major order."""
    import torch

    return bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_torch_reads_the_expected_model_through_the_facts_mapping(case: str, tmp_path: Path) -> None:
    config = CONFIGS[case]
    iteration_dir = write_megatron_sample(tmp_path / "run", config, assets_dir=tmp_path / "hf")
    state = torch_state_dict(iteration_dir, tmp_path)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    converted = facts_to_hf({k: v for k, v in state.items() if "_extra_state" not in k}, hf_config)
    expected = dict(megatron_expected_hf(config))
    assert sorted(converted) == sorted(expected)
    for name, value in expected.items():
        assert str(converted[name].dtype) == "torch.bfloat16" and tuple(converted[name].shape) == value.shape, name
        assert raw(converted[name]) == value.tobytes(), name
    # The padding rows are there, and are not zero (a conversion that keeps them shows).
    padded = state["embedding.word_embeddings.weight"]
    assert padded.shape[0] == config.padded_vocab and padded.shape[0] % (128 * config.tp) == 0
    assert config.padded_vocab == config.vocab or bool(padded[config.vocab :].abs().sum() > 0)
    assert ("output_layer.weight" in state) != config.tied


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_megatron_values_are_what_torch_reads(case: str, tmp_path: Path) -> None:
    """The on-disk values the benchmark checks a plain consolidation against; and the bytes items."""
    config = CONFIGS[case]
    state = torch_state_dict(write_megatron_sample(tmp_path / "run", config), tmp_path)
    seen = set()
    for key, layer, value in megatron_values(config):
        read = state[key] if layer is None else state[key][layer]
        assert tuple(read.shape) == value.shape and raw(read) == value.tobytes(), (key, layer)
        seen.add(key)
    extra = {k for k in state if "_extra_state" in k}
    assert set(state) == seen | extra
    assert {re.sub(r"shard_\d+_", "shard_N_", k) for k in extra} == {
        f"decoder.layers.{m}._extra_state/shard_N_{config.layers}"
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    }
    assert len(extra) == 4 * config.layers and all(state[k] == [None] for k in extra)


def test_metadata_is_megatrons(tmp_path: Path) -> None:
    """DCP's Metadata plus ``all_local_plans`` (one SavePlan per training rank, listing exactly the items
    that rank wrote); the chunks cut as FACTS.md §4 and §6 say; without ``plans``, plain DCP metadata."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    config = MegatronSampleConfig()  # TP 2 × PP 2, 4 layers, ffn 352
    iteration_dir = write_megatron_sample(tmp_path / "run", config)
    metadata = FileSystemReader(iteration_dir).read_metadata()
    assert metadata.planner_data is None and metadata.version == "1.0.0"
    plans = metadata.all_local_plans
    assert len(plans) == config.world and all(isinstance(p, SavePlan) and p.usable for p in plans)
    where = {(k.fqn, None if k.offset is None else tuple(k.offset)): v for k, v in metadata.storage_data.items()}
    for rank, plan in enumerate(plans):
        written = {(i.index.fqn, None if i.index.offset is None else tuple(i.index.offset)) for i in plan.items}
        assert written == {key for key, info in where.items() if info.relative_path == f"__{rank}_0.distcp"}
        assert all((i.type == WriteItemType.BYTE_IO) == (i.tensor_data is None) for i in plan.items)
    assert sum(len(p.items) for p in plans) == len(where)

    def chunks(key: str) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
        entry = metadata.state_dict_metadata[key]
        return {(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks}

    f, h = config.ffn, config.hidden
    fc1 = {((layer, start + r * f // 2, 0), (1, f // 2, h)) for layer in range(4) for r in (0, 1) for start in (0, f)}
    assert chunks("decoder.layers.mlp.linear_fc1.weight") == fc1
    for rank in (0, 1):  # each TP rank's [gate_r; up_r]: rows r·F/2 and F + r·F/2 of the global [gate; up]
        rows = {
            k[1][1]
            for k, info in where.items()
            if k[0].endswith("linear_fc1.weight") and info.relative_path == f"__{rank}_0.distcp"
        }
        assert rows == {rank * f // 2, f + rank * f // 2}
    assert chunks("decoder.layers.mlp.linear_fc2.weight") == {
        ((layer, 0, r * f // 2), (1, h, f // 2)) for layer in range(4) for r in (0, 1)
    }
    rows, q = config.qkv_rows, config.heads * config.head_dim  # QKV by whole query groups on dim 0, o_proj on dim -1
    assert chunks("decoder.layers.self_attention.linear_qkv.weight") == {
        ((layer, r * rows // 2, 0), (1, rows // 2, h)) for layer in range(4) for r in (0, 1)
    }
    assert chunks("decoder.layers.self_attention.linear_proj.weight") == {
        ((layer, 0, r * q // 2), (1, h, q // 2)) for layer in range(4) for r in (0, 1)
    }
    assert chunks("decoder.layers.self_attention.linear_qkv.layer_norm_weight") == {((i, 0), (1, h)) for i in range(4)}
    # Pipeline stage 1 (ranks 2 and 3) writes layers 2 and 3, the final norm and the output layer.
    stage1 = {k for k, info in where.items() if info.relative_path in ("__2_0.distcp", "__3_0.distcp")}
    assert {k[1][0] for k in stage1 if k[0].startswith("decoder.layers.") and k[1] is not None} == {2, 3}
    assert {k[0] for k in stage1 if not k[0].startswith("decoder.layers.")} == {
        "decoder.final_layernorm.weight", "output_layer.weight"
    }  # fmt: skip
    plain = FileSystemReader(write_megatron_sample(tmp_path / "plain", MegatronSampleConfig(plans=False))).read_metadata()
    assert not hasattr(plain, "all_local_plans")


def test_run_directory_common_pt_and_assets(tmp_path: Path) -> None:
    """Megatron-LM's run layout; ``common.pt`` names nothing but ``argparse.Namespace`` and torch dtypes."""
    torch = pytest.importorskip("torch")
    config = MegatronSampleConfig(iteration=1234, tied=True)
    iteration_dir = Path(write_megatron_sample(tmp_path / "run", config, assets_dir=tmp_path / "hf"))
    assert iteration_dir == tmp_path / "run" / "iter_0001234"
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "1234"
    assert sorted(p.name for p in iteration_dir.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "common.pt", "metadata.json"
    ]  # fmt: skip
    assert json.loads((iteration_dir / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1
    }  # fmt: skip
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(iteration_dir / "common.pt", weights_only=True)
    assert common["iteration"] == 1234 and common["checkpoint_version"] == 3.0
    assert common["content_metadata"]["singleton_local_shards"] is False
    args = vars(common["args"])
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf == megatron_hf_config(config)
    assert (args["num_layers"], args["hidden_size"], args["ffn_hidden_size"], args["kv_channels"]) == (
        hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    )  # fmt: skip
    assert (args["num_attention_heads"], args["num_query_groups"], args["vocab_size"]) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["vocab_size"]
    )  # fmt: skip
    assert args["padded_vocab_size"] == 1024 and args["untie_embeddings_and_output_weights"] is False
    assert args["params_dtype"] is torch.bfloat16 and args["layernorm_epsilon"] == hf["rms_norm_eps"]
    assert float(args["rotary_base"]) == hf["rope_parameters"]["rope_theta"]
    bare = MegatronSampleConfig(common=False)
    assert not (Path(write_megatron_sample(tmp_path / "bare", bare)) / "common.pt").exists()
    with pytest.raises(ValueError, match="outside the run directory"):
        write_megatron_sample(tmp_path / "run", config, assets_dir=tmp_path / "run" / "hf")


def test_sizes_and_bad_configs() -> None:
    from mpicons.trainers.megatron.sample import checkpoint_bytes

    for target in (400_000_000, 2_500_000_000):
        config = MegatronSampleConfig.sized(target)
        assert target <= checkpoint_bytes(config) < 2 * target  # hidden grows by 512: 4 heads of 64 × TP 2
        assert (config.tp, config.pp, config.heads, config.query_groups * 4) == (2, 2, config.hidden // 64, config.heads)
        assert config.padded_vocab == 50432 and config.ffn % 128 == 0
    with pytest.raises(ValueError, match="query_groups must be a multiple of tp"):
        MegatronSampleConfig(query_groups=2, heads=8, tp=4)
    with pytest.raises(ValueError, match="layers must be a multiple of pp"):
        MegatronSampleConfig(layers=3, pp=2)


def test_a_plain_consolidation_keeps_megatrons_names_and_layouts(tmp_path: Path) -> None:
    """What the benchmark's plain half writes (``plans=False``: readable before Megatron's metadata is)."""
    config = MegatronSampleConfig(plans=False)
    iteration_dir = write_megatron_sample(tmp_path / "run", config)
    mpicons.consolidate(iteration_dir, tmp_path / "out", adapter="none", comm=SingleProcess(), sync=False)
    out = load_file(tmp_path / "out" / "model.safetensors")
    keys = set()
    for key, layer, value in megatron_values(config):
        read = out[key] if layer is None else out[key][layer]
        assert read.dtype == value.dtype and np.ascontiguousarray(read).tobytes() == value.tobytes(), (key, layer)
        keys.add(key)
    assert set(out) == keys


@pytest.mark.slow
def test_transformers_builds_the_model_from_the_config_and_expected_tensors(tmp_path: Path) -> None:
    """The config and the expected tensors are one model: transformers loads them with no key missing or left over."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for config in CONFIGS.values():
        hf = transformers.LlamaConfig(**megatron_hf_config(config))
        model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16)
        state = {name: torch.frombuffer(bytearray(value.tobytes()), dtype=torch.bfloat16).reshape(value.shape)
                 for name, value in megatron_expected_hf(config)}  # fmt: skip
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not (config.tied and k == "lm_head.weight")]
        assert not missing and not result.unexpected_keys
