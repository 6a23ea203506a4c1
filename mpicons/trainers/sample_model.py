"""What the built-in sample holds (pure, no I/O): the model and mesh (:class:`SampleConfig`), every
tensor's name, dtype, shape and the way training ranks cut it (:func:`tensor_specs`), and its
deterministic values (:func:`full_tensor`), so the expected full tensors can be made again at any time.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 with numpy
import numpy as np

from ..core.names import output_name
from ..core.safetensors_codec import DTYPE_BY_NAME

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


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's piece ``index`` of ``size`` in ``parts``: (start, length), possibly empty."""
    step = -(-size // parts) if size else 0
    start = min(size, index * step)
    return start, min(size, start + step) - start


def _rows(parts_of: Callable[[int, int], tuple[int, int]]) -> Callable[[tuple[int, ...], int, int], Box | None]:
    def place(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        start, length = parts_of(dp, tp)
        return (start,) + (0,) * (len(shape) - 1), (length,) + shape[1:]

    return place


def placements_of(c: SampleConfig) -> dict[str, Callable[[tuple[int, ...], int, int], Box | None]]:
    """How each kind of tensor is cut: (shape, dp rank, tp rank) → the piece that rank saves."""

    def all_rows(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        start, length = chunk_bounds(shape[0], c.world, dp * c.tp + tp)
        return (start,) + (0,) * (len(shape) - 1), (length,) + shape[1:]

    def nested_rows(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        outer, outer_len = chunk_bounds(shape[0], c.tp, tp)
        inner, length = chunk_bounds(outer_len, c.dp, dp)
        return (outer + inner, 0), (length, shape[1])

    def grid(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        row, rows = chunk_bounds(shape[0], c.dp, dp)
        col, cols = chunk_bounds(shape[1], c.tp, tp)
        return (row, col), (rows, cols)

    def all_cols(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        col, cols = chunk_bounds(shape[1], c.world, dp * c.tp + tp)
        return (0, col), (shape[0], cols)

    def experts(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        row, rows = chunk_bounds(shape[0], c.dp, dp)
        last, lasts = chunk_bounds(shape[2], c.tp, tp)
        return (row, 0, last), (rows, shape[1], lasts)

    def norm(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        if tp:  # replicated over tp: saved once
            return None
        start, length = chunk_bounds(shape[0], c.dp, dp)
        return (start,), (length,)

    def replicated(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        return ((0,) * len(shape), shape) if dp == 0 and tp == 0 else None

    def fsdp(shape: tuple[int, ...], dp: int, tp: int) -> Box | None:
        """FSDP2 rows over ``dp``, replicated over ``tp`` (saved once): norms, routers, any rank."""
        if tp:
            return None
        start, length = chunk_bounds(shape[0], c.dp, dp)
        return (start,) + (0,) * (len(shape) - 1), (length,) + shape[1:]

    def experts_mid(shape: tuple[int, ...], dp: int, tp: int) -> Box:
        """Grouped experts [E, F, D] (colwise TP on F): experts over ``dp``, F over ``tp``."""
        row, rows = chunk_bounds(shape[0], c.dp, dp)
        mid, mids = chunk_bounds(shape[1], c.tp, tp)
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


NON_TENSOR_ENTRY = "train.step"
#: torchtitan's own name for it (its ``train_state`` group).
TORCHTITAN_NON_TENSOR_ENTRY = "train_state.step"


def non_tensor_entry(c: SampleConfig) -> str:
    """The name of the sample's one non-tensor (bytes) entry."""
    return TORCHTITAN_NON_TENSOR_ENTRY if c.kind == "torchtitan" else NON_TENSOR_ENTRY


def expected_mapping(c: SampleConfig) -> dict[str, str]:
    """Tensor → output file name the consolidation of the sample must produce."""
    return {name: output_name(index, c.files) for name, _, _, _, index in tensor_specs(c)}
