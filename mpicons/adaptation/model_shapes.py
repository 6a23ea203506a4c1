"""The tensor shapes a model's ``config.json`` implies, and the checkpoint's shapes checked against them (pure).

DCP's Hugging Face layout records no full shapes (:mod:`.completeness`): a checkpoint missing its last
training rank's files gives smaller tensors and nothing else to see. The model's config says what the
shapes must be. Where transformers is installed, the job asks it (the parameters of a model built on
the meta device, :mod:`mpicons.job.model_check`); otherwise :func:`config_shapes` knows what the config
fields of a few common architectures imply. Only names the model has are compared: optimizer state,
buffers and anything else the model lacks are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import InputError
from ..core.reports import Problem, count_of

Shapes = dict[str, tuple[int, ...]]

#: Decoder families whose names and shapes :func:`config_shapes` knows (as Hugging Face saves them).
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe",)
#: Families with a layout of their own: Mixtral's ``block_sparse_moe``, DeepSeek-V3's multi-latent attention.
OTHER_FAMILIES = ("mixtral", "deepseek_v3")
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
    if family not in DENSE_FAMILIES + MOE_FAMILIES + OTHER_FAMILIES:
        return None
    try:
        vocab, hidden, layers = _field(config, "vocab_size"), _field(config, "hidden_size"), _field(config, "num_hidden_layers")
        if family == "deepseek_v3":
            return _deepseek_v3(config, vocab, hidden, layers)
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


def _gated(prefix: str, size: int, hidden: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Shapes:
    """A gated MLP's three projections (gate, up, down) ``size`` wide."""
    gate, up, down = names
    return {
        f"{prefix}{gate}.weight": (size, hidden),
        f"{prefix}{up}.weight": (size, hidden),
        f"{prefix}{down}.weight": (hidden, size),
    }


def _mlp(config: Mapping[str, Any], prefix: str, family: str, hidden: int, layer: int) -> Shapes:
    if family == "mixtral":  # every layer routed; saved under block_sparse_moe, w1 gate, w3 up, w2 down
        moe, size, experts = prefix.replace(".mlp.", ".block_sparse_moe."), _field(config, "intermediate_size"), _experts(config)
        shapes: Shapes = {f"{moe}gate.weight": (experts, hidden)}
        for expert in range(experts):
            shapes.update(_gated(f"{moe}experts.{expert}.", size, hidden, ("w1", "w3", "w2")))
        return shapes
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
    shapes = {f"{prefix}gate.weight": (experts, hidden)}
    for expert in range(experts):
        shapes.update({f"{prefix}experts.{expert}.{name}": shape for name, shape in projections.items()})
    return shapes


def _deepseek_v3(config: Mapping[str, Any], vocab: int, hidden: int, layers: int) -> Shapes:
    """DeepSeek-V3: multi-latent attention, the first ``first_k_dense_replace`` layers dense, then routed
    experts with shared ones and the router's fp32 correction bias (no attention biases: else unknown)."""
    if config.get("attention_bias"):
        raise ValueError("attention_bias")
    heads, kv_rank = _field(config, "num_attention_heads"), _field(config, "kv_lora_rank")
    nope, rope, value = (_field(config, key) for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_rank = None if config.get("q_lora_rank") is None else _field(config, "q_lora_rank")
    dense, experts = _field(config, "first_k_dense_replace"), _field(config, "n_routed_experts")
    width, shared = _field(config, "moe_intermediate_size"), _field(config, "n_shared_experts")
    shapes: Shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        attention = f"{prefix}self_attn."
        shapes.update({f"{prefix}input_layernorm.weight": (hidden,), f"{prefix}post_attention_layernorm.weight": (hidden,)})
        if q_rank is None:
            shapes[f"{attention}q_proj.weight"] = (heads * (nope + rope), hidden)
        else:
            shapes[f"{attention}q_a_proj.weight"] = (q_rank, hidden)
            shapes[f"{attention}q_a_layernorm.weight"] = (q_rank,)
            shapes[f"{attention}q_b_proj.weight"] = (heads * (nope + rope), q_rank)
        shapes[f"{attention}kv_a_proj_with_mqa.weight"] = (kv_rank + rope, hidden)
        shapes[f"{attention}kv_a_layernorm.weight"] = (kv_rank,)
        shapes[f"{attention}kv_b_proj.weight"] = (heads * (nope + value), kv_rank)
        shapes[f"{attention}o_proj.weight"] = (hidden, heads * value)
        if layer < dense:
            shapes.update(_gated(f"{prefix}mlp.", _field(config, "intermediate_size"), hidden))
            continue
        shapes[f"{prefix}mlp.gate.weight"] = (experts, hidden)
        shapes[f"{prefix}mlp.gate.e_score_correction_bias"] = (experts,)
        for expert in range(experts):
            shapes.update(_gated(f"{prefix}mlp.experts.{expert}.", width, hidden))
        shapes.update(_gated(f"{prefix}mlp.shared_experts.", width * shared, hidden))
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


def _not_the_model(found: Mismatch, source: str) -> str:
    return (
        f"tensor {found.name!r}: shape {list(found.found)} in the shards, {list(found.model)} in the model ({source}): "
        "is this config the checkpoint's model?"
    )


#: Sizes past any model's: a config asking for more is refused before anything is sized by it (the
#: names of every layer and expert are listed, so 10**9 layers would exhaust memory first).
MAX_LAYERS = 100_000
MAX_EXPERTS = 100_000
MAX_NAMES = 20_000_000


def check_sizes(config: Mapping[str, Any], path: str) -> None:
    """Bad input naming the key when the config's layer or expert count is past any model's."""
    sizes = {key: config.get(key) for key in ("num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts")}
    for key, value in sizes.items():
        bound = MAX_LAYERS if key == "num_hidden_layers" else MAX_EXPERTS
        if type(value) is int and value > bound:
            raise InputError(f"{path}: {key} is {value}, more than any model has (at most {bound}): a damaged config?")
    layers = sizes["num_hidden_layers"] if type(sizes["num_hidden_layers"]) is int else 0
    experts = max([v for k, v in sizes.items() if k != "num_hidden_layers" and type(v) is int] or [0])
    if layers * (1 + experts) > MAX_NAMES // 16:
        raise InputError(
            f"{path}: num_hidden_layers {layers} with {experts} experts each: more tensors than any model has (a damaged config?)"
        )


_LAYER = re.compile(r"model\.layers\.([0-9]+)\.")
#: Families whose config leaves ``tie_word_embeddings`` false when it does not say (transformers' defaults).
_UNTIED_BY_DEFAULT = DENSE_FAMILIES + MOE_FAMILIES + OTHER_FAMILIES


@dataclass(frozen=True)
class Disagreement:
    """A config field the weights contradict: what the config says, what the weights hold, in words, and
    the tensor that shows it (if one does)."""

    key: str
    said: object
    found: str
    tensor: str | None = None

    def problem(self, path: str) -> Problem:
        return Problem(
            f"{path}: {self.key} is {self.said!r}, but the weights {self.found}: not this checkpoint's config "
            "(transformers would build another model from it, with no error); give the checkpoint's own "
            "config.json (--hf-assets DIR)",
            self.tensor,
            kind="model config",
        )


def disagreements(config: Mapping[str, Any], names: Iterable[str], whole: bool = True) -> list[Disagreement]:
    """What the weights ``names`` say against the config, beyond each tensor's shape: the decoder layers
    (``model.layers.N``, exactly 0 to ``num_hidden_layers`` - 1, DeepSeek's multi-token-prediction layers
    after them), an output layer where the embeddings are not tied, and (``whole``: no tensor was left
    out on purpose) every tensor a known family's model has."""
    names = list(names)
    out = _layer_disagreements(config, names, whole)
    tied = config.get("tie_word_embeddings", False if config.get("model_type") in _UNTIED_BY_DEFAULT else None)
    present = set(names)
    if whole and tied is False and "model.embed_tokens.weight" in present and "lm_head.weight" not in present:
        out.append(
            Disagreement("tie_word_embeddings", False, "hold no lm_head.weight (transformers would make the output layer up)")
        )
    expected = config_shapes(config) if whole and not out else None
    if expected is not None and "model.embed_tokens.weight" in present:  # the weights use the model's names
        missing = [name for name in expected if name not in present and not (name == "lm_head.weight" and tied)]
        if missing:
            more = "" if len(missing) == 1 else f" and {count_of(len(missing) - 1, 'more tensor')} its model has"
            out.append(Disagreement("model_type", config.get("model_type"), f"have no {missing[0]}{more}"))
    return out


def _layer_disagreements(config: Mapping[str, Any], names: list[str], whole: bool) -> list[Disagreement]:
    layers = config.get("num_hidden_layers")
    held = sorted({int(found.group(1)) for name in names if (found := _LAYER.match(name)) is not None})
    if type(layers) is not int or not held:
        return []
    extra = config.get("num_nextn_predict_layers") if config.get("model_type") == "deepseek_v3" else 0
    beyond = [i for i in held if i >= layers + (extra if type(extra) is int else 0)]
    if beyond:
        first = next(name for name in names if name.startswith(f"model.layers.{beyond[0]}."))
        return [Disagreement("num_hidden_layers", layers, f"hold layers up to {held[-1]} ({len(held)} layers)", first)]
    absent = [i for i in range(layers) if i not in set(held)]
    if whole and absent:
        span = f"layer {held[0]}" if len(held) == 1 else f"layers {held[0]} to {held[-1]}"
        return [Disagreement("num_hidden_layers", layers, f"hold no layer {absent[0]} ({count_of(len(held), 'layer')}: {span})")]
    return []


def stop_message(found: list[Mismatch], source: str) -> str:
    """One message for a consolidation that stops: the first mismatch, how many more there are, and why
    (when the shards' tensors are the smaller ones)."""
    short = all(m.smaller for m in found)  # a missing rank makes tensors smaller, never larger
    first = found[0].problem(source).message if short else _not_the_model(found[0], source)
    more = "" if len(found) == 1 else f" ({count_of(len(found) - 1, 'more tensor')} too; mpicons inspect lists each)"
    why = f". {MISSING_RANK_CAUSE}" if short else ""
    return f"{first}{more}{why}"


__all__ = [
    "Shapes",
    "Mismatch",
    "Disagreement",
    "config_shapes",
    "disagreements",
    "check_sizes",
    "mismatches",
    "stop_message",
    "DENSE_FAMILIES",
    "MOE_FAMILIES",
    "OTHER_FAMILIES",
    "MISSING_RANK_CAUSE",
]
