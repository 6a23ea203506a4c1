"""Which files make a verl FSDP actor checkpoint, from the names in a directory (pure, no I/O).

verl's ``FSDPCheckpointManager`` writes ``<run>/global_step_<N>/actor/`` holding, per rank R of W,
``model_world_size_W_rank_R.pt`` (the rank's shard of every parameter), ``optim_world_size_W_rank_R.pt``
and ``extra_state_world_size_W_rank_R.pt`` (optimizer and scheduler/RNG state, not needed here),
``fsdp_config.json`` (``{"FSDP_version": 1|2, "world_size": W}``) and ``huggingface/`` (config and
tokenizer). verl's trainer writes ``<run>/latest_checkpointed_iteration.txt`` holding N.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ...core.errors import InputError
from ..base import RANK_NUMBER, refuse_other_spellings

_MODEL = re.compile(rf"^model_world_size_{RANK_NUMBER}_rank_{RANK_NUMBER}\.pt$")
_OTHER = re.compile(rf"^(optim|extra_state)_world_size_{RANK_NUMBER}_rank_{RANK_NUMBER}\.pt$")
#: Any spelling of a model file's name: one that is not verl's own claims a rank another file has.
_LOOSE_MODEL = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
CONFIG = "fsdp_config.json"
#: The file a verl run directory names its newest step in, and the folders below it.
LATEST = "latest_checkpointed_iteration.txt"
ACTOR = "actor"
ASSETS = "huggingface"


@dataclass(frozen=True)
class VerlFiles:
    """The files of one actor checkpoint (names inside its directory)."""

    world_size: int
    models: dict[int, str]  # rank → model shard file
    others: list[str]  # optimizer and extra-state files (skipped)
    config: str | None  # fsdp_config.json, when present (older verl wrote none)
    assets: str | None  # the huggingface/ folder, when present

    def model_name(self, rank: int) -> str:
        return f"model_world_size_{self.world_size}_rank_{rank}.pt"


def detect(names: Sequence[str], directory: str) -> VerlFiles | None:
    """The actor checkpoint among ``names`` (the entries of ``directory``), or None when there is none.
    Model files of two world sizes are bad input."""
    canonical = lambda m: f"model_world_size_{int(m.group(1))}_rank_{int(m.group(2))}.pt"  # noqa: E731
    refuse_other_spellings(names, _LOOSE_MODEL, canonical, directory)
    models = {n: m for n in names if (m := _MODEL.match(n))}
    if not models:
        return None
    sizes = sorted({int(m.group(1)) for m in models.values()})
    if len(sizes) > 1:
        raise InputError(f"{directory}: model files of world sizes {sizes[0]} and {sizes[1]}: two checkpoints mixed?")
    others = sorted(n for n in names if (m := _OTHER.match(n)) and int(m.group(2)) == sizes[0])
    return VerlFiles(
        world_size=sizes[0],
        models={int(m.group(2)): n for n, m in models.items()},
        others=others,
        config=CONFIG if CONFIG in names else None,
        assets=ASSETS if ASSETS in names else None,
    )


def check_config(files: VerlFiles, text: str, directory: str) -> None:
    """``fsdp_config.json`` must record the world size the file names say."""
    path = f"{directory}/{CONFIG}"
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        raise InputError(f"{path}: not valid JSON (or nested deeper than any config is)") from None
    world = config.get("world_size") if isinstance(config, dict) else None
    if type(world) is not int or world != files.world_size:
        raise InputError(
            f"{path}: records world size {world!r}, the model files say {files.world_size} "
            f"({files.model_name(0)}): two checkpoints mixed?"
        )


def check_ranks(files: VerlFiles, directory: str) -> None:
    """Every rank's model file is present: a missing one would make shorter parameters."""
    missing = [r for r in range(files.world_size) if r not in files.models]
    if missing:
        raise InputError(
            f"{directory}/{files.model_name(missing[0])}: missing (rank {missing[0]} of {files.world_size}"
            f"{f'; {len(missing)} ranks are missing' if len(missing) > 1 else ''}): copy every rank's files"
        )
    stray = sorted(r for r in files.models if r >= files.world_size)
    if stray:
        raise InputError(f"{directory}/{files.models[stray[0]]}: rank {stray[0]} of a world of {files.world_size}?")


def step_directory(text: str, path: str) -> str:
    """The step folder ``latest_checkpointed_iteration.txt`` names (``global_step_<N>``)."""
    step = text.strip()
    if not step.isascii() or not step.isdigit() or len(step) > 18:
        raise InputError(f"{path}: does not hold a step number ({step[:80]!r})")
    return f"global_step_{int(step)}"


__all__ = ["ACTOR", "ASSETS", "CONFIG", "LATEST", "VerlFiles", "check_config", "check_ranks", "detect", "step_directory"]
