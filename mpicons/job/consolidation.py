"""The consolidate job: scan → plan → write → publish, every phase agreed over the communicator."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ..adaptation.hints import trainer_names_note
from ..comm import as_communicator
from ..comm.agreement import Comm, agree_arguments
from ..comm.interrupts import forget_pending
from ..core.convert import prepare_conversion
from ..core.errors import InputError
from ..core.layout import Layout
from ..core.names import INDEX_NAME
from ..core.options import DEFAULT_BUFFER_SIZE, FORMATS, Options
from ..core.parts import Part
from ..io.output_formats import output_format
from ..io.s3 import is_s3
from ..trainers import rule_sets_reading
from .adapter_setup import Adapter
from .directory_target import DirectoryTarget, mapped_names
from .pipeline import Start, check_options, load_mapping, mapping_of, plan_job, scan_selected, start
from .replicas import check_replicas
from .s3_publish import S3Target
from .scan import Scanned, open_store
from .stats import PhaseClock, Stats, reduce_stats
from .values_setup import adapter_folder, published_assets

if TYPE_CHECKING:
    from ..io.assets import HFAssets


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
    #: Output bytes a stopped earlier run of the same command had made durable, kept instead of written again.
    resumed_bytes: int = 0
    #: The checksum manifest published with the weights (``SHA256SUMS``), or "" (``manifest=False``).
    manifest: str = ""


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
    prepare_conversion(options.dtype or options.lora)  # before the clock starts: an import is no writing
    if is_s3(output_dir):
        if options.no_merge:
            raise InputError(f"{output_dir}: --no-merge writes a lora_adapter/ folder, which an s3:// output does not take yet")
        target: Target = S3Target.open(comm, input_dir, output_dir, options)
    else:
        target = DirectoryTarget(comm, output_dir, options, inside_input)
    return _run(comm, input_dir, target, options)


class Target(Protocol):
    """Where a consolidation goes (:class:`~mpicons.job.directory_target.DirectoryTarget`, or
    :class:`~mpicons.job.s3_publish.S3Target` for ``s3://``): the driver calls these in this order, each
    collective, and :meth:`release` last whatever happened."""

    output: str  # as given: a directory or an s3:// URL
    min_part: int  # the smallest stretch of a file one rank may write

    def check(self, begun: Start) -> None: ...  # before anything is made
    def hold(self) -> list[str]: ...  # the output taken (locked, recovered); notes
    def check_names(self, names: dict[str, str]) -> None: ...  # names the mapping gives
    def check_layout(self, layout: Layout, assets: HFAssets | None) -> None: ...  # every name published
    def write(self, scanned: Scanned, layout: Layout, part: Part, assets: HFAssets | None) -> Written: ...
    def publish(self, layout: Layout, assets: HFAssets | None) -> None: ...  # the commit point
    def release(self, failure: BaseException | None) -> None: ...

    resumed: int  # after write: bytes kept from a stopped earlier run (every rank's, summed)
    manifest: str  # after publish: the checksum manifest's name, or ""


#: What a target's write returns: the (re-targeted) layout, the bytes this rank wrote and sent, the MPI-IO hints in effect.
Written = tuple[Layout, int, int, dict[str, str]]


def _run(comm: Comm, input_dir: str, target: Target, options: Options) -> ConsolidateResult:
    """The phases: scan → plan → write → publish, each agreed; the target released whatever happens."""
    clock = PhaseClock()
    try:
        with clock("scan"):
            begun = start(comm, input_dir, options)
            target.check(begun)
            store = open_store(comm, begun.directory, options.s3_endpoint)  # an s3:// input's access checked first
            notes = target.hold()
            scanned, _, values = scan_selected(comm, begun, options, store)
            mapping = mapping_of(options, begun.mapping, scanned, begun.adapter, values)
            target.check_names(mapped_names(mapping))
        with clock("plan"):
            layout, part = plan_job(
                comm, scanned, options, mapping, min_part=target.min_part, model=begun.adapter.model, values=values
            )
            assets = published_assets(begun.adapter.assets, values)
            target.check_layout(layout, assets)
        with clock("write"):
            check_replicas(comm, scanned, layout, part, options.buffer_size)
            layout, written, moved, in_effect = target.write(scanned, layout, part, assets)
            assets = adapter_folder(comm, assets, values, options.buffer_size)
        with clock("finalize"):
            target.publish(layout, assets)
            forget_pending()  # the checkpoint is complete: a signal now has nothing left to stop
    except BaseException as exc:
        target.release(exc)
        raise
    target.release(None)
    stats = reduce_stats(comm, clock, written, len(layout.files), len(layout.tensors), layout.total_bytes)
    result = _result(comm, target.output, options, scanned, layout, stats, written, moved, in_effect, notes)
    result = replace(result, resumed_bytes=target.resumed, manifest=target.manifest)
    return _with_names_report(result, scanned, options, begun.adapter)


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
