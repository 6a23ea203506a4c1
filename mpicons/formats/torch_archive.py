"""Whole ``torch.save`` archives read without torch (no MPI here): what their pickle holds, and where
each tensor's bytes lie in the file.

Trainers that do not use DCP (DeepSpeed ZeRO, verl's FSDP actor) save one ``torch.save`` archive per
rank, and others keep one beside their shards (Megatron's ``common.pt``: the run's arguments, read
as plain values by :func:`archive_value`). An archive is a zip whose ``data.pkl`` pickles a nested
structure (dicts, lists, tensors, a few of the trainer's own classes) and whose ``data/<key>``
members hold the tensors' storages, stored uncompressed. :func:`read_archive` reads the zip's
central directory and ``data.pkl`` (a few small reads, never the storages), unpickles it with the restricted unpickler of
:mod:`~mpicons.formats.unpickling` (the opcode pre-scan and budgets apply), and hands back the value
built from inert stand-ins only:

- a tensor is an :data:`ArchiveTensor` (storage key, dtype, shape, strides, storage offset);
- a tensor subclass torch rebuilds through ``_rebuild_wrapper_subclass`` (DTensor) is a
  :class:`SubclassTensor` holding its global dtype, shape and the pickled state (the local tensor);
- an object of a class the caller's :class:`~mpicons.formats.unpickling.AllowList` names is a
  :class:`~mpicons.formats.unpickling.Record` (the class's name, the arguments and the state the pickle
  gave it), an enum an ``EnumMember``; ``OrderedDict`` is a :class:`StateDict`; ``torch.Size`` a tuple.

Only the names the caller lists (by exact module and name) and torch's tensor machinery are
accepted; any other is refused before it is looked up, naming it. :meth:`TorchArchive.locate` then
turns tensors into absolute byte offsets in the file, from each storage member's local header
(whose extent is checked against the central directory and the next record). The facts are in
docs/torch-archive-format.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import pickle
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.errors import InputError
from ..core.safetensors_codec import DTYPE_BY_NAME
from .byte_sources import ByteSource, SourceWindow, opened
from .distcp_items import (
    Item,
    TensorUnpickler,
    _boundaries,
    _ints,
    _ItemBytes,
    _member_start,
    _rebuild_v2,
    _rebuild_v3,
    _TensorRef,
)
from .unpickling import NOTHING, AllowList, Budget, Record, TorchDType, record_class, shown, unpickle
from .zip_directory import check_directory, simple_members

#: A saved tensor: ``.storage`` (``.key``, ``.dtype``, ``.numel``), ``.storage_offset`` (elements),
#: ``.size``, ``.stride``, ``.dtype`` (safetensors name).
ArchiveTensor = _TensorRef

#: A global the pickle may name: (module, name), compared exactly.
Name = tuple[str, str]

#: Largest ``data.pkl`` and central directory read (far above what any trainer writes: a few MB).
MAX_PICKLE = 1 << 28
_TAIL = 1 << 16  # the archive's last bytes read first: its central directory, for the archives trainers write
_GAP = 1 << 16  # records closer than this are read in one go ...
_WINDOW = 1 << 20  # ... as long as that read stays this small

#: Dotted names of torch's tensor-subclass machinery a caller may allow (DTensor and the like): each
#: runs a stand-in function of its own, not a record.
REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
REBUILD_WRAPPER = "torch._utils._rebuild_wrapper_subclass"
REBUILD_PARAMETER = "torch._utils._rebuild_parameter"


class StateDict(dict[object, object]):
    """``collections.OrderedDict`` (a state dict): a dict in pickled order, whose pickled attributes
    (torch's ``_metadata``) are kept apart in ``attributes``, set once."""

    __slots__ = ("attributes",)

    def __setstate__(self, state: object) -> None:
        if hasattr(self, "attributes"):
            raise pickle.UnpicklingError("the pickle sets state on a state dict twice")
        self.attributes = state


def _refuse_state(self: object, state: object) -> None:
    raise pickle.UnpicklingError(f"the pickle sets state on a {type(self).__name__}")


@dataclass(frozen=True, slots=True)
class SubclassTensor:
    """A tensor subclass (DTensor) rebuilt by ``_rebuild_wrapper_subclass``: its class, global dtype,
    shape and strides, and the state ``_rebuild_from_type_v2`` gave it (DTensor: ``(None, {'_local_tensor':
    ..., '_spec': ...})``)."""

    kind: str
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    state: object = None

    __setstate__ = _refuse_state

    def field(self, name: str) -> object:
        """A field of the state (its dict part or its slots part)."""
        state = self.state
        parts = state if isinstance(state, tuple) else (state,)
        for part in parts:
            if isinstance(part, dict) and name in part:
                return part[name]
        return None


def _ordered_dict(budget: Budget, *args: object) -> StateDict:
    """``collections.OrderedDict()``: filled by the pickle's SETITEMS (or from one list of pairs)."""
    if not args:
        return StateDict()
    if len(args) == 1 and type(args[0]) is list and all(type(p) in (list, tuple) and len(p) == 2 for p in args[0]):
        budget.spend(len(args[0]))
        # The pre-scan weighs the keys of the dicts the pickle fills, not of pairs in a list: a key here
        # must be as cheap to hash (a name, an integer of at most 8 bytes) before the dict hashes it.
        if all(type(k) is str or (type(k) is int and -(1 << 63) <= k < 1 << 63) for k, _ in args[0]):
            return StateDict(args[0])
    raise pickle.UnpicklingError(f"OrderedDict of {shown(args)}")


def _size(budget: Budget, dims: object = ()) -> tuple[int, ...]:
    """``torch.Size(dims)``: the tuple of dimensions."""
    return _ints(budget, tuple(dims) if type(dims) is list else dims)


def _rebuild_wrapper(budget: Budget, cls: object, dtype: object, size: object, stride: object, *rest: object) -> SubclassTensor:
    """``_rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)``."""
    if not (isinstance(cls, type) and issubclass(cls, Record)) or not isinstance(dtype, TorchDType):
        raise pickle.UnpicklingError(f"a tensor subclass of {shown(cls)} with dtype {shown(dtype)}")
    return SubclassTensor(cls.kind, dtype.name, _ints(budget, size), _ints(budget, stride))


def _rebuild_from_type(budget: Budget, function: object, new_type: object, args: object, state: object) -> object:
    """``_rebuild_from_type_v2(function, new_type, args, state)``: ``function(*args)`` (one of the stand-ins
    the pickle could call anyway), then the state: a subclass keeps it; a plain tensor's Python
    attributes (DeepSpeed's ``ds_id``) are dropped."""
    if not callable(function) or type(args) is not tuple or not (isinstance(new_type, type) and issubclass(new_type, Record)):
        raise pickle.UnpicklingError(f"a tensor rebuilt as {shown(new_type)}")
    built = function(*args)
    if isinstance(built, SubclassTensor):
        if built.kind != new_type.kind or built.state is not None:
            raise pickle.UnpicklingError(f"a {built.kind} rebuilt as {new_type.kind}")
        return dataclasses.replace(built, state=state)
    if isinstance(built, _TensorRef) and new_type.kind == "torch.Tensor":
        return built
    raise pickle.UnpicklingError(f"a {type(built).__name__} rebuilt as {new_type.kind}")


def _rebuild_parameter(budget: Budget, data: object, *rest: object) -> object:
    """``_rebuild_parameter(data, requires_grad, hooks[, state])``: an ``nn.Parameter`` is its tensor."""
    if not isinstance(data, _TensorRef):
        raise pickle.UnpicklingError(f"a parameter of {shown(data)}")
    return data


#: What torch's tensor machinery pickles, beside the storage classes and dtypes (always accepted).
_TENSOR_FUNCTIONS: dict[Name, Callable[..., object]] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch", "Size"): _size,
}


def _called(kind: str) -> Callable[..., Record]:
    """A class torch pickles as a call (``torch.device('cuda', 0)``): a record of the arguments."""

    def call(budget: Budget, *args: object) -> Record:
        budget.spend(len(args))
        cls = record_class(kind)
        return cls.__new__(cls, *args)

    call.__name__ = kind
    return call


#: Functions accepted only when the caller's allow-list names them.
_SUBCLASS_FUNCTIONS: dict[Name, Callable[..., object]] = {
    ("torch", "device"): _called("torch.device"),
    ("torch.serialization", "_get_layout"): _called("torch.serialization._get_layout"),
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _ArchiveUnpickler(TensorUnpickler):
    """Unpickles a whole archive's ``data.pkl``: torch's tensor machinery plus the caller's names, as stand-ins."""

    functions = _TENSOR_FUNCTIONS

    def functions_for(self, allow: AllowList) -> dict[Name, Callable[..., object]]:
        return {**self.functions, **{key: f for key, f in _SUBCLASS_FUNCTIONS.items() if key in allow.records}}


class _ArchiveBytes(_ItemBytes):
    """The archive's records as read: its tail (central directory) and windows fetched ahead, each
    range of nearby records in one read; anything else is read when asked for."""

    def __init__(self, source: ByteSource, tail: bytes) -> None:
        super().__init__(source, Item(source.name, "", (), (), 0, source.size), b"", tail)
        self.starts: list[int] = []
        self.windows: list[bytes] = []

    def fetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Read ``(offset, length)`` ranges, merging those less than :data:`_GAP` apart into reads of
        at most :data:`_WINDOW` (a range longer than that is one read of its own)."""
        merged: list[list[int]] = []
        for start, length in sorted(ranges):
            end = min(start + length, self.source.size)
            if merged and start - merged[-1][1] <= _GAP and end - merged[-1][0] <= _WINDOW:
                merged[-1][1] = max(merged[-1][1], end)
            elif end > start:
                merged.append([start, end])
        for start, end in merged:
            at = bisect.bisect(self.starts, start)
            self.starts.insert(at, start)
            self.windows.insert(at, self.source.read_at(start, end - start))

    def read(self, at: int, length: int) -> bytes:
        i = bisect.bisect(self.starts, at) - 1
        if i >= 0 and at + length <= self.starts[i] + len(self.windows[i]):
            return self.windows[i][at - self.starts[i] : at - self.starts[i] + length]
        return super().read(at, length)


class _BoundedWindow(SourceWindow):
    """The whole file for :mod:`zipfile`, refusing any one read past :data:`MAX_PICKLE` (a damaged
    central directory cannot make it read a huge file into memory)."""

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._length - self._position)
        size = left if size is None or size < 0 else min(size, left)
        if size > MAX_PICKLE:
            raise OSError("a record of the archive claims more than 256 MiB")
        return super().read(size) or b""


@dataclass
class TorchArchive:
    """One ``torch.save`` archive: its file, the unpickled ``data.pkl`` and its members."""

    name: str  # the file, for messages
    root: str  # the archive's folder inside the zip
    value: object  # what data.pkl holds, built from stand-ins
    members: dict[str, tuple[int, int, int]]  # name → (compression, size, local header offset)
    boundary: dict[int, int]  # local header offset → where the next record starts
    records: _ArchiveBytes

    def tensors(self) -> list[ArchiveTensor]:
        """Every tensor ``data.pkl`` holds (each once), in pickled order."""
        return tensors_in(self.value)

    def locate(self, tensors: Sequence[ArchiveTensor], labels: Sequence[str] | None = None) -> np.ndarray:
        """int64 absolute byte offset in the file of each tensor's element 0, after checking that its
        storage is a stored (uncompressed) member whose records agree on its extent and that every
        element lies inside it. ``labels`` name the tensors in messages (e.g. their state-dict keys)."""
        labels = labels if labels is not None else [f"storage {t.storage.key!r}" for t in tensors]
        wanted: dict[str, tuple[str, int, int]] = {}
        for tensor, label in zip(tensors, labels):
            if tensor.storage.key not in wanted:
                wanted[tensor.storage.key] = self._member(tensor.storage.key, label)
        self.records.fetch([r for _, size, local in wanted.values() for r in self._record_ranges(local)])
        starts = {
            key: _member_start(self.records, self.name, self.item, name, local, size, self.boundary[local])
            for key, (name, size, local) in wanted.items()
        }
        begins = np.zeros(len(tensors), dtype=np.int64)
        for i, (tensor, label) in enumerate(zip(tensors, labels)):
            _check_extent(self.name, label, tensor, wanted[tensor.storage.key][1])
            begins[i] = starts[tensor.storage.key] + tensor.storage_offset * DTYPE_BY_NAME[tensor.dtype].bits // 8
        return begins

    @property
    def item(self) -> Item:
        """The whole file as the archive readers of :mod:`~mpicons.formats.distcp_items` see an item."""
        return Item(self.name, "", (), (), 0, self.records.source.size)

    def _member(self, key: str, label: str) -> tuple[str, int, int]:
        name = f"{self.root}/data/{key}"
        member = self.members.get(name)
        if member is None:
            raise InputError(f"{self.name}: {label}: the archive has no storage {key!r} (damaged or truncated?)")
        if member[0] != zipfile.ZIP_STORED:
            raise InputError(f"{self.name}: {label}: unsupported: its storage is compressed in the archive")
        return name, member[1], member[2]

    def _record_ranges(self, local: int) -> list[tuple[int, int]]:
        """Where a member's local header and its data descriptor (just before the next record) lie."""
        return [(local, 30 + len(self.root) + 64), (max(local, self.boundary[local] - 32), 32)]


def _check_extent(path: str, label: str, tensor: ArchiveTensor, member_size: int) -> None:
    """The storage's pickled size must be its member's, and every element of the tensor inside it."""
    unit = DTYPE_BY_NAME[tensor.dtype].bits // 8
    storage = tensor.storage
    stored = storage.numel * (unit if storage.dtype is not None else 1)
    if stored != member_size:
        raise InputError(
            f"{path}: {label}: its storage {storage.key!r} is {member_size} bytes in the archive, its pickle says "
            f"{stored} (damaged or truncated?)"
        )
    if len(tensor.stride) != len(tensor.size):
        raise InputError(f"{path}: {label}: stride {list(tensor.stride)} does not match shape {list(tensor.size)}")
    if DTYPE_BY_NAME[tensor.dtype].bits % 8:
        raise InputError(f"{path}: {label}: unsupported: a {tensor.dtype} tensor inside a torch.save archive")
    if tensor.storage_offset < 0 or tensor.storage_offset * unit > member_size:  # an empty tensor's too
        raise InputError(
            f"{path}: {label}: it starts at element {tensor.storage_offset}, outside its {member_size}-byte "
            f"storage {storage.key!r} (damaged or made up?)"
        )
    if 0 in tensor.size:
        return
    last = tensor.storage_offset + sum((d - 1) * s for d, s in zip(tensor.size, tensor.stride))
    if (last + 1) * unit > member_size:
        raise InputError(
            f"{path}: {label}: {tensor.dtype} {list(tensor.size)} at element {tensor.storage_offset} runs past the end "
            f"of its {member_size}-byte storage {storage.key!r} (damaged or truncated?)"
        )


def is_row_major(tensor: ArchiveTensor | SubclassTensor) -> bool:
    """The tensor's elements lie in C order one after another (what every reader here assumes)."""
    step = 1
    for dim, stride in zip(reversed(tensor.size), reversed(tensor.stride)):
        if dim > 1 and stride != step:
            return False
        step *= dim
    return True


def tensors_in(value: object) -> list[ArchiveTensor]:
    """Every tensor inside ``value`` (dicts, lists, tuples, records, subclass states), each once, in pickled order."""
    return [item for item in walk(value) if isinstance(item, _TensorRef)]


def walk(value: object) -> Iterator[object]:
    """``value`` and everything inside it (dict values, items, records' arguments and state, subclass
    tensors' state), each object once, in pickled order; iterative, so any nesting is walked."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, Record):
            stack.extend([item.state, item.args])
        elif isinstance(item, SubclassTensor):
            stack.append(item.state)


def read_archive(source: ByteSource, allow: AllowList, kind: str, fast: bool = True) -> TorchArchive:
    """The ``torch.save`` archive read through ``source`` (which :meth:`TorchArchive.locate` reads on: the
    caller closes it when done): its central directory and ``data.pkl``, unpickled with torch's tensor
    machinery and the classes ``allow`` names (exact module and name) as inert stand-ins. ``kind``
    names the format for messages ("DeepSpeed ZeRO checkpoints", ...).
    ``fast=False`` reads the central directory through :mod:`zipfile` (as is done anyway when it is
    not laid out the simple way ``torch.save`` writes it)."""
    path = source.name
    tail = source.read_at(max(0, source.size - _TAIL), min(source.size, _TAIL))
    found = simple_members(tail, source.size) if fast else None
    members, central = found if found is not None else _zipfile_members(source)
    pickles = [name for name in members if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise InputError(f"{path}: not a torch.save archive ({len(pickles)} data.pkl records; damaged, or another zip file?)")
    root = pickles[0].split("/")[0]
    records = _ArchiveBytes(source, tail)
    boundary = _boundaries([member[2] for member in members.values()], central)
    method, size, local = members[pickles[0]]
    if method != zipfile.ZIP_STORED:
        raise InputError(f"{path}: unsupported: the torch.save archive is compressed")
    if size > MAX_PICKLE:
        raise InputError(f"{path}: its data.pkl claims {size} bytes (more than 256 MiB: damaged?)")
    order = members.get(f"{root}/byteorder", (0, 0, local))[2]  # torch writes it a few records after data.pkl
    records.fetch([(local, 30 + len(pickles[0]) + 64 + size + 32), (order, 30 + len(root) + 160)])
    item = Item(path, "", (), (), 0, source.size)
    start = _member_start(records, path, item, pickles[0], local, size, boundary[local])
    _check_byte_order(records, item, root, members, boundary)
    pickled = records.read(start, size)
    value = unpickle(pickled, _ArchiveUnpickler, path, "its data.pkl", allow, f"a torch.save archive of {kind}")
    return TorchArchive(path, root, value, members, boundary, records)


#: The folder ``torch.save`` gives an archive saved to a stream instead of a path.
STREAM_ROOT = "archive"


def check_root(archive: TorchArchive, file: str) -> None:
    """An archive saved to a path keeps its file's stem as its folder: one whose folder names another
    file is that file, renamed (two ranks' files swapped, a copy standing in for a missing one)."""
    stem = file.rsplit("/", 1)[-1].removesuffix(".pt")
    if archive.root not in (stem, STREAM_ROOT):
        raise InputError(
            f"{archive.name}: this archive was saved as {archive.root}.pt (its folder inside the zip says so), "
            f"not as {file}: files renamed or swapped? Put each rank's file back under its own name"
        )


def archive_value(source: ByteSource | str, allow: AllowList = NOTHING, what: str = "a torch.save archive") -> object:
    """The value pickled in the archive at ``source`` (a path or an open source), its storages never
    read: what a trainer keeps beside its shards (Megatron's ``common.pt``)."""
    with opened(source) as readable:
        return read_archive(readable, allow, what).value


def _check_byte_order(
    records: _ArchiveBytes, item: Item, root: str, members: dict[str, tuple[int, int, int]], boundary: dict[int, int]
) -> None:
    """Storages are little-endian unless the archive's ``byteorder`` record says otherwise (torch before 2.1 wrote none)."""
    member = members.get(f"{root}/byteorder")
    if member is None:
        return
    order = b"?"
    if member[1] <= 16:
        start = _member_start(records, item.name, item, f"{root}/byteorder", member[2], member[1], boundary[member[2]])
        order = records.read(start, member[1])
    if order != b"little":
        raise InputError(f"{item.name}: unsupported: its storages are not little-endian (byteorder {shown(order)})")


def _zipfile_members(source: ByteSource) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Members and central directory offset of any zip archive, read through :mod:`zipfile` in bounded reads
    once :func:`~mpicons.formats.zip_directory.check_directory` has bounded its entries."""
    check_directory(source.read_at, source.size, source.name)
    try:
        archive = zipfile.ZipFile(_BoundedWindow(source, 0, source.size))
        members = {}
        for info in archive.infolist():
            if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                raise zipfile.BadZipFile(f"the records of {info.filename} disagree on its size")
            members[info.filename] = (info.compress_type, info.file_size, info.header_offset)
        return members, archive.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
        raise InputError(f"{source.name}: not a readable torch.save archive ({exc}; damaged or truncated?)") from None


__all__ = [
    "STREAM_ROOT",
    "check_root",
    "MAX_PICKLE",
    "REBUILD_FROM_TYPE",
    "REBUILD_PARAMETER",
    "REBUILD_WRAPPER",
    "ArchiveTensor",
    "Name",
    "Record",
    "AllowList",
    "StateDict",
    "SubclassTensor",
    "TorchArchive",
    "archive_value",
    "is_row_major",
    "read_archive",
    "record_class",
    "tensors_in",
    "walk",
]
