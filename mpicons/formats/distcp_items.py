"""Where each piece of DCP's default format lies in its data file (``__R_N.distcp``), read without
torch (no MPI here).

- ``torch_save`` serialization (the default): each item is a complete zip archive (``torch.save``);
  its ``data.pkl`` (read by a restricted unpickler) names the storage and its offset, size and
  stride, and the storage's bytes are a stored (uncompressed) member of the archive. The archive's
  own records (central directory, local headers, data descriptors) must agree on every extent.
- ``safetensors`` serialization: each data file ends with one safetensors blob holding that file's
  pieces under their tensor names; every piece's recorded offset is the blob's start.

The facts this relies on are in docs/distcp-format.md.
"""

from __future__ import annotations

import json
import pickle
import shlex
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import InputError
from ..core.safetensors_codec import DTYPE_BY_NAME, MAX_DIM, MAX_HEADER_SIZE, MAX_NDIM, parse_header
from .byte_sources import ByteSource, SourceWindow, opened
from .shard_headers import SHARDING_KEY
from .unpickling import Budget, RestrictedUnpickler, Sealed, TorchDType, shown, unpickle
from .zip_directory import check_directory, simple_members

_ZIP_LOCAL = b"PK\x03\x04"

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


def _refuse_state(self: object, state: object) -> None:
    raise pickle.UnpicklingError(f"the pickle sets state on a {type(self).__name__}")


class _StorageType(Sealed):
    """``torch.<X>Storage``: a storage class by its dtype (None: untyped bytes; the tensor names its dtype)."""

    __slots__ = ("dtype",)
    dtype: str | None

    def __init__(self, dtype: str | None) -> None:
        object.__setattr__(self, "dtype", dtype)

    def __repr__(self) -> str:
        return f"storage class {self.dtype or 'untyped'}"


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: str | None
    key: str
    numel: int  # elements of ``dtype``; bytes when untyped

    __setstate__ = _refuse_state


@dataclass(frozen=True, slots=True)
class _TensorRef:
    """What ``data.pkl`` says of the saved tensor."""

    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    __setstate__ = _refuse_state


def _ints(budget: Budget, value: object) -> tuple[int, ...]:
    if type(value) is not tuple or len(value) > MAX_NDIM:
        raise pickle.UnpicklingError(f"expected a tuple of at most {MAX_NDIM} ints, got {shown(value)}")
    budget.spend(len(value))
    if not all(type(v) is int and 0 <= v < MAX_DIM for v in value):
        raise pickle.UnpicklingError(f"expected a tuple of non-negative 64-bit ints, got {shown(value)}")
    return value


def _rebuild(
    budget: Budget, storage: object, storage_offset: object, size: object, stride: object, dtype: str | None
) -> _TensorRef:
    if not isinstance(storage, _Storage) or type(storage_offset) is not int or not 0 <= storage_offset < MAX_DIM:
        raise pickle.UnpicklingError("a tensor without a storage")
    dtype = storage.dtype or dtype
    if dtype is None:
        raise pickle.UnpicklingError("a tensor without a dtype")
    return _TensorRef(storage, storage_offset, _ints(budget, size), _ints(budget, stride), dtype)


def _rebuild_v2(
    budget: Budget, storage: object, storage_offset: object, size: object, stride: object, *rest: object
) -> _TensorRef:
    """``torch._utils._rebuild_tensor_v2``: storage, offset, size, stride, requires_grad, hooks[, metadata]."""
    return _rebuild(budget, storage, storage_offset, size, stride, None)


def _rebuild_v3(
    budget: Budget,
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
    if not isinstance(dtype, TorchDType):
        raise pickle.UnpicklingError(f"dtype {shown(dtype)}")
    return _rebuild(budget, storage, storage_offset, size, stride, dtype.name)


def _no_hooks(budget: Budget, *args: object) -> dict[str, object]:
    """``collections.OrderedDict()``: the (empty) backward hooks of a saved tensor."""
    if args:
        raise pickle.UnpicklingError("backward hooks")
    return {}


_TENSOR_FUNCTIONS: dict[tuple[str, str], Callable[..., object]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): _no_hooks,
}
_STORAGE_TYPES: dict[tuple[str, str], object] = {
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    **{("torch", name): _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}


class TensorUnpickler(RestrictedUnpickler):
    """Unpickles the ``data.pkl`` of one ``torch.save`` of a tensor into a :class:`_TensorRef`, running nothing."""

    functions = _TENSOR_FUNCTIONS
    others = _STORAGE_TYPES

    def persistent_load(self, pid: object) -> Any:
        if (
            type(pid) is tuple
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and type(pid[2]) is str
            and type(pid[4]) is int
            and 0 <= pid[4] < MAX_DIM
        ):
            return _Storage(pid[1].dtype, pid[2], pid[4])
        raise pickle.UnpicklingError(f"persistent id {shown(pid)}")


@dataclass(frozen=True)
class Item:
    """One stored piece to find: its tensor and box, and the item DCP recorded for it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    item_offset: int
    item_length: int


@dataclass(frozen=True)
class ItemProblem:
    """Why one item cannot be read: its index in the items asked for, its tensor and the message."""

    index: int
    tensor: str
    message: str


def locate(path: ByteSource | str, items: Sequence[Item], fast: bool = True) -> np.ndarray:
    """The absolute offset in the data file at ``path`` (or read through a source) where each item's piece (C order) begins.

    Raises InputError at the first item that cannot be read (see :func:`locate_all`).
    """
    begins, problems, _ = locate_all(path, items, fast)
    if problems:
        raise InputError(problems[0].message)
    return begins


def locate_all(
    path: ByteSource | str, items: Sequence[Item], fast: bool = True
) -> tuple[np.ndarray, list[ItemProblem], dict[int, tuple[int, ...]]]:
    """Where each item's piece begins in the data file at ``path`` (or read through a source, left
    open), every item that cannot be read, and the strides of the items torch saved as views
    (transposed, sliced), by position; row-major ones are not listed.

    ``fast``: read archives laid out as ``torch.save`` writes them with two small reads each (their
    first and last 4 KiB; a record outside both costs one more), and any other through :mod:`zipfile`
    (``False``: every one through it).
    A problem names the file, the tensor and what does not agree with the metadata; the file itself
    not being readable raises InputError.
    """
    pickles: dict[bytes, object] = {}  # data.pkl → what it says: pieces of one shape pickle alike
    begins = np.zeros(len(items), dtype=np.int64)
    problems: list[ItemProblem] = []
    views: dict[int, tuple[int, ...]] = {}
    with opened(path) as source:
        blobs: dict[int, dict[str, _BlobEntry]] = {}
        for i, item in enumerate(items):
            try:
                begins[i], stride = _locate_one(source, item, pickles, blobs, fast)
                if stride is not None:
                    views[i] = stride
            except InputError as exc:
                problems.append(ItemProblem(i, item.name, str(exc)))
    return begins, problems, views


class _ItemBytes:
    """One item's bytes as read so far (its first and last few KiB): a record inside them costs no
    read, one outside them one read of the source."""

    def __init__(self, source: ByteSource, item: Item, head: bytes, tail: bytes = b"") -> None:
        self.source, self.base, self.head, self.tail = source, item.item_offset, head, tail
        self.tail_start = item.item_length - len(tail)

    def read(self, at: int, length: int) -> bytes:
        """``length`` bytes at ``at`` (relative to the item's start; they may run past its end)."""
        if at + length <= len(self.head):
            return self.head[at : at + length]
        if self.tail and self.tail_start <= at and at + length <= self.tail_start + len(self.tail):
            return self.tail[at - self.tail_start : at - self.tail_start + length]
        return self.source.read_at(self.base + at, length)


def _locate_one(
    source: ByteSource, item: Item, pickles: dict[bytes, object], blobs: dict[int, dict[str, _BlobEntry]], fast: bool
) -> tuple[int, tuple[int, ...] | None]:
    path, size = source.name, source.size
    where = f"{path}: tensor {item.name!r} (piece at {list(item.offsets)})"
    if item.item_offset + item.item_length > size:
        raise InputError(
            f"{where}: its item at byte {item.item_offset} ({item.item_length} bytes) runs past the end "
            f"of the {size}-byte file (truncated?)"
        )
    blob = blobs.get(item.item_offset)
    if blob is not None:  # a safetensors blob already read (its pieces all share its offset)
        return _blob_piece(blob, where, item), None
    # One read for the signature and the archive's first records (the blob's prefix when it is one).
    peek = source.read_at(item.item_offset, max(_BLOB_PREFIX, min(_PEEK, item.item_length)))
    if peek[:4] == _ZIP_LOCAL:
        return _archive_piece(source, where, item, pickles, fast, peek[: item.item_length])
    blob = blobs[item.item_offset] = _blob_entries(source, where, item.item_offset, peek)
    return _blob_piece(blob, where, item), None


_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_PEEK = 4096
_BLOB_PREFIX = 9  # a safetensors blob's length and its header's first byte


_DESCRIPTOR = b"PK\x07\x08"


def _member_start(record: _ItemBytes, where: str, item: Item, name: str, local: int, size: int, boundary: int) -> int:
    """The archive offset of member ``name``'s data, from its local header (read when ``record`` lacks it),
    after checking that the archive's own records agree on its extent: the local header names it and
    records its size (or a data descriptor after the data does), and its data ends before
    ``boundary`` (the next member's local header, or the central directory)."""
    header = record.read(local, _LOCAL.size)
    if len(header) < _LOCAL.size or header[:4] != _ZIP_LOCAL:
        raise InputError(f"{where}: the archive's local header of {name} is damaged")
    fields = _LOCAL.unpack(header)
    flags, stored, unpacked, names, extra = fields[2], fields[7], fields[8], fields[9], fields[10]
    start = local + _LOCAL.size + names + extra
    if record.read(local + _LOCAL.size, names) != name.encode("utf-8"):
        raise InputError(f"{where}: the archive's local header at byte {local} does not name {name}")
    recorded: tuple[int, ...] = (stored, unpacked)
    if flags & 0x08:  # sizes in a data descriptor after the data
        tail = record.read(start + size, 24)
        body = tail[4:] if tail[:4] == _DESCRIPTOR else tail
        recorded = struct.unpack_from("<4xLL", body) if len(body) >= 12 else ()
        if recorded != (size, size) and len(body) >= 20:
            recorded = struct.unpack_from("<4xQQ", body)
    if 0xFFFFFFFF not in recorded and recorded != (size, size):
        raise InputError(
            f"{where}: the archive's records of {name} disagree: {size} bytes in its central directory, "
            f"{list(recorded) or 'no size'} in its local records (damaged item at byte {item.item_offset})"
        )
    if start + size > boundary:
        raise InputError(
            f"{where}: the archive's member {name} ({size} bytes from byte {start}) runs into the next record at "
            f"byte {boundary} (damaged item at byte {item.item_offset})"
        )
    return start


def _boundaries(locals_: Sequence[int], central: int) -> dict[int, int]:
    """Local header offset → where the next member's local header (or the central directory) starts."""
    ordered = sorted(locals_)
    return {local: nxt for local, nxt in zip(ordered, [*ordered[1:], central])}


def _archive_piece(
    source: ByteSource, where: str, item: Item, pickles: dict[bytes, object], fast: bool, head: bytes
) -> tuple[int, tuple[int, ...] | None]:
    """Where the piece's bytes begin inside its ``torch.save`` archive, checked against the metadata,
    and its strides if it is a view. ``head``: the item's first bytes, already read."""
    found, record = None, _ItemBytes(source, item, head)
    if fast:
        start = max(0, item.item_length - _PEEK)
        whole = len(head) >= item.item_length  # a small item: its head is all of it
        tail = head[start:] if whole else source.read_at(item.item_offset + start, item.item_length - start)
        record = _ItemBytes(source, item, head, tail)
        found = simple_members(tail, item.item_length)
    if found is None:
        return _archive_piece_zipfile(source, where, item)
    members, central = found
    boundary = _boundaries([member[2] for member in members.values()], central)
    root = next(iter(members)).split("/")[0] if members else ""
    pickled = members.get(f"{root}/data.pkl")
    if pickled is None:
        raise InputError(f"{where}: the torch.save archive has no data.pkl")
    if pickled[0] != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the torch.save archive is compressed")
    begin = _member_start(record, where, item, f"{root}/data.pkl", pickled[2], pickled[1], boundary[pickled[2]])
    data = record.read(begin, pickled[1])
    ref = pickles.get(data)
    if ref is None:
        ref = pickles[data] = unpickle(data, TensorUnpickler, where, "the item's data.pkl")
    if not isinstance(ref, _TensorRef):
        raise InputError(f"{where}: the item holds a {type(ref).__name__}, not a tensor")
    name = f"{root}/data/{ref.storage.key}"
    member = members.get(name)
    if member is None:
        raise InputError(f"{where}: the archive has no storage {ref.storage.key!r}")
    if member[0] != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the storage is compressed in the archive")
    stride = _check_ref(where, item, ref, member[1])
    start = _member_start(record, where, item, name, member[2], member[1], boundary[member[2]])
    return item.item_offset + start + ref.storage_offset * DTYPE_BY_NAME[ref.dtype].bits // 8, stride


def _archive_piece_zipfile(source: ByteSource, where: str, item: Item) -> tuple[int, tuple[int, ...] | None]:
    """:func:`_archive_piece` for any zip archive, read through :mod:`zipfile`."""
    record = _ItemBytes(source, item, b"")
    check_directory(record.read, item.item_length, f"{where} (the item at byte {item.item_offset})")
    try:
        archive = zipfile.ZipFile(SourceWindow(source, item.item_offset, item.item_length))
        members = {info.filename: info for info in archive.infolist()}
        root = next(iter(members)).split("/")[0] if members else ""
        pickled = members.get(f"{root}/data.pkl")
        if pickled is None:
            raise InputError(f"{where}: the torch.save archive has no data.pkl")
        if pickled.compress_type != zipfile.ZIP_STORED:
            raise InputError(f"{where}: unsupported: the torch.save archive is compressed")
        boundary = _boundaries([info.header_offset for info in members.values()], archive.start_dir)
        _member_start(
            record, where, item, pickled.filename, pickled.header_offset, pickled.file_size, boundary[pickled.header_offset]
        )
        ref = unpickle(archive.read(pickled), TensorUnpickler, where, "the item's data.pkl")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, OSError, EOFError, StopIteration) as exc:
        raise InputError(f"{where}: the item at byte {item.item_offset} is not a readable torch.save archive ({exc})") from None
    if not isinstance(ref, _TensorRef):
        raise InputError(f"{where}: the item holds a {type(ref).__name__}, not a tensor")
    member = members.get(f"{root}/data/{ref.storage.key}")
    if member is None:
        raise InputError(f"{where}: the archive has no storage {ref.storage.key!r}")
    if member.compress_type != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the storage is compressed in the archive")
    stride = _check_ref(where, item, ref, member.file_size)
    if member.compress_size != member.file_size:
        raise InputError(f"{where}: the archive's records of {member.filename} disagree on its size")
    start = _member_start(
        record, where, item, member.filename, member.header_offset, member.file_size, boundary[member.header_offset]
    )
    return item.item_offset + start + ref.storage_offset * DTYPE_BY_NAME[ref.dtype].bits // 8, stride


def _check_ref(where: str, item: Item, ref: _TensorRef, stored_bytes: int) -> tuple[int, ...] | None:
    """The saved tensor must be the metadata's piece, inside its storage; its strides when it is a view
    torch saved as one (transposed or sliced: any order of non-overlapping dims, one of them
    contiguous), None when it is row-major or has no elements (strides then mean nothing)."""
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
    unit = DTYPE_BY_NAME[ref.dtype].bits // 8
    storage_bytes = ref.storage.numel * (unit if ref.storage.dtype is not None else 1)
    if storage_bytes != stored_bytes:
        raise InputError(f"{where}: the storage is {stored_bytes} bytes in the archive, its pickle says {storage_bytes}")
    if step == 0:
        return None  # no elements: nothing to read, whatever the strides say
    if all(d <= 1 or s == e for d, s, e in zip(ref.size, ref.stride, expected)):
        if (ref.storage_offset + step) * unit > stored_bytes:
            raise InputError(f"{where}: the tensor runs past the end of its storage ({stored_bytes} bytes)")
        return None
    _check_view(where, item, ref, unit, stored_bytes)
    return tuple(int(s) for s in ref.stride)


def _check_view(where: str, item: Item, ref: _TensorRef, unit: int, stored_bytes: int) -> None:
    """A view's strides: no two elements in one place, one dim contiguous, every element inside the storage."""
    dims = sorted((s, d) for s, d in zip(ref.stride, ref.size) if d > 1)
    leave_out = f"leave the tensor out with --exclude {shlex.quote(item.name)}"
    if DTYPE_BY_NAME[ref.dtype].bits % 8:
        raise InputError(
            f"{where}: a {ref.dtype} tensor saved with strides {list(ref.stride)}: mpicons reads sub-byte dtypes "
            f"row-major only; {leave_out}"
        )
    if any(s < 0 for s in ref.stride) or dims[0][0] != 1:
        raise InputError(
            f"{where}: saved with strides {list(ref.stride)}: no dimension is contiguous (a strided slice such as "
            f"x[:, ::2]); mpicons cannot read it at block cost: {leave_out}, or save a contiguous copy (.contiguous())"
        )
    for (inner, size), (outer, _) in zip(dims, dims[1:]):
        if outer < inner * size:
            raise InputError(f"{where}: strides {list(ref.stride)} make elements overlap for shape {list(ref.size)}")
    last = ref.storage_offset + sum((d - 1) * s for s, d in zip(ref.stride, ref.size))
    if (last + 1) * unit > stored_bytes:
        raise InputError(f"{where}: the view runs past the end of its storage ({stored_bytes} bytes)")


#: A tensor of a safetensors blob: dtype, shape, absolute data start, byte length, saved offsets.
_BlobEntry = tuple[str, tuple[int, ...], int, int, list[int] | None]


def _blob_entries(source: ByteSource, where: str, offset: int, peek: bytes) -> dict[str, _BlobEntry]:
    """The safetensors blob at ``offset`` (DCP's safetensors serialization): name → (dtype, shape, begin,
    saved offsets). ``peek``: the bytes at ``offset`` already read (at least its first 9 unless the file ends)."""
    path, size = source.name, source.size
    prefix = peek[:_BLOB_PREFIX]
    if len(prefix) < _BLOB_PREFIX or prefix[8:9] != b"{":
        raise InputError(f"{where}: the item at byte {offset} is neither a torch.save archive nor a safetensors blob")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_SIZE or offset + 8 + length > size:
        raise InputError(f"{path}: the safetensors blob at byte {offset} has a header length of {length} (damaged?)")
    raw = peek[8 : 8 + length] if 8 + length <= len(peek) else source.read_at(offset + 8, length)
    header = parse_header(raw, size - offset, f"{path} (safetensors blob at byte {offset})")
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
        entries[entry.name] = (
            entry.dtype,
            entry.shape,
            offset + header.data_start + entry.begin,
            entry.end - entry.begin,
            offsets,
        )
    return entries


def _blob_piece(blob: dict[str, _BlobEntry], where: str, item: Item) -> int:
    found = blob.get(item.name)
    if found is None:
        raise InputError(f"{where}: the file's safetensors blob does not hold this tensor")
    dtype, shape, begin, length, offsets = found
    if dtype != item.dtype or shape != item.shape:
        raise InputError(f"{where}: the blob holds {dtype} {list(shape)}, the metadata says {item.dtype} {list(item.shape)}")
    if length != item.item_length:
        raise InputError(
            f"{where}: the metadata records {item.item_length} bytes for this piece, the file's safetensors blob holds {length}"
        )
    if offsets is not None and tuple(offsets) != item.offsets:
        raise InputError(f"{where}: the blob's {SHARDING_KEY} places it at {offsets}")
    return begin


__all__ = ["STORAGE_DTYPES", "Item", "ItemProblem", "TensorUnpickler", "locate", "locate_all"]
