"""A built-in sample: a small Llama-shaped model saved the way torch's DCP saves it, in its Hugging
Face layout (``shard-*.safetensors``) or in its default format (``.metadata`` + ``__R_0.distcp``).

Training ranks form a ``dp × tp`` mesh. Tensors are cut the ways real trainers cut them:
rows over every rank (FSDP), nested rows (colwise TP + FSDP), a 2-D grid (rowwise TP + FSDP),
columns over every rank, a 3-D expert tensor cut along its last dim, replicated norms written
once, and small int/bool buffers with empty pieces. Data is deterministic per tensor name, so
the expected full tensors can be regenerated at any time (:func:`~.sample_model.full_tensor`; what the
sample holds is :mod:`.sample_model`, its `.distcp` form :mod:`.sample_distcp`).

The ``torchtitan`` kind is a llama3 (or, with experts, a qwen3_moe) model under torchtitan's own
state-dict names, as its checkpoint manager saves it between steps (DCP's default format, FSDP2
over ``dp`` and TP over ``tp``), optionally with optimizer state, and with the Hugging Face
config an adapter needs written beside it (:func:`write_hf_assets`); :func:`torchtitan_to_hf` is
what torchtitan's ``to_hf`` makes of its tensors, so a conversion can be checked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..comm import Communicator, as_communicator
from ..comm.agreement import agree, agree_on
from ..core.names import INDEX_NAME, METADATA_NAME, SINGLE_FILE_NAME, shard_file_name
from ..core.safetensors_codec import DTYPE_BY_NAME, DTYPE_ORDER, build_header
from ..trainers.sample_distcp import metadata_pickle, write_distcp_ranks
from ..trainers.sample_model import TORCHTITAN_NON_MODEL, Box, ItemIndex, SampleConfig, full_tensor, placements_of, tensor_specs


def _shard_header(pieces: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]) -> bytes:
    """The header torch writes (through safetensors' serializer) for ``(name, dtype, shape, offsets)``
    pieces already in the reference order (dtype alignment, then name), sharding info in the metadata."""
    info = {name: {"saved_offsets": list(offsets)} for name, _, _, offsets in pieces}
    metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
    header, _ = build_header([(name, dtype, shape) for name, dtype, shape, _ in pieces], metadata)
    return header


def _write_file_index(directory: str, c: SampleConfig, index: int, keep: Callable[[str, str], bool], mode: str) -> None:
    """The shard files of output file ``index``, one per training rank holding a piece of it, written
    one full tensor at a time: memory is the largest tensor, whatever the file's size."""
    placements = placements_of(c)
    members = sorted((s for s in tensor_specs(c) if s[4] == index and keep(s[0], s[1])), key=lambda s: (DTYPE_ORDER[s[1]], s[0]))
    held: dict[int, list[tuple[str, str, Box]]] = {r: [] for r in range(c.world)}  # by training rank, file order
    boxes: dict[str, list[tuple[int, Box]]] = {}  # by tensor
    for name, dtype, shape, placement, _ in members:
        for train_rank in range(c.world):
            box = placements[placement](shape, train_rank // c.tp, train_rank % c.tp)
            if box is not None:
                held[train_rank].append((name, dtype, box))
                boxes.setdefault(name, []).append((train_rank, box))
    handles = {}
    try:
        for train_rank, pieces in held.items():
            if pieces:
                path = os.path.join(directory, shard_file_name(train_rank + 1, index, c.files))
                handles[train_rank] = open(path, mode)
                handles[train_rank].write(_shard_header([(name, dtype, box[1], box[0]) for name, dtype, box in pieces]))
        for name, dtype, shape, _, _ in members:
            full = full_tensor(c, name, dtype, shape)
            for train_rank, (offsets, size) in boxes.get(name, []):
                region = tuple(slice(o, o + s) for o, s in zip(offsets, size))
                handles[train_rank].write(np.ascontiguousarray(full[region]).tobytes())
    finally:
        for handle in handles.values():
            handle.close()


def sample_file_names(config: SampleConfig | None = None, distcp: str | None = None) -> list[str]:
    """The names :func:`write_sample` gives its files, known before any is written (from the placements
    alone, no data made), so that a caller can record what it is about to create."""
    c = config or SampleConfig()
    if distcp is not None or c.kind == "torchtitan":
        return sorted([METADATA_NAME, *(f"__{r}_0.distcp" for r in range(c.world))])
    placements = placements_of(c)
    names = {
        shard_file_name(r + 1, index, c.files)
        for _, _, shape, placement, index in tensor_specs(c)
        for r in range(c.world)
        if placements[placement](shape, r // c.tp, r % c.tp) is not None
    }
    return sorted(names)


def write_sample(
    directory: str | os.PathLike[str],
    config: SampleConfig | None = None,
    comm: object | None = None,
    keep: Callable[[str, str], bool] | None = None,
    distcp: str | None = None,
    assets_dir: str | os.PathLike[str] | None = None,
    exclusive: bool = False,
) -> list[str]:
    """Write the sample sharded checkpoint into ``directory`` (split over ``comm`` if given).

    Parameters:
        directory: created if missing.
        config: the model and training mesh (default: a small Llama).
        comm: write with these ranks (output files, or training ranks, dealt to them).
        keep: ``keep(name, dtype)`` selects tensors (e.g. floats only, for consolidators that need that).
        distcp: None for DCP's Hugging Face layout (``shard-RRRRR-model-IIIII-of-NNNNN.safetensors``);
            ``"torch_save"`` or ``"safetensors"`` for DCP's default format with that serialization
            (``.metadata`` and one ``__R_0.distcp`` per training rank, plus a non-tensor entry).
            The torchtitan kind is only ever saved in the default format: None means ``"torch_save"``.
        assets_dir: torchtitan kind only: also write the Hugging Face files an adapter needs here
            (:func:`write_hf_assets`); beside the checkpoint, never inside it (DCP's directory holds
            only what DCP writes).
        exclusive: create every file exclusively: an existing entry of the same name is an error
            (``FileExistsError``), never replaced.

    Returns the names of the files written into ``directory``.
    """
    c = config or SampleConfig()
    directory = os.fspath(directory)
    if c.kind == "torchtitan" and distcp is None:
        distcp = "torch_save"
    if assets_dir is not None:
        _check_assets_dir(c, directory, assets_dir)
    comm = as_communicator(comm) if comm is not None else None
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    chosen = keep or (lambda name, dtype: True)
    mode = "xb" if exclusive else "wb"

    def work() -> list[ItemIndex]:
        os.makedirs(directory, exist_ok=True)
        if distcp is not None:
            return [write_distcp_ranks(directory, c, range(rank, c.world, size), chosen, distcp, mode)]
        for index in range(1 + rank, c.files + 1, size):
            _write_file_index(directory, c, index, chosen, mode)
        return []

    items = work() if comm is None else [part for parts in agree(comm, work, gather=True) for part in parts]

    def write_metadata() -> None:  # written last, as DCP does
        everything = {key: value for part in items for key, value in part.items()}
        with open(os.path.join(directory, METADATA_NAME), mode) as handle:
            handle.write(metadata_pickle(c, chosen, everything))

    if distcp is not None:
        _once(comm, write_metadata)
    if assets_dir is not None:
        target = assets_dir
        _once(comm, lambda: write_hf_assets(target, c))
    return sorted(n for n in os.listdir(directory) if n.startswith(("shard-", "__", ".metadata")))


def _check_assets_dir(c: SampleConfig, directory: str, assets_dir: str | os.PathLike[str]) -> None:
    """Assets are for the torchtitan kind, and go beside the checkpoint, never inside it."""
    if c.kind != "torchtitan":
        raise ValueError(f"assets_dir is for the torchtitan kind, not {c.kind!r}")
    inside = os.path.relpath(os.path.abspath(assets_dir), os.path.abspath(directory))
    if inside == os.curdir or not inside.startswith(os.pardir):
        raise ValueError(f"assets_dir {os.fspath(assets_dir)!r} must lie beside the checkpoint {directory!r}, not in it")


def _once(comm: Communicator | None, action: Callable[[], object]) -> None:
    """``action`` done once for the job: here without a communicator, else on rank 0 (agreed)."""
    if comm is None:
        action()
    else:
        agree_on(comm, 0, action)


# ---------------------------------------------------------------- torchtitan: HF assets and to_hf


def hf_config(c: SampleConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the torchtitan kind: LlamaForCausalLM, or Qwen3MoeForCausalLM
    (every layer sparse) with experts; head counts and ``head_dim`` are what the q/k permutation needs."""
    if c.kind != "torchtitan":
        raise ValueError(f"hf_config is for the torchtitan kind, not {c.kind!r}")
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if c.experts else "LlamaForCausalLM"],
        "model_type": "qwen3_moe" if c.experts else "llama",
        "hidden_size": c.hidden,
        "intermediate_size": c.intermediate,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.layers,
        "vocab_size": c.vocab,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6 if c.experts else 1e-5,
        "rope_theta": 1000000.0 if c.experts else 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": str(DTYPE_BY_NAME[c.dtype].torch),
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if c.experts:
        config.update(
            num_experts=c.experts,
            num_experts_per_tok=min(2, c.experts),
            moe_intermediate_size=c.intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    return config


def write_hf_assets(directory: str | os.PathLike[str], c: SampleConfig) -> list[str]:
    """The Hugging Face files a user keeps beside a torchtitan run (its ``hf_assets_path``): ``config.json``
    and a small ``tokenizer_config.json``; no weights, no index (Hugging Face's default sharding applies)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    files = {
        "config.json": hf_config(c),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "model_max_length": 8192,
        },
    }
    for name, content in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
            json.dump(content, handle, indent=2)
            handle.write("\n")
    return sorted(files)


_COMMON_RENAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_EXPERTS = {
    "moe.routed_experts.inner_experts.w1_EFD": "gate_proj",
    "moe.routed_experts.inner_experts.w3_EFD": "up_proj",
    "moe.routed_experts.inner_experts.w2_EDF": "down_proj",
}


def _rope_to_half(weight: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """torchtitan's interleaved q/k rows to Hugging Face's halves: HF row h·hd + j·hd/2 + i is row h·hd + 2i + j."""
    rows = weight.reshape(heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(rows.swapaxes(1, 2)).reshape(weight.shape)


def torchtitan_to_hf(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """What torchtitan's ``to_hf`` makes of a whole native state dict, for llama and qwen3/qwen3_moe
    (``config`` is the Hugging Face config): renames, llama's q/k permutation, grouped experts one
    tensor per expert; ``expert_bias_E`` and a tied ``lm_head`` dropped; training state left out.

    Whole tensors in memory: for checking a conversion of samples and fixtures, not for converting.
    Raises ValueError on a model key it does not know.
    """
    family = config["model_type"]
    if family not in ("llama", "qwen3", "qwen3_moe"):
        raise ValueError(f"torchtitan_to_hf: model_type {family!r} (llama, qwen3, qwen3_moe)")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name.startswith(TORCHTITAN_NON_MODEL):
            continue
        layer, _, rest = name.partition(".")[2].partition(".") if name.startswith("layers.") else ("", "", name)
        prefix = f"model.layers.{layer}." if layer else ""
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if layer and rest == "moe.expert_bias_E" and family.startswith("qwen3"):
            continue
        if layer and rest in _EXPERTS:
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.{e}.{_EXPERTS[rest]}.weight"] = np.ascontiguousarray(value[e])
            continue
        top_level = rest in ("tok_embeddings.weight", "norm.weight", "lm_head.weight")
        target = _COMMON_RENAMES.get(rest) if top_level != bool(layer) and (not layer or layer.isdigit()) else None
        if target is None:
            raise ValueError(f"torchtitan_to_hf: unknown key {name!r}")
        if family == "llama" and rest.endswith(("wq.weight", "wk.weight")):
            value = _rope_to_half(value, heads if rest.endswith("wq.weight") else kv_heads, head_dim)
        out[prefix + target] = value
    return out


def check_sample(
    output_dir: str | os.PathLike[str],
    config: SampleConfig,
    comm: object | None = None,
    keep: Callable[[str, str], bool] | None = None,
) -> int:
    """Compare every tensor of a consolidated sample with its generated full value (split over ``comm``);
    returns how many tensors were compared, or raises InputError naming the first that differs.
    ``keep(name, dtype)``: only those tensors (a consolidation that left the others out).

    For the torchtitan kind this checks a *plain* consolidation (torchtitan's names, its row order);
    an adapter's output holds other names and rows, which this does not check: compare it with
    :func:`torchtitan_to_hf` of the full tensors instead."""
    from ..core.errors import InputError
    from ..core.safetensors_codec import Header, read_header

    specs = [s for s in tensor_specs(config) if keep is None or keep(s[0], s[1])]
    directory = os.fspath(output_dir)
    comm = as_communicator(comm)

    def work() -> None:
        index = os.path.join(directory, INDEX_NAME)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
        else:  # a single model.safetensors
            weight_map = {name: SINGLE_FILE_NAME for name, _, _, _, _ in specs}
        headers: dict[str, Header] = {}
        for name, dtype, shape, _, _ in specs[comm.rank :: comm.size]:
            path = os.path.join(directory, weight_map[name])
            header = headers.get(path) or headers.setdefault(path, read_header(path))
            entry = next(e for e in header.tensors if e.name == name)
            if entry.dtype != dtype or entry.shape != tuple(shape):
                raise InputError(f"{path}: tensor {name!r} is {entry.dtype}{list(entry.shape)}, expected {dtype}{list(shape)}")
            with open(path, "rb") as handle:
                handle.seek(header.data_start + entry.begin)
                data = handle.read(entry.end - entry.begin)
            if data != np.ascontiguousarray(full_tensor(config, name, dtype, shape)).tobytes():
                raise InputError(f"{path}: tensor {name!r} differs from the sample's value")

    agree(comm, work)
    return len(specs)
