"""The pipeline, written once: start (the mapping and the model adapter) → scan → select → convert →
mapping → layout → checks → distribute, every step agreed over the communicator.

``consolidate`` (into a directory or a bucket), ``inspect`` and ``verify --against`` all run these
steps, so what ``inspect`` shows is what ``consolidate`` writes. A caller that reports problems instead
of raising them (``inspect``, ``verify``) passes a :class:`~mpicons.core.problems.Problems` to collect
them in; a consolidation passes none and stops at the first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..comm.agreement import Comm, agree, agree_on
from ..core.blocks import block_budget
from ..core.completeness import rank_problem
from ..core.errors import InputError
from ..core.facts import NAMES_NO_OUTPUT
from ..core.layout import Layout
from ..core.machine import check_buffer_size, host_name
from ..core.mapping import FileMapping, parse_mapping
from ..core.options import Options
from ..core.parts import Part
from ..core.planner import HF_MAX_SHARD_SIZE, build_layout
from ..core.problems import Problems
from ..core.runs import check_saved_views
from ..core.value_plan import LoraConfig
from ..io.inputs import InputStore
from ..io.lora_adapter import AdapterFolder
from ..io.output_formats import output_format
from ..io.s3_upload_plan import align_work
from .adapter_setup import Adapter, assets_mapping, convert_scanned, load_adapter, plan_scanned
from .archive_scan import scan_input
from .dropped import dropped_warnings
from .model_check import ModelConfig, check_model_shapes
from .scan import Scanned
from .shares import distribute
from .values_setup import Values, auxiliary, plan_values, read_lora


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


@dataclass(frozen=True)
class Start:
    """What a job knows before it reads the input: the mapping the user gave, the model adapter
    (its trainer, rules, config and assets), and the directory the trainer says holds the checkpoint."""

    input_dir: str  # as given
    directory: str  # the checkpoint's own (a run directory's iteration)
    mapping: dict[str, str] | None
    adapter: Adapter
    lora: AdapterFolder | LoraConfig | None = None  # ``--lora``: a peft adapter folder, or its config alone


def start(comm: Comm, input_dir: str, options: Options) -> Start:
    """The mapping and ``--lora``'s folder (read on rank 0) and the adapter (the trainers asked about the
    input), agreed."""
    mapping = agree_on(comm, 0, lambda: load_mapping(options.mapping) if options.mapping is not None else None)
    adapter = load_adapter(comm, options, input_dir)
    directory = adapter.directory(input_dir)
    return Start(input_dir, directory, mapping, adapter, read_lora(comm, options, directory))


def scan_selected(
    comm: Comm,
    begun: Start,
    options: Options,
    store: InputStore | None = None,
    problems: Problems | None = None,
    listing: bool | None = None,
) -> tuple[Scanned, list[str], Values]:
    """The input scanned, its tensors selected (``--include``, ``--exclude``, ``--strip-prefix``) and, with
    an adapter's rules, converted to Hugging Face's; also the saved names before the conversion, and the
    value ops planned on the tensors (dequantized, quantized, a LoRA merged: :mod:`.values_setup`).

    ``problems``: collect what is wrong instead of raising it (the scan then lists pieces it cannot read,
    and a wrong ``--expect-ranks`` is a problem); without it, what the dropped entries hold is read while
    their pieces are still there (warnings in the conversion's report). ``listing``: whether pieces that
    cannot be read are listed rather than raised (by default, when problems are collected)."""
    adapter = begun.adapter
    scanned = scan_input(
        begun.directory, comm, adapter.archives, listing=problems is not None if listing is None else listing,
        endpoint=options.s3_endpoint,
        store=store, allow=adapter.allow,
    )  # fmt: skip
    if problems is None:
        agree(comm, lambda: check_expected_ranks(scanned, options.expect_ranks))
    elif options.expect_ranks is not None:
        found = rank_problem(scanned.files, options.expect_ranks, begun.input_dir)
        if found is not None:
            problems.add(found)
    scanned = adapter.select(scanned, options.selection)
    saved_names = scanned.names
    if adapter.rules is not None:
        rules, config = adapter.rules, adapter.config
        conversion = agree(comm, lambda: plan_scanned(scanned, rules, config))
        if problems is None:
            conversion = replace(conversion, warnings=dropped_warnings(comm, scanned, conversion, options.buffer_size))
        scanned = convert_scanned(comm, scanned, rules, config, conversion)
    scanned, values = agree(comm, lambda: plan_values(scanned, options, adapter.config, begun.lora))
    return replace(scanned, notes=[*scanned.notes, *values.notes]), saved_names, values


def check_expected_ranks(scanned: Scanned, expect: int | None) -> None:
    """``--expect-ranks``: bad input unless the shard files come from exactly that many training ranks."""
    problem = None if expect is None else rank_problem(scanned.files, expect, scanned.directory)
    if problem is not None:
        raise InputError(problem.message)


def mapping_of(
    options: Options, mapping: dict[str, str] | None, scanned: Scanned, adapter: Adapter, values: Values | None = None
) -> dict[str, str] | None:
    """The output files' mapping: ``--mapping``, else the assets' index (unless ``--max-shard-size``), else None;
    without the tensors the value ops read and do not write (an FP8 weight's scales, an adapter's weights)."""
    if mapping is None and options.max_shard_size is None:
        mapping = assets_mapping(scanned.conversion, adapter.assets)
    read_only = frozenset() if values is None else values.plan.read_only
    if mapping is None or not read_only:
        return mapping
    kept = {name: file for name, file in mapping.items() if name not in read_only}
    source = getattr(mapping, "source", None)
    return kept if source is None else FileMapping(kept, source)


def layout_of(
    scanned: Scanned,
    ranks: int,
    options: Options,
    mapping: dict[str, str] | None,
    problems: Problems | None = None,
    gather_to: int | None = None,
    min_part: int = 0,
    values: Values | None = None,
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
        values=None if values is None else values.plan.ops,
        computed=None if values is None else values.plan.computed,
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
    values: Values | None = None,
) -> tuple[Layout, Part]:
    """The layout (the same on every rank) and this rank's checked part of the pieces; ``min_part``
    for an object-store output (see :func:`layout_of`); ``model``: the model's config, whose shapes are
    checked before the pieces move."""
    gather_to = options.gather_to
    layout = agree(comm, lambda: layout_of(scanned, comm.size, options, mapping, None, gather_to, min_part, values))
    check_model_shapes(comm, layout, model, whole=not (options.include or options.exclude))
    agree(comm, lambda: output_format(options.output_format).check(layout))
    part = distribute(comm, scanned, layout)
    check_views(comm, layout, part, options)
    if values is not None:
        part.auxiliary = auxiliary(comm, values, options.buffer_size)
    return layout, part


def check_views(comm: Comm, layout: Layout, part: Part, options: Options) -> None:
    """Saved views (transposed or sliced pieces) must fit the smallest blocks any writer uses: the
    node-local exchange's (four output slots)."""
    agree(comm, lambda: check_saved_views(layout, part, block_budget(options.buffer_size, 4)))


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


__all__ = [
    "Start",
    "check_buffer_fits",
    "check_options",
    "check_expected_ranks",
    "check_views",
    "layout_of",
    "load_mapping",
    "mapping_of",
    "plan_job",
    "scan_selected",
    "start",
]
