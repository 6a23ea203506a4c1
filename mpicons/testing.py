"""Helpers for mpicons' tests: the whole plan computed in one process, from every piece at once.

Not used by mpicons itself; a job plans over its ranks (``mpicons.job``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .core.errors import InputError
from .core.facts import TensorFacts, local_facts, local_odd, piece_destinations, set_odd
from .core.layout import Layout
from .core.owners import RowOwners
from .core.part_builder import build_part, copied_file_problem
from .core.parts import Part
from .core.planner import build_layout
from .core.table import Table


@dataclass
class Plan:
    """The layout and every rank's part, computed in one process (tests)."""

    layout: Layout
    parts: list[Part]

    def __getattr__(self, name: str) -> object:
        return getattr(self.layout, name)


def facts_of(table: Table) -> TensorFacts:
    """Both rounds of the facts, from every piece at once."""
    destinations = piece_destinations(table.files)
    facts = local_facts(table.pieces, len(table.names), table.pieces.width, destinations, table.misaligned)
    set_odd(facts, local_odd(table.pieces, facts, destinations))
    return facts


def build_plan(
    table: Table,
    ranks: int,
    *,
    mapping: Mapping[str, str] | None = None,
    split: str = "bytes",
    dtype: str | None = None,
    max_shard_size: int | None = None,
) -> Plan:
    """The whole plan in one process, from every piece; raises the first problem (InputError)."""
    layout = build_layout(
        table.files, table.names, facts_of(table), ranks, mapping=mapping, split=split, dtype=dtype, max_shard_size=max_shard_size
    )
    owners = RowOwners.of(layout)
    index, rank_of = owners.route(table.pieces)
    parts = [build_part(layout, r, table.pieces.take(index[rank_of == r]), owners) for r in range(ranks)]
    problem = copied_file_problem(
        layout,
        table.names,
        np.sum([p.held for p in parts], axis=0),
        np.sum([p.repeated for p in parts], axis=0),
        {f: e for p in reversed(parts) for f, e in p.examples.items()},
    )
    if problem:
        raise InputError(problem.message)
    return Plan(layout, parts)
