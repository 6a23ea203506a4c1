"""The consolidate job: scan → plan → write → publish, every phase agreed over the communicator."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..adaptation.hints import trainer_names_note
from ..comm import as_communicator
from ..comm.agreement import Comm, agree, agree_arguments, agree_on, wait_for_all
from ..comm.interrupts import deferred, forget_pending, raise_pending, raising_inside
from ..core.blocks import block_budget
from ..core.completeness import rank_problem
from ..core.convert import prepare_conversion
from ..core.errors import InputError, MpiconsError
from ..core.facts import NAMES_NO_OUTPUT
from ..core.layout import Layout
from ..core.machine import check_buffer_size, check_names_fit, check_path_fits, host_name
from ..core.mapping import parse_mapping
from ..core.names import INDEX_NAME
from ..core.options import DEFAULT_BUFFER_SIZE, DTYPE_TARGETS, FORMATS, Options
from ..core.parts import Part
from ..core.planner import HF_MAX_SHARD_SIZE, build_layout
from ..core.problems import Problems
from ..core.runs import check_saved_views
from ..formats.unpickling import NOTHING
from ..io.backends import open_output
from ..io.formats import OutputFormat, output_format
from ..io.inputs import InputStore
from ..io.outdir import OutputDir, directory_identity, identities_up
from ..io.outputs import OutputBackend
from ..io.s3 import S3Location, is_s3
from ..io.s3_output import IN_FLIGHT
from ..io.s3_upload_plan import MIN_PART, align_work
from ..io.sources import SourceFiles
from ..trainers import rule_sets_reading
from .adapter_setup import Adapter, assets_mapping, convert_scanned, load_adapter, plan_scanned, refuse_checkpoint_output
from .archive_scan import scan_input
from .dropped import dropped_warnings
from .exchange import ExchangeWriter
from .model_check import ModelConfig, check_model_shapes
from .progress import Progress
from .replicas import check_replicas
from .s3_publish import S3Publish, check_s3_options
from .scan import Scanned, open_sources, open_store, rank_directory
from .shares import distribute, select
from .stats import PhaseClock, Stats, reduce_stats
from .writer import Writer

if TYPE_CHECKING:
    from ..io.assets import HFAssets

log = logging.getLogger("mpicons")

__all__ = ["consolidate", "ConsolidateResult", "Options", "load_mapping", "DEFAULT_BUFFER_SIZE", "FORMATS"]


@dataclass(frozen=True)
class ConsolidateResult:
    """What a consolidation produced; the same on every rank."""

    output_dir: str
    files: list[str]
    index_file: str
    tensors: int
    total_bytes: int
    stats: Stats
    layout: Layout
    hints: dict[str, str]
    bytes_per_rank: list[int]
    moved_bytes: int  # bytes sent between ranks over MPI (node-local shards / gather_to)
    shared_input: bool  # every rank could read every shard file
    notes: list[str] = field(default_factory=list)  # what was found and mended in the output directory
    skipped: list[str] = field(default_factory=list)  # entries that are not tensors (``.distcp``), left out
    #: The adapter's report: saved tensors skipped (per pattern) and dropped (each), one line each.
    adapted: list[str] = field(default_factory=list)
    #: Dropped entries that hold what the model loses (a routing bias that is not zero, a tied head that
    #: differs from the embeddings), one line each naming it.
    warnings: list[str] = field(default_factory=list)
    #: What the run could not know was wanted: without ``adapter``, names a built-in adapter would map.
    advice: list[str] = field(default_factory=list)
    #: The Hugging Face files published beside the weights (``hf_assets``, or a config a trainer derived).
    assets: list[str] = field(default_factory=list)
    #: What the trainer's leaf said of the input: the checkpoint recognised (its iteration), the adapter it
    #: chose, where the config came from; one line each.
    input_notes: list[str] = field(default_factory=list)


def load_mapping(mapping: str | os.PathLike[str] | Mapping[str, object]) -> dict[str, str]:
    """A ``--mapping`` argument (path to JSON, or the parsed object) as tensor name → file name."""
    if isinstance(mapping, Mapping):
        return parse_mapping(dict(mapping))
    path = os.fspath(mapping)
    try:
        with open(path, encoding="utf-8") as handle:
            obj = json.load(handle)
    except OSError as exc:
        raise InputError(f"{path}: cannot read mapping ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: mapping is not valid JSON ({exc})") from None
    return parse_mapping(obj, path)


def check_machine(comm: Comm, input_dir: str, output_dir: str, buffer_size: int, inside_input: bool = False) -> None:
    """Before anything is created: the output is no rank's input directory nor inside one (``inside_input``:
    it may be inside one), and the buffers fit in memory.

    Each rank compares the output directory and every directory above it, as it sees them, with the
    input directory of every rank on the same host (``{rank}`` resolved), so no file can be written
    among or below any rank's shards.
    """
    seen = agree(comm, lambda: (host_name(), directory_identity(rank_directory(input_dir, comm.rank))), gather=True)

    def check() -> None:
        host = seen[comm.rank][0]
        here = {rank: identity for rank, (other, identity) in enumerate(seen) if other == host}
        refuse_output_in_inputs(output_dir, input_dir, here, inside_input)
        check_buffer_size(buffer_size, sum(1 for other_host, _ in seen if other_host == host))

    agree(comm, check)


def refuse_output_in_inputs(
    output_dir: str, input_dir: str, inputs: dict[int, tuple[int, int] | None], inside_input: bool = False
) -> None:
    """Bad input when ``output_dir`` (or, unless ``inside_input``, a directory above it) is one of ``inputs``:
    rank → the identity of its input directory, for the ranks on this host."""
    for path, identity in identities_up(output_dir):
        rank = next((r for r, other in inputs.items() if other == identity), None)
        if rank is None:
            continue
        whose = f" (rank {rank}'s {rank_directory(input_dir, rank)})" if "{rank}" in input_dir else ""
        if path == os.path.realpath(output_dir):
            raise InputError(f"{output_dir}: output directory is the input directory{whose}")
        if inside_input:
            continue
        raise InputError(
            f"{output_dir}: output directory is inside the input directory {path}{whose}: mpicons never writes among "
            f"or below the shards it reads; give a directory outside it (its parent, {os.path.dirname(path)}, may be the output)"
        )


def mapped_names(mapping: dict[str, str] | None) -> dict[str, str]:
    """The file names a mapping gives, each with the first tensor it holds and where the mapping came from."""
    source = getattr(mapping, "source", "mapping")
    names: dict[str, str] = {}
    for tensor, file_name in (mapping or {}).items():
        names.setdefault(file_name, f"output file name (of tensor {tensor!r} in {source})")
    return names


def layout_names(layout: Layout, options: Options) -> dict[str, str]:
    return {name: "output file name" for name in output_format(options.output_format).final_names(layout)}


def check_output_names(comm: Comm, owner: int, output_dir: str, names: dict[str, str]) -> None:
    """Refuse, before anything is created or written, an output directory or file names the output file
    system cannot hold (too long, not plain names): bad input, not a create that fails mid-run."""

    def check() -> None:
        check_path_fits(output_dir, "output directory name")
        check_names_fit(output_dir, names)

    agree_on(comm, owner, check)


def check_options(comm: Comm, options: Options) -> None:
    """Check the options for this job before any work: also what needs MPI when the communicator is not
    MPI (a torch.distributed group)."""
    options.check(comm.size)
    if options.io == "mpiio" and not hasattr(comm, "mpi"):
        raise InputError(f"--io mpiio needs an MPI communicator, and this job's is a {type(comm).__name__}: use --io posix")


def check_buffer_fits(comm: Comm, buffer_size: int, parts: int = 0) -> None:
    """Refuse, before any work, a buffer size (plus ``parts`` bytes of upload parts) the ranks sharing a
    node cannot all have."""
    hosts = agree(comm, host_name, gather=True)
    agree(comm, lambda: check_buffer_size(buffer_size, hosts.count(hosts[comm.rank]), parts))


def scan_inputs(
    input_dir: str, comm: Comm, options: Options, adapter: Adapter | None = None, store: InputStore | None = None
) -> Scanned:
    """The scan of ``input_dir`` (through ``store`` when it is open already) with the tensors ``options``
    select (include, exclude, strip_prefix), converted by the adapter's rules when there are any
    (``input_dir``: the adapter's directory of the input, see :meth:`Adapter.directory`)."""
    allow = NOTHING if adapter is None else adapter.allow
    archives = None if adapter is None else adapter.archives
    scanned = scan_input(input_dir, comm, archives, endpoint=options.s3_endpoint, store=store, allow=allow)
    agree(comm, lambda: check_expected_ranks(scanned, options.expect_ranks))
    if adapter is None:
        scanned = select(scanned, options.include, options.exclude, options.strip_prefix)
    else:
        scanned = adapter.select(scanned, options)
    if adapter is not None and adapter.rules is not None:
        rules, config = adapter.rules, adapter.config
        conversion = agree(comm, lambda: plan_scanned(scanned, rules, config))
        # What the dropped entries hold is read while their pieces are still there.
        warnings = dropped_warnings(comm, scanned, conversion, options.buffer_size)
        scanned = convert_scanned(comm, scanned, rules, config, replace(conversion, warnings=warnings))
    return scanned


def check_expected_ranks(scanned: Scanned, expect: int | None) -> None:
    """``--expect-ranks``: bad input unless the shard files come from exactly that many training ranks."""
    problem = None if expect is None else rank_problem(scanned.files, expect, scanned.directory)
    if problem is not None:
        raise InputError(problem.message)


def mapping_of(options: Options, mapping: dict[str, str] | None, scanned: Scanned, adapter: Adapter) -> dict[str, str] | None:
    """The output files' mapping: ``--mapping``, else the assets' index (unless ``--max-shard-size``), else None."""
    if mapping is not None or options.max_shard_size is not None:
        return mapping
    return assets_mapping(scanned.conversion, adapter.assets)


def layout_of(
    scanned: Scanned,
    ranks: int,
    options: Options,
    mapping: dict[str, str] | None,
    problems: Problems | None = None,
    gather_to: int | None = None,
    min_part: int = 0,
) -> Layout:
    """The layout of what the scan found, for ``ranks`` writers and these options (pure); ``gather_to``
    gives all the work to that rank.

    Inputs that name no output files (``.distcp``) are sharded like Hugging Face's ``save_pretrained``
    (5GB files in the order the tensors were saved) unless a mapping or a shard size is given.
    ``min_part``: the smallest stretch of a file one rank may write (an object store's part), see
    :func:`~mpicons.io.s3_upload_plan.align_work`.
    """
    max_shard_size = options.max_shard_size
    if max_shard_size is None and mapping is None and scanned.files.source_format in NAMES_NO_OUTPUT:
        max_shard_size = HF_MAX_SHARD_SIZE
    layout = build_layout(
        scanned.files, scanned.names, scanned.facts, ranks, mapping=mapping, split=options.split, dtype=options.dtype,
        max_shard_size=max_shard_size, saved_order=scanned.order, problems=problems, gather_to=gather_to,
        views=None if scanned.conversion is None else scanned.conversion.views(), keep_dtype=options.keep_dtype,
    )  # fmt: skip
    if min_part:
        layout.work = align_work(layout, layout.work, min_part)
    return layout


def plan_job(
    comm: Comm,
    scanned: Scanned,
    options: Options,
    mapping: dict[str, str] | None,
    min_part: int = 0,
    model: ModelConfig | None = None,
) -> tuple[Layout, Part]:
    """The layout (the same on every rank) and this rank's checked part of the pieces; ``min_part``
    for an object-store output (see :func:`layout_of`); ``model``: the model's config, whose shapes are
    checked before the pieces move."""
    layout = agree(comm, lambda: layout_of(scanned, comm.size, options, mapping, gather_to=options.gather_to, min_part=min_part))
    check_model_shapes(comm, layout, model, whole=not (options.include or options.exclude))
    agree(comm, lambda: output_format(options.output_format).check(layout))
    part = distribute(comm, scanned, layout)
    # The node-local exchange's blocks (four output slots) are the smallest any writer uses.
    agree(comm, lambda: check_saved_views(layout, part, block_budget(options.buffer_size, 4)))
    return layout, part


def consolidate(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    options: Options | None = None,
    *,
    comm: object | None = None,
    inside_input: bool = False,
    **changes: Any,
) -> ConsolidateResult:
    """Consolidate the sharded checkpoint in ``input_dir`` into a Hugging Face checkpoint in ``output_dir``.

    Parameters:
        input_dir: the shard files (``shard-*-model-*.safetensors`` or plain safetensors). ``{rank}`` in it
            gives each rank its own directory (node-local shards); the same path may also name a
            different node-local disk on each node: each file is read by ranks that see it.
        output_dir: where ``model-*.safetensors`` and ``model.safetensors.index.json`` go; created if
            missing. It may be the input's parent, never an input directory nor inside one.
        options: an :class:`~mpicons.core.options.Options`; keyword arguments (``split="files"``,
            ``buffer_size=...``, any field of it) change single fields.
        comm: the communicator (default ``MPI.COMM_WORLD``). Collective: every rank of it calls this
            with the same arguments; other ranks of the job are untouched.
        inside_input: allow an output directory inside (never at) the input directory, as torch's
            consolidators do (its tests write to ``INPUT/consolidated``): the input is read without
            descending into directories, so no output file is ever read as a shard.

    The output directory is locked for the run; new files are written in a private staging
    directory and published as one transaction, so the directory holds either what it held before
    or the complete new checkpoint. Returns a :class:`ConsolidateResult` on every rank, or raises
    :class:`~mpicons.core.errors.InputError` (bad checkpoint or options) or
    :class:`~mpicons.core.errors.WriteError` (I/O failure, signal) on every rank alike.
    """
    comm = as_communicator(comm)
    options = (options or Options()).with_changes(**changes)
    input_dir, output_dir = os.fspath(input_dir), os.fspath(output_dir)
    agreed = options.with_changes(io_threads=0)  # background threads are each rank's own affair
    agree_arguments(
        comm, "consolidate", input=_absolute(input_dir), output=_absolute(output_dir), options=agreed, inside_input=inside_input
    )
    check_options(comm, options)
    prepare_conversion(options.dtype)  # before the clock starts: an import is no writing
    if is_s3(output_dir):
        return _consolidate_to_s3(comm, input_dir, output_dir, options)
    owner = options.gather_to if options.gather_to is not None else 0
    clock = PhaseClock()
    held: list[OutputDir] = []  # the owner's hold on the output directory
    try:
        with clock("scan"):
            mapping, notes, scanned, adapter = _scan_phase(comm, input_dir, output_dir, options, owner, held, inside_input)
            mapping = mapping_of(options, mapping, scanned, adapter)
            check_output_names(comm, owner, output_dir, mapped_names(mapping))
        with clock("plan"):
            layout, part = plan_job(comm, scanned, options, mapping, model=adapter.model)
            check_output_names(comm, owner, output_dir, layout_names(layout, options))
        with clock("write"):
            check_replicas(comm, scanned, layout, part, options.buffer_size)
            layout, written, moved, in_effect = _write(comm, held, scanned, layout, part, owner, options, adapter.assets)
        with clock("finalize"):
            fmt = output_format(options.output_format)
            agree_on(comm, owner, lambda: _publish(held[0], layout, fmt, options, adapter.assets))
            forget_pending()  # the checkpoint is complete: a signal now has nothing left to stop
    except BaseException as exc:
        for session in held:
            session.close()
        if isinstance(exc, MpiconsError):  # agreed: every rank is here, so all return after the cleanup
            wait_for_all(comm)
        raise
    for session in held:
        session.close()
    stats = reduce_stats(comm, clock, written, len(layout.files), len(layout.tensors), layout.total_bytes)
    result = _result(comm, output_dir, options, scanned, layout, stats, written, moved, in_effect, notes)
    return _with_names_report(result, scanned, options, adapter)


#: The report's line for an output without a config: what a user would otherwise find out from transformers.
NO_CONFIG = (
    "no config.json was published with the weights, so transformers cannot load {} as it is: give the model's "
    "Hugging Face files (config.json, tokenizer) with --hf-assets DIR"
)


def _with_names_report(result: ConsolidateResult, scanned: Scanned, options: Options, adapter: Adapter) -> ConsolidateResult:
    """The result with its lines about names and the input: the adapter's skipped and dropped entries and its
    warnings, or, without an adapter, the one the names seem to need; what the trainer's leaf noted of the
    input; and the assets published."""
    conversion = scanned.conversion
    assets = [] if adapter.assets is None else list(adapter.assets.files)
    unloadable = (
        [] if "config.json" in assets or options.output_format != "safetensors" else [NO_CONFIG.format(result.output_dir)]
    )
    result = replace(result, assets=assets, input_notes=[*adapter.notes, *scanned.notes, *unloadable])
    if conversion is not None:
        return replace(result, adapted=conversion.summary(), warnings=list(conversion.warnings.values()))
    note = None if options.adapter is not None else trainer_names_note(scanned.names, rule_sets_reading(scanned.names))
    return replace(result, advice=[] if note is None else [note])


def _absolute(location: str) -> str:
    """A path made absolute (as every rank must agree on it); an ``s3://`` URL as it is."""
    return location if is_s3(location) else os.path.abspath(location)


def _consolidate_to_s3(comm: Comm, input_dir: str, url: str, options: Options) -> ConsolidateResult:
    """:func:`consolidate` into ``s3://bucket/prefix``: the same phases, the output uploaded in parts by every
    rank (:mod:`mpicons.job.s3_publish`); any failure aborts every upload the run opened."""
    agree(comm, lambda: check_s3_options(options))
    agree(comm, lambda: _refuse_the_input_as_output(input_dir, url))
    clock = PhaseClock()
    publish: list[S3Publish] = []
    try:
        with clock("scan"):
            publish.append(agree(comm, lambda: S3Publish(comm, url, options)))
            mapping = agree_on(comm, 0, lambda: load_mapping(options.mapping) if options.mapping is not None else None)
            adapter = load_adapter(comm, options, input_dir)
            input_dir = adapter.directory(input_dir)
            check_buffer_fits(comm, options.buffer_size, (IN_FLIGHT + 1) * options.s3_part_size)
            store = open_store(comm, input_dir, options.s3_endpoint)  # an s3:// input's access checked first
            notes = publish[0].open()
            scanned = scan_inputs(input_dir, comm, options, adapter, store)
            mapping = mapping_of(options, mapping, scanned, adapter)
        with clock("plan"):
            layout, part = plan_job(comm, scanned, options, mapping, min_part=MIN_PART, model=adapter.model)
            assets = [] if adapter.assets is None else list(adapter.assets.files)
            publish[0].check_names([f.name for f in layout.files] + [INDEX_NAME] + assets)
        with clock("write"):
            check_replicas(comm, scanned, layout, part, options.buffer_size)
            sources = open_sources(scanned)
            try:
                written, moved = publish[0].write(
                    layout, lambda output: _write_share(comm, scanned, layout, part, sources, output, options)
                )
            finally:
                sources.close()
        with clock("finalize"):
            publish[0].commit(layout, adapter.assets)
            forget_pending()
    except BaseException as exc:
        if isinstance(exc, MpiconsError):  # agreed: every rank has stopped uploading before the owner aborts
            wait_for_all(comm)
        for held in publish:
            held.abort(everywhere=not isinstance(exc, MpiconsError))
            held.close()
        raise
    publish[0].close()
    stats = reduce_stats(comm, clock, written, len(layout.files), len(layout.tensors), layout.total_bytes)
    result = _result(comm, url, options, scanned, layout, stats, written, moved, {}, notes)
    return _with_names_report(result, scanned, options, adapter)


def _refuse_the_input_as_output(input_dir: str, url: str) -> None:
    """Bad input: an ``s3://`` output at the very location of the input, or below it (compared as parsed, so
    ``s3://b//p`` is ``s3://b/p``), as for a directory (:func:`refuse_output_in_inputs`)."""
    if not is_s3(input_dir):
        return
    source, target = S3Location.parse(input_dir), S3Location.parse(url)
    if source == target:
        raise InputError(f"{url}: the output is the input; give another prefix for the consolidated checkpoint")
    if source.bucket == target.bucket and (not source.prefix or target.prefix.startswith(source.prefix + "/")):
        raise InputError(
            f"{url}: the output is inside the input {source.url()}: mpicons never writes among or below the shards it "
            "reads; give a prefix outside it (the input's parent may be the output)"
        )


def _scan_phase(
    comm: Comm, input_dir: str, output_dir: str, options: Options, owner: int, held: list[OutputDir], inside_input: bool
) -> tuple[dict[str, str] | None, list[str], Scanned, Adapter]:
    """Everything before the plan: the mapping, adapter rules and assets read, names and machine checked,
    the output directory held by ``owner`` (appended to ``held``, so the caller releases it), the inputs
    scanned (and converted)."""

    def open_output_dir() -> list[str]:
        held.append(OutputDir.open(output_dir, options.break_lock))
        return held[0].notes

    mapping = agree_on(comm, 0, lambda: load_mapping(options.mapping) if options.mapping is not None else None)
    adapter = load_adapter(comm, options, input_dir)
    agree_on(comm, 0, lambda: refuse_checkpoint_output(output_dir, input_dir, inside_input))
    input_dir = adapter.directory(input_dir)  # a trainer's run directory: the iteration's
    check_output_names(comm, owner, output_dir, mapped_names(mapping))
    check_machine(comm, input_dir, output_dir, options.buffer_size, inside_input)
    store = open_store(comm, input_dir, options.s3_endpoint)  # an s3:// input's access checked before anything is made
    notes = agree_on(comm, owner, open_output_dir)
    if comm.rank == 0:
        for note in notes:
            log.info("%s: %s", output_dir, note)
    return mapping, notes, scan_inputs(input_dir, comm, options, adapter, store), adapter


def _result(
    comm: Comm,
    output_dir: str,
    options: Options,
    scanned: Scanned,
    layout: Layout,
    stats: Stats,
    written: int,
    moved: int,
    in_effect: dict[str, str],
    notes: list[str],
) -> ConsolidateResult:
    """The result every rank returns (collective: the bytes per rank and the bytes moved are gathered)."""
    return ConsolidateResult(
        output_dir=output_dir,
        files=[f.name for f in layout.files],
        index_file=INDEX_NAME if output_format(options.output_format).index(layout) is not None else "",
        tensors=len(layout.tensors),
        total_bytes=layout.total_bytes,
        stats=stats,
        layout=layout,
        hints=in_effect,
        bytes_per_rank=comm.allgather(written),
        moved_bytes=comm.allreduce(moved, "sum"),
        shared_input=scanned.shared,
        notes=notes,
        skipped=scanned.skipped,
    )


def _write(
    comm: Comm,
    held: list[OutputDir],
    scanned: Scanned,
    layout: Layout,
    part: Part,
    owner: int,
    options: Options,
    assets: HFAssets | None = None,
) -> tuple[Layout, int, int, dict[str, str]]:
    """Stage every output in the owner's private directory and fill it; returns the (re-targeted) layout,
    the bytes this rank wrote and sent, and the MPI-IO hints in effect."""
    fmt = output_format(options.output_format)
    layout = fmt.target(layout)
    names = fmt.final_names(layout) + ([] if assets is None else list(assets.files))

    def stage() -> str:
        session = held[0]
        session.aside = session.replaced_entries(names, options.force, checkpoint=fmt.checkpoint)
        return session.stage()

    staging = agree_on(comm, owner, stage)
    if fmt.preallocated:
        layout = agree_on(comm, owner, lambda: fmt.lay_out(staging, layout))
    paths = [os.path.join(staging, f.name) for f in layout.files]
    output = agree(
        comm,
        lambda: open_output(
            options.io,
            comm,
            paths,
            [f.header for f in layout.files],
            [f.size for f in layout.files],
            options.hints,
            preallocated=fmt.preallocated,
            owner=owner,
            durable=options.sync,
        ),
    )
    sources = open_sources(scanned)
    try:
        agree(comm, output.create)
        written, moved = agree(comm, lambda: _write_share(comm, scanned, layout, part, sources, output, options))
        agree(comm, output.sync)
        return layout, written, moved, output.hints_in_effect()
    finally:
        _close_quietly(output, sources)


def _publish(session: OutputDir, layout: Layout, fmt: OutputFormat, options: Options, assets: HFAssets | None) -> None:
    """The owner stages the Hugging Face assets and the index, and publishes everything as one transaction
    (commit point: the index, last).

    Signals are held back meanwhile; one that arrived is honoured at the commit point (rolled back).
    """
    durable = options.sync
    with deferred():
        staged: list[str] = []
        if assets is not None:
            assert session.staging is not None
            from ..io.assets import stage_assets

            target = None if options.dtype is None else DTYPE_TARGETS[options.dtype]
            staged = stage_assets(assets, session.staging, target, durable)
        index = fmt.index(layout)
        if index is not None:
            session.write_staged(INDEX_NAME, index, durable)
        session.publish(staged + fmt.final_names(layout), session.aside, durable, before_commit=raise_pending)
        forget_pending()


def _write_share(
    comm: Comm, scanned: Scanned, layout: Layout, part: Part, sources: SourceFiles, output: OutputBackend, options: Options
) -> tuple[int, int]:
    """This rank's share of the writing (bytes written, bytes sent); with progress, reports flow to rank 0 meanwhile."""
    exchanging = not scanned.shared or options.gather_to is not None
    # Making the channel and the reporter, and their teardown, are a protocol every rank must complete:
    # a signal stops only the writing itself (the exchange polls for signals between its blocks).
    with deferred():
        channel = comm.duplicate() if options.progress or exchanging else comm
        reporter = Progress(channel, layout.total_bytes, options.progress, verbose=options.verbose) if options.progress else None
        on_bytes = reporter.add if reporter is not None else None
        stopped = True  # until the share is done: a signal or an error on the way is no completion
        try:
            if not exchanging:
                with raising_inside():
                    raise_pending()
                    written = Writer(
                        layout, part, sources, output, options.buffer_size, on_bytes, io_threads=options.io_threads
                    ).run()
                stopped = False
                return written, 0
            writer = ExchangeWriter(
                layout,
                part,
                scanned.files,
                sources,
                output,
                options.buffer_size,
                channel,
                on_bytes,
                # An object store's parts are each one rank's, filled in order: no copies handed to
                # another rank, none left for the end (a part's buffer would wait for them).
                delegate=options.gather_to is None and output.any_rank_writes,
                copies=output.any_rank_writes,
            )
            written = writer.run()
            stopped = False
            return written, writer.sent
        finally:
            # Always report the end, also after a failure, so rank 0 never waits for a report that will not come.
            if reporter is not None:
                reporter.finish(stopped)
            wait_for_all(channel)
            if channel is not comm:
                channel.free()


def _close_quietly(output: OutputBackend, sources: SourceFiles) -> None:
    sources.close()
    try:
        output.close()
    except Exception:  # noqa: BLE001 - cleanup after a failure already being reported
        pass
