"""Checking a consolidated checkpoint: file structure, index, and tensor values.

:func:`verify` is collective. Rank 0 lists the directory and reads the index; the output headers
are read round-robin over the ranks; with ``against`` every rank compares its byte-balanced share
of tensor rows with the shards, block by block. A ``SHA256SUMS`` in the directory is checked too,
every file it lists hashed by one rank (:mod:`.manifest_check`). Every problem is collected rather
than the first one raised, so one run tells the whole story, and every rank returns the same report.

What is read, and how (only regular files, bounded), is :mod:`.output_reading`; what is wrong
with it is decided by the pure checks of :mod:`mpicons.frontends.verify_checks`. Here: the value
comparison over the communicator, and the job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..comm import as_communicator
from ..comm.agreement import Comm, agree, agree_arguments, agree_on
from ..core.blocks import Block, Segment, segment_bytes, segment_offset
from ..core.completeness import caveat
from ..core.errors import InputError
from ..core.layout import Layout
from ..core.options import Options
from ..core.parts import Part
from ..core.planner import build_layout
from ..core.problems import Problems
from ..core.reports import Problem
from ..io.hdf5 import HDF5_NAME
from ..io.s3 import is_s3
from ..io.sources import SourceFiles
from ..job.adapter_setup import load_adapter
from ..job.exchange import feed_blocks
from ..job.model_check import judge, layout_tensors
from ..job.pipeline import Start, check_buffer_fits, check_views, scan_selected
from ..job.scan import Scanned, open_sources
from ..job.shares import distribute
from ..job.values_setup import auxiliary, read_lora
from ..trainers import known_rule_sets
from .manifest_check import check_manifest
from .output_reading import MAX_INDEX_SIZE, OutputFiles, check_file, list_output, open_regular
from .verify_checks import Diff, FileResult, Listing, Located, VerifyReport, against_checks, cross_check, diff_problems


class _Checker:
    """Compares assembled blocks (what the shards say) with the output files, segment by segment.

    The output bytes of a block are read with one read per contiguous stretch of an output file;
    only a block that differs is looked at segment by segment.
    """

    def __init__(self, layout: Layout, located: dict[str, Located], outputs: SourceFiles, out_ids: dict[str, int]) -> None:
        self.layout = layout
        self.located = located
        self.outputs = outputs
        self.out_ids = out_ids
        self.got = np.empty(0, dtype=np.uint8)
        self.diffs: dict[int, Diff] = {}

    def _where(self, segment: Segment) -> tuple[int, int, int]:
        """(output file id, byte offset, bytes) of a segment in the checked output."""
        tensor = self.layout.tensors[segment.tensor]
        inside = segment_offset(self.layout, segment) - tensor.offset
        where = self.located[tensor.name]
        return self.out_ids[where.file], where.start + inside, segment_bytes(self.layout, segment)[1]

    def __call__(self, block: Block, expected: np.ndarray) -> None:
        if len(self.got) < block.size:
            self.got = np.empty(block.size, dtype=np.uint8)
        got = self.got[: block.size]
        places = [self._where(s) for s in block.segments]
        position = 0
        while position < len(places):  # one read per contiguous stretch of one output file
            file, offset, size = places[position]
            last = position
            while last + 1 < len(places) and places[last + 1][0] == file and places[last + 1][1] == offset + size:
                last += 1
                size += places[last][2]
            start = sum(p[2] for p in places[:position])
            self.outputs.read_into(file, offset, got[start : start + size].data)
            position = last + 1
        if np.array_equal(got, expected):
            return
        start = 0
        for segment, (_, _, size) in zip(block.segments, places):
            self._segment(segment, got[start : start + size], expected[start : start + size])
            start += size

    def _segment(self, segment: Segment, got: np.ndarray, want: np.ndarray) -> None:
        tensor = self.layout.tensors[segment.tensor]
        unit = tensor.unit
        bad = (got.reshape(-1, unit) != want.reshape(-1, unit)).any(axis=1)
        if not bad.any():
            return
        first = int(np.argmax(bad))
        linear = (segment_offset(self.layout, segment) - tensor.offset) // unit + first
        index = tuple(int(i) for i in np.unravel_index(linear, tensor.storage))
        diff = self.diffs.setdefault(segment.tensor, Diff())
        diff.add(
            int(np.count_nonzero(bad)),
            index,
            got[first * unit : (first + 1) * unit].tobytes(),
            want[first * unit : (first + 1) * unit].tobytes(),
        )

    def fail(self, block: Block, error: BaseException) -> None:
        for segment in block.segments:
            self.diffs.setdefault(segment.tensor, Diff()).error = f"cannot compare: {error}"


def _compare_share(
    comm: Comm,
    scanned: Scanned,
    layout: Layout,
    part: Part,
    output_dir: str,
    located: dict[str, Located],
    comparable: set[int],
    buffer_size: int,
    follow_links: bool,
) -> dict[int, Diff]:
    """This rank's rows of the comparable tensors, assembled from the shards and compared; differences per tensor."""
    part.items = [item for item in part.items if item.tensor in comparable]
    out_names = sorted({located[layout.tensors[t].name].file for t in comparable})
    sources, outputs = open_sources(scanned), OutputFiles(output_dir, out_names, follow_links)
    checker = _Checker(layout, located, outputs, {name: i for i, name in enumerate(out_names)})
    try:
        feed_blocks(comm, scanned, layout, part, sources, buffer_size, checker, on_error=checker.fail)
    finally:
        sources.close()
        outputs.close()
    return checker.diffs


# ---------------------------------------------------------------- the job


def verify(
    output_dir: str | os.PathLike[str],
    options: Options | None = None,
    *,
    against: str | os.PathLike[str] | None = None,
    comm: object | None = None,
    follow_links: bool = False,
    **changes: Any,
) -> VerifyReport:
    """Check the consolidated checkpoint in ``output_dir``; with ``against``, every tensor against the shards.

    Parameters:
        output_dir: a consolidated checkpoint (safetensors files and ``model.safetensors.index.json``,
            or the ``model.h5`` of ``--format hdf5``). Structure is always checked: headers (HDF5:
            datasets), index, stray and missing files, leftovers of a run; with a ``SHA256SUMS`` there,
            every file it lists is hashed and compared with it, and files it does not list are problems.
            Only regular files inside the directory are opened: links, FIFOs and devices are reported, never read.
        options: the :class:`~mpicons.core.options.Options` the output was written with; keyword
            arguments change single fields. ``buffer_size`` is the bytes of buffers per rank for the
            comparison; with ``dtype`` the shards are converted the same way before comparing; with
            ``include``, ``exclude`` and ``strip_prefix`` they are selected and renamed alike.
        against: the shard directory it was made from (``{rank}`` allowed, as for consolidate): every
            tensor's dtype, shape and bytes are compared with the shards, block by block.
        comm: the communicator (default ``MPI.COMM_WORLD``); collective, files and blocks are split
            over its ranks.
        follow_links: accept symbolic links to regular files (a Hugging Face cache snapshot links
            its files into ``blobs/``); links to anything else are still reported.

    Problems with the checkpoint are collected in the returned :class:`VerifyReport` (the same on
    every rank), not raised. :class:`InputError` is raised on every rank when the arguments are
    unusable (missing directory, unreadable shards).
    """
    comm = as_communicator(comm)
    options = (options or Options()).with_changes(**changes)
    output_dir = os.fspath(output_dir)
    against = None if against is None else os.fspath(against)
    agree_arguments(
        comm, "verify", output=os.path.abspath(output_dir),
        against=against and (against if is_s3(against) else os.path.abspath(against)),
        options=options, follow_links=follow_links,
    )  # fmt: skip
    agree(comm, lambda: _refuse_options_without_shards(options, against))
    check_buffer_fits(comm, options.buffer_size)
    listing: Listing = agree_on(comm, 0, lambda: list_output(output_dir, follow_links))
    if listing.sharded:
        return VerifyReport(output_dir, against, comm.size, [], 0, 0, problems=list(listing.problems))
    files, results = _read_files(comm, output_dir, listing, follow_links)
    located, problems = cross_check(output_dir, listing, results)
    total = sum(w.nbytes for w in located.values())
    report = VerifyReport(
        output_dir=output_dir, against=against, ranks=comm.size, files=files, tensors=len(located), total_bytes=total
    )
    not_hashed = _check_manifest(comm, output_dir, follow_links, report, problems)
    if against is not None:
        checked = _Checked(output_dir, listing, results, located, follow_links)
        problems += _compare_with_shards(comm, against, options, checked, report)
    report.problems = sorted(problems, key=lambda p: (p.path or "", p.tensor or "", p.what))
    names = set(listing.refused) | {r.name for r in results if r.refused} | not_hashed
    report.refused = sorted(os.path.join(output_dir, name) for name in names)
    return report


#: Options that say how the shards become the output: meaningless without the shards to compare with.
_SHARD_OPTIONS = (
    "dtype",
    "keep_dtype",
    "include",
    "exclude",
    "strip_prefix",
    "main_params",
    "adapter",
    "hf_assets",
    "expect_ranks",
    "model_type",
)


def _refuse_options_without_shards(options: Options, against: str | None) -> None:
    """Bad input: an option about the shards given without ``against`` would be ignored, and an OK that
    ignored ``--expect-ranks`` or ``--hf-assets`` would claim a check that never ran."""
    if against is not None:
        return
    default = Options()
    given = [name for name in _SHARD_OPTIONS if getattr(options, name) != getattr(default, name)]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InputError(
            f"{flags}: about the shards the output was made from, so only with --against SHARD_DIR; add it or drop them"
        )


def _check_manifest(comm: Comm, output_dir: str, follow_links: bool, report: VerifyReport, problems: list[Problem]) -> set[str]:
    """The directory's SHA256SUMS checked (:mod:`.manifest_check`): its counts into ``report``, its problems added
    to ``problems`` but for a missing or refused file the structure checks named already; the names not opened."""
    manifest = check_manifest(comm, output_dir, follow_links)
    report.manifest, report.manifest_files, report.checksummed = manifest.path, manifest.listed, manifest.matched
    reported = {(p.kind, p.path) for p in problems}
    problems += [p for p in manifest.problems if (p.kind, p.path) not in reported]
    return set(manifest.refused)


def _read_files(comm: Comm, output_dir: str, listing: Listing, follow_links: bool) -> tuple[list[str], list[FileResult]]:
    """The checkpoint's files and what each holds: headers read round-robin over the ranks (HDF5: read by rank 0)."""
    if listing.hdf5 is not None:
        return [HDF5_NAME], [listing.hdf5]
    files = sorted(set(listing.found) | set(listing.listed_existing))
    mine = files[comm.rank :: comm.size]
    parts = agree(comm, lambda: [check_file(output_dir, name, follow_links) for name in mine], gather=True)
    return files, sorted((r for part in parts for r in part), key=lambda r: r.name)


@dataclass(frozen=True)
class _Checked:
    """What the structure checks found, which the comparison with the shards starts from."""

    output_dir: str
    listing: Listing
    results: list[FileResult]
    located: dict[str, Located]
    follow_links: bool


def _compare_with_shards(comm: Comm, against: str, options: Options, checked: _Checked, report: VerifyReport) -> list[Problem]:
    """Every tensor of the shards in ``against`` compared with the output; the counts go into ``report``."""
    output_dir, located = checked.output_dir, checked.located
    adapter = load_adapter(comm, options, against)
    found = Problems(strict=False)  # a wrong --expect-ranks; the shards' tensors as the adapter makes them
    directory = adapter.directory(against)
    begun = Start(against, directory, None, adapter, read_lora(comm, options, directory))
    scanned, _, values = scan_selected(comm, begun, options, problems=found, listing=False)
    views = None if scanned.conversion is None else scanned.conversion.views()
    layout = agree(
        comm,
        lambda: build_layout(
            scanned.files,
            scanned.names,
            scanned.facts,
            comm.size,
            dtype=options.dtype,
            views=views,
            keep_dtype=options.keep_dtype,
            values=values.plan.ops,
            computed=values.plan.computed,
        ),
    )
    part = distribute(comm, scanned, layout)
    check_views(comm, layout, part, options)
    part.auxiliary = auxiliary(comm, values, options.buffer_size)
    comparable, problems = against_checks(
        layout, against, output_dir, checked.listing, checked.results, located, known_rule_sets()
    )
    verdict = judge(comm, layout_tensors(layout), adapter.model, whole=not (options.include or options.exclude))
    problems += found.general + [p for _, p in verdict.problems()]
    report.caveat = caveat(scanned.files, options.expect_ranks, verdict.checked(scanned.names))
    shares = agree(
        comm,
        lambda: _compare_share(
            comm, scanned, layout, part, output_dir, located, comparable, options.buffer_size, checked.follow_links
        ),
        gather=True,
        collective=True,
    )
    diffs: dict[int, Diff] = {}
    for share in shares:
        for t, diff in share.items():
            diffs.setdefault(t, Diff()).merge(diff)
    problems += diff_problems(layout, output_dir, located, diffs)
    report.shard_tensors = len(layout.tensors)
    report.compared_tensors = len(comparable)
    report.compared_bytes = sum(layout.tensors[t].nbytes for t in comparable)
    return problems


__all__ = ["verify", "VerifyReport", "MAX_INDEX_SIZE", "open_regular"]
