"""Which ranks own the rows a piece crosses: the routing of pieces to the ranks that write them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layout import Layout
from .table import Pieces


@dataclass
class RowOwners:
    """Every work item as sorted arrays, to find with searchsorted which ranks own a piece's rows."""

    base: np.ndarray  # int64[T + 1]: the first global row of each tensor (rows of all tensors end to end)
    begin: np.ndarray  # int64[I]: global first row of each item, sorted
    end: np.ndarray  # int64[I]
    rank: np.ndarray  # int32[I]

    @classmethod
    def of(cls, layout: Layout) -> RowOwners:
        base = np.concatenate(([0], np.cumsum(layout.arrays.rows)))
        items = [
            (base[i.tensor] + i.row_begin, base[i.tensor] + i.row_end, rank)
            for rank, work in enumerate(layout.work)
            for i in work
        ]
        items.sort()
        arr = np.array(items, dtype=np.int64).reshape(-1, 3)
        return cls(base, arr[:, 0], arr[:, 1], arr[:, 2].astype(np.int32))

    def route(self, pieces: Pieces) -> tuple[np.ndarray, np.ndarray]:
        """(piece index, owner rank) for every non-empty piece and every rank whose rows it crosses."""
        nonempty = np.flatnonzero(~(pieces.shape == 0).any(axis=1))
        low = self.base[pieces.tensor[nonempty]] + pieces.offset[nonempty, 0]
        high = low + pieces.shape[nonempty, 0]
        first = np.searchsorted(self.end, low, side="right")
        last = np.searchsorted(self.begin, high, side="left")
        count = np.maximum(0, last - first)
        index = np.repeat(nonempty, count)
        position = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
        return index, self.rank[position]

    def primary(self, pieces: Pieces, rank: int) -> np.ndarray:
        """Whether ``rank`` owns the first row of each piece (each piece is counted once, by that owner)."""
        row = self.base[pieces.tensor] + pieces.offset[:, 0]
        at = np.searchsorted(self.end, row, side="right")
        inside = at < len(self.end)
        owner = np.full(len(pieces), -1, dtype=np.int32)
        owner[inside] = np.where(self.begin[at[inside]] <= row[inside], self.rank[at[inside]], -1)
        return owner == rank
