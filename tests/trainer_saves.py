"""Small DeepSpeed ZeRO and verl checkpoints written here, for the cases the library-written fixtures
do not cover (3 ranks with padding, tied embeddings, frozen parameters, buffers, sub-groups).

They follow the partition rules of tests/fixtures/deepspeed/FACTS.md and tests/fixtures/verl/FACTS.md
going forward (full tensors → each rank's slices, padding filled with garbage); the readers under
test go backward, so a test compares what they assemble with the tensors given here. The archives
are zips of stored members like ``torch.save``'s, their ``data.pkl`` written opcode by opcode with
the classes DeepSpeed and torch name (no torch, no DeepSpeed needed).
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path

import numpy as np

from mpicons.formats.pickle_writer import Call, Global, Obj, PersistentId, dumps

_STORAGE = {np.dtype("float32"): "FloatStorage", np.dtype("float16"): "HalfStorage", np.dtype("int64"): "LongStorage"}
_REBUILD = Global("torch._utils", "_rebuild_tensor_v2")
_HOOKS = Call(Global("collections", "OrderedDict"), ())
GARBAGE = np.float32(np.nan)


class Archive:
    """One archive being written: its storages by key, and tensor markers that name them."""

    def __init__(self) -> None:
        self.storages: dict[str, bytes] = {}

    def storage(self, data: np.ndarray) -> tuple[str, np.dtype, int]:
        key = str(len(self.storages))
        self.storages[key] = np.ascontiguousarray(data).tobytes()
        return key, data.dtype, data.size

    def tensor(
        self, data: np.ndarray, shape: tuple[int, ...] | None = None, offset: int = 0, storage: tuple | None = None
    ) -> Call:
        """``data`` saved as a tensor (or a view of ``shape`` at ``offset`` in an existing ``storage``)."""
        key, dtype, numel = storage if storage is not None else self.storage(data.ravel())
        shape = tuple(data.shape) if shape is None else shape
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        pid = PersistentId(("storage", Global("torch", _STORAGE[np.dtype(dtype)]), key, "cpu", numel))
        return Call(_REBUILD, (pid, offset, shape, stride, False, _HOOKS))

    def write(self, path: Path, value: object) -> None:
        root = path.name.removesuffix(".pt")
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr(f"{root}/data.pkl", dumps(value))
            archive.writestr(f"{root}/.format_version", "1")
            archive.writestr(f"{root}/byteorder", "little")
            for key, data in self.storages.items():
                archive.writestr(f"{root}/data/{key}", data)
            archive.writestr(f"{root}/version", "3\n")
        path.write_bytes(buffer.getvalue())


def _size(shape: tuple[int, ...]) -> Call:
    return Call(Global("torch", "Size"), (tuple(shape),))


def _stage(stage: int) -> Call:
    return Call(Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (stage,))


def _moments(archive: Archive, numel: int) -> dict[str, object]:
    """AdamW state of one group: what the layout must skip and count."""
    step = archive.tensor(np.array([2.0], dtype=np.float32), shape=())
    moments = {name: archive.tensor(np.full(numel, 0.5, dtype=np.float32)) for name in ("exp_avg", "exp_avg_sq")}
    return {"state": {0: {"step": step, **moments}}, "param_groups": [{"weight_decay": 0, "params": [0]}]}


def write_zero(
    directory: Path,
    params: dict[str, np.ndarray],
    world: int,
    stage: int,
    *,
    tied: dict[str, str] | None = None,
    frozen: dict[str, np.ndarray] | None = None,
    buffers: dict[str, np.ndarray] | None = None,
    groups: list[list[str]] | None = None,
    sub_groups: int = 1,
    shift: int = 0,
) -> None:
    """A ZeRO checkpoint of ``params`` (fp32 masters) over ``world`` ranks into ``directory`` (a tag folder);
    ``shift`` (stages 1-2): rank 0's partition that many elements short and rank 1's as many longer, the
    total unchanged (what DeepSpeed never writes)."""
    directory.mkdir(parents=True, exist_ok=True)
    groups = groups or [list(params)]
    tied, frozen, buffers = tied or {}, frozen or {}, buffers or {}
    model = {
        "param_shapes": [{name: _size(params[name].shape) for name in group} for group in groups],
        "shared_params": dict(tied),
        "frozen_param_shapes": {name: _size(value.shape) for name, value in frozen.items()},
        "buffer_names": list(buffers),
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}},
        "ds_version": "0.19.8",
    }
    optim = {
        "loss_scaler": Obj(Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), {"cur_scale": 1, "dynamic": False}),
        "zero_stage": _stage(stage),
    }
    if stage == 3:
        _write_zero3(directory, params, world, groups, frozen, buffers, model, optim, sub_groups)
    else:
        _write_zero2(directory, params, world, groups, frozen, buffers, model, optim, shift)
    (directory.parent / "latest").write_text(directory.name)


def _module(archive: Archive, params: dict[str, np.ndarray], buffers: dict[str, np.ndarray], whole: bool) -> dict[str, object]:
    """The module's state dict: 16-bit weights (stages 1-2) or empty placeholders (stage 3), and buffers."""
    module: dict[str, object] = {
        name: archive.tensor(value.astype(np.float16)) if whole else archive.tensor(np.zeros(0, np.float16))
        for name, value in params.items()
    }
    module.update({name: archive.tensor(value) for name, value in buffers.items()})
    return module


def _parameter(tensor: Call) -> Call:
    return Call(Global("torch._utils", "_rebuild_parameter"), (tensor, False, _HOOKS))


def _write_zero2(directory, params, world, groups, frozen, buffers, model, optim, shift=0) -> None:
    archive = Archive()
    model_value = {
        "module": _module(archive, params, buffers, whole=True),
        **model,
        # Stages 1-2 save the frozen nn.Parameter itself (pickled through _rebuild_parameter).
        "frozen_param_fragments": {name: _parameter(archive.tensor(value)) for name, value in frozen.items()},
    }
    archive.write(directory / "mp_rank_00_model_states.pt", model_value)
    flats = [np.concatenate([params[name].ravel() for name in group]) for group in groups]
    for rank in range(world):
        archive = Archive()
        slices, paddings = [], []
        for flat in flats:
            aligned = -(-flat.size // (2 * world)) * 2 * world
            part = aligned // world
            cuts = [r * part - (shift if r == 1 else 0) for r in range(world + 1)]
            piece = flat[cuts[rank] : min(cuts[rank + 1], flat.size)]  # saved without its padding
            slices.append(archive.tensor(piece))
            paddings.append(part - piece.size)
        value = {
            "optimizer_state_dict": {
                **optim,
                "base_optimizer_state": _moments(archive, flats[0].size // world),
                "single_partition_of_fp32_groups": slices,
                "group_paddings": paddings,
                "param_alignment_paddings": [[0] * len(group) for group in groups],
                "partition_count": [world] * len(groups),
            },
            "ds_version": "0.19.8",
        }
        archive.write(directory / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", value)


def _slice(value: np.ndarray, rank: int, world: int, rng: np.random.Generator) -> np.ndarray:
    """Rank ``rank``'s ceil(n / world) elements of a flattened tensor, the padding uninitialised (random)."""
    part = -(-value.size // world)
    out = np.full(part, rng.choice([np.nan, 1e4, -3.0]), dtype=value.dtype)
    got = value.ravel()[rank * part : (rank + 1) * part]
    out[: got.size] = got
    return out


def _write_zero3(directory, params, world, groups, frozen, buffers, model, optim, sub_groups) -> None:
    rng = np.random.default_rng(3)
    names = [name for group in groups for name in group]
    for rank in range(world):
        archive = Archive()
        model_value = {
            "module": _module(archive, params, buffers, whole=False),
            **model,
            "frozen_param_fragments": {name: archive.tensor(_slice(v, rank, world, rng)) for name, v in frozen.items()},
        }
        archive.write(directory / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", model_value)
        archive = Archive()
        flat = np.concatenate([_slice(params[name], rank, world, rng) for name in names])
        cuts = np.linspace(0, flat.size, sub_groups + 1).astype(int)  # sub-groups cut anywhere
        flat_groups = [
            Call(
                Global("torch._tensor", "_rebuild_from_type_v2"),
                (_REBUILD, Global("torch", "Tensor"), archive.tensor(flat[a:b]).args, {"ds_id": f"0_{rank}"}),
            )
            for a, b in zip(cuts, cuts[1:])
        ]
        value = {
            "optimizer_state_dict": {
                **optim,
                "partition_count": world,
                "optimizer_state_dict": _moments(archive, flat.size),
                "fp32_flat_groups": flat_groups,
            },
            "ds_version": "0.19.8",
        }
        archive.write(directory / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", value)


_TENSOR = "torch.distributed.tensor"


def _dtensor(local: Call, shape: tuple[int, ...], world: int, rank: int) -> Call:
    """A DTensor as torch 2.13 pickles it (tests/fixtures/verl/FACTS.md §4), sharded on dim 0 of a 1-D mesh."""
    dtensor = Global(_TENSOR, "DTensor")
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    mesh = Obj(
        Global("torch.distributed.device_mesh", "DeviceMesh"),
        {"_device_type": "cpu", "_mesh_dim_names": ("fsdp",), "_rank": rank, "_coordinate_on_dim": (rank,)},
    )
    spec = Obj(
        Global(f"{_TENSOR}._dtensor_spec", "DTensorSpec"),
        {
            "mesh": mesh,
            "placements": (Obj(Global(f"{_TENSOR}.placement_types", "Shard"), {"dim": 0}),),
            "tensor_meta": Obj(Global(f"{_TENSOR}._dtensor_spec", "TensorMeta"), {}),
        },
    )
    args = (
        dtensor,
        Global("torch", "float32"),
        _size(shape),
        stride,
        0,
        Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
        Call(Global("torch", "device"), ("cpu",)),
        False,
    )
    return Call(
        Global("torch._tensor", "_rebuild_from_type_v2"),
        (Global("torch._utils", "_rebuild_wrapper_subclass"), dtensor, args, (None, {"_local_tensor": local, "_spec": spec})),
    )


def write_verl(directory: Path, params: dict[str, np.ndarray], world: int, *, tied: dict[str, str] | None = None) -> None:
    """A verl actor checkpoint (FSDP2) of fp32 ``params`` over ``world`` ranks into ``directory``;
    ``tied``: alias → name, saved as a second DTensor on the same storage."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    for rank in range(world):
        archive = Archive()
        state: dict[str, object] = {}
        storages = {}
        for name, value in params.items():
            chunk = -(-value.shape[0] // world)
            rows = value[rank * chunk : (rank + 1) * chunk]
            padded = rng.standard_normal((chunk, *value.shape[1:])).astype(np.float32) * 1e9
            padded[: len(rows)] = rows  # FSDP2 pads a short shard's storage to the full chunk
            storages[name] = archive.storage(padded.ravel())
            local = archive.tensor(rows, storage=storages[name])
            state[name] = _dtensor(local, value.shape, world, rank)
        for alias, name in (tied or {}).items():
            value = params[name]
            chunk = -(-value.shape[0] // world)
            rows = value[rank * chunk : (rank + 1) * chunk]
            state[alias] = _dtensor(archive.tensor(rows, storage=storages[name]), value.shape, world, rank)
        archive.write(directory / f"model_world_size_{world}_rank_{rank}.pt", state)
    (directory / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
