"""The files Megatron keeps beside its ``torch_dist`` shards, read only for what they tell (no MPI here).

- ``latest_checkpointed_iteration.txt`` in the run's checkpoint directory: the iteration last saved
  (``10``) or ``release``; it names the directory ``iter_0000010`` (or ``release``).
- ``metadata.json`` in the iteration directory: ``{"sharded_backend": "torch_dist", ...}``.
- ``common.pt``: a ``torch.save`` archive of what is not sharded: ``args`` (an ``argparse.Namespace``),
  ``iteration``, ``checkpoint_version``, the optimizer's hyper-parameters. Read by the restricted
  unpickler with :data:`COMMON_ALLOW`: the Namespace is a record of its fields, enums their values.

Every file is opened only as a regular file and read with a bound; none is ever executed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...core.errors import InputError
from ...formats.torch_archive import archive_value
from ...formats.unpickling import AllowList, Record, shown
from ...io.places import Place

TRACKER = "latest_checkpointed_iteration.txt"
BACKEND_FILE = "metadata.json"
COMMON_FILE = "common.pt"
ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
#: The classes Megatron-Core adds to DCP's ``.metadata``: every rank's save plan (``all_local_plans``,
#: torch's planner classes; Megatron-Core's own subclass in some versions) and their storage prefixes.
METADATA_ALLOW = AllowList.of(
    "Megatron-Core",
    records=[
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "torch.distributed.checkpoint.filesystem._StoragePrefix",
        "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
    ],
    enums=["torch.distributed.checkpoint.planner.WriteItemType"],
)
#: The classes Megatron-LM pickles into ``common.pt`` (its ``args``).
COMMON_ALLOW = AllowList.of(
    "Megatron-LM",
    records=["argparse.Namespace"],
    enums=["megatron.core.transformer.enums.AttnBackend", "signal.Signals"],
)


def tracked_iteration(run: Place) -> tuple[str, str]:
    """What the run's tracker file names: the iteration's directory name and the iteration in words."""
    path = run.join(TRACKER)
    text = run.read_small(TRACKER, "Megatron's tracker file").decode("utf-8", "replace").strip()
    if text == "release":
        return "release", "the release checkpoint"
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise InputError(f"{path}: holds {shown(text[:80])}, neither an iteration number nor 'release' (damaged tracker file?)")
    return f"iter_{int(text):07d}", f"iteration {int(text)}"


def read_backend(directory: Place) -> dict[str, Any]:
    """``metadata.json``: the backend that wrote the shards (only ``torch_dist`` is read)."""
    path = directory.join(BACKEND_FILE)
    try:
        found = json.loads(directory.read_small(BACKEND_FILE, "Megatron's metadata.json"))
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(found, dict):
        raise InputError(f"{path}: holds {shown(found)}, not Megatron's backend record")
    backend = found.get("sharded_backend")
    if backend != "torch_dist":
        raise InputError(
            f"{path}: unsupported: the shards were written by Megatron's {shown(backend)} backend; mpicons reads "
            "torch_dist (save with --ckpt-format torch_dist, or convert with Megatron's own tools)"
        )
    return found


@dataclass(frozen=True)
class RunFacts:
    """What ``common.pt`` says of the run."""

    path: str
    args: dict[str, object] | None
    iteration: int | None


def read_common(directory: Place) -> RunFacts:
    """``common.pt`` of an iteration directory: the run's args and the iteration."""
    path = directory.join(COMMON_FILE)
    source = directory.open(COMMON_FILE)
    try:
        value = archive_value(source, COMMON_ALLOW, "Megatron's common.pt")
    finally:
        source.close()
    if not isinstance(value, dict):
        raise InputError(f"{path}: holds {shown(value)}, not Megatron's common state (a dict)")
    args = value.get("args")
    fields = args.state if isinstance(args, Record) and args.kind == "argparse.Namespace" else None
    iteration = value.get("iteration")
    return RunFacts(path, fields if isinstance(fields, dict) else None, iteration if type(iteration) is int else None)


__all__ = [
    "BACKEND_FILE",
    "COMMON_ALLOW",
    "COMMON_FILE",
    "ITERATION_DIR",
    "METADATA_ALLOW",
    "TRACKER",
    "RunFacts",
    "read_backend",
    "read_common",
    "tracked_iteration",
]
