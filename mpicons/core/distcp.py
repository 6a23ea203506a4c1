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
import reprlib
import shlex
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from .errors import InputError
from .format import DTYPE_BY_NAME, DTYPE_ORDER, DTYPES, MAX_DIM, MAX_HEADER_SIZE, MAX_NDIM, parse_header

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


class _Sealed:
    """A value the unpicklers hand out: a pickle cannot change it (no ``__dict__``; BUILD, the only
    opcode that sets state on an object it did not make, is refused), so what one input does to it
    can never change how the next one is read."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise pickle.UnpicklingError(f"the pickle sets state on {self!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")


class _TorchDType(_Sealed):
    """A torch dtype named by the pickle, as its safetensors name."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return f"torch dtype {self.name}"


#: One read-only stand-in per torch dtype name.
_TORCH_DTYPE_STANDINS = {name: _TorchDType(dtype) for name, dtype in TORCH_DTYPES.items()}


class _Budget:
    """What the stand-in functions may build for one pickle, in proportion to its size: a pickle
    that names a large value again and again through its memo cannot make them copy it each time."""

    __slots__ = ("left",)

    def __init__(self, data_size: int) -> None:
        self.left = 4 * data_size + (1 << 16)

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < 0:
            raise _Bound("it builds values far larger than the file")


class _Function(_Sealed):
    """One of the functions a pickle may call, bound to the budget of the pickle being read."""

    __slots__ = ("function", "budget")
    function: Callable[..., object]
    budget: _Budget

    def __init__(self, function: Callable[..., object], budget: _Budget) -> None:
        object.__setattr__(self, "function", function)
        object.__setattr__(self, "budget", budget)

    def __call__(self, *args: object) -> object:
        self.budget.spend(len(args))
        return self.function(self.budget, *args)

    def __repr__(self) -> str:
        return f"function {self.function.__name__}"


def _size(budget: _Budget, dims: object = ()) -> tuple[int, ...]:
    """``torch.Size(dims)``: a tuple (its items are checked in bulk when the columns are made)."""
    if type(dims) is tuple or type(dims) is list:
        if len(dims) > MAX_NDIM:
            raise pickle.UnpicklingError(f"torch.Size of {len(dims)} dimensions (mpicons reads at most {MAX_NDIM})")
        budget.spend(len(dims))
        return tuple(dims)
    raise pickle.UnpicklingError(f"torch.Size of a {type(dims).__name__}")


def _text(budget: _Budget, *parts: object) -> str:
    """``PosixPath(...)``, ``_get_layout(...)``: kept as text."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("expected text")
    texts = [str(p) for p in parts]
    budget.spend(sum(map(len, texts)))
    return "/".join(texts)


def _enum_value(budget: _Budget, value: object) -> object:
    """``_MEM_FORMAT_ENCODING(n)``: the number."""
    if type(value) is not int:
        raise pickle.UnpicklingError(f"memory format {_shown(value)}")
    return value


_METADATA_FUNCTIONS: dict[tuple[str, str], Callable[..., object]] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _text,
    (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): _enum_value,
    **{("pathlib", name): _text for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
}


class _Refused(Exception):
    """The pickle names something mpicons does not stand in for."""


class _Bound(Exception):
    """The pickle passes one of the bounds on what reading it may build."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxtuple, _SHOWN.maxlist, _SHOWN.maxdict = 3, 80, 80, 8, 8, 8


def _shown(value: object) -> str:
    """A value from an input, shortened for a message (a hostile value can be huge or deeply nested)."""
    try:
        return _SHOWN.repr(value)
    except Exception:  # a stand-in's repr cannot fail, but a message must never be what fails
        return f"a {type(value).__name__}"


def _torch_dtype(module: str, name: str) -> _TorchDType | None:
    return _TORCH_DTYPE_STANDINS.get(name) if module == "torch" else None


class _Unpickler(pickle.Unpickler):
    """A restricted unpickler: ``find_class`` hands out only read-only stand-ins (functions bound to
    this pickle's budget, made afresh for each pickle) and refuses every other name."""

    functions: dict[tuple[str, str], Callable[..., object]] = {}
    others: dict[tuple[str, str], object] = {}

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        budget = _Budget(len(data))
        self._found = {key: _Function(function, budget) for key, function in self.functions.items()}

    def find_class(self, module: str, name: str) -> Any:
        found = self._found.get((module, name)) or self.others.get((module, name)) or _torch_dtype(module, name)
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _MetadataUnpickler(_Unpickler):
    """Unpickles DCP's ``Metadata`` into stand-ins; refuses every other global (nothing it names is imported)."""

    functions = _METADATA_FUNCTIONS
    others = dict(_RECORDS)

    def persistent_load(self, pid: object) -> Any:
        raise _Refused("a persistent id")


_UNREADABLE = (
    pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError,
    OverflowError, UnicodeError,
)  # fmt: skip


def _unpickle(data: bytes, unpickler: type[_Unpickler], path: str, what: str) -> object:
    """``data`` unpickled with ``unpickler`` after :func:`_check_opcodes`; every failure is bad input."""
    try:
        _check_opcodes(data)
        return unpickler(data).load()
    except _Refused as exc:
        raise InputError(
            f"{path}: unsupported: {what} names {exc}, which is not part of DCP's checkpoint format "
            "(refused without running anything)"
        ) from None
    except _Bound as exc:
        raise InputError(
            f"{path}: {what} is refused: {exc} (a {len(data)}-byte pickle; damaged or not written by torch?)"
        ) from None
    except _UNREADABLE as exc:
        raise InputError(f"{path}: {what} is not a readable pickle ({type(exc).__name__}: {_shown(str(exc))})") from None
    except MemoryError:
        raise InputError(f"{path}: {what} is not a readable pickle (it asks for more memory than there is)") from None


# ---------------------------------------------------------------- bounds checked before unpickling

#: Nesting deeper than this is refused before anything is built: DCP's metadata nests about a dozen
#: levels, and Python's unpickler hashes dict keys recursively (a tuple nested 100,000 deep crashes it).
MAX_DEPTH = 64

# Opcode kinds of the pre-scan (see :func:`_check_opcodes`).
_ATOM, _COUNTED, _LINE, _EMPTY, _MEMOIZE, _GET, _PUT, _TUPLE_N, _FROM_MARK, _INTO_MARK = range(10)
_MARK, _REDUCE, _BUILD, _APPEND, _SETITEM, _POP, _POP_MARK, _DUP, _STACK_GLOBAL, _PERSID = range(10, 20)
_NEWOBJ, _NEWOBJ_EX, _GLOBAL, _INST, _FRAME, _PROTO, _STOP = range(20, 27)
_KIND: dict[bytes, tuple[int, int]] = {  # opcode → (kind, argument bytes or length-prefix bytes)
    **{op: (_ATOM, 0) for op in (b"N", b"\x88", b"\x89")},
    b"K": (_ATOM, 1), b"M": (_ATOM, 2), b"J": (_ATOM, 4), b"G": (_ATOM, 8),
    **{op: (_COUNTED, 1) for op in (b"\x8c", b"C", b"U", b"\x8a")},
    **{op: (_COUNTED, 4) for op in (b"X", b"B", b"T", b"\x8b")},
    **{op: (_COUNTED, 8) for op in (b"\x8d", b"\x8e", b"\x96")},
    **{op: (_LINE, 0) for op in (b"I", b"L", b"F", b"S", b"V")},
    **{op: (_EMPTY, 0) for op in (b"]", b")", b"}", b"\x8f")},
    b"\x94": (_MEMOIZE, 0), b"g": (_GET, -1), b"h": (_GET, 1), b"j": (_GET, 4),
    b"p": (_PUT, -1), b"q": (_PUT, 1), b"r": (_PUT, 4),
    b"\x85": (_TUPLE_N, 1), b"\x86": (_TUPLE_N, 2), b"\x87": (_TUPLE_N, 3),
    **{op: (_FROM_MARK, 0) for op in (b"t", b"l", b"d", b"\x91", b"o")},
    **{op: (_INTO_MARK, 0) for op in (b"e", b"u", b"\x90")},
    b"(": (_MARK, 0), b"R": (_REDUCE, 0), b"b": (_BUILD, 0), b"a": (_APPEND, 0), b"s": (_SETITEM, 0),
    b"0": (_POP, 0), b"1": (_POP_MARK, 0), b"2": (_DUP, 0), b"\x93": (_STACK_GLOBAL, 0),
    b"P": (_PERSID, -1), b"Q": (_PERSID, 0), b"\x81": (_NEWOBJ, 0), b"\x92": (_NEWOBJ_EX, 0),
    b"c": (_GLOBAL, 0), b"i": (_INST, 0), b"\x95": (_FRAME, 8), b"\x80": (_PROTO, 1), b".": (_STOP, 0),
}  # fmt: skip
_KINDS = [_KIND.get(bytes([op]), (-1, 0)) for op in range(256)]


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes once, without building anything, and refuse what would make the
    unpickler take memory out of proportion to the file or crash: a memo index beyond the entries
    stored so far (the unpickler grows its memo array to the largest index), a length reaching past
    the end of the data, nesting deeper than :data:`MAX_DEPTH`, opcodes DCP's pickles never use
    (extension registry, out-of-band buffers). Linear: one step per opcode, the common ones inline."""
    try:
        _walk(data)
    except IndexError:
        raise pickle.UnpicklingError("the pickle takes more values from its stack or memo than it put there") from None


def _walk(data: bytes) -> None:
    kinds, size, at, from_bytes, limit = _KINDS, len(data), 0, int.from_bytes, MAX_DEPTH
    # The kinds as local names: the loop runs once per opcode.
    memoize, get, atom, mark, empty, tuple_n, reduce, newobj, build, from_mark, into_mark, counted = (
        _MEMOIZE,
        _GET,
        _ATOM,
        _MARK,
        _EMPTY,
        _TUPLE_N,
        _REDUCE,
        _NEWOBJ,
        _BUILD,
        _FROM_MARK,
        _INTO_MARK,
        _COUNTED,
    )
    stack: list[int] = []  # nesting depth of each value on the unpickler's stack
    marks: list[int] = []
    memo: list[int] = []
    while at < size:
        kind, arg = kinds[data[at]]
        at += 1
        if kind == memoize:
            memo.append(stack[-1])
        elif kind == get:
            if arg == 1:
                stack.append(memo[data[at]])
                at += 1
            elif arg == 4:
                stack.append(memo[from_bytes(data[at : at + 4], "little")])
                at += 4
            else:
                index, at = _opcode_index(data, at, arg)
                stack.append(memo[index])
        elif kind == atom:
            stack.append(0)
            at += arg
        elif kind == mark:
            marks.append(len(stack))
        elif kind == empty:
            stack.append(1)
        elif kind == tuple_n:
            if len(stack) < arg:
                raise IndexError
            depth = 1 + max(stack[-arg:])
            del stack[-arg:]
            stack.append(depth)
            if depth > limit:
                _deep(depth)
        elif kind == reduce or kind == newobj:
            depth = stack.pop()
            stack[-1] = depth if depth > 1 else 1
        elif kind == build:
            depth = 1 + stack.pop()
            if depth > stack[-1]:
                stack[-1] = depth if depth <= limit else _deep(depth)
        elif kind == from_mark or kind == into_mark:
            start = marks.pop()
            depth = 1 + max(stack[start:], default=0)
            del stack[start:]
            if kind == into_mark:
                stack[-1] = _deep(max(stack[-1], depth))
            else:
                stack.append(_deep(depth))
        elif kind == counted:
            at += arg + from_bytes(data[at : at + arg], "little")
            if at > size:
                raise pickle.UnpicklingError("a value reaches past the end of the pickle")
            stack.append(0)
        else:
            at = _rare_opcode(data, at, data[at - 1], kind, arg, stack, marks, memo)
            if at < 0:
                return
    raise pickle.UnpicklingError("the pickle ends without a STOP")


def _deep(depth: int) -> int:
    if depth > MAX_DEPTH:
        raise _Bound(f"it nests values more than {MAX_DEPTH} deep")
    return depth


def _opcode_index(data: bytes, at: int, width: int) -> tuple[int, int]:
    """A memo index: ``width`` little-endian bytes, or a decimal line when ``width`` is -1."""
    if width > 0:
        if at + width > len(data):
            raise pickle.UnpicklingError("the pickle is truncated")
        return int.from_bytes(data[at : at + width], "little"), at + width
    end = data.find(b"\n", at)
    if end < 0 or not data[at:end].isdigit() or end - at > 18:
        raise pickle.UnpicklingError("a malformed memo index")
    return int(data[at:end]), end + 1


def _pop(stack: list[int], count: int) -> int:
    """Remove ``count`` values; the deepest of them."""
    if len(stack) < count:
        raise pickle.UnpicklingError("stack underflow")
    deepest = max(stack[len(stack) - count :], default=0)
    del stack[len(stack) - count :]
    return deepest


def _line_end(data: bytes, at: int, lines: int = 1) -> int:
    for _ in range(lines):
        end = data.find(b"\n", at)
        if end < 0:
            raise pickle.UnpicklingError("the pickle is truncated")
        at = end + 1
    return at


def _rare_opcode(data: bytes, at: int, op: int, kind: int, arg: int, stack: list[int], marks: list[int], memo: list[int]) -> int:
    """:func:`_check_opcodes` for the opcodes that are not in every piece's record; -1 at STOP."""
    if kind == _PUT:
        index, at = _opcode_index(data, at, arg)
        if index > len(memo):
            raise _Bound(f"it stores memo entry {index} after {len(memo)} entries")
        if not stack:
            raise pickle.UnpicklingError("PUT on an empty stack")
        memo.append(stack[-1]) if index == len(memo) else memo.__setitem__(index, stack[-1])
    elif kind in (_NEWOBJ_EX, _STACK_GLOBAL):
        deepest = _pop(stack, 3 if kind == _NEWOBJ_EX else 2)
        stack.append(0 if kind == _STACK_GLOBAL else max(deepest, 1))
    elif kind in (_APPEND, _SETITEM):
        depth = 1 + _pop(stack, 2 if kind == _SETITEM else 1)
        if not stack:
            raise pickle.UnpicklingError("stack underflow")
        stack[-1] = _deep(max(stack[-1], depth))
    elif kind == _POP:
        if marks and marks[-1] == len(stack):
            marks.pop()
        else:
            _pop(stack, 1)
    elif kind == _POP_MARK:
        if not marks:
            raise pickle.UnpicklingError("no MARK")
        del stack[marks.pop() :]
    elif kind == _DUP:
        stack.append(stack[-1])
    elif kind == _PERSID:
        if arg < 0:
            at = _line_end(data, at)
            stack.append(1)
        else:
            stack.append(max(_pop(stack, 1), 1))
    elif kind in (_LINE, _GLOBAL):
        at = _line_end(data, at, 2 if kind == _GLOBAL else 1)
        stack.append(0)
    elif kind == _INST:
        at = _line_end(data, at, 2)
        if not marks:
            raise pickle.UnpicklingError("no MARK")
        start = marks.pop()
        depth = 1 + max(stack[start:], default=0)
        del stack[start:]
        stack.append(_deep(depth))
    elif kind == _FRAME:
        if at + 8 > len(data) or at + 8 + int.from_bytes(data[at : at + 8], "little") > len(data):
            raise pickle.UnpicklingError("a frame reaches past the end of the pickle")
        at += 8
    elif kind == _PROTO:
        at += 1
    elif kind == _STOP:
        return -1
    else:
        raise pickle.UnpicklingError(f"opcode {bytes([op])!r}, which DCP's pickles do not use")
    return at


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
        raise InputError(f"{path}: tensor {name!r}: unsupported dtype {_shown(dtype)} (safetensors cannot hold it)")
    if layout != "torch.strided":
        raise InputError(f"{path}: tensor {name!r}: unsupported layout {_shown(layout)} (only dense tensors)")
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
            raise _bad_metadata(path, f"storage key {_shown(where)}")
        if not (type(file) is str and type(offset) is int and type(length) is int and 0 <= offset < MAX_DIM - length <= MAX_DIM):
            raise _bad_metadata(
                path,
                f"storage entry of tensor {fqn!r} at {list(offsets)}: {_shown(info)} "
                "(expected a file name and a non-negative offset and length whose sum is below 2**63)",
            )
        if file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
            raise InputError(f"{path}: tensor {fqn!r}: data file {file!r} is not a file name inside the checkpoint directory")
        if info.get("transform_descriptors"):
            raise InputError(
                f"{path}: tensor {fqn!r}: unsupported: stored through stream transforms {_shown(info['transform_descriptors'])} "
                "(a compression extension); save without it"
            )
        index[(fqn, offsets)] = (file, offset, length)
    return index


def _padded(rows: Sequence[tuple[int, ...]], width: int, fill: int, path: str, what: str) -> np.ndarray:
    """Ragged tuples of non-negative ints as an int64 array padded with ``fill`` (checked in bulk)."""
    flat = list(itertools.chain.from_iterable(rows))
    if not set(map(type, flat)) <= {int} or (flat and not 0 <= min(flat) <= max(flat) < MAX_DIM):
        bad = next(row for row in rows if not all(type(v) is int and 0 <= v < MAX_DIM for v in row))
        raise _bad_metadata(path, f"{what} {_shown(bad)} is not a tuple of non-negative 64-bit integers")
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
            raise _bad_metadata(path, f"entry name {_shown(name)} is not text")
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
    _check_names(entries, path)
    saved_order = [n for n in planner if type(n) is str and n in entries] if isinstance(planner, dict) else []
    in_order = set(saved_order)
    saved_order += [n for n in entries if n not in in_order]
    tensors: dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    skipped = []
    for name, entry in entries.items():
        if isinstance(entry, _Record) and entry.kind == "BytesStorageMetadata":
            skipped.append(name)
            continue
        fields = _fields(entry, "TensorStorageMetadata", path)
        dtype, size, chunks = _dtype_of(fields.get("properties"), name, path), fields.get("size"), fields.get("chunks")
        if not _is_box(size) or type(chunks) is not list:
            raise _bad_metadata(
                path, f"tensor {name!r}: size {_shown(size)} (a tuple of non-negative 64-bit integers?), chunks {_shown(chunks)}"
            )
        _check_tensor_bytes(path, name, dtype, size)
        boxes = []
        for chunk in chunks:
            box = _fields(chunk, "ChunkStorageMetadata", path)
            offsets, sizes = box.get("offsets"), box.get("sizes")
            if not (_is_box(offsets) and _is_box(sizes) and len(offsets) == len(sizes) == len(size)):
                raise InputError(
                    f"{path}: tensor {name!r} (size {list(size)}): chunk {_shown(box)} is not {len(size)} non-negative "
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


# ---------------------------------------------------------------- the items in the data files


def _refuse_state(self: object, state: object) -> None:
    raise pickle.UnpicklingError(f"the pickle sets state on a {type(self).__name__}")


class _StorageType(_Sealed):
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


def _ints(budget: _Budget, value: object) -> tuple[int, ...]:
    if type(value) is not tuple or len(value) > MAX_NDIM:
        raise pickle.UnpicklingError(f"expected a tuple of at most {MAX_NDIM} ints, got {_shown(value)}")
    budget.spend(len(value))
    if not all(type(v) is int and 0 <= v < MAX_DIM for v in value):
        raise pickle.UnpicklingError(f"expected a tuple of non-negative 64-bit ints, got {_shown(value)}")
    return value


def _rebuild(
    budget: _Budget, storage: object, storage_offset: object, size: object, stride: object, dtype: str | None
) -> _TensorRef:
    if not isinstance(storage, _Storage) or type(storage_offset) is not int or not 0 <= storage_offset < MAX_DIM:
        raise pickle.UnpicklingError("a tensor without a storage")
    dtype = storage.dtype or dtype
    if dtype is None:
        raise pickle.UnpicklingError("a tensor without a dtype")
    return _TensorRef(storage, storage_offset, _ints(budget, size), _ints(budget, stride), dtype)


def _rebuild_v2(
    budget: _Budget, storage: object, storage_offset: object, size: object, stride: object, *rest: object
) -> _TensorRef:
    """``torch._utils._rebuild_tensor_v2``: storage, offset, size, stride, requires_grad, hooks[, metadata]."""
    return _rebuild(budget, storage, storage_offset, size, stride, None)


def _rebuild_v3(
    budget: _Budget,
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
        raise pickle.UnpicklingError(f"dtype {_shown(dtype)}")
    return _rebuild(budget, storage, storage_offset, size, stride, dtype.name)


def _no_hooks(budget: _Budget, *args: object) -> dict[str, object]:
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


class _TensorUnpickler(_Unpickler):
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
        raise pickle.UnpicklingError(f"persistent id {_shown(pid)}")


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


@dataclass(frozen=True)
class ItemProblem:
    """Why one item cannot be read: its index in the items asked for, its tensor and the message."""

    index: int
    tensor: str
    message: str


def locate(path: str, items: Sequence[Item], fast: bool = True) -> np.ndarray:
    """The absolute offset in the data file at ``path`` where each item's piece (C order) begins.

    Raises InputError at the first item that cannot be read (see :func:`locate_all`).
    """
    begins, problems = locate_all(path, items, fast)
    if problems:
        raise InputError(problems[0].message)
    return begins


def locate_all(path: str, items: Sequence[Item], fast: bool = True) -> tuple[np.ndarray, list[ItemProblem]]:
    """Where each item's piece begins in the data file at ``path``, and every item that cannot be read.

    ``fast``: read archives laid out as ``torch.save`` writes them with two small reads each (their
    first and last 4 KiB), and any other through :mod:`zipfile` (``False``: every one through it).
    A problem names the file, the tensor and what does not agree with the metadata; the file itself
    not being readable raises InputError.
    """
    pickles: dict[bytes, object] = {}  # data.pkl → what it says: pieces of one shape pickle alike
    begins = np.zeros(len(items), dtype=np.int64)
    problems: list[ItemProblem] = []
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        blobs: dict[int, dict[str, _BlobEntry]] = {}
        for i, item in enumerate(items):
            try:
                begins[i] = _locate_one(fd, path, size, item, pickles, blobs, fast)
            except InputError as exc:
                problems.append(ItemProblem(i, item.name, str(exc)))
    finally:
        os.close(fd)
    return begins, problems


def _locate_one(
    fd: int, path: str, size: int, item: Item, pickles: dict[bytes, object], blobs: dict[int, dict[str, _BlobEntry]], fast: bool
) -> int:
    where = f"{path}: tensor {item.name!r} (piece at {list(item.offsets)})"
    if item.item_offset + item.item_length > size:
        raise InputError(
            f"{where}: its item at byte {item.item_offset} ({item.item_length} bytes) runs past the end "
            f"of the {size}-byte file (truncated?)"
        )
    if os.pread(fd, 4, item.item_offset) == _ZIP_LOCAL:
        return _archive_piece(fd, where, item, pickles, fast)
    blob = blobs.get(item.item_offset)
    if blob is None:
        blob = blobs[item.item_offset] = _blob_entries(fd, path, where, item.item_offset, size)
    return _blob_piece(blob, where, item)


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_LOCATOR = struct.Struct("<4sLQL")  # ZIP64 end of central directory locator
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # ZIP64 end of central directory record
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_PEEK = 4096


def _simple_members(tail: bytes, length: int) -> tuple[dict[str, tuple[int, int, int]], int] | None:
    """Members (method, stored size, local header offset) of the archive ending with ``tail`` and where
    its central directory starts, or None when it is not laid out as simply as ``torch.save`` writes it
    (no comment, the central directory within ``tail``, no ZIP64 member fields): :mod:`zipfile` reads those."""
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
    at, central = offset - base, offset
    if at < 0 or at + size > len(tail):
        return None
    members = {}
    for _ in range(count):
        if at + _CENTRAL.size > len(tail):
            return None
        fields = _CENTRAL.unpack_from(tail, at)
        method, stored, names, extra, note, local = fields[4], fields[8], fields[10], fields[11], fields[12], fields[16]
        if fields[0] != b"PK\x01\x02" or 0xFFFFFFFF in (stored, fields[9], local) or stored != fields[9]:
            return None
        members[tail[at + _CENTRAL.size : at + _CENTRAL.size + names].decode("utf-8", "replace")] = (method, stored, local)
        at += _CENTRAL.size + names + extra + note
    return members, central


_DESCRIPTOR = b"PK\x07\x08"


def _member_start(fd: int, where: str, item: Item, name: str, local: int, size: int, boundary: int, head: bytes = b"") -> int:
    """The archive offset of member ``name``'s data, from its local header (in ``head`` when it is there),
    after checking that the archive's own records agree on its extent: the local header names it and
    records its size (or a data descriptor after the data does), and its data ends before
    ``boundary`` (the next member's local header, or the central directory)."""
    header = (
        head[local : local + _LOCAL.size]
        if local + _LOCAL.size <= len(head)
        else os.pread(fd, _LOCAL.size, item.item_offset + local)
    )
    if len(header) < _LOCAL.size or header[:4] != _ZIP_LOCAL:
        raise InputError(f"{where}: the archive's local header of {name} is damaged")
    fields = _LOCAL.unpack(header)
    flags, stored, unpacked, names, extra = fields[2], fields[7], fields[8], fields[9], fields[10]
    start = local + _LOCAL.size + names + extra
    if os.pread(fd, names, item.item_offset + local + _LOCAL.size) != name.encode("utf-8"):
        raise InputError(f"{where}: the archive's local header at byte {local} does not name {name}")
    recorded: tuple[int, ...] = (stored, unpacked)
    if flags & 0x08:  # sizes in a data descriptor after the data
        tail = os.pread(fd, 24, item.item_offset + start + size)
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


def _archive_piece(fd: int, where: str, item: Item, pickles: dict[bytes, object], fast: bool) -> int:
    """Where the piece's bytes begin inside its ``torch.save`` archive, checked against the metadata."""
    head = tail = b""
    found = None
    if fast:
        head = os.pread(fd, min(_PEEK, item.item_length), item.item_offset)
        start = max(0, item.item_length - _PEEK)
        tail = os.pread(fd, item.item_length - start, item.item_offset + start)
        found = _simple_members(tail, item.item_length)
    if found is None:
        return _archive_piece_zipfile(fd, where, item)
    members, central = found
    boundary = _boundaries([member[2] for member in members.values()], central)
    root = next(iter(members)).split("/")[0] if members else ""
    pickled = members.get(f"{root}/data.pkl")
    if pickled is None:
        raise InputError(f"{where}: the torch.save archive has no data.pkl")
    if pickled[0] != zipfile.ZIP_STORED:
        raise InputError(f"{where}: unsupported: the torch.save archive is compressed")
    begin = _member_start(fd, where, item, f"{root}/data.pkl", pickled[2], pickled[1], boundary[pickled[2]], head)
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
    start = _member_start(fd, where, item, name, member[2], member[1], boundary[member[2]], head)
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
        boundary = _boundaries([info.header_offset for info in members.values()], archive.start_dir)
        _member_start(
            fd, where, item, pickled.filename, pickled.header_offset, pickled.file_size, boundary[pickled.header_offset]
        )
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
    if member.compress_size != member.file_size:
        raise InputError(f"{where}: the archive's records of {member.filename} disagree on its size")
    start = _member_start(
        fd, where, item, member.filename, member.header_offset, member.file_size, boundary[member.header_offset]
    )
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
            f"{where}: unsupported yet: stored with strides {list(ref.stride)}, not row-major ({expected}), as "
            f"torch saves a transposed or sliced view; mpicons cannot read this layout yet: leave the tensor out "
            f"with --exclude {shlex.quote(item.name)} (and save it contiguous next time, e.g. .contiguous() before saving)"
        )
    unit = DTYPE_BY_NAME[ref.dtype].bits // 8
    storage_bytes = ref.storage.numel * (unit if ref.storage.dtype is not None else 1)
    if storage_bytes != stored_bytes:
        raise InputError(f"{where}: the storage is {stored_bytes} bytes in the archive, its pickle says {storage_bytes}")
    if (ref.storage_offset + step) * unit > stored_bytes and step:
        raise InputError(f"{where}: the tensor runs past the end of its storage ({stored_bytes} bytes)")


#: A tensor of a safetensors blob: dtype, shape, absolute data start, byte length, saved offsets.
_BlobEntry = tuple[str, tuple[int, ...], int, int, list[int] | None]


def _blob_entries(fd: int, path: str, where: str, offset: int, size: int) -> dict[str, _BlobEntry]:
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


__all__ = ["DistcpTable", "Item", "ItemProblem", "METADATA_NAME", "DATA_SUFFIX", "read_metadata", "locate", "locate_all"]
