"""A Megatron-shaped sample: a llama model saved the way Megatron-LM saves it (``--ckpt-format torch_dist``).

What the adapter for Megatron has to undo, at any size: layers stacked on a leading axis ``[L, ...]``
(pipeline stages write their own layers), q/k/v fused by query group, ``linear_fc1`` as
``[gate; up]`` written as two chunks per tensor-parallel rank, the vocabulary padded to a multiple of
``make_vocab_size_divisible_by × TP``, tensor parallelism on dim 0 (QKV, fc1, embedding, output
layer) or dim -1 (``linear_proj``, ``linear_fc2``), replicated norms written once, and a
``_extra_state`` bytes item per linear and layer. On disk, as Megatron-LM writes it::

    RUN/latest_checkpointed_iteration.txt          the iteration, no newline
    RUN/iter_0000001/.metadata                     DCP's Metadata, plus Megatron's ``all_local_plans``
    RUN/iter_0000001/__R_0.distcp                  the items of training rank R = stage × TP + tp rank
    RUN/iter_0000001/common.pt                     ``args`` (an ``argparse.Namespace``), iteration, ...
    RUN/iter_0000001/metadata.json                 the backends

The weights are made as Hugging Face tensors first, deterministic in the seed and the tensor's name
(:func:`megatron_expected_hf`: exactly what a correct conversion gives back), then laid out as
Megatron lays them out (:func:`megatron_values`). Facts and sources: the Megatron fixtures' FACTS.md
(tests/fixtures/megatron), written from checkpoints megatron-core 0.16.1 saved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ...formats.pickle_writer import Call, Global, Obj, dumps
from ..sample_distcp import METADATA_MODULE, tensor_pickle, torch_archive, torch_size
from ..sample_model import ItemIndex, SampleConfig, full_tensor

DTYPE = "BF16"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
_PLANNER_MODULE = "torch.distributed.checkpoint.planner"
_SHARD, _BYTE_IO = 2, 3  # WriteItemType values

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
QKV_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
QKV = "decoder.layers.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
FC1_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC2 = "decoder.layers.mlp.linear_fc2.weight"
#: The linears that carry an ``_extra_state`` bytes item per layer.
EXTRA_STATE_MODULES = (
    "decoder.layers.self_attention.linear_qkv",
    "decoder.layers.self_attention.linear_proj",
    "decoder.layers.mlp.linear_fc1",
    "decoder.layers.mlp.linear_fc2",
)
#: How tensor parallelism cuts each stacked key (per layer): rows, the last dim, [gate; up] or not at all.
_CUTS = {QKV_NORM: "whole", QKV: "rows", PROJ: "cols", FC1_NORM: "whole", FC1: "gated", FC2: "cols"}


@dataclass(frozen=True)
class MegatronSampleConfig:
    """A llama (GQA, SwiGLU, RMSNorm, no biases) and its training mesh: ``tp`` × ``pp`` ranks, bf16."""

    layers: int = 4
    hidden: int = 128
    ffn: int = 352
    heads: int = 8
    query_groups: int = 2
    head_dim: int = 16
    vocab: int = 1000
    tp: int = 2
    pp: int = 2
    #: Megatron-LM's ``--make-vocab-size-divisible-by``: the vocab is padded to a multiple of this × ``tp``.
    divisible_by: int = 128
    tied: bool = False
    iteration: int = 1
    seed: int = 0
    rope_theta: int = 500000
    norm_eps: float = 1e-5
    #: Megatron's extra ``.metadata`` attribute (``all_local_plans``); False: plain DCP metadata.
    plans: bool = True
    #: Write ``common.pt`` (the run's ``args``).
    common: bool = True

    def __post_init__(self) -> None:
        problems = [
            f"{name} = {value} must be positive"
            for name, value in (("layers", self.layers), ("hidden", self.hidden), ("ffn", self.ffn), ("heads", self.heads),
                                ("query_groups", self.query_groups), ("head_dim", self.head_dim), ("vocab", self.vocab),
                                ("tp", self.tp), ("pp", self.pp), ("divisible_by", self.divisible_by))
            if value < 1
        ]  # fmt: skip
        if not problems:
            problems += [
                what
                for bad, what in (
                    (self.heads % self.query_groups, "heads must be a multiple of query_groups"),
                    (self.query_groups % self.tp, "query_groups must be a multiple of tp (whole groups per rank)"),
                    (self.ffn % self.tp, "ffn must be a multiple of tp"),
                    (self.layers % self.pp, "layers must be a multiple of pp"),
                )
                if bad
            ]
        if problems:
            raise ValueError(f"MegatronSampleConfig: {'; '.join(problems)}")

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def padded_vocab(self) -> int:
        """Megatron-LM's ``padded_vocab_size``."""
        step = self.divisible_by * self.tp
        return -(-self.vocab // step) * step

    @property
    def qkv_rows(self) -> int:
        return self.query_groups * (self.heads // self.query_groups + 2) * self.head_dim

    @classmethod
    def sized(
        cls, target_bytes: int, layers: int = 8, vocab: int = 50257, head_dim: int = 64, **kwargs: Any
    ) -> MegatronSampleConfig:
        """At least ``target_bytes`` of checkpoint tensors: ``hidden`` grown by whole steps of 4 query
        heads per group and ``tp`` groups, ``ffn`` about 8/3 of it; TP 2 × PP 2 unless told otherwise."""
        tp = kwargs.get("tp", 2)
        step = 4 * head_dim * tp

        def config(hidden: int) -> MegatronSampleConfig:
            heads = hidden // head_dim
            ffn = -(-hidden * 8 // 3 // (64 * tp)) * 64 * tp
            fields = {"layers": layers, "vocab": vocab, "head_dim": head_dim, "hidden": hidden, "heads": heads,
                      "query_groups": heads // 4, "ffn": ffn, "tp": tp, "pp": 2}  # fmt: skip
            return cls(**{**fields, **kwargs})

        hidden = step
        while checkpoint_bytes(config(hidden)) < target_bytes and hidden < 1 << 16:
            hidden += step
        return config(hidden)


# ---------------------------------------------------------------- names, shapes, values


def hf_specs(c: MegatronSampleConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the Hugging Face model, in its order."""
    h, q, kv = c.hidden, c.heads * c.head_dim, c.query_groups * c.head_dim
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab, h))]
    for layer in range(c.layers):
        p = f"model.layers.{layer}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (c.ffn, h)),
            (p + "mlp.up_proj.weight", (c.ffn, h)),
            (p + "mlp.down_proj.weight", (h, c.ffn)),
        ]
    specs.append(("model.norm.weight", (h,)))
    if not c.tied:
        specs.append(("lm_head.weight", (c.vocab, h)))
    return specs


def megatron_specs(c: MegatronSampleConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(key, global shape) of every tensor on disk, in the state dict's order."""
    h, big_l = c.hidden, c.layers
    specs: list[tuple[str, tuple[int, ...]]] = [
        (EMBEDDING, (c.padded_vocab, h)),
        (QKV_NORM, (big_l, h)),
        (QKV, (big_l, c.qkv_rows, h)),
        (PROJ, (big_l, h, c.heads * c.head_dim)),
        (FC1_NORM, (big_l, h)),
        (FC1, (big_l, 2 * c.ffn, h)),
        (FC2, (big_l, h, c.ffn)),
        (FINAL_NORM, (h,)),
    ]
    return specs + ([] if c.tied else [(OUTPUT_LAYER, (c.padded_vocab, h))])


def checkpoint_bytes(c: MegatronSampleConfig) -> int:
    """Bytes of tensor data the checkpoint holds (padding rows included)."""
    return sum(int(np.prod(shape, dtype=np.int64)) * 2 for _, shape in megatron_specs(c))


def _value(c: MegatronSampleConfig, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return full_tensor(SampleConfig(seed=c.seed), name, DTYPE, shape)


def _hf_layer(c: MegatronSampleConfig, layer: int) -> dict[str, np.ndarray]:
    prefix = f"model.layers.{layer}."
    return {n[len(prefix) :]: _value(c, n, s) for n, s in hf_specs(c) if n.startswith(prefix)}


def _padded(c: MegatronSampleConfig, key: str, rows: np.ndarray) -> np.ndarray:
    """``rows`` then the padding rows up to ``padded_vocab`` (not zero: trained runs have values there)."""
    padding = _value(c, f"{key}/padding", (c.padded_vocab - c.vocab, c.hidden))
    return np.concatenate([rows, padding])


def _megatron_layer(c: MegatronSampleConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One layer's slices of the stacked keys (no layer axis), from its Hugging Face tensors."""
    groups, per_group, d, h = c.query_groups, c.heads // c.query_groups, c.head_dim, c.hidden
    q = hf["self_attn.q_proj.weight"].reshape(groups, per_group * d, h)
    k = hf["self_attn.k_proj.weight"].reshape(groups, d, h)
    v = hf["self_attn.v_proj.weight"].reshape(groups, d, h)
    return {
        QKV_NORM: hf["input_layernorm.weight"],
        QKV: np.concatenate([q, k, v], axis=1).reshape(c.qkv_rows, h),
        PROJ: hf["self_attn.o_proj.weight"],
        FC1_NORM: hf["post_attention_layernorm.weight"],
        FC1: np.concatenate([hf["mlp.gate_proj.weight"], hf["mlp.up_proj.weight"]]),
        FC2: hf["mlp.down_proj.weight"],
    }


def megatron_expected_hf(c: MegatronSampleConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, value) of every tensor a correct conversion to Hugging Face writes, one at a time."""
    for name, shape in hf_specs(c):
        yield name, _value(c, name, shape)


def megatron_values(c: MegatronSampleConfig) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """(key, layer, value) of the tensors on disk: a stacked key once per layer (``layer`` its index on
    the leading axis, ``value`` without it), a top-level key with ``layer`` None; one layer in memory."""
    yield EMBEDDING, None, _padded(c, EMBEDDING, _value(c, "model.embed_tokens.weight", (c.vocab, c.hidden)))
    for layer in range(c.layers):
        for key, value in _megatron_layer(c, _hf_layer(c, layer)).items():
            yield key, layer, value
    yield FINAL_NORM, None, _value(c, "model.norm.weight", (c.hidden,))
    if not c.tied:
        yield OUTPUT_LAYER, None, _padded(c, OUTPUT_LAYER, _value(c, "lm_head.weight", (c.vocab, c.hidden)))


# ---------------------------------------------------------------- pieces and files


Box = tuple[tuple[int, ...], tuple[int, ...]]


def _tp_boxes(cut: str, shape: tuple[int, ...], tp: int, rank: int) -> list[Box]:
    """The chunks tensor-parallel rank ``rank`` writes of a per-layer (or top-level) ``shape``."""
    zeros = (0,) * len(shape)
    if cut == "whole":
        return [(zeros, shape)] if rank == 0 else []
    if cut == "rows":
        rows = shape[0] // tp
        return [((rank * rows, *zeros[1:]), (rows, *shape[1:]))]
    if cut == "cols":
        cols = shape[-1] // tp
        return [((*zeros[:-1], rank * cols), (*shape[:-1], cols))]
    half = shape[0] // 2  # "gated": this rank's gate rows, then its up rows
    rows = half // tp
    return [((start + rank * rows, *zeros[1:]), (rows, *shape[1:])) for start in (0, half)]


class _Ranks:
    """The training ranks' ``__R_0.distcp`` files: items appended, their places recorded for the metadata."""

    def __init__(self, directory: str, world: int) -> None:
        self.names = [f"__{rank}_0.distcp" for rank in range(world)]
        self.handles: list[BinaryIO] = []
        for name in self.names:
            self.handles.append(open(os.path.join(directory, name), "wb"))
        self.items: ItemIndex = {}
        self.plans: list[list[tuple[str, tuple[int, ...] | None]]] = [[] for _ in range(world)]

    def put(self, rank: int, key: str, offsets: tuple[int, ...] | None, value: np.ndarray | None) -> None:
        """One item: a tensor chunk at ``offsets``, or (``value`` None) an ``_extra_state`` bytes item."""
        if value is None:
            archive = torch_archive(dumps([None]), None)
        else:
            archive = torch_archive(tensor_pickle(DTYPE, value.shape), np.ascontiguousarray(value).tobytes())
        handle = self.handles[rank]
        self.items[(key, offsets)] = (self.names[rank], handle.tell(), len(archive), () if value is None else value.shape)
        self.plans[rank].append((key, offsets))
        handle.write(archive)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


def _write_items(directory: str, c: MegatronSampleConfig) -> _Ranks:
    """Every rank's items: its ``_extra_state`` first (as DCP writes bytes before tensors), then its chunks."""
    ranks = _Ranks(directory, c.world)
    per_stage = c.layers // c.pp
    try:
        for index in range(c.layers):
            for module in EXTRA_STATE_MODULES:  # replicated over TP: written by TP rank 0 of the stage
                ranks.put(index // per_stage * c.tp, f"{module}._extra_state/shard_{index}_{c.layers}", None, None)
        last = (c.pp - 1) * c.tp
        for key, layer, value in megatron_values(c):
            stage_rank = 0 if key == EMBEDDING else last if layer is None else layer // per_stage * c.tp
            cut = "whole" if key == FINAL_NORM else "rows" if layer is None else _CUTS[key]
            lead = () if layer is None else (layer,)
            for tp_rank in range(c.tp):
                for offsets, sizes in _tp_boxes(cut, value.shape, c.tp, tp_rank):
                    piece = value[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
                    ranks.put(stage_rank + tp_rank, key, lead + offsets, piece.reshape((1,) * len(lead) + piece.shape))
    finally:
        ranks.close()
    return ranks


def _metadata_pickle(c: MegatronSampleConfig, ranks: _Ranks, checkpoint_id: str) -> bytes:
    """DCP's ``Metadata`` as Megatron-LM pickles it: no planner data, a ``StorageMeta``, and (with
    ``plans``) ``all_local_plans``: per rank a ``SavePlan`` of the ``WriteItem`` s it wrote."""

    def cls(name: str, module: str = METADATA_MODULE) -> Global:
        return Global(module, name)

    properties = Obj(
        cls("TensorProperties"),
        (Global("torch", "bfloat16"), Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)), False,
         Call(cls("_MEM_FORMAT_ENCODING"), (0,)), False),
    )  # fmt: skip
    shapes = dict(megatron_specs(c))

    def chunk(key: str, offsets: tuple[int, ...]) -> Obj:
        return Obj(
            cls("ChunkStorageMetadata"), {"offsets": torch_size(offsets), "sizes": torch_size(ranks.items[(key, offsets)][3])}
        )

    def index(key: str, offsets: tuple[int, ...] | None) -> Obj:
        return Obj(cls("MetadataIndex"), {"fqn": key, "offset": None if offsets is None else torch_size(offsets), "index": None})

    chunks: dict[str, list[object]] = {key: [] for key in shapes}
    entries: dict[str, object] = {
        key: Obj(cls("TensorStorageMetadata"), {"properties": properties, "size": torch_size(shape), "chunks": chunks[key]})
        for key, shape in shapes.items()
    }
    storage: dict[object, object] = {}
    for (key, offsets), (file, offset, length, _) in ranks.items.items():
        if offsets is None:
            entries[key] = Obj(cls("BytesStorageMetadata"))
        else:
            chunks[key].append(chunk(key, offsets))
        info = {"relative_path": file, "offset": offset, "length": length, "transform_descriptors": None}
        storage[index(key, offsets)] = Obj(cls("_StorageInfo", "torch.distributed.checkpoint.filesystem"), info)
    state: dict[str, object] = {
        "state_dict_metadata": entries,
        "planner_data": None,
        "storage_data": storage,
        "storage_meta": Obj(
            cls("StorageMeta"),
            {"checkpoint_id": checkpoint_id, "save_id": f"mpicons-sample-{c.seed}", "load_id": None, "modules": []},
        ),
        "version": "1.0.0",
    }
    if c.plans:
        state["all_local_plans"] = _save_plans(ranks, shapes, properties, chunk, index)
    return dumps(Obj(cls("Metadata"), state))


def _save_plans(
    ranks: _Ranks,
    shapes: dict[str, tuple[int, ...]],
    properties: Obj,
    chunk: Callable[[str, tuple[int, ...]], Obj],
    index: Callable[[str, tuple[int, ...] | None], Obj],
) -> list[Obj]:
    """Megatron-LM's ``all_local_plans``: per rank a ``SavePlan`` of the ``WriteItem`` s it wrote."""

    def item(key: str, offsets: tuple[int, ...] | None) -> Obj:
        kind = Call(Global(_PLANNER_MODULE, "WriteItemType"), (_BYTE_IO if offsets is None else _SHARD,))
        data = None
        if offsets is not None:
            fields = {"chunk": chunk(key, offsets), "properties": properties, "size": torch_size(shapes[key])}
            data = Obj(Global(_PLANNER_MODULE, "TensorWriteData"), fields)
        fields = {"index": index(key, offsets), "type": kind, "bytes_io_data": None, "tensor_data": data}
        return Obj(Global(_PLANNER_MODULE, "WriteItem"), fields)

    return [
        Obj(Global(_PLANNER_MODULE, "SavePlan"), {"items": [item(*k) for k in plan], "storage_data": None,
                                                  "planner_data": {}, "usable": True})
        for plan in ranks.plans
    ]  # fmt: skip


def _common_pt(c: MegatronSampleConfig, run_dir: str) -> bytes:
    """``common.pt``: what Megatron-LM saves beside the sharded state, ``args`` the model's share of its flags."""
    args = {
        "num_layers": c.layers, "hidden_size": c.hidden, "ffn_hidden_size": c.ffn, "num_attention_heads": c.heads,
        "group_query_attention": c.query_groups != c.heads, "num_query_groups": c.query_groups, "kv_channels": c.head_dim,
        "padded_vocab_size": c.padded_vocab, "vocab_size": c.vocab, "make_vocab_size_divisible_by": c.divisible_by,
        "tensor_model_parallel_size": c.tp, "pipeline_model_parallel_size": c.pp, "expert_model_parallel_size": 1,
        "data_parallel_size": 1, "world_size": c.world, "untie_embeddings_and_output_weights": not c.tied,
        "normalization": "RMSNorm", "layernorm_epsilon": c.norm_eps, "swiglu": True, "add_bias_linear": False,
        "add_qkv_bias": False, "position_embedding_type": "rope", "rotary_base": c.rope_theta, "rotary_percent": 1.0,
        "rotary_interleaved": False, "qk_layernorm": False, "num_experts": None, "moe_router_topk": 2,
        "moe_ffn_hidden_size": None, "bf16": True, "fp16": False, "params_dtype": Global("torch", "bfloat16"),
        "seq_length": 4096, "max_position_embeddings": 8192, "ckpt_format": "torch_dist", "transformer_impl": "local",
        "tokenizer_type": "NullTokenizer", "save": run_dir,
    }  # fmt: skip
    state = {
        "args": Obj(Global("argparse", "Namespace"), args),
        "checkpoint_version": 3.0,
        "iteration": c.iteration,
        "num_floating_point_operations_so_far": 0,
        "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
    }
    return torch_archive(dumps(state), None, folder="common")


# ---------------------------------------------------------------- the Hugging Face side


def megatron_hf_config(c: MegatronSampleConfig) -> dict[str, Any]:
    """The ``config.json`` of the model the checkpoint holds (as transformers 5 writes a llama's)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.query_groups,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.layers,
        "vocab_size": c.vocab,
        "max_position_embeddings": 8192,
        "rms_norm_eps": c.norm_eps,
        "rope_parameters": {"rope_theta": float(c.rope_theta), "rope_type": "default"},
        "tie_word_embeddings": c.tied,
        "dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_megatron_hf_assets(directory: str | os.PathLike[str], c: MegatronSampleConfig) -> list[str]:
    """``config.json`` and ``generation_config.json`` (the HF assets; no weights, no tokenizer)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    files = {"config.json": megatron_hf_config(c), "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2}}
    for name, content in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
            json.dump(content, handle, indent=2)
            handle.write("\n")
    return sorted(files)


def write_megatron_sample(
    run_dir: str | os.PathLike[str],
    config: MegatronSampleConfig | None = None,
    assets_dir: str | os.PathLike[str] | None = None,
) -> str:
    """Write a Megatron-LM run directory holding one ``torch_dist`` checkpoint; returns its
    ``iter_NNNNNNN`` directory. ``assets_dir``: also the Hugging Face config there (outside the run)."""
    c = config or MegatronSampleConfig()
    run_dir = os.path.abspath(os.fspath(run_dir))
    if assets_dir is not None:
        inside = os.path.relpath(os.path.abspath(assets_dir), run_dir)
        if inside == os.curdir or not inside.startswith(os.pardir):
            raise ValueError(f"assets_dir {os.fspath(assets_dir)!r} must lie outside the run directory {run_dir!r}")
    iteration_dir = os.path.join(run_dir, f"iter_{c.iteration:07d}")
    os.makedirs(iteration_dir, exist_ok=True)
    ranks = _write_items(iteration_dir, c)
    files = {".metadata": _metadata_pickle(c, ranks, iteration_dir)}
    if c.common:
        files["common.pt"] = _common_pt(c, run_dir)
    backends = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                "common_backend_version": 1}  # fmt: skip
    files["metadata.json"] = json.dumps(backends).encode()
    for name, data in files.items():
        with open(os.path.join(iteration_dir, name), "wb") as handle:
            handle.write(data)
    with open(os.path.join(run_dir, TRACKER_NAME), "w", encoding="ascii") as handle:
        handle.write(str(c.iteration))
    if assets_dir is not None:
        write_megatron_hf_assets(assets_dir, c)
    return iteration_dir


__all__ = [
    "MegatronSampleConfig",
    "checkpoint_bytes",
    "hf_specs",
    "megatron_expected_hf",
    "megatron_hf_config",
    "megatron_specs",
    "megatron_values",
    "write_megatron_hf_assets",
    "write_megatron_sample",
]
