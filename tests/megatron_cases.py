"""The Megatron fixtures (tests/fixtures/megatron, written by Megatron-LM's own ``save_checkpoint``) and
what they hold, restated from FACTS.md with numpy: never mpicons' code.

:func:`saved_tensors` gives the tensors as Megatron saved them (stacked on the layer axis, QKV fused by
query group, fc1 = [gate; up], the vocabulary padded with zero rows), built from the expected Hugging
Face tensors by FACTS.md §4-§8 and §11; :func:`identity_rules` a rule file that keeps every saved name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from helpers import Tensors, load_tensors

MEGATRON = Path(__file__).parent / "fixtures" / "megatron"
CASES = ("llama-tp2", "qwen3-pp2", "qwen3moe-ep2", "qwen2-tp2", "deepseekv3-ep2")
ITERATION = "iter_0000010"


def checkpoint(case: str) -> Path:
    """The run's checkpoint directory (``latest_checkpointed_iteration.txt`` names iteration 10)."""
    return MEGATRON / case / "checkpoint"


def iteration_dir(case: str) -> Path:
    return checkpoint(case) / ITERATION


def hf_assets(case: str) -> Path:
    return MEGATRON / case / "hf"


def expected_dir(case: str) -> Path:
    return MEGATRON / case / "expected"


def shape_of(case: str) -> dict:
    """The case's shapes and parallelism, as its generator recorded them (``case.json``)."""
    return json.loads((MEGATRON / case / "case.json").read_text())


def verify_record(case: str) -> dict:
    """The fixture generator's record: the tensor and non-tensor keys torch's DCP reader found."""
    return json.loads((MEGATRON / case / "verify.json").read_text())


def copy_run(case: str, target: Path) -> Path:
    """A writable copy of the case's run directory."""
    shutil.copytree(checkpoint(case), target)
    for path in target.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}


def _arrays(case: str) -> dict[str, np.ndarray]:
    return {
        name: np.frombuffer(data, dtype=NUMPY_DTYPES[dtype]).reshape(shape)
        for name, (dtype, shape, data) in load_tensors(expected_dir(case) / "model.safetensors").items()
    }


def _padded(rows: np.ndarray, padded: int) -> np.ndarray:
    """FACTS.md §8: rows up to the padded vocabulary, zero in these fixtures."""
    return np.concatenate([rows, np.zeros((padded - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)])


def _qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, groups: int, head_dim: int) -> np.ndarray:
    """FACTS.md §5: per query group, its q heads, then its k head, then its v head."""
    per_group = q.shape[0] // groups
    parts = []
    for g in range(groups):
        parts += [
            q[g * per_group : (g + 1) * per_group],
            k[g * head_dim : (g + 1) * head_dim],
            v[g * head_dim : (g + 1) * head_dim],
        ]
    return np.concatenate(parts)


def _gated(hf: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """FACTS.md §6: fc1 is all gate rows, then all up rows."""
    return np.concatenate([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]])


def _deepseek_tensors(hf: dict[str, np.ndarray], facts: dict) -> dict[str, np.ndarray]:
    """FACTS.md §15: one key per layer; MLA's matrices as they are; layer 0 dense, then routed and shared experts."""
    padded = facts["padded_vocab"]
    out = {
        "embedding.word_embeddings.weight": _padded(hf["model.embed_tokens.weight"], padded),
        "output_layer.weight": _padded(hf["lm_head.weight"], padded),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    mla = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    }
    for i in range(facts["layers"]):
        mine, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        out.update({mine + m: hf[theirs + h] for m, h in mla.items()})
        if i < facts["first_dense"]:
            out[mine + "mlp.linear_fc1.weight"] = _gated(hf, theirs + "mlp.")
            out[mine + "mlp.linear_fc2.weight"] = hf[theirs + "mlp.down_proj.weight"]
            continue
        experts = [f"{theirs}mlp.experts.{e}." for e in range(facts["experts"])]
        out[mine + "mlp.router.weight"] = hf[theirs + "mlp.gate.weight"]
        out[mine + "mlp.router.expert_bias"] = hf[theirs + "mlp.gate.e_score_correction_bias"]
        out[mine + "mlp.experts.experts.linear_fc1.weight"] = np.stack([_gated(hf, e) for e in experts])
        out[mine + "mlp.experts.experts.linear_fc2.weight"] = np.stack([hf[e + "down_proj.weight"] for e in experts])
        out[mine + "mlp.shared_experts.linear_fc1.weight"] = _gated(hf, theirs + "mlp.shared_experts.")
        out[mine + "mlp.shared_experts.linear_fc2.weight"] = hf[theirs + "mlp.shared_experts.down_proj.weight"]
    return out


def saved_tensors(case: str) -> dict[str, np.ndarray]:
    """Every tensor of the case's checkpoint by its saved name and global shape (FACTS.md §4, §11, §14, §15)."""
    hf, facts = _arrays(case), shape_of(case)
    if facts["arch"] == "deepseek_v3":
        return _deepseek_tensors(hf, facts)
    layers, groups, head_dim, padded = facts["layers"], facts["kv"], facts["head_dim"], facts["padded_vocab"]

    def stack(make: object) -> np.ndarray:
        return np.stack([make(f"model.layers.{i}.") for i in range(layers)])  # type: ignore[operator]

    out = {
        "embedding.word_embeddings.weight": _padded(hf["model.embed_tokens.weight"], padded),
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stack(lambda p: hf[p + "input_layernorm.weight"]),
        "decoder.layers.self_attention.linear_qkv.weight": stack(
            lambda p: _qkv(*(hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"), groups, head_dim)
        ),
        "decoder.layers.self_attention.linear_proj.weight": stack(lambda p: hf[p + "self_attn.o_proj.weight"]),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": stack(lambda p: hf[p + "post_attention_layernorm.weight"]),
    }
    if not facts["tied"]:
        out["output_layer.weight"] = _padded(hf["lm_head.weight"], padded)
    if "model.layers.0.self_attn.q_proj.bias" in hf:  # FACTS.md §14: grouped like the weight's rows
        out["decoder.layers.self_attention.linear_qkv.bias"] = stack(
            lambda p: _qkv(*(hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"), groups, head_dim)
        )
    if "model.layers.0.self_attn.q_norm.weight" in hf:
        out["decoder.layers.self_attention.q_layernorm.weight"] = stack(lambda p: hf[p + "self_attn.q_norm.weight"])
        out["decoder.layers.self_attention.k_layernorm.weight"] = stack(lambda p: hf[p + "self_attn.k_norm.weight"])
    if facts.get("experts"):
        experts = range(facts["experts"])

        def expert_stack(make: object) -> np.ndarray:
            return stack(lambda p: np.stack([make(f"{p}mlp.experts.{e}.") for e in experts]))  # type: ignore[operator]

        out["decoder.layers.mlp.router.weight"] = stack(lambda p: hf[p + "mlp.gate.weight"])
        out["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = expert_stack(
            lambda p: np.concatenate([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])
        )
        out["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = expert_stack(lambda p: hf[p + "down_proj.weight"])
    else:
        out["decoder.layers.mlp.linear_fc1.weight"] = stack(
            lambda p: np.concatenate([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        )
        out["decoder.layers.mlp.linear_fc2.weight"] = stack(lambda p: hf[p + "mlp.down_proj.weight"])
    return out


def as_tensors(arrays: dict[str, np.ndarray]) -> Tensors:
    """bf16 (and fp32) arrays as the raw tensors the reference serializer takes."""
    names = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32"}
    return {name: (names[a.dtype], list(a.shape), np.ascontiguousarray(a).tobytes()) for name, a in arrays.items()}


def identity_rules(names: list[str], prefix: str = "") -> str:
    """A rule file keeping every saved name as it is (less ``prefix``), the optimizer's state skipped."""
    lines = ["# every saved tensor under its own name", "skip optimizer.**"]
    lines += [f"{prefix}{name}  {name}" for name in names]
    return "\n".join(lines) + "\n"
