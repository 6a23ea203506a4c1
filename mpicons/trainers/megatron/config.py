"""The Hugging Face config a Megatron run implies, from ``common.pt``'s ``args`` (no MPI here): derived
when the run has no config.json, or compared field by field with the one ``--hf-assets`` gives.

The families are those the built-in rules map (Megatron-Bridge's llama, qwen3, qwen3_moe and mixtral
bridges): experts and qk-norm tell them apart, ``--model-type`` decides where the args cannot. The
field correspondences are FACTS.md §11's (tests/fixtures/megatron/FACTS.md). Anything the args say
that these configs cannot express (another norm, rotary scaling, shared experts, ...) is refused by
name rather than dropped: a wrong config makes a model that loads and talks nonsense.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.errors import InputError
from ...core.unpickling import EnumMember, TorchDType, shown
from ...io.assets import config_with_dtype


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family the rules map: its class, and what tells it from the others."""

    architecture: str
    experts: bool
    qk_norm: bool
    #: The config key of the expert count transformers writes (it reads ``num_experts`` as an alias too).
    expert_key: str = "num_local_experts"


FAMILIES = {
    "llama": Family("LlamaForCausalLM", experts=False, qk_norm=False),
    "qwen3": Family("Qwen3ForCausalLM", experts=False, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", experts=True, qk_norm=True),
    "mixtral": Family("MixtralForCausalLM", experts=True, qk_norm=False),
}
MODEL_TYPES = tuple(FAMILIES)


class Args:
    """``common.pt``'s ``args`` (an ``argparse.Namespace`` record's fields), read with their types
    checked: a wrong one is bad input naming the field."""

    def __init__(self, values: Mapping[str, object], path: str) -> None:
        self.values, self.path = values, path

    def bad(self, name: str, wanted: str) -> InputError:
        return InputError(f"{self.path}: args.{name} is {shown(self.values.get(name))}, expected {wanted}")

    def whole(self, name: str, default: int | None = None) -> int:
        value = self.values.get(name, default)
        if value is None and default is not None:
            value = default
        if type(value) is not int or value <= 0:
            raise self.bad(name, "a positive whole number")
        return value

    def maybe_whole(self, name: str) -> int | None:
        return None if self.values.get(name) is None else self.whole(name)

    def flag(self, name: str) -> bool:
        value = self.values.get(name, False)
        if value is None:
            return False
        if type(value) is not bool:
            raise self.bad(name, "true or false")
        return value

    def number(self, name: str) -> int | float:
        value = self.values.get(name)
        if type(value) not in (int, float):
            raise self.bad(name, "a number")
        return value  # type: ignore[return-value]

    def text(self, name: str) -> str | None:
        value = self.values.get(name)
        if isinstance(value, EnumMember):
            return str(value.value)
        if value is not None and type(value) is not str:
            raise self.bad(name, "text")
        return value


def _unsupported(args: Args, name: str, said: str, wanted: str) -> InputError:
    return InputError(
        f"{args.path}: args.{name} = {said}: the Hugging Face families mpicons derives a config for "
        f"({', '.join(MODEL_TYPES)}) need {wanted}; give the model's own config with --hf-assets DIR, "
        "or convert with a rule file of your own (docs/adapter-rules.md)"
    )


def _check_supported(args: Args) -> None:
    """Refuse what none of the families can describe (the config would load and compute something else)."""
    wanted = {
        "normalization": ("RMSNorm", "RMSNorm"),
        "position_embedding_type": ("rope", "rotary position embeddings (rope)"),
    }
    for name, (value, words) in wanted.items():
        if args.text(name) != value:
            raise _unsupported(args, name, repr(args.text(name)), words)
    for name, words in (("swiglu", "a SwiGLU MLP"),):
        if not args.flag(name):
            raise _unsupported(args, name, "false", words)
    for name, words in (
        ("rotary_interleaved", "rotation of the two halves of each head (not interleaved pairs)"),
        ("layernorm_zero_centered_gamma", "plain norm weights (not zero-centred)"),
        ("multi_latent_attention", "plain multi-head attention"),
        ("use_rope_scaling", "rotary embeddings without Llama 3.1 scaling (its factors are not in the args)"),
    ):
        if args.flag(name):
            raise _unsupported(args, name, "true", words)
    percent = args.values.get("rotary_percent", 1.0)
    if percent != 1.0:
        raise _unsupported(args, "rotary_percent", repr(percent), "rotary embeddings on the whole head (1.0)")
    for name in ("mtp_num_layers", "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json"):
        if args.values.get(name):
            raise _unsupported(args, name, shown(args.values.get(name)), "the same plain decoder layer throughout")
    if args.values.get("hybrid_override_pattern"):
        raise _unsupported(
            args, "hybrid_override_pattern", shown(args.values["hybrid_override_pattern"]), "attention layers only"
        )


def family_of(args: Args, model_type: str | None) -> str:
    """The family the args describe (``model_type``: the user's or the config's, checked against them)."""
    experts = (args.values.get("num_experts") or 0) > 0  # type: ignore[operator]
    qk_norm = args.flag("qk_layernorm")
    if model_type is None:
        return {(False, False): "llama", (False, True): "qwen3", (True, True): "qwen3_moe", (True, False): "mixtral"}[
            (experts, qk_norm)
        ]
    family = FAMILIES.get(model_type)
    if family is None:
        raise InputError(f"--model-type {model_type!r}: mpicons derives configs for {', '.join(MODEL_TYPES)}")
    if family.experts != experts:
        said = f"{args.values.get('num_experts')} experts" if experts else "no experts"
        raise InputError(
            f"model_type {model_type!r} is {'' if family.experts else 'not '}a mixture of experts, "
            f"but {args.path}'s args have {said}"
        )
    if family.qk_norm != qk_norm:
        raise InputError(
            f"model_type {model_type!r} {'has' if family.qk_norm else 'has no'} qk-norm, "
            f"but {args.path}'s args.qk_layernorm is {qk_norm}"
        )
    return model_type


def _moe_layers(args: Args, layers: int) -> list[int]:
    """The layers with experts: ``moe_layer_freq`` N puts them at 0, N, 2N, ...; a list marks each layer."""
    freq = args.values.get("moe_layer_freq", 1)
    if type(freq) is int and freq > 0:
        return [i for i in range(layers) if i % freq == 0]
    if type(freq) is list and len(freq) == layers and all(type(v) is int for v in freq):
        return [i for i, v in enumerate(freq) if v]
    raise args.bad("moe_layer_freq", f"a positive whole number or a list of {layers} 0/1 values")


def _expert_fields(args: Args, family: str, layers: int) -> dict[str, Any]:
    """The experts' fields of a mixture-of-experts family."""
    if args.text("moe_router_score_function") not in (None, "softmax"):
        raise _unsupported(args, "moe_router_score_function", repr(args.text("moe_router_score_function")), "softmax routing")
    for name, words in (
        ("moe_shared_expert_intermediate_size", "no shared experts"),
        ("moe_router_topk_scaling_factor", "routing weights without a scaling factor"),
        ("moe_router_num_groups", "routing without expert groups"),
    ):
        if args.values.get(name):
            raise _unsupported(args, name, shown(args.values[name]), words)
    if args.flag("moe_router_enable_expert_bias"):
        raise _unsupported(args, "moe_router_enable_expert_bias", "true", "routing without a per-expert bias")
    experts, top_k = args.whole("num_experts"), args.whole("moe_router_topk")
    expert_ffn = args.whole("moe_ffn_hidden_size", args.values.get("ffn_hidden_size"))  # type: ignore[arg-type]
    moe_layers = _moe_layers(args, layers)
    normalised = not args.flag("moe_router_pre_softmax")  # softmax over the top k = weights renormalised
    fields: dict[str, Any] = {"num_local_experts": experts, "num_experts": experts, "num_experts_per_tok": top_k}
    if family == "mixtral":
        if moe_layers != list(range(layers)):
            raise _unsupported(
                args, "moe_layer_freq", shown(args.values.get("moe_layer_freq")), "experts in every layer (Mixtral)"
            )
        if not normalised:
            raise _unsupported(args, "moe_router_pre_softmax", "true", "top-k weights renormalised (Mixtral)")
        return {**fields, "intermediate_size": expert_ffn}
    dense = [i for i in range(layers) if i not in moe_layers]
    return {
        **fields,
        "moe_intermediate_size": expert_ffn,
        "norm_topk_prob": normalised,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _dtype(args: Args) -> str:
    """The weights' dtype as a safetensors name: Megatron's --bf16 / --fp16 runs save every parameter so."""
    if args.flag("bf16"):
        return "BF16"
    if args.flag("fp16"):
        return "F16"
    dtype = args.values.get("params_dtype")
    return dtype.name if isinstance(dtype, TorchDType) else "F32"


def described(args: Args, model_type: str | None) -> tuple[str, dict[str, Any]]:
    """The family and the config fields the args determine (``vocab_size`` None when they do not tell it)."""
    _check_supported(args)
    family = family_of(args, model_type)
    layers, hidden, heads = args.whole("num_layers"), args.whole("hidden_size"), args.whole("num_attention_heads")
    groups = args.whole("num_query_groups", heads) if args.flag("group_query_attention") else heads
    bias_linear, bias_qkv = args.flag("add_bias_linear"), args.flag("add_qkv_bias")
    if bias_linear and family != "llama":
        raise _unsupported(args, "add_bias_linear", "true", f"no biases in the MLP ({family})")
    fields: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": args.whole("ffn_hidden_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": args.whole("kv_channels", hidden // heads),
        "rms_norm_eps": args.number("layernorm_epsilon"),
        "rope_theta": float(args.number("rotary_base")),
        "tie_word_embeddings": not args.flag("untie_embeddings_and_output_weights"),
        "vocab_size": args.maybe_whole("vocab_size"),
        "attention_bias": bias_linear or bias_qkv,
    }
    if family == "llama":
        fields["mlp_bias"] = bias_linear
    if FAMILIES[family].experts:
        fields.update(_expert_fields(args, family, layers))
    return family, fields


def derive_config(values: Mapping[str, object], path: str, model_type: str | None) -> dict[str, Any]:
    """config.json for the run whose ``common.pt`` (at ``path``) holds these args."""
    args = Args(values, path)
    family, fields = described(args, model_type)
    if fields["vocab_size"] is None:
        raise InputError(
            f"{path}: args.vocab_size is not set (the vocabulary came from the tokenizer), so the model's vocabulary "
            f"size cannot be derived (args.padded_vocab_size {shown(values.get('padded_vocab_size'))} includes padding): "
            "give the model's config.json with --hf-assets DIR"
        )
    padded = values.get("padded_vocab_size")
    if type(padded) is int and fields["vocab_size"] > padded:
        raise args.bad("vocab_size", f"at most args.padded_vocab_size ({padded})")
    positions = args.values.get("max_position_embeddings") or args.values.get("seq_length")
    config: dict[str, Any] = {
        "architectures": [FAMILIES[family].architecture],
        "model_type": family,
        "hidden_act": "silu",
        **fields,
        "rope_parameters": {"rope_theta": fields["rope_theta"], "rope_type": "default"},
    }
    if type(positions) is int and positions > 0:
        config["max_position_embeddings"] = positions
    aux_loss = values.get("moe_aux_loss_coeff")
    if FAMILIES[family].experts and type(aux_loss) in (int, float):  # training only: said, never checked
        config["router_aux_loss_coef"] = float(aux_loss)  # type: ignore[arg-type]
    return config_with_dtype(config, _dtype(args))


def _config_value(config: Mapping[str, Any], key: str, default: object) -> object:
    """What transformers reads for ``key`` from ``config`` (its aliases and defaults)."""
    if key == "rope_theta":
        rope = config.get("rope_parameters")
        found = config.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
        return default if found is None else found
    if key in ("num_local_experts", "num_experts"):
        found = config.get("num_local_experts", config.get("num_experts"))
        return default if found is None else found
    found = config.get(key)
    return default if found is None else found


def _disagreement(config_path: str, key: str, found: object, said: object, path: str) -> InputError:
    return InputError(
        f"{config_path}: {key} is {shown(found)}, but the checkpoint's run says {shown(said)} ({path}'s args): "
        "a wrong config makes a model that loads and talks nonsense; give the run's own config.json, "
        "or leave out --hf-assets to derive it from the args"
    )


def _dense_layers(config: Mapping[str, Any], layers: int) -> list[int]:
    """The config's layers without experts: Qwen3-MoE's ``mlp_only_layers`` and those off its ``decoder_sparse_step``."""
    only, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step") or 1
    if type(step) is not int or step <= 0 or not isinstance(only, list):
        raise InputError(f"config.json: decoder_sparse_step {shown(step)} / mlp_only_layers {shown(only)} are not layer numbers")
    return [i for i in range(layers) if i in only or (i + 1) % step != 0]


def check_config(values: Mapping[str, object], path: str, config: Mapping[str, Any], config_path: str) -> None:
    """Refuse a config.json that disagrees with the run's args, naming the first field that does."""
    args = Args(values, path)
    model_type = config.get("model_type")
    family, fields = described(args, model_type if model_type in FAMILIES else None)
    defaults: dict[str, object] = {
        "num_key_value_heads": _config_value(config, "num_attention_heads", None),
        "tie_word_embeddings": False,
        "norm_topk_prob": False,
        "num_local_experts": 0,
        "attention_bias": False,
        "mlp_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    heads, hidden = _config_value(config, "num_attention_heads", None), _config_value(config, "hidden_size", None)
    if type(heads) is int and type(hidden) is int and heads > 0:
        defaults["head_dim"] = hidden // heads
    if not FAMILIES[family].experts and _config_value(config, "num_local_experts", 0):
        fields["num_local_experts"] = 0  # a dense run against an expert config
    dense = fields.pop("mlp_only_layers", None)
    fields.pop("decoder_sparse_step", None)
    if dense is not None:  # the layers without experts, however the config expresses them
        found_dense = _dense_layers(config, fields["num_hidden_layers"])
        if found_dense != dense:
            raise _disagreement(config_path, "mlp_only_layers (with decoder_sparse_step)", found_dense, dense, path)
    for key, said in fields.items():
        if key == "num_experts" or (key == "vocab_size" and said is None):
            continue
        found = _config_value(config, key, defaults.get(key))
        if found is None:
            continue  # not in the config and no default to compare: transformers' own default applies
        if found != said or (type(found) is bool) != (type(said) is bool):
            raise _disagreement(config_path, key, found, said, path)
    padded = values.get("padded_vocab_size")
    vocab = _config_value(config, "vocab_size", None)
    if type(padded) is int and type(vocab) is int and vocab > padded:
        raise InputError(
            f"{config_path}: vocab_size is {vocab}, more rows than the checkpoint's embedding holds "
            f"({padded}, args.padded_vocab_size in {path}): not this run's config"
        )


__all__ = ["FAMILIES", "MODEL_TYPES", "Args", "check_config", "derive_config", "described", "family_of"]
