"""Shard headers read into columns (no MPI here): fast for well-formed headers, strict for the rest.

Headers are parsed with one ``json.loads`` each and turned into :class:`~mpicons.core.table.Pieces`
columns with a handful of list comprehensions and numpy; validation is vectorized. Only a header
that fails the fast checks is parsed again entry by entry, to say exactly what is wrong with it.
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.errors import InputError
from ..core.names import DATA_SUFFIX, MAX_SHARD_NUMBER, METADATA_NAME, parse_shard_name
from ..core.safetensors_codec import (
    DTYPE_BY_NAME,
    DTYPE_ORDER,
    MAX_DIM,
    MAX_NDIM,
    PREFIX_SIZE,
    BadPrefix,
    header_length,
    parse_header,
)
from ..core.table import DTYPE_BITS, Pieces, Table, shard_files, to_storage_units
from .byte_sources import ByteSource, Opener, opened, posix_opener

SHARDING_KEY = "DCP_SHARDING_INFO"
#: The suffixes of the files a checkpoint is made of (besides DCP's ``.metadata``).
INPUT_SUFFIXES = (".safetensors", DATA_SUFFIX)
#: ``-0`` in a list: an integer to Python, refused by the reference reader's unsigned fields.
_MINUS_ZERO = re.compile(rb"[\[,][ \t\n\r]*-0")

#: Headers (and sharding strings) at least this long are decoded with orjson when it is installed: it
#: decodes about 1.5x faster, but importing it (and the uuid module it loads) costs 0.2-0.6 s from a
#: cold page cache, more than it saves on a checkpoint of small headers. It accepts a subset of what
#: json does; what it refuses goes to the strict path as before.
FAST_JSON_MIN = 256 << 10


@functools.cache
def _orjson_loads() -> Callable[[bytes | str], object] | None:
    """orjson's decoder, imported on first use (None: not installed)."""
    try:
        from orjson import loads
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return loads


def _fast_loads(raw: bytes | str) -> object:
    """JSON decoded by orjson for long texts when installed, else json (UTF-8 only: other encodings
    json would guess from the bytes go to the strict path)."""
    loads = _orjson_loads() if len(raw) >= FAST_JSON_MIN else None
    if loads is not None:
        return loads(raw)
    return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)


@dataclass
class _Parsed:
    """One file's header as columns, in header order; ``shape``/``offset`` padded to its widest tensor."""

    names: list[str]
    dtype: np.ndarray
    ndim: np.ndarray
    shape: np.ndarray  # int64[N, W]
    offset: np.ndarray  # int64[N, W]
    begin: np.ndarray
    data_start: int
    is_dcp: bool


#: The first read of a header: its length prefix and, for most checkpoints, the whole header, so a
#: header costs one read (one ranged GET on object storage), two when it is longer than this.
HEAD_READ = 64 << 10


def _read_raw(source: ByteSource) -> tuple[bytes, int]:
    """The header bytes of ``source`` and its size, in one read (two when the header is longer than :data:`HEAD_READ`)."""
    size = source.size
    head = source.read_at(0, min(size, HEAD_READ))
    try:
        length = header_length(head[:PREFIX_SIZE], size)
    except BadPrefix as exc:
        raise InputError(f"{source.name}: {exc.what}") from None
    end = PREFIX_SIZE + length
    raw = head[PREFIX_SIZE:end] if end <= len(head) else head[PREFIX_SIZE:] + source.read_at(len(head), end - len(head))
    if len(raw) != length:
        raise InputError(f"{source.name}: file shrank while its header was read")
    return raw, size


def _grid(rows: list[list[int]], ndim: np.ndarray, fill: int) -> np.ndarray:
    """Ragged integer lists as an int64 [N, max(1, max ndim)] array, padded with ``fill``."""
    width = max(1, int(ndim.max(initial=0)))
    if len(rows) and int(ndim.min()) == width:
        return np.array(rows, dtype=np.int64).reshape(len(rows), width)
    out = np.full((len(rows), width), fill, dtype=np.int64)
    if len(rows):
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(ndim.sum()))
        at = np.repeat(np.arange(len(rows)), ndim)
        out[at, np.arange(len(flat)) - np.repeat(np.cumsum(ndim) - ndim, ndim)] = flat
    return out


@dataclass
class _Entries:
    """A header's entries as Python lists, types checked, before any numeric check (the fast path's first half)."""

    names: list[str]
    dtypes: list[int]
    shapes: list[list[int]]
    spans: list[list[int]]
    offsets: list[list[int]] | None  # saved_offsets, None without DCP_SHARDING_INFO
    commas: int  # commas between the values of the header's objects, its entries' own not counted yet
    strings: str  # the header's keys and metadata texts, whose commas the text holds too


def _fast_entries(raw: bytes, dcp_name: bool) -> _Entries | None:
    """The entries of a header that holds nothing unusual, or None (the strict path then says what).

    One decode per header (and one for DCP_SHARDING_INFO), then list comprehensions;
    types are checked with ``set(map(type, ...))`` so a bool or float never passes for an int.
    """
    # What Python's json module accepts beyond JSON and the format (a byte-order mark or other
    # encodings, lone surrogates, duplicate names, -0) goes to the strict path, which refuses it.
    if raw[:1] != b"{" or b"\\u" in raw or (b"-0" in raw and _MINUS_ZERO.search(raw)):  # the substring test is C-fast
        return None
    try:
        obj = _fast_loads(raw)
        if type(obj) is not dict:
            return None
        commas, strings = max(len(obj) - 1, 0), "".join(obj)
        metadata = obj.pop("__metadata__", None)
        if type(metadata) is dict:
            commas += max(len(metadata) - 1, 0)
            strings += "".join(itertools.chain.from_iterable(metadata.items()))
        elif metadata is None:
            metadata = {}
        if type(metadata) is not dict or not set(map(type, itertools.chain.from_iterable(metadata.items()))) <= {str}:
            return None
        names = list(obj)
        entries = list(obj.values())
        if not set(map(type, entries)) <= {dict} or not set(map(len, entries)) <= {3}:
            return None  # an odd entry, or fields the strict path checks
        dtypes = [DTYPE_ORDER[e["dtype"]] for e in entries]
        shapes = [e["shape"] for e in entries]
        spans = [e["data_offsets"] for e in entries]
        info_text = metadata.get(SHARDING_KEY)
        if info_text is None:
            if dcp_name:
                return None
            offsets = None
        else:
            info = _fast_loads(info_text)
            if type(info) is not dict or len(info) != len(names):
                return None
            offsets = [info[n]["saved_offsets"] for n in names]
    except (ValueError, KeyError, TypeError, RecursionError, AttributeError):
        return None
    lists = set(map(type, shapes)) | set(map(type, spans)) | (set(map(type, offsets)) if offsets is not None else set())
    if not lists <= {list}:
        return None
    ints = set(map(type, itertools.chain.from_iterable(shapes))) | set(map(type, itertools.chain.from_iterable(spans)))
    if offsets is not None:
        ints |= set(map(type, itertools.chain.from_iterable(offsets)))
    if not ints <= {int} or set(map(len, spans)) - {2}:
        return None
    return _Entries(names, dtypes, shapes, spans, offsets, commas, strings)


def _fast(raw: bytes, size: int, dcp_name: bool) -> _Parsed | None:
    """Columns of a well-formed header, or None when anything is unusual (the strict path then says what).

    :func:`_fast_entries` reads it; numpy checks the numbers in bulk.
    """
    entries = _fast_entries(raw, dcp_name)
    if entries is None:
        return None
    names, dtypes, shapes, spans, offsets = entries.names, entries.dtypes, entries.shapes, entries.spans, entries.offsets
    ndim = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    if len(shapes) and int(ndim.max()) > MAX_NDIM:
        return None
    # No name twice anywhere: with no escapes in the text, its commas are exactly those between the
    # values of every object and list plus those inside its strings; a repeated key adds one.
    # Per entry: 2 commas between its fields, 1 in data_offsets, ndim - 1 in its shape.
    commas = entries.commas + 3 * len(names) + int(np.maximum(ndim - 1, 0).sum())
    if raw.count(b",") != commas + entries.strings.count(","):
        return None
    if offsets is not None and not np.array_equal(ndim, np.fromiter(map(len, offsets), dtype=np.int64, count=len(offsets))):
        return None
    try:
        shape = _grid(shapes, ndim, 1)
        offset = _grid(offsets, ndim, 0) if offsets is not None else np.zeros_like(shape)
        span = np.array(spans, dtype=np.int64).reshape(-1, 2)
    except OverflowError:
        return None
    if (shape < 0).any() or (offset < 0).any() or (span < 0).any():
        return None
    # Elements, through float64 first so that huge shapes cannot overflow silently.
    if ((shape + offset).astype(np.float64) >= MAX_DIM).any():
        return None
    reach = np.prod((shape + offset).astype(np.float64), axis=1) * DTYPE_BITS[np.array(dtypes, dtype=np.int64)] / 8
    if len(shape) and (reach >= 2.0**62).any():
        return None  # the full tensor may not be addressable: the strict path says so exactly
    if len(shape) and (np.cumprod(shape.astype(np.float64), axis=1) * 8 >= 2.0**62).any():
        return None  # the strict path multiplies exactly, left to right as the reference reader does
    dtype = np.array(dtypes, dtype=np.int8)
    bits = np.prod(shape, axis=1) * DTYPE_BITS[dtype]
    if (bits % 8).any() or not np.array_equal(bits // 8, span[:, 1] - span[:, 0]):
        return None
    order = np.lexsort((span[:, 1], span[:, 0]))
    begins, ends = span[order, 0], span[order, 1]
    if len(order) and (begins[0] != 0 or not np.array_equal(begins[1:], ends[:-1])):
        return None
    data_start = 8 + len(raw)
    if data_start + (int(ends[-1]) if len(order) else 0) != size:
        return None
    return _Parsed(names, dtype, ndim.astype(np.int8), shape, offset, span[:, 0] + data_start, data_start, offsets is not None)


def _strict(path: str, raw: bytes, size: int, dcp_name: bool) -> _Parsed:
    """Entry by entry, with the reference reader's rules: raises InputError naming what is wrong."""
    header = parse_header(raw, size, path)
    info = _sharding_info(path, header.metadata)
    if dcp_name and info is None:
        raise InputError(f"{path}: named like a DCP shard but its header has no {SHARDING_KEY}")
    offsets = []
    for entry in header.tensors:
        if info is None:
            offsets.append([0] * len(entry.shape))
            continue
        saved = info.get(entry.name)
        if saved is None:
            raise InputError(f"{path}: tensor {entry.name!r} is missing from {SHARDING_KEY}")
        if len(saved) != len(entry.shape):
            raise InputError(
                f"{path}: tensor {entry.name!r} has {len(entry.shape)} dimensions but saved_offsets {saved} has {len(saved)}"
            )
        if any(o + d >= MAX_DIM for o, d in zip(saved, entry.shape)):
            raise InputError(
                f"{path}: tensor {entry.name!r}: saved_offsets {saved} with shape {list(entry.shape)} reach past 2**63 elements"
            )
        reach = DTYPE_BY_NAME[entry.dtype].bits
        for o, d in zip(saved, entry.shape):
            reach *= o + d
        if reach >= MAX_DIM * 8:
            raise InputError(
                f"{path}: tensor {entry.name!r}: saved_offsets {saved} with shape {list(entry.shape)} make a tensor of "
                "2**63 bytes or more (damaged header?)"
            )
        offsets.append(saved)
    if info is not None:
        extra = set(info) - {entry.name for entry in header.tensors}
        if extra:
            raise InputError(f"{path}: {SHARDING_KEY} names tensor {sorted(extra)[0]!r} that the file does not hold")
    entries = header.tensors
    ndim = np.array([len(e.shape) for e in entries], dtype=np.int64)
    return _Parsed(
        [e.name for e in entries],
        np.array([DTYPE_ORDER[e.dtype] for e in entries], dtype=np.int8),
        ndim.astype(np.int8),
        _grid([list(e.shape) for e in entries], ndim, 1),
        _grid(offsets, ndim, 0),
        np.array([header.data_start + e.begin for e in entries], dtype=np.int64),
        header.data_start,
        info is not None,
    )


def _sharding_info(path: str, metadata: dict[str, str]) -> dict[str, list[int]] | None:
    text = metadata.get(SHARDING_KEY)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):
        raise InputError(f"{path}: {SHARDING_KEY} is not valid JSON") from None
    if not isinstance(info, dict):
        raise InputError(f"{path}: {SHARDING_KEY} is not a JSON object")
    offsets: dict[str, list[int]] = {}
    for name, entry in info.items():
        saved = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(saved, list) or not all(type(o) is int and 0 <= o < MAX_DIM for o in saved):
            raise InputError(
                f"{path}: {SHARDING_KEY} entry for tensor {name!r} has invalid saved_offsets {saved!r} "
                "(expected a list of non-negative integers)"
            )
        offsets[name] = saved
    return offsets


def read_file(source: ByteSource | str, file_name: str) -> _Parsed:
    """One shard file's header as columns (fast path, else strict with a precise error); ``source``
    is read through, or is the path of a file opened here."""
    named = parse_shard_name(file_name)
    if named is not None and max(named) > MAX_SHARD_NUMBER:
        where = source if isinstance(source, str) else source.name
        raise InputError(f"{where}: the numbers in this shard name are out of range (at most {MAX_SHARD_NUMBER})")
    with opened(source) as readable:
        raw, size = _read_raw(readable)
        path = readable.name
    collecting = gc.isenabled()
    gc.disable()  # a header is ~10^5 acyclic dicts and lists: the cyclic collector's passes over them are waste
    try:
        parsed = _fast(raw, size, named is not None)
    finally:
        if collecting:
            gc.enable()
    return parsed if parsed is not None else _strict(path, raw, size, named is not None)


@dataclass
class LocalTable:
    """The headers one rank read: file facts by file id, pieces with tensor ids into ``names``."""

    file_ids: np.ndarray  # int32[f], global ids of the files read here
    data_start: np.ndarray  # int64[f]
    is_dcp: np.ndarray  # bool[f]
    names: list[str]  # tensor names, first appearance order
    pieces: Pieces


def read_headers(directory: str | Opener, names: Sequence[str], file_ids: Sequence[int], holder: int = 0) -> LocalTable:
    """Read the headers of ``names`` (files with global ids ``file_ids`` inside ``directory``, or opened
    by name with an :data:`~mpicons.formats.byte_sources.Opener`), each closed once read."""
    open_one = posix_opener(directory) if isinstance(directory, str) else directory
    tensor_names: list[str] = []
    ids: dict[str, int] = {}
    parts, starts, dcp = [], [], []
    for file_id, file_name in zip(file_ids, names):
        source = open_one(file_name)
        try:
            parsed = read_file(source, file_name)
        finally:
            source.close()
        new = [n for n in parsed.names if n not in ids]
        ids.update(zip(new, range(len(ids), len(ids) + len(new))))
        lookup = np.fromiter(map(ids.__getitem__, parsed.names), dtype=np.int32, count=len(parsed.names))
        parts.append(
            Pieces(
                tensor=lookup,
                file=np.full(len(lookup), file_id, dtype=np.int32),
                dtype=parsed.dtype,
                ndim=parsed.ndim,
                shape=parsed.shape,
                offset=parsed.offset,
                begin=parsed.begin,
                holder=np.full(len(lookup), holder, dtype=np.int32),
            )
        )
        starts.append(parsed.data_start)
        dcp.append(parsed.is_dcp)
    tensor_names = list(ids)
    return LocalTable(
        np.asarray(file_ids, dtype=np.int32),
        np.array(starts, dtype=np.int64),
        np.array(dcp, dtype=bool),
        tensor_names,
        Pieces.concat(parts),
    )


def list_shards(input_dir: str, allow_empty: bool = False, suffixes: tuple[str, ...] = (".safetensors",)) -> list[str]:
    """The ``*.safetensors`` files (or files with other ``suffixes``) directly in ``input_dir``, sorted by name."""
    if not os.path.isdir(input_dir):
        raise InputError(f"{input_dir}: input directory does not exist or is not a directory")
    try:
        names = sorted(
            entry.name
            for entry in os.scandir(input_dir)
            if entry.name.endswith(suffixes) and not entry.name.startswith(".") and entry.is_file()
        )
    except OSError as exc:
        raise InputError(f"{input_dir}: cannot list input directory ({exc.strerror})") from None
    if not names and not allow_empty:
        raise InputError(f"{input_dir}: no *.safetensors files found")
    return names


def input_files(entries: Sequence[tuple[str, int]]) -> tuple[list[str], list[int]]:
    """Of a location's ``(name, size)`` entries, the input files: ``.metadata`` first when there is one,
    then the ``*.safetensors`` and ``*.distcp`` files sorted by name (what a store's listing returns)."""
    kept = sorted(
        (name, size) for name, size in entries if name.endswith(INPUT_SUFFIXES) and not name.startswith(".") and "/" not in name
    )
    metadata = [(name, size) for name, size in entries if name == METADATA_NAME]
    both = metadata + kept
    return [name for name, _ in both], [size for _, size in both]


def relabel(local: LocalTable, names: list[str]) -> Pieces:
    """``local``'s pieces with tensor ids into the global, sorted ``names``."""
    position = {name: i for i, name in enumerate(names)}
    lookup = np.array([position[n] for n in local.names], dtype=np.int32)
    pieces = local.pieces
    return Pieces(
        lookup[pieces.tensor] if len(pieces) else pieces.tensor,
        pieces.file,
        pieces.dtype,
        pieces.ndim,
        pieces.shape,
        pieces.offset,
        pieces.begin,
        pieces.holder,
    )


def read_table(directory: str, names: Sequence[str] | None = None) -> Table:
    """Read every shard header of ``directory`` in this process (tests, previews; the scan splits this over ranks)."""
    names = list_shards(directory) if names is None else list(names)
    sizes = [os.path.getsize(os.path.join(directory, n)) for n in names]
    files = shard_files(names, sizes, None)
    local = read_headers(directory, names, range(len(names)))
    files.data_start[local.file_ids] = local.data_start
    files.is_dcp[local.file_ids] = local.is_dcp
    tensor_names = sorted(local.names)
    pieces = relabel(local, tensor_names)
    misaligned = to_storage_units(pieces)
    return Table(files, tensor_names, pieces, misaligned)


__all__ = [
    "SHARDING_KEY",
    "INPUT_SUFFIXES",
    "LocalTable",
    "input_files",
    "read_file",
    "read_headers",
    "list_shards",
    "relabel",
    "read_table",
]
