"""Megatron checkpoint layouts no fixture holds, written with torch's own DCP from a fixture's tensors.

    python megatron_variants.py ITERATION_DIR OUT KIND

``KIND``: ``optimizer`` writes a Megatron-LM run directory ``OUT`` (tracker file naming iteration 20,
``iter_0000020/`` with the model's tensors plus Adam's ``optimizer.state.exp_avg.<key>`` and
``exp_avg_sq`` beside them, FACTS.md §10); ``nemo`` writes a NeMo 2 step directory ``OUT`` (``weights/``
with every key prefixed ``module.`` and the optimizer's keys under ``optimizer.``, an empty ``context/``,
FACTS.md §12). The non-tensor ``_extra_state`` items are saved again as DCP bytes items; ``common.pt``
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
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    for name in ("common.pt", "metadata.json"):
        shutil.copy(source / name, target / name)


if __name__ == "__main__":
    main()
