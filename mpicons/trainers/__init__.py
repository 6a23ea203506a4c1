"""The trainers mpicons knows, one leaf each (``torchtitan/``, ``megatron/``, ``deepspeed/``, ``verl/``,
``accelerate/``): how to recognise a checkpoint of theirs, the classes their pickles may name, their
rule files, where their config and iteration live, and a sample writer of their format beside its
reader (no MPI here). ``sample_model`` is what every sample holds, ``sample_distcp`` DCP's default
format as the samples write it.

Nothing below this package names a trainer. The job asks the trainers in turn whether the input is
theirs (:func:`recognise`) and hands what the one that claims it gives (an allow-list for the
metadata's pickle, a directory to read, rule sets, a config) to the layers below as parameters.
A new trainer is one more leaf and one more entry in :data:`TRAINERS`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..adaptation.rule_text import RuleLine, joined
from ..adaptation.rules import RuleSet, may_read
from ..io.places import Place
from .accelerate import ACCELERATE
from .base import ArchiveFormat, Found, Settled, Trainer, parsed_rules
from .deepspeed import DEEPSPEED
from .megatron import MEGATRON
from .torchtitan import TORCHTITAN
from .verl import VERL

#: Every trainer, by its ``--adapter`` name, in the order they are asked (verl before Megatron: both
#: name a run's newest step in ``latest_checkpointed_iteration.txt``; verl's names a ``global_step_<N>/actor``).
TRAINERS: dict[str, Trainer] = {trainer.name: trainer for trainer in (TORCHTITAN, VERL, MEGATRON, DEEPSPEED, ACCELERATE)}


def recognise(place: Place) -> Found | None:
    """The checkpoint at ``place`` as the first trainer that recognises it sees it (None: no trainer's own)."""
    for trainer in TRAINERS.values():
        found = trainer.recognise(place)
        if found is not None:
            return found
    return None


def trainer(name: str) -> Trainer | None:
    """The trainer of a built-in ``--adapter`` name (None: not one, a rule file's path)."""
    found = TRAINERS.get(name)
    return found if found is not None and found.has_rules() else None


def adapter_names() -> list[str]:
    """The built-in ``--adapter`` names: the trainers that have rule files."""
    return [name for name, known in TRAINERS.items() if known.has_rules()]


def derived_model_types() -> list[str]:
    """Every ``model_type`` a trainer derives a config for (``--model-type``'s choices), as ``trainer:type``."""
    return [f"{name}:{model_type}" for name, known in TRAINERS.items() for model_type in known.derived_model_types]


@functools.cache
def known_rule_sets() -> tuple[tuple[str, RuleSet], ...]:
    """Every trainer's built-in rule sets, each with its ``--adapter`` name: what the hints about names ask
    (:mod:`mpicons.adaptation.hints`). Parsed once per process."""
    return tuple((name, rules) for name, known in TRAINERS.items() for rules in known.rule_sets())


@functools.cache
def _rule_texts() -> tuple[tuple[str, str, tuple[RuleLine, ...], str], ...]:
    """(``--adapter`` name, origin, expanded lines, their text) of every built-in family, read once per process."""
    return tuple((name, origin, lines, joined(lines)) for name, known in TRAINERS.items() for origin, lines in known.rule_texts())


def rule_sets_reading(names: Sequence[str]) -> tuple[tuple[str, RuleSet], ...]:
    """The built-in rule sets, as :func:`known_rule_sets`, that may read every one of ``names``: only
    the files that may read the first name are parsed (none, usually, for names no trainer writes),
    so the names hint of a run without ``--adapter`` compiles few of the built-in patterns."""
    if not names:
        return ()
    return tuple((name, parsed_rules(lines, origin)) for name, origin, lines, text in _rule_texts() if may_read(text, names[0]))


__all__ = [
    "TRAINERS",
    "ArchiveFormat",
    "Found",
    "Settled",
    "Trainer",
    "adapter_names",
    "derived_model_types",
    "known_rule_sets",
    "recognise",
    "rule_sets_reading",
    "trainer",
]
