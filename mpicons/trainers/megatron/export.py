"""What a Hugging Face model becomes as a Megatron-Core ``torch_dist`` checkpoint (pure: no I/O, no MPI).

The built-in Megatron rule files, read backwards (:mod:`mpicons.adaptation.inverse`), give the saved
tensors; this module adds what Megatron-LM's ``load_checkpoint`` needs beside them (FACTS.md §9, §17
of the Megatron fixtures): an ``_extra_state`` bytes item per linear module and stacked index, the
``.metadata`` pickle, ``common.pt``, ``metadata.json`` and the tracker file naming ``release``.

Each tensor is saved whole, one chunk, in one ``__0_0.distcp`` file: ``torch_dist`` reshards on load, so
Megatron-LM loads it at any TP/PP/EP whose padded vocabulary is the one written (the vocabulary is
padded to a multiple of ``make_vocab_size_divisible_by × TP``, zero rows, as Megatron pads).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...adaptation.inverse import SavedForm, SavedTensor
from ...core.errors import InputError
from ...core.safetensors_codec import DTYPE_BY_NAME
from ...formats.pickle_writer import Call, Global, Obj, dumps
from ...formats.torch_pickles import METADATA_MODULE, tensor_pickle, torch_size
from ...formats.torch_zip import archive_around

RELEASE = "release"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
DATA_FILE = "__0_0.distcp"
METADATA_JSON = (
    b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}'
)
SPECS = ("local", "te")
#: Transformer Engine's fused layer-norm names (the local spec saves under them too, FACTS.md §4).
_FUSED_NORMS = ("linear_qkv.layer_norm_weight", "linear_fc1.layer_norm_weight", "up_proj.layer_norm_weight")
_LINEAR = re.compile(r"(.*\.linear_\w+)\.weight")


@dataclass(frozen=True)
class Parallelism:
    """The mesh the checkpoint is written for: it sets the vocabulary padding and ``common.pt``'s args."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    divisible_by: int = 128  # Megatron-LM's --make-vocab-size-divisible-by
    spec: str = "te"  # Megatron-LM builds Transformer Engine layers unless told --transformer-impl local

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "divisible_by"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} {getattr(self, name)}: a positive number")
        if self.spec not in SPECS:
            raise InputError(f"--spec {self.spec!r}: one of {', '.join(SPECS)}")

    def padded(self, vocab: int) -> int:
        """Megatron-LM's ``padded_vocab_size``: a multiple of ``make_vocab_size_divisible_by × TP``."""
        step = self.divisible_by * self.tp
        return -(-vocab // step) * step


def expert_layers(config: Mapping[str, Any]) -> list[bool] | None:
    """Which layers have experts (None: a dense model): DeepSeek-V3's after ``first_k_dense_replace``, a
    Qwen-MoE's but its ``mlp_only_layers`` and those ``decoder_sparse_step`` skips, every Mixtral layer."""
    layers = int(_field(config, "num_hidden_layers", default=0))
    if config.get("model_type") == "deepseek_v3":
        first = int(_field(config, "first_k_dense_replace", default=0))
        return [i >= first for i in range(layers)]
    if not _field(config, "num_experts", "num_local_experts"):
        return None
    dense, step = set(config.get("mlp_only_layers") or ()), int(config.get("decoder_sparse_step") or 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def saved_form(config: Mapping[str, Any], spec: str) -> SavedForm:
    """The names Megatron-LM saves for this model and layer spec (FACTS.md §4, §15). Layers that differ
    (DeepSeek-V3's dense first layers, a Qwen-MoE's dense layers) are one key each. Both specs save a dense
    MLP's norm fused (``mlp.linear_fc1.layer_norm_weight``) but for DeepSeek-V3's local spec; the
    Transformer Engine spec keeps MoE layers' ``pre_mlp_layernorm`` and fuses MLA's latent norms into the
    up projections; multi-latent attention keeps ``input_layernorm``."""
    experts = expert_layers(config)
    keyed = frozenset({"N"}) if experts is not None and not all(experts) else frozenset()
    mla = config.get("model_type") == "deepseek_v3"
    if mla and spec == "local":
        return SavedForm(keyed, _FUSED_NORMS)
    unsaved = ("linear_qkv.layer_norm_weight", "self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight")
    if spec != "te" or experts is None:
        return SavedForm(keyed, unsaved if mla else ())
    fused, separate = "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"
    if not keyed:  # every layer has experts
        return SavedForm(keyed, (*(unsaved if mla else ()), fused))
    names = frozenset(f"decoder.layers.{i}.{fused if moe else separate}" for i, moe in enumerate(experts))
    return SavedForm(keyed, unsaved if mla else (), names)


def check_layers(config: Mapping[str, Any], parallel: Parallelism) -> None:
    """Refuse a mesh Megatron-LM could not build for the model (before anything is written)."""
    layers = int(config.get("num_hidden_layers") or 0)
    heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)
    problems = [
        f"{what} ({number}) is not a multiple of --{flag} {size}"
        for what, number, flag, size in (
            ("num_hidden_layers", layers, "pp", parallel.pp),
            ("num_key_value_heads", heads, "tp", parallel.tp),
            ("the experts", experts, "ep", parallel.ep if experts else 1),
        )
        if number % size
    ]
    if problems:
        raise InputError(f"cannot write for TP{parallel.tp} PP{parallel.pp} EP{parallel.ep}: {'; '.join(problems)}")


def extra_state_keys(tensor: SavedTensor) -> list[str]:
    """The ``_extra_state`` items Megatron-LM keeps for a linear's weight: one per stacked index,
    ``<module>._extra_state/shard_<i>_<n>`` (``shard_<i>.<j>_<n>.<m>`` for layers × experts)."""
    found = _LINEAR.fullmatch(tensor.name)
    if found is None:
        return []
    counts = tensor.shape[: tensor.stacked] or (1,)
    total = ".".join(map(str, counts))
    return [
        f"{found.group(1)}._extra_state/shard_{'.'.join(map(str, index))}_{total}"
        for index in itertools.product(*(range(c) for c in counts))
    ]


@dataclass(frozen=True)
class Item:
    """One DCP item of the data file: a tensor (its archive around ``length`` bytes of data) or an
    ``_extra_state`` bytes item (``tensor`` None, the archive whole in ``before``)."""

    key: str
    offset: int  # where the item starts in the data file
    before: bytes
    length: int
    after: bytes
    tensor: SavedTensor | None = None
    dtype: str = ""

    @property
    def data_offset(self) -> int:
        return self.offset + len(self.before)

    @property
    def size(self) -> int:
        return len(self.before) + self.length + len(self.after)


def plan_items(saved: Sequence[SavedTensor], dtypes: Mapping[str, str]) -> list[Item]:
    """Every item of the data file in order (bytes items first, as DCP writes them), with its offset."""
    empty_state = archive_around(dumps([None]), None)[0]
    items: list[Item] = []
    offset = 0
    for tensor in saved:
        for key in extra_state_keys(tensor):
            items.append(Item(key, offset, empty_state, 0, b""))
            offset += len(empty_state)
    for tensor in sorted(saved, key=lambda t: t.name):
        dtype = dtypes[tensor.name]
        length = _count(tensor.shape) * DTYPE_BY_NAME[dtype].bits // 8
        before, after = archive_around(tensor_pickle(dtype, tensor.shape), length)
        items.append(Item(tensor.name, offset, before, length, after, tensor, dtype))
        offset += items[-1].size
    return items


def _count(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def metadata_pickle(items: Sequence[Item], checkpoint_id: str) -> bytes:
    """DCP's ``Metadata`` for the data file: each tensor one chunk at offset zero, each bytes item its own."""

    def cls(name: str, module: str = METADATA_MODULE) -> Global:
        return Global(module, name)

    entries: dict[str, object] = {}
    storage: dict[object, object] = {}
    for item in items:
        where = None if item.tensor is None else torch_size((0,) * len(item.tensor.shape))
        index = Obj(cls("MetadataIndex"), {"fqn": item.key, "offset": where, "index": None})
        info = {"relative_path": DATA_FILE, "offset": item.offset, "length": item.size, "transform_descriptors": None}
        storage[index] = Obj(cls("_StorageInfo", "torch.distributed.checkpoint.filesystem"), info)
        if item.tensor is None:
            entries[item.key] = Obj(cls("BytesStorageMetadata"))
            continue
        shape = torch_size(item.tensor.shape)
        properties = Obj(
            cls("TensorProperties"),
            (Global("torch", str(DTYPE_BY_NAME[item.dtype].torch).removeprefix("torch.")),
             Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)), False,
             Call(cls("_MEM_FORMAT_ENCODING"), (0,)), False),
        )  # fmt: skip
        chunk = Obj(cls("ChunkStorageMetadata"), {"offsets": where, "sizes": shape})
        entries[item.key] = Obj(cls("TensorStorageMetadata"), {"properties": properties, "size": shape, "chunks": [chunk]})
    meta: dict[str, object] = {"checkpoint_id": checkpoint_id, "save_id": "mpicons-shard", "load_id": None, "modules": []}
    state = {
        "state_dict_metadata": entries,
        "planner_data": None,
        "storage_data": storage,
        "storage_meta": Obj(cls("StorageMeta"), meta),
        "version": "1.0.0",
    }
    return dumps(Obj(cls("Metadata"), state))


def _field(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def model_args(config: Mapping[str, Any], parallel: Parallelism, dtype: str) -> dict[str, Any]:
    """The model's share of Megatron-LM's ``args`` (what ``load_checkpoint`` compares when it resumes
    without ``--finetune``), derived from ``config.json``, the mesh and the weights' ``dtype``."""
    heads = int(_field(config, "num_attention_heads", default=1))
    groups = int(_field(config, "num_key_value_heads", default=heads))
    hidden = int(_field(config, "hidden_size", default=0))
    experts = _field(config, "num_experts", "num_local_experts", "n_routed_experts")
    rope = config.get("rope_parameters") or {}
    return {
        "num_layers": _field(config, "num_hidden_layers"), "hidden_size": hidden,
        "ffn_hidden_size": _field(config, "intermediate_size"), "num_attention_heads": heads,
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "kv_channels": _field(config, "head_dim", default=hidden // heads if heads else None),
        "padded_vocab_size": parallel.padded(int(_field(config, "vocab_size", default=0))),
        "vocab_size": _field(config, "vocab_size"), "make_vocab_size_divisible_by": parallel.divisible_by,
        "tensor_model_parallel_size": parallel.tp, "pipeline_model_parallel_size": parallel.pp,
        "expert_model_parallel_size": parallel.ep,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "normalization": "RMSNorm", "layernorm_epsilon": _field(config, "rms_norm_eps", default=1e-6), "swiglu": True,
        "add_bias_linear": bool(config.get("attention_bias") or config.get("mlp_bias")),
        "add_qkv_bias": config.get("model_type") == "qwen2" or bool(config.get("attention_bias")),
        "position_embedding_type": "rope",
        "rotary_base": _field(config, "rope_theta", default=rope.get("rope_theta", 10000)),
        "rotary_percent": 1.0, "qk_layernorm": config.get("model_type") in ("qwen3", "qwen3_moe"),
        "num_experts": experts, "moe_router_topk": _field(config, "num_experts_per_tok", default=2),
        "moe_ffn_hidden_size": _field(config, "moe_intermediate_size"),
        "ckpt_format": "torch_dist", "transformer_impl": "transformer_engine" if parallel.spec == "te" else "local",
        "bf16": dtype == "BF16", "fp16": dtype == "F16",
        "params_dtype": Global("torch", {"BF16": "bfloat16", "F16": "float16"}.get(dtype, "float32")),
        **(_mla_args(config) if config.get("model_type") == "deepseek_v3" else _moe_args(config)),
    }  # fmt: skip


def _moe_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Qwen-MoE's or Mixtral's routing: softmax scores, renormalised over the top k (Megatron's softmax
    after the top-k choice) unless Qwen-MoE's ``norm_topk_prob`` is false; which layers have experts."""
    experts = expert_layers(config)
    if experts is None:
        return {}
    renormalised = config.get("model_type") == "mixtral" or bool(config.get("norm_topk_prob"))
    return {
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not renormalised,
        "moe_layer_freq": 1 if all(experts) else [int(e) for e in experts],
    }


def _mla_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's flags: multi-latent attention, sigmoid routing with an expert bias and groups, shared
    experts, the first layers dense."""
    layers, dense = int(_field(config, "num_hidden_layers", default=0)), int(_field(config, "first_k_dense_replace", default=0))
    width = int(_field(config, "moe_intermediate_size", default=0))
    scaling = config.get("rope_scaling") or {}
    return {
        "multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": config.get("q_lora_rank"),
        "kv_lora_rank": config.get("kv_lora_rank"), "qk_head_dim": config.get("qk_nope_head_dim"),
        "qk_pos_emb_head_dim": config.get("qk_rope_head_dim"), "v_head_dim": config.get("v_head_dim"),
        "rope_type": "yarn" if scaling.get("type", scaling.get("rope_type")) == "yarn" else "rope",
        "rotary_scaling_factor": scaling.get("factor", 1.0), "mscale_all_dim": scaling.get("mscale_all_dim", 0.0),
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        "moe_shared_expert_intermediate_size": int(_field(config, "n_shared_experts", default=0)) * width or None,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": config.get("n_group"), "moe_router_group_topk": config.get("topk_group"),
        "moe_router_topk_scaling_factor": config.get("routed_scaling_factor"), "add_qkv_bias": False,
    }  # fmt: skip


def common_pt(config: Mapping[str, Any], parallel: Parallelism, dtype: str) -> bytes:
    """``common.pt``: the checkpoint version, iteration 0 (a release checkpoint) and the model's ``args``."""
    state = {
        "args": Obj(Global("argparse", "Namespace"), model_args(config, parallel, dtype)),
        "checkpoint_version": 3.0,
        "iteration": 0,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }
    return archive_around(dumps(state), None, folder="common")[0]
