"""Floating-point dtype conversion on the way (``--dtype``), rounding to nearest even.

Integers, bools, complex and sub-byte floats (F4, F6) are never converted. numpy and ml_dtypes
round correctly from a single rounding, except float64 → bfloat16, which ml_dtypes rounds twice
(through float32); that path first rounds to float32 *to odd*, which makes the second rounding exact.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence

import numpy as np

from .options import DTYPE_TARGETS as TARGETS
from .options import DTYPES, check_choice
from .safetensors_codec import DTYPE_BY_NAME


def converted_dtype(source: str, target: str | None) -> str:
    """The dtype a tensor of ``source`` dtype is written as under ``--dtype target``."""
    if target is None:
        return source
    check_choice(target, DTYPES, "--dtype")
    kind = DTYPE_BY_NAME[source]
    if not kind.is_float or kind.bits % 8 or target not in TARGETS:  # fp8: only what the plan quantizes
        return source
    return TARGETS[target]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (bfloat16 and float8 come from ml_dtypes)."""
    _register_ml_dtypes()
    return np.dtype(DTYPE_BY_NAME[name].numpy)


def prepare_conversion(target: object | None) -> None:
    """Load now what a conversion to ``target`` (or a merge: any value) will need (ml_dtypes' bfloat16 and
    float8 types), so that its import (0.5-2 s) is not counted as writing when the first block is
    converted: the job calls this before its phases are timed."""
    if target is not None:
        _register_ml_dtypes()


def _register_ml_dtypes() -> None:
    """Import ml_dtypes, which registers bfloat16 and float8 with numpy, when a conversion first needs them.

    Not at import: ml_dtypes 0.7 takes about 0.7 s to import, which every rank of every job would pay.
    """
    import ml_dtypes  # noqa: F401


def convert(source: np.ndarray, target: np.ndarray) -> None:
    """Write ``source`` (any float dtype) into ``target`` (same shape) with round-to-nearest-even."""
    with np.errstate(over="ignore", invalid="ignore"):  # out of range is inf, NaN stays NaN: no warnings
        if target.dtype == np.float32 and source.dtype in (numpy_dtype("BF16"), numpy_dtype("F8_E4M3")):
            to_float32(source, target)
        elif source.dtype == np.float64 and target.dtype == numpy_dtype("BF16"):
            np.copyto(target, _float64_to_float32_round_to_odd(source), casting="unsafe")
        else:
            np.copyto(target, source, casting="unsafe")


def to_float32(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``values`` widened exactly into the float32 array ``out``: bfloat16 by a shift of its bits, E4M3 by a
    table of its 256 values (several times faster than a cast through ml_dtypes), others by numpy."""
    if values.dtype == numpy_dtype("BF16"):
        np.left_shift(values.view(np.uint16), np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    elif values.dtype == numpy_dtype("F8_E4M3"):
        np.take(_e4m3_values(), values.view(np.uint8), out=out)
    else:
        np.copyto(out, values, casting="unsafe")
    return out


@functools.cache
def _e4m3_values() -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(numpy_dtype("F8_E4M3")).astype(np.float32)


def _float64_to_float32_round_to_odd(values: np.ndarray) -> np.ndarray:
    """float32 nearest to ``values`` toward zero, with the last bit set when inexact (sticky)."""
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = values.astype(np.float32)
        away = np.abs(rounded.astype(np.float64)) > np.abs(values)
        rounded = np.where(away, np.nextafter(rounded, np.float32(0)), rounded)
        inexact = (rounded.astype(np.float64) != values) & np.isfinite(values)
    bits = rounded.view(np.uint32)
    bits |= inexact.astype(np.uint32)
    return rounded


def keep_dtype_matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``--keep-dtype`` keeps a tensor (by its output name) out of a ``--dtype`` conversion."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)
