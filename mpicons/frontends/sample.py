"""A built-in sample: a small Llama-shaped model saved the way torch's DCP saves it, in its Hugging
Face layout (``shard-*.safetensors``) or in its default format (``.metadata`` + ``__R_0.distcp``).

Training ranks form a ``dp × tp`` mesh. Tensors are cut the ways real trainers cut them:
rows over every rank (FSDP), nested rows (colwise TP + FSDP), a 2-D grid (rowwise TP + FSDP),
columns over every rank, a 3-D expert tensor cut along its last dim, replicated norms written
once, and small int/bool buffers with empty pieces. Data is deterministic per tensor name, so
the expected full tensors can be regenerated at any time (:func:`full_tensor`).

The ``torchtitan`` kind is a llama3 (or, with experts, a qwen3_moe) model under torchtitan's own
state-dict names, as its checkpoint manager saves it between steps (DCP's default format, FSDP2
over ``dp`` and TP over ``tp``), optionally with optimizer state, and with the Hugging Face
config an adapter needs written beside it (:func:`write_hf_assets`); :func:`torchtitan_to_hf` is
what torchtitan's ``to_hf`` makes of its tensors, so a conversion can be checked.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 with numpy
import numpy as np

from ..comm import as_communicator
from ..comm.agreement import agree, agree_on
from ..core.distcp_items import STORAGE_DTYPES
from ..core.format import DTYPE_BY_NAME, DTYPE_ORDER, build_header
from ..core.headers import SHARDING_KEY
from ..core.names import INDEX_NAME, METADATA_NAME, SINGLE_FILE_NAME, output_name, shard_file_name
from ._pickling import Call, Global, Obj, PersistentId, dumps

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)
#: (tensor name, chunk offsets; None for a non-tensor entry) → (data file, item offset, item length, chunk size)
ItemIndex = dict[tuple[str, "tuple[int, ...] | None"], tuple[str, int, int, tuple[int, ...]]]


@dataclass(frozen=True)
class SampleConfig:
    """Model and mesh sizes of the sample; ``scale`` multiplies the matrix sizes."""

    layers: int = 4
    hidden: int = 96
    intermediate: int = 248
    vocab: int = 1003
    kv_dim: int = 24
    experts: int = 4
    dp: int = 2
    tp: int = 2
    files: int = 2
    dtype: str = "BF16"
    seed: int = 0
    #: ``"llama"``: the dense model above; ``"moe"``: many small expert tensors, every one cut by rows
    #: over all ``dp × tp`` training ranks (FSDP), so pieces are many and small; ``"torchtitan"``:
    #: torchtitan's native names and layouts (llama3, or qwen3_moe when ``experts`` > 0).
    kind: str = "llama"
    #: torchtitan kind: rows per attention head (``hidden`` is a multiple of it).
    head_dim: int = 64
    #: torchtitan kind: key/value heads (0: a quarter of the query heads, at least 1).
    kv_heads: int = 0
    #: torchtitan kind: an ``optimizer.state.<parameter>.exp_avg`` beside every parameter.
    optimizer: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def n_heads(self) -> int:
        """Query heads of the torchtitan kind."""
        return self.hidden // self.head_dim

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads of the torchtitan kind."""
        return self.kv_heads or max(1, self.n_heads // 4)

    @classmethod
    def torchtitan(
        cls, target_bytes: int, experts: int = 0, layers: int = 8, vocab: int = 16384, head_dim: int = 64, **kwargs: Any
    ) -> SampleConfig:
        """A torchtitan-native llama3 (qwen3_moe with ``experts``) of at least ``target_bytes`` of model
        tensors: ``hidden`` grown by whole groups of heads (4 query heads per key/value head unless
        ``kv_heads`` says otherwise); FSDP2 over 3 ranks inside TP over 2 by default, so row pieces
        end inside heads, even inside a rotary pair."""
        fields: dict[str, Any] = {
            "layers": layers, "vocab": vocab, "head_dim": head_dim, "experts": experts, "dp": 3, "tp": 2,
            "files": 1, "dtype": "BF16", "kind": "torchtitan",
        }  # fmt: skip
        fields.update(kwargs)

        def sized(hidden: int) -> SampleConfig:
            ffn = hidden * 8 // 3 // 64 * 64 if not experts else max(64, hidden // 2 // 64 * 64)
            return cls(**{"hidden": hidden, "intermediate": ffn, **fields})

        step = head_dim * (fields.get("kv_heads") or 4)  # whole groups of query heads per key/value head
        hidden = step
        while _model_bytes(sized(hidden)) < target_bytes and hidden < 1 << 16:
            hidden += step
        return sized(hidden)

    @classmethod
    def moe(cls, target_bytes: int, training_ranks: int = 64, layers: int = 24, hidden: int = 128, **kwargs: Any) -> SampleConfig:
        """A mixture-of-experts shape of about ``target_bytes``: ``layers`` × (attention, norms, router,
        ``experts`` × gate/up/down of hidden × hidden, fp16), every tensor cut by rows over ``training_ranks``."""
        per_expert = 3 * hidden * hidden * 2
        experts = max(1, round((target_bytes / layers - 4 * hidden * hidden * 2) / per_expert))
        fields: dict[str, Any] = {
            "layers": layers, "hidden": hidden, "intermediate": hidden, "kv_dim": hidden, "experts": experts,
            "dp": training_ranks, "tp": 1, "files": 1, "dtype": "F16", "vocab": hidden, "kind": "moe",
        }  # fmt: skip
        return cls(**{**fields, **kwargs})

    @classmethod
    def sized(cls, target_bytes: int, **kwargs: Any) -> SampleConfig:
        """A config whose checkpoint is roughly ``target_bytes`` (hidden size grown to fit)."""
        base = cls(**kwargs)
        per_layer_unit = 4 * base.hidden * base.hidden + 3 * base.hidden * base.intermediate
        factor = max(1.0, (target_bytes / 2 / max(1, base.layers * per_layer_unit)) ** 0.5)
        hidden = int(base.hidden * factor) // 8 * 8
        return cls(**{**kwargs, "hidden": hidden, "intermediate": int(hidden * 8 / 3) // 8 * 8 + 8, "kv_dim": hidden // 4})


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's piece ``index`` of ``size`` in ``parts``: (start, length), possibly empty."""
    step = -(-size // parts) if size else 0
    start = min(size, index * step)
    return start, min(size, start + step) - start


def _rows(parts_of: Callable[[int, int], tuple[int, int]]) -> Callable[[tuple[int, ...], int, int], Box | None]:
    def place(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        start, length = parts_of(dp, tp)
        return (start,) + (0,) * (len(shape) - 1), (length,) + shape[1:]

    return place


def _placements(c: SampleConfig) -> dict[str, Callable[[tuple[int, ...], int, int], Box | None]]:
    """How each kind of tensor is cut: (shape, dp rank, tp rank) → the piece that rank saves."""

    def all_rows(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        start, length = _chunk(shape[0], c.world, dp * c.tp + tp)
        return (start,) + (0,) * (len(shape) - 1), (length,) + shape[1:]

    def nested_rows(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        outer, outer_len = _chunk(shape[0], c.tp, tp)
        inner, length = _chunk(outer_len, c.dp, dp)
        return (outer + inner, 0), (length, shape[1])

    def grid(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        row, rows = _chunk(shape[0], c.dp, dp)
        col, cols = _chunk(shape[1], c.tp, tp)
        return (row, col), (rows, cols)

    def all_cols(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        col, cols = _chunk(shape[1], c.world, dp * c.tp + tp)
        return (0, col), (shape[0], cols)

    def experts(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        row, rows = _chunk(shape[0], c.dp, dp)
        last, lasts = _chunk(shape[2], c.tp, tp)
        return (row, 0, last), (rows, shape[1], lasts)

    def norm(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        if tp:  # replicated over tp: saved once
            return None
        start, length = _chunk(shape[0], c.dp, dp)
        return (start,), (length,)

    def replicated(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        return ((0,) * len(shape), shape) if dp == 0 and tp == 0 else None

    def fsdp(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        """FSDP2 rows over ``dp``, replicated over ``tp`` (saved once): norms, routers, any rank."""
        if tp:
            return None
        start, length = _chunk(shape[0], c.dp, dp)
        return (start,) + (0,) * (len(shape) - 1), (length,) + shape[1:]

    def experts_mid(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        """Grouped experts [E, F, D] (colwise TP on F): experts over ``dp``, F over ``tp``."""
        row, rows = _chunk(shape[0], c.dp, dp)
        mid, mids = _chunk(shape[1], c.tp, tp)
        return (row, mid, 0), (rows, mids, shape[2])

    return {
        "all_rows": all_rows,
        "nested_rows": nested_rows,
        "grid": grid,
        "all_cols": all_cols,
        "experts": experts,
        "norm": norm,
        "replicated": replicated,
        "fsdp": fsdp,
        "experts_mid": experts_mid,
    }


#: (name, dtype, full shape, placement, output file index from 1)
Spec = tuple[str, str, tuple[int, ...], str, int]


def _moe_specs(c: SampleConfig) -> list[Spec]:
    specs: list[Spec] = []
    for layer in range(c.layers):
        index = 1 + layer * c.files // c.layers
        p = f"model.layers.{layer}."
        specs += [(p + f"self_attn.{m}_proj.weight", c.dtype, (c.hidden, c.hidden), "all_rows", index) for m in "qkvo"]
        specs += [
            (p + n, "F32", (c.hidden,), "all_rows", index) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
        ]
        specs.append((p + "mlp.gate.weight", c.dtype, (c.experts, c.hidden), "all_rows", index))
        for e in range(c.experts):
            q = f"{p}mlp.experts.{e}."
            specs += [
                (q + "gate_proj.weight", c.dtype, (c.intermediate, c.hidden), "all_rows", index),
                (q + "up_proj.weight", c.dtype, (c.intermediate, c.hidden), "all_rows", index),
                (q + "down_proj.weight", c.dtype, (c.hidden, c.intermediate), "all_rows", index),
            ]
    return specs


#: The training state groups torchtitan saves beside the model (only ``optimizer.*`` holds tensors).
TORCHTITAN_NON_MODEL = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


def _torchtitan_specs(c: SampleConfig) -> list[Spec]:
    """torchtitan's native state dict: the model keys (split q/k/v, as ``_split_qkv_on_save`` saves
    them), then with ``optimizer`` an ``exp_avg`` per parameter, keyed as torchtitan keys it (the fused
    ``qkv_linear.wqkv``; no state for the ``expert_bias_E`` buffer). TP cuts colwise layers by rows and
    rowwise ones by columns; FSDP2 cuts every parameter by rows within that."""
    if c.hidden % c.head_dim or c.n_heads % c.n_kv_heads or c.head_dim % 2:
        raise ValueError(
            f"torchtitan sample: hidden {c.hidden} must be a multiple of an even head_dim {c.head_dim}, and its "
            f"{c.n_heads} heads a multiple of {c.n_kv_heads} key/value heads"
        )
    hd, kv, f = c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate
    model: list[Spec] = [("tok_embeddings.weight", c.dtype, (c.vocab, c.hidden), "nested_rows", 1)]
    params: list[Spec] = list(model)
    for layer in range(c.layers):
        p = f"layers.{layer}."
        qkv = [
            (p + "attention.qkv_linear.wq.weight", c.dtype, (c.hidden, c.hidden), "nested_rows", 1),
            (p + "attention.qkv_linear.wk.weight", c.dtype, (kv, c.hidden), "nested_rows", 1),
            (p + "attention.qkv_linear.wv.weight", c.dtype, (kv, c.hidden), "nested_rows", 1),
        ]
        rest: list[Spec] = [(p + "attention.wo.weight", c.dtype, (c.hidden, c.hidden), "grid", 1)]
        if c.experts:
            e = c.experts
            rest += [
                (p + "attention.q_norm.weight", "F32", (hd,), "fsdp", 1),
                (p + "attention.k_norm.weight", "F32", (hd,), "fsdp", 1),
                (p + "moe.router.gate.weight", c.dtype, (e, c.hidden), "fsdp", 1),
                (p + "moe.routed_experts.inner_experts.w1_EFD", c.dtype, (e, f, c.hidden), "experts_mid", 1),
                (p + "moe.routed_experts.inner_experts.w2_EDF", c.dtype, (e, c.hidden, f), "experts", 1),
                (p + "moe.routed_experts.inner_experts.w3_EFD", c.dtype, (e, f, c.hidden), "experts_mid", 1),
            ]
        else:
            rest += [
                (p + "feed_forward.w1.weight", c.dtype, (f, c.hidden), "nested_rows", 1),
                (p + "feed_forward.w2.weight", c.dtype, (c.hidden, f), "grid", 1),
                (p + "feed_forward.w3.weight", c.dtype, (f, c.hidden), "nested_rows", 1),
            ]
        norms: list[Spec] = [
            (p + "attention_norm.weight", "F32", (c.hidden,), "fsdp", 1),
            (p + "ffn_norm.weight", "F32", (c.hidden,), "fsdp", 1),
        ]
        buffers: list[Spec] = [(p + "moe.expert_bias_E", "F32", (c.experts,), "replicated", 1)] if c.experts else []
        model += qkv + rest + norms + buffers
        fused = (p + "attention.qkv_linear.wqkv.weight", c.dtype, (c.hidden + 2 * kv, c.hidden), "nested_rows", 1)
        params += [fused, *rest, *norms]
    tail: list[Spec] = [
        ("norm.weight", "F32", (c.hidden,), "fsdp", 1),
        ("lm_head.weight", c.dtype, (c.vocab, c.hidden), "nested_rows", 1),
    ]
    model += tail
    params += tail
    if not c.optimizer:
        return model
    return model + [(f"optimizer.state.{name}.exp_avg", dtype, shape, cut, 1) for name, dtype, shape, cut, _ in params]


def _model_bytes(c: SampleConfig) -> int:
    """Bytes of the model tensors (optimizer state aside)."""
    return sum(
        int(np.prod(shape, dtype=np.int64)) * DTYPE_BY_NAME[dtype].bits // 8
        for name, dtype, shape, _, _ in tensor_specs(c)
        if not name.startswith(TORCHTITAN_NON_MODEL)
    )


def tensor_specs(c: SampleConfig) -> list[Spec]:
    """(name, dtype, full shape, placement, output file index from 1) for every tensor of the sample."""
    if c.kind == "moe":
        return _moe_specs(c)
    if c.kind == "torchtitan":
        return _torchtitan_specs(c)
    specs: list[Spec] = [("model.embed_tokens.weight", c.dtype, (c.vocab, c.hidden), "all_rows", 1)]
    for layer in range(c.layers):
        index = 1 + layer * c.files // c.layers
        p = f"model.layers.{layer}."
        specs += [
            (p + "self_attn.q_proj.weight", c.dtype, (c.hidden, c.hidden), "nested_rows", index),
            (p + "self_attn.k_proj.weight", c.dtype, (c.kv_dim, c.hidden), "nested_rows", index),
            (p + "self_attn.v_proj.weight", c.dtype, (c.kv_dim, c.hidden), "nested_rows", index),
            (p + "self_attn.o_proj.weight", c.dtype, (c.hidden, c.hidden), "grid", index),
            (p + "mlp.gate_proj.weight", c.dtype, (c.intermediate, c.hidden), "nested_rows", index),
            (p + "mlp.up_proj.weight", c.dtype, (c.intermediate, c.hidden), "nested_rows", index),
            (p + "mlp.down_proj.weight", c.dtype, (c.hidden, c.intermediate), "grid", index),
            (p + "input_layernorm.weight", "F32", (c.hidden,), "norm", index),
            (p + "post_attention_layernorm.weight", "F32", (c.hidden,), "norm", index),
        ]
    last = c.files
    specs += [
        ("model.norm.weight", "F32", (c.hidden,), "norm", last),
        ("lm_head.weight", c.dtype, (c.vocab, c.hidden), "all_cols", last),
        ("moe.experts.w1", "F16", (c.experts, c.hidden // 2, 11), "experts", last),
        ("moe.router.bias", "F64", (c.experts,), "replicated", last),
        ("buffers.step", "I64", (c.world - 1,), "all_rows", 1),
        ("buffers.position_ids", "I32", (1, 64), "replicated", 1),
        ("buffers.token_mask", "BOOL", (c.world + 1,), "all_rows", last),
        ("buffers.codes", "U8", (3, 5), "grid", last),
    ]
    return specs


#: Elements drawn at a time for a floating-point tensor: the float32 draws and their arithmetic stay
#: this size, so a 2 GB tensor needs its own 2 GB, not four times it (the stream is the same in chunks).
_DRAW = 1 << 24


def full_tensor(c: SampleConfig, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The sample's full value of tensor ``name`` (deterministic in the config's seed and the name)."""
    rng = np.random.default_rng([c.seed, zlib.crc32(name.encode())])
    count = int(np.prod(shape, dtype=np.int64))
    kind = DTYPE_BY_NAME[dtype]
    if dtype == "BOOL" or kind.is_float:
        values = np.empty(count, dtype=bool if dtype == "BOOL" else np.dtype(kind.numpy))
        for start in range(0, count, _DRAW):
            drawn = rng.random(min(_DRAW, count - start), dtype=np.float32)
            values[start : start + len(drawn)] = drawn < 0.5 if dtype == "BOOL" else ((drawn - 0.5) * 0.2).astype(values.dtype)
    else:
        info = np.iinfo(np.dtype(kind.numpy))
        values = rng.integers(info.min, info.max, count, dtype=np.dtype(kind.numpy), endpoint=True)
    return values.reshape(shape)


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
    placements = _placements(c)
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
    placements = _placements(c)
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
        if c.kind != "torchtitan":
            raise ValueError(f"assets_dir is for the torchtitan kind, not {c.kind!r}")
        inside = os.path.relpath(os.path.abspath(assets_dir), os.path.abspath(directory))
        if inside == os.curdir or not inside.startswith(os.pardir):
            raise ValueError(f"assets_dir {os.fspath(assets_dir)!r} must lie beside the checkpoint {directory!r}, not in it")
    comm = as_communicator(comm) if comm is not None else None
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    chosen = keep or (lambda name, dtype: True)
    mode = "xb" if exclusive else "wb"

    def work() -> list[ItemIndex]:
        os.makedirs(directory, exist_ok=True)
        if distcp is not None:
            return [_write_distcp_ranks(directory, c, range(rank, c.world, size), chosen, distcp, mode)]
        for index in range(1 + rank, c.files + 1, size):
            _write_file_index(directory, c, index, chosen, mode)
        return []

    items = work() if comm is None else [part for parts in agree(comm, work, gather=True) for part in parts]

    def write_metadata() -> None:  # written last, as DCP does
        everything = {key: value for part in items for key, value in part.items()}
        with open(os.path.join(directory, METADATA_NAME), mode) as handle:
            handle.write(_metadata_pickle(c, chosen, everything))

    if distcp is not None:
        if comm is None:
            write_metadata()
        else:
            agree_on(comm, 0, write_metadata)
    if assets_dir is not None:
        target = assets_dir
        if comm is None:
            write_hf_assets(target, c)
        else:
            agree_on(comm, 0, lambda: write_hf_assets(target, c))
    return sorted(n for n in os.listdir(directory) if n.startswith(("shard-", "__", ".metadata")))


# ---------------------------------------------------------------- DCP's default format

NON_TENSOR_ENTRY = "train.step"
#: torchtitan's own name for it (its ``train_state`` group).
TORCHTITAN_NON_TENSOR_ENTRY = "train_state.step"


def non_tensor_entry(c: SampleConfig) -> str:
    """The name of the sample's one non-tensor (bytes) entry."""
    return TORCHTITAN_NON_TENSOR_ENTRY if c.kind == "torchtitan" else NON_TENSOR_ENTRY


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_LEGACY_STORAGE = {dtype: name for name, dtype in STORAGE_DTYPES.items()}


def _size(dims: tuple[int, ...]) -> Call:
    return Call(Global("torch", "Size"), (tuple(int(d) for d in dims),))


def _tensor_pickle(dtype: str, shape: tuple[int, ...], stride: tuple[int, ...] | None = None, numel: int | None = None) -> bytes:
    """``data.pkl`` of ``torch.save`` of a tensor: legacy typed storages where torch uses them.

    ``stride`` (default: row-major) and ``numel``, the storage's elements (default: the tensor's), write
    what torch writes for views, e.g. a tensor with no elements keeps the strides it had."""
    if stride is None:
        strides, step = [], 1
        for dim in reversed(shape):
            strides.append(step)
            step *= dim
        stride = tuple(reversed(strides))
    if numel is None:
        numel = int(np.prod(shape, dtype=np.int64))
    hooks = Call(Global("collections", "OrderedDict"))
    legacy = _LEGACY_STORAGE.get(dtype)
    if legacy is not None:
        storage = PersistentId(("storage", Global("torch", legacy), "0", "cpu", numel))
        return dumps(Call(Global("torch._utils", "_rebuild_tensor_v2"), (storage, 0, tuple(shape), stride, False, hooks)))
    storage = PersistentId(
        ("storage", Global("torch.storage", "UntypedStorage"), "0", "cpu", numel * DTYPE_BY_NAME[dtype].bits // 8)
    )
    dtype_global = Global("torch", str(DTYPE_BY_NAME[dtype].torch))
    return dumps(
        Call(Global("torch._utils", "_rebuild_tensor_v3"), (storage, 0, tuple(shape), stride, False, hooks, dtype_global))
    )


def _archive(data_pkl: bytes, data: bytes | None, folder: str = "archive") -> bytes:
    """A ``torch.save`` zip archive: stored members under ``folder/`` (torch.save names it after the
    file it writes, e.g. ``common/`` for ``common.pt``; DCP's items use ``archive/``)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{folder}/data.pkl", data_pkl)
        archive.writestr(f"{folder}/byteorder", "little")
        if data is not None:
            archive.writestr(f"{folder}/data/0", data)
        archive.writestr(f"{folder}/version", "3\n")
    return buffer.getvalue()


def _write_distcp_ranks(
    directory: str, c: SampleConfig, train_ranks: range, keep: Callable[[str, str], bool], serialization: str, mode: str = "wb"
) -> ItemIndex:
    """Write ``__R_0.distcp`` for training ranks ``train_ranks``; returns (name, chunk offsets) → (file, offset, length)."""
    if serialization not in ("torch_save", "safetensors"):
        raise ValueError(f"unknown serialization {serialization!r} (torch_save or safetensors)")
    placements = _placements(c)
    names = {r: f"__{r}_0.distcp" for r in train_ranks}
    handles: dict[int, Any] = {}
    try:
        for r in train_ranks:
            handles[r] = open(os.path.join(directory, names[r]), mode)
    except BaseException:
        for handle in handles.values():
            handle.close()
        raise
    items: ItemIndex = {}
    blobs: dict[int, list[tuple[str, str, np.ndarray, tuple[int, ...]]]] = {r: [] for r in train_ranks}
    try:
        if 0 in handles:  # non-tensor items come first, as torch writes them
            archive = _archive(dumps(1000), None)
            items[(non_tensor_entry(c), None)] = (names[0], 0, len(archive), ())
            handles[0].write(archive)
        for name, dtype, shape, placement, _ in tensor_specs(c):
            if not keep(name, dtype):
                continue
            full = full_tensor(c, name, dtype, shape)
            for r in train_ranks:
                box = placements[placement](shape, r // c.tp, r % c.tp)
                if box is None:
                    continue
                offsets, size = box
                piece = np.ascontiguousarray(full[tuple(slice(o, o + n) for o, n in zip(offsets, size))])
                if serialization == "safetensors":
                    blobs[r].append((name, dtype, piece, offsets))
                    continue
                archive = _archive(_tensor_pickle(dtype, tuple(size)), piece.tobytes())
                items[(name, tuple(offsets))] = (names[r], handles[r].tell(), len(archive), tuple(size))
                handles[r].write(archive)
        for r, pieces in blobs.items():  # DCP's safetensors serialization: one blob per file, after the items
            start = handles[r].tell()
            for name, _, piece, offsets in pieces:
                items[(name, tuple(offsets))] = (names[r], start, piece.nbytes, piece.shape)
            if pieces:
                _write_blob(handles[r], pieces)
    finally:
        for handle in handles.values():
            handle.close()
    return items


def _write_blob(handle: Any, pieces: list[tuple[str, str, np.ndarray, tuple[int, ...]]]) -> None:
    pieces = sorted(pieces, key=lambda p: (DTYPE_ORDER[p[1]], p[0]))
    info = {name: {"saved_offsets": list(offsets)} for name, _, _, offsets in pieces}
    metadata = {SHARDING_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
    header, _ = build_header([(name, dtype, data.shape) for name, dtype, data, _ in pieces], metadata)
    handle.write(header)
    for _, _, data, _ in pieces:
        handle.write(data.tobytes())


def _metadata_pickle(
    c: SampleConfig,
    keep: Callable[[str, str], bool],
    items: ItemIndex,
) -> bytes:
    """DCP's ``Metadata`` for the items written, as torch pickles it."""

    def cls(name: str, module: str = _METADATA_MODULE) -> Global:
        return Global(module, name)

    entries: dict[str, object] = {}
    planner: dict[str, object] = {}
    storage: dict[object, object] = {}
    specs = [s for s in tensor_specs(c) if keep(s[0], s[1])]
    chunks_of: dict[str, list[tuple[int, ...]]] = {}
    for name, chunk in sorted(items, key=lambda key: (key[0], key[1] or ())):
        if chunk is not None:
            chunks_of.setdefault(name, []).append(chunk)
    for name, dtype, shape, _, _ in specs:
        boxes = [
            Obj(cls("ChunkStorageMetadata"), {"offsets": _size(offsets), "sizes": _size(items[(name, offsets)][3])})
            for offsets in chunks_of.get(name, [])
        ]
        layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
        memory = Call(cls("_MEM_FORMAT_ENCODING"), (0,))
        torch_dtype = Global("torch", str(DTYPE_BY_NAME[dtype].torch))
        properties = Obj(cls("TensorProperties"), (torch_dtype, layout, False, memory, False))
        entries[name] = Obj(cls("TensorStorageMetadata"), {"properties": properties, "size": _size(shape), "chunks": boxes})
        planner[name] = (name,)
    entries[non_tensor_entry(c)] = Obj(cls("BytesStorageMetadata"))
    planner[non_tensor_entry(c)] = (non_tensor_entry(c),)
    for (name, chunk), (file, offset, length, _) in sorted(items.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())):
        key = Obj(cls("MetadataIndex"), {"fqn": name, "offset": None if chunk is None else _size(chunk), "index": 0})
        info = Obj(
            cls("_StorageInfo", "torch.distributed.checkpoint.filesystem"),
            {"relative_path": file, "offset": offset, "length": length},
        )
        storage[key] = info
    return dumps(
        Obj(
            cls("Metadata"),
            {
                "state_dict_metadata": entries,
                "planner_data": planner,
                "storage_data": storage,
                "storage_meta": None,
                "version": "1.0.0",
            },
        )
    )


def expected_mapping(c: SampleConfig) -> dict[str, str]:
    """Tensor → output file name the consolidation of the sample must produce."""
    return {name: output_name(index, c.files) for name, _, _, _, index in tensor_specs(c)}


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
    from ..core.format import Header, read_header

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
