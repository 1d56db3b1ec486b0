"""Decoded (Arrow) size of Parquet row groups, estimated from a footer: pure, no I/O.

A footer's ``total_uncompressed_size`` is the *encoded* size: dictionary indices of a few bits
per value, run-length levels, no list offsets. The Arrow table pyarrow decodes is often several
times larger (a list<int32> of small values: 3.3x). This module counts what Arrow allocates
instead: for each column, walking its Arrow type, the value slots at each level (rows; list
children from the leaf's statistics) times their width, plus offsets and validity bitmaps.

Exact for fixed-width values (ints, floats, timestamps, decimals), inside lists and structs too;
for byte arrays (strings, binary) the data bytes come from the plain encoding's size, or, for
dictionary-encoded chunks, from ``value_bytes`` (average bytes per value measured on a sample,
``streamshard inspect`` reads one) or, without it, from the chunk's encoded size (a lower bound).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_DICTIONARY_ENCODINGS = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}


def decoded_bytes(metadata: pq.FileMetaData, columns: Sequence[str] | None = None,
                  value_bytes: Mapping[str, float] | None = None) -> np.ndarray:
    """Estimated Arrow bytes of each row group's ``columns`` (top-level names; None: all), int64."""
    schema = metadata.schema.to_arrow_schema()
    return np.array([row_group_decoded_bytes(metadata, r, columns, value_bytes, schema)
                     for r in range(metadata.num_row_groups)], dtype=np.int64)


def row_group_decoded_bytes(metadata: pq.FileMetaData, row_group: int, columns: Sequence[str] | None = None,
                            value_bytes: Mapping[str, float] | None = None, schema: pa.Schema | None = None) -> int:
    """Estimated Arrow bytes of one row group's ``columns`` (see :func:`decoded_bytes`)."""
    schema = metadata.schema.to_arrow_schema() if schema is None else schema
    wanted = set(schema.names if columns is None else columns)
    group = metadata.row_group(row_group)
    by_top: dict[str, list[Any]] = {}
    for c in range(group.num_columns):
        leaf = group.column(c)
        by_top.setdefault(leaf.path_in_schema.split(".")[0], []).append(leaf)
    return sum(_field_bytes(field, group.num_rows, iter(by_top[field.name]), value_bytes or {})
               for field in schema if field.name in wanted and field.name in by_top)


def byte_array_leaves(field: pa.Field) -> list[int]:
    """DFS leaf indices (within ``field``) whose values are variable-length bytes (strings, binary)."""
    return [i for i, t in enumerate(_leaf_types(field.type)) if _is_binary(t)]


def leaf_value_bytes(array: pa.Array | pa.ChunkedArray) -> list[tuple[int, int]]:
    """``(data bytes, values)`` of each byte-array leaf of ``array``, in DFS leaf order (to measure a sample)."""
    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    sums: list[list[int]] = []
    for chunk in chunks:
        for i, (nbytes, count) in enumerate(_binary_leaf_sizes(chunk)):
            if i == len(sums):
                sums.append([0, 0])
            sums[i][0] += nbytes
            sums[i][1] += count
    return [(a, b) for a, b in sums]


# -- the walk ----------------------------------------------------------------------------------
def _field_bytes(field: pa.Field, count: int, leaves: Iterator[Any], value_bytes: Mapping[str, float]) -> int:
    """Bytes of ``count`` slots of ``field``, consuming its leaf chunks from ``leaves`` in DFS order."""
    t = field.type
    validity = -(-count // 8) if field.nullable else 0
    if pa.types.is_dictionary(t):
        leaf = next(leaves)
        return validity + count * t.index_type.bit_width // 8 + int(leaf.total_uncompressed_size)
    if pa.types.is_struct(t):
        return validity + sum(_field_bytes(t.field(i), count, leaves, value_bytes) for i in range(t.num_fields))
    if pa.types.is_fixed_size_list(t):
        return validity + _field_bytes(t.value_field, count * t.list_size, leaves, value_bytes)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
        offsets = (count + 1) * (8 if pa.types.is_large_list(t) else 4)
        child = t.value_field if not pa.types.is_map(t) else pa.field("entries", pa.struct([t.key_field, t.item_field]), False)
        leaves = _peek(leaves)
        first = leaves.first  # type: ignore[attr-defined]
        # The first leaf below says how many values the child holds; inner list levels are not in
        # the footer, so a list of lists counts its inner lists as one per row (offsets only).
        inner = _values(first) if not _has_list(child.type) else count
        return validity + offsets + _field_bytes(child, inner, leaves, value_bytes)
    leaf = next(leaves)
    if _is_binary(t):
        offsets = (count + 1) * (8 if pa.types.is_large_binary(t) or pa.types.is_large_string(t) else 4)
        return validity + offsets + _binary_data(leaf, value_bytes)
    if pa.types.is_boolean(t):
        return validity + -(-count // 8)
    if pa.types.is_null(t):
        return 0
    try:
        width = t.bit_width // 8
    except ValueError:  # no fixed width (a type this walk does not know): the encoded size
        return validity + int(leaf.total_uncompressed_size)
    return validity + count * width


def _binary_data(leaf: Any, value_bytes: Mapping[str, float]) -> int:
    """Data bytes (without offsets) of a byte-array leaf chunk."""
    values = _values(leaf)
    encoded = int(leaf.total_uncompressed_size)
    if leaf.path_in_schema in value_bytes:
        return int(round(value_bytes[leaf.path_in_schema] * values))
    if not _DICTIONARY_ENCODINGS.intersection(leaf.encodings):
        return max(encoded - 4 * values, 0)  # PLAIN: a 4-byte length before each value
    return encoded  # dictionary-encoded, no sample: at least what was written


def _values(leaf: Any) -> int:
    """Non-null values of a leaf chunk (statistics), else its level entries (an upper bound)."""
    stats = leaf.statistics if leaf.is_stats_set else None
    if stats is not None and stats.num_values is not None and stats.null_count is not None:
        return int(stats.num_values)
    return int(leaf.num_values)


def _is_binary(t: pa.DataType) -> bool:
    return any(f(t) for f in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_string,
                              pa.types.is_large_string))


def _has_list(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t) or pa.types.is_fixed_size_list(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_list(t.field(i).type) for i in range(t.num_fields))
    return False


def _leaf_types(t: pa.DataType) -> list[pa.DataType]:
    if pa.types.is_struct(t):
        return [leaf for i in range(t.num_fields) for leaf in _leaf_types(t.field(i).type)]
    if pa.types.is_map(t):
        return _leaf_types(t.key_type) + _leaf_types(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_types(t.value_type)
    return [t]


def _binary_leaf_sizes(array: pa.Array) -> list[tuple[int, int]]:
    t = array.type
    if pa.types.is_struct(t):
        return [s for i in range(t.num_fields) for s in _binary_leaf_sizes(array.field(i))]
    if pa.types.is_map(t):
        return _binary_leaf_sizes(array.keys) + _binary_leaf_sizes(array.items)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _binary_leaf_sizes(array.flatten())
    if _is_binary(t):
        if len(array) == 0:
            return [(0, 0)]
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if pa.types.is_large_binary(t)
                                or pa.types.is_large_string(t) else np.int32)
        start = array.offset
        return [(int(offsets[start + len(array)] - offsets[start]), len(array) - array.null_count)]
    return []


class _peek:
    """An iterator whose next item can be looked at first (``first``) without consuming it."""

    def __init__(self, items: Iterator[Any]) -> None:
        self._items = items
        self.first = next(items)
        self._taken = False

    def __iter__(self) -> "_peek":
        return self

    def __next__(self) -> Any:
        if not self._taken:
            self._taken = True
            return self.first
        return next(self._items)
