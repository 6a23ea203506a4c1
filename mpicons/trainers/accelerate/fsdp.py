"""accelerate's FSDP ``SHARDED_STATE_DICT`` checkpoints, recognised from names (pure, no I/O).

``Accelerator.save_state`` with ``fsdp_state_dict_type: SHARDED_STATE_DICT`` saves model ``i`` with
DCP into ``<checkpoint>/pytorch_model_fsdp_<i>/`` (``.metadata`` + ``__R_0.distcp``) as the state dict
``{"model": <the model's state dict>}``, so every tensor name starts with ``model.``; the optimizer
goes to ``optimizer_<i>/`` the same way. Stripping ``model.`` gives the model's own names (Hugging
Face names for a Hugging Face model).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ...core.errors import InputError

_MODEL_DIRECTORY = re.compile(r"^pytorch_model_fsdp_(\d+)$")
PREFIX = "model."


def model_directory(names: Sequence[str], directory: str) -> str | None:
    """The ``pytorch_model_fsdp_<i>`` folder among ``names`` (the entries of a checkpoint folder such as
    ``checkpoint-500/``), or None when there is none; several (one per model) are bad input: name one."""
    found = sorted(n for n in names if _MODEL_DIRECTORY.match(n))
    if len(found) > 1:
        raise InputError(
            f"{directory}: holds the FSDP checkpoints of {len(found)} models ({', '.join(found[:4])}): "
            f"give the one to consolidate, e.g. {directory}/{found[0]}"
        )
    return found[0] if found else None


def prefix_to_strip(directory: str, tensor_names: Sequence[str]) -> str | None:
    """``model.`` when ``directory`` is accelerate's ``pytorch_model_fsdp_<i>`` and every tensor name
    starts with it (what mpicons then strips by itself, and reports), else None."""
    base = directory.rstrip("/").rsplit("/", 1)[-1]
    if not _MODEL_DIRECTORY.match(base) or not tensor_names:
        return None
    return PREFIX if all(name.startswith(PREFIX) and len(name) > len(PREFIX) for name in tensor_names) else None


__all__ = ["PREFIX", "model_directory", "prefix_to_strip"]
