"""A DeepSpeed ZeRO-3 sample: a llama saved as ``engine.save_checkpoint`` saves it at stage 3 with bf16
mixed precision, written without torch or DeepSpeed, at any size. On disk::

    RUN/latest                                                   the tag ("global_step2", no newline)
    RUN/global_step2/zero_pp_rank_R_mp_rank_00_model_states.pt   per rank: parameter order and shapes,
                                                                 tied names, empty module placeholders
    RUN/global_step2/bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                                 per rank: Adam's step and moments, then
                                                                 the rank's fp32 flat partition

Every ``.pt`` is a ``torch.save`` zip (members stored, each storage 64-byte aligned as torch aligns
it) whose ``data.pkl`` names the classes DeepSpeed's pickles name (``LossScaler``, ``ZeroStageEnum``,
a flat tensor rebuilt through ``_rebuild_from_type_v2`` with its ``ds_id``). Rank R's flat partition
holds, for each parameter in ``param_shapes`` order, elements ``[R·p, (R+1)·p)`` of the flattened
parameter (``p = ceil(numel / world)``), the last ranks' padding filled with garbage (NaN and huge
values, as the uninitialised memory DeepSpeed saves). Facts: tests/fixtures/deepspeed/FACTS.md §1-8.

The weights are the fp32 masters :func:`zero_expected_hf` gives (deterministic in the seed and the
name: exactly what a correct conversion writes); :func:`write_zero_plain` writes the same tensors as a
plain DCP checkpoint of the same training ranks, the baseline the benchmark compares against.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.names import shard_file_name
from ...core.safetensors_codec import build_header
from ...formats.pickle_writer import Call, Global, Obj, PersistentId, dumps
from ..megatron.sample import MegatronSampleConfig, hf_specs, megatron_hf_config, write_megatron_hf_assets
from ..sample_distcp import torch_size
from ..sample_model import SampleConfig, chunk_bounds, full_tensor

DS_VERSION = "0.19.8"
LATEST = "latest"
#: torch.save aligns every storage's bytes in the file to this (its ``.storage_alignment`` record).
ALIGNMENT = 64
_CHUNK_ELEMENTS = 4 << 20
_REBUILD = Global("torch._utils", "_rebuild_tensor_v2")
_HOOKS = Call(Global("collections", "OrderedDict"))


@dataclass(frozen=True)
class ZeroSampleConfig:
    """A llama (GQA, SwiGLU, RMSNorm, no biases) trained with ZeRO-3 over ``world`` data-parallel ranks."""

    layers: int = 2
    hidden: int = 64
    ffn: int = 172
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 1001
    world: int = 3
    tied: bool = False
    #: Save Adam's ``exp_avg`` and ``exp_avg_sq`` beside the masters, as DeepSpeed does (2× more bytes on disk).
    moments: bool = True
    step: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        fields = ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "world", "step")
        problems = [f"{name} = {getattr(self, name)} must be positive" for name in fields if getattr(self, name) < 1]
        if not problems and self.heads % self.kv_heads:
            problems.append("heads must be a multiple of kv_heads")
        if problems:
            raise ValueError(f"ZeroSampleConfig: {'; '.join(problems)}")

    @property
    def tag(self) -> str:
        return f"global_step{self.step}"

    @property
    def model(self) -> MegatronSampleConfig:
        """The same llama as the Megatron sample describes it (its names, shapes and HF config)."""
        return MegatronSampleConfig(
            layers=self.layers, hidden=self.hidden, ffn=self.ffn, heads=self.heads, query_groups=self.kv_heads,
            head_dim=self.head_dim, vocab=self.vocab, tp=1, pp=1, tied=self.tied, seed=self.seed,
        )  # fmt: skip

    @classmethod
    def sized(
        cls, target_bytes: int, layers: int = 8, vocab: int = 32000, head_dim: int = 64, world: int = 4, **kwargs: Any
    ) -> ZeroSampleConfig:
        """fp32 weights of at least ``target_bytes``: ``hidden`` grown by 4 heads at a time (a quarter of
        them key/value heads), ``ffn`` about 8/3 of it; over 4 training ranks unless told otherwise."""

        def config(hidden: int) -> ZeroSampleConfig:
            heads = hidden // head_dim
            fields = {"layers": layers, "vocab": vocab, "head_dim": head_dim, "hidden": hidden, "heads": heads,
                      "kv_heads": heads // 4, "ffn": -(-hidden * 8 // 3 // 64) * 64, "world": world}  # fmt: skip
            return cls(**{**fields, **kwargs})

        hidden = 4 * head_dim
        while weight_bytes(config(hidden)) < target_bytes and hidden < 1 << 16:
            hidden += 4 * head_dim
        return config(hidden)


def zero_param_specs(c: ZeroSampleConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the trainable parameters in ``model.parameters()`` order (``param_shapes``
    order): per layer attention, MLP, then the two norms; a tied ``lm_head`` left out."""

    def order(spec: tuple[str, tuple[int, ...]]) -> int:
        return 1 if spec[0].endswith("layernorm.weight") else 0

    specs = hf_specs(c.model)
    ordered: list[tuple[str, tuple[int, ...]]] = [specs[0]]
    for layer in range(c.layers):
        prefix = f"model.layers.{layer}."
        ordered += sorted((s for s in specs if s[0].startswith(prefix)), key=order)  # stable: q, k, v, o, gate, up, down
    return ordered + [s for s in specs[1:] if not s[0].startswith("model.layers.")]


def weight_bytes(c: ZeroSampleConfig) -> int:
    """Bytes of the fp32 weights (what a consolidation writes at fp32)."""
    return sum(math.prod(shape) * 4 for _, shape in zero_param_specs(c))


def zero_expected_hf(c: ZeroSampleConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, fp32 value) of every tensor a correct consolidation writes, in parameter order, one at a time."""
    values = SampleConfig(seed=c.seed)
    for name, shape in zero_param_specs(c):
        yield name, full_tensor(values, name, "F32", shape)


def zero_hf_config(c: ZeroSampleConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of the model the checkpoint holds."""
    return megatron_hf_config(c.model)


def _part(numel: int, world: int) -> int:
    return -(-numel // world)


def _padding(c: ZeroSampleConfig, name: str, count: int) -> np.ndarray:
    """What the last ranks hold past a parameter's end: not zeros, never plausible (NaN first)."""
    garbage = full_tensor(SampleConfig(seed=c.seed), f"{name}/padding", "F32", (count,)) * np.float32(1e9)
    garbage[:1] = np.nan
    return garbage


# ---------------------------------------------------------------- torch.save archives, streamed


def _tensor(storage: str, key: str, numel: int, shape: tuple[int, ...], requires_grad: bool = False) -> Call:
    """``_rebuild_tensor_v2`` of a row-major ``shape`` at the start of legacy storage ``key``."""
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    pid = PersistentId(("storage", Global("torch", storage), key, "cpu", numel))
    return Call(_REBUILD, (pid, 0, shape, stride, requires_grad, _HOOKS))


def _raw(array: np.ndarray) -> memoryview:
    """An array's bytes without a copy where it is contiguous (a zip member counts ``len()`` of what it gets)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


class _TorchSave:
    """One ``torch.save`` zip written member by member: stored, each member's bytes aligned to
    :data:`ALIGNMENT` by the local header's extra field (as torch pads it), storages streamed."""

    def __init__(self, path: str) -> None:
        self.root = os.path.basename(path).removesuffix(".pt")
        self.zip = zipfile.ZipFile(path, "x", zipfile.ZIP_STORED)

    def info(self, name: str, size: int) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(f"{self.root}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # decided as zipfile decides it: its extra is 20 bytes
        fixed = 30 + len(info.filename.encode()) + (20 if zip64 else 0) + 4
        pad = -(self.zip.start_dir + fixed) % ALIGNMENT
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # an "FB" field, as torch's
        return info

    def record(self, name: str, data: bytes) -> None:
        self.zip.writestr(self.info(name, len(data)), data)

    def storage(self, key: str, nbytes: int, chunks: Iterable[np.ndarray]) -> None:
        """Storage ``key`` of ``nbytes``, its bytes given as arrays in order."""
        written = 0
        with self.zip.open(self.info(f"data/{key}", nbytes), "w") as member:
            for chunk in chunks:
                member.write(_raw(chunk))
                written += chunk.nbytes
        if written != nbytes:
            raise ValueError(f"{self.root}: storage {key} got {written} bytes, {nbytes} announced")

    def header(self, value: object) -> None:
        """``data.pkl`` and the records torch writes before the storages."""
        self.record("data.pkl", dumps(value))
        self.record(".format_version", b"1")
        self.record(".storage_alignment", str(ALIGNMENT).encode())
        self.record("byteorder", b"little")

    def close(self) -> None:
        self.record("version", b"3\n")
        self.record(".data/serialization_id", f"{zlib.crc32(self.root.encode()):040d}".encode())
        self.zip.close()


def _ds_config(c: ZeroSampleConfig) -> dict[str, object]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
    }


def _model_states(c: ZeroSampleConfig, path: str) -> None:
    """One rank's model states: the module's empty bf16 placeholders (a tied ``lm_head`` on the
    embeddings' storage), ``param_shapes``, ``shared_params`` and the run's numbers."""
    specs = zero_param_specs(c)
    module: dict[str, object] = {name: _tensor("BFloat16Storage", str(i), 0, (0,)) for i, (name, _) in enumerate(specs)}
    if c.tied:
        module["lm_head.weight"] = _tensor("BFloat16Storage", "0", 0, (0,))
    shared = {"lm_head.weight": "model.embed_tokens.weight"} if c.tied else {}
    state = {
        "module": module, "buffer_names": [], "optimizer": None,
        "param_shapes": [{name: torch_size(shape) for name, shape in specs}], "frozen_param_shapes": {},
        "shared_params": shared, "frozen_param_fragments": {}, "lr_scheduler": None, "data_sampler": None,
        "random_ltd": None, "skipped_steps": 0, "global_steps": c.step, "global_samples": c.step * c.world,
        "dp_world_size": c.world, "mp_world_size": 1, "ds_config": _ds_config(c), "ds_version": DS_VERSION,
    }  # fmt: skip
    archive = _TorchSave(path)
    try:
        archive.header(state)
        for i in range(len(specs)):
            archive.storage(str(i), 0, [])
    finally:
        archive.close()


def _optim_value(c: ZeroSampleConfig, numel: int, count: int) -> dict[str, object]:
    """One rank's optimizer states: Adam's state (step ``0``, moments ``1``, ``2``), the flat fp32 partition (``3``)."""
    keys = {"step": "0", "exp_avg": "1", "exp_avg_sq": "2", "flat": "3"} if c.moments else {"flat": "0"}
    adam: dict[str, object] = {"state": {}, "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08,
                                                              "weight_decay": 0.01, "params": [0]}]}  # fmt: skip
    if c.moments:
        step = _tensor("FloatStorage", keys["step"], 1, ())
        moments = {name: _tensor("FloatStorage", keys[name], numel, (numel,)) for name in ("exp_avg", "exp_avg_sq")}
        adam["state"] = {0: {"step": step, **moments}}
    flat = _tensor("FloatStorage", keys["flat"], numel, (numel,), requires_grad=True)
    rebuilt = Call(Global("torch._tensor", "_rebuild_from_type_v2"), (_REBUILD, Global("torch", "Tensor"), flat.args,
                                                                       {"ds_id": f"0_{count - 1}"}))  # fmt: skip
    return {
        "optimizer_state_dict": {
            "zero_stage": Call(Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (3,)),
            "loss_scaler": Obj(Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), {"cur_scale": 1.0, "dynamic": False}),
            "dynamic_loss_scale": False,
            "overflow": False,
            "partition_count": c.world,
            "optimizer_state_dict": adam,
            "fp32_flat_groups": [rebuilt],
        },
        "ds_config": _ds_config(c),
        "ds_version": DS_VERSION,
    }


def _filled(value: float, count: int) -> Iterator[np.ndarray]:
    for start in range(0, count, _CHUNK_ELEMENTS):
        yield np.full(min(_CHUNK_ELEMENTS, count - start), value, dtype=np.float32)


def _optim_states(c: ZeroSampleConfig, step_dir: str) -> None:
    """Every rank's optimizer states, the flat partitions written together: each parameter made once."""
    specs = zero_param_specs(c)
    numel = sum(_part(math.prod(shape), c.world) for _, shape in specs)
    names = [os.path.join(step_dir, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(c.world)]
    archives: list[_TorchSave] = []
    try:
        for path in names:
            archives.append(_TorchSave(path))
            archives[-1].header(_optim_value(c, numel, len(specs)))
            if c.moments:
                archives[-1].storage("0", 4, [np.array([float(c.step)], dtype=np.float32)])
                archives[-1].storage("1", numel * 4, _filled(1e-4, numel))
                archives[-1].storage("2", numel * 4, _filled(1e-8, numel))
        members = [a.zip.open(a.info(f"data/{3 if c.moments else 0}", numel * 4), "w") for a in archives]
        try:
            for name, value in zero_expected_hf(c):
                flat, part = value.ravel(), _part(value.size, c.world)
                padding = _padding(c, name, part * c.world - value.size)
                for rank, member in enumerate(members):
                    piece = flat[rank * part : (rank + 1) * part]
                    member.write(_raw(piece))
                    if piece.size < part:
                        member.write(_raw(padding[max(0, rank * part - value.size) :][: part - piece.size]))
        finally:
            for member in members:
                member.close()
    finally:
        for archive in archives:
            archive.close()


def write_zero_sample(
    run_dir: str | os.PathLike[str],
    config: ZeroSampleConfig | None = None,
    assets_dir: str | os.PathLike[str] | None = None,
) -> str:
    """Write a DeepSpeed run directory holding one ZeRO-3 checkpoint (``latest`` and its tag's
    directory); returns the tag's directory. ``assets_dir``: also the Hugging Face config there.
    Files are created exclusively: an existing one is an error, never replaced."""
    c = config or ZeroSampleConfig()
    run_dir = os.fspath(run_dir)
    step_dir = os.path.join(run_dir, c.tag)
    os.makedirs(step_dir, exist_ok=True)
    for rank in range(c.world):
        _model_states(c, os.path.join(step_dir, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    _optim_states(c, step_dir)
    with open(os.path.join(run_dir, LATEST), "x", encoding="ascii") as handle:
        handle.write(c.tag)
    if assets_dir is not None:
        write_megatron_hf_assets(assets_dir, c.model)
    return step_dir


def write_zero_plain(directory: str | os.PathLike[str], config: ZeroSampleConfig | None = None) -> list[str]:
    """The same fp32 tensors as a plain DCP checkpoint in its Hugging Face layout: per training rank a
    ``shard-*.safetensors`` of its rows of every parameter (``torch.chunk`` over ``world``, as FSDP
    cuts them), tensors in safetensors' order. Returns the file names written."""
    c = config or ZeroSampleConfig()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    specs = sorted(zero_param_specs(c))  # all F32: safetensors' order is by name
    pieces: list[list[tuple[str, int, int]]] = [[] for _ in range(c.world)]
    for name, shape in specs:
        for rank in range(c.world):
            start, rows = chunk_bounds(shape[0], c.world, rank)
            if rows:
                pieces[rank].append((name, start, rows))
    shapes = dict(specs)
    files = [shard_file_name(rank + 1, 1, 1) for rank in range(c.world)]
    handles = []
    try:
        for rank, file in enumerate(files):
            handles.append(open(os.path.join(directory, file), "xb"))
            info = {name: {"saved_offsets": [start] + [0] * (len(shapes[name]) - 1)} for name, start, _ in pieces[rank]}
            metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
            tensors = [(name, "F32", (rows, *shapes[name][1:])) for name, start, rows in pieces[rank]]
            handles[-1].write(build_header(tensors, metadata)[0])
        values = SampleConfig(seed=c.seed)
        for name, shape in specs:
            full = full_tensor(values, name, "F32", shape)
            for rank in range(c.world):
                start, rows = chunk_bounds(shape[0], c.world, rank)
                if rows:
                    handles[rank].write(_raw(full[start : start + rows]))
    finally:
        for handle in handles:
            handle.close()
    return files


__all__ = [
    "ZeroSampleConfig",
    "weight_bytes",
    "write_zero_plain",
    "write_zero_sample",
    "zero_expected_hf",
    "zero_hf_config",
    "zero_param_specs",
]
