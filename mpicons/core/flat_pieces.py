"""Parameters stored as stretches of flat buffers, and the boxes they make (no MPI here).

Trainers that shard by flattening (DeepSpeed ZeRO: a group's parameters concatenated and split
evenly over the ranks, or each parameter split on its own) store a parameter as *flat pieces*:
elements ``[start, start + count)`` of the parameter in C order, contiguous in one file. A trainer's
layout (``mpicons.trainers.*``) turns what it read into a :class:`TrainerLayout` of such pieces; a
row-sharded tensor (FSDP's ``Shard(0)``) is the special case of whole rows. :func:`boxes` cuts a
flat stretch into the few boxes (offset, shape) the rest of mpicons deals in, each still one
contiguous byte range, and :func:`as_pieces` makes the scan's columns of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .safetensors_codec import DTYPE_BY_NAME, DTYPE_ORDER
from .table import Pieces


@dataclass(frozen=True, slots=True)
class Param:
    """One tensor of the consolidated checkpoint: its name, dtype (safetensors name) and full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class FlatPiece:
    """Elements ``[start, start + count)`` of tensor ``tensor`` flattened in C order, stored one after
    another from byte ``begin`` of ``file`` (a file name of the checkpoint directory)."""

    tensor: str
    start: int
    count: int
    file: str
    begin: int


@dataclass
class TrainerLayout:
    """What a trainer's checkpoint holds, as mpicons consolidates it: the tensors to write (in the
    order the trainer saved them), their pieces, the tied names left out, and what is skipped."""

    params: list[Param]
    pieces: list[FlatPiece]
    #: A tensor not written because it is another's (tied embeddings): its name → the name written.
    tied: dict[str, str] = field(default_factory=dict)
    #: What was not read, one line each (optimizer state, 16-bit copies): for the report and ``inspect``.
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """``count`` elements stored one after another from byte ``begin`` of ``file``."""

    file: str
    begin: int
    count: int


class FlatBuffer:
    """A flat vector stored as consecutive runs (a ZeRO group's buffer over its ranks' files, or one
    rank's sub-groups): finds where any stretch of it lies."""

    def __init__(self, runs: Sequence[Run], itemsize: int) -> None:
        self.runs = [run for run in runs if run.count]
        self.itemsize = itemsize
        self.starts = np.cumsum([0] + [run.count for run in self.runs], dtype=np.int64)

    @property
    def numel(self) -> int:
        return int(self.starts[-1])

    def cut(self, tensor: str, at: int, count: int, start: int) -> list[FlatPiece]:
        """The pieces of elements ``[at, at + count)`` of the buffer, which are elements ``[start, ...)`` of ``tensor``."""
        if at < 0 or at + count > self.numel:
            raise ValueError(f"elements {at}..{at + count} of a buffer of {self.numel}")
        pieces = []
        first = int(np.searchsorted(self.starts, at, side="right")) - 1
        while count > 0:
            run = self.runs[first]
            inside = at - int(self.starts[first])
            take = min(count, run.count - inside)
            pieces.append(FlatPiece(tensor, start, take, run.file, run.begin + inside * self.itemsize))
            at, start, count, first = at + take, start + take, count - take, first + 1
        return pieces


def boxes(shape: Sequence[int], start: int, count: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements ``[start, start + count)`` of a C-order tensor of ``shape`` as the fewest boxes that
    follow the flat order: (offset, box shape, flat index of the box's first element) each, at most
    ``2·ndim − 1``. Each box is contiguous in the flat order, so it is one byte range of its piece."""
    shape = tuple(shape)
    if count <= 0:
        return []
    if not shape:
        return [((), (), 0)]
    steps = [math.prod(shape[d + 1 :]) for d in range(len(shape))]  # elements per index of each dim
    result: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    at, end, down_from = start, start + count, 0
    # Up: finish the current index of each dim (whole indices of the dim below it), innermost first,
    # while that stays within the stretch.
    for d in range(len(shape) - 1, 0, -1):
        boundary = -(-at // steps[d - 1]) * steps[d - 1]
        if boundary > end:
            down_from = d
            break
        if boundary > at:
            result.append(_box(shape, steps, d, at, boundary))
            at = boundary
    # Down: as many whole indices of each dim as are left, outermost first.
    for d in range(down_from, len(shape)):
        upto = at + (end - at) // steps[d] * steps[d]
        if upto > at:
            result.append(_box(shape, steps, d, at, upto))
            at = upto
    return result


def _box(shape: tuple[int, ...], steps: list[int], d: int, at: int, upto: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The box of indices ``[at, upto)`` along dim ``d`` (whole below it, one index above it)."""
    offset = [(at // steps[k]) % shape[k] for k in range(len(shape))]
    size = [1] * d + [(upto - at) // steps[d]] + list(shape[d + 1 :])
    offset[d + 1 :] = [0] * (len(shape) - d - 1)
    return tuple(offset), tuple(size), at


def as_pieces(layout: TrainerLayout, names: Sequence[str], files: Sequence[str], holder: int) -> Pieces:
    """The scan's columns for ``layout``'s pieces (boxes of each flat piece): ``names`` and ``files``
    give the tensor and file ids (their positions), ``holder`` the rank that read the files."""
    tensor_id = {name: i for i, name in enumerate(names)}
    file_id = {name: i for i, name in enumerate(files)}
    params = {p.name: p for p in layout.params}
    width = max([1] + [len(p.shape) for p in layout.params])
    rows: list[tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], int]] = []
    for piece in layout.pieces:
        param = params[piece.tensor]
        itemsize = DTYPE_BY_NAME[param.dtype].bits // 8
        dtype = DTYPE_ORDER[param.dtype]
        for box_offset, box_shape, first in boxes(param.shape, piece.start, piece.count):
            begin = piece.begin + (first - piece.start) * itemsize
            rows.append((tensor_id[piece.tensor], file_id[piece.file], dtype, len(param.shape), box_offset, box_shape, begin))
    count = len(rows)
    shape = np.ones((count, width), dtype=np.int64)
    offset = np.zeros((count, width), dtype=np.int64)
    for i, row in enumerate(rows):
        shape[i, : row[3]], offset[i, : row[3]] = row[5], row[4]
    return Pieces(
        tensor=np.array([r[0] for r in rows], dtype=np.int32),
        file=np.array([r[1] for r in rows], dtype=np.int32),
        dtype=np.array([r[2] for r in rows], dtype=np.int8),
        ndim=np.array([r[3] for r in rows], dtype=np.int8),
        shape=shape,
        offset=offset,
        begin=np.array([r[6] for r in rows], dtype=np.int64),
        holder=np.full(count, holder, dtype=np.int32),
    )


__all__ = ["FlatBuffer", "FlatPiece", "Param", "Run", "TrainerLayout", "as_pieces", "boxes"]
