"""torchtitan: plain DCP checkpoints, so nothing to recognise and nothing extra in the pickles; its
rule files (``rules/``, one per model family, chosen by config.json's ``model_type``) need the
model's config from ``--hf-assets``."""

from __future__ import annotations

from ..base import Trainer


class Torchtitan(Trainer):
    name = "torchtitan"
    title = "torchtitan"


TORCHTITAN = Torchtitan()

__all__ = ["TORCHTITAN", "Torchtitan"]
