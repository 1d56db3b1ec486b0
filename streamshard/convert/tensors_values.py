"""Leaf values: one Arrow array of numbers, times or decimals -> a writable numpy array.

The leaves of every column go through here, whatever lists or structs hold them, so a type
has one meaning everywhere (a decimal in a map value reads like a top-level decimal). Nulls
read as 0 (the callers add masks); a value with no faithful int64 is a :class:`ValueFault`,
which the converter turns into a ``ConversionError`` naming the column and file.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DECIMAL_FORMATS = ("float64", "scaled_int64")

_WIDENED = {pa.uint16(): pa.int32(), pa.uint32(): pa.int64(), pa.uint64(): pa.int64()}
_EXACT_DOUBLE = 2**53  # integers up to this magnitude are exact in float64
_EXACT_POWERS = 22  # 10**k is exact in float64 for k <= 22


class ValueFault(Exception):
    """A value that has no faithful tensor form; the message is the cause, without the column."""


def is_number(t: pa.DataType) -> bool:
    """Types whose values become tensors: numbers, bools, times, decimals."""
    return (
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
        or pa.types.is_decimal(t) or (pa.types.is_temporal(t) and not pa.types.is_interval(t))
    )


def numbers(array: pa.Array, decimals: str = "float64", copy: bool = True) -> np.ndarray:
    """The array's values as a new writable numpy array, nulls as 0 (False for bools); with
    ``copy=False`` a read-only view of Arrow's buffer where the values need no conversion.

    Types map as the table of :mod:`streamshard.convert.tensors` says; ``decimals`` picks float64 or the
    unscaled integer (``value * 10**scale``) as int64.
    """
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    t = array.type
    if pa.types.is_decimal(t):
        return _scaled_int64(array) if decimals == "scaled_int64" else _decimal_float64(array)
    if pa.types.is_temporal(t):
        array = array.view(pa.int32() if t.bit_width == 32 else pa.int64())
    elif t == pa.uint64() and len(array):
        top = pc.max(array).as_py()
        if top is not None and top >= 2**63:
            raise ValueFault(f"uint64 value {top} does not fit int64")
    if t in _WIDENED:
        array = array.cast(_WIDENED[t])
    if array.null_count:
        array = array.fill_null(False if pa.types.is_boolean(array.type) else 0)
    # Copy so the tensor owns writable memory (Arrow buffers are immutable).
    values = array.to_numpy(zero_copy_only=False)
    return np.array(values, copy=True) if copy else values


def valid(array: pa.Array) -> np.ndarray:
    """True where the array holds a value (a new writable bool array)."""
    if not array.null_count:
        return np.ones(len(array), dtype=bool)
    return np.array(array.is_valid().to_numpy(zero_copy_only=False), copy=True)


def _unscaled(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Each decimal's unscaled integer as int64 (0 for nulls), and whether it fits int64 exactly."""
    width = array.type.byte_width
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.ones(0, dtype=bool)
    raw = np.frombuffer(array.buffers()[1], dtype=np.uint8)[array.offset * width:(array.offset + n) * width]
    if width <= 8:  # decimal32 / decimal64
        low, fits = raw.view(f"<i{width}").astype(np.int64), np.ones(n, dtype=bool)
    else:  # decimal128 / decimal256: little-endian 64-bit words, the first one the lowest
        words = raw.view("<i8").reshape(n, width // 8)
        low = words[:, 0].copy()
        fits = (words[:, 1:] == (low >> 63)[:, None]).all(axis=1)  # upper words only sign-extend
    present = valid(array)
    low[~present] = 0  # the slots behind nulls are unspecified
    fits |= ~present
    return low, fits


def _scaled_int64(array: pa.Array) -> np.ndarray:
    low, fits = _unscaled(array)
    if not fits.all():
        bad = array[int(np.argmin(fits))].as_py()
        raise ValueFault(
            f"decimal value {bad} does not fit int64 as value * 10**{array.type.scale} "
            "(decimals='scaled_int64'); read it with decimals='float64'"
        )
    return low


def _decimal_float64(array: pa.Array) -> np.ndarray:
    """Nearest float64 where the unscaled integer is below 2**53 (one exact division), else Arrow's
    cast (within one unit in the last place): Arrow alone rounds 1.10 to 1.1000000000000003."""
    low, fits = _unscaled(array)
    scale = array.type.scale
    exact = fits & (np.abs(low) <= _EXACT_DOUBLE) if abs(scale) <= _EXACT_POWERS else np.zeros(len(low), bool)
    if scale >= 0:
        out = low.astype(np.float64) / 10.0**scale
    else:
        out = low.astype(np.float64) * 10.0 ** (-scale)
    if not exact.all():
        cast = array.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)
        out = np.where(exact, out, cast)
    return out
