"""A model adapter applied to the pieces: renames, per-expert slices, fused splits and rotary row
orders as geometry, so converted tensors are assembled like any other (no whole-tensor buffer).

:func:`plan_conversion` is per tensor and the same on every rank: which rule each saved tensor
matches and what Hugging Face tensors it becomes (:class:`Conversion`). :func:`convert_pieces` then
re-expresses one rank's pieces in the outputs' coordinates, with numpy over the pieces of each
tensor at once:

- ``unbind``: index ``e`` of dim 0 of a piece is the contiguous bytes of expert ``e``; the piece is
  cut per index it crosses and loses dim 0.
- ``crop_rows``: the rows of dim 0 past the kept ones are cut off the pieces' ends (pieces wholly
  past them are gone).
- ``split_rows``: a fused tensor's rows are, group by group, the parts' rows; a piece is cut at every
  (group, part) boundary it crosses, each cut a contiguous run of rows of one part.
- ``rope_to_half`` / ``rope_to_interleaved``: dim 0 is viewed as (heads, a, b) and the output has the
  last two swapped. Pieces are cut into boxes of that view (at most five each); the output tensor
  keeps the view as its storage and the swap as its ``axes``, which the engine follows when it
  places rows (one run per row of ``in_features`` units). Dim 0, the heads, stays dim 0, so the work
  split and coverage checks are unchanged.

A rule's chain (``unbind(N) | unbind(E) | split_rows(...)``) applies these in turn: each step maps a
piece of an intermediate tensor to pieces of the next ones, numbered ``index · fan-out + k``, so the
last step's numbers are the outputs' :attr:`Output.index`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import InputError
from ..core.layout import View
from ..core.reports import count_of
from ..core.table import Pieces
from .hints import mostly_written_by
from .rules import Rule, RuleSet, Transform, target_names


@dataclass(frozen=True)
class Output:
    """One Hugging Face tensor the conversion writes.

    ``storage`` is its shape in the pieces' coordinates (storage units); ``view`` is set when those
    coordinates are not the header's (rotary row orders).
    """

    name: str
    source: int  # the saved tensor's id
    kind: str  # rename, or the rule's chain: unbind, split_rows, ..., unbind | split_rows
    storage: tuple[int, ...]
    rule: str  # where the rule is: FILE:LINE
    index: int = 0  # its number among the source's outputs (the chain's indices, row-major)
    view: View | None = None


@dataclass(frozen=True)
class Step:
    """One transform of a chain with its numbers: unbind (rows), crop_rows (kept rows),
    split_rows (groups, *sizes), rope_to_half / rope_to_interleaved (heads, a, b)."""

    kind: str
    params: tuple[int, ...]


@dataclass(frozen=True)
class Dropped:
    """A saved tensor not written: a model entry the rules drop on purpose, or state they skip."""

    name: str
    hf_name: str | None  # the Hugging Face name it would have had (drop), None when it has none
    rule: str
    skipped: bool = False  # a ``skip`` pattern (not model state) rather than a ``drop``
    pattern: str = ""
    #: ``drop(same_as=NAME)``: the saved tensor it repeats (a tied ``lm_head``: the embeddings).
    same_as: str | None = None
    #: The rule's condition as it held (``tie_word_embeddings is true``), "" without one.
    because: str = ""


@dataclass(frozen=True)
class Conversion:
    """Every saved tensor's fate under one rule set: the outputs (sorted by name) and what is left out."""

    rules: str  # the rule set's origin
    outputs: tuple[Output, ...]
    dropped: tuple[Dropped, ...] = ()
    #: The steps of each source that is not a rename, with their numbers.
    steps: Mapping[int, tuple[Step, ...]] = field(default_factory=dict)
    #: Dropped entries found to hold what the model loses (their values read): name → the warning.
    warnings: Mapping[str, str] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def views(self) -> dict[int, View]:
        return {t: o.view for t, o in enumerate(self.outputs) if o.view is not None}

    def dropped_names(self) -> set[str]:
        """Hugging Face names left out on purpose (an assets index may list them: a tied ``lm_head``)."""
        return {d.hf_name for d in self.dropped if d.hf_name is not None}

    def skipped_counts(self) -> dict[str, int]:
        """Per ``skip`` pattern, how many saved tensors it left out."""
        counts: dict[str, int] = {}
        for d in self.dropped:
            if d.skipped:
                counts[d.pattern] = counts.get(d.pattern, 0) + 1
        return counts

    def summary(self) -> list[str]:
        """Lines for the run's report: what was skipped (per pattern) and every entry dropped on purpose
        (not those in :attr:`warnings`, which hold what the model loses)."""
        lines = [
            f"skipped {count_of(n, 'saved tensor')} matching {pattern} (not model state)"
            for pattern, n in self.skipped_counts().items()
        ]
        for d in self.dropped:
            if not d.skipped and d.name not in self.warnings:
                hf = f" (Hugging Face {d.hf_name})" if d.hf_name else ""
                lines.append(f"dropped {d.name}{hf}: rule {d.rule}")
        return lines


def _unknown_message(unknown: Sequence[str], rules: RuleSet) -> str:
    shown = ", ".join(repr(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    first = unknown[0]
    if mostly_written_by(rules, unknown):
        return (
            f"adapter {rules.origin}: no rule reads {count_of(len(unknown), 'saved tensor')} ({shown}), and they are the "
            "names these rules write: the checkpoint is in Hugging Face's names already. Drop --adapter "
            "(keep --hf-assets to publish the model's files with it)"
        )
    return (
        f"adapter {rules.origin}: no rule for {count_of(len(unknown), 'saved tensor')}: {shown}. Leave it out "
        f"deliberately with --exclude {first!r} (a glob: --exclude '{first.rsplit('.', 1)[0]}.*'), or add a rule for it"
    )


def plan_conversion(
    names: Sequence[str],
    storage: Sequence[tuple[int, ...]],
    sub_byte: Sequence[bool],
    rules: RuleSet,
    config: Mapping[str, object],
) -> Conversion:
    """The outputs of the saved tensors ``names`` (shapes ``storage`` in storage units, unpadded; whether
    each dtype is sub-byte) under ``rules`` and ``config`` (its defaults filled in). Pure; the first
    problem is an :class:`InputError` naming the tensor and the rule's line."""
    config = rules.config_with_defaults(config)
    outputs: list[Output] = []
    dropped: list[Dropped] = []
    unknown: list[str] = []
    steps: dict[int, tuple[Step, ...]] = {}
    for t, name in enumerate(names):
        found = rules.match(name, config)
        if found is None:
            unknown.append(name)
            continue
        rule, captures = found
        where = rules.where(rule)
        if rule.skip:
            dropped.append(Dropped(name, None, where, skipped=True, pattern=rule.source))
            continue
        hf = None if rule.target is None else target_names(rule, captures, config, where)
        if rule.kind == "drop":
            because = f"config.json's {rule.condition} is {'false' if rule.negated else 'true'}" if rule.condition else ""
            same_as = rule.steps[0].name_arg("same_as")
            dropped.append(Dropped(name, hf[0] if hf else None, where, same_as=same_as, because=because))
            continue
        chain, shapes, view = _chain(name, tuple(storage[t]), sub_byte[t], rule, config, where)
        if chain:
            steps[t] = chain
        outputs += _outputs(t, rule, captures, chain, shapes, view, config, where)
    if unknown:
        raise InputError(_unknown_message(unknown, rules))
    outputs.sort(key=lambda o: o.name)
    for a, b in zip(outputs, outputs[1:]):
        if a.name == b.name:
            raise InputError(
                f"adapter {rules.origin}: {names[a.source]!r} (rule {a.rule}) and {names[b.source]!r} (rule {b.rule}) "
                f"would both be {a.name!r}"
            )
    if not outputs:
        raise InputError(f"adapter {rules.origin}: the rules leave none of the {count_of(len(names), 'saved tensor')}")
    return Conversion(rules.origin, tuple(outputs), tuple(dropped), steps)


def _chain(
    name: str, storage: tuple[int, ...], sub_byte: bool, rule: Rule, config: Mapping[str, object], where: str
) -> tuple[tuple[Step, ...], list[tuple[int, ...]], View | None]:
    """A rule's steps with their numbers for one saved tensor, checked against its shape; the shapes of
    the last step's outputs (one per part, in storage units) and the view a rotary order leaves."""
    steps: list[Step] = []
    shape = storage
    for transform in rule.steps:
        kind = transform.kind
        shape_text = f"{name!r} (shape {list(shape)}{f' after {steps[-1].kind}' if steps else ''})"
        if not shape:
            raise InputError(f"{where}: {kind} of {shape_text}: a scalar has no dim 0")
        rows, rest = shape[0], shape[1:]
        if sub_byte and not rest:
            raise InputError(f"{where}: {kind} of {shape_text}: a 1-d sub-byte tensor cannot be cut by elements")
        if kind == "unbind":
            if not rest:
                raise InputError(f"{where}: unbind of {shape_text}: one-dimensional, its entries are not tensors")
            steps.append(Step(kind, (rows,)))
            shape = rest
        elif kind == "crop_rows":
            kept = transform.value("rows", config, where)
            if not isinstance(kept, int) or not 0 < kept <= rows:
                raise InputError(
                    f"{where}: crop_rows({kept!r}) of {shape_text}: keeps 1 to {rows} rows (check the config's sizes)"
                )
            steps.append(Step(kind, (kept,)))
            shape = (kept, *rest)
        elif kind == "split_rows":
            step = _split_step(transform, rows, shape_text, config, where)
            steps.append(step)
            return tuple(steps), [(step.params[0] * size, *rest) for size in step.params[1:]], None
        else:
            step, coords = _rope_step(transform, shape, shape_text, config, where)
            steps.append(step)
            axes = (0, 2, 1, *range(3, len(coords)))
            return tuple(steps), [coords], View(shape, axes)
    return tuple(steps), [shape], None


def _split_step(transform: Transform, rows: int, shape_text: str, config: Mapping[str, object], where: str) -> Step:
    groups = transform.value("groups", config, where)
    sizes = transform.value("sizes", config, where)
    if not isinstance(groups, int) or groups <= 0:
        raise InputError(f"{where}: split_rows groups={groups!r}: a positive number")
    if isinstance(sizes, int):
        sizes = (sizes,)
    if not sizes or any(s <= 0 for s in sizes):
        raise InputError(f"{where}: split_rows sizes={list(sizes)}: positive numbers of rows per group")
    if groups * sum(sizes) != rows:
        raise InputError(
            f"{where}: split_rows of {shape_text}: {groups} groups of {'+'.join(map(str, sizes))} rows is "
            f"{groups * sum(sizes)} rows, not {rows} (check the config's head counts)"
        )
    return Step("split_rows", (groups, *sizes))


def _rope_step(
    transform: Transform, shape: tuple[int, ...], shape_text: str, config: Mapping[str, object], where: str
) -> tuple[Step, tuple[int, ...]]:
    kind, rows, rest = transform.kind, shape[0], shape[1:]
    heads = transform.value("heads", config, where)
    head_dim = transform.value("head_dim", config, where)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or heads <= 0 or head_dim <= 0 or head_dim % 2:
        raise InputError(f"{where}: {kind} needs positive heads and an even head_dim (got {heads!r}, {head_dim!r})")
    if heads * head_dim != rows:
        raise InputError(
            f"{where}: {kind} of {shape_text}: {heads} heads of {head_dim} rows is {heads * head_dim} rows, not {rows} "
            f"(check num_attention_heads, num_key_value_heads and head_dim in config.json)"
        )
    a, b = (head_dim // 2, 2) if kind == "rope_to_half" else (2, head_dim // 2)
    return Step(kind, (heads, a, b)), (heads, a, b, *(rest or (1,)))


def _outputs(
    t: int,
    rule: Rule,
    captures: Mapping[str, str],
    chain: tuple[Step, ...],
    shapes: list[tuple[int, ...]],
    view: View | None,
    config: Mapping[str, object],
    where: str,
) -> list[Output]:
    """One output per combination of the unbind indices and per part, numbered as the pieces will be."""
    counts = [step.params[0] for step in chain if step.kind == "unbind"]
    fields = rule.unbound
    outputs = []
    for number, indices in enumerate(itertools.product(*(range(c) for c in counts))):
        filled = {**captures, **{f: str(i) for f, i in zip(fields, indices)}}
        names = target_names(rule, filled, config, where)
        if len(names) != len(shapes):
            raise InputError(f"{where}: split_rows has {len(shapes)} sizes for {len(names)} target names")
        for part, (hf, shape) in enumerate(zip(names, shapes)):
            outputs.append(Output(hf, t, rule.kind, shape, where, number * len(shapes) + part, view))
    return outputs


# ---------------------------------------------------------------- pieces in the outputs' coordinates


def _unit_bytes(pieces: Pieces, bits_of: Callable[[int], int]) -> np.ndarray:
    bits = np.array([bits_of(int(d)) for d in range(int(pieces.dtype.max()) + 1)] if len(pieces) else [8], dtype=np.int64)
    per = bits[pieces.dtype.astype(np.int64)] if len(pieces) else np.zeros(0, dtype=np.int64)
    return np.where(per % 8 == 0, per // 8, 1)


def _unbind(p: Pieces, unit: np.ndarray, rows: int) -> Pieces:
    """Each piece cut per index of dim 0 it holds, less dim 0; intermediate ``i`` becomes ``i·rows + index``."""
    count = p.shape[:, 0]
    rep = np.repeat(np.arange(len(p)), count)
    step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    index = p.tensor[rep].astype(np.int64) * rows + p.offset[rep, 0] + step
    width = p.width
    shape = np.ones((len(rep), width), dtype=np.int64)
    offset = np.zeros((len(rep), width), dtype=np.int64)
    shape[:, : width - 1] = p.shape[rep, 1:]
    offset[:, : width - 1] = p.offset[rep, 1:]
    strides = p.strides()[rep]
    begin = p.begin[rep] + step * strides[:, 0] * unit[rep]
    ndim = (p.ndim[rep] - 1).astype(p.ndim.dtype)
    stride = None
    if p.stride is not None:  # a view keeps its strides, less dim 0
        stride = np.ones((len(rep), width), dtype=np.int64)
        stride[:, : width - 1] = strides[:, 1:]
    return Pieces(index, p.file[rep], p.dtype[rep], ndim, shape, offset, begin, p.holder[rep], stride)


def _crop_rows(p: Pieces, kept: int) -> Pieces:
    """The pieces' rows below ``kept`` only: a piece's rows are cut off its end (its start is unchanged)."""
    p = p.take(np.flatnonzero(p.offset[:, 0] < kept))
    shape = p.shape.copy()
    shape[:, 0] = np.minimum(shape[:, 0], kept - p.offset[:, 0])
    return Pieces(p.tensor, p.file, p.dtype, p.ndim, shape, p.offset, p.begin, p.holder, p.stride)


def _split_rows(p: Pieces, unit: np.ndarray, groups: int, sizes: Sequence[int]) -> Pieces:
    """Each piece cut at the (group, part) boundaries it crosses; intermediate ``i`` becomes ``i·parts + part``."""
    per_group = sum(sizes)
    starts_in_group = np.cumsum([0, *sizes[:-1]])
    parts = len(sizes)
    # Interval q = g * parts + k holds rows [g * per_group + starts[k], + sizes[k]) of part k.
    interval_start = (np.arange(groups)[:, None] * per_group + starts_in_group[None, :]).ravel()
    interval_size = np.tile(np.array(sizes, dtype=np.int64), groups)
    low, high = p.offset[:, 0], p.offset[:, 0] + p.shape[:, 0]
    nonempty = high > low
    first = np.searchsorted(interval_start, low, side="right") - 1
    last = np.searchsorted(interval_start, np.maximum(high - 1, low), side="right") - 1
    count = np.where(nonempty, last - first + 1, 0)
    rep = np.repeat(np.arange(len(p)), count)
    q = np.repeat(first, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    lo = np.maximum(low[rep], interval_start[q])
    hi = np.minimum(high[rep], interval_start[q] + interval_size[q])
    group, part = q // parts, q % parts
    shape = p.shape[rep].copy()
    offset = p.offset[rep].copy()
    shape[:, 0] = hi - lo
    offset[:, 0] = group * np.array(sizes, dtype=np.int64)[part] + (lo - interval_start[q])
    strides = p.strides()[rep]
    begin = p.begin[rep] + (lo - low[rep]) * strides[:, 0] * unit[rep]
    stride = None if p.stride is None else strides
    index = p.tensor[rep].astype(np.int64) * parts + part
    return Pieces(index, p.file[rep], p.dtype[rep], p.ndim[rep], shape, offset, begin, p.holder[rep], stride)


def _rope(p: Pieces, unit: np.ndarray, heads: int, a: int, b: int, width: int) -> Pieces:
    """Row ranges cut into boxes of the (heads, a, b) view of dim 0: at most five per piece."""
    per_head = a * b
    r0, r1 = p.offset[:, 0], p.offset[:, 0] + p.shape[:, 0]
    up = lambda x, m: -(-x // m) * m  # noqa: E731
    p1 = np.minimum(r1, up(r0, b))
    p2 = np.maximum(p1, np.minimum(up(p1, per_head), r1 // b * b))  # whole b-runs only: a partial last run is box 4
    p3 = np.maximum(p2, r1 // per_head * per_head)
    p4 = np.maximum(p3, r1 // b * b)
    bounds = [r0, p1, p2, p3, p4, r1]
    strides = p.strides()
    row_bytes = strides[:, 0] * unit
    boxes = []
    for k in range(5):
        lo, hi = bounds[k], bounds[k + 1]
        keep = np.flatnonzero(hi > lo)
        if not len(keep):
            continue
        lo, hi = lo[keep], hi[keep]
        n = len(keep)
        dims = np.empty((n, 3), dtype=np.int64)
        offs = np.empty((n, 3), dtype=np.int64)
        offs[:, 0] = lo // per_head
        offs[:, 1] = (lo % per_head) // b
        offs[:, 2] = lo % b if k in (0, 4) else 0
        if k in (0, 4):  # within one (head, a) row pair: along b
            dims[:] = np.stack([np.ones(n, np.int64), np.ones(n, np.int64), hi - lo], axis=1)
        elif k == 2:  # whole heads
            dims[:] = np.stack([(hi - lo) // per_head, np.full(n, a), np.full(n, b)], axis=1)
        else:  # whole b-runs inside one head
            dims[:] = np.stack([np.ones(n, np.int64), (hi - lo) // b, np.full(n, b)], axis=1)
        shape = np.ones((n, width), dtype=np.int64)
        offset = np.zeros((n, width), dtype=np.int64)
        shape[:, :3], offset[:, :3] = dims, offs
        inner = min(width - 3, p.width - 1)  # beyond the saved rank, the columns are padding
        shape[:, 3 : 3 + inner] = p.shape[keep, 1 : 1 + inner]
        offset[:, 3 : 3 + inner] = p.offset[keep, 1 : 1 + inner]
        begin = p.begin[keep] + (lo - r0[keep]) * row_bytes[keep]
        stride = None
        if p.stride is not None:  # rows h·a·b + i·b + j apart in the view's three dims, the rest as saved
            stride = np.ones((n, width), dtype=np.int64)
            row = strides[keep, 0]
            stride[:, 0], stride[:, 1], stride[:, 2] = row * a * b, row * b, row
            stride[:, 3 : 3 + inner] = strides[keep, 1 : 1 + inner]
        ndim = (3 + np.maximum(1, p.ndim[keep].astype(np.int64) - 1)).astype(p.ndim.dtype)
        boxes.append(Pieces(p.tensor[keep], p.file[keep], p.dtype[keep], ndim, shape, offset, begin, p.holder[keep], stride))
    return Pieces.concat(boxes, width)


def converted_width(conversion: Conversion, width: int) -> int:
    """The piece table's width after the conversion (a rotary view adds two dims to a tensor)."""
    return max([width] + [len(o.storage) for o in conversion.outputs])


def convert_pieces(pieces: Pieces, conversion: Conversion, bits_of: Callable[[int], int]) -> Pieces:
    """This rank's pieces (saved tensor ids) in the outputs' coordinates and ids. Pieces of tensors
    the conversion leaves out are gone. ``bits_of(dtype_code)`` is the dtype's size in bits."""
    width = converted_width(conversion, pieces.width)
    by_source: dict[int, list[tuple[int, Output]]] = {}
    for t, o in enumerate(conversion.outputs):
        by_source.setdefault(o.source, []).append((t, o))
    order = np.argsort(pieces.tensor, kind="stable")
    sorted_tensor = pieces.tensor[order]
    result = []
    for source, outs in by_source.items():
        lo, hi = np.searchsorted(sorted_tensor, [source, source + 1])
        if hi == lo:
            continue
        p = pieces.take(order[lo:hi])
        p.tensor = np.zeros(len(p), dtype=np.int64)  # the saved tensor: intermediate 0
        for step in conversion.steps.get(source, ()):
            p = _apply(step, p, _unit_bytes(p, bits_of), width)
        ids = np.empty(len(outs), dtype=np.int32)
        for t, o in outs:
            ids[o.index] = t
        p.tensor = ids[p.tensor]
        result.append(p)
    return Pieces.concat(result, width)


def _apply(step: Step, p: Pieces, unit: np.ndarray, width: int) -> Pieces:
    if step.kind == "unbind":
        return _unbind(p, unit, step.params[0])
    if step.kind == "crop_rows":
        return _crop_rows(p, step.params[0])
    if step.kind == "split_rows":
        return _split_rows(p, unit, step.params[0], step.params[1:])
    heads, a, b = step.params
    return _rope(p, unit, heads, a, b, width)


def converted_declared(conversion: Conversion, width: int) -> np.ndarray:
    """The outputs' full shapes in the pieces' coordinates, padded to ``width`` (DCP's declared shapes)."""
    declared = np.ones((len(conversion.outputs), width), dtype=np.int64)
    for t, o in enumerate(conversion.outputs):
        declared[t, : len(o.storage)] = o.storage
    return declared


def converted_order(conversion: Conversion, order: np.ndarray | None) -> np.ndarray | None:
    """The outputs' positions in the saved state dict (a source's outputs together, in their own order)."""
    if order is None:
        return None
    keys = np.array([int(order[o.source]) for o in conversion.outputs], dtype=np.int64)
    sub = np.array([o.index for o in conversion.outputs], dtype=np.int64)
    ranked = np.lexsort((sub, keys))
    result = np.empty(len(ranked), dtype=np.int64)
    result[ranked] = np.arange(len(ranked))
    return result


__all__ = [
    "Output",
    "Step",
    "Dropped",
    "Conversion",
    "plan_conversion",
    "convert_pieces",
    "converted_width",
    "converted_declared",
    "converted_order",
]
