"""The tensor shapes a model's ``config.json`` implies, and the checkpoint's shapes checked against them (pure).

DCP's Hugging Face layout records no full shapes (:mod:`.completeness`): a checkpoint missing its last
training rank's files gives smaller tensors and nothing else to see. The model's config says what the
shapes must be. Where transformers is installed, the job asks it (the parameters of a model built on
the meta device, :mod:`mpicons.job.model_check`); otherwise :func:`config_shapes` knows what the config
fields of a few common architectures imply. Only names the model has are compared: optimizer state,
buffers and anything else the model lacks are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .reports import Problem, count_of

Shapes = dict[str, tuple[int, ...]]

#: Decoder families whose names and shapes :func:`config_shapes` knows (as Hugging Face names them).
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe",)
#: Families with per-head norms on the queries and keys; with biases on q/k/v always (not on o); with
#: biases on every attention projection when ``attention_bias`` says so; on the MLP's when ``mlp_bias`` does.
_QK_NORM = ("qwen3", "qwen3_moe")
_QKV_BIAS = ("qwen2",)
_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")
_MLP_BIAS = ("llama",)

#: Why the shards' tensors would be smaller than the model's: said once, where a run stops.
MISSING_RANK_CAUSE = (
    "DCP's Hugging Face layout records no full shapes, so shards missing their last training rank's files "
    "(a copy that stopped early, a node-local disk not mounted, fewer {rank} directories read than were "
    "written) give smaller tensors: check that every rank's shard files are there"
)


def _field(config: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(name)
    return value


def config_shapes(config: Mapping[str, Any]) -> Shapes | None:
    """The parameter shapes the config fields of a known architecture imply (embedding and head
    ``[vocab_size, hidden_size]``, every layer below ``num_hidden_layers``); None for another architecture
    or a config without the fields."""
    family = config.get("model_type")
    if family not in DENSE_FAMILIES + MOE_FAMILIES:
        return None
    try:
        vocab, hidden, layers = _field(config, "vocab_size"), _field(config, "hidden_size"), _field(config, "num_hidden_layers")
        heads = _field(config, "num_attention_heads")
        kv_heads = _field(config, "num_key_value_heads", heads)
        head_dim = config.get("head_dim") or (hidden // heads if heads else 0)
        head_dim = _field({"head_dim": head_dim}, "head_dim")
        shapes: Shapes = {
            "model.embed_tokens.weight": (vocab, hidden),
            "lm_head.weight": (vocab, hidden),
            "model.norm.weight": (hidden,),
        }
        for layer in range(layers):
            shapes.update(_attention(config, f"model.layers.{layer}.", family, hidden, heads, kv_heads, head_dim))
            shapes.update(_mlp(config, f"model.layers.{layer}.mlp.", family, hidden, layer))
    except ValueError:
        return None
    return shapes


def _attention(config: Mapping[str, Any], prefix: str, family: str, hidden: int, heads: int, kv: int, head_dim: int) -> Shapes:
    shapes: Shapes = {
        f"{prefix}input_layernorm.weight": (hidden,),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
        f"{prefix}self_attn.q_proj.weight": (heads * head_dim, hidden),
        f"{prefix}self_attn.k_proj.weight": (kv * head_dim, hidden),
        f"{prefix}self_attn.v_proj.weight": (kv * head_dim, hidden),
        f"{prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
    }
    biased = family in _ATTENTION_BIAS and config.get("attention_bias") is True
    if family in _QKV_BIAS or biased:
        shapes.update(
            {
                f"{prefix}self_attn.q_proj.bias": (heads * head_dim,),
                f"{prefix}self_attn.k_proj.bias": (kv * head_dim,),
                f"{prefix}self_attn.v_proj.bias": (kv * head_dim,),
            }
        )
    if biased:
        shapes[f"{prefix}self_attn.o_proj.bias"] = (hidden,)
    if family in _QK_NORM:
        shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
    return shapes


def _mlp(config: Mapping[str, Any], prefix: str, family: str, hidden: int, layer: int) -> Shapes:
    sparse = family in MOE_FAMILIES and _sparse_layer(config, layer)
    size = _field(config, "moe_intermediate_size") if sparse else _field(config, "intermediate_size")
    projections: Shapes = {
        "gate_proj.weight": (size, hidden),
        "up_proj.weight": (size, hidden),
        "down_proj.weight": (hidden, size),
    }
    if family in _MLP_BIAS and config.get("mlp_bias") is True:
        projections.update({"gate_proj.bias": (size,), "up_proj.bias": (size,), "down_proj.bias": (hidden,)})
    if not sparse:
        return {prefix + name: shape for name, shape in projections.items()}
    experts = _experts(config)
    shapes: Shapes = {f"{prefix}gate.weight": (experts, hidden)}
    for expert in range(experts):
        shapes.update({f"{prefix}experts.{expert}.{name}": shape for name, shape in projections.items()})
    return shapes


def _sparse_layer(config: Mapping[str, Any], layer: int) -> bool:
    dense = config.get("mlp_only_layers") or []
    step = _field(config, "decoder_sparse_step", 1) or 1
    return layer not in dense and _experts(config) > 0 and (layer + 1) % step == 0


def _experts(config: Mapping[str, Any]) -> int:
    """Routed experts per layer (``num_experts``; transformers 5 writes ``num_local_experts``)."""
    return _field(config, "num_experts" if "num_experts" in config else "num_local_experts", 0)


@dataclass(frozen=True)
class Mismatch:
    """A tensor of the checkpoint (number ``tensor`` in its table) whose shape is not the model's."""

    tensor: int
    name: str
    found: tuple[int, ...]
    model: tuple[int, ...]

    @property
    def smaller(self) -> bool:
        """The shards' tensor falls short of the model's in some dimension and exceeds it in none."""
        return len(self.found) == len(self.model) and all(f <= m for f, m in zip(self.found, self.model))

    def problem(self, source: str) -> Problem:
        cause = "smaller: most likely a missing training rank" if self.smaller else "is this config the checkpoint's model?"
        return Problem(
            f"tensor {self.name!r}: shape {list(self.found)} in the shards, {list(self.model)} in the model ({source}): {cause}",
            self.name,
            kind="model shape",
        )


def mismatches(tensors: Iterable[tuple[str, tuple[int, ...]]], expected: Mapping[str, tuple[int, ...]]) -> list[Mismatch]:
    """Every tensor whose name the model has and whose shape differs from the model's (names it lacks are left alone)."""
    found = []
    for t, (name, shape) in enumerate(tensors):
        want = expected.get(name)
        if want is not None and tuple(want) != tuple(shape):
            found.append(Mismatch(t, name, tuple(shape), tuple(want)))
    return found


def stop_message(found: list[Mismatch], source: str) -> str:
    """One message for a consolidation that stops: the first mismatch, how many more there are, and why
    (when the shards' tensors are the smaller ones)."""
    first = found[0].problem(source).message
    more = "" if len(found) == 1 else f" ({count_of(len(found) - 1, 'more tensor')} too; mpicons inspect lists each)"
    why = f". {MISSING_RANK_CAUSE}" if found[0].smaller else ""
    return f"{first}{more}{why}"


__all__ = [
    "Shapes",
    "Mismatch",
    "config_shapes",
    "mismatches",
    "stop_message",
    "DENSE_FAMILIES",
    "MOE_FAMILIES",
    "MISSING_RANK_CAUSE",
]
