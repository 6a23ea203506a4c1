"""What an adapter's dropped entries hold: read before the conversion leaves them out, so that an entry
that carries information (a routing bias that is not zero, a tied ``lm_head`` that differs from the
embeddings) is a warning naming it rather than a line saying it was dropped on purpose.

An entry dropped as the repeat of another saved tensor (``drop(same_as=NAME)``) is compared with it;
any other dropped entry is looked at for values that are not zero. The reading is the engine's, as
``verify`` does it: each rank takes an even share of the rows (the same rows of both tensors of a
pair, in chunks that alternate between the two, so it holds at most one chunk), assembled block by
block from the shards or through the exchange. The counts are summed over the ranks, so every rank
reports the same. Cost: the bytes of the entries checked (a bias is a few hundred bytes; a head and
embeddings twice the embeddings), read once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..adaptation.apply import Conversion, Dropped
from ..comm.agreement import Comm, agree
from ..core.blocks import Block, block_budget, segment_bytes, segment_offset
from ..core.errors import InputError
from ..core.layout import Layout, WorkItem
from ..core.planner import HF_MAX_SHARD_SIZE, build_layout
from ..core.problems import Problems
from ..core.reports import count_of
from ..core.runs import check_saved_views
from ..core.safetensors_codec import DTYPE_BY_NAME
from .exchange import feed_blocks
from .scan import Scanned, open_sources, shapes_and_dtypes
from .shares import distribute, only

#: Dtypes whose zero may be negative (the sign bit alone set): -0.0 holds nothing either.
_SIGNED_ZERO = {"F64", "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2"}


@dataclass(frozen=True)
class _Check:
    """One dropped entry to look at: its number in the sub-scan, and its partner's (``same_as``) or None."""

    dropped: Dropped
    tensor: int
    partner: int | None = None


def dropped_warnings(comm: Comm, scanned: Scanned, conversion: Conversion, buffer_size: int) -> dict[str, str]:
    """Per dropped entry of ``conversion`` that carries information, the warning that names it (collective;
    the same on every rank). ``scanned``: the saved tensors, before the conversion; it is left as it is."""
    index = {name: t for t, name in enumerate(scanned.names)}
    shapes, dtypes = shapes_and_dtypes(scanned)
    warnings: dict[str, str] = {}
    wanted: list[tuple[Dropped, int, int | None]] = []
    dropped = {d.name for d in conversion.dropped}  # a partner left out too is no stand-in: the entry alone counts
    for d in conversion.dropped:
        if d.skipped or d.name not in index:
            continue
        t = index[d.name]
        partner = index.get(d.same_as) if d.same_as is not None and d.same_as not in dropped else None
        if partner is not None and (shapes[t], dtypes[t]) != (shapes[partner], dtypes[partner]):
            warnings[d.name] = _unlike(d, f"{dtypes[t]}{list(shapes[t])}", f"{dtypes[partner]}{list(shapes[partner])}")
        elif int(np.prod(shapes[t], dtype=np.int64)):
            wanted.append((d, t, partner))
    if not wanted:
        return warnings
    tensors = sorted({t for _, t, _ in wanted} | {p for _, _, p in wanted if p is not None})
    number = {t: i for i, t in enumerate(tensors)}
    checks = [_Check(d, number[t], None if p is None else number[p]) for d, t, p in wanted]
    counts, totals, unchecked = _count(comm, only(scanned, tensors), checks, buffer_size)
    for check, count, total in zip(checks, counts, totals):
        d = check.dropped
        if d.name in unchecked:
            warnings[d.name] = f"dropped {d.name} (rule {d.rule}) could not be checked for what it holds: {unchecked[d.name]}"
        elif count:
            warnings[d.name] = _differs(d, count, total) if check.partner is not None else _not_zero(d, count, total)
    return warnings


def _count(comm: Comm, sub: Scanned, checks: Sequence[_Check], buffer_size: int) -> tuple[list[int], list[str], dict[str, str]]:
    """Per check, the elements that differ from the partner (or are not zero) and the elements looked at,
    summed over the ranks; and the entries that could not be read as a whole (name → why)."""
    problems = Problems(strict=False)
    layout = agree(
        comm,
        lambda: build_layout(sub.files, sub.names, sub.facts, comm.size, max_shard_size=HF_MAX_SHARD_SIZE, problems=problems),
    )
    chunk = block_budget(buffer_size, 4)
    layout.work = _shares(layout, checks, comm.size, chunk)
    part = distribute(comm, sub, layout, problems)
    broken = {t: p.message for t, p in problems.by_tensor.items()}
    try:
        agree(comm, lambda: check_saved_views(layout, part, chunk))
    except InputError as exc:  # agreed: every rank is here
        broken.update({t: str(exc) for t in range(len(sub.names))})
    unchecked: dict[str, str] = {}
    for c in checks:  # an entry whose partner cannot be read is not checked either
        reason = broken.get(c.tensor) or (broken.get(c.partner) if c.partner is not None else None)
        if reason is not None:
            unchecked[sub.names[c.tensor]] = reason
    readable = [c for c in checks if sub.names[c.tensor] not in unchecked]
    keep = {c.tensor for c in readable} | {c.partner for c in readable if c.partner is not None}
    part.items = [item for item in part.items if item.tensor in keep]
    tally = _Tally(layout, readable, chunk)
    sources = open_sources(sub)
    try:
        agree(comm, lambda: feed_blocks(comm, sub, layout, part, sources, buffer_size, tally), collective=True)
    finally:
        sources.close()
    comm.allreduce_array(tally.counts, "sum")
    totals = [_elements(layout, c.tensor) for c in checks]
    return [int(tally.counts[c.tensor]) for c in checks], totals, unchecked


def _elements(layout: Layout, t: int) -> str:
    """A tensor's size in the units compared: elements, or bytes for a sub-byte dtype."""
    tensor = layout.tensors[t]
    whole = tensor.unit * 8 == DTYPE_BY_NAME[tensor.dtype].bits
    return count_of(int(np.prod(tensor.storage, dtype=np.int64)), "element" if whole else "byte")


def _shares(layout: Layout, checks: Sequence[_Check], ranks: int, chunk: int) -> list[list[WorkItem]]:
    """Each checked tensor's rows split evenly over the ranks, a pair's two tensors alike; a rank's rows of
    a pair cut at whole multiples of ``chunk`` bytes' rows, the partner's first in each (then every entry
    that repeats it), so that a rank holds one chunk of the partner at a time."""
    groups: dict[int, list[int]] = {}  # the first tensor of each group (a partner, or a lone entry) → the group
    for check in checks:
        if check.partner is None:
            groups[check.tensor] = [check.tensor]
        else:
            groups.setdefault(check.partner, [check.partner]).append(check.tensor)
    work: list[list[WorkItem]] = [[] for _ in range(ranks)]
    for first, group in groups.items():
        rows, step = layout.tensors[first].rows, _chunk_rows(layout, first, chunk)
        for rank in range(ranks):
            low, high = rows * rank // ranks, rows * (rank + 1) // ranks
            cuts = sorted({low, high} | set(range(-(-low // step) * step, high, step)))
            work[rank] += [WorkItem(t, begin, end) for begin, end in zip(cuts, cuts[1:]) for t in group]
    return work


def _chunk_rows(layout: Layout, t: int, chunk: int) -> int:
    return max(1, chunk // max(1, layout.tensors[t].row_bytes))


class _Tally:
    """The sink of the assembled blocks: per checked tensor, the elements that differ from its partner's
    (the partner's chunk is held until the entries that repeat it have been compared) or that are not zero."""

    def __init__(self, layout: Layout, checks: Sequence[_Check], chunk: int) -> None:
        self.layout = layout
        self.counts = np.zeros(len(layout.tensors), dtype=np.int64)
        self.partner = {c.tensor: c.partner for c in checks if c.partner is not None}
        partners = set(self.partner.values())
        self.chunk = {t: _chunk_rows(layout, t, chunk) * layout.tensors[t].row_bytes for t in partners}
        self.held = {t: np.empty(self.chunk[t], dtype=np.uint8) for t in partners}

    def __call__(self, block: Block, data: np.ndarray) -> None:
        position = 0
        for segment in block.segments:
            size = segment_bytes(self.layout, segment)[1]
            values = data[position : position + size]
            position += size
            t = segment.tensor
            inside = segment_offset(self.layout, segment) - self.layout.tensors[t].offset
            if t in self.held:
                at = inside % self.chunk[t]
                self.held[t][at : at + size] = values
            elif t in self.partner:
                partner = self.partner[t]
                at = inside % self.chunk[partner]
                self.counts[t] += self._differing(t, values, self.held[partner][at : at + size])
            else:
                self.counts[t] += self._not_zero(t, values)

    def _units(self, t: int, values: np.ndarray) -> np.ndarray:
        return values.reshape(-1, self.layout.tensors[t].unit)

    def _differing(self, t: int, values: np.ndarray, other: np.ndarray) -> int:
        return int(np.count_nonzero((self._units(t, values) != self._units(t, other)).any(axis=1)))

    def _not_zero(self, t: int, values: np.ndarray) -> int:
        units = self._units(t, values)
        if self.layout.tensors[t].dtype in _SIGNED_ZERO:  # little-endian: the sign bit is the last byte's top bit
            units = units.copy()
            units[:, -1] &= 0x7F
        return int(np.count_nonzero(units.any(axis=1)))


# ---------------------------------------------------------------- the words


def _unlike(d: Dropped, mine: str, theirs: str) -> str:
    return (
        f"dropped {d.name} (rule {d.rule}) is {mine} but {d.same_as}, which it should repeat, is {theirs}: they differ{_since(d)}"
    )


def _differs(d: Dropped, count: int, total: str) -> str:
    return f"dropped {d.name} (rule {d.rule}) differs from {d.same_as} in {count} of {total}{_since(d)}"


def _since(d: Dropped) -> str:
    """What the model loses by a differing repeat, and what to do about it."""
    hf = f"{d.hf_name} is" if d.hf_name else "it is"
    if d.because:
        key = d.because.removeprefix("config.json's ").rsplit(" is ", 1)
        other = "false" if key[-1] == "true" else "true"
        return (
            f": {hf} left out because {d.because}, so the Hugging Face model uses {d.same_as}'s values in its place; "
            f"if the two were not tied in training, set {key[0]} to {other} in the --hf-assets config.json"
        )
    return f": {hf} left out, so the Hugging Face model uses {d.same_as}'s values in its place"


def _not_zero(d: Dropped, count: int, total: str) -> str:
    if d.hf_name is None:
        lost = (
            "the Hugging Face model has no place for it, so what it does in the trained model is lost "
            "(a routing bias: which experts take each token)"
        )
    else:
        why = f" because {d.because}" if d.because else ""
        lost = f"{d.hf_name} is left out{why}, so the Hugging Face model does not get these values"
    return f"dropped {d.name} (rule {d.rule}) is not zero in {count} of {total}: {lost}"


__all__ = ["dropped_warnings"]
