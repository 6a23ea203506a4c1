"""Value transforms applied where a rank assembles its rows: block-FP8 dequantization and LoRA merges.

A tensor of the layout may carry one :data:`ValueOp`; the engine cuts each assembled segment of it at the
tensor's tile grid (:func:`value_regions`: about 2²⁰ elements a tile, at fixed places) and hands each
region to :func:`apply_value` with the small tensors the op needs (scales, LoRA ``A`` and ``B``, DoRA
magnitudes), which come through an :class:`Auxiliary`. Everything is computed in float32, as the
trainers' own tools do, and rounded once into the output dtype. Cost: a few numpy passes per region, in
work arrays kept from one region to the next (:class:`Scratch`); memory: those arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .convert import convert, to_float32
from .errors import InputError

#: The block of a DeepSeek-V3-style FP8 weight's scales, when ``quantization_config`` names none.
FP8_BLOCK = (128, 128)
#: The largest finite float8_e4m3fn: a block's scale is its largest magnitude over this.
E4M3_MAX = 448.0


@dataclass(frozen=True)
class Dequantize:
    """``w[i, j] = float32(q[i, j]) * scales[i // block[0], j // block[1]]`` (DeepSeek-V3's ``weight_dequant``)."""

    scales: str
    block: tuple[int, int] = FP8_BLOCK


@dataclass(frozen=True)
class Merge:
    """peft's merge: ``w + scaling * (b @ a)`` (transposed with ``fan_in_fan_out``); with a DoRA
    ``magnitude``, each output row of that sum rescaled to the magnitude's length."""

    a: str
    b: str
    scaling: float
    magnitude: str | None = None
    fan_in_fan_out: bool = False


@dataclass(frozen=True)
class Replace:
    """The rows of another tensor instead (peft's ``modules_to_save``: the adapter holds the trained module)."""

    source: str


@dataclass(frozen=True)
class Quantize:
    """``q = e4m3(clamp(w / scales[i // block[0], j // block[1]], ±448))``: the scales (block maxima over 448,
    1.0 for an all-zero block) measured before the writing, the division in float32, rounded to nearest even."""

    scales: str
    block: tuple[int, int] = FP8_BLOCK


@dataclass(frozen=True)
class Computed:
    """Values no piece holds, computed before the writing (a quantized weight's scales): an auxiliary tensor's rows."""

    source: str


ValueOp = Dequantize | Merge | Replace | Quantize | Computed


class Auxiliary(Protocol):
    """Where the tensors a value op names are read: whole (small ones) or by rows."""

    def whole(self, name: str) -> np.ndarray:
        """The tensor in float32 (scales, LoRA ``A`` and ``B``, magnitudes: a few MB at most)."""
        ...

    def rows(self, name: str, begin: int, end: int) -> np.ndarray:
        """Rows ``[begin, end)`` of the tensor in its own dtype (a module saved whole)."""
        ...


class Scratch:
    """float32 work arrays kept from one region to the next: fresh ones would be mapped and faulted in
    again for every region (most of a merge's system time)."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        array = self._arrays.get(name)
        if array is None or array.size < size:
            array = self._arrays[name] = np.empty(size, dtype=np.float32)
        return array[:size].reshape(shape)


#: About this many elements make a tile of the grid a value op works in (a few float32 arrays of 4 MB).
TILE_ELEMENTS = 1 << 20
#: The widest tile: rows wider than this are cut into tiles of this many columns.
TILE_COLUMNS = 1 << 16


def tile_shape(width: int) -> tuple[int, int]:
    """The rows and columns of a tile of a ``width``-wide tensor: a function of the width alone, so that
    an element is computed alike whatever rows a block, a rank or a buffer holds (BLAS rounds some
    elements of a product of another shape differently). Rows in multiples of 128 when there are that
    many (an FP8 block's), never fewer than 2 (one row would take BLAS's matrix-vector product)."""
    columns = min(max(1, width), TILE_COLUMNS)
    rows = max(2, TILE_ELEMENTS // columns)
    return (rows - rows % 128 if rows >= 128 else rows), columns


def value_regions(
    rows: tuple[int, int], cols: tuple[int, int], width: int, whole_rows: bool = False
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The rows ``[rows)`` and columns ``[cols)`` of a segment cut at the tile grid (``whole_rows``: the
    columns are not cut, for an op that needs whole rows)."""
    tile_rows, tile_cols = tile_shape(width)
    row_cuts = _cuts(rows, tile_rows)
    col_cuts = [cols] if whole_rows else _cuts(cols, tile_cols)
    return [(r, c) for r in row_cuts for c in col_cuts]


def _cuts(span: tuple[int, int], step: int) -> list[tuple[int, int]]:
    marks = sorted({span[0], span[1], *range(-(-span[0] // step) * step, span[1], step)})
    return list(zip(marks, marks[1:]))


def apply_value(
    op: ValueOp,
    values: np.ndarray,
    rows: tuple[int, int],
    cols: tuple[int, int],
    aux: Auxiliary,
    out: np.ndarray,
    scratch: Scratch | None = None,
) -> None:
    """Write into ``out`` (the output dtype) the op's values of ``values``, the rows ``[rows)`` and columns
    ``[cols)`` of a 2-D tensor (a region of :func:`value_regions`)."""
    if isinstance(op, (Replace, Computed)):
        convert(aux.rows(op.source, *rows)[:, cols[0] : cols[1]], out)
        return
    scratch = scratch or Scratch()
    work = to_float32(values, scratch.get("values", values.shape))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if isinstance(op, Dequantize):
            _by_blocks(work, rows, cols, aux.whole(op.scales), op.block, np.multiply)
        elif isinstance(op, Quantize):
            _by_blocks(work, rows, cols, aux.whole(op.scales), op.block, np.divide)
            np.clip(work, -E4M3_MAX, E4M3_MAX, out=work)
        else:
            _merge_into(op, work, rows, cols, aux, scratch)
        convert(work, out)


def _by_blocks(
    work: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], scales: np.ndarray, block: tuple[int, int], op: np.ufunc
) -> None:
    """``work[i, j] op= scales[i // block[0], j // block[1]]`` in place, one pass per block row."""
    (block_rows, block_cols), first = block, cols[0] // block[1]
    for row_block in range(rows[0] // block_rows, (rows[1] - 1) // block_rows + 1):
        top, bottom = max(rows[0], row_block * block_rows) - rows[0], min(rows[1], (row_block + 1) * block_rows) - rows[0]
        line = np.repeat(scales[row_block, first : (cols[1] - 1) // block_cols + 1], block_cols)
        op(work[top:bottom], line[cols[0] - first * block_cols : cols[1] - first * block_cols], out=work[top:bottom])


def block_amax(
    values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]
) -> tuple[slice, slice, np.ndarray]:
    """The largest magnitude in each block the rows ``[rows)`` and columns ``[cols)`` touch (the blocks'
    rows and columns, and the maxima in float32): compared as integers, the bits without the sign (the
    order of magnitudes, a NaN above all), one reduction per axis whatever the block count."""
    (i0, i1), (j0, j1), (bi, bj) = rows, cols, block
    row_starts = np.r_[0, np.arange((i0 // bi + 1) * bi, i1, bi) - i0]
    col_starts = np.r_[0, np.arange((j0 // bj + 1) * bj, j1, bj) - j0]
    unsigned = np.dtype(f"u{values.dtype.itemsize}")
    magnitudes = values.view(unsigned) & unsigned.type((1 << (8 * values.dtype.itemsize - 1)) - 1)
    grid = np.maximum.reduceat(np.maximum.reduceat(magnitudes, row_starts, axis=0), col_starts, axis=1)
    return slice(i0 // bi, (i1 - 1) // bi + 1), slice(j0 // bj, (j1 - 1) // bj + 1), grid.view(values.dtype).astype(np.float32)


def scales_of(amax: np.ndarray) -> np.ndarray:
    """A block's scale: its largest magnitude over 448 in float32; 1.0 for an all-zero block (any scale
    decodes zeros alike; transformers' quantizer writes 1.0)."""
    scales = amax.astype(np.float32) / np.float32(E4M3_MAX)
    scales[amax == 0] = 1.0
    return scales


def _merge_into(
    op: Merge, work: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary, scratch: Scratch
) -> None:
    """``work += scaling * (b @ a)`` in place; with a magnitude, each row rescaled to it (DoRA)."""
    work += merge_delta(op, rows, cols, aux, scratch)
    if op.magnitude is None:
        return
    width = _width(op, aux)
    if cols != (0, width):
        raise InputError(
            f"DoRA needs whole rows of its weight in one block, and a row of this one is larger: "
            f"raise --buffer-size above {4 * width} bytes"
        )
    norm = np.sqrt(np.einsum("ij,ij->i", work, work, dtype=np.float32))
    work *= (aux.whole(op.magnitude)[rows[0] : rows[1]] / norm)[:, None]


def merge_delta(
    op: Merge, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary, scratch: Scratch | None = None
) -> np.ndarray:
    """``scaling * (b @ a)`` for rows ``[rows)`` and columns ``[cols)`` of the weight, in float32: the
    product first (each element from its tile's product), then the scaling, as peft computes it."""
    a, b = aux.whole(op.a), aux.whole(op.b)
    scratch = scratch or Scratch()
    delta = scratch.get("delta", (rows[1] - rows[0], cols[1] - cols[0]))
    if op.fan_in_fan_out:  # the weight is [in, out]: its rows are a's columns, its columns b's rows
        width = b.shape[0]
        for (r0, r1), (c0, c1) in value_regions(rows, cols, width):
            part = delta[r0 - rows[0] : r1 - rows[0], c0 - cols[0] : c1 - cols[0]]
            np.copyto(part, _tile_product(b, a, (c0, c1), (r0, r1), width, scratch, transposed=True).T)
    else:
        width = a.shape[1]
        for (r0, r1), (c0, c1) in value_regions(rows, cols, width):
            part = delta[r0 - rows[0] : r1 - rows[0], c0 - cols[0] : c1 - cols[0]]
            if _is_tile((r0, r1), (c0, c1), b.shape[0], width) and r1 - r0 >= 2 and c1 - c0 >= 2:
                np.matmul(b[r0:r1], a[:, c0:c1], out=part)  # the whole tile: its product in place
            else:
                np.copyto(part, _tile_product(b, a, (r0, r1), (c0, c1), width, scratch))
    delta *= np.float32(op.scaling)
    return delta


def _is_tile(rows: tuple[int, int], cols: tuple[int, int], height: int, width: int) -> bool:
    """Whether the region is a whole tile of the grid (the last ones end with the weight)."""
    tile_rows, tile_cols = tile_shape(width)
    return (
        rows[0] % tile_rows == 0
        and rows[1] == min(rows[0] + tile_rows, height)
        and cols[0] % tile_cols == 0
        and cols[1] == min(cols[0] + tile_cols, width)
    )


def _tile_product(
    left: np.ndarray,
    right: np.ndarray,
    rows: tuple[int, int],
    cols: tuple[int, int],
    width: int,
    scratch: Scratch,
    transposed: bool = False,
) -> np.ndarray:
    """Rows ``[rows)`` and columns ``[cols)`` of ``left @ right``, inside one tile of the weight's grid (for
    ``transposed``, of its transpose's): computed as that whole tile, the same BLAS call whatever was asked."""
    tile_rows, tile_cols = tile_shape(width)
    grid_rows, grid_cols = (cols, rows) if transposed else (rows, cols)
    top = grid_rows[0] // tile_rows * tile_rows
    start = grid_cols[0] // tile_cols * tile_cols
    bottom = min(top + tile_rows, right.shape[1] if transposed else left.shape[0])
    stop = min(start + tile_cols, left.shape[0] if transposed else right.shape[1])
    if transposed:
        (top, bottom), (start, stop) = (start, stop), (top, bottom)
    tile = _gemm(left[top:bottom], right[:, start:stop], scratch)
    return tile[rows[0] - top : rows[1] - top, cols[0] - start : cols[1] - start]


def _gemm(left: np.ndarray, right: np.ndarray, scratch: Scratch) -> np.ndarray:
    """``left @ right`` through BLAS's matrix-matrix product whatever the shapes (with one row or one column
    numpy takes the matrix-vector product, whose sums may round otherwise), into a kept work array."""
    rows, cols = left.shape[0], right.shape[1]
    if rows >= 2 and cols >= 2:
        return np.matmul(left, right, out=scratch.get("tile", (rows, cols)))
    wide_left = np.concatenate([left, left[:1]]) if rows == 1 else left
    wide_right = np.concatenate([right, right[:, :1]], axis=1) if cols == 1 else right
    return (wide_left @ wide_right)[:rows, :cols]


def _width(op: Merge, aux: Auxiliary) -> int:
    return int(aux.whole(op.b).shape[0] if op.fan_in_fan_out else aux.whole(op.a).shape[1])


__all__ = [
    "E4M3_MAX",
    "FP8_BLOCK",
    "TILE_COLUMNS",
    "TILE_ELEMENTS",
    "Auxiliary",
    "Computed",
    "Dequantize",
    "Merge",
    "Quantize",
    "Replace",
    "Scratch",
    "ValueOp",
    "apply_value",
    "block_amax",
    "merge_delta",
    "scales_of",
    "tile_shape",
    "value_regions",
]
