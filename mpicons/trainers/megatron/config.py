"""The Hugging Face config a Megatron run implies, from ``common.pt``'s ``args`` (no MPI here): derived
when the run has no config.json, or compared field by field with the one ``--hf-assets`` gives.

The families are those the built-in rules map (Megatron-Bridge's llama, qwen2, qwen3, qwen3_moe,
mixtral and deepseek_v3 bridges), told apart by the args:

- ``--multi-latent-attention``: deepseek_v3 (its fields and refusals: :mod:`.config_deepseek`);
- otherwise experts and qk-norm: qwen3_moe (both), mixtral (experts), qwen3 (qk-norm), and without
  either qwen2 or llama by the biases. Transformers' Qwen2 always has q/k/v biases and no others
  (``--add-qkv-bias --disable-bias-linear``); Llama's ``attention_bias`` puts one on o_proj as well,
  so it cannot say "q/k/v only". Hence: q/k/v biases only → qwen2, else llama (with
  ``--add-bias-linear``: ``attention_bias`` and ``mlp_bias``). ``--model-type llama`` on a
  q/k/v-bias-only run is refused (its o_proj bias would be missing), as is q/k/v-bias-only on every
  other family; ``--model-type qwen2`` needs exactly those biases.

``--model-type`` (or a given config's ``model_type``) must agree with all of that. The field
correspondences are FACTS.md §11's, §14's (qwen2: no ``attention_bias``; ``head_dim`` only when it is
not hidden / heads, which transformers' Qwen2 then reads) and §15's (tests/fixtures/megatron/FACTS.md).
Anything the args say that these configs cannot express (another norm, rotary scaling, a sliding
window, shared experts outside deepseek_v3, ...) is refused by name rather than dropped: a wrong config
makes a model that loads and talks nonsense. A given config is compared with what transformers reads
from it (aliases; defaults for keys it leaves out, DeepSeek-V3's being that model's own sizes), and
must ask for no rotary scaling and no sliding-window layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...adaptation.model_shapes import MAX_EXPERTS, MAX_LAYERS
from ...core.errors import InputError
from ...formats.unpickling import EnumMember, TorchDType, shown
from ...io.assets import config_with_dtype
from . import config_deepseek as deepseek
from .args import Args


@dataclass(frozen=True)
class Family:
    """A Hugging Face model family the rules map: its class, and what tells it from the others."""

    architecture: str
    experts: bool
    qk_norm: bool
    #: The config key of the expert count transformers writes (it reads ``num_experts`` as an alias too).
    expert_key: str = "num_local_experts"
    #: Multi-latent attention (whose ``qk_layernorm`` norms the latents: not what tells it apart).
    mla: bool = False


FAMILIES = {
    "llama": Family("LlamaForCausalLM", experts=False, qk_norm=False),
    "qwen2": Family("Qwen2ForCausalLM", experts=False, qk_norm=False),
    "qwen3": Family("Qwen3ForCausalLM", experts=False, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", experts=True, qk_norm=True),
    "mixtral": Family("MixtralForCausalLM", experts=True, qk_norm=False),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", experts=True, qk_norm=True, expert_key="n_routed_experts", mla=True),
}
MODEL_TYPES = tuple(FAMILIES)


def _unsupported(args: Args, name: str, said: str, wanted: str) -> InputError:
    return InputError(
        f"{args.path}: args.{name} = {said}: the Hugging Face families mpicons derives a config for "
        f"({', '.join(MODEL_TYPES)}) need {wanted}; give the model's own config with --hf-assets DIR, "
        "or convert with a rule file of your own (docs/adapter-rules.md)"
    )


#: Args fields whose other values none of the families can describe: the harmless values, and what is needed.
UNEXPRESSED: dict[str, tuple[tuple[object, ...], str]] = {
    "window_size": ((None,), "attention over the whole sequence (no sliding window)"),
    "softmax_type": ((None, "vanilla"), "plain softmax attention"),
    "experimental_attention_variant": ((None,), "plain attention"),
    "rotary_seq_len_interpolation_factor": ((None, 1, 1.0), "rotary embeddings without position interpolation"),
    "no_rope_freq": ((None,), "rotary embeddings in every layer"),
    "moe_latent_size": ((None, 0), "experts on the hidden states themselves (no latent projection)"),
}


def _check_supported(args: Args) -> None:
    """Refuse what none of the families can describe (the config would load and compute something else);
    multi-latent attention is refused by :func:`family_of` for all but deepseek_v3."""
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
        ("use_rope_scaling", "rotary embeddings without Llama 3.1 scaling (its factors are not in the args)"),
        ("qk_l2_norm", "queries and keys without L2 normalisation"),
        ("attention_output_gate", "attention output without a gate"),
    ):
        if args.flag(name):
            raise _unsupported(args, name, "true", words)
    for name, (harmless, words) in UNEXPRESSED.items():
        found = args.values.get(name)
        if (found.value if isinstance(found, EnumMember) else found) not in harmless:
            raise _unsupported(args, name, shown(found), words)
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


def _qkv_bias_only(args: Args) -> bool:
    """Biases on q, k and v and nowhere else: Qwen2's, which no other family can say."""
    return args.flag("add_qkv_bias") and not args.flag("add_bias_linear")


def _chosen(args: Args, experts: bool, qk_norm: bool) -> str:
    """The family the args alone point to (the module docstring says how)."""
    if args.flag("multi_latent_attention"):
        return "deepseek_v3"
    if not experts and not qk_norm and _qkv_bias_only(args):
        return "qwen2"
    return {(False, False): "llama", (False, True): "qwen3", (True, True): "qwen3_moe", (True, False): "mixtral"}[
        (experts, qk_norm)
    ]


def family_of(args: Args, model_type: str | None) -> str:
    """The family the args describe (``model_type``: the user's or the config's, checked against them)."""
    experts = (args.values.get("num_experts") or 0) > 0  # type: ignore[operator]
    qk_norm, mla = args.flag("qk_layernorm"), args.flag("multi_latent_attention")
    if model_type is None:
        model_type = _chosen(args, experts, qk_norm)  # checked like a given one: MLA needs experts too
    family = FAMILIES.get(model_type)
    if family is None:
        raise InputError(f"--model-type {model_type!r}: mpicons derives configs for {', '.join(MODEL_TYPES)}")
    if family.mla != mla:
        raise InputError(
            f"model_type {model_type!r} {'has' if family.mla else 'has no'} multi-latent attention, "
            f"but {args.path}'s args.multi_latent_attention is {mla}"
        )
    if family.experts != experts:
        said = f"{args.values.get('num_experts')} experts" if experts else "no experts"
        raise InputError(
            f"model_type {model_type!r} is {'' if family.experts else 'not '}a mixture of experts, "
            f"but {args.path}'s args have {said}"
        )
    if not mla and family.qk_norm != qk_norm:
        raise InputError(
            f"model_type {model_type!r} {'has' if family.qk_norm else 'has no'} qk-norm, "
            f"but {args.path}'s args.qk_layernorm is {qk_norm}"
        )
    if model_type == "qwen2" and not _qkv_bias_only(args):
        raise InputError(
            f"model_type 'qwen2' has biases on q, k and v and nowhere else, but {args.path}'s args.add_qkv_bias "
            f"is {args.flag('add_qkv_bias')} and args.add_bias_linear is {args.flag('add_bias_linear')}"
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


def _attention_fields(args: Args, family: str, hidden: int, heads: int) -> dict[str, Any]:
    """The attention's fields of a family without multi-latent attention: k/v heads, head width, biases."""
    groups = args.whole("num_query_groups", heads) if args.flag("group_query_attention") else heads
    fields: dict[str, Any] = {"num_key_value_heads": groups, "head_dim": args.whole("kv_channels", hidden // heads)}
    bias_linear = args.flag("add_bias_linear")
    if family == "qwen2":  # q/k/v biases always, none elsewhere (family_of checked): no field says so
        return fields
    if _qkv_bias_only(args):
        raise _unsupported(
            args, "add_qkv_bias", "true (with add_bias_linear false)",
            f"no bias on q, k and v alone ({family}; only qwen2 has one, llama's attention_bias biases o_proj too)",
        )  # fmt: skip
    fields["attention_bias"] = bias_linear
    if family == "llama":
        fields["mlp_bias"] = bias_linear
    return fields


def described(args: Args, model_type: str | None) -> tuple[str, dict[str, Any]]:
    """The family and the config fields the args determine (``vocab_size`` None when they do not tell it)."""
    _check_supported(args)
    family = family_of(args, model_type)
    layers, hidden, heads = args.whole("num_layers"), args.whole("hidden_size"), args.whole("num_attention_heads")
    experts = args.values.get("num_experts")
    if layers > MAX_LAYERS or (type(experts) is int and experts > MAX_EXPERTS):  # before any loop sized by them
        raise args.bad("num_layers" if layers > MAX_LAYERS else "num_experts", "a count a model can have (damaged?)")
    if args.flag("add_bias_linear") and family != "llama":
        raise _unsupported(args, "add_bias_linear", "true", f"no biases in the MLP ({family})")
    mla = FAMILIES[family].mla
    fields: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": args.whole("ffn_hidden_size"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        **(deepseek.attention_fields(args, heads) if mla else _attention_fields(args, family, hidden, heads)),
        "rms_norm_eps": args.number("layernorm_epsilon"),
        "rope_theta": float(args.number("rotary_base")),
        "tie_word_embeddings": not args.flag("untie_embeddings_and_output_weights"),
        "vocab_size": args.maybe_whole("vocab_size"),
    }
    if mla:
        fields.update(deepseek.expert_fields(args, layers, _moe_layers(args, layers)))
    elif FAMILIES[family].experts:
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
    if family == "qwen2" and fields["head_dim"] == fields["hidden_size"] // fields["num_attention_heads"]:
        del fields["head_dim"]  # Qwen2Config has no such field; transformers' Qwen2 reads it only when given
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
    experts = FAMILIES[family].experts and not FAMILIES[family].mla  # DeepseekV3Config has no aux-loss field
    if experts and type(aux_loss) in (int, float):  # training only: said, never checked
        config["router_aux_loss_coef"] = float(aux_loss)  # type: ignore[arg-type]
    return config_with_dtype(config, _dtype(args))


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary parameters transformers takes: a legacy ``rope_scaling`` before ``rope_parameters``."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    return rope if isinstance(rope, dict) else {}


def _config_value(config: Mapping[str, Any], key: str, default: object) -> object:
    """What transformers reads for ``key`` from ``config`` (its aliases and defaults)."""
    if key == "rope_theta":
        found = _rope(config).get("rope_theta", config.get("rope_theta"))
        return default if found is None else found
    alias = {"num_local_experts": "num_experts", **deepseek.ALIASES}.get(key)
    found = config.get(key) if alias is None else config.get(key, config.get(alias))
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


def _check_positions(config: Mapping[str, Any], config_path: str, path: str) -> None:
    """Refuse a config asking for rotary scaling, partial rotary embeddings or sliding-window layers: no run
    a config is derived for has them."""
    rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        raise _disagreement(config_path, "rope_parameters.rope_type", kind, "default", path)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _disagreement(config_path, "partial_rotary_factor", partial, 1.0, path)
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and any(kind != "full_attention" for kind in kinds):
        raise _disagreement(config_path, "layer_types", kinds, ["full_attention"] * len(kinds), path)


def _defaults(config: Mapping[str, Any], family: str) -> dict[str, object]:
    """What transformers takes for a key ``config`` leaves out (a key not here is then not compared)."""
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
    if FAMILIES[family].mla:
        defaults.update(deepseek.config_defaults(config))
    return defaults


def check_config(values: Mapping[str, object], path: str, config: Mapping[str, Any], config_path: str) -> None:
    """Refuse a config.json that disagrees with the run's args, naming the first field that does."""
    args = Args(values, path)
    model_type = config.get("model_type")
    family, fields = described(args, model_type if model_type in FAMILIES else None)
    defaults = _defaults(config, family)
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
        if key == "q_lora_rank" and key in config and config[key] is None:
            found = None  # null is DeepSeek-V2-Lite's plain q_proj, not "left out"
        elif found is None:
            continue  # not in the config and no default to compare: transformers' own default applies
        if found != said or (type(found) is bool) != (type(said) is bool):
            raise _disagreement(config_path, key, found, said, path)
    _check_positions(config, config_path, path)
    padded = values.get("padded_vocab_size")
    vocab = _config_value(config, "vocab_size", None)
    if type(padded) is int and type(vocab) is int and vocab > padded:
        raise InputError(
            f"{config_path}: vocab_size is {vocab}, more rows than the checkpoint's embedding holds "
            f"({padded}, args.padded_vocab_size in {path}): not this run's config"
        )


__all__ = ["FAMILIES", "MODEL_TYPES", "Args", "check_config", "derive_config", "described", "family_of"]
