"""``mpicons shard``: a Hugging Face model written as a Megatron-Core ``torch_dist`` checkpoint, in parallel.

Phases, each agreed over the communicator: rank 0 reads the model's ``config.json`` and safetensors
headers (no data); every rank plans the same items (:mod:`mpicons.trainers.megatron.export`, the
rules read backwards); the owner stages ``release/`` and creates the data file at its full size with
every item's archive bytes; every rank copies its byte-balanced share of the tensors' rows straight
from the model's files (``copy_file_range``, cost per run of rows); the owner writes ``.metadata``,
``common.pt``, ``metadata.json`` and publishes ``release/`` and the tracker file as one transaction
(the tracker last: Megatron-LM sees nothing until then). Memory per rank: the plan (per run of rows,
per query group and layer at most) and one copy buffer.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..adaptation.inverse import invert
from ..comm import as_communicator
from ..comm.agreement import agree, agree_on
from ..core.errors import InputError
from ..core.safetensors_codec import DTYPE_BY_NAME, PREFIX_SIZE, BadPrefix, Header, header_length, parse_header
from ..io.backends import open_output
from ..io.inputs import InputStore, PosixInputs, open_inputs
from ..io.outdir import OutputDir
from ..io.outputs import OutputBackend
from ..io.regular_files import write_new_file
from ..io.sources import SourceFiles
from ..trainers import TRAINERS
from ..trainers.megatron.export import (
    DATA_FILE,
    METADATA_JSON,
    RELEASE,
    TRACKER_NAME,
    Item,
    Parallelism,
    check_layers,
    common_pt,
    metadata_pickle,
    plan_items,
    saved_form,
)

BUFFER = 16 << 20


def _no_hook(length: int) -> None:
    """Called before each copy (tests slow the copying down to act while it runs)."""


copy_hook: Callable[[int], None] = _no_hook


@dataclass(frozen=True)
class ShardOptions:
    """What ``mpicons shard`` is told: the mesh and layer spec, where the config is, how it publishes."""

    parallel: Parallelism = Parallelism()
    hf_assets: str | None = None  # the directory with config.json (default: the model's own)
    force: bool = False
    sync: bool = True
    s3_endpoint: str | None = None  # for an s3:// model: the S3 API's endpoint (default: boto3's own settings)


@dataclass(frozen=True)
class Model:
    """A Hugging Face model as rank 0 read it: config, files, and each tensor's file, dtype, shape and data offset."""

    config: dict[str, object]
    files: tuple[str, ...]
    tensors: dict[str, tuple[int, str, tuple[int, ...], int]]


@dataclass(frozen=True)
class Copy:
    """Bytes of one model file copied to the data file."""

    file: int
    source: int
    offset: int
    length: int


@dataclass(frozen=True)
class ShardResult:
    """What ``shard`` wrote: the checkpoint directory, its tensors and items, the bytes each rank copied."""

    checkpoint: str  # OUT/release
    tensors: int
    items: int
    bytes: int  # tensor bytes copied
    seconds: float
    bytes_per_rank: tuple[int, ...] = ()


def read_model(store: InputStore, hf_assets: str | None) -> Model:
    """The model's config and its safetensors headers, from a directory or an ``s3://`` prefix (bad input:
    a location that is not a model)."""
    jsons = dict(zip(*store.list_suffixed((".json",))))
    if hf_assets is not None:
        if not os.path.isfile(os.path.join(hf_assets, "config.json")):
            raise InputError(f"{os.path.join(hf_assets, 'config.json')}: not found; --hf-assets names the directory holding it")
        config = _json(PosixInputs(hf_assets), "config.json", None)
    elif "config.json" in jsons:
        config = _json(store, "config.json", jsons["config.json"])
    else:
        raise InputError(f"{store.path('config.json')}: not found; give the model's Hugging Face files with --hf-assets DIR")
    files = _weight_files(store, jsons)
    tensors: dict[str, tuple[int, str, tuple[int, ...], int]] = {}
    for number, (name, size) in enumerate(files):
        header = _header(store, name, size)
        for entry in header.tensors:
            if entry.name in tensors:
                raise InputError(f"{store.location}: {entry.name!r} is in {files[tensors[entry.name][0]][0]} and {name}")
            tensors[entry.name] = (number, entry.dtype, entry.shape, header.data_start + entry.begin)
    return Model(config, tuple(name for name, _ in files), tensors)


def _json(store: InputStore, name: str, size: int | None) -> dict[str, Any]:
    """A small JSON file of the model, read whole; bad input when it is missing or not an object."""
    try:
        source = store.open(name, size)
        try:
            raw = source.read_at(0, size if size is not None else os.path.getsize(store.path(name)))
        finally:
            source.close()
        value = json.loads(raw)
    except FileNotFoundError:
        raise InputError(f"{store.path(name)}: not found; give the model's Hugging Face files with --hf-assets DIR") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{store.path(name)}: cannot read it ({exc})") from None
    if not isinstance(value, dict):
        raise InputError(f"{store.path(name)}: not a JSON object")
    return value


def _weight_files(store: InputStore, jsons: dict[str, int]) -> list[tuple[str, int]]:
    """The model's weight files and sizes: those its index names, else every ``.safetensors`` file there."""
    listed = dict(zip(*store.list_suffixed((".safetensors",))))
    index = "model.safetensors.index.json"
    if index in jsons:
        try:
            wanted = sorted(set(_json(store, index, jsons[index])["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{store.path(index)}: not a Hugging Face index ({exc})") from None
        missing = [name for name in wanted if name not in listed]
        if missing:
            raise InputError(f"{store.path(missing[0])}: named by {index} but not there: is the model complete?")
        return [(name, listed[name]) for name in wanted]
    if not listed:
        raise InputError(f"{store.location}: no .safetensors files: give a Hugging Face model directory")
    return sorted(listed.items())


def _header(store: InputStore, name: str, size: int) -> Header:
    """One weight file's safetensors header, read with two ranged reads."""
    source = store.open(name, size)
    try:
        try:
            length = header_length(source.read_at(0, PREFIX_SIZE), size)
        except BadPrefix as exc:
            raise InputError(f"{store.path(name)}: not a safetensors file ({exc.what})") from None
        return parse_header(source.read_at(PREFIX_SIZE, length), size, store.path(name))
    finally:
        source.close()


@dataclass(frozen=True)
class Plan:
    items: tuple[Item, ...]
    copies: tuple[Copy, ...]
    size: int  # the data file's bytes
    dtype: str  # the weights' (most bytes), what common.pt's args say the run trains in


def plan_shard(model: Model, parallel: Parallelism) -> Plan:
    """Every item of the data file and every copy into it, in order (pure, the same on every rank)."""
    check_layers(model.config, parallel)
    rules = TRAINERS["megatron"].choose_rules(dict(model.config))
    vocab = int(model.config.get("vocab_size") or 0)  # type: ignore[call-overload]
    shapes = {name: shape for name, (_, _, shape, _) in model.tensors.items()}
    inverted = invert(shapes, rules, model.config, lambda rows: parallel.padded(rows) if rows == vocab else rows,
                      saved_form(model.config, parallel.spec))  # fmt: skip
    dtypes = {}
    for tensor in inverted.saved:
        found = {model.tensors[fill.source][1] for fill in tensor.fills}
        if len(found) != 1:
            raise InputError(f"{tensor.name}: made of tensors of dtypes {sorted(found)}; convert the model to one dtype first")
        dtypes[tensor.name] = found.pop()
    items = plan_items(inverted.saved, dtypes)
    copies = []
    for item in items:
        if item.tensor is None:
            continue
        row_bytes = _count(item.tensor.shape[item.tensor.stacked + 1 :]) * DTYPE_BY_NAME[item.dtype].bits // 8
        for fill in item.tensor.fills:
            file, _, _, start = model.tensors[fill.source]
            copies.append(
                Copy(file, start + fill.source_row * row_bytes, item.data_offset + fill.row * row_bytes, fill.rows * row_bytes)
            )
    size = items[-1].offset + items[-1].size if items else 0
    by_dtype: dict[str, int] = {}
    for item in items:
        by_dtype[item.dtype] = by_dtype.get(item.dtype, 0) + item.length
    return Plan(tuple(items), tuple(copies), size, max(by_dtype, key=lambda d: (by_dtype[d], d)))


def _count(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def share_of(copies: Sequence[Copy], rank: int, size: int) -> list[Copy]:
    """Rank ``rank``'s byte-balanced share of the copies: the bytes ``[T·r/n, T·(r+1)/n)`` of all of them,
    copies cut at the boundaries."""
    lengths = np.fromiter((c.length for c in copies), dtype=np.int64, count=len(copies))
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    low, high = total * rank // size, total * (rank + 1) // size
    mine = []
    first = int(np.searchsorted(ends, low, side="right"))
    for index in range(first, len(copies)):
        copy, begin = copies[index], int(ends[index] - lengths[index])
        if begin >= high:
            break
        cut_low, cut_high = max(low, begin) - begin, min(high, begin + copy.length) - begin
        if cut_high > cut_low:
            mine.append(Copy(copy.file, copy.source + cut_low, copy.offset + cut_low, cut_high - cut_low))
    return mine


def shard(
    model_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    options: ShardOptions | None = None,
    *,
    comm: object | None = None,
) -> ShardResult:
    """Write ``model_dir`` (a Hugging Face model directory) into ``output_dir`` as a Megatron-Core
    ``torch_dist`` checkpoint, over ``comm`` (default: ``MPI.COMM_WORLD``; any communicator
    :func:`mpicons.consolidate` takes)."""
    started = time.perf_counter()
    src, out, options, comm = os.fspath(model_dir), os.fspath(output_dir), options or ShardOptions(), as_communicator(comm)
    store: InputStore = agree(comm, lambda: open_inputs(src, options.s3_endpoint))
    model: Model = agree_on(comm, 0, lambda: read_model(store, options.hf_assets))
    plan: Plan = agree(comm, lambda: plan_shard(model, options.parallel))
    holder: list[OutputDir] = []
    try:
        staging: str = agree_on(comm, 0, lambda: _begin(out, options, holder))
        data_path = os.path.join(staging, RELEASE, DATA_FILE)
        output = agree(comm, lambda: open_output("posix", comm, [data_path], [b""], [plan.size], durable=options.sync))
        try:
            agree(comm, output.create)
            agree_on(comm, 0, lambda: _write_archives(output, plan.items))
            mine = share_of(plan.copies, comm.rank, comm.size)
            agree(comm, lambda: _copy_share(output, store.sources(model.files), mine))
            agree(comm, output.sync)
        finally:
            output.close()
        agree_on(comm, 0, lambda: _finish(holder[0], model, plan, options))
    finally:
        if holder:
            holder[0].close()
    tensors = sum(1 for item in plan.items if item.tensor is not None)
    per_rank = tuple(agree(comm, lambda: sum(c.length for c in mine), gather=True))
    return ShardResult(os.path.join(out, RELEASE), tensors, len(plan.items), sum(per_rank),
                       time.perf_counter() - started, per_rank)  # fmt: skip


def _begin(out: str, options: ShardOptions, holder: list[OutputDir]) -> str:
    """The owner takes the output directory and stages ``release/`` (an existing one is never replaced)."""
    if os.path.lexists(os.path.join(out, RELEASE)):
        raise InputError(
            f"{os.path.join(out, RELEASE)}: a checkpoint is there already; mpicons never replaces a directory: "
            "remove it, or give another output directory"
        )
    session = OutputDir.open(out)
    holder.append(session)
    session.aside = session.replaced_entries([RELEASE, TRACKER_NAME], options.force, checkpoint=False)
    staging, _ = session.stage()
    os.mkdir(os.path.join(staging, RELEASE), 0o755)
    return staging


def _write_archives(output: OutputBackend, items: Sequence[Item]) -> None:
    """The owner writes every item's archive bytes around the data the ranks copy in."""
    for item in items:
        output.write(0, item.offset, memoryview(item.before))
        if item.after:
            output.write(0, item.data_offset + item.length, memoryview(item.after))


def _copy_share(output: OutputBackend, sources: SourceFiles, copies: Sequence[Copy]) -> None:
    bounce = np.empty(BUFFER, dtype=np.uint8)
    try:
        for copy in copies:
            copy_hook(copy.length)
            output.copy(sources, copy.file, copy.source, 0, copy.offset, copy.length, bounce)
    finally:
        sources.close()


def _finish(session: OutputDir, model: Model, plan: Plan, options: ShardOptions) -> None:
    """The owner writes the small files and publishes ``release/`` with the tracker, the tracker last."""
    assert session.staging is not None
    folder = os.path.join(session.staging, RELEASE)
    checkpoint_id = os.path.join(os.path.abspath(session.path), RELEASE)
    write_new_file(os.path.join(folder, ".metadata"), metadata_pickle(plan.items, checkpoint_id), options.sync)
    write_new_file(os.path.join(folder, "common.pt"), common_pt(model.config, options.parallel, plan.dtype), options.sync)
    write_new_file(os.path.join(folder, "metadata.json"), METADATA_JSON, options.sync)
    session.write_staged(TRACKER_NAME, RELEASE.encode(), options.sync)
    session.publish([RELEASE, TRACKER_NAME], session.aside, options.sync, lambda: None)


__all__ = ["Parallelism", "ShardOptions", "ShardResult", "plan_shard", "read_model", "share_of", "shard"]
