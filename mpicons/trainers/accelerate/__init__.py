"""accelerate's FSDP checkpoints: a ``SHARDED_STATE_DICT`` save is DCP whose tensor names carry
accelerate's ``model.`` prefix; recognised from its folder's name (:mod:`.fsdp`, pure), read as DCP
with the prefix removed (and reported), so that it consolidates without options.

Layouts recognised: ``pytorch_model_fsdp_<i>/`` itself, or the checkpoint folder holding one."""

from __future__ import annotations

import os

from ...core.names import METADATA_NAME
from ..base import Found, Trainer, entries
from .fsdp import _MODEL_DIRECTORY, PREFIX, model_directory


class Accelerate(Trainer):
    name = "accelerate"
    title = "accelerate FSDP (SHARDED_STATE_DICT)"

    def recognise(self, location: str) -> Found | None:
        if not _MODEL_DIRECTORY.match(os.path.basename(os.path.normpath(location))):
            inner = model_directory(entries(location), location)
            if inner is None:
                return None
            location = os.path.join(location, inner)
        if not os.path.isfile(os.path.join(location, METADATA_NAME)):
            return None
        note = f"{self.title} checkpoint: {location}, the '{PREFIX}' prefix removed from its names"
        return Found(self.name, location, "model directory", (note,), strip_prefix=PREFIX)


ACCELERATE = Accelerate()

__all__ = ["ACCELERATE", "Accelerate"]
