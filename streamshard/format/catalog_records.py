"""The record types the catalog modules share: a listed file and what its footer said.

Plain frozen dataclasses with no I/O and no behaviour, so ``catalog`` (which builds them),
``catalog_cache`` (which stores them as JSON) and anything else can import them without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = ["FileEntry", "FileFooter"]


@dataclass(frozen=True)
class FileEntry:
    """A listed file: its URL, size in bytes and version token ('' when the store has none)."""

    url: str
    size: int
    version: str


@dataclass(frozen=True)
class FileFooter:
    """What one file's footer contributes to the catalog."""

    url: str
    size: int
    row_group_rows: np.ndarray  # int64, one entry per row group
    schema: pa.Schema  # projected arrow schema, in projection order
    maybe_null: frozenset[str]  # projected columns whose statistics do not rule out nulls
    footer_length: int = 0  # the Thrift footer's length (the 8 bytes after it are not counted)
    ranges: np.ndarray | None = None  # int64 (row groups, projected columns, 2): [start, end)
    version: str = ""  # ETag / mtime the listing reported ('' if none)
    # int64 (row groups, projected columns): non-null leaf values of each single-leaf column chunk
    # (a list column's tokens), -1 where the column has several leaves or no null count
    values: np.ndarray | None = None
