"""Value transforms applied where a rank assembles its rows: block-FP8 dequantization and LoRA merges.

A tensor of the layout may carry one :data:`ValueOp`; the engine then hands each assembled segment of it
(rows, or a stretch of one row) to :func:`apply_value` with the small tensors the op needs (scales, LoRA
``A`` and ``B``, DoRA magnitudes), which come through an :class:`Auxiliary`. Everything is computed in
float32, as the trainers' own tools do, and rounded once into the output dtype by the caller. Cost: one
numpy expression per segment; memory: the segment in float32 plus the auxiliary rows it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

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


def apply_value(op: ValueOp, values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary) -> np.ndarray:
    """The output values of ``values`` (float32, or the replacement's dtype), the rows ``[rows)`` and
    columns ``[cols)`` of a 2-D tensor, as a 2-D array of the same shape."""
    if isinstance(op, Dequantize):
        return _dequantized(op, values, rows, cols, aux)
    if isinstance(op, Merge):
        return _merged(op, values, rows, cols, aux)
    if isinstance(op, Quantize):
        return _quantized(op, values, rows, cols, aux)
    return aux.rows(op.source, *rows)[:, cols[0] : cols[1]]


def _block_indices(rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(rows[0], rows[1]) // block[0], np.arange(cols[0], cols[1]) // block[1]


def _quantized(op: Quantize, values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary) -> np.ndarray:
    row_blocks, col_blocks = _block_indices(rows, cols, op.block)
    scaled = values.astype(np.float32) / aux.whole(op.scales)[np.ix_(row_blocks, col_blocks)]
    return np.clip(scaled, -E4M3_MAX, E4M3_MAX, out=scaled)


def block_amax(
    values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]
) -> tuple[slice, slice, np.ndarray]:
    """The largest magnitude in each block the rows ``[rows)`` and columns ``[cols)`` touch (the blocks'
    rows and columns, and the maxima): one reduction per axis, whatever the block count."""
    (i0, i1), (j0, j1), (bi, bj) = rows, cols, block
    row_starts = np.r_[0, np.arange((i0 // bi + 1) * bi, i1, bi) - i0]
    col_starts = np.r_[0, np.arange((j0 // bj + 1) * bj, j1, bj) - j0]
    magnitudes = np.abs(values.astype(np.float32))
    grid = np.maximum.reduceat(np.maximum.reduceat(magnitudes, row_starts, axis=0), col_starts, axis=1)
    return slice(i0 // bi, (i1 - 1) // bi + 1), slice(j0 // bj, (j1 - 1) // bj + 1), grid


def scales_of(amax: np.ndarray) -> np.ndarray:
    """A block's scale: its largest magnitude over 448 in float32; 1.0 for an all-zero block (any scale
    decodes zeros alike; transformers' quantizer writes 1.0)."""
    scales = amax.astype(np.float32) / np.float32(E4M3_MAX)
    scales[amax == 0] = 1.0
    return scales


def _dequantized(op: Dequantize, values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary) -> np.ndarray:
    scales = aux.whole(op.scales)
    (i0, i1), (j0, j1), (bi, bj) = rows, cols, op.block
    row_blocks, col_blocks = _block_indices(rows, cols, op.block)
    if len(row_blocks) and len(col_blocks) and (row_blocks[-1] >= scales.shape[0] or col_blocks[-1] >= scales.shape[1]):
        raise InputError(
            f"{op.scales} (shape {list(scales.shape)}) has too few {bi}x{bj} blocks for rows {i0}..{i1 - 1}, "
            f"columns {j0}..{j1 - 1} of its weight: check weight_block_size in the config's quantization_config"
        )
    return values.astype(np.float32) * scales[np.ix_(row_blocks, col_blocks)]


def merge_delta(op: Merge, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary) -> np.ndarray:
    """``scaling * (b @ a)`` for rows ``[rows)`` and columns ``[cols)`` of the weight, in float32: the
    product first, then the scaling, as peft computes it."""
    a, b = aux.whole(op.a), aux.whole(op.b)
    if op.fan_in_fan_out:  # the weight is [in, out]: its rows are a's columns
        product = _tiled_product(b, a, cols, rows).T
    else:
        product = _tiled_product(b, a, rows, cols)
    return product * np.float32(op.scaling)


#: The product ``b @ a`` is computed in tiles of these many rows and columns at fixed places of the
#: weight, whatever rows a block holds: BLAS may round an element differently in products of other shapes,
#: and the output must not depend on the rank count or the buffer.
PRODUCT_TILE = (128, 1 << 16)


def _tiled_product(left: np.ndarray, right: np.ndarray, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """Rows ``[rows)`` and columns ``[cols)`` of ``left @ right``, each element from the same BLAS call
    (its tile's) for any stretch asked: a stretch that cuts a tile costs the tile."""
    (tile_rows, tile_cols), (height, width) = PRODUCT_TILE, (left.shape[0], right.shape[1])
    out = np.empty((rows[1] - rows[0], cols[1] - cols[0]), dtype=np.float32)
    for top in range(rows[0] // tile_rows * tile_rows, rows[1], tile_rows):
        bottom = min(top + tile_rows, height)
        for start in range(cols[0] // tile_cols * tile_cols, cols[1], tile_cols):
            stop = min(start + tile_cols, width)
            tile = _gemm(left[top:bottom], right[:, start:stop])
            r0, r1, c0, c1 = max(top, rows[0]), min(bottom, rows[1]), max(start, cols[0]), min(stop, cols[1])
            out[r0 - rows[0] : r1 - rows[0], c0 - cols[0] : c1 - cols[0]] = tile[r0 - top : r1 - top, c0 - start : c1 - start]
    return out


def _gemm(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``left @ right`` through BLAS's matrix-matrix product whatever the shapes: with one row or one
    column numpy takes the matrix-vector product, whose sums may round otherwise, so an element would
    depend on how the rows fell into blocks (the rank count, the buffer). The matrix-matrix product sums
    each element alike for any block (torch's, which peft merges with, too)."""
    rows, cols = left.shape[0], right.shape[1]
    if rows >= 2 and cols >= 2:
        return left @ right
    wide_left = np.concatenate([left, left[:1]]) if rows == 1 else left
    wide_right = np.concatenate([right, right[:, :1]], axis=1) if cols == 1 else right
    return (wide_left @ wide_right)[:rows, :cols]


def _merged(op: Merge, values: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], aux: Auxiliary) -> np.ndarray:
    merged = values.astype(np.float32) + merge_delta(op, rows, cols, aux)
    if op.magnitude is None:
        return merged
    if cols[1] - cols[0] != _width(op, aux):
        raise InputError(
            f"DoRA needs whole rows of its weight in one block, and a row of this one is larger: "
            f"raise --buffer-size above {4 * _width(op, aux)} bytes"
        )
    magnitude = aux.whole(op.magnitude)
    norm = np.sqrt(np.einsum("ij,ij->i", merged, merged, dtype=np.float32))
    return (magnitude[rows[0] : rows[1]] / norm)[:, None] * merged


def _width(op: Merge, aux: Auxiliary) -> int:
    return int(aux.whole(op.b).shape[0] if op.fan_in_fan_out else aux.whole(op.a).shape[1])


__all__ = [
    "E4M3_MAX",
    "FP8_BLOCK",
    "Auxiliary",
    "Computed",
    "Dequantize",
    "Merge",
    "Quantize",
    "Replace",
    "ValueOp",
    "apply_value",
    "block_amax",
    "merge_delta",
    "scales_of",
]
