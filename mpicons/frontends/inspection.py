"""Looking at a sharded checkpoint without writing anything: ``mpicons inspect``.

:func:`inspect` runs the same scan and plan as a consolidation, so what it shows is what a
consolidation would do: the tensors and their full shapes, the shard files, the output files and
each rank's share of the bytes. ``ranks`` previews a bigger job from one process. A checkpoint
the plan refuses (holes, overlaps, disagreeing pieces) is still described: every problem is
collected (each rank checks the rows it would own), so one run lists every broken tensor rather
than only the first.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..adaptation.apply import Conversion
from ..adaptation.hints import trainer_names_note
from ..comm import as_communicator
from ..comm.agreement import Comm, agree, agree_arguments
from ..core.completeness import UNCHECKED_HINT, caveat
from ..core.errors import InputError
from ..core.facts import TensorFacts
from ..core.layout import Layout
from ..core.names import INDEX_NAME, missing_shards
from ..core.options import Options
from ..core.owners import RowOwners
from ..core.planner import natural_key
from ..core.problems import Problems
from ..core.reports import Problem, human_bytes, skipped_entries, wrapped
from ..core.reports import count_of as _count
from ..core.split import SPLITS
from ..core.table import ShardFiles
from ..io.s3 import is_s3
from ..job.adapter_setup import Adapter
from ..job.model_check import judge, layout_tensors
from ..job.pipeline import layout_of, mapping_of, scan_selected, start
from ..job.scan import Scanned
from ..job.shares import distribute
from ..trainers import rule_sets_reading
from .manifest_check import manifest_summary

#: Width the table output is laid out for.
WIDTH = 100


_Row = TypeVar("_Row")


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
class MappingInfo:
    """One saved tensor under a model adapter: its Hugging Face name(s), the transform, the rule's line;
    ``fate`` is ``written``, ``dropped`` (on purpose) or ``skipped`` (not model state)."""

    source: str
    targets: tuple[str, ...]
    transform: str
    rule: str
    fate: str = "written"


def mapping_infos(names: Sequence[str], conversion: Conversion) -> list[MappingInfo]:
    """The adapter's mapping, a row per saved tensor, in the saved names' natural order."""
    outputs: dict[int, list[str]] = {}
    kind: dict[int, tuple[str, str]] = {}
    for o in conversion.outputs:
        outputs.setdefault(o.source, []).append(o.name)
        kind[o.source] = (o.kind, o.rule)
    rows = [MappingInfo(names[t], tuple(sorted(n, key=natural_key)), *kind[t]) for t, n in outputs.items()]
    rows += [
        MappingInfo(
            d.name,
            () if d.hf_name is None else (d.hf_name,),
            "skip" if d.skipped else "drop",
            d.rule,
            "skipped" if d.skipped else "dropped",
        )
        for d in conversion.dropped
    ]
    return sorted(rows, key=lambda r: natural_key(r.source))


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
    layout: Layout | None = None
    #: ``safetensors`` (DCP's Hugging Face layout or plain files) or ``distcp`` (DCP's default format).
    format: str = "safetensors"
    #: Entries that are not tensors, left out of a consolidation (``.distcp``: step counters, loader state).
    skipped: list[str] = field(default_factory=list)
    #: The model adapter's rule set and mapping (``--adapter``), a row per saved tensor; None without one.
    adapter: str | None = None
    mapping_rows: list[MappingInfo] = field(default_factory=list)
    #: What an OK rests on when the format records no full shapes (DCP's Hugging Face layout): the checks
    #: made (the model's config, ``--expect-ranks``) or what could not be known; None for other formats.
    caveat: str | None = None
    #: A SHA256SUMS in the input directory (a consolidated folder): how many files it lists; None without one.
    manifest: str | None = None

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
            "format": self.format,
            "skipped": list(self.skipped),
            "adapter": self.adapter,
            "caveat": self.caveat,
            "manifest": self.manifest,
            "adapter_mapping": [{**dataclasses.asdict(m), "targets": list(m.targets)} for m in self.mapping_rows],
            "summary": {
                "shard_files": len(self.shards),
                "training_ranks": len(self.training_ranks),
                "tensors": len(self.tensors),
                "pieces": self.pieces,
                "total_bytes": self.total_bytes,
                "output_files": len(self.files),
                "planned": self.layout is not None,
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
            "problems": [p.to_dict() for p in self.problems],
            "notes": list(self.notes),
        }

    def table(self, limit: int = 50) -> str:
        """The human-readable report, at most ``limit`` rows per list (0: all), within 100 columns."""
        return "\n".join(_render(self, limit))


# ---------------------------------------------------------------- inspect


def inspect(
    input_dir: str | os.PathLike[str],
    options: Options | None = None,
    *,
    comm: object | None = None,
    ranks: int | None = None,
    **changes: Any,
) -> InspectReport:
    """Describe the sharded checkpoint in ``input_dir`` and what consolidating it on ``ranks`` ranks would do.

    Parameters:
        input_dir: the shard files, as for :func:`~mpicons.consolidate`.
        options: the consolidation's :class:`~mpicons.options.Options` (``mapping``, ``split``,
            ``dtype`` and ``max_shard_size`` matter here); keyword arguments change single fields.
        comm: the communicator (default ``MPI.COMM_WORLD``); collective, the headers are read once,
            split over its ranks, and the report is the same on every rank.
        ranks: the job size to plan for (default ``comm.size``): a preview of a bigger job.

    Problems in the checkpoint are reported (every broken tensor, not only the first), not raised;
    :class:`InputError` is raised on every rank only when the checkpoint cannot be read at all or
    the options are wrong.
    """
    comm = as_communicator(comm)
    options = (options or Options()).with_changes(**changes)
    input_dir = os.fspath(input_dir)
    agree_arguments(
        comm, "inspect", input=input_dir if is_s3(input_dir) else os.path.abspath(input_dir), options=options, ranks=ranks
    )
    ranks = comm.size if ranks is None else ranks
    if type(ranks) is not int or ranks < 1:
        raise InputError(f"ranks must be a positive integer (got {ranks!r})")
    options.check(comm.size)
    begun = start(comm, input_dir, options)
    adapter, problems = begun.adapter, Problems(strict=False)
    # Tensors with pieces the scan cannot read are listed as problems, each of them, not raised.
    scanned, saved_names, values = scan_selected(comm, begun, options, problems=problems)
    mapping = mapping_of(options, begun.mapping, scanned, adapter, values)
    position = {name: t for t, name in enumerate(scanned.names)}
    for name in sorted(scanned.unreadable):
        problems.add(Problem(scanned.unreadable[name], name, kind="unreadable"), position[name])
    layout = agree(comm, lambda: layout_of(scanned, comm.size, options, mapping, problems, values=values))
    verdict = judge(comm, layout_tensors(layout), adapter.model, whole=not (options.include or options.exclude))
    for t, problem in verdict.problems():
        problems.add(problem, t)
    file_pieces, kept = _piece_counts(comm, scanned, layout, problems)
    report = describe(
        input_dir, scanned.files, scanned.facts, layout, problems, file_pieces, kept, ranks=ranks, job_ranks=comm.size,
        split=options.split, mapping_label=_mapping_label(options, mapping, adapter), mapped=mapping is not None,
        skipped=scanned.skipped,
    )  # fmt: skip
    _add_notes(report, adapter.notes, scanned, saved_names, options)
    report.caveat = caveat(scanned.files, options.expect_ranks, verdict.checked(scanned.names))
    report.manifest = manifest_summary(comm, input_dir)
    if report.caveat is not None and options.expect_ranks is None and verdict.checked(scanned.names) is None:
        report.notes.append(UNCHECKED_HINT)
    return report


def _mapping_label(options: Options, mapping: dict[str, str] | None, adapter: Adapter) -> str | None:
    """Where the output files' names come from: ``--mapping``'s file, else the assets' index, else nothing."""
    if options.mapping is not None and not isinstance(options.mapping, Mapping):
        return os.fspath(options.mapping)
    if options.mapping is None and mapping is not None and adapter.assets is not None:
        return os.path.join(adapter.assets.directory, INDEX_NAME)
    return None


def _piece_counts(comm: Comm, scanned: Scanned, layout: Layout, problems: Problems) -> tuple[np.ndarray, np.ndarray]:
    """The pieces each shard file holds, and the pieces each tensor's writers would copy (replicas once),
    summed over the ranks; distributing the pieces checks every rank's rows (problems collected)."""
    file_pieces = np.bincount(scanned.pieces.file, minlength=len(scanned.files)).astype(np.int64)
    comm.allreduce_array(file_pieces, "sum")
    part = distribute(comm, scanned, layout, problems)
    primary = RowOwners.of(layout).primary(part.pieces, comm.rank)
    kept = np.bincount(part.pieces.tensor[primary], minlength=len(scanned.names)).astype(np.int64)
    comm.allreduce_array(kept, "sum")
    return file_pieces, kept


def _add_notes(report: InspectReport, noted: Sequence[str], scanned: Scanned, saved_names: list[str], options: Options) -> None:
    """What the trainer's leaf and the scan noted, and the adapter's view of the names: its skipped
    entries and mapping rows, or (without an adapter) the one the names seem to need."""
    report.notes = [*noted, *scanned.notes, *report.notes]
    if scanned.conversion is not None:
        skipped = [line for line in scanned.conversion.summary() if line.startswith("skipped ")]
        report.notes += [f"adapter: {line}" for line in skipped]  # as consolidate reports them
        report.adapter = scanned.conversion.rules
        report.mapping_rows = mapping_infos(saved_names, scanned.conversion)
    elif options.adapter is None:
        report.notes += [note for note in [trainer_names_note(scanned.names, rule_sets_reading(scanned.names))] if note]


def _shard_infos(files: ShardFiles, file_pieces: np.ndarray) -> list[ShardInfo]:
    """One row per shard file: its name's numbers (None where the name has none), pieces and size."""
    return [
        ShardInfo(
            name,
            None if files.train_rank[f] < 0 else int(files.train_rank[f]),
            None if files.out_index[f] < 0 else int(files.out_index[f]),
            None if files.out_count[f] < 0 else int(files.out_count[f]),
            int(file_pieces[f]),
            int(files.size[f]),
        )
        for f, name in enumerate(files.names)
    ]


def _work_per_rank(layout: Layout, split: str, ranks: int) -> list[RankInfo]:
    """What each rank of a ``ranks``-rank job would write under the ``split`` policy."""
    per_rank = []
    for rank, items in enumerate(SPLITS[split](layout, ranks)):
        work = tuple((layout.tensors[i.tensor].name, i.row_begin, i.row_end, layout.item_bytes(i)) for i in items)
        touched = sorted({layout.tensors[i.tensor].file for i in items})
        per_rank.append(RankInfo(rank, sum(w[3] for w in work), tuple(layout.files[f].name for f in touched), work))
    return per_rank


def describe(
    input_dir: str,
    files: ShardFiles,
    facts: TensorFacts,
    layout: Layout,
    problems: Problems,
    file_pieces: np.ndarray,
    kept: np.ndarray,
    *,
    ranks: int,
    job_ranks: int = 1,
    split: str = "bytes",
    mapping_label: str | None = None,
    mapped: bool = False,
    skipped: Sequence[str] = (),
) -> InspectReport:
    """The report from the scan's facts, the layout and the problems found; pure, the same on every rank."""
    planned = not problems
    shards = _shard_infos(files, file_pieces)
    tensors = [
        TensorInfo(
            info.name,
            info.dtype,
            info.shape,
            int(facts.count[t]) if t < len(facts.count) else 0,  # a computed tensor (FP8 scales) has no piece
            layout.files[info.file].name,
            info.nbytes,
            (int(kept[t]) if t < len(kept) else 0) if planned else None,
            problems.by_tensor[t].message if t in problems.by_tensor else None,
        )
        for t, info in enumerate(layout.tensors)
    ]
    files_info = [
        FileInfo(out.name, len(out.tensors), sum(layout.tensors[t].nbytes for t in out.tensors), out.size if planned else None)
        for out in layout.files
    ]
    per_rank = _work_per_rank(layout, split, ranks) if planned else []
    listed = [*problems.general]
    listed += [problems.by_tensor[t] for t in sorted(problems.by_tensor, key=lambda t: natural_key(layout.tensors[t].name))]
    tensors.sort(key=lambda info: natural_key(info.name))
    return InspectReport(
        input_dir=input_dir,
        ranks=ranks,
        job_ranks=job_ranks,
        split=split,
        mapping=mapping_label if mapping_label is not None else ("<mapping>" if mapped else None),
        shards=shards,
        tensors=tensors,
        files=files_info,
        per_rank=per_rank,
        problems=listed,
        notes=_missing_shard_notes(files.names),
        layout=layout if planned else None,
        format=files.source_format,
        skipped=list(skipped),
    )


def _missing_shard_notes(names: list[str], show: int = 5) -> list[str]:
    """Hints about absent shard files: every training rank usually writes one per output file."""
    missing, expected, shown = missing_shards(names, show)
    if not missing:
        return []
    more = f" and {missing - len(shown)} more" if missing > len(shown) else ""
    return [
        f"{missing} of {expected} expected shard files absent: {', '.join(shown)}{more} "
        "(fine if those training ranks held none of the file's tensors)"
    ]


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


def _summary(report: InspectReport) -> list[str]:
    out = [f"mpicons inspect: {report.input_dir}"]
    training = report.training_ranks
    trained = f" from {_count(len(training), 'training rank')}" if training else ""
    kind = " (DCP .distcp)" if report.format == "distcp" else ""
    out.append(f"  shards   {_count(len(report.shards), 'file')}{kind}{trained}, {_count(report.pieces, 'piece')}")
    if report.skipped:
        out.append(f"  skipped  {skipped_entries(report.skipped)}")
    out.append(
        f"  tensors  {_count(len(report.tensors), 'tensor')}, {_size(report.total_bytes)} ({report.total_bytes} bytes) "
        f"in {_count(len(report.files), 'output file')}"
    )
    preview = f" (this run has {report.job_ranks})" if report.job_ranks != report.ranks else ""
    if report.layout is not None:
        out.append(
            f"  plan     {_count(report.ranks, 'rank')}{preview}, split by {report.split}: up to "
            f"{_size(max(report.bytes_per_rank))} per rank, max/mean {report.imbalance:.2f}"
        )
    else:
        out.append(f"  plan     none for {_count(report.ranks, 'rank')}{preview}: the checkpoint has problems")
    if report.mapping is not None:
        out.append(f"  mapping  {report.mapping}")
    out += wrapped([f"  manifest {report.manifest}"], WIDTH) if report.manifest is not None else []
    status = "OK" if report.ok else f"{_count(len(report.problems), 'problem')} (listed at the end)"
    out += wrapped([f"  status   {status}" + ("" if report.caveat is None or not report.ok else f"; {report.caveat}")], WIDTH)
    return out


def _table(title: str, items: Sequence[_Row], limit: int, noun: str, columns: str, row: Callable[[_Row], list[str]]) -> list[str]:
    """A titled list of at most ``limit`` rows (0: all) and a line saying how many more there are.

    ``columns`` names the columns, separated by ``|``: a leading ``>`` right-aligns one, a leading
    ``*`` makes it the column that wraps when the terminal is narrow.
    """
    names = columns.split("|")
    headers = [name.lstrip(">*") for name in names]
    right = {i for i, name in enumerate(names) if name.startswith(">")}
    flex = next(i for i, name in enumerate(names) if name.startswith("*"))
    heading, shown = _section(title, len(items), limit)
    return ["", heading, *_grid(headers, [row(item) for item in items[:shown]], right, flex), *_more(len(items), shown, noun)]


def _render(report: InspectReport, limit: int) -> list[str]:
    out = _summary(report)
    file_number = {f.name: i + 1 for i, f in enumerate(report.files)}
    total = report.total_bytes or 1

    def rank_row(r: RankInfo) -> list[str]:
        first = f"{r.work[0][0]}[{r.work[0][1]}:{r.work[0][2]}]" if r.work else "-"
        numbers = sorted(file_number[name] for name in r.files)
        return [str(r.rank), _size(r.bytes), f"{100 * r.bytes / total:.1f}%", str(len(r.work)), _ranges(numbers) or "-", first]

    def file_row(f: FileInfo) -> list[str]:
        return [str(file_number[f.name]), f.name, str(f.tensors), _size(f.tensor_bytes), _size(f.size)]

    def tensor_row(t: TensorInfo) -> list[str]:
        number = str(file_number.get(t.file, "?"))
        return [t.name, t.dtype, _shape(t.shape), str(t.pieces), number, _size(t.bytes), t.status]

    def shard_row(s: ShardInfo) -> list[str]:
        return [s.name, _dash(s.training_rank), _dash(s.output_index), str(s.pieces), _size(s.size)]

    if report.adapter is not None:
        columns = "saved tensor|transform|*Hugging Face name|line"
        out += _table(f"adapter {report.adapter}", report.mapping_rows, limit, "saved tensor", columns, _mapping_row)
    out += _table("output files", report.files, limit, "file", ">#|*file|>tensors|>tensor bytes|>file size", file_row)
    if report.per_rank:
        columns = ">rank|>bytes|>share|>items|files|*starts at (rows)"
        out += _table(f"work per rank (split by {report.split})", report.per_rank, limit, "rank", columns, rank_row)
    columns = "*tensor|dtype|shape|>pieces|>file|>bytes|status"
    out += _table("tensors", report.tensors, limit, "tensor", columns, tensor_row)
    columns = "*shard file|>training rank|>output #|>pieces|>size"
    out += _table("shard files", report.shards, limit, "shard file", columns, shard_row)
    if report.notes:
        out += ["", *wrapped([f"note: {note}" for note in report.notes], WIDTH)]
    if report.problems:
        heading, shown = _section("problems", len(report.problems), limit)
        out += ["", heading, *(f"  {p}" for p in report.problems[:shown]), *_more(len(report.problems), shown, "problem")]
    return out


def _mapping_row(m: MappingInfo) -> list[str]:
    targets = m.targets[0] if len(m.targets) == 1 else f"{m.targets[0]} ... ({len(m.targets)})" if m.targets else "-"
    return [m.source, m.transform if m.fate == "written" else m.fate, targets, m.rule.rsplit(":", 1)[-1]]


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


__all__ = ["inspect", "describe", "InspectReport", "TensorInfo", "FileInfo", "RankInfo", "ShardInfo"]
