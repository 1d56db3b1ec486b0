"""List levels: Arrow list arrays -> per-item lengths, validity and the items end to end.

Any nesting of list, large_list, fixed_size_list and map unnests one level at a time with
:func:`unnest`; the values of the innermost level then come back as one 1-D array for all rows,
padded to ``[rows, longest]`` with :func:`slots` and :func:`pad` (one list level) or regrouped into Python lists
with :func:`regroup` (text, which has no tensor form).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .tensors_values import valid


class Level(NamedTuple):
    """One list level of a batch: each item's length (0 when null) and whether it is present."""

    lengths: np.ndarray  # int64
    present: np.ndarray  # bool


def is_list(t: pa.DataType) -> bool:
    """Types that unnest into items: the list kinds and maps (a map is a list of key/value structs)."""
    return (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
        or pa.types.is_map(t)
    )


def map_entries(t: pa.MapType) -> pa.DataType:
    """The ``list<struct<key, value>>`` type a map array is a view of (same buffers)."""
    entries = pa.struct([t.key_field.with_name("key"), t.item_field.with_name("value")])
    return pa.list_(pa.field("entries", entries, nullable=False))


def unnest(array: pa.Array) -> tuple[Level, pa.Array]:
    """The level of ``array`` and its items end to end, skipping those behind null lists."""
    if pa.types.is_map(array.type):
        array = array.view(map_entries(array.type))  # zero-copy: list_flatten has no map kernel
    lengths = pc.list_value_length(array)
    if lengths.null_count:
        lengths = lengths.fill_null(0)
    level = Level(np.array(lengths.to_numpy(zero_copy_only=False), dtype=np.int64), valid(array))
    return level, array.flatten()  # respects slicing and skips the values behind null lists


def slots(lengths: np.ndarray, width: int | None = None) -> np.ndarray:
    """``[rows, width]`` (default: the longest row), True where a row has a value."""
    width = int(lengths.max(initial=0)) if width is None else width
    return np.arange(width) < lengths[:, None]


def pad(values: np.ndarray, where: np.ndarray) -> np.ndarray:
    """The values (all rows end to end) laid into the True cells of ``where``, zeros elsewhere."""
    padded = np.zeros(where.shape, dtype=values.dtype)
    if values.size:
        # A boolean mask visits cells in row-major order, the order of the flattened values:
        # one vectorised pass, several times faster than scattering through (row, col) indices.
        padded[where] = values
    return padded


def regroup(values: list[Any], levels: list[Level]) -> list[Any]:
    """Python values of the innermost items nested back into per-row lists (``None`` for null lists)."""
    for level in reversed(levels):
        ends = np.cumsum(level.lengths).tolist()
        starts = [0] + ends[:-1]
        values = [values[a:b] if ok else None for a, b, ok in zip(starts, ends, level.present.tolist())]
    return values
