"""One rank's part: the pieces that cross the rows it owns, replicas kept once.

Memory per rank is its part, not the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layout import WorkItem
from .table import Pieces
from .values import Auxiliary


@dataclass(frozen=True)
class Replicas:
    """Every copy of every piece stored more than once (same tensor, offsets and shape), one row each.

    Rows with the same ``group`` must hold the same bytes; the part keeps one copy of each group,
    so a divergent replica would otherwise go unnoticed.
    """

    group: np.ndarray  # int64[R]
    file: np.ndarray  # int32[R]
    begin: np.ndarray  # int64[R], absolute byte offset in the file
    nbytes: np.ndarray  # int64[R]
    tensor: np.ndarray  # int32[R]
    holder: np.ndarray  # int32[R], a rank that can read the file
    offset: np.ndarray  # int64[R, D], storage units
    shape: np.ndarray  # int64[R, D]

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


@dataclass
class Part:
    """One rank's rows and the pieces they need: non-empty, replicas kept once, sorted by (tensor, row).

    Tensor ``t``'s pieces are ``pieces[start[t]:start[t + 1]]``.
    """

    rank: int
    items: list[WorkItem]
    pieces: Pieces
    start: np.ndarray
    replicas: Replicas | None = None
    #: Per source file: pieces this rank counted (it owns their first row), and how many were repeats.
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    repeated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Per source file: one repeated piece (tensor, offset, shape, original file) for the message.
    examples: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=dict)
    #: The small tensors the layout's value ops read (scales, LoRA weights), when any tensor has one.
    auxiliary: Auxiliary | None = None

    def tensor_pieces(self, t: int) -> Pieces:
        return self.pieces.take(slice(int(self.start[t]), int(self.start[t + 1])))
