"""DeepSpeed ZeRO checkpoints (stage 1, 2 and 3): which files a ``global_stepN/`` directory holds
(:mod:`.files`), what their ``torch.save`` archives say (:mod:`.records`, read without torch or
DeepSpeed), and where every element of every fp32 master weight lies (:mod:`.layout`, pure).
The facts are in docs/torch-archive-format.md.

Layouts recognised (the directory the user gives): the run directory holding ``latest`` (the tag it
names is read), or the tag's directory itself (``global_step2/``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...core.errors import InputError
from ...core.flat_pieces import TrainerLayout
from ...formats.byte_sources import ByteSource
from ...io.places import Place
from ..base import ArchiveFormat, Found, Trainer
from .files import _MODEL3, _OPTIM, LATEST, ZeroFiles, detect, latest_tag
from .layout import zero_layout
from .records import ZeroModel, ZeroPartition, read_model_states, read_optim_states

RUN_LAYOUT, TAG_LAYOUT = "run directory", "checkpoint directory"
CONFIG_NAME = "config.json"


def _files(names: Sequence[str], directory: str) -> ZeroFiles:
    files = detect(names, directory)
    if files is None:
        raise InputError(f"{directory}: no DeepSpeed ZeRO checkpoint files (*_optim_states.pt, *_model_states.pt)")
    return files


class ZeroArchives(ArchiveFormat):
    """The optimizer-state files (fp32 master weights) and model-state files of a ZeRO checkpoint."""

    title = "DeepSpeed ZeRO"

    def wanted(self, names: Sequence[str], directory: str) -> list[str]:
        files = _files(names, directory)
        return [*sorted(files.model_states.values()), *sorted(files.optim_states.values())]

    def read(self, source: ByteSource, name: str) -> object:
        optim = _OPTIM.match(name)
        if optim:
            return read_optim_states(source, name, int(optim.group(2)))
        model = _MODEL3.match(name)
        return read_model_states(source, name, int(model.group(1)) if model else 0)

    def layout(self, names: Sequence[str], records: Sequence[object], sizes: Mapping[str, int], directory: str) -> TrainerLayout:
        models = [r for r in records if isinstance(r, ZeroModel)]
        partitions = [r for r in records if isinstance(r, ZeroPartition)]
        return zero_layout(_files(names, directory), models, partitions, directory)


class DeepSpeed(Trainer):
    name = "deepspeed"
    title = "DeepSpeed ZeRO"
    archives = ZeroArchives()

    def recognise(self, place: Place) -> Found | None:
        names = place.entries()
        if LATEST in names and place.is_file(LATEST) and detect(names, place.path) is None:
            latest = place.join(LATEST)
            tag = latest_tag(place.read_small(LATEST, "DeepSpeed's latest file").decode("utf-8", "replace"), latest)
            if not place.is_dir(tag):
                raise InputError(
                    f"{latest}: names {tag!r}, but {place.join(tag)} is not there (removed?): give a checkpoint directory"
                )
            step = place.child(tag)
            if detect(step.entries(), step.path) is None:
                return None
            note = f"{self.title} checkpoint {tag} (named by {latest}): {step.path}"
            return Found(self.name, step.path, RUN_LAYOUT, (note,), assets=_assets_in(place), place=step)
        if detect(names, place.path) is None:
            return None
        note = f"{self.title} checkpoint: {place.path}"
        return Found(self.name, place.path, TAG_LAYOUT, (note,), assets=_assets_in(place.parent()), place=place)


def _assets_in(folder: Place) -> str | None:
    """The folder itself when it holds the model's ``config.json``: Hugging Face Trainer's ``checkpoint-N/``
    keeps the config and tokenizer beside DeepSpeed's ``global_stepN/`` (only a model's files are published)."""
    return folder.path if folder.is_file(CONFIG_NAME) else None


DEEPSPEED = DeepSpeed()

__all__ = ["DEEPSPEED", "DeepSpeed", "ZeroArchives"]
