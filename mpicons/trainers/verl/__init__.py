"""verl FSDP actor checkpoints (FSDP2, and FSDP1 saved with a device mesh): which files an ``actor/``
directory holds (:mod:`.files`), what each rank's ``torch.save`` archive says (:mod:`.records`, read
without torch), and where every row of every parameter lies (:mod:`.layout`, pure). The facts are
in docs/torch-archive-format.md.

Layouts recognised (the directory the user gives): the run directory holding
``latest_checkpointed_iteration.txt`` (its ``global_step_<N>/actor/`` is read), a step directory
holding ``actor/``, or the ``actor/`` directory itself. Its ``huggingface/`` folder (config and
tokenizer) is the model's Hugging Face files unless ``--hf-assets`` names others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...core.errors import InputError
from ...core.flat_pieces import TrainerLayout
from ...formats.byte_sources import ByteSource
from ...io.places import Place
from ..base import ArchiveFormat, Found, Trainer
from .files import _MODEL, ACTOR, ASSETS, CONFIG, LATEST, check_config, detect
from .layout import verl_layout
from .records import VerlRank, read_rank

RUN_LAYOUT, STEP_LAYOUT, ACTOR_LAYOUT = "run directory", "step directory", "actor directory"


class VerlArchives(ArchiveFormat):
    """Every rank's model file (its rows of each parameter) and ``fsdp_config.json``."""

    title = "verl FSDP actor"

    def wanted(self, names: Sequence[str], directory: str) -> list[str]:
        files = detect(names, directory)
        if files is None:
            raise InputError(f"{directory}: no verl model files (model_world_size_W_rank_R.pt)")
        return [*([files.config] if files.config else []), *(files.models[r] for r in sorted(files.models))]

    def read(self, source: ByteSource, name: str) -> object:
        if name == CONFIG:
            return source.read_at(0, min(source.size, 1 << 20)).decode("utf-8", "replace")
        match = _MODEL.match(name)
        return read_rank(source, name, int(match.group(2)) if match else 0)

    def layout(self, names: Sequence[str], records: Sequence[object], sizes: Mapping[str, int], directory: str) -> TrainerLayout:
        files = detect(names, directory)
        assert files is not None
        for text in (r for r in records if isinstance(r, str)):
            check_config(files, text, directory)
        return verl_layout(files, [r for r in records if isinstance(r, VerlRank)], directory, sizes)


def _step_of(run: Place) -> tuple[Place, str] | None:
    """The step directory and its number a run's ``latest_checkpointed_iteration.txt`` names (None: not verl's)."""
    text = run.read_small(LATEST, "verl's latest_checkpointed_iteration.txt").decode("utf-8", "replace").strip()
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    name = f"global_step_{int(text)}"
    return (run.child(name), text) if run.is_dir(name) and run.child(name).is_dir(ACTOR) else None


class Verl(Trainer):
    name = "verl"
    title = "verl FSDP actor"
    archives = VerlArchives()

    def recognise(self, place: Place) -> Found | None:
        which, layout = "", ACTOR_LAYOUT
        if place.is_file(LATEST):
            found = _step_of(place)
            if found is None:
                return None
            place, layout, which = found[0], RUN_LAYOUT, f", step {found[1]} (named by {LATEST})"
        if detect(place.entries(), place.path) is None and place.is_dir(ACTOR):
            place, layout = place.child(ACTOR), layout if which else STEP_LAYOUT
        if detect(place.entries(), place.path) is None:
            return None
        note = f"{self.title} checkpoint{which}: {place.path}"
        saved = place.is_dir(ASSETS) and place.child(ASSETS).is_file("config.json")
        return Found(self.name, place.path, layout, (note,), assets=place.join(ASSETS) if saved else None, place=place)


VERL = Verl()

__all__ = ["VERL", "Verl", "VerlArchives"]
