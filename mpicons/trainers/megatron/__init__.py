"""Megatron-Core's ``torch_dist`` checkpoints (Megatron-LM, NeMo 2, Megatron-Bridge): recognised by
their layout, read as DCP with the save plans Megatron adds to ``.metadata`` allowed as inert records,
converted by the rule files in ``rules/`` (by config.json's ``model_type``), the config derived from
``common.pt``'s args when the run has none (:mod:`.config`).

Layouts recognised (the directory the user gives):

- a run's checkpoint directory holding ``latest_checkpointed_iteration.txt``: the iteration it names;
- an iteration directory (``iter_0000010``, ``release``): ``.metadata`` beside ``metadata.json``;
- a NeMo 2 checkpoint (a step directory holding ``weights/`` and ``context/``, or its ``weights/``):
  the same files in ``weights/``, every name prefixed ``module.`` (removed).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...core.errors import InputError
from ...core.names import METADATA_NAME
from ...io.places import Place
from ..base import Found, Settled, Trainer
from .config import MODEL_TYPES, check_config, derive_config
from .files import (
    BACKEND_FILE,
    COMMON_FILE,
    ITERATION_DIR,
    METADATA_ALLOW,
    TRACKER,
    RunFacts,
    read_backend,
    read_common,
    tracked_iteration,
)

if TYPE_CHECKING:
    from ...io.assets import HFAssets

RUN_LAYOUT, ITERATION_LAYOUT, NEMO_LAYOUT = "run directory", "iteration directory", "NeMo 2 checkpoint"
NEMO_PREFIX = "module."


def _nemo_weights(place: Place) -> Place | None:
    """NeMo 2's ``weights/`` when ``place`` is its step directory or that ``weights/`` itself."""
    if place.is_dir("context") and place.is_dir("weights") and place.child("weights").is_file(METADATA_NAME):
        return place.child("weights")
    if place.name == "weights" and place.is_file(METADATA_NAME) and place.parent().is_dir("context"):
        return place
    return None


class Megatron(Trainer):
    name = "megatron"
    title = "Megatron-Core torch_dist"
    metadata_allow = METADATA_ALLOW
    chosen_unasked = True
    derived_model_types = MODEL_TYPES
    #: Float16Optimizer and the distributed optimizer's fully_sharded_model_space form: ``fp32_param``;
    #: its fully_reshardable form: ``param`` (FACTS.md §10, §16). Its default dp_reshardable form keeps
    #: flat per-bucket buffers instead, which name no parameter.
    main_params_prefixes = ("optimizer.state.fp32_param.", "optimizer.state.param.")

    def recognise(self, place: Place) -> Found | None:
        if place.is_file(TRACKER):
            return self._from_run(place)
        weights = _nemo_weights(place)
        if weights is not None:
            note = f"{self.title} checkpoint of NeMo 2: reading {weights.path}, the '{NEMO_PREFIX}' prefix removed from its names"
            return Found(self.name, weights.path, NEMO_LAYOUT, (note,), strip_prefix=NEMO_PREFIX, place=weights)
        if place.is_file(METADATA_NAME) and (place.is_file(BACKEND_FILE) or place.is_file(COMMON_FILE)):
            if place.is_file(BACKEND_FILE):
                read_backend(place)
            match = ITERATION_DIR.match(place.name)
            which = f", iteration {int(match.group(1))}" if match else ""
            return Found(self.name, place.path, ITERATION_LAYOUT, (f"{self.title} checkpoint{which}: {place.path}",), place=place)
        iterations = sorted(entry for entry in place.entries() if ITERATION_DIR.match(entry))
        if not place.is_file(METADATA_NAME) and iterations:
            raise InputError(
                f"{place.path}: holds Megatron iteration directories ({', '.join(iterations[-3:])}) but no {TRACKER}: "
                "give the iteration directory to read"
            )
        return None

    def _from_run(self, run: Place) -> Found:
        name, words = tracked_iteration(run)
        if not run.is_dir(name):
            raise InputError(
                f"{run.join(TRACKER)}: names {words}, but {run.join(name)} is not there (removed?): "
                f"give an iteration directory of {run.path} instead"
            )
        directory = run.child(name)
        if not directory.is_file(METADATA_NAME):
            legacy = any(entry.startswith("mp_rank_") for entry in directory.entries())
            raise InputError(
                f"{directory.path}: no {METADATA_NAME}: "
                + (
                    "a checkpoint in Megatron's legacy 'torch' format (mp_rank_XX/), which mpicons does not read; "
                    "save with --ckpt-format torch_dist"
                    if legacy
                    else "not a torch_dist checkpoint (was the save interrupted?)"
                )
            )
        if directory.is_file(BACKEND_FILE):
            read_backend(directory)
        note = f"{self.title} checkpoint, {words} (named by {TRACKER}): {directory.path}"
        return Found(self.name, directory.path, RUN_LAYOUT, (note,), place=directory)

    def settle_config(self, found: Found | None, assets: HFAssets | None, model_type: str | None) -> Settled:
        """The assets' config checked against ``common.pt``'s args, or, without one, derived from them; a
        note when the embeddings are tied (Megatron then saves no output layer, and none is written)."""
        settled = self._settled(found, assets, model_type)
        config = settled.config or {}
        if config.get("tie_word_embeddings"):
            tied = (
                "tied embeddings (tie_word_embeddings): Megatron saves no output layer, none is written, and "
                "transformers uses the embedding as lm_head"
            )
            return Settled(settled.assets, (*settled.notes, tied))
        return settled

    def _settled(self, found: Found | None, assets: HFAssets | None, model_type: str | None) -> Settled:
        config = None if assets is None else assets.config
        if config is not None and model_type is not None and config.get("model_type") != model_type:
            raise InputError(f"--model-type {model_type!r}: config.json from --hf-assets says {config.get('model_type')!r}")
        run = None
        readable = found is not None and found.layout != NEMO_LAYOUT and found.at().is_file(COMMON_FILE)
        try:
            run = read_common(found.at()) if readable and found is not None else None
        except InputError as exc:
            if config is None:
                raise
            return Settled(assets, (f"{exc}; config.json from --hf-assets is not checked against the run's args",))
        if config is not None:
            if run is None or run.args is None:
                return Settled(assets, (f"config.json from --hf-assets, not checked: {_no_args(found)}",))
            check_config(run.args, run.path, config, os.path.join(assets.directory, "config.json") if assets else "config.json")
            return Settled(assets, (f"config.json from --hf-assets agrees with the run's args ({run.path})",))
        return Settled(*self._derived(found, run, model_type))

    def _derived(self, found: Found | None, run: RunFacts | None, model_type: str | None) -> tuple[HFAssets, tuple[str, ...]]:
        from ...io.assets import HFAssets, render_config

        if found is None or run is None or run.args is None:
            raise InputError(f"--adapter {self.name} needs the model's config.json ({_no_args(found)}): give --hf-assets DIR")
        config = derive_config(run.args, run.path, model_type)
        origin = f"the config derived from {run.path}'s args"
        assets = HFAssets(found.directory, config, None, ("config.json",), (), render_config(config), config_origin=origin)
        note = f"config.json derived from the run's args ({run.path}): model_type {config['model_type']}"
        return assets, (note,)


def _no_args(found: Found | None) -> str:
    """Why there are no run arguments to derive or check a config with."""
    if found is None:
        return "the input is not a directory mpicons recognises as Megatron's"
    if found.layout == NEMO_LAYOUT:
        return f"a {NEMO_LAYOUT} keeps the model's config in context/, which mpicons does not read"
    return f"{found.directory} holds no {COMMON_FILE} with the run's args"


MEGATRON = Megatron()

__all__ = ["MEGATRON", "METADATA_ALLOW", "Megatron", "NEMO_PREFIX"]
