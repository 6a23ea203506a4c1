"""The safetensors file format: dtypes, header parsing and reference-identical header writing.

The writer reproduces the bytes of safetensors' own serializer (``safetensors/src/tensor.rs``):
tensors sorted by dtype (largest alignment first) then name, compact JSON with
``__metadata__`` first, padded with spaces to a multiple of 8.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import InputError

#: safetensors refuses headers larger than this (``MAX_HEADER_SIZE`` in the reference reader).
MAX_HEADER_SIZE = 100_000_000
#: Shapes and offsets are held in int64 columns: dimensions must stay below this.
MAX_DIM = 1 << 63
#: Dimensions of one tensor mpicons holds (numpy's limit; shapes are assembled with numpy).
MAX_NDIM = 64


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its header name, size in bits and numpy name (None when numpy lacks it)."""

    name: str
    bits: int
    numpy: str | None
    torch: str | None
    is_float: bool = False


# Listed in the reference writer's order: largest alignment first (the reverse of its enum order).
DTYPES: tuple[DType, ...] = (
    DType("U64", 64, "uint64", "uint64"),
    DType("I64", 64, "int64", "int64"),
    DType("F64", 64, "float64", "float64", True),
    DType("C64", 64, "complex64", "complex64"),
    DType("F32", 32, "float32", "float32", True),
    DType("U32", 32, "uint32", "uint32"),
    DType("I32", 32, "int32", "int32"),
    DType("BF16", 16, "bfloat16", "bfloat16", True),
    DType("F16", 16, "float16", "float16", True),
    DType("U16", 16, "uint16", "uint16"),
    DType("I16", 16, "int16", "int16"),
    DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz", True),
    DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz", True),
    DType("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu", True),
    DType("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn", True),
    DType("F8_E5M2", 8, "float8_e5m2", "float8_e5m2", True),
    DType("I8", 8, "int8", "int8"),
    DType("U8", 8, "uint8", "uint8"),
    DType("F6_E3M2", 6, "float6_e3m2fn", None, True),
    DType("F6_E2M3", 6, "float6_e2m3fn", None, True),
    DType("F4", 4, "float4_e2m1fn", "float4_e2m1fn_x2", True),
    DType("BOOL", 8, "bool", "bool"),
)
DTYPE_BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
#: Sort key of a dtype in the reference writer's tensor order.
DTYPE_ORDER: dict[str, int] = {d.name: i for i, d in enumerate(DTYPES)}


def nbytes_of(dtype: str, shape: Sequence[int]) -> int | None:
    """Byte length of a tensor, or None when it is not a whole number of bytes (sub-byte dtypes)."""
    count = 1
    for dim in shape:
        count *= dim
    bits = count * DTYPE_BY_NAME[dtype].bits
    return bits // 8 if bits % 8 == 0 else None


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as the header describes it; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed header: metadata, tensors in file order, and where the data section starts."""

    metadata: dict[str, str]
    tensors: tuple[TensorEntry, ...]
    data_start: int
    file_size: int


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """JSON object hook: the reference reader rejects duplicate tensor names, so do we."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _short(value: object) -> str:
    """A header value for a message, cut short (it can be as long as the header)."""
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < 16 else f"a {type(value).__name__} of {len(value)}"
    return text if len(text) <= 200 else text[:200] + "..."


class HeaderError(InputError):
    """A header that breaks the rules, its path (and tensor, if one entry is at fault) kept as values
    beside the message, so a report need not take them back out of the text."""

    tensor: str | None = None

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what

    def __reduce__(self) -> tuple[type[HeaderError], tuple[str, ...]]:
        return type(self), (self.path, self.what)


def _bad(path: str, what: str) -> HeaderError:
    return HeaderError(path, what)


class TensorHeaderError(HeaderError):
    """A header entry that breaks the rules, with its tensor kept as a value beside the message."""

    tensor: str

    def __init__(self, path: str, tensor: str, what: str) -> None:
        InputError.__init__(self, f"{path}: tensor {tensor!r}: {what}")
        self.path, self.tensor, self.what = path, tensor, what

    def __reduce__(self) -> tuple[type[TensorHeaderError], tuple[str, ...]]:
        return type(self), (self.path, self.tensor, self.what)


def _bad_tensor(path: str, tensor: str, what: str) -> TensorHeaderError:
    return TensorHeaderError(path, tensor, what)


#: serde_json, which the reference reader parses with, refuses 128 or more nested arrays and objects.
MAX_JSON_DEPTH = 127
#: The reference reader computes element and bit counts in 64-bit unsigned integers.
_U64 = 1 << 64


class _NotJson(Exception):
    """A value Python's json module accepts but JSON (and the reference reader) does not."""


def _refuse_constant(name: str) -> object:
    raise _NotJson(f"{name} is not JSON")


def _json_int(text: str) -> object:
    # ``-0`` is an integer to Python; the reference reader's unsigned fields refuse it.
    return -0.0 if text == "-0" else int(text)


def _check_ignored(value: object, depth: int, path: str, name: str) -> None:
    """A field the reader ignores must still be what the reference reader parses: finite numbers,
    valid Unicode, nesting within serde_json's limit."""
    if depth > MAX_JSON_DEPTH:
        raise _bad_tensor(path, name, f"header nests more than {MAX_JSON_DEPTH} levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad_tensor(path, name, "header holds a number out of range")
    if type(value) is int and value.bit_length() > 1023 and not _float_range(value):
        raise _bad_tensor(path, name, "header holds a number out of range")
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, list):
        for item in value:
            _check_ignored(item, depth + 1, path, name)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path)
            _check_ignored(item, depth + 1, path, name)


def _float_range(value: int) -> bool:
    """Whether a 64-bit float holds ``value`` (serde_json reads integers past 64 bits as floats)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(path, f"header holds {text!r}, which is not valid Unicode (a lone surrogate escape)") from None


def parse_header(raw: bytes, file_size: int, path: str = "<bytes>") -> Header:
    """Parse and validate the JSON header ``raw`` of a file of ``file_size`` bytes.

    Accepts what the format and its reference reader both accept (docs/distcp-format.md says how):
    UTF-8 JSON starting with ``{``, no name twice, known dtypes, byte lengths that match shape × dtype,
    offsets contiguous from 0 and ending exactly at the file's end.
    """
    try:
        text = raw.decode("utf-8")
        if raw[:1] != b"{":
            raise _bad(
                path, f"header is not a JSON object starting with '{{' as the safetensors format requires ({raw[:4]!r}...)"
            )
        obj = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_refuse_constant, parse_int=_json_int)
    except UnicodeDecodeError as exc:
        raise _bad(path, f"header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError, _NotJson) as exc:  # ValueError also covers ints past Python's digit limit
        raise _bad(path, f"header is not valid JSON ({exc})") from None
    except _DuplicateKey as exc:
        raise _bad(path, f"header names {exc.args[0]!r} twice (the safetensors format forbids it)") from None
    if not isinstance(obj, dict):
        raise _bad(path, "header is not a JSON object")
    if "\\u" in text:  # only an escape can make a lone surrogate
        for key, value in obj.items():
            _check_text(key, path)
            for field, item in value.items() if isinstance(value, dict) else ():
                _check_text(field, path)
                if isinstance(item, str):
                    _check_text(item, path)
    metadata = obj.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise _bad(path, "__metadata__ is not a map of strings to strings")
    entries = []
    for name, info in obj.items():
        entries.append(_parse_entry(path, name, info))
    data_start = 8 + len(raw)
    ordered = sorted(entries, key=lambda e: (e.begin, e.end))
    position = 0
    for entry in ordered:
        if entry.begin != position:
            kind = "overlaps the previous tensor" if entry.begin < position else "leaves a gap before it"
            raise _bad_tensor(path, entry.name, f"data_offsets {entry.begin}..{entry.end} {kind} (expected start {position})")
        position = entry.end
    if data_start + position > file_size:
        # Name the first tensor whose bytes are missing: that is what a truncated file has lost.
        cut = next(e for e in ordered if data_start + e.end > file_size)
        raise _bad_tensor(
            path,
            cut.name,
            f"data_offsets {cut.begin}..{cut.end} run past the end of the file "
            f"({file_size} bytes, the header describes {data_start + position}; truncated?)",
        )
    if data_start + position < file_size:
        raise _bad(path, f"file is {file_size} bytes but the header describes {data_start + position} (trailing bytes)")
    return Header(metadata, tuple(entries), data_start, file_size)


def _parse_entry(path: str, name: str, info: object) -> TensorEntry:
    if not isinstance(info, dict):
        raise _bad_tensor(path, name, "entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    for field, value in info.items():
        if field not in ("dtype", "shape", "data_offsets"):
            _check_ignored(value, 3, path, name)
    if type(dtype) is not str or dtype not in DTYPE_BY_NAME:
        raise _bad_tensor(path, name, f"unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < MAX_DIM for d in shape):
        raise _bad_tensor(path, name, f"shape {_short(shape)} is not a list of non-negative 64-bit integers")
    if len(shape) > MAX_NDIM:
        raise _bad_tensor(path, name, f"{len(shape)} dimensions (mpicons handles at most {MAX_NDIM}, numpy's limit)")
    elements = 1
    for dim in shape:  # as the reference reader multiplies: left to right, in 64 bits
        elements *= dim
        if elements >= _U64:
            raise _bad_tensor(path, name, f"shape {shape} overflows 64 bits")
    if elements * DTYPE_BY_NAME[dtype].bits >= _U64:
        raise _bad_tensor(path, name, f"shape {shape} of {dtype} overflows 64 bits")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _bad_tensor(path, name, f"data_offsets {_short(offsets)} is not [begin, end]")
    expected = nbytes_of(dtype, shape)
    if expected is None:
        raise _bad_tensor(path, name, f"shape {shape} of {dtype} is not a whole number of bytes")
    if offsets[1] - offsets[0] != expected:
        raise _bad_tensor(
            path,
            name,
            f"data_offsets span {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype} needs {expected}",
        )
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


class BadPrefix(Exception):
    """A safetensors length prefix that cannot start a header; ``what`` says why (the path is kept apart)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


#: Bytes of the little-endian length that begins every safetensors file.
PREFIX_SIZE = 8


def header_length(prefix: bytes, file_size: int) -> int:
    """The header length a file's first bytes give, checked as the reference reader does before reading it.

    Shared by every reader so that each says the same thing about a short file, an over-limit length
    and a length that runs past the end; raises :class:`BadPrefix`, which each caller words as its own.
    """
    if len(prefix) < PREFIX_SIZE:
        raise BadPrefix(f"file is {file_size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:PREFIX_SIZE])
    if length > MAX_HEADER_SIZE:
        raise BadPrefix(
            f"header length {length} exceeds the safetensors limit of {MAX_HEADER_SIZE} bytes (not a safetensors file?)"
        )
    if PREFIX_SIZE + length > file_size:
        raise BadPrefix(
            f"header length {length} runs past the end of the {file_size}-byte file (truncated, or not a safetensors file?)"
        )
    return int(length)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at ``path`` (data is not read)."""
    label = os.fspath(path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            length = header_length(handle.read(PREFIX_SIZE), size)
        except BadPrefix as exc:
            raise _bad(label, exc.what) from None
        raw = handle.read(length)
    if len(raw) != length:
        raise _bad(label, "file shrank while its header was read")
    return parse_header(raw, size, label)


def reference_order(tensors: Sequence[tuple[str, str]]) -> list[int]:
    """Indices of ``(name, dtype)`` pairs in the order the reference writer stores them."""
    return sorted(range(len(tensors)), key=lambda i: (DTYPE_ORDER[tensors[i][1]], tensors[i][0]))


def build_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[tuple[int, int]]]:
    """Header bytes (length prefix included) for tensors already in file order.

    Returns the bytes and each tensor's ``(begin, end)`` in the data section.
    """
    parts: dict[str, object] = {}
    if metadata is not None:
        parts["__metadata__"] = dict(metadata)
    spans = []
    position = 0
    for name, dtype, shape in tensors:
        size = nbytes_of(dtype, shape)
        if size is None:
            raise InputError(f"tensor {name!r}: shape {list(shape)} of {dtype} is not a whole number of bytes")
        parts[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + size]}
        spans.append((position, position + size))
        position += size
    text = json.dumps(parts, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, spans
