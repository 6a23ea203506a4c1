"""accelerate's FSDP checkpoints: a ``SHARDED_STATE_DICT`` save is DCP whose tensor names carry
accelerate's ``model.`` prefix; recognised from its folder's name (:mod:`.fsdp`, pure), read as DCP
with the prefix removed (and reported), so that it consolidates without options.

Layouts recognised: ``pytorch_model_fsdp_<i>/`` itself, or the checkpoint folder holding one."""

from __future__ import annotations

from ...core.names import METADATA_NAME
from ...io.places import Place
from ..base import Found, Trainer
from .fsdp import _MODEL_DIRECTORY, PREFIX, model_directory


class Accelerate(Trainer):
    name = "accelerate"
    title = "accelerate FSDP (SHARDED_STATE_DICT)"

    def recognise(self, place: Place) -> Found | None:
        if not _MODEL_DIRECTORY.match(place.name):
            inner = model_directory(place.entries(), place.path)
            if inner is None:
                return None
            place = place.child(inner)
        if not place.is_file(METADATA_NAME):
            return None
        note = f"{self.title} checkpoint: {place.path}, the '{PREFIX}' prefix removed from its names"
        return Found(self.name, place.path, "model directory", (note,), strip_prefix=PREFIX, place=place)


ACCELERATE = Accelerate()

__all__ = ["ACCELERATE", "Accelerate"]
