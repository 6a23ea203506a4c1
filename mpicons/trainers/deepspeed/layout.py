"""Where every element of a ZeRO checkpoint's weights lies (pure: a function of what the files say).

The fp32 master weights are the source of truth (the 16-bit module weights of stages 1-2 are their
rounding, and stage 3 saves only empty placeholders):

- **Stages 1 and 2**: per parameter group, the trainable parameters are concatenated in
  ``param_shapes`` order into one flat buffer, padded at the end to a multiple of 2 × world size and
  split evenly over the ranks; each rank's optimizer states hold its slice with the padding left out.
  The ranks' slices in rank order are the buffer, and parameter *i* its next ``numel`` elements:
  pieces cut anywhere, at element granularity.
- **Stage 3**: each parameter is split on its own into ``p = ceil(numel / world)`` elements per rank
  (the last rank's slice padded with uninitialised memory, dropped here); a rank's ``fp32_flat_groups``
  concatenate its slices of every parameter in ``param_shapes`` order, each exactly ``p`` long.

Tied parameters (``shared_params``) are written once, under the name ``param_shapes`` lists, as
``save_pretrained`` writes tied embeddings; frozen parameters and buffers come from the model
states, in the order DeepSpeed's own converter writes them (buffers, frozen, trainable).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...core.errors import InputError
from ...core.flat_pieces import FlatBuffer, FlatPiece, Param, Run, TrainerLayout
from ...core.reports import count_of, human_bytes
from ...core.safetensors_codec import DTYPE_BY_NAME
from .files import ZeroFiles
from .records import Stored, ZeroModel, ZeroPartition


def check_ranks(files: ZeroFiles, world_size: int, directory: str, recorded_in: str) -> None:
    """Every rank's files must be present, and none beyond the recorded world size (a missing rank
    would make shorter parameters, a stray one a second checkpoint mixed in)."""
    kinds = [("optimizer states", files.optim_states, files.optim_name)]
    if files.stage3:
        kinds.append(("model states", files.model_states, files.model_name))
    for kind, present, name_of in kinds:
        missing = [r for r in range(world_size) if r not in present]
        if missing:
            raise InputError(
                f"{directory}/{name_of(missing[0])}: missing ({kind} of rank {missing[0]}; {recorded_in} records "
                f"{world_size} data-parallel ranks{_more(missing)}): copy every rank's files"
            )
        stray = sorted(r for r in present if r >= world_size)
        if stray:
            raise InputError(
                f"{directory}/{present[stray[0]]}: rank {stray[0]}'s {kind}, but {recorded_in} records {world_size} "
                "data-parallel ranks (two checkpoints mixed in one directory?)"
            )


def _more(missing: list[int]) -> str:
    if len(missing) == 1:
        return ""
    return f"; ranks {', '.join(map(str, missing[:8]))}{', ...' if len(missing) > 8 else ''} are missing"


def zero_layout(
    files: ZeroFiles, models: Sequence[ZeroModel], partitions: Sequence[ZeroPartition], directory: str
) -> TrainerLayout:
    """The tensors of the checkpoint and their flat pieces, from every file's records (stage 3: every
    rank's model states; stages 1-2: the one). Raises InputError naming the file for anything that
    does not add up."""
    model = min(models, key=lambda m: m.rank)
    world = model.world_size
    recorded = f"{model.file} (dp_world_size)"
    if model.model_parallel != 1:
        raise InputError(f"{directory}/{model.file}: saved with {model.model_parallel}-way tensor parallelism: not supported")
    check_ranks(files, world, directory, recorded)
    for other in models:
        if other.param_shapes != model.param_shapes or other.world_size != world:
            raise InputError(
                f"{directory}/{other.file}: records other parameters or another world size than {model.file} "
                "(two checkpoints mixed?)"
            )
    ranked = sorted(partitions, key=lambda p: p.rank)
    stage = _stage(files, model, ranked, world, directory)
    params: list[Param] = [Param(b.name, b.dtype, b.shape) for b in model.buffers]
    pieces = [FlatPiece(b.name, 0, b.numel, b.file, b.begin) for b in model.buffers]
    _frozen(sorted(models, key=lambda m: m.rank), stage, params, pieces, directory)
    trainable = _zero3(model, ranked, directory) if stage == 3 else _zero2(model, ranked, directory)
    params += [p for p, _ in trainable]
    pieces += [piece for _, found in trainable for piece in found]
    written = {p.name for p in params}
    tied = {alias: source for alias, source in model.shared.items() if alias not in written}
    unknown = sorted(alias for alias, source in tied.items() if source not in written)
    if unknown:
        alias = unknown[0]
        raise InputError(f"{directory}/{model.file}: tied parameter {alias!r} names {tied[alias]!r}, which is not saved")
    return TrainerLayout(params, pieces, tied, _skipped(model, ranked, stage))


def _stage(files: ZeroFiles, model: ZeroModel, ranked: Sequence[ZeroPartition], world: int, directory: str) -> int:
    stage = ranked[0].stage
    for partition in ranked:
        if partition.stage != stage or partition.partition_count != world:
            raise InputError(
                f"{directory}/{partition.file}: ZeRO stage {partition.stage} over {partition.partition_count} ranks, but "
                f"{ranked[0].file} says stage {stage} and {model.file} {world} ranks (two checkpoints mixed?)"
            )
        if partition.aligned_params:
            raise InputError(f"{directory}/{partition.file}: saved with per-parameter alignment padding: not supported")
    if (stage == 3) != files.stage3 or (model.stage is not None and model.stage != stage):
        raise InputError(
            f"{directory}: the optimizer states say ZeRO stage {stage}, but the model states are "
            f"{'one per rank (stage 3)' if files.stage3 else 'one file (stages 1-2)'} and record stage {model.stage}"
        )
    return stage


def _zero2(model: ZeroModel, ranked: Sequence[ZeroPartition], directory: str) -> list[tuple[Param, list[FlatPiece]]]:
    """Stages 1-2: each group's buffer is the ranks' slices in rank order; parameters follow one another."""
    found = []
    world = len(ranked)
    for g, shapes in enumerate(model.param_shapes):
        slices = [_group(p, g, len(model.param_shapes), directory) for p in ranked]
        buffer = FlatBuffer([Run(s.file, s.begin, s.numel) for s in slices], _itemsize(slices, directory))
        total = sum(math.prod(shape) for _, shape in shapes)
        align = 2 * world
        _equal_partitions(slices, -(-total // align) * align // world, total, g, directory)  # the buffer holds them all
        at = 0
        for name, shape in shapes:
            count = math.prod(shape)
            found.append((Param(name, slices[0].dtype, shape), buffer.cut(name, at, count, 0)))
            at += count
    return found


def _zero3(model: ZeroModel, ranked: Sequence[ZeroPartition], directory: str) -> list[tuple[Param, list[FlatPiece]]]:
    """Stage 3: rank R holds elements [R·p, (R+1)·p) of each parameter, p = ceil(numel / world), one after another."""
    world = len(ranked)
    shapes = [entry for group in model.param_shapes for entry in group]
    sizes = [math.prod(shape) for _, shape in shapes]
    parts = [-(-n // world) for n in sizes]
    itemsize = _itemsize([group for partition in ranked for group in partition.groups], directory)
    buffers = []
    for partition in ranked:
        buffer = FlatBuffer([Run(s.file, s.begin, s.numel) for s in partition.groups], itemsize)
        if buffer.numel != sum(parts):
            raise InputError(
                f"{directory}/{partition.file}: its fp32 slices hold {buffer.numel} elements, the {len(shapes)} parameters "
                f"of {model.file} need {sum(parts)} per rank (ceil(numel / {world}) each; damaged, or not this checkpoint's?)"
            )
        buffers.append(buffer)
    dtype = ranked[0].groups[0].dtype if ranked[0].groups else "F32"
    found, at = [], 0
    for (name, shape), numel, part in zip(shapes, sizes, parts):
        pieces = []
        for rank, buffer in enumerate(buffers):
            count = max(0, min(part, numel - rank * part))  # the last ranks' padding left out
            pieces += buffer.cut(name, at, count, rank * part) if count else []
        found.append((Param(name, dtype, shape), pieces))
        at += part
    return found


def _frozen(models: Sequence[ZeroModel], stage: int, params: list[Param], pieces: list[FlatPiece], directory: str) -> None:
    """Frozen parameters: saved whole in the model states (stages 1-2), or each rank's slice in its own
    model states, the slices in rank order and cut to the parameter's size (stage 3)."""
    for name, shape in models[0].frozen:
        numel = math.prod(shape)
        fragments = [m.fragments.get(name) for m in (models if stage == 3 else models[:1])]
        absent = [m.file for m, f in zip(models, fragments) if f is None]
        if absent:
            raise InputError(f"{directory}/{absent[0]}: frozen parameter {name!r} has no saved value")
        stored = [f for f in fragments if f is not None]
        buffer = FlatBuffer([Run(f.file, f.begin, f.numel) for f in stored], _itemsize(stored, directory))
        if buffer.numel < numel or (stage != 3 and buffer.numel != numel):
            raise InputError(
                f"{directory}/{stored[0].file}: frozen parameter {name!r} of shape {list(shape)}: {buffer.numel} elements saved"
            )
        params.append(Param(name, stored[0].dtype, shape))
        pieces += buffer.cut(name, 0, numel, 0) if numel else []


def _equal_partitions(slices: Sequence[Stored], size: int, total: int, g: int, directory: str) -> None:
    """DeepSpeed cuts a group's flat buffer, padded to ``size`` elements per rank, into one partition per rank:
    every rank but the last holds ``size`` elements, the last the rest (with or without its padding). A
    slice of another size (one short, another long, the same total) would shift every later parameter."""
    rest = total - size * (len(slices) - 1)
    for rank, stored in enumerate(slices):
        last = rank == len(slices) - 1
        if (stored.numel != size) if not last else not rest <= stored.numel <= size:
            wanted = f"{size}" if not last else f"{rest} to {size}"
            raise InputError(
                f"{directory}/{stored.file}: parameter group {g}: its fp32 partition holds {stored.numel} elements, "
                f"DeepSpeed gives rank {rank} of {len(slices)} {wanted} for the group's {total} (damaged, or files mixed?)"
            )


def _group(partition: ZeroPartition, g: int, groups: int, directory: str) -> Stored:
    if len(partition.groups) != groups:
        raise InputError(f"{directory}/{partition.file}: {len(partition.groups)} parameter groups, the model states {groups}")
    return partition.groups[g]


def _itemsize(stored: Sequence[Stored], directory: str) -> int:
    dtypes = sorted({s.dtype for s in stored})
    if len(dtypes) > 1:
        raise InputError(f"{directory}/{stored[-1].file}: flat buffers of {' and '.join(dtypes)} for one parameter group")
    return DTYPE_BY_NAME[dtypes[0]].bits // 8 if dtypes else 4


def _skipped(model: ZeroModel, ranked: Sequence[ZeroPartition], stage: int) -> list[str]:
    tensors = sum(p.skipped_tensors for p in ranked)
    lines = []
    if tensors:  # a checkpoint saved without the optimizer's moments has none to skip
        lines.append(
            f"optimizer state (Adam moments, step counters): {count_of(tensors, 'tensor')}, "
            f"{human_bytes(sum(p.skipped_bytes for p in ranked))} in {count_of(len(ranked), 'file')}, not read"
        )
    if stage != 3 and model.module_tensors:
        lines.append(
            f"16-bit module weights in {model.file}: {count_of(model.module_tensors, 'tensor')}, "
            f"{human_bytes(model.module_bytes)} (the fp32 master weights are written instead)"
        )
    return lines


__all__ = ["check_ranks", "zero_layout"]
