"""DCP's default checkpoint format (``.metadata`` + ``__R_N.distcp``), read without torch (no MPI here).

``.metadata`` is a pickle of DCP's ``Metadata``: per tensor its dtype, full size and stored chunks,
and per chunk the (file, offset, length) of the item holding it. It is read by a restricted
unpickler that knows DCP's metadata classes, ``torch.Size``, torch dtypes and the few helpers the
pickle names, each replaced by an inert stand-in; any other name is refused before anything of
the pickle runs. The items are located in the data files afterwards:

- ``torch_save`` serialization (the default): each item is a complete zip archive (``torch.save``);
  its ``data.pkl`` (read by a second restricted unpickler) names the storage and its offset, size
  and stride, and the storage's bytes are a stored (uncompressed) member of the archive.
- ``safetensors`` serialization: each data file ends with one safetensors blob holding that file's
  pieces under their tensor names; every piece's recorded offset is the blob's start.

Non-tensor entries (``BytesStorageMetadata``: step counters, data-loader state) are skipped and
listed. The facts this relies on are in docs/distcp-format.md.
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InputError
from .format import DTYPE_BY_NAME, DTYPE_ORDER, DTYPES, MAX_DIM, MAX_HEADER_SIZE, parse_header

METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
SHARDING_KEY = "DCP_SHARDING_INFO"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ZIP_LOCAL = b"PK\x03\x04"

#: torch dtype attribute names (and the aliases a pickle may use) → safetensors dtype.
TORCH_DTYPES: dict[str, str] = {d.torch: d.name for d in DTYPES if d.torch is not None}
TORCH_DTYPES.update(float="F32", double="F64", half="F16", long="I64", int="I32", short="I16")
#: ``torch.<X>Storage`` classes of the legacy typed storages (``torch.save`` of most dtypes).
STORAGE_DTYPES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}


# ---------------------------------------------------------------- inert stand-ins for the pickled names


class _Record:
    """Stands in for one of DCP's metadata classes: keeps the pickled state (a dict of fields), runs nothing."""

    __slots__ = ("state",)
    kind = ""

    def __setstate__(self, state: object) -> None:
        self.state = state

    def field(self, name: str, default: object = None) -> object:
        state = getattr(self, "state", None)
        return state.get(name, default) if isinstance(state, dict) else default


def _record(kind: str) -> type[_Record]:
    return type(kind, (_Record,), {"__slots__": (), "kind": kind})


_RECORDS = {
    (module, name): _record(name)
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


@dataclass(frozen=True)
class _TorchDType:
    """A torch dtype named by the pickle, as its safetensors name."""

    name: str


def _size(dims: object = ()) -> tuple[int, ...]:
    """``torch.Size(dims)``: a tuple (its items are checked in bulk when the columns are made)."""
    if type(dims) is tuple:
        return dims
    if type(dims) is list:
        return tuple(dims)
    raise pickle.UnpicklingError(f"torch.Size of {dims!r}")


def _text(*parts: object) -> str:
    """``PosixPath(...)``, ``_get_layout(...)``: kept as text."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError(f"expected text, got {parts!r}")
    return "/".join(parts)  # type: ignore[arg-type]


def _enum_value(value: object) -> object:
    """``_MEM_FORMAT_ENCODING(n)``: the number."""
    if type(value) is not int:
        raise pickle.UnpicklingError(f"memory format {value!r}")
    return value


_METADATA_CALLABLES: dict[tuple[str, str], object] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _text,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _enum_value,
    **{("pathlib", name): _text for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
}


class _Refused(Exception):
    """The pickle names something mpicons does not stand in for."""


def _torch_dtype(module: str, name: str) -> _TorchDType | None:
    if module == "torch" and name in TORCH_DTYPES:
        return _TorchDType(TORCH_DTYPES[name])
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` into stand-ins; refuses every other global (nothing it names is imported)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _RECORDS.get((module, name)) or _METADATA_CALLABLES.get((module, name)) or _torch_dtype(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: object) -> Any:
        raise _Refused("a persistent id")


def _unpickle(data: bytes, unpickler: type[pickle.Unpickler], path: str, what: str) -> object:
    try:
        return unpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise InputError(
            f"{path}: unsupported: {what} names {exc}, which is not part of DCP's checkpoint format "
            "(refused without running anything)"
        ) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError) as exc:
        raise InputError(f"{path}: {what} is not a readable pickle ({type(exc).__name__}: {exc})") from None
    except MemoryError:
        raise InputError(f"{path}: {what} is not a readable pickle (it asks for more memory than there is)") from None


# ---------------------------------------------------------------- .metadata → columns


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
    if not isinstance(record, _Record) or record.kind != kind or not isinstance(getattr(record, "state", None), dict):
        raise _bad_metadata(path, f"expected a {kind}, found {type(record).__name__}")
    return record.state  # type: ignore[return-value]


def _dtype_of(properties: object, name: str, path: str) -> str:
    """The safetensors dtype of a ``TensorProperties`` (pickled as a tuple, or as a field dict)."""
    state = getattr(properties, "state", None) if isinstance(properties, _Record) else None
    if isinstance(state, tuple) and len(state) >= 2:
        dtype, layout = state[0], state[1]
    elif isinstance(state, dict):
        dtype, layout = state.get("dtype"), state.get("layout", "torch.strided")
    else:
        raise _bad_metadata(path, f"tensor {name!r} has no properties")
    if not isinstance(dtype, _TorchDType):
        raise InputError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r} (safetensors cannot hold it)")
    if layout != "torch.strided":
        raise InputError(f"{path}: tensor {name!r}: unsupported layout {layout} (only dense tensors)")
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
        if not isinstance(fqn, str) or not isinstance(offsets, tuple):
            raise _bad_metadata(path, f"storage key {where!r}")
        if not (isinstance(file, str) and type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise _bad_metadata(path, f"storage entry of tensor {fqn!r} at {list(offsets)}: {info!r}")
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            raise InputError(f"{path}: tensor {fqn!r}: data file {file!r} is not a file name inside the checkpoint directory")
        if info.get("transform_descriptors"):
            raise InputError(
                f"{path}: tensor {fqn!r}: unsupported: stored through stream transforms {info['transform_descriptors']} "
                "(a compression extension); save without it"
            )
        index[(fqn, offsets)] = (file, offset, length)
    return index


def _padded(rows: Sequence[tuple[int, ...]], width: int, fill: int, path: str, what: str) -> np.ndarray:
    """Ragged tuples of non-negative ints as an int64 array padded with ``fill`` (checked in bulk)."""
    flat = list(itertools.chain.from_iterable(rows))
    if not set(map(type, flat)) <= {int} or (flat and not 0 <= min(flat) <= max(flat) < MAX_DIM):
        bad = next(row for row in rows if not all(type(v) is int and 0 <= v < MAX_DIM for v in row))
        raise _bad_metadata(path, f"{what} {bad!r} is not a tuple of non-negative 64-bit integers")
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), width), fill, dtype=np.int64)
    if flat:
        at = np.repeat(np.arange(len(rows)), lengths)
        out[at, np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = np.array(flat, dtype=np.int64)
    return out


def read_metadata(path: str) -> DistcpTable:
    """Read ``.metadata`` (a pickle of DCP's ``Metadata``) without torch, refusing anything else it could hold."""
    # The pickle makes a few objects per piece and none of them cycles: the cyclic garbage collector
    # would only rescan them over and over (two thirds of the time for 200,000 pieces).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _read_metadata(path)
    finally:
        if collecting:
            gc.enable()


def _read_metadata(path: str) -> DistcpTable:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    metadata = _fields(_unpickle(data, _MetadataUnpickler, path, "the metadata"), "Metadata", path)
    del data
    entries = metadata.get("state_dict_metadata")
    if not isinstance(entries, dict):
        raise _bad_metadata(path, "state_dict_metadata is not a map")
    where = _storage_index(metadata.get("storage_data"), path)
    planner = metadata.get("planner_data")
    saved_order = [n for n in planner if n in entries] if isinstance(planner, dict) else []
    saved_order += [n for n in entries if n not in set(saved_order)]
    tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    skipped = []
    for name, entry in entries.items():
        if not isinstance(name, str):
            raise _bad_metadata(path, f"entry name {name!r}")
        if isinstance(entry, _Record) and entry.kind == "BytesStorageMetadata":
            skipped.append(name)
            continue
        fields = _fields(entry, "TensorStorageMetadata", path)
        dtype, size, chunks = _dtype_of(fields.get("properties"), name, path), fields.get("size"), fields.get("chunks")
        if not isinstance(size, tuple) or not isinstance(chunks, list):
            raise _bad_metadata(path, f"tensor {name!r}: size {size!r}, chunks {type(chunks).__name__}")
        boxes = []
        for chunk in chunks:
            box = _fields(chunk, "ChunkStorageMetadata", path)
            offsets, sizes = box.get("offsets"), box.get("sizes")
            if not (isinstance(offsets, tuple) and isinstance(sizes, tuple) and len(offsets) == len(sizes) == len(size)):
                raise InputError(f"{path}: tensor {name!r} (size {list(size)}): chunk {box!r} has the wrong number of dimensions")
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


# ---------------------------------------------------------------- the items in the data files


@dataclass(frozen=True)
class _StorageType:
    dtype: str | None  # None: an untyped (byte) storage; the tensor names its dtype


@dataclass(frozen=True)
class _Storage:
    dtype: str | None
    key: str
    numel: int  # elements of ``dtype``; bytes when untyped


@dataclass(frozen=True)
class _TensorRef:
    """What ``data.pkl`` says of the saved tensor."""

    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


def _ints(value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        raise pickle.UnpicklingError(f"expected a tuple of ints, got {value!r}")
    return value


def _rebuild(storage: object, storage_offset: object, size: object, stride: object, dtype: str | None) -> _TensorRef:
    if not isinstance(storage, _Storage) or type(storage_offset) is not int or storage_offset < 0:
        raise pickle.UnpicklingError("a tensor without a storage")
    dtype = storage.dtype or dtype
    if dtype is None:
        raise pickle.UnpicklingError("a tensor without a dtype")
    return _TensorRef(storage, storage_offset, _ints(size), _ints(stride), dtype)


def _rebuild_v2(storage: object, storage_offset: object, size: object, stride: object, *rest: object) -> _TensorRef:
    """``torch._utils._rebuild_tensor_v2``: storage, offset, size, stride, requires_grad, hooks[, metadata]."""
    return _rebuild(storage, storage_offset, size, stride, None)


def _rebuild_v3(
    storage: object,
    storage_offset: object,
    size: object,
    stride: object,
    requires_grad: object,
    hooks: object,
    dtype: object,
    *rest: object,
) -> _TensorRef:
    """``torch._utils._rebuild_tensor_v3``: as v2 with the dtype named (untyped storages: float8, uint16, ...)."""
    if not isinstance(dtype, _TorchDType):
        raise pickle.UnpicklingError(f"dtype {dtype!r}")
    return _rebuild(storage, storage_offset, size, stride, dtype.name)


def _no_hooks(*args: object) -> dict[str, object]:
    """``collections.OrderedDict()``: the (empty) backward hooks of a saved tensor."""
    if args:
        raise pickle.UnpicklingError("backward hooks")
    return {}


_TENSOR_CALLABLES: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): _no_hooks,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    **{("torch", name): _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles the ``data.pkl`` of one ``torch.save`` of a tensor into a :class:`_TensorRef`, running nothing."""

    def find_class(self, module: str, name: str) -> Any:
        found = _TENSOR_CALLABLES.get((module, name)) or _torch_dtype(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: object) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            return _Storage(pid[1].dtype, pid[2], pid[4])
        raise pickle.UnpicklingError(f"persistent id {pid!r}")


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a seekable file of their own (for zipfile)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the item")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._position))
        data = os.pread(self._fd, count, self._start + self._position) if count else b""
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


@dataclass(frozen=True)
class Item:
    """One stored piece to find: its tensor and box, and the item DCP recorded for it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    item_offset: int
    item_length: int


def locate(path: str, items: Sequence[Item], fast: bool = True) -> np.ndarray:
    """The absolute offset in the data file at ``path`` where each item's piece (C order) begins.

    ``fast``: read archives laid out as ``torch.save`` writes them with two small reads each (their
    first and last 4 KiB), and any other through :mod:`zipfile` (``False``: every one through it).
    Raises InputError naming the file, the tensor and what does not agree with the metadata.
    """
    pickles: dict[bytes, object] = {}  # data.pkl → what it says: pieces of one shape pickle alike
    begins = np.zeros(len(items), dtype=np.int64)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        blobs: dict[int, dict[str, tuple[str, tuple[int, ...], int, list[int] | None]]] = {}
        for i, item in enumerate(items):
            where = f"{path}: tensor {item.name!r} (piece at {list(item.offsets)})"
            if item.item_offset + item.item_length > size:
                raise InputError(
                    f"{where}: its item at byte {item.item_offset} ({item.item_length} bytes) runs past the end "
                    f"of the {size}-byte file (truncated?)"
                )
            head = os.pread(fd, 4, item.item_offset)
            if head == _ZIP_LOCAL:
                begins[i] = _archive_piece(fd, where, item, pickles, fast)
            else:
                blob = blobs.get(item.item_offset)
                if blob is None:
                    blob = blobs[item.item_offset] = _blob_entries(fd, path, where, item.item_offset, size)
                begins[i] = _blob_piece(blob, where, item)
    finally:
        os.close(fd)
    return begins


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_LOCATOR = struct.Struct("<4sLQL")  # ZIP64 end of central directory locator
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # ZIP64 end of central directory record
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_PEEK = 4096


def _simple_members(tail: bytes, length: int) -> dict[str, tuple[int, int, int]] | None:
    """Members (method, stored size, local header offset) of the archive ending with ``tail``, or None
    when it is not laid out as simply as ``torch.save`` writes it (no comment, the central directory
    within ``tail``, no ZIP64 member fields): :mod:`zipfile` reads those."""
    if len(tail) < _EOCD.size:
        return None
    signature, _, _, _, count, size, offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if signature != b"PK\x05\x06" or comment:
        return None
    base = length - len(tail)  # archive offset of tail[0]
    locator = len(tail) - _EOCD.size - _LOCATOR.size
    if locator >= 0 and tail[locator : locator + 4] == b"PK\x06\x07":
        at = _LOCATOR.unpack_from(tail, locator)[2] - base
        if at < 0 or at + _EOCD64.size > len(tail) or tail[at : at + 4] != b"PK\x06\x06":
            return None
        count, size, offset = _EOCD64.unpack_from(tail, at)[7:10]
    at = offset - base
    if at < 0 or at + size > len(tail):
        return None
    members = {}
    for _ in range(count):
        if at + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, at)
        method, stored, names, extra, note, local = fields[4], fields[8], fields[10], fields[11], fields[12], fields[16]
        if fields[0] != b"PK\x01\x02" or 0xFFFFFFFF in (stored, fields[9], local):
            return None
        members[tail[at + _CENTRAL.size : at + _CENTRAL.size + names].decode("utf-8", "replace")] = (method, stored, local)
        at += _CENTRAL.size + names + extra + note
    return members


def _member_start(fd: int, where: str, item: Item, name: str, local: int, head: bytes) -> int:
    """The archive offset of member ``name``'s data, from its local header (in ``head`` when it is there)."""
    header = (
        head[local : local + _LOCAL.size]
        if local + _LOCAL.size <= len(head)
        else os.pread(fd, _LOCAL.size, item.item_offset + local)
    )
    if len(header) < _LOCAL.size or header[:4] != _ZIP_LOCAL:
        raise InputError(f"{where}: the archive's local header of {name} is damaged")
    names, extra = _LOCAL.unpack(header)[9:11]
    return local + _LOCAL.size + names + extra


def _archive_piece(fd: int, where: str, item: Item, pickles: dict[bytes, object], fast: bool) -> int:
    """Where the piece's bytes begin inside its ``torch.save`` archive, checked against the metadata."""
    head = tail = b""
    members = None
    if fast:
        head = os.pread(fd, min(_PEEK, item.item_length), item.item_offset)
        start = max(0, item.item_length - _PEEK)
        tail = os.pread(fd, item.item_length - start, item.item_offset + start)
        members = _simple_members(tail, item.item_length)
    if members is None:
        return _archive_piece_zipfile(fd, where, item)
    root = next(iter(members)).split("/")[0] if members else ""
    pickled = members.get(f"{root}/data.pkl")
    if pickled is None:
        raise InputError(f"{where}: the torch.save archive has no data.pkl")
    if pickled[0] != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the torch.save archive is compressed")
    begin = _member_start(fd, where, item, "data.pkl", pickled[2], head)
    data = (
        head[begin : begin + pickled[1]]
        if begin + pickled[1] <= len(head)
        else os.pread(fd, pickled[1], item.item_offset + begin)
    )
    ref = pickles.get(data)
    if ref is None:
        ref = pickles[data] = _unpickle(data, _TensorUnpickler, where, "the item's data.pkl")
    if not isinstance(ref, _TensorRef):
        raise InputError(f"{where}: the item holds a {type(ref).__name__}, not a tensor")
    name = f"{root}/data/{ref.storage.key}"
    member = members.get(name)
    if member is None:
        raise InputError(f"{where}: the archive has no storage {ref.storage.key!r}")
    if member[0] != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the storage is compressed in the archive")
    _check_ref(where, item, ref, member[1])
    start = _member_start(fd, where, item, name, member[2], head)
    if start + member[1] > item.item_length:
        raise InputError(f"{where}: the storage runs past the end of its item")
    return item.item_offset + start + ref.storage_offset * DTYPE_BY_NAME[ref.dtype].bits // 8


def _archive_piece_zipfile(fd: int, where: str, item: Item) -> int:
    """:func:`_archive_piece` for any zip archive, read through :mod:`zipfile`."""
    try:
        archive = zipfile.ZipFile(_Window(fd, item.item_offset, item.item_length))
        members = {info.filename: info for info in archive.infolist()}
        root = next(iter(members)).split("/")[0] if members else ""
        pickled = members.get(f"{root}/data.pkl")
        if pickled is None:
            raise InputError(f"{where}: the torch.save archive has no data.pkl")
        if pickled.compress_type != zipfile.ZIP_STORED:
            raise InputError(f"{where}: unsupported: the torch.save archive is compressed")
        ref = _unpickle(archive.read(pickled), _TensorUnpickler, where, "the item's data.pkl")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, OSError, EOFError, StopIteration) as exc:
        raise InputError(f"{where}: the item at byte {item.item_offset} is not a readable torch.save archive ({exc})") from None
    if not isinstance(ref, _TensorRef):
        raise InputError(f"{where}: the item holds a {type(ref).__name__}, not a tensor")
    member = members.get(f"{root}/data/{ref.storage.key}")
    if member is None:
        raise InputError(f"{where}: the archive has no storage {ref.storage.key!r}")
    if member.compress_type != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the storage is compressed in the archive")
    _check_ref(where, item, ref, member.file_size)
    start = _member_start(fd, where, item, member.filename, member.header_offset, b"")
    if start + member.file_size > item.item_length:
        raise InputError(f"{where}: the storage runs past the end of its item")
    return item.item_offset + start + ref.storage_offset * DTYPE_BY_NAME[ref.dtype].bits // 8


def _check_ref(where: str, item: Item, ref: _TensorRef, stored_bytes: int) -> None:
    """The saved tensor must be the metadata's piece, row-major, inside its storage."""
    if ref.dtype != item.dtype:
        raise InputError(f"{where}: the archive holds {ref.dtype}, the metadata says {item.dtype}")
    if ref.size != item.shape:
        raise InputError(f"{where}: the archive holds shape {list(ref.size)}, the metadata says {list(item.shape)}")
    if len(ref.stride) != len(ref.size):
        raise InputError(f"{where}: stride {list(ref.stride)} does not match shape {list(ref.size)}")
    expected, step = [], 1
    for dim in reversed(ref.size):
        expected.append(step)
        step *= dim
    expected.reverse()
    if any(d > 1 and s != e for d, s, e in zip(ref.size, ref.stride, expected)):
        raise InputError(
            f"{where}: unsupported: stored with strides {list(ref.stride)}, not row-major "
            f"(row-major strides are {expected}); save a contiguous copy of the tensor"
        )
    unit = DTYPE_BY_NAME[ref.dtype].bits // 8
    storage_bytes = ref.storage.numel * (unit if ref.storage.dtype is not None else 1)
    if storage_bytes != stored_bytes:
        raise InputError(f"{where}: the storage is {stored_bytes} bytes in the archive, its pickle says {storage_bytes}")
    if (ref.storage_offset + step) * unit > stored_bytes and step:
        raise InputError(f"{where}: the tensor runs past the end of its storage ({stored_bytes} bytes)")


def _blob_entries(
    fd: int, path: str, where: str, offset: int, size: int
) -> dict[str, tuple[str, tuple[int, ...], int, list[int] | None]]:
    """The safetensors blob at ``offset`` (DCP's safetensors serialization): name → (dtype, shape, begin, saved offsets)."""
    prefix = os.pread(fd, 9, offset)
    if len(prefix) < 9 or prefix[8:9] != b"{":
        raise InputError(f"{where}: the item at byte {offset} is neither a torch.save archive nor a safetensors blob")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_SIZE or offset + 8 + length > size:
        raise InputError(f"{path}: the safetensors blob at byte {offset} has a header length of {length} (damaged?)")
    header = parse_header(os.pread(fd, length, offset + 8), size - offset, f"{path} (safetensors blob at byte {offset})")
    saved: dict[str, Any] = {}
    text = header.metadata.get(SHARDING_KEY)
    if text is not None:
        try:
            saved = json.loads(text)
        except ValueError:
            raise InputError(f"{path}: the blob's {SHARDING_KEY} is not valid JSON") from None
    entries = {}
    for entry in header.tensors:
        info = saved.get(entry.name) if isinstance(saved, dict) else None
        offsets = info.get("saved_offsets") if isinstance(info, dict) else None
        entries[entry.name] = (entry.dtype, entry.shape, offset + header.data_start + entry.begin, offsets)
    return entries


def _blob_piece(blob: dict[str, tuple[str, tuple[int, ...], int, list[int] | None]], where: str, item: Item) -> int:
    found = blob.get(item.name)
    if found is None:
        raise InputError(f"{where}: the file's safetensors blob does not hold this tensor")
    dtype, shape, begin, offsets = found
    if dtype != item.dtype or shape != item.shape:
        raise InputError(f"{where}: the blob holds {dtype} {list(shape)}, the metadata says {item.dtype} {list(item.shape)}")
    if offsets is not None and tuple(offsets) != item.offsets:
        raise InputError(f"{where}: the blob's {SHARDING_KEY} places it at {offsets}")
    return begin


__all__ = ["DistcpTable", "Item", "METADATA_NAME", "DATA_SUFFIX", "read_metadata", "locate"]
