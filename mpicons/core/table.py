"""Shard files and their pieces as numpy columns (no MPI here).

A *piece* is one header entry of one shard file: a box of a tensor (``offset``, ``shape``) stored
contiguously at ``begin``. The scan fills these columns (:mod:`mpicons.formats.shard_headers` reads the
headers into them), moves them between ranks as fixed-size records, and re-expresses sub-byte
dtypes in whole storage units before the plan sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from .names import MAX_SHARD_NUMBER, parse_shard_name
from .safetensors_codec import DTYPES

#: Bits per element of each dtype, by index into format.DTYPES.
DTYPE_BITS = np.array([d.bits for d in DTYPES], dtype=np.int64)


def _row_gather(index: np.ndarray | slice) -> Callable[[np.ndarray], np.ndarray]:
    """Rows of an array at ``index`` (positions or a mask): ``np.take`` along axis 0 rather than fancy
    indexing, which is several times slower on the [P, D] columns (0.15 s against 0.04 s for 278 k pieces)."""
    if isinstance(index, slice):
        return lambda column: column[index]
    positions = np.asarray(index)
    if positions.dtype == bool:
        positions = np.flatnonzero(positions)
    return lambda column: np.take(column, positions, axis=0)


@dataclass
class ShardFiles:
    """Every input file, in sorted name order (file id = position); the same on every rank."""

    names: list[str]
    size: np.ndarray  # int64[F]
    data_start: np.ndarray  # int64[F]
    out_index: np.ndarray  # int32[F], -1 when not named like a DCP shard
    out_count: np.ndarray  # int32[F]
    train_rank: np.ndarray  # int32[F], -1 when not named like a DCP shard
    is_dcp: np.ndarray  # bool[F], its header carries DCP_SHARDING_INFO
    #: Ranks that can read each file; None when every rank can (a shared filesystem).
    holders: list[np.ndarray] | None = None
    #: ``safetensors`` (DCP's Hugging Face layout, or plain files) or ``distcp`` (DCP's default format).
    source_format: str = "safetensors"

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class Pieces:
    """Pieces as columns. Shapes and offsets are padded to a common width with 1s / 0s (the C-order
    layout is unchanged); ``ndim`` keeps each piece's true rank. ``holder`` is the rank that read
    the piece's header (it can read the file)."""

    tensor: np.ndarray  # int32[P]
    file: np.ndarray  # int32[P]
    dtype: np.ndarray  # int8[P], index into format.DTYPES
    ndim: np.ndarray  # int8[P]
    shape: np.ndarray  # int64[P, D]
    offset: np.ndarray  # int64[P, D]
    begin: np.ndarray  # int64[P], absolute byte offset in its file
    holder: np.ndarray  # int32[P]
    #: int64[P, D]: storage units between neighbours along each dim, for pieces torch saved as a view
    #: (a transposed or sliced tensor: ``.distcp`` only); None when every piece is row-major.
    stride: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tensor)

    @property
    def width(self) -> int:
        return int(self.shape.shape[1])

    def take(self, index: np.ndarray | slice) -> Pieces:
        """The pieces at ``index`` (positions, a mask or a slice), in its order."""
        gather = _row_gather(index)
        columns = {f.name: gather(getattr(self, f.name)) for f in fields(self) if f.name != "stride"}
        return Pieces(**columns, stride=None if self.stride is None else gather(self.stride))

    def strides(self) -> np.ndarray:
        """Every piece's strides (row-major ones computed where none were saved)."""
        return dense_strides(self.shape) if self.stride is None else self.stride

    def dense(self) -> np.ndarray:
        """bool[P]: the piece is row-major (what every reader but a view's assumes)."""
        if self.stride is None:
            return np.ones(len(self), dtype=bool)
        return np.all((self.stride == dense_strides(self.shape)) | (self.shape <= 1), axis=1)

    def widened(self, width: int) -> Pieces:
        """The same pieces padded to ``width`` dimensions."""
        if width == self.width:
            return self
        shape = np.ones((len(self), width), dtype=np.int64)
        offset = np.zeros((len(self), width), dtype=np.int64)
        shape[:, : self.width] = self.shape
        offset[:, : self.width] = self.offset
        stride = None
        if self.stride is not None:  # a size-1 trailing dim of stride 1 keeps the layout
            stride = np.ones((len(self), width), dtype=np.int64)
            stride[:, : self.width] = self.stride
        return Pieces(self.tensor, self.file, self.dtype, self.ndim, shape, offset, self.begin, self.holder, stride)

    @classmethod
    def empty(cls, width: int = 1) -> Pieces:
        return cls(
            np.zeros(0, np.int32),
            np.zeros(0, np.int32),
            np.zeros(0, np.int8),
            np.zeros(0, np.int8),
            np.zeros((0, width), np.int64),
            np.zeros((0, width), np.int64),
            np.zeros(0, np.int64),
            np.zeros(0, np.int32),
        )

    @classmethod
    def concat(cls, parts: Sequence[Pieces], width: int | None = None) -> Pieces:
        width = max([width or 1] + [p.width for p in parts])
        parts = [p.widened(width) for p in parts if len(p)] or [cls.empty(width)]
        strided = any(p.stride is not None for p in parts)
        columns = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls) if f.name != "stride"}
        return cls(**columns, stride=np.concatenate([p.strides() for p in parts]) if strided else None)

    # -- fixed-size records, for moving pieces between ranks in one message

    @staticmethod
    def record_dtype(width: int, strided: bool = False) -> np.dtype:
        """One piece as a record; ``strided`` adds its strides (every rank must agree on it)."""
        return np.dtype(
            [
                ("tensor", "<i4"),
                ("file", "<i4"),
                ("holder", "<i4"),
                ("dtype", "i1"),
                ("ndim", "i1"),
                ("begin", "<i8"),
                ("shape", "<i8", (width,)),
                ("offset", "<i8", (width,)),
            ]
            + ([("stride", "<i8", (width,))] if strided else [])
        )

    def to_records(self, index: np.ndarray | None = None, strided: bool | None = None) -> np.ndarray:
        """The pieces (or those at ``index``) as one record array, built in place (no intermediate copy);
        with strides when ``strided`` (default: when these pieces have them)."""
        strided = self.stride is not None if strided is None else strided
        count = len(self) if index is None else len(index)
        records = np.empty(count, dtype=self.record_dtype(self.width, strided))
        for name in records.dtype.names or ():
            column = self.strides() if name == "stride" else getattr(self, name)
            records[name] = column if index is None else column[index]
        return records

    @classmethod
    def from_records(cls, records: np.ndarray) -> Pieces:
        """Column views of a record array (no copy; the records stay alive as long as the columns)."""
        width = records.dtype["shape"].shape[0]
        return cls(
            records["tensor"],
            records["file"],
            records["dtype"],
            records["ndim"],
            records["shape"].reshape(len(records), width),
            records["offset"].reshape(len(records), width),
            records["begin"],
            records["holder"],
            records["stride"].reshape(len(records), width) if "stride" in (records.dtype.names or ()) else None,
        )


def dense_strides(shape: np.ndarray) -> np.ndarray:
    """Row-major strides (in elements) of each row of ``shape`` (int64[P, D])."""
    strides = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * shape[:, d + 1]
    return strides


def shard_files(names: list[str], sizes: Sequence[int], holders: list[np.ndarray] | None) -> ShardFiles:
    """File facts known from the names alone (data starts and DCP flags are filled in by the scan)."""
    parsed = [parse_shard_name(n) for n in names]
    return ShardFiles(
        names=list(names),
        size=np.asarray(sizes, dtype=np.int64),
        data_start=np.zeros(len(names), dtype=np.int64),
        out_index=np.array([p[1] if p and p[1] <= MAX_SHARD_NUMBER else -1 for p in parsed], dtype=np.int32),
        out_count=np.array([p[2] if p and p[2] <= MAX_SHARD_NUMBER else -1 for p in parsed], dtype=np.int32),
        train_rank=np.array([p[0] if p and p[0] <= MAX_SHARD_NUMBER else -1 for p in parsed], dtype=np.int32),
        is_dcp=np.zeros(len(names), dtype=bool),
        holders=holders,
    )


def to_storage_units(pieces: Pieces) -> np.ndarray:
    """Re-express sub-byte pieces' last dimension in bytes, in place; returns which pieces are not cut on a byte."""
    bits = DTYPE_BITS[pieces.dtype.astype(np.int64)]
    misaligned = np.zeros(len(pieces), dtype=bool)
    sub = np.flatnonzero(bits % 8 != 0)
    if len(sub):
        last = pieces.ndim[sub].astype(np.int64) - 1
        shape, offset, b = pieces.shape[sub, last], pieces.offset[sub, last], bits[sub]
        misaligned[sub] = ((shape * b) % 8 != 0) | ((offset * b) % 8 != 0)
        pieces.shape[sub, last] = shape * b // 8
        pieces.offset[sub, last] = offset * b // 8
    return misaligned


@dataclass
class Table:
    """A whole checkpoint read by one process: files, tensor names (sorted) and every piece (storage units)."""

    files: ShardFiles
    names: list[str]
    pieces: Pieces
    misaligned: np.ndarray  # bool[P]


__all__ = ["DTYPE_BITS", "ShardFiles", "Pieces", "Table", "shard_files", "to_storage_units"]
