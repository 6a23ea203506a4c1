"""The layout's values: tensors, output files, work items; per tensor, never per piece, the same on every rank.

Geometry is in *storage units*: sub-byte dtypes (F4, F6) count their last dimension in bytes, so
everything downstream moves whole bytes. Element units appear only in messages and shapes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from .names import SINGLE_FILE_NAME
from .values import ValueOp

#: What Hugging Face ``save_pretrained`` writes; transformers refuses files without it.
OUTPUT_METADATA = {"format": "pt"}


@dataclass(frozen=True)
class View:
    """How an output tensor's pieces are laid out when that differs from its header: the header's
    ``shape`` (elements) and ``axes`` (output dim ``k`` is storage dim ``axes[k]``), or None."""

    shape: tuple[int, ...]
    axes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Tensor:
    """A full tensor of the output: where it goes and its byte geometry.

    ``storage`` is the shape in storage units of ``unit`` bytes (padded to the table's width);
    it equals ``shape`` except for sub-byte dtypes, whose last dimension is counted in bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    storage: tuple[int, ...]
    unit: int
    file: int = -1
    offset: int = 0
    source_dtype: str = ""  # dtype in the shards when converting (``--dtype``), else == dtype
    source_unit: int = 0
    #: None: the output is ``storage`` in C order. Else output dim ``k`` is storage dim ``axes[k]``
    #: (a model adapter's rotary row order); ``axes[0] == 0`` always, so rows stay rows.
    axes: tuple[int, ...] | None = None
    #: What the values become on the way (dequantized, a LoRA merged), or None: see :mod:`.values`.
    value: ValueOp | None = None

    def __post_init__(self) -> None:
        if not self.source_dtype:
            object.__setattr__(self, "source_dtype", self.dtype)
        if not self.source_unit:
            object.__setattr__(self, "source_unit", self.unit)

    @property
    def dims(self) -> int:
        """How many coordinates the pieces have: the header's rank, or (an adapter's view) the storage's."""
        return max(1, len(self.shape) if self.axes is None else len(self.storage))

    @property
    def rows(self) -> int:
        return self.storage[0]

    @property
    def row_units(self) -> int:
        return math.prod(self.storage[1:])

    @property
    def row_bytes(self) -> int:
        return self.row_units * self.unit

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def converting(self) -> bool:
        return self.source_dtype != self.dtype or self.value is not None


@dataclass(frozen=True)
class OutputFile:
    name: str
    header: bytes
    size: int
    tensors: tuple[int, ...]


@dataclass(frozen=True)
class WorkItem:
    """Rows ``[row_begin, row_end)`` (dim 0, storage units) of one tensor, written by one rank."""

    tensor: int
    row_begin: int
    row_end: int


@dataclass(frozen=True)
class TensorArrays:
    """The tensor table as numpy columns, for vectorized geometry (computed once per layout)."""

    storage: np.ndarray  # int64[T, D]
    source_unit: np.ndarray  # int64[T]
    unit: np.ndarray  # int64[T]
    converting: np.ndarray  # bool[T]
    rows: np.ndarray  # int64[T]
    #: int64[T, D]: output dim k is storage dim axes[t, k] (identity but for an adapter's row orders)
    axes: np.ndarray
    #: int64[T]: the first storage dim from which the output order is the storage order
    same_from: np.ndarray


@dataclass
class Layout:
    """Everything about the output, per tensor and per file; identical on every rank."""

    source_files: list[str]
    tensors: list[Tensor]
    files: list[OutputFile]
    work: list[list[WorkItem]] = field(default_factory=list)

    @functools.cached_property
    def arrays(self) -> TensorArrays:
        tensors = self.tensors
        width = max([len(t.storage) for t in tensors], default=1)
        axes = np.tile(np.arange(width, dtype=np.int64), (len(tensors), 1))
        same_from = np.zeros(len(tensors), dtype=np.int64)
        for i, t in enumerate(tensors):
            if t.axes is not None:
                axes[i, : len(t.axes)] = t.axes
                moved = np.flatnonzero(axes[i] != np.arange(width))
                same_from[i] = int(moved[-1]) + 1 if len(moved) else 0
        return TensorArrays(
            axes=axes,
            same_from=same_from,
            storage=np.array([t.storage for t in tensors], dtype=np.int64).reshape(len(tensors), width),
            source_unit=np.array([t.source_unit for t in tensors], dtype=np.int64),
            unit=np.array([t.unit for t in tensors], dtype=np.int64),
            converting=np.array([t.converting for t in tensors], dtype=bool),
            rows=np.array([t.rows for t in tensors], dtype=np.int64),
        )

    @property
    def total_bytes(self) -> int:
        """Tensor data bytes over all output files (the index's ``total_size``)."""
        return sum(t.nbytes for t in self.tensors)

    def item_bytes(self, item: WorkItem) -> int:
        return (item.row_end - item.row_begin) * self.tensors[item.tensor].row_bytes

    def bytes_per_rank(self) -> list[int]:
        return [sum(self.item_bytes(item) for item in items) for items in self.work]

    def weight_map(self) -> dict[str, str]:
        return {self.tensors[t].name: f.name for f in self.files for t in f.tensors}

    @property
    def has_index(self) -> bool:
        """Hugging Face writes no index beside a single ``model.safetensors``."""
        return not (len(self.files) == 1 and self.files[0].name == SINGLE_FILE_NAME)

    def index(self) -> dict[str, object]:
        """The ``model.safetensors.index.json`` content, as Hugging Face writes it."""
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map().items()))}
