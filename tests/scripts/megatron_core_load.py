"""Load what ``mpicons shard`` wrote with Megatron-Core's own ``dist_checkpointing.load``, on CPU (a check
by hand: megatron-core is not a dependency of mpicons).

Usage, with megatron-core 0.16.1 on the path (``pip install --target DIR megatron-core==0.16.1 --no-deps``,
then ``PYTHONPATH=DIR``)::

    torchrun --nproc-per-node TP tests/scripts/megatron_core_load.py CHECKPOINT MODEL_DIR CASE

CHECKPOINT is ``mpicons shard --spec local``'s output directory (the local layer spec's names),
MODEL_DIR the Hugging Face model it was written from, CASE the Megatron fixture's name (``llama-tp2``,
``qwen2-tp2``, ``qwen3-pp2``, ``qwen3moe-ep2``, ``deepseekv3-ep2``; ``-`` for another model: its logits
only). The model is built with Megatron-Core's local layer spec at TP (EP for a MoE model) = the number
of processes, loaded, and (on one process) every parameter compared with what Megatron-LM saved for the
model (tests/megatron_cases.py); its logits are compared with transformers' for the same weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")


def build(config: dict, args: object, world: int):  # type: ignore[no-untyped-def]
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if getattr(args, "multi_latent_attention", False):
        return build_mla(config, args, world)
    qk_norm = bool(args.qk_layernorm)  # type: ignore[attr-defined]
    experts = args.num_experts  # type: ignore[attr-defined]
    moe = {} if not experts else {
        "num_moe_experts": experts, "moe_ffn_hidden_size": args.moe_ffn_hidden_size,  # type: ignore[attr-defined]
        "moe_router_topk": args.moe_router_topk, "moe_router_pre_softmax": False,  # type: ignore[attr-defined]
        "moe_router_load_balancing_type": "none", "moe_token_dispatcher_type": "allgather",
        "expert_model_parallel_size": world,
    }  # fmt: skip
    settings = TransformerConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], num_query_groups=config["num_key_value_heads"],
        kv_channels=config.get("head_dim"), ffn_hidden_size=config["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=config["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=bool(args.add_qkv_bias), qk_layernorm=qk_norm, bf16=True,  # type: ignore[attr-defined]
        params_dtype=torch.bfloat16, use_cpu_initialization=True, tensor_model_parallel_size=1 if experts else world,
        hidden_dropout=0.0, attention_dropout=0.0,
        perform_initialization=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, **moe,
    )  # fmt: skip
    return GPTModel(
        settings, get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=qk_norm), vocab_size=args.padded_vocab_size,  # type: ignore[attr-defined]
        max_sequence_length=128, share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
        position_embedding_type="rope", rotary_base=int(args.rotary_base), parallel_output=False,  # type: ignore[attr-defined]
    )  # fmt: skip


def build_mla(config: dict, args: object, world: int):  # type: ignore[no-untyped-def]
    """DeepSeek-V3 with the local spec: megatron-core 0.16.1 builds multi-latent attention only with two
    stand-ins (the Megatron fixtures' README says why): a core attention that takes MLA's k/v widths (it has
    no parameters and nothing saved), and a placeholder for Transformer Engine's missing TELinear."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args: object, k_channels: int | None = None, v_channels: int | None = None, **kw: object):
            super().__init__(*args, **kw)  # type: ignore[arg-type]
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    if not isinstance(getattr(multi_latent_attention, "TELinear", None), type):
        multi_latent_attention.TELinear = type("NoTELinear", (), {})  # type: ignore[attr-defined]
    a = args
    settings = MLATransformerConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], ffn_hidden_size=config["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=config["rms_norm_eps"], gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, bf16=True, params_dtype=torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, perform_initialization=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, multi_latent_attention=True,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,  # type: ignore[attr-defined]
        qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim, rope_type="rope",  # type: ignore[attr-defined]
        rotary_base=a.rotary_base, num_moe_experts=a.num_experts,  # type: ignore[attr-defined]
        moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_router_topk=a.moe_router_topk,  # type: ignore[attr-defined]
        moe_layer_freq=a.moe_layer_freq,  # type: ignore[attr-defined]
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,  # type: ignore[attr-defined]
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False,
        moe_router_num_groups=a.moe_router_num_groups, moe_router_group_topk=a.moe_router_group_topk,  # type: ignore[attr-defined]
        moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor,  # type: ignore[attr-defined]
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather", expert_model_parallel_size=world,
    )  # fmt: skip
    block = get_gpt_decoder_block_spec(settings, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
    return GPTModel(
        settings, block, vocab_size=a.padded_vocab_size, max_sequence_length=128,  # type: ignore[attr-defined]
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
        rotary_base=int(a.rotary_base), parallel_output=False,  # type: ignore[attr-defined]
    )  # fmt: skip


def compare_parameters(sharded: dict, state: dict, case: str) -> str:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron_cases import saved_tensors

    expected = saved_tensors(case)
    compared = differ = 0
    for name, spec in sharded.items():
        if not isinstance(spec, ShardedTensor) or spec.key not in expected:
            continue  # fc1's gate/up factory: checked by the forward
        p = spec.prepend_axis_num
        want = expected[spec.key][tuple(spec.global_offset[:p])]
        want = want[tuple(slice(o, o + n) for o, n in zip(spec.global_offset[p:], spec.local_shape))]
        compared += 1
        differ += not torch.equal(state[name].float(), torch.from_numpy(want.astype("float32")))
    return f"{compared} parameters compared with what Megatron-LM saved, {differ} differ"


def main() -> None:
    checkpoint, model_dir, case = sys.argv[1:4]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # rotary tables on the CPU
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    config = json.loads(Path(model_dir, "config.json").read_text())
    args = torch.load(os.path.join(checkpoint, "release", "common.pt"), weights_only=False)["args"]
    if args.num_experts:  # experts over the ranks (EP), attention whole on each
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = build(config, args, world)
    sharded = model.sharded_state_dict()
    state = dist_checkpointing.load(sharded, os.path.join(checkpoint, "release"))
    missing = [m for m in model.load_state_dict(state, strict=False)[0] if not m.endswith("_extra_state")]
    model.eval()
    megatron_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # no dropout RNG on CPU
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # megatron-core 0.16.1 names it without Transformer Engine installed
    tokens = torch.tensor([[5, 17, 301, 999, 42, 7, 123, 640]]) % config["vocab_size"]
    mask = torch.triu(torch.ones(8, 8), diagonal=1).bool()[None, None]
    with torch.no_grad():
        logits = model(tokens, torch.arange(8)[None], attention_mask=mask)[..., : config["vocab_size"]].float()
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)(tokens).logits.float()
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        checked = "parameters compared on 1 process" if world > 1 else "no saved reference (CASE -)"
        if world == 1 and case != "-":
            checked = compare_parameters(sharded, state, case)
        print(
            f"{'EP' if args.num_experts else 'TP'}{world}: loaded, missing keys {missing}; {checked}; "
            f"max |logits - transformers'| "
            f"{(logits - reference).abs().max().item():.4f} in bf16 (largest logit {reference.abs().max().item():.2f}), "
            f"argmax agreement {agree:.3f}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
