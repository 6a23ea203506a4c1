"""The consolidation plan: pure and deterministic (no MPI, no I/O), in two levels.

- The **layout** is per tensor, never per piece: from :class:`TensorFacts` (what the pieces say,
  reduced element-wise over all of them, so any split of the pieces over ranks gives the same
  facts) every rank computes the same tensor table, full shapes, output files, reference headers,
  tensor offsets and work split (rows of tensors per rank). Its size is O(tensors + files).
- A **part** is one rank's share of the pieces: the pieces that cross the rows it owns (routed to
  it by the scan). The rank checks them (replicas kept once, coverage of its rows exact) and
  writes from them. Memory per rank is its part, not the checkpoint.

Geometry is in *storage units*: sub-byte dtypes (F4, F6) count their last dimension in bytes, so
everything downstream moves whole bytes. Element units appear only in messages and shapes.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .convert import converted_dtype
from .errors import InputError
from .format import DTYPE_BY_NAME, DTYPE_ORDER, DTYPES, build_header
from .names import INDEX_NAME, SINGLE_FILE_NAME, missing_shards, output_name, plain_file_name, shard_file_name  # noqa: F401 - re-exported
from .reports import Problem, count_of
from .table import Pieces, ShardFiles, Table  # noqa: F401 - re-exported

#: What Hugging Face ``save_pretrained`` writes; transformers refuses files without it.
OUTPUT_METADATA = {"format": "pt"}
#: Hugging Face's default ``max_shard_size`` ("5GB", 10⁹ bytes a GB): the sharding of inputs that name no files.
HF_MAX_SHARD_SIZE = 5 * 10**9
#: Above this many grid cells a tensor's coverage is checked pairwise instead of on a grid.
MAX_GRID_CELLS = 1 << 24
_BITS = np.array([d.bits for d in DTYPES], dtype=np.int64)
#: Keys combine a file id with a small value (dtype, rank, destination) so one MIN finds both.
_KEY = 1 << 32


# ---------------------------------------------------------------- tensors and files


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
    def row_units(self) -> int:
        return math.prod(self.storage[1:])

    @property
    def row_bytes(self) -> int:
        return self.row_units * self.unit

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def converting(self) -> bool:
        return self.source_dtype != self.dtype


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


@dataclass(frozen=True)
class TensorArrays:
    """The tensor table as numpy columns, for vectorized geometry (computed once per layout)."""

    storage: np.ndarray  # int64[T, D]
    source_unit: np.ndarray  # int64[T]
    unit: np.ndarray  # int64[T]
    converting: np.ndarray  # bool[T]
    rows: np.ndarray  # int64[T]


@dataclass
class Layout:
    """Everything about the output, per tensor and per file; identical on every rank."""

    source_files: list[str]
    tensors: list[Tensor]
    files: list[OutputFile]
    work: list[list[WorkItem]] = field(default_factory=list)

    @functools.cached_property
    def arrays(self) -> TensorArrays:
        tensors = self.tensors
        width = max([len(t.storage) for t in tensors], default=1)
        return TensorArrays(
            storage=np.array([t.storage for t in tensors], dtype=np.int64).reshape(len(tensors), width),
            source_unit=np.array([t.source_unit for t in tensors], dtype=np.int64),
            unit=np.array([t.unit for t in tensors], dtype=np.int64),
            converting=np.array([t.converting for t in tensors], dtype=bool),
            rows=np.array([t.rows for t in tensors], dtype=np.int64),
        )

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

    @property
    def has_index(self) -> bool:
        """Hugging Face writes no index beside a single ``model.safetensors``."""
        return not (len(self.files) == 1 and self.files[0].name == SINGLE_FILE_NAME)

    def index(self) -> dict[str, object]:
        """The ``model.safetensors.index.json`` content, as Hugging Face writes it."""
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map().items()))}


# ---------------------------------------------------------------- facts: what the pieces say, reduced


@dataclass
class TensorFacts:
    """Per tensor, from all its pieces: combined element-wise with min / max / sum only, so the facts
    of any split of the pieces over ranks combine (an Allreduce each) into the same result.

    ``*_first`` keys are ``file · 2³² + value`` of the piece in the lowest-numbered file (one MIN
    gives both); ``*_odd`` the same for the lowest file whose value differs from that (needs the
    first round), -1 when all agree.
    """

    count: np.ndarray  # int64[T]: header entries, empty ones included
    extent: np.ndarray  # int64[T, D]: max(offset + shape), storage units
    volume: np.ndarray  # float64[T]: storage units of non-empty pieces (replicas counted each time)
    misaligned: np.ndarray  # int64[T]: 1 when a sub-byte piece is not cut on a byte boundary
    dtype_first: np.ndarray  # int64[T]
    ndim_first: np.ndarray  # int64[T]
    dest_first: np.ndarray  # int64[T]
    dtype_odd: np.ndarray | None = None
    ndim_odd: np.ndarray | None = None
    dest_odd: np.ndarray | None = None
    #: int64[T, D]: the full shape the checkpoint declares (DCP's ``.metadata``), storage units; None: the extent.
    declared: np.ndarray | None = None

    SUM = ("count", "volume")
    MAX = ("extent", "misaligned")
    MIN = ("dtype_first", "ndim_first", "dest_first")
    ODD = ("dtype_odd", "ndim_odd", "dest_odd")

    @property
    def num_tensors(self) -> int:
        return len(self.count)

    def needs_odd(self) -> bool:
        return self.dtype_odd is None


def piece_destinations(files: ShardFiles) -> np.ndarray:
    """Per file, where its pieces go by name: the DCP output index, (plain files) the file itself, or
    (``.distcp`` data files, which name no output) nowhere in particular."""
    if files.source_format == "distcp":
        return np.zeros(len(files), dtype=np.int64)
    if (files.out_index >= 0).any():
        return files.out_index.astype(np.int64)
    return np.arange(len(files), dtype=np.int64)


def _keys(pieces: Pieces, values: np.ndarray) -> np.ndarray:
    return pieces.file.astype(np.int64) * _KEY + values.astype(np.int64)


def local_facts(
    pieces: Pieces, num_tensors: int, width: int, destinations: np.ndarray, misaligned: np.ndarray | None = None
) -> TensorFacts:
    """This part's facts (the first round: everything but the ``*_odd`` keys)."""
    t = pieces.tensor
    flags = np.zeros(num_tensors, dtype=np.int64)
    if misaligned is not None and misaligned.any():
        np.maximum.at(flags, t, misaligned.astype(np.int64))
    extent = np.zeros((num_tensors, width), dtype=np.int64)
    if len(pieces):
        np.maximum.at(extent, t, pieces.offset + pieces.shape)
    nonempty = ~(pieces.shape == 0).any(axis=1)
    volume = np.bincount(
        t, weights=np.where(nonempty, np.prod(pieces.shape.astype(np.float64), axis=1), 0.0), minlength=num_tensors
    )
    firsts = []
    for values in (pieces.dtype, pieces.ndim, destinations[pieces.file]):
        first = np.full(num_tensors, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, t, _keys(pieces, values))
        firsts.append(first)
    return TensorFacts(
        count=np.bincount(t, minlength=num_tensors).astype(np.int64),
        extent=extent,
        volume=volume,
        misaligned=flags,
        dtype_first=firsts[0],
        ndim_first=firsts[1],
        dest_first=firsts[2],
    )


def local_odd(pieces: Pieces, facts: TensorFacts, destinations: np.ndarray) -> list[np.ndarray]:
    """The second round: per tensor, the lowest (file, value) key whose value differs from the first's."""
    t = pieces.tensor
    result = []
    for values, first in (
        (pieces.dtype, facts.dtype_first),
        (pieces.ndim, facts.ndim_first),
        (destinations[pieces.file], facts.dest_first),
    ):
        odd = np.full(facts.num_tensors, np.iinfo(np.int64).max, dtype=np.int64)
        differs = values.astype(np.int64) != first[t] % _KEY
        np.minimum.at(odd, t[differs], _keys(pieces, values)[differs])
        result.append(odd)
    return result


def combine_facts(parts: Sequence[TensorFacts]) -> TensorFacts:
    """What an Allreduce does, in one process (tests, previews)."""
    out = replace(parts[0])
    for name in TensorFacts.SUM:
        setattr(out, name, sum(getattr(p, name) for p in parts))
    for name in TensorFacts.MAX:
        setattr(out, name, np.maximum.reduce([getattr(p, name) for p in parts]))
    for name in TensorFacts.MIN:
        setattr(out, name, np.minimum.reduce([getattr(p, name) for p in parts]))
    return out


def set_odd(facts: TensorFacts, odd: Sequence[np.ndarray]) -> None:
    big = np.iinfo(np.int64).max
    facts.dtype_odd, facts.ndim_odd, facts.dest_odd = (np.where(o == big, -1, o) for o in odd)


# ---------------------------------------------------------------- mapping


class FileMapping(dict[str, str]):
    """A parsed mapping that remembers where it came from, so the plan's errors about it name the file."""

    def __init__(self, items: Mapping[str, str], source: str) -> None:
        super().__init__(items)
        self.source = source


def parse_mapping(obj: object, source: str = "mapping") -> dict[str, str]:
    """Tensor name → output file name, from torch's ``fqn_to_index_mapping`` or an HF index.

    ``{name: index}`` names files ``model-IIIII-of-NNNNN.safetensors`` with NNNNN the largest index;
    ``{"weight_map": {name: file}}`` names them directly (plain names only, no directories, not
    hidden — mpicons' own files are — and not the index).
    """
    if isinstance(obj, dict) and isinstance(obj.get("weight_map"), dict):
        result = {}
        for name, file_name in obj["weight_map"].items():
            if not plain_file_name(file_name) or file_name.startswith(".") or file_name == INDEX_NAME:
                raise InputError(f"{source}: tensor {name!r} maps to {file_name!r}, which is not a plain file name")
            result[name] = file_name
        return FileMapping(result, source)
    if isinstance(obj, dict) and obj and all(type(v) is int for v in obj.values()):
        if min(obj.values()) < 1:
            raise InputError(f"{source}: file indices start at 1 (got {min(obj.values())})")
        count = max(obj.values())
        return FileMapping({name: output_name(index, count) for name, index in obj.items()}, source)
    raise InputError(f"{source}: expected {{tensor: file index}} or a model.safetensors.index.json with a weight_map")


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """``layers.2`` before ``layers.10``: the order modules are usually defined in."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------- the layout


@dataclass(frozen=True)
class Hole:
    """A region of a tensor no piece covers, as one rank found it in its rows (storage units)."""

    low: tuple[int, ...]
    high: tuple[int, ...]
    missing: int  # elements missing in the rows that rank checked


class Problems:
    """Problems found while planning: raised at the first (``strict``) or collected (``inspect``)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.general: list[Problem] = []  # checkpoint-wide
        self.by_tensor: dict[int, Problem] = {}
        self.holes: dict[int, Hole] = {}  # the tensors whose problem is a hole, to merge over ranks

    def add(self, problem: Problem, tensor: int | None = None, hole: Hole | None = None) -> None:
        """Record ``problem`` (of tensor number ``tensor``, if any): the first per tensor is kept."""
        if self.strict:
            raise InputError(problem.message)
        if tensor is None:
            self.general.append(problem)
        elif tensor not in self.by_tensor:
            self.by_tensor[tensor] = problem
            if hole is not None:
                self.holes[tensor] = hole

    def __bool__(self) -> bool:
        return bool(self.general or self.by_tensor)


def _region(low: Sequence[int], high: Sequence[int], rank: int) -> str:
    return "[" + ", ".join(f"{int(a)}:{int(b)}" for a, b in zip(low[:rank], high[:rank])) + "]"


def check_files(files: ShardFiles, mapping: Mapping[str, str] | None, problems: Problems) -> None:
    """File-level consistency, checked before any tensor so that a stray file is named as such."""
    dcp = files.is_dcp
    if dcp.any() and not dcp.all():
        stray = files.names[int(np.argmin(dcp))]
        message = f"{stray}: not a DCP shard: its header has no DCP_SHARDING_INFO, unlike the other shard files"
        problems.add(Problem(message, kind="not dcp", files=(stray,)))
        return
    named = files.out_index >= 0
    if mapping is not None or not named.any():
        return  # file names do not decide the output
    if not named.all():
        stray = files.names[int(np.argmin(named))]
        message = (
            f"{stray}: not named like a DCP shard (shard-RRRRR-model-IIIII-of-NNNNN.safetensors) among DCP shards, "
            "so its output file is unknown (rename it or give --mapping)"
        )
        problems.add(Problem(message, kind="shard name", files=(stray,)))
        return
    count, index = files.out_count, files.out_index
    odd = np.nonzero(count != count[0])[0]
    if len(odd):
        f = int(odd[0])
        message = f"{files.names[f]}: names {count_of(int(count[f]), 'output file')} but {files.names[0]} names {count[0]}"
        problems.add(Problem(message, kind="shard name", files=(files.names[f], files.names[0])))
        return
    outside = np.nonzero((index < 1) | (index > count))[0]
    if len(outside):
        f = int(outside[0])
        message = f"{files.names[f]}: output file index {index[f]} is outside 1..{count[f]}"
        problems.add(Problem(message, kind="shard name", files=(files.names[f],)))


def _agreement(files: ShardFiles, names: list[str], facts: TensorFacts, problems: Problems) -> set[int]:
    """Tensors whose pieces disagree on dtype or rank (each reported once)."""
    broken: set[int] = set()
    for kind, what, first, odd, show in (
        ("dtype", "dtype", facts.dtype_first, facts.dtype_odd, lambda v: DTYPES[v].name),
        ("ndim", "number of dimensions", facts.ndim_first, facts.ndim_odd, int),
    ):
        assert odd is not None
        for t in np.flatnonzero(odd >= 0):
            if int(t) in broken:
                continue
            broken.add(int(t))
            (f1, v1), (f2, v2) = divmod(int(first[t]), _KEY), divmod(int(odd[t]), _KEY)
            message = (
                f"tensor {names[t]!r}: pieces disagree on {what}: "
                f"{show(v1)} in {files.names[f1]} but {show(v2)} in {files.names[f2]}"
            )
            problems.add(Problem(message, names[t], kind=kind, files=(files.names[f1], files.names[f2])), int(t))
    return broken


def tensor_table(files: ShardFiles, names: list[str], facts: TensorFacts, problems: Problems) -> list[Tensor]:
    """The full tensors (dtype of the first piece, full shape = max extent) and their tensor-level problems."""
    broken = _agreement(files, names, facts, problems)
    dtype = (facts.dtype_first % _KEY).astype(np.int64)
    ndim = (facts.ndim_first % _KEY).astype(np.int64)
    tensors = []
    for t, name in enumerate(names):
        kind = DTYPES[int(dtype[t])]
        storage = tuple(int(x) for x in (facts.extent[t] if facts.declared is None else facts.declared[t]))
        rank = int(ndim[t])
        shape = list(storage[:rank])
        unit = kind.bits // 8 if kind.bits % 8 == 0 else 1
        if kind.bits % 8 and rank:
            shape[-1] = storage[rank - 1] * 8 // kind.bits
        tensors.append(Tensor(name, kind.name, tuple(shape), storage, unit))
        if t in broken:
            continue
        if facts.declared is not None and (facts.extent[t] > facts.declared[t]).any():
            reach = [int(x) for x in facts.extent[t][:rank]]
            message = f"tensor {name!r} (shape {list(shape)}): a piece reaches past its shape, to {reach}"
            problems.add(Problem(message, name, kind="extent"), t)
        elif facts.misaligned[t]:
            message = f"tensor {name!r}: {kind.name} pieces are not cut on byte boundaries of the last dimension"
            problems.add(Problem(message, name, kind="misaligned"), t)
        elif math.prod(int(x) for x in storage) * unit >= 2**62:
            elements = math.prod(tensors[t].shape)
            short = int(facts.volume[t]) < math.prod(int(x) for x in storage)
            what = (
                f"hole: pieces cover {int(facts.volume[t])} of {count_of(elements, 'element')}"
                if short
                else f"{count_of(elements, 'element')}, more bytes than mpicons can address (2**62)"
            )
            message = f"tensor {name!r} (shape {list(tensors[t].shape)}): {what}"
            problems.add(Problem(message, name, kind="hole" if short else "too large"), t)
    return tensors


def _assign_files(
    files: ShardFiles, tensors: list[Tensor], facts: TensorFacts, mapping: Mapping[str, str] | None, problems: Problems
) -> list[str]:
    """Output file name of each tensor: from the mapping, or from the shard names (plain files: their own)."""
    names = [t.name for t in tensors]
    if mapping is not None:
        source = getattr(mapping, "source", "mapping")
        missing = sorted(set(names) - set(mapping))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            problems.add(Problem(f"{source}: no entry for tensor {missing[0]!r}{more}", kind="mapping"))
        extra = sorted(set(mapping) - set(names))
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            message = f"{source}: names tensor {extra[0]!r}, which the checkpoint does not hold{more}"
            problems.add(Problem(message, kind="mapping"))
        return [mapping.get(n, "?") for n in names]
    named = bool((files.out_index >= 0).any())
    count = int(files.out_count.max()) if named else 0

    def name_of(file: int, dest: int) -> str:
        return output_name(dest, count) if named else files.names[file]

    assert facts.dest_odd is not None
    result = []
    for t, name in enumerate(names):
        f1, d1 = divmod(int(facts.dest_first[t]), _KEY)
        result.append(name_of(f1, d1))
        if facts.dest_odd[t] >= 0:
            f2, d2 = divmod(int(facts.dest_odd[t]), _KEY)
            message = (
                f"tensor {name!r} has pieces destined for {name_of(f1, d1)} ({files.names[f1]}) and "
                f"{name_of(f2, d2)} ({files.names[f2]})"
            )
            problems.add(Problem(message, name, kind="destination", files=(files.names[f1], files.names[f2])), t)
    return result


def _pack_shards(tensors: list[Tensor], assignment: list[str], max_shard_size: int, saved_order: np.ndarray | None) -> list[str]:
    """Hugging Face's sharding: fill a file until the next tensor would exceed the limit.

    Tensors are taken in the order they were saved when the checkpoint records it (``saved_order``),
    else in their original file order, then natural name order; a tensor larger than the limit gets
    a file of its own. Files are named ``model-IIIII-of-NNNNN.safetensors``, or ``model.safetensors``
    when there is one.
    """
    if saved_order is not None:
        order = sorted(range(len(tensors)), key=lambda t: int(saved_order[t]))
    else:
        order = sorted(range(len(tensors)), key=lambda t: (assignment[t], natural_key(tensors[t].name)))
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
            result[t] = output_name(index, len(shards)) if len(shards) > 1 else SINGLE_FILE_NAME
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
        header, spans = build_header([(tensors[t].name, tensors[t].dtype, tensors[t].shape) for t in members], OUTPUT_METADATA)
        for t, (start, _) in zip(members, spans):
            placed[t] = replace(tensors[t], file=file_index, offset=len(header) + start)
        files.append(OutputFile(name, header, len(header) + (spans[-1][1] if spans else 0), tuple(members)))
    return placed, files


def _converted(tensor: Tensor, target: str | None) -> Tensor:
    dtype = converted_dtype(tensor.dtype, target)
    if dtype == tensor.dtype:
        return tensor
    return replace(tensor, dtype=dtype, unit=DTYPE_BY_NAME[dtype].bits // 8)


def build_layout(
    files: ShardFiles,
    names: list[str],
    facts: TensorFacts,
    ranks: int,
    *,
    mapping: Mapping[str, str] | None = None,
    split: str = "bytes",
    dtype: str | None = None,
    max_shard_size: int | None = None,
    saved_order: np.ndarray | None = None,
    problems: Problems | None = None,
) -> Layout:
    """The layout for ``ranks`` writers. With strict ``problems`` (the default) the first problem is
    raised as InputError naming the tensor and files; otherwise problems are collected and a
    layout is still returned (broken tensors keep the first piece's dtype and the extent as shape)."""
    problems = Problems(strict=True) if problems is None else problems
    if mapping is not None and max_shard_size is not None:
        problems.add(Problem("--mapping and --max-shard-size both decide the output files: give one", kind="options"))
        mapping = None
    if not names:
        problems.add(Problem("the checkpoint holds no tensors", kind="empty"))
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    if max_shard_size is not None and max_shard_size <= 0:
        raise InputError(f"--max-shard-size must be positive (got {max_shard_size})")
    check_files(files, mapping, problems)
    tensors = [_converted(t, dtype) for t in tensor_table(files, names, facts, problems)]
    assignment = _assign_files(files, tensors, facts, mapping, problems)
    if max_shard_size is not None:
        assignment = _pack_shards(tensors, assignment, max_shard_size, saved_order)
    tensors, out_files = _layout(tensors, assignment)
    layout = Layout(list(files.names), tensors, out_files)
    layout.work = SPLITS[split](layout, ranks)
    return layout


# ---------------------------------------------------------------- work split policies


def split_by_files(layout: Layout, ranks: int) -> list[list[WorkItem]]:
    """Whole output files dealt round-robin to ranks (torch's policy; idle ranks when files < ranks)."""
    work: list[list[WorkItem]] = [[] for _ in range(ranks)]
    for index, out in enumerate(layout.files):
        work[index % ranks].extend(WorkItem(t, 0, layout.tensors[t].rows) for t in out.tensors if layout.tensors[t].nbytes)
    return work


def split_by_bytes(layout: Layout, ranks: int) -> list[list[WorkItem]]:
    """Equal byte ranges of the concatenated output data, cut at row boundaries.

    Each rank gets one contiguous stretch of the output, so max/mean bytes per rank stays
    near 1 whatever the number and sizes of files (up to one row of the cut tensors).
    """
    ordered = [t for out in layout.files for t in out.tensors if layout.tensors[t].nbytes]
    sizes = np.array([layout.tensors[t].nbytes for t in ordered], dtype=np.int64)
    ends = np.cumsum(sizes)
    begins = ends - sizes
    total = int(ends[-1]) if len(ends) else 0
    cuts = [0]
    for k in range(1, ranks):
        target = total * k // ranks
        i = int(np.searchsorted(ends, target, side="right"))
        if i >= len(ordered):
            cuts.append(total)
            continue
        row_bytes = layout.tensors[ordered[i]].row_bytes
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
            info = layout.tensors[ordered[i]]
            row_low = max(0, (low - int(begins[i])) // info.row_bytes)
            row_high = min(info.rows, -(-(high - int(begins[i])) // info.row_bytes))
            if row_high > row_low:
                work[rank].append(WorkItem(ordered[i], int(row_low), int(row_high)))
    return work


SPLITS: dict[str, Callable[[Layout, int], list[list[WorkItem]]]] = {"bytes": split_by_bytes, "files": split_by_files}


# ---------------------------------------------------------------- routing pieces to the ranks that own their rows


@dataclass
class RowOwners:
    """Every work item as sorted arrays, to find with searchsorted which ranks own a piece's rows."""

    base: np.ndarray  # int64[T + 1]: the first global row of each tensor (rows of all tensors end to end)
    begin: np.ndarray  # int64[I]: global first row of each item, sorted
    end: np.ndarray  # int64[I]
    rank: np.ndarray  # int32[I]

    @classmethod
    def of(cls, layout: Layout) -> RowOwners:
        base = np.concatenate(([0], np.cumsum(layout.arrays.rows)))
        items = [
            (base[i.tensor] + i.row_begin, base[i.tensor] + i.row_end, rank)
            for rank, work in enumerate(layout.work)
            for i in work
        ]
        items.sort()
        arr = np.array(items, dtype=np.int64).reshape(-1, 3)
        return cls(base, arr[:, 0], arr[:, 1], arr[:, 2].astype(np.int32))

    def route(self, pieces: Pieces) -> tuple[np.ndarray, np.ndarray]:
        """(piece index, owner rank) for every non-empty piece and every rank whose rows it crosses."""
        nonempty = np.flatnonzero(~(pieces.shape == 0).any(axis=1))
        low = self.base[pieces.tensor[nonempty]] + pieces.offset[nonempty, 0]
        high = low + pieces.shape[nonempty, 0]
        first = np.searchsorted(self.end, low, side="right")
        last = np.searchsorted(self.begin, high, side="left")
        count = np.maximum(0, last - first)
        index = np.repeat(nonempty, count)
        position = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
        return index, self.rank[position]

    def primary(self, pieces: Pieces, rank: int) -> np.ndarray:
        """Whether ``rank`` owns the first row of each piece (each piece is counted once, by that owner)."""
        row = self.base[pieces.tensor] + pieces.offset[:, 0]
        at = np.searchsorted(self.end, row, side="right")
        inside = at < len(self.end)
        owner = np.full(len(pieces), -1, dtype=np.int32)
        owner[inside] = np.where(self.begin[at[inside]] <= row[inside], self.rank[at[inside]], -1)
        return owner == rank


# ---------------------------------------------------------------- one rank's part


@dataclass(frozen=True)
class Replicas:
    """Every copy of every piece stored more than once (same tensor, offsets and shape), one row each.

    Rows with the same ``group`` must hold the same bytes; the part keeps one copy of each group,
    so a divergent replica would otherwise go unnoticed.
    """

    group: np.ndarray  # int64[R]
    file: np.ndarray  # int32[R]
    begin: np.ndarray  # int64[R], absolute byte offset in the file
    nbytes: np.ndarray  # int64[R]
    tensor: np.ndarray  # int32[R]
    holder: np.ndarray  # int32[R], a rank that can read the file
    offset: np.ndarray  # int64[R, D], storage units
    shape: np.ndarray  # int64[R, D]

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


@dataclass
class Part:
    """One rank's rows and the pieces they need: non-empty, replicas kept once, sorted by (tensor, row).

    Tensor ``t``'s pieces are ``pieces[start[t]:start[t + 1]]``.
    """

    rank: int
    items: list[WorkItem]
    pieces: Pieces
    start: np.ndarray
    replicas: Replicas | None = None
    #: Per source file: pieces this rank counted (it owns their first row), and how many were repeats.
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    repeated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Per source file: one repeated piece (tensor, offset, shape, original file) for the message.
    examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=dict)

    def tensor_pieces(self, t: int) -> Pieces:
        return self.pieces.take(slice(int(self.start[t]), int(self.start[t + 1])))


def _first_identical(order: np.ndarray, columns: list[np.ndarray]) -> np.ndarray:
    """For every position of ``order`` (rows sorted by ``columns``), the position of the first row equal to it
    in all of them (one column at a time, so no key matrix is built)."""
    same = np.ones(max(0, len(order) - 1), dtype=bool)
    for column in columns:
        ordered = column[order]
        same &= ordered[1:] == ordered[:-1]
    starts_group = np.r_[True, ~same] if len(order) else np.zeros(0, dtype=bool)
    return np.flatnonzero(starts_group)[np.cumsum(starts_group) - 1]


def _element_region(tensor: Tensor, low: Sequence[int] | np.ndarray, high: Sequence[int] | np.ndarray) -> str:
    """A storage-unit box as the element region messages show (sub-byte last dimension in elements)."""
    rank = max(1, len(tensor.shape))
    low, high = [int(x) for x in low[:rank]], [int(x) for x in high[:rank]]
    bits = DTYPE_BY_NAME[tensor.source_dtype].bits
    if bits % 8 and tensor.shape:
        low[-1], high[-1] = low[-1] * 8 // bits, high[-1] * 8 // bits
    return _region(low, high, rank)


def build_part(
    layout: Layout,
    rank: int,
    received: Pieces,
    owners: RowOwners,
    problems: Problems | None = None,
) -> Part:
    """Check and order the pieces routed to ``rank``: replicas, coverage of its rows, copied files.

    ``received`` holds every non-empty piece that crosses the rows ``rank`` owns (storage units).
    Coverage problems are raised (strict) or collected per tensor.
    """
    problems = Problems(strict=True) if problems is None else problems
    items = layout.work[rank] if rank < len(layout.work) else []
    width = received.width
    order = np.lexsort(
        (
            received.file,
            *[received.shape[:, d] for d in reversed(range(width))],
            *[received.offset[:, d] for d in reversed(range(width))],
            received.tensor,
        )
    )
    # Identical boxes are adjacent in this order, the lowest file first: that copy is kept.
    first_copy = _first_identical(order, [received.tensor, *received.offset.T, *received.shape.T])
    repeat = first_copy != np.arange(len(order))
    held, repeated, examples, replicas = _repeats(layout, received, order, first_copy, repeat, owners, rank)
    kept = received.take(order[~repeat])
    start = np.searchsorted(kept.tensor, np.arange(len(layout.tensors) + 1)).astype(np.int64)
    part = Part(rank, items, kept, start, replicas, held, repeated, examples)
    check_coverage(layout, part, problems)
    return part


def _repeats(
    layout: Layout, received: Pieces, order: np.ndarray, first_copy: np.ndarray, repeat: np.ndarray, owners: RowOwners, rank: int
) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]], Replicas | None]:
    """Per-file counts of the pieces this rank counts (it owns their first row) and of repeats among them,
    an example repeat per file, and the replica groups (every copy) for the byte comparison."""
    num_files = len(layout.source_files)
    primary = owners.primary(received, rank)[order]
    files = received.file[order]
    held = np.bincount(files[primary], minlength=num_files).astype(np.int64)
    repeated = np.bincount(files[primary & repeat], minlength=num_files).astype(np.int64)
    examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]] = {}
    if not repeat.any():
        return held, repeated, examples, None
    for i in np.flatnonzero(primary & repeat):
        f = int(files[i])
        if f not in examples:
            p, q = int(order[i]), int(order[first_copy[i]])
            examples[f] = (
                int(received.tensor[p]),
                tuple(int(x) for x in received.offset[p]),
                tuple(int(x) for x in received.shape[p]),
                int(received.file[q]),
            )
    rows = np.unique(np.concatenate([np.flatnonzero(repeat), first_copy[repeat]]))
    return held, repeated, examples, _replicas(received.take(order[rows]), first_copy[rows], layout)


def _replicas(copies: Pieces, group: np.ndarray, layout: Layout) -> Replicas:
    nbytes = np.prod(copies.shape, axis=1) * layout.arrays.source_unit[copies.tensor]
    return Replicas(
        group=group.astype(np.int64),
        file=copies.file,
        begin=copies.begin,
        nbytes=nbytes,
        tensor=copies.tensor,
        holder=copies.holder,
        offset=copies.offset,
        shape=copies.shape,
    )


def copied_file_problem(
    layout: Layout,
    names: list[str],
    held: np.ndarray,
    repeated: np.ndarray,
    examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]],
) -> Problem | None:
    """A shard file whose every non-empty piece repeats a piece of another file is a copy, not a rank's share.

    torch writes replicated tensors once, so a file of nothing but repeats was saved twice (e.g. under
    another rank number), which can hide the loss of the file it replaced. ``held``/``repeated`` are
    summed over all ranks; ``examples`` are merged from them.
    """
    copies = np.flatnonzero((held > 0) & (repeated == held))
    if not len(copies):
        return None
    f = int(copies[0])
    tensor, offset, shape, original = examples[f]
    info = layout.tensors[tensor]
    region = _element_region(info, offset, np.add(offset, shape))
    message = (
        f"{layout.source_files[f]}: every piece in it duplicates a piece of another shard file (tensor "
        f"{names[tensor]!r} at {region} is also in {layout.source_files[original]}); is it a copy saved under another name?"
    )
    return Problem(message, kind="copy", region=region, files=(layout.source_files[f], layout.source_files[original]))


def check_coverage(layout: Layout, part: Part, problems: Problems) -> None:
    """Every element of the rows this part owns is covered exactly once, else a problem naming the region and files."""
    if not part.items:
        return
    item_tensor = np.array([i.tensor for i in part.items], dtype=np.int64)
    item_low = np.array([i.row_begin for i in part.items], dtype=np.int64)
    item_high = np.array([i.row_end for i in part.items], dtype=np.int64)
    pieces = part.pieces
    storage = layout.arrays.storage
    # Fast path, vectorized over every item: all pieces span the full trailing dimensions and tile the rows.
    counts = part.start[item_tensor + 1] - part.start[item_tensor]
    full_width = np.all((pieces.shape[:, 1:] == storage[pieces.tensor, 1:]) & (pieces.offset[:, 1:] == 0), axis=1)
    item_of_piece = np.repeat(np.arange(len(part.items)), counts)
    index = (
        np.repeat(part.start[item_tensor], counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    low = np.maximum(pieces.offset[index, 0], item_low[item_of_piece])
    high = np.minimum(pieces.offset[index, 0] + pieces.shape[index, 0], item_high[item_of_piece])
    crosses = high > low
    index, item_of_piece, low, high = index[crosses], item_of_piece[crosses], low[crosses], high[crosses]
    simple = np.ones(len(part.items), dtype=bool)
    np.logical_and.at(simple, item_of_piece, full_width[index])
    ok = simple.copy()
    if len(index):
        first_of_item = np.r_[True, item_of_piece[1:] != item_of_piece[:-1]]
        last_of_item = np.r_[item_of_piece[1:] != item_of_piece[:-1], True]
        gap = np.zeros(len(index), dtype=bool)
        gap[1:] = ~first_of_item[1:] & (low[1:] != high[:-1])
        gap |= first_of_item & (low != item_low[item_of_piece])
        gap |= last_of_item & (high != item_high[item_of_piece])
        np.logical_and.at(ok, item_of_piece, ~gap)
    ok &= np.bincount(item_of_piece, minlength=len(part.items)) > 0
    ok |= np.prod(storage[item_tensor], axis=1) == 0
    for i in np.flatnonzero(~ok):
        item = part.items[i]
        _check_item(layout, part, item, problems)


def _check_item(layout: Layout, part: Part, item: WorkItem, problems: Problems) -> None:
    """The exact check of one item's rows on a grid of the pieces' cut points (or pairwise when huge)."""
    tensor = layout.tensors[item.tensor]
    pieces = part.tensor_pieces(item.tensor)
    rank = max(1, len(tensor.shape))
    whole = (item.row_begin, item.row_end) == (0, tensor.rows)
    where = f"tensor {tensor.name!r} (shape {list(tensor.shape)})"
    scope = "overall" if whole else f"in rows {item.row_begin}:{item.row_end}"
    low_box = np.array([item.row_begin] + [0] * (rank - 1), dtype=np.int64)
    high_box = np.array([item.row_end] + list(tensor.storage[1:rank]), dtype=np.int64)
    offset = np.maximum(pieces.offset[:, :rank], low_box)
    end = np.minimum(pieces.offset[:, :rank] + pieces.shape[:, :rank], high_box)
    inside = np.all(end > offset, axis=1)
    offset, end, files = offset[inside], end[inside], pieces.file[inside]
    full_pieces = pieces.take(np.flatnonzero(inside))
    expected = int(np.prod(high_box - low_box))
    covered = int(np.prod(end - offset, axis=1).sum()) if len(offset) else 0
    if expected == 0:
        return
    if len(offset) == 0:
        if whole:
            problems.add(Problem(f"{where}: no piece holds any data", tensor.name, kind="no data"), item.tensor)
        else:
            hole = Hole(tuple(low_box.tolist()), tuple(high_box.tolist()), expected)
            problems.add(hole_problem(tensor, hole, scope), item.tensor, hole)
        return
    cuts = [np.unique(np.concatenate(([low_box[d], high_box[d]], offset[:, d], end[:, d]))) for d in range(rank)]
    grid = [len(c) - 1 for c in cuts]
    if int(np.prod(grid, dtype=np.int64)) > MAX_GRID_CELLS:
        _check_pairwise(layout, tensor, where, offset, end, files, covered, expected, scope, problems, item.tensor)
        return
    lo = np.stack([np.searchsorted(cuts[d], offset[:, d]) for d in range(rank)], axis=1)
    hi = np.stack([np.searchsorted(cuts[d], end[:, d]) for d in range(rank)], axis=1)
    dims = [g + 1 for g in grid]
    corners = list(itertools.product((0, 1), repeat=rank))
    flat = np.concatenate(
        [np.ravel_multi_index(tuple(np.where(c[d], hi[:, d], lo[:, d]) for d in range(rank)), dims) for c in corners]
    )
    signs = np.repeat([-1 if sum(c) % 2 else 1 for c in corners], len(lo))
    diff = np.bincount(flat, weights=signs, minlength=int(np.prod(dims))).astype(np.int64).reshape(dims)
    for d in range(rank):
        diff = np.cumsum(diff, axis=d)
    counts = diff[tuple(slice(0, g) for g in grid)]
    bad = np.argwhere(counts != 1)
    if len(bad) == 0:
        return
    cell = bad[0]
    region = _element_region(tensor, [cuts[d][cell[d]] for d in range(rank)], [cuts[d][cell[d] + 1] for d in range(rank)])
    if counts[tuple(cell)] == 0:
        low = tuple(int(cuts[d][cell[d]]) for d in range(rank))
        hole = Hole(low, tuple(int(cuts[d][cell[d] + 1]) for d in range(rank)), max(0, expected - covered))
        problems.add(hole_problem(tensor, hole, scope), item.tensor, hole)
        return
    holding = np.all((lo <= cell) & (cell < hi), axis=1)
    # The region all holders share, whole: the same whatever rows this item (and so this job size) has.
    shared_low = full_pieces.offset[holding, :rank].max(axis=0)
    shared_high = (full_pieces.offset[holding, :rank] + full_pieces.shape[holding, :rank]).min(axis=0)
    region = _element_region(tensor, shared_low, shared_high)
    holding_files = [layout.source_files[f] for f in full_pieces.file[holding]]
    holders = ", ".join(
        f"{name} at {_element_region(tensor, o, o + s)}"
        for name, o, s in zip(holding_files, full_pieces.offset[holding, :rank], full_pieces.shape[holding, :rank])
    )
    message = f"{where}: overlap: region {region} is covered by {int(holding.sum())} pieces: {holders}"
    problems.add(Problem(message, tensor.name, kind="overlap", region=region, files=tuple(holding_files)), item.tensor)


def hole_problem(tensor: Tensor, hole: Hole, scope: str) -> Problem:
    """The problem of a region no piece covers, ``scope`` saying where the missing count was taken."""
    where = f"tensor {tensor.name!r} (shape {list(tensor.shape)})"
    missing = f" ({count_of(hole.missing, 'element')} missing {scope})" if hole.missing else ""
    region = _element_region(tensor, hole.low, hole.high)
    return Problem(f"{where}: hole: no piece covers region {region}{missing}", tensor.name, kind="hole", region=region)


def merge_problems(layout: Layout, found: Sequence[tuple[dict[int, Problem], dict[int, Hole]]]) -> dict[int, Problem]:
    """One message per tensor from every rank's findings (in rank order), the same whatever the job size.

    A hole that crosses the rows of several ranks is found in pieces, one per rank: when each rank's
    finding is a hole over the same columns and their rows meet, the message names the whole hole.
    Otherwise the lowest rank's (the first rows') finding stands.
    """
    merged: dict[int, Problem] = {}
    holes: dict[int, list[Hole | None]] = {}
    for by_tensor, rank_holes in found:
        for t, problem in by_tensor.items():
            merged.setdefault(t, problem)
            holes.setdefault(t, []).append(rank_holes.get(t))
    for t, parts in holes.items():
        if len(parts) < 2 or not all(parts):
            continue
        pieces = sorted((h for h in parts if h is not None), key=lambda h: h.low[0])
        meet = zip(pieces, pieces[1:])
        joined = all(a.high[0] == b.low[0] and (a.low[1:], a.high[1:]) == (b.low[1:], b.high[1:]) for a, b in meet)
        if joined:  # every rank with a problem in this tensor found this hole: their counts add up to all that is missing
            whole = Hole(pieces[0].low, (pieces[-1].high[0], *pieces[0].high[1:]), sum(h.missing for h in pieces))
            merged[t] = hole_problem(layout.tensors[t], whole, "overall")
    return merged


def _check_pairwise(
    layout: Layout,
    tensor: Tensor,
    where: str,
    offset: np.ndarray,
    end: np.ndarray,
    files: np.ndarray,
    covered: int,
    expected: int,
    scope: str,
    problems: Problems,
    t: int,
) -> None:
    """Overlap check for irregular tilings too fine for a grid: blockwise pairwise box tests."""
    block = 512
    for i0 in range(0, len(offset), block):
        hit = np.all((offset[i0 : i0 + block, None] < end[None]) & (offset[None] < end[i0 : i0 + block, None]), axis=2)
        hit[np.arange(hit.shape[0]), np.arange(i0, i0 + hit.shape[0])] = False
        pairs = np.argwhere(hit)
        if len(pairs):
            i, j = i0 + pairs[0][0], pairs[0][1]
            first, second = layout.source_files[files[i]], layout.source_files[files[j]]
            region = _element_region(tensor, offset[i], end[i])
            message = (
                f"{where}: overlap: piece {region} in {first} "
                f"overlaps piece {_element_region(tensor, offset[j], end[j])} in {second}"
            )
            problems.add(Problem(message, tensor.name, kind="overlap", region=region, files=(first, second)), t)
            return
    if covered != expected:
        message = f"{where}: hole: pieces cover {covered} of {count_of(expected, 'element')} {scope}"
        problems.add(Problem(message, tensor.name, kind="hole"), t)


# ---------------------------------------------------------------- everything in one process


@dataclass
class Plan:
    """The layout and every rank's part, computed in one process (tests, previews, one-rank jobs)."""

    layout: Layout
    parts: list[Part]

    def __getattr__(self, name: str) -> object:
        return getattr(self.layout, name)


def facts_of(table: Table) -> TensorFacts:
    """Both rounds of the facts, from every piece at once."""
    destinations = piece_destinations(table.files)
    facts = local_facts(table.pieces, len(table.names), table.pieces.width, destinations, table.misaligned)
    set_odd(facts, local_odd(table.pieces, facts, destinations))
    return facts


def build_plan(
    table: Table,
    ranks: int,
    *,
    mapping: Mapping[str, str] | None = None,
    split: str = "bytes",
    dtype: str | None = None,
    max_shard_size: int | None = None,
) -> Plan:
    """The whole plan in one process, from every piece; raises the first problem (InputError)."""
    layout = build_layout(
        table.files, table.names, facts_of(table), ranks, mapping=mapping, split=split, dtype=dtype, max_shard_size=max_shard_size
    )
    owners = RowOwners.of(layout)
    index, rank_of = owners.route(table.pieces)
    parts = [build_part(layout, r, table.pieces.take(index[rank_of == r]), owners) for r in range(ranks)]
    problem = copied_file_problem(
        layout,
        table.names,
        np.sum([p.held for p in parts], axis=0),
        np.sum([p.repeated for p in parts], axis=0),
        {f: e for p in reversed(parts) for f, e in p.examples.items()},
    )
    if problem:
        raise InputError(problem.message)
    return Plan(layout, parts)
