"""DeepSeek-V3's Hugging Face config (``deepseek_v3``) from a Megatron-LM run with multi-latent attention
(MLA), and what a config.json that leaves a key out means to transformers (so a check compares what
transformers will build, not what the file happens to say).

The correspondences are FACTS.md §15's (tests/fixtures/megatron/FACTS.md). ``DeepseekV3Config`` fixes
much that Megatron leaves open; a run that differs is refused by name, since its config would load
and compute something else:

- routing: transformers always takes sigmoid scores plus a per-expert bias for choosing
  (``--moe-router-score-function sigmoid --moe-router-enable-expert-bias``), weights normalised over
  the chosen ones (Megatron does that only for top-k > 1: ``norm_topk_prob`` says which) times
  ``routed_scaling_factor``. Group-limited routing: transformers scores a group by its top 2 experts,
  Megatron by the sum of its top ``topk // group_topk``, the same only when that is 2 (or when every
  group is chosen anyway); without ``--moe-router-group-topk`` Megatron does not group: ``n_group`` =
  ``topk_group`` = 1.
- layers: the first k dense, every later one with experts (``first_k_dense_replace``), and one
  ungated shared expert a whole number of routed experts wide (``n_shared_experts``).
- attention: RMSNorms on the q and kv latents (``--qk-layernorm``); plain rotary embeddings
  (``--rope-type rope``: MLA's default, yarn, is not derived: its scaling, beta and original length
  are not all in the args), rotated in pairs (``rope_interleave``); softmax scale 1/sqrt(qk head dim).
  Without ``--q-lora-rank`` (DeepSeek-V2-Lite style) ``q_lora_rank`` is null: transformers' ``q_proj``.
- no multi-token prediction layers (refused for every family): ``num_nextn_predict_layers`` 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.errors import InputError
from ...formats.unpickling import shown
from .args import Args

#: ``DeepseekV3Config``'s own defaults (transformers 5.x: DeepSeek-V3's sizes): what transformers builds
#: for a key config.json leaves out, so leaving one out is no agreement with a smaller run.
HF_DEFAULTS: dict[str, object] = {
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
    "attention_bias": False,
}
#: The other names transformers reads these keys by (``DeepseekV3Config.attribute_map``).
ALIASES = {"n_routed_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers"}


def refused(args: Args, name: str, said: str, wanted: str) -> InputError:
    """What DeepSeek-V3's config cannot say about this run, named by its args field."""
    return InputError(
        f"{args.path}: args.{name} = {said}, but transformers' DeepSeek-V3 (deepseek_v3) needs {wanted}: "
        "a config for it would load and compute something else; convert with a rule file of your own "
        "for a model class that computes this run's model (docs/adapter-rules.md)"
    )


def attention_fields(args: Args, heads: int) -> dict[str, Any]:
    """MLA's fields: the latent ranks and head widths, a k/v head per query head (``kv_channels`` and
    ``num_query_groups`` mean nothing to MLA)."""
    if not args.flag("qk_layernorm"):
        raise refused(args, "qk_layernorm", "false", "RMSNorms on the q and kv latents (--qk-layernorm)")
    rope_type = args.text("rope_type")
    if rope_type != "rope":
        said = "None (MLA's default, 'yarn')" if rope_type is None else repr(rope_type)
        raise refused(args, "rope_type", said, "plain rotary embeddings (--rope-type rope; yarn's scaling is not derived)")
    factor, mscale = args.number("rotary_scaling_factor"), args.number("mscale_all_dim")
    if factor > 1 and mscale != 0:  # Megatron's MLA scales the softmax by yarn's mscale even with plain rope
        raise refused(
            args, "mscale_all_dim", f"{mscale} (with rotary_scaling_factor {factor})", "softmax scale 1/sqrt(qk head dim)"
        )
    nope, rope = args.whole("qk_head_dim"), args.whole("qk_pos_emb_head_dim")
    return {
        "num_key_value_heads": heads,
        "q_lora_rank": args.maybe_whole("q_lora_rank"),
        "kv_lora_rank": args.whole("kv_lora_rank"),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "qk_head_dim": nope + rope,
        "head_dim": rope,  # transformers' rotary width
        "v_head_dim": args.whole("v_head_dim"),
        "rope_interleave": True,  # Megatron's MLA rotates pairs (2j, 2j+1) as transformers does with this
        "attention_bias": False,  # MLA's projections have none; --add-bias-linear is refused
        "num_nextn_predict_layers": 0,
    }


def _groups(args: Args, top_k: int) -> tuple[int, int]:
    """``n_group`` and ``topk_group``: Megatron limits routing to groups only with ``--moe-router-group-topk``."""
    if not args.values.get("moe_router_group_topk"):
        return 1, 1
    groups, chosen = args.whole("moe_router_num_groups"), args.whole("moe_router_group_topk")
    if chosen < groups and top_k // chosen != 2:
        raise refused(
            args,
            "moe_router_group_topk",
            f"{chosen} (with moe_router_topk {top_k})",
            "expert groups scored by their top 2 experts, as transformers does: Megatron scores them by their "
            f"top moe_router_topk // moe_router_group_topk = {top_k // chosen}",
        )
    return groups, chosen


def expert_fields(args: Args, layers: int, moe_layers: list[int]) -> dict[str, Any]:
    """The routed and shared experts' fields, and how many layers come first without experts."""
    if args.text("moe_router_score_function") != "sigmoid":
        said = repr(args.text("moe_router_score_function"))
        raise refused(args, "moe_router_score_function", said, "sigmoid routing scores")
    if not args.flag("moe_router_enable_expert_bias"):
        raise refused(args, "moe_router_enable_expert_bias", "false", "a per-expert bias for choosing experts")
    if args.flag("moe_shared_expert_gate"):
        raise refused(args, "moe_shared_expert_gate", "true", "shared experts without a gate")
    dense = moe_layers[0] if moe_layers else layers
    if moe_layers != list(range(dense, layers)):
        said = shown(args.values.get("moe_layer_freq"))
        raise refused(args, "moe_layer_freq", said, "the first k layers dense and all later ones with experts")
    experts, top_k = args.whole("num_experts"), args.whole("moe_router_topk")
    width = args.whole("moe_ffn_hidden_size", args.whole("ffn_hidden_size"))
    shared = args.values.get("moe_shared_expert_intermediate_size")
    if type(shared) is not int or shared <= 0 or shared % width:
        wanted = f"a shared expert as wide as a whole number of routed ones ({width}, moe_ffn_hidden_size)"
        raise refused(args, "moe_shared_expert_intermediate_size", shown(shared), wanted)
    scaling = args.values.get("moe_router_topk_scaling_factor")
    groups, chosen = _groups(args, top_k)
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": width,
        "n_shared_experts": shared // width,
        "first_k_dense_replace": dense,
        "norm_topk_prob": top_k > 1,  # Megatron renormalises the chosen sigmoid scores only for top-k > 1
        "routed_scaling_factor": float(args.number("moe_router_topk_scaling_factor")) if scaling else 1.0,
        "n_group": groups,
        "topk_group": chosen,
    }


def config_defaults(config: Mapping[str, Any]) -> dict[str, object]:
    """What transformers takes for each key a DeepSeek-V3 config.json leaves out (the head widths it
    computes from the config's own)."""
    defaults = dict(HF_DEFAULTS)
    nope, rope = (
        HF_DEFAULTS[key] if config.get(key) is None else config[key] for key in ("qk_nope_head_dim", "qk_rope_head_dim")
    )
    defaults["head_dim"] = rope
    if type(nope) is int and type(rope) is int:
        defaults["qk_head_dim"] = nope + rope
    return defaults


__all__ = ["ALIASES", "HF_DEFAULTS", "attention_fields", "config_defaults", "expert_fields", "refused"]
