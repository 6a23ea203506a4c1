"""What every trainer leaf provides (no MPI here): how to recognise its checkpoints, the classes its
pickles may name, its rule files, and the model's config.

A leaf subclasses :class:`Trainer` and overrides what its checkpoints need; the defaults describe a
trainer whose checkpoints are plain DCP (torchtitan): nothing to recognise, nothing extra in the
pickles, the config from ``--hf-assets``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from ..adaptation.rule_text import RuleLine, expand
from ..adaptation.rules import RuleSet, parse_lines
from ..core.errors import InputError
from ..core.flat_pieces import TrainerLayout
from ..formats.byte_sources import ByteSource
from ..formats.unpickling import NOTHING, AllowList
from ..io.places import LocalPlace, Place

if TYPE_CHECKING:
    from ..io.assets import HFAssets


@dataclass(frozen=True)
class Found:
    """A checkpoint a trainer recognised at the location the user gave."""

    trainer: str  # the trainer's name (its ``--adapter`` name)
    directory: str  # the directory that holds ``.metadata`` and the data files
    layout: str  # which of the trainer's layouts it is, in words ("iteration directory", ...)
    notes: tuple[str, ...] = ()  # what the report says about it (the iteration chosen, ...)
    strip_prefix: str | None = None  # a prefix every saved name carries (NeMo's ``module.``)
    assets: str | None = None  # a folder of the model's Hugging Face files saved with it (verl's ``huggingface/``)
    #: ``directory`` as a place to read more of (Megatron's ``common.pt``); by default the local directory.
    place: Place | None = field(default=None, compare=False, repr=False)

    def at(self) -> Place:
        """Where the checkpoint is, to read more of it."""
        return self.place if self.place is not None else LocalPlace(self.directory)


@dataclass(frozen=True)
class Settled:
    """The model's config as the job uses it: the assets to publish (a derived config is one), the
    config the rules read, and what the report says about it."""

    assets: HFAssets | None
    notes: tuple[str, ...] = ()

    @property
    def config(self) -> dict[str, Any] | None:
        return None if self.assets is None else self.assets.config


class ArchiveFormat:
    """Checkpoints saved as per-rank ``torch.save`` archives (DeepSpeed ZeRO, verl), as the scan reads
    them: which files of the directory to read, what each says (a small record every rank receives),
    and where every element of every tensor lies (pure: the same on every rank)."""

    #: What the checkpoints are called in messages.
    title = ""

    def wanted(self, names: Sequence[str], directory: str) -> list[str]:
        """The files of ``names`` (the directory's entries) to read; InputError when they are not a checkpoint."""
        raise NotImplementedError

    def read(self, source: ByteSource, name: str) -> object:
        """What file ``name`` says, read through ``source`` (its storages never read)."""
        raise NotImplementedError

    def layout(self, names: Sequence[str], records: Sequence[object], sizes: Mapping[str, int], directory: str) -> TrainerLayout:
        """The tensors and their pieces from every file's record; InputError for what does not add up."""
        raise NotImplementedError


class Trainer:
    """A trainer's leaf: subclasses override what their checkpoints need."""

    #: The ``--adapter`` name.
    name = ""
    #: What its checkpoints are called in reports.
    title = ""
    #: Classes its ``.metadata`` pickles name beyond DCP's own (read as inert records).
    metadata_allow: AllowList = NOTHING
    #: Whether an input it recognises chooses its adapter when ``--adapter`` is not given.
    chosen_unasked = False
    #: How its per-rank ``torch.save`` archives are read (None: its checkpoints are DCP).
    archives: ArchiveFormat | None = None
    #: The prefixes under which its checkpoints may keep the optimizer's fp32 main parameters, one tensor
    #: per parameter under the parameter's name (``--main-params``); empty: none mpicons can map back.
    main_params_prefixes: tuple[str, ...] = ()
    #: The ``model_type`` values whose config.json it derives from the run itself (``--model-type``'s choices).
    derived_model_types: tuple[str, ...] = ()

    def recognise(self, place: Place) -> Found | None:
        """The checkpoint at ``place`` (the location the user gave) if it is recognisably this trainer's
        (None: not its own); :class:`InputError` when it is, but cannot be read as given."""
        return None

    def settle_config(self, found: Found | None, assets: HFAssets | None, model_type: str | None) -> Settled:
        """The config for the rules: the assets' own by default (a trainer may derive one, or check it)."""
        if model_type is not None:
            raise InputError(
                f"--model-type is for checkpoints whose config mpicons derives; --adapter {self.name} reads config.json"
            )
        return Settled(assets)

    def has_rules(self) -> bool:
        """Whether the trainer has built-in rule files, so that ``--adapter NAME`` names it (a trainer whose
        checkpoints hold Hugging Face's names already, DeepSpeed's or verl's, has none)."""
        folder = resources.files(type(self).__module__).joinpath("rules")
        return folder.is_dir() and any(entry.name.endswith(".rules") for entry in folder.iterdir())

    def rule_texts(self) -> list[tuple[str, tuple[RuleLine, ...]]]:
        """The trainer's built-in families (``rules/*.rules`` in its folder; ``rules/parts/`` holds what they
        include) as (origin, expanded lines), by file name."""
        folder = resources.files(type(self).__module__).joinpath("rules")
        files = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".rules")) if folder.is_dir() else []
        return [(origin, expand(text, origin, self.rule_file)) for origin, text in (self.rule_file(f, "") for f in files)]

    def rule_file(self, name: str, including: str) -> tuple[str, str]:
        """A built-in rule file (what an ``include`` line names, beside the file including it) as (origin, text)."""
        base = including.partition(":")[2].rpartition("/")[0] if including.startswith(f"{self.name}:") else ""
        parts = [*base.split("/"), *name.split("/")] if base else name.split("/")
        if not name.endswith(".rules") or any(p in ("", ".", "..") for p in name.split("/")):
            raise InputError(f"{including}: include {name!r}: a built-in rule file, such as parts/gqa.rules")
        entry = resources.files(type(self).__module__).joinpath("rules", *parts)
        if not entry.is_file():
            raise InputError(f"{including}: include {name!r}: --adapter {self.name} has no such rule file")
        return f"{self.name}:{'/'.join(parts)}", entry.read_text(encoding="utf-8")

    def rule_sets(self) -> list[RuleSet]:
        """The trainer's built-in rule files, parsed, by file name."""
        return [parsed_rules(lines, origin) for origin, lines in self.rule_texts()]

    def choose_rules(self, config: dict[str, Any] | None) -> RuleSet:
        """The rule file for the config's ``model_type``; bad input when there is no config or no file for it."""
        if config is None:
            raise InputError(
                f"--adapter {self.name} needs the model's config.json: give --hf-assets DIR (the model's Hugging Face files)"
            )
        model_type = config.get("model_type")
        sets = self.rule_sets()
        for rule_set in sets:
            if model_type in rule_set.model_types:
                return rule_set
        known = sorted(t for s in sets for t in s.model_types)
        raise InputError(
            f"--adapter {self.name}: config.json's model_type {model_type!r} has no built-in rules "
            f"(known: {', '.join(known) or 'none yet'}); write a rule file for it (docs/adapter-rules.md) and pass --adapter FILE"
        )


#: A rank as trainers write it in a file name: ASCII digits, no leading zero (``re``'s ``\d`` would take
#: any script's digits, and ``int`` reads them: ``rank_٠`` would be rank 0).
RANK_NUMBER = r"(0|[1-9][0-9]*)"


def refuse_other_spellings(
    names: Sequence[str], loose: re.Pattern[str], canonical: Callable[[re.Match[str]], str], directory: str
) -> None:
    """Bad input for a file that claims a rank under another spelling than the trainer's own (``loose``
    matches it, ``canonical`` gives the name the trainer writes for what it claims): such a file would
    stand in for the real one, or beside it, with another parameter order or another rank's data."""
    present = set(names)
    for name in sorted(names):
        found = loose.match(name)
        if found is None or (own := canonical(found)) == name:
            continue
        beside = f", beside {own}" if own in present else ""
        raise InputError(
            f"{directory}/{name}: not a name the trainer writes; it claims what {own} holds{beside}. Ranks are "
            "plain ASCII numbers in the trainer's own zero-padding: remove or rename the file"
        )


@functools.cache
def parsed_rules(lines: tuple[RuleLine, ...], origin: str) -> RuleSet:
    """A built-in rule file parsed once per process (its patterns compiled: about 15 ms)."""
    return parse_lines(lines, origin)


__all__ = ["RANK_NUMBER", "ArchiveFormat", "Found", "Settled", "Trainer", "parsed_rules", "refuse_other_spellings"]
