"""What a DeepSpeed ZeRO checkpoint's archives say, read without torch or DeepSpeed (no MPI here).

Each file is a ``torch.save`` archive read by :func:`~mpicons.formats.torch_archive.read_archive` with
the few DeepSpeed classes its pickle names allowed as inert records. A reader keeps only what the
layout needs, small enough to send to every rank: the model states' parameter order and shapes,
tied names, frozen parameters and buffers; the optimizer states' flat fp32 master buffers (where
they lie in the file) and a count of what else they hold (Adam moments, step counters), never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...core.errors import InputError
from ...core.safetensors_codec import DTYPE_BY_NAME, MAX_DIM
from ...formats.byte_sources import ByteSource
from ...formats.torch_archive import (
    REBUILD_FROM_TYPE,
    REBUILD_PARAMETER,
    ArchiveTensor,
    TorchArchive,
    check_root,
    is_row_major,
    read_archive,
)
from ...formats.unpickling import AllowList, EnumMember, shown

#: The globals DeepSpeed's checkpoint pickles name beside torch's tensor machinery (checked on
#: DeepSpeed 0.19 with torch 2.13; docs/torch-archive-format.md), each rebuilt as an inert record.
ALLOWED = AllowList.of(
    "DeepSpeed",
    records=[
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "torch.Tensor",
        REBUILD_FROM_TYPE,
        REBUILD_PARAMETER,
    ],
    enums=["deepspeed.runtime.zero.config.ZeroStageEnum"],
)
KIND = "DeepSpeed ZeRO checkpoints"


@dataclass(frozen=True)
class Stored:
    """A tensor stored whole and row-major: ``numel`` elements of ``dtype`` from byte ``begin`` of ``file``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ZeroModel:
    """What a model-states file says (stage 3: one per rank, alike but for ``fragments``)."""

    file: str
    rank: int
    #: Per parameter group, the trainable parameters' names and shapes in flat-buffer order.
    param_shapes: list[list[tuple[str, tuple[int, ...]]]]
    #: Tied names: a parameter saved only under another name → that name.
    shared: dict[str, str]
    #: Frozen (not trained) parameters: names and shapes, and their saved values (stage 3: this rank's part).
    frozen: list[tuple[str, tuple[int, ...]]]
    fragments: dict[str, Stored]
    buffers: list[Stored]
    world_size: int
    model_parallel: int
    stage: int | None  # from the saved ds_config, when it says
    #: The 16-bit module weights the file also holds (stages 1-2; stage 3 saves empty placeholders).
    module_tensors: int
    module_bytes: int


@dataclass(frozen=True)
class ZeroPartition:
    """What one rank's optimizer-states file says: its flat fp32 master buffers, and what else it holds."""

    file: str
    rank: int
    stage: int
    partition_count: int
    #: Stages 1-2: one buffer per parameter group; stage 3: the rank's sub-groups, to be concatenated.
    groups: list[Stored]
    #: Stages 1-2: per-parameter alignment padding was on (``param_alignment_paddings`` not all 0).
    aligned_params: bool
    skipped_tensors: int
    skipped_bytes: int


def _bad(path: str, what: str, found: object) -> InputError:
    return InputError(f"{path}: not a DeepSpeed ZeRO checkpoint file as mpicons knows it: {what} is {shown(found)}")


def _mapping(value: object, path: str, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _bad(path, what, value)
    return value


def _list(value: object, path: str, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(path, what, value)
    return value


def _count(value: object, path: str, what: str) -> int:
    if type(value) is not int or not 0 < value < 1 << 31:
        raise _bad(path, what, value)
    return value


def _name(name: object, path: str) -> str:
    if type(name) is not str or not name:
        raise _bad(path, "a parameter name", name)
    return name


def _shape(value: object, path: str, name: str) -> tuple[int, ...]:
    if type(value) is not tuple or not all(type(d) is int and 0 <= d < MAX_DIM for d in value):
        raise _bad(path, f"the shape of {name!r}", value)
    return value


def _bytes(tensors: list[ArchiveTensor]) -> int:
    return sum(math.prod(t.size) * DTYPE_BY_NAME[t.dtype].bits // 8 for t in tensors)


def _stored(archive: TorchArchive, file: str, items: list[tuple[str, object]]) -> list[Stored]:
    """Tensors saved whole (each row-major), as where their bytes are."""
    tensors = []
    for name, tensor in items:
        if not isinstance(tensor, ArchiveTensor):
            raise _bad(archive.name, f"the tensor {name!r}", tensor)
        if not is_row_major(tensor):
            raise InputError(f"{archive.name}: tensor {name!r} was saved with strides {list(tensor.stride)}: not supported")
        tensors.append(tensor)
    begins = archive.locate(tensors, [f"tensor {name!r}" for name, _ in items])
    return [Stored(name, t.dtype, t.size, file, int(b)) for (name, _), t, b in zip(items, tensors, begins)]


def read_model_states(source: ByteSource, file: str, rank: int = 0) -> ZeroModel:
    """The model-states file read through ``source`` (``file``: its name in the checkpoint directory)."""
    archive = read_archive(source, ALLOWED, KIND)
    check_root(archive, file)
    path = archive.name
    top = _mapping(archive.value, path, "its content")
    param_shapes = [
        [(_name(n, path), _shape(s, path, n)) for n, s in _mapping(group, path, "a group of 'param_shapes'").items()]
        for group in _list(top.get("param_shapes"), path, "'param_shapes'")
    ]
    shared = _mapping(top.get("shared_params") or {}, path, "'shared_params'")
    if not all(type(k) is str and type(v) is str for k, v in shared.items()):
        raise _bad(path, "'shared_params'", shared)
    frozen_shapes = _mapping(top.get("frozen_param_shapes") or {}, path, "'frozen_param_shapes'")
    fragments = _mapping(top.get("frozen_param_fragments") or {}, path, "'frozen_param_fragments'")
    module = _mapping(top.get("module"), path, "'module'")
    buffer_names = [n for n in _list(top.get("buffer_names") or [], path, "'buffer_names'") if n in module]
    weights = [t for n, t in module.items() if isinstance(t, ArchiveTensor) and n not in buffer_names]
    config = top.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    fragment_items = [(_name(n, path), t) for n, t in fragments.items()]
    located = _stored(archive, file, fragment_items + [(n, module[n]) for n in buffer_names])
    return ZeroModel(
        file=file,
        rank=rank,
        param_shapes=param_shapes,
        shared=dict(shared),
        frozen=[(_name(n, path), _shape(s, path, n)) for n, s in frozen_shapes.items()],
        fragments={s.name: s for s in located[: len(fragment_items)]},
        buffers=located[len(fragment_items) :],
        world_size=_count(top.get("dp_world_size"), path, "'dp_world_size'"),
        model_parallel=_count(top.get("mp_world_size", 1), path, "'mp_world_size'"),
        stage=stage if type(stage) is int else None,
        module_tensors=sum(1 for t in weights if math.prod(t.size)),
        module_bytes=_bytes(weights),
    )


def _stage(record: object, path: str) -> int:
    """``ZeroStageEnum(n)``: n."""
    if not isinstance(record, EnumMember) or record.kind != "deepspeed.runtime.zero.config.ZeroStageEnum":
        raise _bad(path, "'zero_stage'", record)
    stage = record.value
    if type(stage) is not int or stage not in (1, 2, 3):
        raise _bad(path, "'zero_stage'", stage)
    return stage


def read_optim_states(source: ByteSource, file: str, rank: int) -> ZeroPartition:
    """Rank ``rank``'s optimizer-states file read through ``source`` (``file``: its name in the directory)."""
    archive = read_archive(source, ALLOWED, KIND)
    check_root(archive, file)
    path = archive.name
    state = _mapping(_mapping(archive.value, path, "its content").get("optimizer_state_dict"), path, "'optimizer_state_dict'")
    stage = _stage(state.get("zero_stage"), path)
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups = _list(state.get(key), path, repr(key))
    for g, tensor in enumerate(groups):
        if not isinstance(tensor, ArchiveTensor) or len(tensor.size) != 1:
            raise _bad(path, f"{key}[{g}]", tensor)
    counts = state.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or any(c != counts[0] for c in counts):
        raise _bad(path, "'partition_count'", counts)
    paddings = state.get("param_alignment_paddings") or []
    masters = _stored(archive, file, [(f"{key}[{g}]", t) for g, t in enumerate(groups)])
    others = [t for t in archive.tensors() if not any(t is m for m in groups)]
    return ZeroPartition(
        file=file,
        rank=rank,
        stage=stage,
        partition_count=_count(counts[0], path, "'partition_count'"),
        groups=masters,
        aligned_params=any(p for group in paddings if isinstance(group, list) for p in group),
        skipped_tensors=len(others),
        skipped_bytes=_bytes(others),
    )


__all__ = ["ALLOWED", "KIND", "Stored", "ZeroModel", "ZeroPartition", "read_model_states", "read_optim_states"]
