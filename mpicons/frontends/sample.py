"""A built-in sample: a small Llama-shaped model saved the way torch's DCP saves it, in its Hugging
Face layout (``shard-*.safetensors``) or in its default format (``.metadata`` + ``__R_0.distcp``).

Training ranks form a ``dp × tp`` mesh. Tensors are cut the ways real trainers cut them:
rows over every rank (FSDP), nested rows (colwise TP + FSDP), a 2-D grid (rowwise TP + FSDP),
columns over every rank, a 3-D expert tensor cut along its last dim, replicated norms written
once, and small int/bool buffers with empty pieces. Data is deterministic per tensor name, so
the expected full tensors can be regenerated at any time (:func:`full_tensor`).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from collections.abc import Callable, Iterator
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
    #: over all ``dp × tp`` training ranks (FSDP), so pieces are many and small.
    kind: str = "llama"

    @property
    def world(self) -> int:
        return self.dp * self.tp

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

    return {
        "all_rows": all_rows,
        "nested_rows": nested_rows,
        "grid": grid,
        "all_cols": all_cols,
        "experts": experts,
        "norm": norm,
        "replicated": replicated,
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


def tensor_specs(c: SampleConfig) -> list[Spec]:
    """(name, dtype, full shape, placement, output file index from 1) for every tensor of the sample."""
    if c.kind == "moe":
        return _moe_specs(c)
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


def full_tensor(c: SampleConfig, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The sample's full value of tensor ``name`` (deterministic in the config's seed and the name)."""
    rng = np.random.default_rng([c.seed, zlib.crc32(name.encode())])
    count = int(np.prod(shape, dtype=np.int64))
    kind = DTYPE_BY_NAME[dtype]
    if dtype == "BOOL":
        values = rng.random(count, dtype=np.float32) < 0.5
    elif kind.is_float:
        values = ((rng.random(count, dtype=np.float32) - 0.5) * 0.2).astype(np.dtype(kind.numpy))
    else:
        info = np.iinfo(np.dtype(kind.numpy))
        values = rng.integers(info.min, info.max, count, dtype=np.dtype(kind.numpy), endpoint=True)
    return values.reshape(shape)


def _write_shard(path: str, pieces: list[tuple[str, str, np.ndarray, tuple[int, ...]]]) -> None:
    """One DCP shard file as torch writes it (through safetensors' serializer): tensors in the
    reference order (dtype alignment, then name), sharding info in the metadata."""
    pieces = sorted(pieces, key=lambda p: (DTYPE_ORDER[p[1]], p[0]))
    info = {name: {"saved_offsets": list(offsets)} for name, _, _, offsets in pieces}
    metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
    header, _ = build_header([(name, dtype, data.shape) for name, dtype, data, _ in pieces], metadata)
    with open(path, "wb") as handle:
        handle.write(header)
        for _, _, data, _ in pieces:
            handle.write(np.ascontiguousarray(data).tobytes())


def _pieces_of_file(
    c: SampleConfig, index: int, keep: Callable[[str, str], bool]
) -> Iterator[tuple[int, list[tuple[str, str, np.ndarray, tuple[int, ...]]]]]:
    placements = _placements(c)
    members = [s for s in tensor_specs(c) if s[4] == index and keep(s[0], s[1])]
    per_rank: dict[int, list[tuple[str, str, np.ndarray, tuple[int, ...]]]] = {r: [] for r in range(c.world)}
    for name, dtype, shape, placement, _ in members:
        full = full_tensor(c, name, dtype, shape)
        for dp in range(c.dp):
            for tp in range(c.tp):
                box = placements[placement](shape, dp, tp)
                if box is None:
                    continue
                offsets, size = box
                region = tuple(slice(o, o + s) for o, s in zip(offsets, size))
                per_rank[dp * c.tp + tp].append((name, dtype, full[region], offsets))
    yield from per_rank.items()


def write_sample(
    directory: str | os.PathLike[str],
    config: SampleConfig | None = None,
    comm: object | None = None,
    keep: Callable[[str, str], bool] | None = None,
    distcp: str | None = None,
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

    Returns the names of the files written.
    """
    c = config or SampleConfig()
    directory = os.fspath(directory)
    comm = as_communicator(comm) if comm is not None else None
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    chosen = keep or (lambda name, dtype: True)

    def work() -> list[ItemIndex]:
        os.makedirs(directory, exist_ok=True)
        if distcp is not None:
            return [_write_distcp_ranks(directory, c, range(rank, c.world, size), chosen, distcp)]
        for index in range(1 + rank, c.files + 1, size):
            for train_rank, pieces in _pieces_of_file(c, index, chosen):
                if pieces:
                    _write_shard(os.path.join(directory, shard_file_name(train_rank + 1, index, c.files)), pieces)
        return []

    items = work() if comm is None else [part for parts in agree(comm, work, gather=True) for part in parts]

    def write_metadata() -> None:  # written last, as DCP does
        everything = {key: value for part in items for key, value in part.items()}
        with open(os.path.join(directory, METADATA_NAME), "wb") as handle:
            handle.write(_metadata_pickle(c, chosen, everything))

    if distcp is not None:
        if comm is None:
            write_metadata()
        else:
            agree_on(comm, 0, write_metadata)
    return sorted(n for n in os.listdir(directory) if n.startswith(("shard-", "__", ".metadata")))


# ---------------------------------------------------------------- DCP's default format

NON_TENSOR_ENTRY = "train.step"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_LEGACY_STORAGE = {dtype: name for name, dtype in STORAGE_DTYPES.items()}


def _size(dims: tuple[int, ...]) -> Call:
    return Call(Global("torch", "Size"), (tuple(int(d) for d in dims),))


def _tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save`` of a contiguous tensor: legacy typed storages where torch uses them."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    stride = tuple(reversed(strides))
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


def _archive(data_pkl: bytes, data: bytes | None) -> bytes:
    """A ``torch.save`` zip archive: stored members under ``archive/``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        if data is not None:
            archive.writestr("archive/data/0", data)
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def _write_distcp_ranks(
    directory: str, c: SampleConfig, train_ranks: range, keep: Callable[[str, str], bool], serialization: str
) -> ItemIndex:
    """Write ``__R_0.distcp`` for training ranks ``train_ranks``; returns (name, chunk offsets) → (file, offset, length)."""
    if serialization not in ("torch_save", "safetensors"):
        raise ValueError(f"unknown serialization {serialization!r} (torch_save or safetensors)")
    placements = _placements(c)
    names = {r: f"__{r}_0.distcp" for r in train_ranks}
    handles = {r: open(os.path.join(directory, names[r]), "wb") for r in train_ranks}
    items: ItemIndex = {}
    blobs: dict[int, list[tuple[str, str, np.ndarray, tuple[int, ...]]]] = {r: [] for r in train_ranks}
    try:
        if 0 in handles:  # non-tensor items come first, as torch writes them
            archive = _archive(dumps(1000), None)
            items[(NON_TENSOR_ENTRY, None)] = (names[0], 0, len(archive), ())
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
    entries[NON_TENSOR_ENTRY] = Obj(cls("BytesStorageMetadata"))
    planner[NON_TENSOR_ENTRY] = (NON_TENSOR_ENTRY,)
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


def check_sample(output_dir: str | os.PathLike[str], config: SampleConfig, comm: object | None = None) -> int:
    """Compare every tensor of a consolidated sample with its generated full value (split over ``comm``);
    returns how many tensors were compared, or raises InputError naming the first that differs."""
    from ..core.errors import InputError
    from ..core.format import Header, read_header

    specs = tensor_specs(config)
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
