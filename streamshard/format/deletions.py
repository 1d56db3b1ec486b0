"""Rows a table deletes without rewriting its files (Delta deletion vectors), as the catalog and readers see them.

A deletion vector names row numbers of one file. The catalog counts only the rows kept, so planning,
sample ids and padding never see a deleted row: ``rg_rows`` holds each row group's kept rows and
``rg_stored_rows`` (present only when some file has deletions) what the file stores. A reader is
asked for plan rows (0 .. kept - 1 of a row group) and reads the stored rows they stand for
(``stored_rows``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import CatalogError


def kept_rows(urls: Sequence[str], stored: Sequence[np.ndarray],
              deleted: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], dict[int, np.ndarray]]:
    """Per file, its row groups' kept rows; and, by file index, the sorted deleted row numbers of files with
    deletions (``CatalogError`` when a vector names a row the file does not have)."""
    counts, by_file = [], {}
    for index, (url, rows) in enumerate(zip(urls, stored)):
        gone = deleted.get(url)
        if gone is None or len(gone) == 0:
            counts.append(rows)
            continue
        gone = np.unique(np.asarray(gone, dtype=np.int64))
        total = int(rows.sum())
        if gone[0] < 0 or gone[-1] >= total:
            raise CatalogError(f"{url}: its deletion vector deletes row {int(gone[-1])} but the file has {total} rows")
        bounds = np.concatenate([[0], np.cumsum(rows)])
        counts.append(rows - np.diff(np.searchsorted(gone, bounds)))
        by_file[index] = gone
    return counts, by_file


def stored_rows(catalog: Any, rg: int, rows: np.ndarray | None) -> np.ndarray | None:
    """The stored row numbers (in the row group) of plan rows ``rows`` of global row group ``rg`` (None: all
    kept rows); ``rows`` itself when the file has no deletions."""
    deleted = catalog.deleted_rows
    file_index = int(catalog.rg_file[rg])
    if not deleted or file_index not in deleted:
        return rows
    stored = catalog.rg_stored_rows
    first = int(catalog.file_first_rg[file_index])
    start = int(stored[first:rg].sum())
    count = int(stored[rg])
    gone = deleted[file_index]
    gone = gone[(gone >= start) & (gone < start + count)] - start
    kept = np.setdiff1d(np.arange(count, dtype=np.int64), gone, assume_unique=True)
    return kept if rows is None else kept[np.asarray(rows, dtype=np.int64)]
