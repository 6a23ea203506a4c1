"""Whose names a checkpoint holds: a trainer's own (a built-in adapter would map them) or Hugging
Face's already (what an adapter writes). Pure; the built-in rule sets are asked in turn.

Asked when no adapter is given (a trainer's names consolidated as they are load in no transformers
model), when an adapter's rules match none of a checkpoint's names (they may be the names the rules
write), and by ``verify`` when an output's names and the shards' do not line up. The rule sets
asked are the caller's (``known``: each built-in adapter's name with one of its rule sets, as
:func:`mpicons.trainers.known_rule_sets` gives them): this layer knows no trainer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence

from .rules import Rule, RuleSet

#: Built-in rule sets, each with the ``--adapter`` name that chooses it.
KnownRules = Sequence[tuple[str, RuleSet]]

_TARGET_PART = re.compile(r"\{([^{}]*)\}")


def _source_rule(rules: RuleSet, name: str) -> Rule | None:
    """The first rule whose source pattern matches ``name``, whatever its condition on the config."""
    return next((rule for rule in rules.rules if rule.pattern.fullmatch(name)), None)


def maps_every_name(rules: RuleSet, names: Iterable[str]) -> bool:
    """Whether ``rules`` read every name (a ``skip`` counts) and give at least one of them another name:
    the names are the trainer's own, not Hugging Face's (which a rule may keep, as ``lm_head.weight``)."""
    renamed = False
    for name in names:
        rule = _source_rule(rules, name)
        if rule is None:
            return False
        renamed = renamed or (not rule.skip and (rule.target != name or rule.kind != "rename"))
    return renamed


def recognising_adapters(names: Sequence[str], known: KnownRules) -> list[str]:
    """The built-in adapters (``--adapter NAME``) one of whose rule files maps every name in ``names``."""
    if not names:
        return []
    found: list[str] = []
    for adapter, rules in known:
        if adapter not in found and maps_every_name(rules, names):
            found.append(adapter)
    return found


@functools.cache
def _target_pattern(template: str) -> re.Pattern[str]:
    """A rule's target as a pattern: ``{N}`` and ``{M+expr}`` any number, ``{q|k|v}`` one of the parts."""
    parts, position = [], 0
    for found in _TARGET_PART.finditer(template):
        parts.append(re.escape(template[position : found.start()]))
        inner = found.group(1)
        parts.append("(?:" + "|".join(map(re.escape, inner.split("|"))) + ")" if "|" in inner else "[0-9]+")
        position = found.end()
    parts.append(re.escape(template[position:]))
    return re.compile("".join(parts))


def written_by(rules: RuleSet, name: str) -> bool:
    """Whether ``name`` is one the rules write (a target), rather than one they read."""
    return any(rule.target is not None and _target_pattern(rule.target).fullmatch(name) for rule in rules.rules)


def mostly_written_by(rules: RuleSet, names: Sequence[str]) -> bool:
    """Whether most of ``names`` are what the rules write: the checkpoint is an adapter's output already."""
    return bool(names) and 2 * sum(written_by(rules, name) for name in names) > len(names)


def adapter_between(saved: Sequence[str], written: Sequence[str], known: KnownRules) -> str | None:
    """The built-in adapter one of whose rule files maps every name in ``saved`` and writes most of
    ``written``: an output made from those shards with that adapter, or None."""
    if not saved or not written:
        return None
    for adapter, rules in known:
        if maps_every_name(rules, saved) and mostly_written_by(rules, written):
            return adapter
    return None


def trainer_names_note(names: Sequence[str], known: KnownRules) -> str | None:
    """The consolidation report's note when the names are a trainer's own and no adapter was given."""
    adapters = recognising_adapters(names, known)
    if not adapters:
        return None
    options = " or ".join(f"--adapter {a} --hf-assets DIR" for a in adapters)
    whose = " or ".join(adapters)
    return (
        f"the tensor names are {whose}'s own, which transformers will not load as they are; {options} "
        "(DIR: the model's Hugging Face files, config.json) writes them as a Hugging Face model"
    )


__all__ = [
    "KnownRules",
    "maps_every_name",
    "recognising_adapters",
    "written_by",
    "mostly_written_by",
    "adapter_between",
    "trainer_names_note",
]
