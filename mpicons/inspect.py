"""Looking at a sharded checkpoint without writing anything: ``mpicons inspect``.

:func:`inspect` runs the same scan and plan as a consolidation, so what it shows is what a
consolidation would do: the tensors and their full shapes, the shard files, the output files and
each rank's share of the bytes. ``ranks`` previews a bigger job from one process. A checkpoint
the plan refuses (holes, overlaps, disagreeing pieces) is still described: the plan's error is
reported and every tensor is checked on its own, so one run lists every broken tensor rather
than only the first.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
from mpi4py import MPI

from .consolidation import load_mapping
from .errors import InputError
from .format import DTYPES
from .parallel import Comm, agree
from .plan import SPLITS, Plan, build_plan, missing_shards, output_name
from .stats import count_of as _count, human_bytes
from .scan import DCP_SHARD_NAME, PieceTable, scan

#: Width the table output is laid out for.
WIDTH = 100
#: File name given to a tensor when it is checked on its own (no real output file is involved).
_CHECK_FILE = "check.safetensors"


@dataclass(frozen=True)
class ShardInfo:
    """One input file: its DCP name parts (None when it is not named like a DCP shard), pieces and size."""

    name: str
    training_rank: int | None
    output_index: int | None
    output_count: int | None
    pieces: int
    size: int


@dataclass(frozen=True)
class TensorInfo:
    """One full tensor: what it becomes and, when its pieces do not fit together, why.

    ``pieces`` counts header entries over all shards (replicas and empty pieces included);
    ``copied_pieces`` is what the plan copies (non-empty, replicas once), None without a plan.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: int
    file: str
    bytes: int
    copied_pieces: int | None = None
    problem: str | None = None

    @property
    def status(self) -> str:
        """A one-word summary of ``problem`` for the table."""
        if self.problem is None:
            return "ok"
        for word, status in ((": hole", "hole"), (": overlap", "overlap"), ("disagree", "mismatch")):
            if word in self.problem:
                return status
        return "error"


@dataclass(frozen=True)
class FileInfo:
    """One output file; ``size`` (header included) is None when there is no plan."""

    name: str
    tensors: int
    tensor_bytes: int
    size: int | None


@dataclass(frozen=True)
class RankInfo:
    """One writer rank's share: bytes, output files touched and work items ``(tensor, row_begin, row_end, bytes)``."""

    rank: int
    bytes: int
    files: tuple[str, ...]
    work: tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True)
class Problem:
    """Something that stops consolidation; ``tensor`` is None for checkpoint-wide problems."""

    tensor: str | None
    what: str

    def __str__(self) -> str:
        return self.what


@dataclass
class InspectReport:
    """What :func:`inspect` found; identical on every rank. ``ok`` when nothing stops consolidation."""

    input_dir: str
    ranks: int
    job_ranks: int
    split: str
    mapping: str | None
    shards: list[ShardInfo]
    tensors: list[TensorInfo]
    files: list[FileInfo]
    per_rank: list[RankInfo]
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plan: Plan | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def pieces(self) -> int:
        return sum(s.pieces for s in self.shards)

    @property
    def training_ranks(self) -> list[int]:
        """Training ranks named by the shard files (``shard-RRRRR-...``), as numbered there."""
        return sorted({s.training_rank for s in self.shards if s.training_rank is not None})

    @property
    def bytes_per_rank(self) -> list[int]:
        return [r.bytes for r in self.per_rank]

    @property
    def imbalance(self) -> float | None:
        """max / mean bytes per rank (1.0 is perfect); None without a plan."""
        if not self.per_rank:
            return None
        mean = self.total_bytes / len(self.per_rank)
        return max(self.bytes_per_rank) / mean if mean else 1.0

    def to_dict(self) -> dict[str, object]:
        """Everything, nothing truncated (``--json``)."""
        return {
            "ok": self.ok,
            "input_dir": self.input_dir,
            "ranks": self.ranks,
            "job_ranks": self.job_ranks,
            "split": self.split,
            "mapping": self.mapping,
            "summary": {
                "shard_files": len(self.shards),
                "training_ranks": len(self.training_ranks),
                "tensors": len(self.tensors),
                "pieces": self.pieces,
                "total_bytes": self.total_bytes,
                "output_files": len(self.files),
                "planned": self.plan is not None,
                "max_bytes_per_rank": max(self.bytes_per_rank) if self.per_rank else None,
                "imbalance": self.imbalance,
                "problems": len(self.problems),
            },
            "files": [dataclasses.asdict(f) for f in self.files],
            "tensors": [{**dataclasses.asdict(t), "shape": list(t.shape), "status": t.status} for t in self.tensors],
            "per_rank": [
                {
                    "rank": r.rank,
                    "bytes": r.bytes,
                    "items": len(r.work),
                    "files": list(r.files),
                    "work": [{"tensor": n, "rows": [a, b], "bytes": s} for n, a, b, s in r.work],
                }
                for r in self.per_rank
            ],
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "problems": [dataclasses.asdict(p) for p in self.problems],
            "notes": list(self.notes),
        }

    def table(self, limit: int = 50) -> str:
        """The human-readable report, at most ``limit`` rows per list (0: all), within 100 columns."""
        return "\n".join(_render(self, limit))


# ---------------------------------------------------------------- inspect


def inspect(
    input_dir: str | os.PathLike[str],
    *,
    comm: Comm | None = None,
    ranks: int | None = None,
    mapping: str | os.PathLike[str] | Mapping[str, object] | None = None,
    split: str = "bytes",
    dtype: str | None = None,
    max_shard_size: int | None = None,
) -> InspectReport:
    """Describe the sharded checkpoint in ``input_dir`` and what consolidating it on ``ranks`` ranks would do.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): the headers are read once, split over the
    ranks, and the report is the same on every rank. ``ranks`` (default ``comm.size``) is the job
    size to plan for. Problems in the checkpoint are reported, not raised; :class:`InputError` is
    raised (on every rank) only when the checkpoint cannot be read at all or the options are wrong.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    input_dir = os.fspath(input_dir)
    ranks = comm.size if ranks is None else ranks
    if type(ranks) is not int or ranks < 1:
        raise InputError(f"ranks must be a positive integer (got {ranks!r})")
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    names = agree(comm, lambda: load_mapping(mapping) if mapping is not None and comm.rank == 0 else None, root=0)
    table = scan(input_dir, comm)
    plan, error = agree(comm, lambda: _try_plan(table, ranks, names, split, dtype, max_shard_size))
    tensor_problems: dict[int, str] = {}
    if plan is None:
        # Check every tensor on its own (split over the ranks) to list all broken ones, not just the first.
        parts = agree(comm, lambda: _tensor_problems(table, range(comm.rank, len(table.names), comm.size)), gather=True)
        for part in parts:
            tensor_problems.update(part)
    return describe(
        input_dir,
        table,
        plan,
        error,
        tensor_problems,
        ranks=ranks,
        job_ranks=comm.size,
        split=split,
        mapping=names,
        mapping_label=None if mapping is None or isinstance(mapping, Mapping) else os.fspath(mapping),
    )


def _try_plan(
    table: PieceTable,
    ranks: int,
    mapping: Mapping[str, str] | None,
    split: str,
    dtype: str | None = None,
    max_shard_size: int | None = None,
) -> tuple[Plan | None, str | None]:
    """The plan, or the reason there is none (the checkpoint's first problem)."""
    try:
        return build_plan(table, ranks, mapping=mapping, split=split, dtype=dtype, max_shard_size=max_shard_size), None
    except InputError as exc:
        return None, str(exc)


def _tensor_table(table: PieceTable, t: int, rows: np.ndarray) -> PieceTable:
    """A table holding only tensor ``t``'s pieces (file list unchanged, so errors name the real files)."""
    changes: dict[str, object] = {"names": [table.names[t]]}
    for item in dataclasses.fields(table):
        if item.name.startswith("piece_"):
            changes[item.name] = getattr(table, item.name)[rows]
    changes["piece_tensor"] = np.zeros(len(rows), dtype=table.piece_tensor.dtype)
    return dataclasses.replace(table, **changes)


def _tensor_problems(table: PieceTable, tensors: range) -> dict[int, str]:
    """Tensor id → the plan's error for that tensor alone (dtype/rank agreement, coverage, byte cuts).

    Each tensor is planned by itself with a one-entry mapping, so checkpoint-wide matters (output
    file assignment) stay out of it and are reported once, from the full plan.
    """
    order = np.argsort(table.piece_tensor, kind="stable")
    starts = np.searchsorted(table.piece_tensor[order], np.arange(len(table.names) + 1))
    problems = {}
    for t in tensors:
        sub = _tensor_table(table, t, order[starts[t] : starts[t + 1]])
        try:
            build_plan(sub, 1, mapping={table.names[t]: _CHECK_FILE}, split="files")
        except InputError as exc:
            problems[t] = str(exc)
    return problems


def describe(
    input_dir: str,
    table: PieceTable,
    plan: Plan | None,
    error: str | None,
    tensor_problems: Mapping[int, str],
    *,
    ranks: int,
    job_ranks: int = 1,
    split: str = "bytes",
    mapping: Mapping[str, str] | None = None,
    mapping_label: str | None = None,
) -> InspectReport:
    """The report from a scanned table and the plan (or its error); pure, the same on every rank."""
    shards = _shards(table)
    pieces = np.bincount(table.piece_tensor, minlength=len(table.names))
    tensors: list[TensorInfo] = []
    files: list[FileInfo] = []
    per_rank: list[RankInfo] = []
    if plan is not None:
        copied = np.diff(plan.piece_start)
        for t, info in enumerate(plan.tensors):
            tensors.append(
                TensorInfo(info.name, info.dtype, info.shape, int(pieces[t]), plan.files[info.file].name,
                           info.nbytes, int(copied[t]))
            )
        for out in plan.files:
            files.append(FileInfo(out.name, len(out.tensors), sum(plan.tensors[t].nbytes for t in out.tensors), out.size))
        for rank, items in enumerate(plan.work):
            work = tuple(
                (plan.tensors[i.tensor].name, i.row_begin, i.row_end, plan.item_bytes(i)) for i in items
            )
            touched = sorted({plan.tensors[i.tensor].file for i in items})
            per_rank.append(RankInfo(rank, sum(w[3] for w in work), tuple(plan.files[f].name for f in touched), work))
    else:
        tensors = _unplanned_tensors(table, pieces, mapping, tensor_problems)
        by_file: dict[str, list[TensorInfo]] = {}
        for info in tensors:
            by_file.setdefault(info.file, []).append(info)
        files = [FileInfo(name, len(group), sum(t.bytes for t in group), None) for name, group in sorted(by_file.items())]
    problems = [Problem(table.names[t], tensor_problems[t]) for t in sorted(tensor_problems, key=lambda t: _natural_key(table.names[t]))]
    if error is not None and error not in tensor_problems.values():
        problems.insert(0, Problem(None, error))
    tensors.sort(key=lambda info: _natural_key(info.name))
    return InspectReport(
        input_dir=input_dir,
        ranks=ranks,
        job_ranks=job_ranks,
        split=split,
        mapping=mapping_label if mapping_label is not None else (None if mapping is None else "<mapping>"),
        shards=shards,
        tensors=tensors,
        files=files,
        per_rank=per_rank,
        problems=problems,
        notes=_missing_shard_notes(table),
        plan=plan,
    )


def _shards(table: PieceTable) -> list[ShardInfo]:
    counts = np.bincount(table.piece_file, minlength=len(table.files))
    result = []
    for f, name in enumerate(table.files):
        match = DCP_SHARD_NAME.match(name)
        result.append(
            ShardInfo(
                name,
                int(match.group(1)) if match else None,
                int(match.group(2)) if match else None,
                int(match.group(3)) if match else None,
                int(counts[f]),
                int(table.file_size[f]),
            )
        )
    return result


def _unplanned_tensors(
    table: PieceTable, pieces: np.ndarray, mapping: Mapping[str, str] | None, tensor_problems: Mapping[int, str]
) -> list[TensorInfo]:
    """Best-effort tensor rows when the plan failed: shape as the plan computes it, file from the names."""
    order = np.lexsort((table.piece_file, table.piece_tensor))
    first = order[np.searchsorted(table.piece_tensor[order], np.arange(len(table.names)))]
    extent = table.piece_offset + table.piece_shape
    full = np.zeros((len(table.names), extent.shape[1]), dtype=np.int64)
    np.maximum.at(full, table.piece_tensor, extent)
    result = []
    for t, name in enumerate(table.names):
        p = int(first[t])
        dtype = DTYPES[int(table.piece_dtype[p])]
        shape = tuple(int(x) for x in full[t, : int(table.piece_ndim[p])])
        f = int(table.piece_file[p])
        if mapping is not None:
            file_name = mapping.get(name, "?")
        elif table.file_out_index[f] >= 0:
            file_name = output_name(int(table.file_out_index[f]), int(table.file_out_count[f]))
        else:
            file_name = table.files[f]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.bits // 8
        result.append(TensorInfo(name, dtype.name, shape, int(pieces[t]), file_name, nbytes, None, tensor_problems.get(t)))
    return result


def _missing_shard_notes(table: PieceTable, show: int = 5) -> list[str]:
    """Hints about absent shard files: every training rank usually writes one per output file."""
    missing, expected, names = missing_shards(table.files, show)
    if not missing:
        return []
    more = f" and {missing - len(names)} more" if missing > len(names) else ""
    return [
        f"{missing} of {expected} expected shard files absent: {', '.join(names)}{more} "
        "(fine if those training ranks held none of the file's tensors)"
    ]


def _natural_key(name: str) -> list[tuple[int, object]]:
    """``layers.2`` before ``layers.10``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------- text rendering


def _size(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "()"


def _ranges(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` → ``1-3,5``."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _elide(text: str, width: int) -> str:
    """Shorten ``text`` to ``width`` by cutting its middle (names differ at both ends)."""
    if len(text) <= width:
        return text
    if width <= 3:
        return text[:width]
    head = (width - 1) // 2
    return text[:head] + "~" + text[len(text) - (width - 1 - head) :]


def _grid(headers: list[str], rows: list[list[str]], right: set[int], flex: int) -> list[str]:
    """Columns sized to their content; column ``flex`` is shortened (middle cut) to fit WIDTH."""
    widths = [max([len(h)] + [len(r[c]) for r in rows]) for c, h in enumerate(headers)]
    others = sum(w for c, w in enumerate(widths) if c != flex) + 2 * (len(widths) - 1)
    widths[flex] = max(len(headers[flex]), min(widths[flex], WIDTH - others))
    lines = []
    for row in [headers, *rows]:
        cells = [_elide(cell, widths[c]) for c, cell in enumerate(row)]
        cells = [cell.rjust(widths[c]) if c in right else cell.ljust(widths[c]) for c, cell in enumerate(cells)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _section(title: str, total: int, limit: int) -> tuple[str, int]:
    shown = total if limit <= 0 else min(total, limit)
    suffix = f" (first {shown} of {total}; --limit N or --json for all)" if shown < total else ""
    return f"{title}{suffix}", shown


def _more(total: int, shown: int, noun: str) -> list[str]:
    return [f"... and {_count(total - shown, 'more ' + noun)}"] if shown < total else []


def _render(report: InspectReport, limit: int) -> list[str]:
    out = [f"mpicons inspect: {report.input_dir}"]
    training = report.training_ranks
    trained = f" from {_count(len(training), 'training rank')}" if training else ""
    out.append(f"  shards   {_count(len(report.shards), 'file')}{trained}, {_count(report.pieces, 'piece')}")
    out.append(
        f"  tensors  {_count(len(report.tensors), 'tensor')}, {_size(report.total_bytes)} ({report.total_bytes} bytes) "
        f"in {_count(len(report.files), 'output file')}"
    )
    preview = f" (this run has {report.job_ranks})" if report.job_ranks != report.ranks else ""
    if report.plan is not None:
        out.append(
            f"  plan     {_count(report.ranks, 'rank')}{preview}, split by {report.split}: up to "
            f"{_size(max(report.bytes_per_rank))} per rank, max/mean {report.imbalance:.2f}"
        )
    else:
        out.append(f"  plan     none for {_count(report.ranks, 'rank')}{preview}: the checkpoint has problems")
    if report.mapping is not None:
        out.append(f"  mapping  {report.mapping}")
    out.append("  status   " + ("OK" if report.ok else f"{_count(len(report.problems), 'problem')} (listed at the end)"))

    file_number = {f.name: i + 1 for i, f in enumerate(report.files)}
    out.append("")
    title, shown = _section("output files", len(report.files), limit)
    out.append(title)
    rows = [[str(i + 1), f.name, str(f.tensors), _size(f.tensor_bytes), _size(f.size)] for i, f in enumerate(report.files[:shown])]
    out += _grid(["#", "file", "tensors", "tensor bytes", "file size"], rows, {0, 2, 3, 4}, 1)
    out += _more(len(report.files), shown, "file")

    if report.per_rank:
        out.append("")
        title, shown = _section(f"work per rank (split by {report.split})", len(report.per_rank), limit)
        out.append(title)
        total = report.total_bytes or 1
        rows = []
        for r in report.per_rank[:shown]:
            first = f"{r.work[0][0]}[{r.work[0][1]}:{r.work[0][2]}]" if r.work else "-"
            numbers = sorted(file_number[name] for name in r.files)
            rows.append([str(r.rank), _size(r.bytes), f"{100 * r.bytes / total:.1f}%", str(len(r.work)),
                         _ranges(numbers) or "-", first])
        out += _grid(["rank", "bytes", "share", "items", "files", "starts at (rows)"], rows, {0, 1, 2, 3}, 5)
        out += _more(len(report.per_rank), shown, "rank")

    out.append("")
    title, shown = _section("tensors", len(report.tensors), limit)
    out.append(title)
    rows = [
        [t.name, t.dtype, _shape(t.shape), str(t.pieces), str(file_number.get(t.file, "?")), _size(t.bytes), t.status]
        for t in report.tensors[:shown]
    ]
    out += _grid(["tensor", "dtype", "shape", "pieces", "file", "bytes", "status"], rows, {3, 4, 5}, 0)
    out += _more(len(report.tensors), shown, "tensor")

    out.append("")
    title, shown = _section("shard files", len(report.shards), limit)
    out.append(title)
    rows = [
        [s.name, "-" if s.training_rank is None else str(s.training_rank), "-" if s.output_index is None else str(s.output_index),
         str(s.pieces), _size(s.size)]
        for s in report.shards[:shown]
    ]
    out += _grid(["shard file", "training rank", "output #", "pieces", "size"], rows, {1, 2, 3, 4}, 0)
    out += _more(len(report.shards), shown, "shard file")

    if report.notes:
        out.append("")
        out += [f"note: {note}" for note in report.notes]
    if report.problems:
        out.append("")
        title, shown = _section("problems", len(report.problems), limit)
        out.append(title)
        out += [f"  {p}" for p in report.problems[:shown]]
        out += _more(len(report.problems), shown, "problem")
    return out


__all__ = ["inspect", "describe", "InspectReport", "TensorInfo", "FileInfo", "RankInfo", "ShardInfo", "Problem"]
