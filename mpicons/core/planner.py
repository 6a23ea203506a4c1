"""The layout built from the facts: tensor table and its checks, output files, sharding, work split.

Pure and deterministic (no MPI, no I/O): every rank computes the same layout from the same facts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from .convert import converted_dtype, keep_dtype_matches
from .errors import InputError
from .facts import FACT_KEY, TensorFacts
from .layout import OUTPUT_METADATA, Layout, OutputFile, Tensor, View
from .names import SINGLE_FILE_NAME, output_name
from .problems import Problems
from .reports import Problem, count_of
from .safetensors_codec import DTYPE_BY_NAME, DTYPE_ORDER, DTYPES, build_header
from .split import SPLITS, split_work
from .table import ShardFiles
from .value_plan import SCALE_SUFFIX
from .values import Computed, Quantize, ValueOp

#: Hugging Face's default ``max_shard_size`` ("5GB", 10⁹ bytes a GB): the sharding of inputs that name no files.
HF_MAX_SHARD_SIZE = 5 * 10**9


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """``layers.2`` before ``layers.10``: the order modules are usually defined in."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]


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
            (f1, v1), (f2, v2) = divmod(int(first[t]), FACT_KEY), divmod(int(odd[t]), FACT_KEY)
            message = (
                f"tensor {names[t]!r}: pieces disagree on {what}: "
                f"{show(v1)} in {files.names[f1]} but {show(v2)} in {files.names[f2]}"
            )
            problems.add(Problem(message, names[t], kind=kind, files=(files.names[f1], files.names[f2])), int(t))
    return broken


def tensor_table(
    files: ShardFiles, names: list[str], facts: TensorFacts, problems: Problems, views: Mapping[int, View] | None = None
) -> list[Tensor]:
    """The full tensors (dtype of the first piece, full shape = max extent) and their tensor-level problems.

    ``views`` gives the header shape and output axes of tensors whose pieces are in other coordinates
    (a model adapter's rotary row orders)."""
    broken = _agreement(files, names, facts, problems)
    dtype = (facts.dtype_first % FACT_KEY).astype(np.int64)
    ndim = (facts.ndim_first % FACT_KEY).astype(np.int64)
    tensors = []
    for t, name in enumerate(names):
        kind = DTYPES[int(dtype[t])]
        storage = tuple(int(x) for x in (facts.extent[t] if facts.declared is None else facts.declared[t]))
        rank = int(ndim[t])
        view = None if views is None else views.get(t)
        shape = list(storage[:rank] if view is None else view.shape)
        unit = kind.bits // 8 if kind.bits % 8 == 0 else 1
        if kind.bits % 8 and shape:
            shape[-1] = shape[-1] * 8 // kind.bits
        axes = None if view is None or view.axes is None else tuple(view.axes) + tuple(range(len(view.axes), len(storage)))
        tensors.append(Tensor(name, kind.name, tuple(shape), storage, unit, axes=axes))
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
        f1, d1 = divmod(int(facts.dest_first[t]), FACT_KEY)
        result.append(name_of(f1, d1))
        if facts.dest_odd[t] >= 0:
            f2, d2 = divmod(int(facts.dest_odd[t]), FACT_KEY)
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


def _with_computed(
    tensors: list[Tensor],
    assignment: list[str],
    saved_order: np.ndarray | None,
    computed: Mapping[str, tuple[str, tuple[int, ...]]],
) -> tuple[list[Tensor], list[str], np.ndarray | None]:
    """The tensors with the computed ones after them, each in the file of the tensor it follows (and
    saved right after it)."""
    position = {t.name: i for i, t in enumerate(tensors)}
    follows = [position[weight] for weight, _ in computed.values()]
    extra = [Tensor(name, "F32", shape, shape, 4, value=Computed(name)) for name, (_, shape) in computed.items()]
    order = None
    if saved_order is not None:
        order = np.concatenate(
            [np.asarray(saved_order, dtype=np.int64) * 2, np.asarray(saved_order, dtype=np.int64)[follows] * 2 + 1]
        )
    return tensors + extra, assignment + [assignment[t] for t in follows], order


def _converted(tensor: Tensor, target: str | None, keep: Sequence[str] = (), value: ValueOp | None = None) -> Tensor:
    if value is not None:
        tensor = replace(tensor, value=value)
    if isinstance(value, Quantize):
        return replace(tensor, dtype="F8_E4M3", unit=1)
    if keep and keep_dtype_matches(tensor.name, keep):
        return tensor
    dtype = converted_dtype(tensor.dtype, target)
    if dtype == tensor.dtype:
        return tensor
    return replace(tensor, dtype=dtype, unit=DTYPE_BY_NAME[dtype].bits // 8)


def _check_scaled_casts(tensors: list[Tensor], problems: Problems) -> None:
    """A block-quantized weight (float8 beside its ``<name>_scale_inv``) or its scales converted by
    ``--dtype`` would be cast without the other: values that load without an error and are wrong."""
    by_name = {t.name: t for t in tensors}
    for position, weight in enumerate(tensors):
        scales = by_name.get(weight.name + SCALE_SUFFIX)
        if scales is None or not weight.source_dtype.startswith("F8") or not (weight.converting or scales.converting):
            continue
        message = (
            f"tensor {weight.name!r} is block-quantized FP8 (its scales are {scales.name!r}): --keep-dtype keeps one "
            "of the two and --dtype casts the other, a model that loads and gives wrong answers: keep both with "
            f"--keep-dtype (a pattern for each, such as '*{SCALE_SUFFIX}'), or neither (the weight is dequantized)"
        )
        problems.add(Problem(message, weight.name, kind="quantized"), position)


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
    gather_to: int | None = None,
    views: Mapping[int, View] | None = None,
    keep_dtype: Sequence[str] = (),
    values: Mapping[str, ValueOp] | None = None,
    computed: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> Layout:
    """The layout for ``ranks`` writers. With strict ``problems`` (the default) the first problem is
    raised as InputError naming the tensor and files; otherwise problems are collected and a
    layout is still returned (broken tensors keep the first piece's dtype and the extent as shape).
    ``gather_to`` gives all the work to that rank (see :func:`split_work`); ``views`` are a model
    adapter's (see :func:`tensor_table`); tensors whose name matches a ``keep_dtype`` glob are not converted;
    ``values``: the value op of each tensor that has one (:mod:`.value_plan`); ``computed``: float32 tensors
    no piece holds (name → the tensor they follow, their shape), in that tensor's file right after it."""
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
    ops = values or {}
    tensors = [_converted(t, dtype, keep_dtype, ops.get(t.name)) for t in tensor_table(files, names, facts, problems, views)]
    _check_scaled_casts(tensors, problems)
    assignment = _assign_files(files, tensors, facts, mapping, problems)
    if computed:
        tensors, assignment, saved_order = _with_computed(tensors, assignment, saved_order, computed)
    if max_shard_size is not None:
        assignment = _pack_shards(tensors, assignment, max_shard_size, saved_order)
    tensors, out_files = _layout(tensors, assignment)
    layout = Layout(list(files.names), tensors, out_files)
    layout.work = split_work(layout, ranks, split, gather_to)
    return layout
