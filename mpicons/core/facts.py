"""What the pieces say about each tensor, reduced element-wise so any split of the pieces over ranks
gives the same facts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .table import Pieces, ShardFiles

#: Keys combine a file id with a small value (dtype, rank, destination) so one MIN finds both.
FACT_KEY = 1 << 32


@dataclass
class TensorFacts:
    """Per tensor, from all its pieces: combined element-wise with min / max / sum only, so the facts
    of any split of the pieces over ranks combine (an Allreduce each) into the same result.

    ``*_first`` keys are ``file · 2³² + value`` of the piece in the lowest-numbered file (one MIN
    gives both); ``*_odd`` the same for the lowest file whose value differs from that (needs the
    first round), -1 when all agree.
    """

    count: np.ndarray  # int64[T]: header entries, empty ones included
    extent: np.ndarray  # int64[T, D]: max(offset + shape), storage units
    volume: np.ndarray  # float64[T]: storage units of non-empty pieces (replicas counted each time)
    misaligned: np.ndarray  # int64[T]: 1 when a sub-byte piece is not cut on a byte boundary
    dtype_first: np.ndarray  # int64[T]
    ndim_first: np.ndarray  # int64[T]
    dest_first: np.ndarray  # int64[T]
    dtype_odd: np.ndarray | None = None
    ndim_odd: np.ndarray | None = None
    dest_odd: np.ndarray | None = None
    #: int64[T, D]: the full shape the checkpoint declares (DCP's ``.metadata``), storage units; None: the extent.
    declared: np.ndarray | None = None

    SUM = ("count", "volume")
    MAX = ("extent", "misaligned")
    MIN = ("dtype_first", "ndim_first", "dest_first")
    ODD = ("dtype_odd", "ndim_odd", "dest_odd")

    @property
    def num_tensors(self) -> int:
        return len(self.count)

    def needs_odd(self) -> bool:
        return self.dtype_odd is None


#: Input formats whose files name no output file (DCP's ``.distcp``, a trainer's ``torch.save`` archives).
NAMES_NO_OUTPUT = ("distcp", "torch.save")


def piece_destinations(files: ShardFiles) -> np.ndarray:
    """Per file, where its pieces go by name: the DCP output index, (plain files) the file itself, or
    (``.distcp`` data files, which name no output) nowhere in particular."""
    if files.source_format in NAMES_NO_OUTPUT:
        return np.zeros(len(files), dtype=np.int64)
    if (files.out_index >= 0).any():
        return files.out_index.astype(np.int64)
    return np.arange(len(files), dtype=np.int64)


def _keys(pieces: Pieces, values: np.ndarray) -> np.ndarray:
    return pieces.file.astype(np.int64) * FACT_KEY + values.astype(np.int64)


def local_facts(
    pieces: Pieces, num_tensors: int, width: int, destinations: np.ndarray, misaligned: np.ndarray | None = None
) -> TensorFacts:
    """This part's facts (the first round: everything but the ``*_odd`` keys)."""
    t = pieces.tensor
    flags = np.zeros(num_tensors, dtype=np.int64)
    if misaligned is not None and misaligned.any():
        np.maximum.at(flags, t, misaligned.astype(np.int64))
    extent = np.zeros((num_tensors, width), dtype=np.int64)
    if len(pieces):
        np.maximum.at(extent, t, pieces.offset + pieces.shape)
    nonempty = ~(pieces.shape == 0).any(axis=1)
    volume = np.bincount(
        t, weights=np.where(nonempty, np.prod(pieces.shape.astype(np.float64), axis=1), 0.0), minlength=num_tensors
    )
    firsts = []
    for values in (pieces.dtype, pieces.ndim, destinations[pieces.file]):
        first = np.full(num_tensors, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, t, _keys(pieces, values))
        firsts.append(first)
    return TensorFacts(
        count=np.bincount(t, minlength=num_tensors).astype(np.int64),
        extent=extent,
        volume=volume,
        misaligned=flags,
        dtype_first=firsts[0],
        ndim_first=firsts[1],
        dest_first=firsts[2],
    )


def local_odd(pieces: Pieces, facts: TensorFacts, destinations: np.ndarray) -> list[np.ndarray]:
    """The second round: per tensor, the lowest (file, value) key whose value differs from the first's."""
    t = pieces.tensor
    result = []
    for values, first in (
        (pieces.dtype, facts.dtype_first),
        (pieces.ndim, facts.ndim_first),
        (destinations[pieces.file], facts.dest_first),
    ):
        odd = np.full(facts.num_tensors, np.iinfo(np.int64).max, dtype=np.int64)
        differs = values.astype(np.int64) != first[t] % FACT_KEY
        np.minimum.at(odd, t[differs], _keys(pieces, values)[differs])
        result.append(odd)
    return result


def set_odd(facts: TensorFacts, odd: Sequence[np.ndarray]) -> None:
    big = np.iinfo(np.int64).max
    facts.dtype_odd, facts.ndim_odd, facts.dest_odd = (np.where(o == big, -1, o) for o in odd)
