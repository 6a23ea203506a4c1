"""The consolidation plan: pure and deterministic (no MPI, no I/O).

From the :class:`~mpicons.scan.PieceTable` every rank computes the same plan: the tensor
table with full shapes, an exact coverage check, the output files' layout (reference header
bytes and tensor offsets) and which rows of which tensor each rank writes.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from .convert import converted_dtype
from .errors import InputError
from .format import DTYPE_BY_NAME, DTYPE_ORDER, DTYPES, build_header
from .scan import DCP_SHARD_NAME, PieceTable

#: What Hugging Face ``save_pretrained`` writes; transformers refuses files without it.
OUTPUT_METADATA = {"format": "pt"}
INDEX_NAME = "model.safetensors.index.json"
#: Above this many grid cells a tensor's coverage is checked pairwise instead of on a grid.
MAX_GRID_CELLS = 1 << 24


@dataclass(frozen=True)
class Tensor:
    """A full tensor of the output: where it goes and its byte geometry.

    ``storage`` is the shape in storage units of ``unit`` bytes (padded to the table's width);
    it equals ``shape`` except for sub-byte dtypes, whose last dimension is counted in bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    storage: tuple[int, ...]
    unit: int
    file: int = -1
    offset: int = 0
    source_dtype: str = ""  # dtype in the shards when converting (``--dtype``), else == dtype
    source_unit: int = 0

    def __post_init__(self) -> None:
        if not self.source_dtype:
            object.__setattr__(self, "source_dtype", self.dtype)
        if not self.source_unit:
            object.__setattr__(self, "source_unit", self.unit)

    @property
    def rows(self) -> int:
        return self.storage[0]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.storage[1:], dtype=np.int64)) * self.unit

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class OutputFile:
    name: str
    header: bytes
    size: int
    tensors: tuple[int, ...]


@dataclass(frozen=True)
class WorkItem:
    """Rows ``[row_begin, row_end)`` (dim 0, storage units) of one tensor, written by one rank."""

    tensor: int
    row_begin: int
    row_end: int


@dataclass
class Plan:
    """Everything the writers need; identical on every rank."""

    source_files: list[str]
    tensors: list[Tensor]
    files: list[OutputFile]
    # Non-empty, de-duplicated pieces sorted by tensor; tensor t owns rows piece_start[t]:piece_start[t+1].
    piece_start: np.ndarray
    piece_file: np.ndarray
    piece_begin: np.ndarray
    piece_shape: np.ndarray  # storage units
    piece_offset: np.ndarray  # storage units
    work: list[list[WorkItem]] = field(default_factory=list)
    #: Pieces saved more than once (replicas kept once above); their bytes are compared before writing.
    replicas: "Replicas | None" = None

    @property
    def total_bytes(self) -> int:
        """Tensor data bytes over all output files (the index's ``total_size``)."""
        return sum(t.nbytes for t in self.tensors)

    def item_bytes(self, item: WorkItem) -> int:
        return (item.row_end - item.row_begin) * self.tensors[item.tensor].row_bytes

    def bytes_per_rank(self) -> list[int]:
        return [sum(self.item_bytes(item) for item in items) for items in self.work]

    def weight_map(self) -> dict[str, str]:
        return {self.tensors[t].name: f.name for f in self.files for t in f.tensors}

    def index(self) -> dict[str, object]:
        """The ``model.safetensors.index.json`` content, as Hugging Face writes it."""
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map().items()))}


@dataclass(frozen=True)
class Replicas:
    """Every copy of every piece stored more than once (same tensor, offsets and shape), one row each.

    Rows with the same ``group`` must hold the same bytes; the plan keeps one copy of each group,
    so a divergent replica would otherwise go unnoticed.
    """

    group: np.ndarray  # int64[R]
    file: np.ndarray  # int32[R]
    begin: np.ndarray  # int64[R], absolute byte offset in the file
    nbytes: np.ndarray  # int64[R]
    tensor: np.ndarray  # int32[R]
    ndim: np.ndarray  # int8[R]
    offset: np.ndarray  # int64[R, D], elements
    shape: np.ndarray  # int64[R, D], elements

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


def _replicas(
    first_copy: np.ndarray,
    tensor: np.ndarray,
    dtypes: np.ndarray,
    ndim: np.ndarray,
    shape: np.ndarray,
    offset: np.ndarray,
    files: np.ndarray,
    begin: np.ndarray,
) -> Replicas | None:
    """The non-empty pieces that have an identical twin, grouped by the copy the plan keeps."""
    twins = np.flatnonzero(first_copy != np.arange(len(first_copy)))
    if not len(twins):
        return None
    rows = np.unique(np.concatenate([twins, first_copy[twins]]))
    bits = np.array([d.bits for d in DTYPES], dtype=np.int64)[dtypes[rows]]
    nbytes = np.prod(shape[rows], axis=1) * bits // 8
    rows, nbytes = rows[nbytes > 0], nbytes[nbytes > 0]
    if not len(rows):
        return None
    return Replicas(
        group=first_copy[rows].astype(np.int64),
        file=files[rows],
        begin=begin[rows],
        nbytes=nbytes,
        tensor=tensor[rows],
        ndim=ndim[rows],
        offset=offset[rows],
        shape=shape[rows],
    )


# ---------------------------------------------------------------- mapping


class FileMapping(dict):  # type: ignore[type-arg]  # dict[str, str]
    """A parsed mapping that remembers where it came from, so the plan's errors about it name the file."""

    def __init__(self, items: Mapping[str, str], source: str) -> None:
        super().__init__(items)
        self.source = source


def parse_mapping(obj: object, source: str = "mapping") -> dict[str, str]:
    """Tensor name → output file name, from torch's ``fqn_to_index_mapping`` or an HF index.

    ``{name: index}`` names files ``model-IIIII-of-NNNNN.safetensors`` with NNNNN the largest index;
    ``{"weight_map": {name: file}}`` names them directly (plain names only, no directories).
    """
    if isinstance(obj, dict) and isinstance(obj.get("weight_map"), dict):
        result = {}
        for name, file_name in obj["weight_map"].items():
            if not isinstance(file_name, str) or not _plain_file_name(file_name):
                raise InputError(f"{source}: tensor {name!r} maps to {file_name!r}, which is not a plain file name")
            result[name] = file_name
        return FileMapping(result, source)
    if isinstance(obj, dict) and obj and all(type(v) is int for v in obj.values()):
        if min(obj.values()) < 1:
            raise InputError(f"{source}: file indices start at 1 (got {min(obj.values())})")
        count = max(obj.values())
        return FileMapping({name: output_name(index, count) for name, index in obj.items()}, source)
    raise InputError(f"{source}: expected {{tensor: file index}} or a model.safetensors.index.json with a weight_map")


def _plain_file_name(name: str) -> bool:
    """A name inside the output directory that is neither hidden (temporary outputs are) nor the index."""
    return (
        bool(name)
        and not name.startswith(".")
        and name != INDEX_NAME
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def output_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


# ---------------------------------------------------------------- plan


def build_plan(
    table: PieceTable,
    ranks: int,
    *,
    mapping: Mapping[str, str] | None = None,
    split: str = "bytes",
    dtype: str | None = None,
    max_shard_size: int | None = None,
) -> Plan:
    """The full plan for ``ranks`` writers; raises InputError naming the tensor and files on bad input.

    ``dtype`` (``bf16``/``fp16``/``fp32``) converts floating-point tensors; ``max_shard_size`` (bytes)
    re-shards the output the way Hugging Face does instead of following the shard names.
    """
    if mapping is not None and max_shard_size is not None:
        raise InputError("--mapping and --max-shard-size both decide the output files: give one")
    if table.num_pieces == 0:
        raise InputError("the checkpoint holds no tensors")
    _check_files(table, mapping)
    # By tensor, then file: the same order (and the same replica kept) whatever the number of scanning ranks.
    order = np.lexsort((table.piece_file, table.piece_tensor))
    tensor = table.piece_tensor[order]
    dtypes = table.piece_dtype[order]
    ndim = table.piece_ndim[order]
    shape = table.piece_shape[order]
    offset = table.piece_offset[order]
    files = table.piece_file[order]
    begin = table.piece_begin[order]
    num_tensors = len(table.names)
    starts = np.searchsorted(tensor, np.arange(num_tensors + 1))
    first = starts[:-1]

    _check_agreement(table, "dtype", dtypes, tensor, first, files, lambda v: DTYPES[v].name)
    _check_agreement(table, "number of dimensions", ndim, tensor, first, files, int)

    # Identical replicas (same tensor, offsets and shape) count once: keep the first file's copy.
    # Only tensors whose pieces hold more elements than the tensor can have any: sort just those.
    full = np.maximum.reduceat(offset + shape, first, axis=0)
    with np.errstate(over="ignore"):
        volume = np.where((shape == 0).any(axis=1), 0, np.prod(shape, axis=1))
        suspect = np.add.reduceat(volume, first) > np.prod(full, axis=1)
    rows = np.flatnonzero(suspect[tensor])
    first_copy = np.arange(len(tensor))
    replicas = None
    if len(rows):
        keys = np.concatenate([tensor[rows, None].astype(np.int64), offset[rows], shape[rows]], axis=1)
        first_copy[rows] = rows[_first_identical_row(keys)]
        _check_copied_files(table, tensor, ndim, shape, offset, files, first_copy)
        replicas = _replicas(first_copy, tensor, dtypes, ndim, shape, offset, files, begin)
        keep = np.flatnonzero(first_copy == np.arange(len(first_copy)))
        tensor, dtypes, ndim, shape, offset, files, begin = (
            a[keep] for a in (tensor, dtypes, ndim, shape, offset, files, begin)
        )
        starts = np.searchsorted(tensor, np.arange(num_tensors + 1))
        first = starts[:-1]

    empty_piece = (shape == 0).any(axis=1)
    # A tensor whose every piece is empty has size 0 along some dimension; reduceat gave that.
    tensors = []
    for t in range(num_tensors):
        rank = int(ndim[first[t]])
        tensors.append(
            Tensor(
                name=table.names[t],
                dtype=DTYPES[int(dtypes[first[t]])].name,
                shape=tuple(int(x) for x in full[t, :rank]),
                storage=tuple(int(x) for x in full[t]),
                unit=0,
            )
        )
    try:
        _check_coverage(table, tensors, full, starts, shape, offset, files, empty_piece)
    except InputError as exc:
        missing, _, names = missing_shards(table.files)
        if missing:
            more = f" (and {missing - len(names)} more)" if missing > len(names) else ""
            raise InputError(f"{exc}; shard files missing from the set (seen by no rank): {', '.join(names)}{more}") from None
        raise
    tensors, shape, offset = _to_storage_units(table, tensors, tensor, shape, offset, files)
    tensors = [_converted(t, dtype) for t in tensors]

    if empty_piece.any():
        nonempty = ~empty_piece
        tensor, shape, offset, files, begin = (a[nonempty] for a in (tensor, shape, offset, files, begin))
        starts = np.searchsorted(tensor, np.arange(num_tensors + 1))

    assignment = _assign_files(table, tensors, mapping, table.piece_tensor, table.piece_file)
    if max_shard_size is not None:
        assignment = _pack_shards(tensors, assignment, max_shard_size)
    tensors, out_files = _layout(tensors, assignment)
    plan = Plan(
        source_files=list(table.files),
        tensors=tensors,
        files=out_files,
        piece_start=starts,
        piece_file=files,
        piece_begin=begin,
        piece_shape=shape,
        piece_offset=offset,
        replicas=replicas,
    )
    try:
        policy = SPLITS[split]
    except KeyError:
        raise InputError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})") from None
    plan.work = policy(plan, ranks)
    return plan


def _check_files(table: PieceTable, mapping: Mapping[str, str] | None) -> None:
    """File-level consistency, checked before any tensor so that a stray file is named as such."""
    dcp = table.file_is_dcp
    if dcp.any() and not dcp.all():
        stray = table.files[int(np.argmin(dcp))]
        raise InputError(f"{stray}: not a DCP shard: its header has no DCP_SHARDING_INFO, unlike the other shard files")
    named = table.file_out_index >= 0
    if mapping is not None or not named.any():
        return  # file names do not decide the output
    if not named.all():
        stray = table.files[int(np.argmin(named))]
        raise InputError(
            f"{stray}: not named like a DCP shard (shard-RRRRR-model-IIIII-of-NNNNN.safetensors) among DCP shards, "
            "so its output file is unknown (rename it or give --mapping)"
        )
    count, index = table.file_out_count, table.file_out_index
    odd = np.nonzero(count != count[0])[0]
    if len(odd):
        f = int(odd[0])
        raise InputError(f"{table.files[f]}: names {count[f]} output files but {table.files[0]} names {count[0]}")
    outside = np.nonzero((index < 1) | (index > count))[0]
    if len(outside):
        f = int(outside[0])
        raise InputError(f"{table.files[f]}: output file index {index[f]} is outside 1..{count[f]}")


def _check_copied_files(
    table: PieceTable,
    tensor: np.ndarray,
    ndim: np.ndarray,
    shape: np.ndarray,
    offset: np.ndarray,
    files: np.ndarray,
    original: np.ndarray,
) -> None:
    """A shard file whose every non-empty piece repeats one of another file is a copy, not a rank's share.

    ``original[i]`` is the first piece identical to piece ``i`` (pieces are in file order). torch
    writes replicated tensors once, so a file of nothing but repeats was saved twice (e.g. under
    another rank number), which can hide the loss of the file it replaced.
    """
    real = ~(shape == 0).any(axis=1)
    repeat = real & (original != np.arange(len(original)))
    held = np.bincount(files, weights=real, minlength=len(table.files))
    repeated = np.bincount(files, weights=repeat, minlength=len(table.files))
    copies = np.nonzero((held > 0) & (repeated == held))[0]
    if len(copies):
        f = int(copies[0])
        i = int(np.nonzero((files == f) & real)[0][0])
        j = int(original[i])
        raise InputError(
            f"{table.files[f]}: every piece in it duplicates a piece of another shard file (tensor "
            f"{table.names[tensor[i]]!r} at {_region(offset[i], offset[i] + shape[i], int(ndim[i]))} is also in "
            f"{table.files[files[j]]}); is it a copy saved under another name?"
        )


def _first_identical_row(keys: np.ndarray) -> np.ndarray:
    """For every row of ``keys``, the index of the first row equal to it (a stable lexsort; no Python loop)."""
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    starts_group = np.ones(len(keys), dtype=bool)
    starts_group[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    group = np.cumsum(starts_group) - 1
    first = np.empty(len(keys), dtype=np.int64)
    first[order] = order[starts_group][group]
    return first


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


def missing_shards(files: Sequence[str], show: int = 3) -> tuple[int, int, list[str]]:
    """Absent DCP shard files: (how many, how many the present names imply, the first ``show`` names).

    The present names span a grid of training ranks × output files; a training rank with no piece
    of some output file writes no file for it, so this is only a hint, and a missing *last* rank
    cannot be seen at all. Costs what exists (the names present), never what the names imply: a
    rank number of 10⁹ in one name does not make 10⁹ names.
    """
    parsed = {(int(m.group(1)), int(m.group(2)), int(m.group(3))) for m in map(DCP_SHARD_NAME.match, files) if m}
    counts = {count for _, _, count in parsed}
    if not parsed or len(counts) != 1:
        return 0, 0, []
    count = counts.pop()
    by_rank: dict[int, set[int]] = {}
    for rank, index, _ in parsed:
        by_rank.setdefault(rank, set()).add(index)
    low, top = (1 if min(by_rank) >= 1 else 0), max(by_rank)
    expected = (top - low + 1) * count
    missing = expected - len(parsed)
    names: list[str] = []
    previous = low - 1
    for rank in sorted(by_rank):
        for absent in range(previous + 1, min(rank, previous + 1 + show)):  # ranks with no file at all
            names += [shard_file_name(absent, i, count) for i in range(1, min(count, show) + 1)]
        index = 1
        while len(names) < show and index <= count:
            if index not in by_rank[rank]:
                names.append(shard_file_name(rank, index, count))
            index += 1
            if index > len(by_rank[rank]) + show:
                break
        previous = rank
        if len(names) >= show:
            break
    return missing, expected, names[:show]


def shard_file_name(rank: int, index: int, count: int) -> str:
    """The name torch's HuggingFaceStorageWriter gives training rank ``rank``'s part of output file ``index``."""
    return f"shard-{rank:05d}-model-{index:05d}-of-{count:05d}.safetensors"


def _check_agreement(
    table: PieceTable,
    what: str,
    values: np.ndarray,
    tensor: np.ndarray,
    first: np.ndarray,
    files: np.ndarray,
    show: Callable[[int], object],
) -> None:
    bad = np.nonzero(values != values[first[tensor]])[0]
    if len(bad):
        i = bad[0]
        j = first[tensor[i]]
        raise InputError(
            f"tensor {table.names[tensor[i]]!r}: pieces disagree on {what}: {show(int(values[j]))} in "
            f"{table.files[files[j]]} but {show(int(values[i]))} in {table.files[files[i]]}"
        )


def _region(low: Sequence[int], high: Sequence[int], rank: int) -> str:
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(low[:rank], high[:rank])) + "]"


def _check_coverage(
    table: PieceTable,
    tensors: list[Tensor],
    full: np.ndarray,
    starts: np.ndarray,
    shape: np.ndarray,
    offset: np.ndarray,
    files: np.ndarray,
    empty_piece: np.ndarray,
) -> None:
    """Every element of every tensor covered exactly once, else an error naming the region and files."""
    volume = np.where(empty_piece, 0, np.prod(shape, axis=1))
    covered = np.add.reduceat(volume, starts[:-1])
    # Offsets far past the data would overflow int64 element counts; no file holds 2**62 elements, so: a hole.
    huge = np.nonzero(np.prod(full.astype(np.float64), axis=1) >= 2.0**62)[0]
    if len(huge):
        t = int(huge[0])
        raise InputError(
            f"tensor {tensors[t].name!r} (shape {list(tensors[t].shape)}): hole: pieces cover {int(covered[t])} "
            f"of {math.prod(tensors[t].shape)} elements"
        )
    expected = np.prod(full, axis=1)
    # Fast path: one piece that is the whole tensor.
    count = np.diff(starts)
    trivial = (count == 1) & (covered == expected)
    for t in np.nonzero(~trivial)[0]:
        lo, hi = starts[t], starts[t + 1]
        keep = ~empty_piece[lo:hi]
        _check_one(
            table,
            tensors[t],
            full[t],
            offset[lo:hi][keep],
            shape[lo:hi][keep],
            files[lo:hi][keep],
            int(covered[t]),
            int(expected[t]),
        )


def _check_one(
    table: PieceTable,
    tensor: Tensor,
    full: np.ndarray,
    offset: np.ndarray,
    shape: np.ndarray,
    files: np.ndarray,
    covered: int,
    expected: int,
) -> None:
    rank = max(1, len(tensor.shape))
    if expected == 0:
        return
    where = f"tensor {tensor.name!r} (shape {list(tensor.shape)})"
    if len(offset) == 0:
        raise InputError(f"{where}: no piece holds any data")
    end = offset + shape
    cuts = [_sorted_unique(np.concatenate(([0, full[d]], offset[:, d], end[:, d]))) for d in range(rank)]
    grid = [len(c) - 1 for c in cuts]
    if int(np.prod(grid, dtype=np.int64)) > MAX_GRID_CELLS:
        _check_pairwise(table, where, offset, shape, files, covered, expected, rank)
        return
    low = np.stack([np.searchsorted(cuts[d], offset[:, d]) for d in range(rank)], axis=1)
    high = np.stack([np.searchsorted(cuts[d], end[:, d]) for d in range(rank)], axis=1)
    # +1/-1 at the 2^rank corners of every piece's cell box, summed by bincount (np.add.at is slow).
    dims = [g + 1 for g in grid]
    corners = list(itertools.product((0, 1), repeat=rank))
    flat = np.concatenate(
        [np.ravel_multi_index(tuple(np.where(c[d], high[:, d], low[:, d]) for d in range(rank)), dims) for c in corners]
    )
    signs = np.repeat([-1 if sum(c) % 2 else 1 for c in corners], len(low))
    diff = np.bincount(flat, weights=signs, minlength=int(np.prod(dims))).astype(np.int64).reshape(dims)
    for d in range(rank):
        diff = np.cumsum(diff, axis=d)
    counts = diff[tuple(slice(0, g) for g in grid)]
    bad = np.argwhere(counts != 1)
    if len(bad) == 0:
        return
    cell = bad[0]
    region = _region([cuts[d][cell[d]] for d in range(rank)], [cuts[d][cell[d] + 1] for d in range(rank)], rank)
    if counts[tuple(cell)] == 0:
        raise InputError(f"{where}: hole: no piece covers region {region} ({expected - covered} elements missing overall)")
    inside = np.all((low <= cell) & (cell < high), axis=1)
    holders = ", ".join(
        f"{table.files[f]} at {_region(o, o + s, rank)}" for f, o, s in zip(files[inside], offset[inside], shape[inside])
    )
    raise InputError(f"{where}: overlap: region {region} is covered by {int(inside.sum())} pieces: {holders}")


def _check_pairwise(
    table: PieceTable,
    where: str,
    offset: np.ndarray,
    shape: np.ndarray,
    files: np.ndarray,
    covered: int,
    expected: int,
    rank: int,
) -> None:
    """Overlap check for irregular tilings too fine for a grid: blockwise pairwise box tests."""
    end = offset + shape
    block = 512
    for i0 in range(0, len(offset), block):
        a_lo, a_hi = offset[i0 : i0 + block, None, :rank], end[i0 : i0 + block, None, :rank]
        hit = np.all((a_lo < end[None, :, :rank]) & (offset[None, :, :rank] < a_hi), axis=2)
        hit[np.arange(hit.shape[0]), np.arange(i0, i0 + hit.shape[0])] = False
        pairs = np.argwhere(hit)
        if len(pairs):
            i, j = i0 + pairs[0][0], pairs[0][1]
            raise InputError(
                f"{where}: overlap: piece {_region(offset[i], end[i], rank)} in {table.files[files[i]]} overlaps "
                f"piece {_region(offset[j], end[j], rank)} in {table.files[files[j]]}"
            )
    if covered != expected:
        raise InputError(f"{where}: hole: pieces cover {covered} of {expected} elements")


def _to_storage_units(
    table: PieceTable,
    tensors: list[Tensor],
    tensor: np.ndarray,
    shape: np.ndarray,
    offset: np.ndarray,
    files: np.ndarray,
) -> tuple[list[Tensor], np.ndarray, np.ndarray]:
    """Express geometry in whole bytes: sub-byte dtypes count their last dimension in bytes."""
    shape, offset = shape.copy(), offset.copy()
    result = []
    for t, info in enumerate(tensors):
        bits = DTYPE_BY_NAME[info.dtype].bits
        if bits % 8 == 0:
            result.append(replace(info, unit=bits // 8, source_unit=bits // 8))
            continue
        last = len(info.shape) - 1
        rows = np.nonzero(tensor == t)[0]
        values = np.concatenate(([info.storage[last]], shape[rows, last], offset[rows, last])) * bits
        if last < 0 or np.any(values % 8):
            raise InputError(
                f"tensor {info.name!r}: {info.dtype} pieces are not cut on byte boundaries of the last dimension"
            )
        shape[rows, last] = shape[rows, last] * bits // 8
        offset[rows, last] = offset[rows, last] * bits // 8
        storage = list(info.storage)
        storage[last] = storage[last] * bits // 8
        result.append(replace(info, storage=tuple(storage), unit=1, source_unit=1))
    return result, shape, offset


def _assign_files(
    table: PieceTable,
    tensors: list[Tensor],
    mapping: Mapping[str, str] | None,
    piece_tensor: np.ndarray,
    piece_file: np.ndarray,
) -> list[str]:
    """Output file name of each tensor: from the mapping, or from the DCP shard names."""
    names = [t.name for t in tensors]
    if mapping is not None:
        source = getattr(mapping, "source", "mapping")
        missing = sorted(set(names) - set(mapping))
        if missing:
            raise InputError(
                f"{source}: no entry for tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        extra = sorted(set(mapping) - set(names))
        if extra:
            raise InputError(
                f"{source}: names tensor {extra[0]!r}, which the checkpoint does not hold"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
            )
        return [mapping[n] for n in names]
    if not (table.file_out_index >= 0).any():
        # Plain safetensors files: each tensor stays in the file it came from.
        return _per_tensor_source(table, len(tensors), piece_tensor, piece_file, lambda f: table.files[f])
    count = int(table.file_out_count[0])  # _check_files made every file DCP-named, with one count
    return _per_tensor_source(
        table, len(tensors), piece_tensor, piece_file, lambda f: output_name(int(table.file_out_index[f]), count)
    )


def _per_tensor_source(
    table: PieceTable, num_tensors: int, piece_tensor: np.ndarray, piece_file: np.ndarray, name_of: Callable[[int], str]
) -> list[str]:
    order = np.lexsort((piece_file, piece_tensor))
    tensor, files = piece_tensor[order], piece_file[order]
    starts = np.searchsorted(tensor, np.arange(num_tensors))
    chosen = [name_of(int(files[s])) for s in starts]
    file_targets = [name_of(f) for f in range(len(table.files))]
    codes = {name: i for i, name in enumerate(sorted(set(file_targets)))}
    targets = np.array([codes[name] for name in file_targets], dtype=np.int64)
    differs = np.nonzero(targets[files] != targets[files[starts[tensor]]])[0]
    if len(differs):
        i = differs[0]
        j = starts[tensor[i]]
        raise InputError(
            f"tensor {table.names[tensor[i]]!r} has pieces destined for {name_of(int(files[j]))} "
            f"({table.files[files[j]]}) and {name_of(int(files[i]))} ({table.files[files[i]]})"
        )
    return chosen


def _converted(tensor: Tensor, target: str | None) -> Tensor:
    dtype = converted_dtype(tensor.dtype, target)
    if dtype == tensor.dtype:
        return tensor
    return replace(tensor, dtype=dtype, unit=DTYPE_BY_NAME[dtype].bits // 8)


def _natural_key(name: str) -> list[object]:
    """``layers.2`` before ``layers.10``: the order modules are usually defined in."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _pack_shards(tensors: list[Tensor], assignment: list[str], max_shard_size: int) -> list[str]:
    """Hugging Face's sharding: fill a file until the next tensor would exceed the limit.

    Tensors are taken in their original file order, then natural name order; a tensor larger than
    the limit gets a file of its own. Files are named ``model-IIIII-of-NNNNN.safetensors``.
    """
    if max_shard_size <= 0:
        raise InputError(f"--max-shard-size must be positive (got {max_shard_size})")
    order = sorted(range(len(tensors)), key=lambda t: (assignment[t], _natural_key(tensors[t].name)))
    shards: list[list[int]] = []
    current: list[int] = []
    current_size = 0
    for t in order:
        size = tensors[t].nbytes
        if size > max_shard_size:
            shards.append([t])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(t)
        current_size += size
    if current:
        shards.append(current)
    result = [""] * len(tensors)
    for index, members in enumerate(shards, start=1):
        for t in members:
            result[t] = output_name(index, len(shards))
    return result


def _layout(tensors: list[Tensor], assignment: list[str]) -> tuple[list[Tensor], list[OutputFile]]:
    """Reference-order headers and tensor offsets for every output file (files sorted by name)."""
    by_file: dict[str, list[int]] = {}
    for t, name in enumerate(assignment):
        by_file.setdefault(name, []).append(t)
    placed = list(tensors)
    files = []
    for file_index, name in enumerate(sorted(by_file)):
        members = sorted(by_file[name], key=lambda t: (DTYPE_ORDER[tensors[t].dtype], tensors[t].name))
        header, spans = build_header(
            [(tensors[t].name, tensors[t].dtype, tensors[t].shape) for t in members], OUTPUT_METADATA
        )
        for t, (start, _) in zip(members, spans):
            info = tensors[t]
            placed[t] = replace(info, file=file_index, offset=len(header) + start)
        files.append(OutputFile(name, header, len(header) + (spans[-1][1] if spans else 0), tuple(members)))
    return placed, files




# ---------------------------------------------------------------- work split policies


def split_by_files(plan: Plan, ranks: int) -> list[list[WorkItem]]:
    """Whole output files dealt round-robin to ranks (torch's policy; idle ranks when files < ranks)."""
    work: list[list[WorkItem]] = [[] for _ in range(ranks)]
    for index, out in enumerate(plan.files):
        work[index % ranks].extend(WorkItem(t, 0, plan.tensors[t].rows) for t in out.tensors if plan.tensors[t].nbytes)
    return work


def split_by_bytes(plan: Plan, ranks: int) -> list[list[WorkItem]]:
    """Equal byte ranges of the concatenated output data, cut at row boundaries.

    Each rank gets one contiguous stretch of the output, so max/mean bytes per rank stays
    near 1 whatever the number and sizes of files (up to one row of the cut tensors).
    """
    ordered = [t for out in plan.files for t in out.tensors if plan.tensors[t].nbytes]
    sizes = np.array([plan.tensors[t].nbytes for t in ordered], dtype=np.int64)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    total = int(ends[-1]) if len(ends) else 0
    # Cut points in bytes, each moved to the nearest row boundary of the tensor it falls in.
    cuts = [0]
    for k in range(1, ranks):
        target = total * k // ranks
        i = int(np.searchsorted(ends, target, side="right"))
        if i >= len(ordered):
            cuts.append(total)
            continue
        row_bytes = plan.tensors[ordered[i]].row_bytes
        rows = round((target - int(begins[i])) / row_bytes)
        cuts.append(max(cuts[-1], int(begins[i]) + rows * row_bytes))
    cuts.append(total)
    work: list[list[WorkItem]] = [[] for _ in range(ranks)]
    for rank in range(ranks):
        low, high = cuts[rank], cuts[rank + 1]
        if low >= high:
            continue
        first = int(np.searchsorted(ends, low, side="right"))
        last = int(np.searchsorted(begins, high, side="left"))
        for i in range(first, last):
            info = plan.tensors[ordered[i]]
            row_low = max(0, (low - int(begins[i])) // info.row_bytes)
            row_high = min(info.rows, -(-(high - int(begins[i])) // info.row_bytes))
            if row_high > row_low:
                work[rank].append(WorkItem(ordered[i], int(row_low), int(row_high)))
    return work


SPLITS: dict[str, Callable[[Plan, int], list[list[WorkItem]]]] = {"bytes": split_by_bytes, "files": split_by_files}
