"""Megatron checkpoint layouts no fixture holds, written with torch's own DCP from a fixture's tensors.

    python megatron_variants.py ITERATION_DIR OUT KIND

``KIND``: ``optimizer`` writes a Megatron-LM run directory ``OUT`` (tracker file naming iteration 20,
``iter_0000020/`` with the model's tensors plus Adam's ``optimizer.state.exp_avg.<key>`` and
``exp_avg_sq`` beside them, FACTS.md §10); ``nemo`` writes a NeMo 2 step directory ``OUT`` (``weights/``
with every key prefixed ``module.`` and the optimizer's keys under ``optimizer.``, an empty ``context/``,
FACTS.md §12); ``distributed-optimizer`` writes a run saved with ``--use-distributed-optimizer`` in
megatron-core 0.16's default ``dp_reshardable`` form (FACTS.md §16: flat fp32 ``param``, ``exp_avg`` and
``exp_avg_sq`` buffers per bucket, written in two stretches as two data-parallel ranks write them, and its
bytes items; written whole by one process); ``fp32-main`` writes a run whose optimizer kept per-parameter
fp32 main weights as Float16Optimizer and the distributed optimizer's ``fully_sharded_model_space`` form
name them (``optimizer.state.fp32_param.<key>``, FACTS.md §10), ``fully-reshardable`` as that form names
them (``optimizer.state.param.<key>``, megatron-core's ``sharded_param_state_fully_reshardable``); each
the bf16 weight plus 2**-12 of itself, so that they differ from the bf16 weights and round back to them
(a buffer, the router's ``expert_bias``, has none: no optimizer keeps it).
The non-tensor ``_extra_state`` items are saved again as DCP bytes items; ``common.pt``
and ``metadata.json`` are copied from the fixture.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys


def model_state(iteration_dir: Path) -> dict[str, object]:
    metadata = dcp.FileSystemReader(str(iteration_dir)).read_metadata()
    state = _load_state_dict_from_keys(checkpoint_id=str(iteration_dir))
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) and not isinstance(state[key], io.BytesIO):
            buffer = io.BytesIO()
            torch.save(state[key], buffer)
            buffer.seek(0)
            state[key] = buffer
    return state


def with_optimizer(state: dict[str, object], prefix: str) -> dict[str, object]:
    out = {f"{prefix}{key}": value for key, value in state.items()}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[f"optimizer.state.exp_avg.{prefix}{key}"] = torch.full(value.shape, 0.5, dtype=torch.float32)
            out[f"optimizer.state.exp_avg_sq.{prefix}{key}"] = torch.full(value.shape, 0.25, dtype=torch.float32)
    return out


BUCKET = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"


def with_distributed_optimizer(state: dict[str, object]) -> dict[str, object]:
    """The model's tensors, and one bucket of the distributed optimizer's flat state (its parameters in
    reverse order, each at a multiple of 64 elements)."""
    tensors = [value for value in state.values() if isinstance(value, torch.Tensor)][::-1]
    flat = torch.cat([t.float().flatten() for t in tensors])
    out = dict(state)
    for name, values in (("param", flat), ("exp_avg", flat * 0.5), ("exp_avg_sq", flat * flat)):
        out[f"{BUCKET}.{name}"] = values
    for item in ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded"):
        buffer = io.BytesIO()
        torch.save({"numel": [flat.numel()]}, buffer)
        buffer.seek(0)
        out[f"optimizer.distributed.dp_group_idx_0.{item}/shard_0_1"] = buffer
    return out


def with_fp32_main(state: dict[str, object], name: str) -> dict[str, object]:
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and not key.endswith("expert_bias"):
            main = value.float()
            out[f"optimizer.state.{name}.{key}"] = main + main * 2.0**-12
            out[f"optimizer.state.exp_avg.{key}"] = torch.zeros_like(main)
    return out


def main() -> None:
    source, out, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    state = model_state(source)
    if kind == "optimizer":
        target = out / "iter_0000020"
        dcp.save(with_optimizer(state, ""), checkpoint_id=str(target))
        (out / "latest_checkpointed_iteration.txt").write_text("20")
    elif kind == "nemo":
        target = out / "weights"
        dcp.save(with_optimizer(state, "module."), checkpoint_id=str(target))
        (out / "context").mkdir()
        (out / "context" / "model.yaml").write_text("# the model's NeMo config (not read by mpicons)\n")
    elif kind in ("distributed-optimizer", "fp32-main", "fully-reshardable"):
        target = out / "iter_0000030"
        if kind == "distributed-optimizer":
            made = with_distributed_optimizer(state)
        else:
            made = with_fp32_main(state, "fp32_param" if kind == "fp32-main" else "param")
        dcp.save(made, checkpoint_id=str(target))
        (out / "latest_checkpointed_iteration.txt").write_text("30")
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    for name in ("common.pt", "metadata.json"):
        shutil.copy(source / name, target / name)


if __name__ == "__main__":
    main()
