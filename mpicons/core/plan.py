"""The consolidation plan, in two levels: one import for the modules that make it up.

- The **layout** (:mod:`.layout`, built by :mod:`.planner` from the :mod:`.facts`, split over ranks by
  :mod:`.split`) is per tensor, never per piece: every rank computes the same tensor table, output
  files, reference headers, tensor offsets and work split. Its size is O(tensors + files).
- A **part** (:mod:`.parts`, built by :mod:`.part_builder`) is one rank's share of the pieces: those
  that cross the rows it owns (:mod:`.owners`), replicas kept once, coverage of its rows exact
  (:mod:`.coverage`); problems are values (:mod:`.problems`).
"""

from __future__ import annotations

from .coverage import merge_problems
from .facts import TensorFacts, local_facts, local_odd, piece_destinations, set_odd
from .layout import OUTPUT_METADATA, Layout, OutputFile, Tensor, WorkItem
from .mapping import parse_mapping
from .owners import RowOwners
from .part_builder import build_part, copied_file_problem
from .parts import Part
from .planner import HF_MAX_SHARD_SIZE, build_layout, natural_key
from .problems import Problems
from .split import SPLITS

__all__ = [
    "HF_MAX_SHARD_SIZE", "OUTPUT_METADATA", "SPLITS",
    "Layout", "OutputFile", "Part", "Problems", "RowOwners", "Tensor", "TensorFacts", "WorkItem",
    "build_layout", "build_part", "copied_file_problem", "local_facts", "local_odd", "merge_problems",
    "natural_key", "parse_mapping", "piece_destinations", "set_odd",
]  # fmt: skip
