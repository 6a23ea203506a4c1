"""DCP's ``.metadata`` read without torch (no MPI here): a pickle of DCP's ``Metadata`` turned into columns.

``.metadata`` holds, per tensor, its dtype, full size and stored chunks, and per chunk the (file,
offset, length) of the item holding it. It is read by a restricted unpickler that knows DCP's
metadata classes, ``torch.Size``, torch dtypes and the few helpers the pickle names, each replaced
by an inert stand-in; any other name is refused before anything of the pickle runs. Non-tensor
entries (``BytesStorageMetadata``: step counters, data-loader state) are skipped and listed. Classes
a trainer adds (Megatron's ``all_local_plans``) are read only when the caller allows them, as records
nothing here looks at. The facts this relies on are in docs/distcp-format.md.
"""

from __future__ import annotations

import gc
import itertools
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from ..core.errors import InputError
from ..core.safetensors_codec import DTYPE_BY_NAME, DTYPE_ORDER, MAX_DIM, MAX_NDIM
from .byte_sources import ByteSource, opened
from .unpickling import (
    NOTHING,
    AllowList,
    Budget,
    Record,
    Refused,
    RestrictedUnpickler,
    TorchDType,
    record_class,
    shown,
    unpickle,
)

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


_RECORDS = {
    (module, name): record_class(name)
    for module, names in (
        (
            _METADATA_MODULE,
            (
                "Metadata",
                "TensorStorageMetadata",
                "TensorProperties",
                "ChunkStorageMetadata",
                "BytesStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
            ),
        ),
        ("torch.distributed.checkpoint.filesystem", ("_StorageInfo",)),
    )
    for name in names
}


def _size(budget: Budget, dims: object = ()) -> tuple[int, ...]:
    """``torch.Size(dims)``: a tuple (its items are checked in bulk when the columns are made)."""
    if type(dims) is tuple or type(dims) is list:
        if len(dims) > MAX_NDIM:
            raise pickle.UnpicklingError(f"torch.Size of {len(dims)} dimensions (mpicons reads at most {MAX_NDIM})")
        budget.spend(len(dims))
        return tuple(dims)
    raise pickle.UnpicklingError(f"torch.Size of a {type(dims).__name__}")


def _text(budget: Budget, *parts: object) -> str:
    """``PosixPath(...)``, ``_get_layout(...)``: kept as text."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("expected text")
    texts = [str(p) for p in parts]
    budget.spend(sum(map(len, texts)))
    return "/".join(texts)


def _enum_value(budget: Budget, value: object) -> object:
    """``_MEM_FORMAT_ENCODING(n)``: the number."""
    if type(value) is not int:
        raise pickle.UnpicklingError(f"memory format {shown(value)}")
    return value


_METADATA_FUNCTIONS: dict[tuple[str, str], Callable[..., object]] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _text,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _enum_value,
    **{("pathlib", name): _text for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
}


class _MetadataUnpickler(RestrictedUnpickler):
    """Unpickles DCP's ``Metadata`` into stand-ins; refuses every other global (nothing it names is imported)."""

    functions = _METADATA_FUNCTIONS
    others = dict(_RECORDS)

    def persistent_load(self, pid: object) -> Any:
        raise Refused("a persistent id")


@dataclass
class DistcpTable:
    """What ``.metadata`` says, as columns: tensors sorted by name, one row per stored piece.

    Shapes and offsets are padded to a common width with 1s / 0s like :class:`~mpicons.table.Pieces`.
    """

    names: list[str]  # tensor names, sorted
    order: np.ndarray  # int64[T]: position in the state dict (the order a trainer saved them in)
    dtype: np.ndarray  # int8[T], index into format.DTYPES
    size: np.ndarray  # int64[T, W]: the full shape, padded with 1s
    ndim: np.ndarray  # int8[T]
    skipped: list[str]  # non-tensor entries, sorted
    files: list[str]  # the data files pieces are in, sorted
    tensor: np.ndarray  # int32[P]
    file: np.ndarray  # int32[P], into ``files``
    shape: np.ndarray  # int64[P, W]
    offset: np.ndarray  # int64[P, W]
    item_offset: np.ndarray  # int64[P]
    item_length: np.ndarray  # int64[P]


def _bad_metadata(path: str, what: str) -> InputError:
    return InputError(f"{path}: not DCP checkpoint metadata: {what}")


def _fields(record: object, kind: str, path: str) -> dict[str, Any]:
    if not isinstance(record, Record) or record.kind != kind or not isinstance(getattr(record, "state", None), dict):
        raise _bad_metadata(path, f"expected a {kind}, found {type(record).__name__}")
    return record.state  # type: ignore[return-value]


def _dtype_of(properties: object, name: str, path: str) -> str:
    """The safetensors dtype of a ``TensorProperties`` (pickled as a tuple, or as a field dict)."""
    state = getattr(properties, "state", None) if isinstance(properties, Record) else None
    if isinstance(state, tuple) and len(state) >= 2:
        dtype, layout = state[0], state[1]
    elif isinstance(state, dict):
        dtype, layout = state.get("dtype"), state.get("layout", "torch.strided")
    else:
        raise _bad_metadata(path, f"tensor {name!r} has no properties")
    if not isinstance(dtype, TorchDType):
        raise InputError(f"{path}: tensor {name!r}: unsupported dtype {shown(dtype)} (safetensors cannot hold it)")
    if layout != "torch.strided":
        raise InputError(f"{path}: tensor {name!r}: unsupported layout {shown(layout)} (only dense tensors)")
    return dtype.name


def _storage_index(storage_data: object, path: str) -> dict[tuple[str, tuple[int, ...]], tuple[str, int, int]]:
    """(tensor name, chunk offsets) → (data file, item offset, item length); non-tensor items left out."""
    if not isinstance(storage_data, dict):
        raise _bad_metadata(path, "storage_data is not a map")
    index = {}
    for key, value in storage_data.items():
        where, info = _fields(key, "MetadataIndex", path), _fields(value, "_StorageInfo", path)
        if where.get("offset") is None:
            continue  # a non-tensor item
        fqn, offsets = where.get("fqn"), where.get("offset")
        file, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if type(fqn) is not str or not _is_box(offsets):
            raise _bad_metadata(path, f"storage key {shown(where)}")
        if not (type(file) is str and type(offset) is int and type(length) is int and 0 <= offset < MAX_DIM - length <= MAX_DIM):
            raise _bad_metadata(
                path,
                f"storage entry of tensor {fqn!r} at {list(offsets)}: {shown(info)} "
                "(expected a file name and a non-negative offset and length whose sum is below 2**63)",
            )
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            raise InputError(f"{path}: tensor {fqn!r}: data file {file!r} is not a file name inside the checkpoint directory")
        if info.get("transform_descriptors"):
            raise InputError(
                f"{path}: tensor {fqn!r}: unsupported: stored through stream transforms {shown(info['transform_descriptors'])} "
                "(a compression extension); save without it"
            )
        index[(fqn, offsets)] = (file, offset, length)
    return index


def _padded(rows: Sequence[tuple[int, ...]], width: int, fill: int, path: str, what: str) -> np.ndarray:
    """Ragged tuples of non-negative ints as an int64 array padded with ``fill`` (checked in bulk)."""
    flat = list(itertools.chain.from_iterable(rows))
    if not set(map(type, flat)) <= {int} or (flat and not 0 <= min(flat) <= max(flat) < MAX_DIM):
        bad = next(row for row in rows if not all(type(v) is int and 0 <= v < MAX_DIM for v in row))
        raise _bad_metadata(path, f"{what} {shown(bad)} is not a tuple of non-negative 64-bit integers")
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), width), fill, dtype=np.int64)
    if flat:
        at = np.repeat(np.arange(len(rows)), lengths)
        out[at, np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = np.array(flat, dtype=np.int64)
    return out


def _is_box(value: object) -> TypeGuard[tuple[int, ...]]:
    """A tuple of at most MAX_NDIM non-negative 64-bit ints (checked before it is hashed or shown)."""
    return type(value) is tuple and len(value) <= MAX_NDIM and all(type(v) is int and 0 <= v < MAX_DIM for v in value)


def _check_names(entries: dict[object, object], path: str) -> None:
    """Tensor names must be text that UTF-8 can hold (the output header is UTF-8 JSON)."""
    for name in entries:
        if type(name) is not str:
            raise _bad_metadata(path, f"entry name {shown(name)} is not text")
    try:
        "".join(entries).encode("utf-8")  # type: ignore[arg-type]
    except UnicodeEncodeError:
        bad = next(n for n in entries if not _encodes(n))  # type: ignore[arg-type]
        raise InputError(
            f"{path}: tensor name {bad!r} is not valid Unicode (a lone surrogate); safetensors cannot hold it"
        ) from None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_tensor_bytes(path: str, name: str, dtype: str, size: tuple[int, ...]) -> None:
    """The declared full tensor must be addressable: fewer than 2**63 bytes."""
    elements = 1
    for dim in size:
        elements *= dim
    if elements * DTYPE_BY_NAME[dtype].bits >= MAX_DIM * 8:
        raise InputError(f"{path}: tensor {name!r}: size {list(size)} of {dtype} is 2**63 bytes or more (damaged metadata?)")


def read_metadata(source: ByteSource | str, allow: AllowList = NOTHING) -> DistcpTable:
    """Read ``.metadata`` (a pickle of DCP's ``Metadata``) without torch, refusing anything else it could hold.

    ``source`` is read whole in one read, or is the path of a file opened here. ``allow``: the classes a
    trainer adds to the pickle (Megatron's save plans), read as inert records and otherwise ignored."""
    # The pickle makes a few objects per piece and none of them cycles: the cyclic garbage collector
    # would only rescan them over and over (two thirds of the time for 200,000 pieces).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with opened(source) as readable:
            return _read_metadata(readable, allow)
    finally:
        if collecting:
            gc.enable()


def _read_metadata(source: ByteSource, allow: AllowList) -> DistcpTable:
    path, data = source.name, source.read_at(0, source.size)
    metadata = _fields(unpickle(data, _MetadataUnpickler, path, "the metadata", allow), "Metadata", path)
    del data
    entries = metadata.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise _bad_metadata(path, "state_dict_metadata is not a map")
    where = _storage_index(metadata.get("storage_data"), path)
    planner = metadata.get("planner_data")
    _check_names(entries, path)
    saved_order = [n for n in planner if type(n) is str and n in entries] if isinstance(planner, dict) else []
    in_order = set(saved_order)
    saved_order += [n for n in entries if n not in in_order]
    tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    skipped = []
    for name, entry in entries.items():
        if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
            skipped.append(name)
            continue
        fields = _fields(entry, "TensorStorageMetadata", path)
        dtype, size, chunks = _dtype_of(fields.get("properties"), name, path), fields.get("size"), fields.get("chunks")
        if not _is_box(size) or type(chunks) is not list:
            raise _bad_metadata(
                path, f"tensor {name!r}: size {shown(size)} (a tuple of non-negative 64-bit integers?), chunks {shown(chunks)}"
            )
        _check_tensor_bytes(path, name, dtype, size)
        boxes = []
        for chunk in chunks:
            box = _fields(chunk, "ChunkStorageMetadata", path)
            offsets, sizes = box.get("offsets"), box.get("sizes")
            if not (_is_box(offsets) and _is_box(sizes) and len(offsets) == len(sizes) == len(size)):
                raise InputError(
                    f"{path}: tensor {name!r} (size {list(size)}): chunk {shown(box)} is not {len(size)} non-negative "
                    "64-bit offsets and sizes"
                )
            boxes.append((offsets, sizes))
        tensors[name] = (dtype, size, boxes)
    return _columns(path, tensors, [n for n in saved_order if n in tensors], sorted(skipped), where)


def _columns(
    path: str,
    tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]],
    saved_order: list[str],
    skipped: list[str],
    where: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]],
) -> DistcpTable:
    names = sorted(tensors)
    position = {name: i for i, name in enumerate(saved_order)}
    width = max([1] + [len(size) for _, size, _ in tensors.values()])
    located = []
    for t, name in enumerate(names):
        _, size, boxes = tensors[name]
        for offsets, sizes in boxes:
            item = where.get((name, offsets))
            if item is None:
                raise InputError(f"{path}: tensor {name!r}: the piece at {list(offsets)} has no storage entry")
            located.append((t, offsets, sizes, *item))
    files = sorted({item[3] for item in located})
    file_id = {f: i for i, f in enumerate(files)}
    return DistcpTable(
        names=names,
        order=np.array([position[n] for n in names], dtype=np.int64),
        dtype=np.array([DTYPE_ORDER[tensors[n][0]] for n in names], dtype=np.int8),
        size=_padded([tensors[n][1] for n in names], width, 1, path, "a tensor size"),
        ndim=np.array([len(tensors[n][1]) for n in names], dtype=np.int8),
        skipped=skipped,
        files=files,
        tensor=np.array([p[0] for p in located], dtype=np.int32),
        file=np.array([file_id[p[3]] for p in located], dtype=np.int32),
        shape=_padded([p[2] for p in located], width, 1, path, "a chunk size"),
        offset=_padded([p[1] for p in located], width, 0, path, "a chunk offset"),
        item_offset=np.array([p[4] for p in located], dtype=np.int64),
        item_length=np.array([p[5] for p in located], dtype=np.int64),
    )


__all__ = ["DistcpTable", "read_metadata"]
