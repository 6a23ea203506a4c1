"""What each rank takes from the scan: the tensors chosen (``--include``, ``--exclude``,
``--strip-prefix``: :func:`select`, pure) and its share of the pieces, checked (:func:`distribute`:
replicas, coverage, copied files, every rank's problems agreed).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..comm.agreement import Comm, agree
from ..core.coverage import merge_problems
from ..core.errors import InputError
from ..core.facts import TensorFacts
from ..core.layout import Layout
from ..core.names import missing_shards
from ..core.owners import RowOwners
from ..core.part_builder import build_part, copied_file_problem
from ..core.parts import Part
from ..core.problems import Problems
from ..core.reports import count_of
from ..core.table import Pieces
from .scan import Scanned, exchange, unreadable_summary

# ---------------------------------------------------------------- choosing tensors

#: What an optimizer's state is saved under (DCP, accelerate, torchtitan, Megatron): never a model by itself.
OPTIMIZER_PREFIX = "optimizer."


def select(
    scanned: Scanned, include: Sequence[str] = (), exclude: Sequence[str] = (), strip_prefix: str | None = None
) -> Scanned:
    """Keep the tensors whose names match an ``include`` glob (all, when none is given) and no
    ``exclude`` glob; then remove ``strip_prefix`` from the names that start with it. Pure: every
    rank computes the same from the same names."""
    names = scanned.names
    if not include and names and all(name.startswith(OPTIMIZER_PREFIX) for name in names):
        raise InputError(
            f"{scanned.directory}: holds optimizer state only ({count_of(len(names), 'tensor')} named "
            f"{OPTIMIZER_PREFIX}*), no model weights: give the folder of the model's weights (accelerate saves it "
            f"beside this one, as pytorch_model_fsdp_N), or --include '{OPTIMIZER_PREFIX}*' to write these on purpose"
        )
    if not include and not exclude and not strip_prefix:
        return _readable(scanned)
    keep = [
        t
        for t, name in enumerate(names)
        if (not include or any(fnmatch.fnmatchcase(name, g) for g in include))
        and not any(fnmatch.fnmatchcase(name, g) for g in exclude)
    ]
    if not keep:
        left_out = count_of(len(names), "tensor")
        raise InputError(f"{scanned.directory}: the --include/--exclude patterns leave none of the {left_out}")
    renamed = [without(names[t], strip_prefix or "") for t in keep]
    return chosen(scanned, keep, renamed, f"--strip-prefix {strip_prefix!r}")


def without(name: str, prefix: str) -> str:
    """``name`` less ``prefix`` when it starts with it."""
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def chosen(scanned: Scanned, keep: Sequence[int], renamed: Sequence[str], said: str) -> Scanned:
    """The tensors numbered ``keep`` under the names ``renamed`` (``said``: what renamed them, in
    messages: no name may be empty or given twice). Pure: every rank computes the same."""
    names = scanned.names
    seen: dict[str, int] = {}
    for t, new in zip(keep, renamed):
        if not new:
            raise InputError(f"{said}: tensor {names[t]!r} would have no name left")
        if new in seen:
            raise InputError(f"{said}: tensors {names[seen[new]]!r} and {names[t]!r} would both be {new!r}")
        seen[new] = t
    ordered = sorted(range(len(keep)), key=lambda i: renamed[i])
    old = np.array([keep[i] for i in ordered], dtype=np.int64)
    return _readable(_subset(scanned, old, [renamed[i] for i in ordered]))


def only(scanned: Scanned, tensors: Sequence[int]) -> Scanned:
    """A scan of just the tensors numbered ``tensors`` (in that order), its pieces copied: the scan
    itself keeps all of its own. Pure: every rank computes the same."""
    names = scanned.names
    return _subset(scanned, np.array(tensors, dtype=np.int64), [names[t] for t in tensors])


def _subset(scanned: Scanned, old: np.ndarray, renamed: list[str]) -> Scanned:
    """The scan of tensors ``old`` (old numbers, in their new order) under the names ``renamed``."""
    names = scanned.names
    new_id = np.full(len(names), -1, dtype=np.int32)
    new_id[old] = np.arange(len(old), dtype=np.int32)
    pieces = scanned.pieces
    kept = new_id[pieces.tensor] >= 0 if len(pieces) else np.zeros(0, dtype=bool)
    pieces = pieces.take(np.flatnonzero(kept))
    pieces.tensor = new_id[pieces.tensor]
    facts = scanned.facts
    per_tensor = {
        f: getattr(facts, f)[old]
        for f in ("count", "extent", "volume", "misaligned", "dtype_first", "ndim_first", "dest_first")
        + TensorFacts.ODD
        + ("declared",)
        if getattr(facts, f) is not None
    }
    new_name = {names[t]: new for t, new in zip(old.tolist(), renamed)}
    return replace(
        scanned,
        names=renamed,
        pieces=pieces,
        facts=replace(facts, **per_tensor),
        order=None if scanned.order is None else scanned.order[old],
        unreadable={new_name[n]: m for n, m in scanned.unreadable.items() if n in new_name},
    )


def _readable(scanned: Scanned) -> Scanned:
    """``scanned`` when every tensor it keeps can be read (or it lists them); else bad input naming them all."""
    if scanned.unreadable and not scanned.listing:
        raise InputError(unreadable_summary(scanned.unreadable))
    return scanned


def distribute(comm: Comm, scanned: Scanned, layout: Layout, problems: Problems | None = None) -> Part:
    """Give every rank the pieces of the rows ``layout.work`` assigns it, checked (replicas, coverage, copied files).

    The scan's pieces move into the parts: ``scanned.pieces`` is empty afterwards.

    Strict (default): the first problem, in tensor order, is raised on every rank. With collecting
    ``problems``, every rank's problems are merged into it instead.
    """
    owners = RowOwners.of(layout)
    index, owner = owners.route(scanned.pieces)
    by_owner = np.argsort(owner, kind="stable")
    index, owner = index[by_owner], owner[by_owner]
    del by_owner
    strided = bool(comm.allreduce(int(scanned.pieces.stride is not None), "max"))  # one record layout everywhere
    records = scanned.pieces.to_records(index, strided)
    scanned.pieces = Pieces.empty(scanned.pieces.width)  # from here on the parts hold them
    del index
    received = Pieces.from_records(exchange(comm, records, owner, ordered=True))
    del records, owner
    collect = problems is not None and not problems.strict
    local = Problems(strict=False)
    part = agree(comm, lambda: build_part(layout, comm.rank, received, owners, local))
    held, repeated = part.held.copy(), part.repeated.copy()
    comm.allreduce_array(held, "sum")
    comm.allreduce_array(repeated, "sum")
    copies = np.flatnonzero((held > 0) & (repeated == held))
    copied = None
    if len(copies):
        examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]] = {}
        for found in reversed(comm.allgather({f: e for f, e in part.examples.items() if f in set(copies.tolist())})):
            examples.update(found)
        copied = copied_file_problem(layout, scanned.names, held, repeated, examples)
    by_tensor = merge_problems(layout, comm.allgather((local.by_tensor, local.holes)))
    if copied or by_tensor:
        hint = _missing_hint(scanned.files.names)
        annotated = {
            t: replace(p, message=p.message + hint) if p.kind in ("hole", "overlap") else p for t, p in sorted(by_tensor.items())
        }
        if not collect:
            raise InputError((copied or next(iter(annotated.values()))).message)
        assert problems is not None
        if copied:
            problems.general.append(copied)
        for t, problem in annotated.items():
            problems.by_tensor.setdefault(t, problem)
    return part


def _missing_hint(names: Sequence[str]) -> str:
    missing, _, shown = missing_shards(names)
    if not missing:
        return ""
    more = f" (and {missing - len(shown)} more)" if missing > len(shown) else ""
    return f"; shard files missing from the set (seen by no rank): {', '.join(shown)}{more}"


__all__ = ["distribute", "only", "select"]
