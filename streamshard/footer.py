"""Parquet footers: reading one with a single ranged request, and the byte ranges it describes.

The byte range of a column chunk is where pyarrow will read it: from its dictionary page (if
any, else its first data page) for ``total_compressed_size`` bytes. Ranges are kept per row
group and per *projected top-level column* (a struct or list column spans all its leaves), so
a reader can fetch exactly the chunks it decodes, before it even holds the footer.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FOOTER_PROBE_BYTES = 64 * 1024
MAGIC = b"PAR1"


class FooterError(ValueError):
    """The bytes at the end of a file are not a readable Parquet footer (message says why)."""


def tail_range(size: int, footer_length: int | None) -> tuple[int, int]:
    """The ``[start, end)`` to fetch for a footer: exact when its length is known, else a probe."""
    if size < 12:
        raise FooterError(f"not a Parquet file ({size} bytes is too small)")
    want = footer_length + 8 if footer_length is not None else FOOTER_PROBE_BYTES
    return max(0, size - want), size


def parse_footer(
    tail: bytes, size: int, fetch_more: Callable[[int, int], bytes] | None = None
) -> tuple[pq.FileMetaData, int]:
    """``(metadata, footer_length)`` from the last bytes of a file of ``size`` bytes.

    ``fetch_more(start, end)`` is called once when the footer is longer than ``tail``.
    """
    more = missing_footer_range(tail, size)
    if more is not None:
        if fetch_more is None:
            raise FooterError(f"footer length {footer_length_of(tail, size)} does not match the "
                              f"{len(tail) - 8} bytes cataloged")
        tail = fetch_more(*more)
    footer_length = footer_length_of(tail, size)
    try:
        return pq.read_metadata(pa.BufferReader(tail[-(footer_length + 8) :])), footer_length
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError/ArrowInvalid variants
        raise FooterError(f"corrupt Parquet footer: {exc}") from exc


def footer_length_of(tail: bytes, size: int) -> int:
    """The footer length the last 8 bytes of a file of ``size`` bytes state; ``FooterError`` if not Parquet."""
    if len(tail) < 8 or tail[-4:] != MAGIC:
        kind = "encrypted Parquet is not supported" if tail[-4:] == b"PARE" else "no PAR1 magic at the end"
        raise FooterError(f"not a readable Parquet file ({kind}; truncated or another format?)")
    footer_length = int.from_bytes(tail[-8:-4], "little")
    if footer_length + 12 > size:
        raise FooterError(f"corrupt Parquet footer (length {footer_length} exceeds file size {size})")
    return footer_length


def missing_footer_range(tail: bytes, size: int) -> tuple[int, int] | None:
    """None when ``tail`` holds the whole footer, else the ``[start, end)`` to fetch instead."""
    footer_length = footer_length_of(tail, size)
    return (size - footer_length - 8, size) if footer_length + 8 > len(tail) else None


def column_leaves(metadata: pq.FileMetaData, names: Sequence[str]) -> list[list[int]]:
    """For each top-level column name, the indices of its Parquet leaf columns."""
    wanted = {name: i for i, name in enumerate(names)}
    leaves: list[list[int]] = [[] for _ in names]
    for j in range(metadata.num_columns):
        path = metadata.schema.column(j).path
        top = path.split(".")[0]
        if top not in wanted:  # a top-level name that itself contains dots
            top = next((n for n in wanted if path == n or path.startswith(n + ".")), None)
        if top is not None:
            leaves[wanted[top]].append(j)
    return leaves


def chunk_ranges(metadata: pq.FileMetaData, names: Sequence[str]) -> np.ndarray:
    """int64 array ``(row_groups, len(names), 2)``: ``[start, end)`` of each projected column.

    A column with several leaves (struct, map) spans from its first leaf chunk to the end of its
    last; the leaves of one column are written next to each other, so nothing else is inside.
    """
    leaves = column_leaves(metadata, names)
    out = np.zeros((metadata.num_row_groups, len(names), 2), dtype=np.int64)
    for rg in range(metadata.num_row_groups):
        group = metadata.row_group(rg)
        for c, indices in enumerate(leaves):
            starts, ends = [], []
            for j in indices:
                chunk = group.column(j)
                start = _chunk_start(chunk)
                starts.append(start)
                ends.append(start + chunk.total_compressed_size)
            if starts:
                out[rg, c] = (min(starts), max(ends))
    return out


def leaf_values(metadata: pq.FileMetaData, names: Sequence[str]) -> np.ndarray:
    """int64 array ``(row_groups, len(names))``: non-null leaf values of each single-leaf column chunk
    (for a list column, its elements: empty and null lists count as nulls at the leaf level), or -1
    where the column has several leaves or the writer kept no null count."""
    leaves = column_leaves(metadata, names)
    out = np.full((metadata.num_row_groups, len(names)), -1, dtype=np.int64)
    for rg in range(metadata.num_row_groups):
        group = metadata.row_group(rg)
        for c, indices in enumerate(leaves):
            if len(indices) != 1:
                continue
            chunk = group.column(indices[0])
            stats = chunk.statistics
            if stats is not None and stats.has_null_count:
                out[rg, c] = chunk.num_values - stats.null_count
    return out


def _chunk_start(chunk: pq.ColumnChunkMetaData) -> int:
    # As pyarrow computes it: the dictionary page when it precedes the first data page.
    start = chunk.data_page_offset
    dictionary = chunk.dictionary_page_offset
    if chunk.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
        start = dictionary
    return int(start)
