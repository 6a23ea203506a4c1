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
CASES = ("llama-tp2", "qwen3-pp2", "qwen3moe-ep2")
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


def _arrays(case: str) -> dict[str, np.ndarray]:
    return {
        name: np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(shape)
        for name, (dtype, shape, data) in load_tensors(expected_dir(case) / "model.safetensors").items()
        if dtype == "BF16"
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


def saved_tensors(case: str) -> dict[str, np.ndarray]:
    """Every tensor of the case's checkpoint by its saved name and global shape (FACTS.md §4, §11)."""
    hf, facts = _arrays(case), shape_of(case)
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
    """bf16 arrays as the raw tensors the reference serializer takes."""
    return {name: ("BF16", list(a.shape), np.ascontiguousarray(a).tobytes()) for name, a in arrays.items()}


def identity_rules(names: list[str], prefix: str = "") -> str:
    """A rule file keeping every saved name as it is (less ``prefix``), the optimizer's state skipped."""
    lines = ["# every saved tensor under its own name", "skip optimizer.**"]
    lines += [f"{prefix}{name}  {name}" for name in names]
    return "\n".join(lines) + "\n"
