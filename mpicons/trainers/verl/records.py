"""What one rank's verl model file says, read without torch (no MPI here).

``model_world_size_W_rank_R.pt`` is a ``torch.save`` of the actor's sharded state dict: name →
DTensor, pickled through ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, ...)`` with the
state ``{'_local_tensor': <this rank's rows>, '_spec': DTensorSpec(mesh, placements, tensor_meta)}``.
The DTensor, spec, mesh and placement classes are allowed as inert records (their fields beyond the
placements and the global shape are torch internals that change between releases, and are not used).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import InputError
from ...formats.byte_sources import ByteSource
from ...formats.torch_archive import (
    REBUILD_FROM_TYPE,
    REBUILD_WRAPPER,
    ArchiveTensor,
    SubclassTensor,
    check_root,
    is_row_major,
    read_archive,
)
from ...formats.unpickling import AllowList, Record, shown

_TENSOR = "torch.distributed.tensor"
DTENSOR = f"{_TENSOR}.DTensor"
SHARD = f"{_TENSOR}.placement_types.Shard"
#: The globals verl's model files name beside torch's tensor machinery (verl 0.9 with torch 2.13).
ALLOWED = AllowList.of(
    "verl (torch's DTensor)",
    records=[
        REBUILD_FROM_TYPE,
        REBUILD_WRAPPER,
        "torch.device",
        "torch.serialization._get_layout",
        DTENSOR,
        f"{_TENSOR}._dtensor_spec.DTensorSpec",
        f"{_TENSOR}._dtensor_spec.TensorMeta",
        f"{_TENSOR}._dtensor_spec.ShardOrderEntry",
        SHARD,
        "torch.distributed.device_mesh.DeviceMesh",
        "torch.distributed._mesh_layout._MeshLayout",
        "torch.distributed._mesh_layout._FlatLayout",
    ],
)
KIND = "verl FSDP actor checkpoints"


@dataclass(frozen=True)
class VerlEntry:
    """One tensor of a rank's file: its full dtype and shape, the rows this rank holds (all of them
    when it is not sharded), where they begin, and its storage (two names on one storage: tied)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    rows: int
    sharded: bool
    begin: int
    storage: tuple[str, int, tuple[int, ...]]


@dataclass(frozen=True)
class VerlRank:
    """What rank ``rank``'s model file holds: its tensors in saved order, and the entries that are not tensors."""

    file: str
    rank: int
    entries: list[VerlEntry]
    skipped: list[str]


def _local(path: str, name: str, value: SubclassTensor) -> ArchiveTensor:
    """A DTensor's local rows, after checking it is sharded on dim 0 of a 1-D mesh (FSDP's layout)."""
    where = f"{path}: tensor {name!r}"
    if value.kind != DTENSOR:
        raise InputError(f"{where}: unsupported: a {value.kind}")
    local, spec = value.field("_local_tensor"), value.field("_spec")
    placements = spec.field("placements") if isinstance(spec, Record) else None
    if not isinstance(local, ArchiveTensor) or not isinstance(placements, tuple):
        raise InputError(f"{where}: a DTensor without its local tensor or placements ({shown(value.state)})")
    if len(placements) != 1 or not isinstance(placements[0], Record) or placements[0].kind != SHARD:
        raise InputError(
            f"{where}: unsupported: placements {shown(placements)} (FSDP's Shard(0) on a 1-D mesh is read; "
            "HSDP and tensor-parallel meshes are not)"
        )
    if placements[0].field("dim") != 0:
        raise InputError(f"{where}: unsupported: sharded on dim {shown(placements[0].field('dim'))} (FSDP shards dim 0)")
    if local.dtype != value.dtype or tuple(local.size[1:]) != tuple(value.size[1:]) or not value.size:
        raise InputError(
            f"{where}: its local rows are {local.dtype} {list(local.size)}, the DTensor {value.dtype} {list(value.size)}"
        )
    return local


def read_rank(source: ByteSource, file: str, rank: int) -> VerlRank:
    """Rank ``rank``'s model file read through ``source`` (``file``: its name in the actor directory)."""
    archive = read_archive(source, ALLOWED, KIND)
    check_root(archive, file)
    path = archive.name
    if not isinstance(archive.value, dict):
        raise InputError(f"{path}: not a verl model file: it holds a {type(archive.value).__name__}, not a state dict")
    found: list[tuple[str, ArchiveTensor, SubclassTensor | None]] = []
    skipped = []
    for name, value in archive.value.items():
        if type(name) is not str or not name:
            raise InputError(f"{path}: not a verl model file: a key {shown(name)}")
        if isinstance(value, SubclassTensor):
            found.append((name, _local(path, name, value), value))
        elif isinstance(value, ArchiveTensor):
            found.append((name, value, None))
        else:
            skipped.append(name)
    for name, local, _ in found:
        if not is_row_major(local):
            raise InputError(f"{path}: tensor {name!r} was saved with strides {list(local.stride)}: not supported")
    begins = archive.locate([local for _, local, _ in found], [f"tensor {name!r}" for name, _, _ in found])
    entries = [
        VerlEntry(
            name,
            local.dtype,
            tuple(whole.size if whole is not None else local.size),
            local.size[0] if local.size else 1,
            whole is not None,
            int(begin),
            (local.storage.key, local.storage_offset, tuple(local.size)),
        )
        for (name, local, whole), begin in zip(found, begins)
    ]
    return VerlRank(file, rank, entries, skipped)


__all__ = ["ALLOWED", "DTENSOR", "KIND", "SHARD", "VerlEntry", "VerlRank", "read_rank"]
