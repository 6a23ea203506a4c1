"""A rule set read backwards (pure): the saved tensors a trainer's checkpoint holds for a set of Hugging
Face tensors, and which rows of which Hugging Face tensor fill each of them.

A rule maps a saved tensor to Hugging Face tensors through row transforms; each has an inverse:

- ``unbind(N)``: the Hugging Face tensors for ``N = 0 .. count-1`` stacked on a new leading axis
  (``count``: every index found, none missing);
- ``crop_rows(k)``: the ``k`` rows, then rows up to ``padded(k)`` left zero (the caller says how a
  trainer pads: Megatron's vocabulary to ``make_vocab_size_divisible_by × TP``);
- ``split_rows(groups, sizes)``: group by group, each part's rows of that group.

The result is a list of :class:`Fill` per saved tensor: a run of rows of one Hugging Face tensor copied
to a run of the saved tensor's rows (its leading axes flattened), so the cost is per run of rows (per
query group and layer at most), never per row. The forward plan of what this gives
(:func:`~mpicons.adaptation.apply.plan_conversion`) gives the Hugging Face names and shapes back.

The first rule whose target matches a Hugging Face name claims it, in the file's order: so the stacked
form of a ``[N]`` rule (first) is chosen, and of two saved names for one Hugging Face tensor, the one
written first (Transformer Engine's fused layer-norm names before the separate modules).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..core.errors import InputError
from .rules import Rule, RuleSet, evaluate_text

Shape = tuple[int, ...]
_FIELD = re.compile(r"\{([A-Za-z_]\w*)(?:\s*\+\s*([^{}]+))?\}|\{([^{}]*\|[^{}]*)\}")


@dataclass(frozen=True)
class Fill:
    """``rows`` rows of Hugging Face tensor ``source`` from its row ``source_row``, to the saved tensor's
    row ``row`` (leading axes flattened into rows)."""

    source: str
    source_row: int
    row: int
    rows: int


@dataclass(frozen=True)
class SavedTensor:
    """A tensor the trainer's checkpoint holds: its name, full shape and where its rows come from; rows
    no fill covers are zero (padding)."""

    name: str
    shape: Shape
    fills: tuple[Fill, ...]
    rule: str  # where the rule is written: FILE:LINE
    stacked: int = 0  # how many leading axes stack tensors (layers, experts)


@dataclass(frozen=True)
class Inverted:
    """The saved tensors for a set of Hugging Face tensors, and the Hugging Face names a ``drop`` rule
    left out (a tied ``lm_head``)."""

    saved: tuple[SavedTensor, ...]
    dropped: tuple[str, ...] = ()


@dataclass
class _Claims:
    """The Hugging Face tensors one rule claimed for one saved name: (unbind indices, part) → name."""

    rule: Rule
    source: str
    names: dict[tuple[tuple[int, ...], int], str] = field(default_factory=dict)


def _target_pattern(rule: Rule, config: Mapping[str, object]) -> tuple[re.Pattern[str], list[tuple[str, int]], list[str]]:
    """The rule's target as a regular expression; its fields with the offset each adds; its ``{a|b}`` parts."""
    assert rule.target is not None
    parts, fields, position = [], [], 0
    choices: list[str] = []
    for found in _FIELD.finditer(rule.target):
        parts.append(re.escape(rule.target[position : found.start()]))
        if found.group(3) is not None:
            choices = found.group(3).split("|")
            parts.append("(?P<_part>" + "|".join(re.escape(c) for c in choices) + ")")
        else:
            name, offset = found.group(1), found.group(2)
            extra = 0 if offset is None else evaluate_text(offset, config, rule.where)
            if not isinstance(extra, int):
                raise InputError(f"{rule.where}: {offset!r} is a list, not a number")
            fields.append((name, extra))
            parts.append(f"(?P<{name}>[0-9]+)")
        position = found.end()
    parts.append(re.escape(rule.target[position:]))
    return re.compile("".join(parts)), fields, choices


@dataclass(frozen=True)
class SavedForm:
    """How the trainer saved what the rules allow two ways: ``keyed``, the ``[X]`` fields saved one key
    per index rather than stacked (``{"N"}``: layers that differ, one key per layer); ``unsaved``, the
    endings of saved names the trainer's build does not write (a layer spec's fused norm names)."""

    keyed: frozenset[str] = frozenset()
    unsaved: tuple[str, ...] = ()
    #: Whole saved names the trainer does not write (a norm fused in some layers, separate in others).
    unsaved_names: frozenset[str] = frozenset()

    def writes(self, name: str) -> bool:
        return not name.endswith(self.unsaved) and name not in self.unsaved_names


def _invertible(rule: Rule, config: Mapping[str, object], form: SavedForm) -> bool:
    """Whether the rule can name a saved tensor from a Hugging Face name: a target, no wildcard in the
    source, its condition holding, in the trainer's saved form."""
    if rule.target is None or rule.skip or "*" in rule.source or not rule.applies(config):
        return False
    return not form.keyed.intersection(rule.unbound)


def _source_name(rule: Rule, captures: Mapping[str, int]) -> str:
    return re.sub(r"\{([A-Za-z_]\w*)\}", lambda m: str(captures[m.group(1)]), rule.source)


def _claim(
    names: Mapping[str, Shape], rules: RuleSet, config: Mapping[str, object], form: SavedForm
) -> tuple[list[_Claims], list[str]]:
    """Each Hugging Face name claimed by the first rule whose target matches it, grouped by saved name."""
    patterns = [(rule, *_target_pattern(rule, config)) for rule in rules.rules if _invertible(rule, config, form)]
    groups: dict[tuple[int, str], _Claims] = {}
    dropped, unclaimed = [], []
    for hf in names:
        for number, (rule, pattern, fields, choices) in enumerate(patterns):
            found = pattern.fullmatch(hf)
            if found is None:
                continue
            values = {name: int(found.group(name)) - extra for name, extra in fields}
            if any(v < 0 for v in values.values()):
                continue
            if rule.kind == "drop":
                dropped.append(hf)
                break
            unbound = rule.unbound
            source = _source_name(rule, {k: v for k, v in values.items() if k not in unbound})
            if not form.writes(source):
                continue
            claims = groups.setdefault((number, source), _Claims(rule, source))
            part = choices.index(found.group("_part")) if choices else 0
            claims.names[(tuple(values[f] for f in unbound), part)] = hf
            break
        else:
            unclaimed.append(hf)
    if unclaimed:
        shown = ", ".join(repr(n) for n in unclaimed[:5]) + (f" and {len(unclaimed) - 5} more" if len(unclaimed) > 5 else "")
        raise InputError(f"adapter {rules.origin}: no rule gives {shown}: the model is not of this family, or a rule is missing")
    return [groups[key] for key in sorted(groups)], dropped


def _counts(claims: _Claims, parts: int) -> tuple[int, ...]:
    """How many indices each unbind has (every one from 0 there, with every part); bad input otherwise."""
    fields = claims.rule.unbound
    counts = tuple(max(index[i] for index, _ in claims.names) + 1 for i in range(len(fields)))
    for indices in itertools.product(*(range(c) for c in counts)):
        for part in range(parts):
            if (indices, part) not in claims.names:
                where = ", ".join(f"{f}={i}" for f, i in zip(fields, indices))
                seen = next(iter(claims.names.values()))
                raise InputError(
                    f"{claims.rule.where}: {claims.source!r} needs a Hugging Face tensor for {where or 'it'}"
                    f"{f' (part {part + 1} of {parts})' if parts > 1 else ''} like {seen!r}, and the model has "
                    "none: is it complete?"
                )
    return counts


def invert(
    shapes: Mapping[str, Shape],
    rules: RuleSet,
    config: Mapping[str, object],
    padded: Callable[[int], int] = lambda rows: rows,
    form: SavedForm = SavedForm(),
) -> Inverted:
    """The saved tensors that ``rules`` map to the Hugging Face tensors ``shapes`` (name → shape), with
    ``config`` (its defaults filled in); ``padded(k)``: the rows a ``crop_rows(k)`` tensor is saved with.
    ``form``: which of the names the rules allow the trainer writes. Every name must be claimed by a rule;
    the first problem is an :class:`InputError` naming the rule's line."""
    config = rules.config_with_defaults(config)
    groups, dropped = _claim(shapes, rules, config, form)
    saved = [_saved(claims, shapes, config, padded) for claims in groups]
    twice = sorted(name for name, count in Counter(t.name for t in saved).items() if count > 1)
    if twice:
        raise InputError(f"adapter {rules.origin}: {twice[0]!r} would be filled by two rules: a rule file's targets overlap")
    return Inverted(tuple(saved), tuple(dropped))


def _saved(
    claims: _Claims, shapes: Mapping[str, Shape], config: Mapping[str, object], padded: Callable[[int], int]
) -> SavedTensor:
    """One saved tensor: the rule's chain undone over the Hugging Face tensors it claimed."""
    rule = claims.rule
    tail = [step for step in rule.steps if step.kind != "unbind"]
    split = tail[-1] if tail and tail[-1].kind == "split_rows" else None
    crop = tail[0] if tail and tail[0].kind == "crop_rows" else None
    if len(tail) != (split is not None) + (crop is not None) or any(s.kind == "unbind" for s in rule.steps[len(rule.unbound) :]):
        raise InputError(f"{rule.where}: {rule.kind} has no inverse yet (unbind, crop_rows, split_rows have)")
    sizes: tuple[int, ...] = (0,)
    groups = 1
    if split is not None:
        groups = _number(split.value("groups", config, rule.where), rule)
        value = split.value("sizes", config, rule.where)
        sizes = (value,) if isinstance(value, int) else value
    parts = len(sizes) if split is not None else 1
    counts = _counts(claims, parts)
    first = next(iter(claims.names.values()))
    if not shapes[first]:
        raise InputError(f"{rule.where}: {first!r} is a scalar: a saved tensor is made of rows")
    rest = shapes[first][1:]
    if split is None:
        sizes = (shapes[first][0],)
    for (_, part), hf in claims.names.items():
        expected = (groups * sizes[part], *rest)
        if tuple(shapes[hf]) != expected:
            raise InputError(f"{rule.where}: {hf!r} has shape {list(shapes[hf])}; {claims.source!r} needs {list(expected)} there")
    kept = groups * sum(sizes)
    if crop is not None:
        wanted = _number(crop.value("rows", config, rule.where), rule)
        if wanted != kept:
            raise InputError(f"{rule.where}: {first!r} has {kept} rows; crop_rows keeps {wanted} (check the config's sizes)")
        rows = padded(kept)
    else:
        rows = kept
    fills = []
    for stack, indices in enumerate(itertools.product(*(range(c) for c in counts))):
        offset = 0
        for group in range(groups):
            for part, size in enumerate(sizes):
                fills.append(Fill(claims.names[(indices, part)], group * size, stack * rows + offset, size))
                offset += size
    return SavedTensor(claims.source, (*counts, rows, *rest), tuple(fills), rule.where, len(counts))


def _number(value: int | tuple[int, ...], rule: Rule) -> int:
    if not isinstance(value, int) or value <= 0:
        raise InputError(f"{rule.where}: {value!r}: a positive number of rows")
    return value
