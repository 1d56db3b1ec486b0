"""The order a shuffled epoch visits row groups (``unit="row_group"``): each file spread over the epoch.

Pure (numpy only). A uniformly random order of row groups lets a file's row groups bunch up: a
shuffle window of 16 consecutive row groups then holds two or three of one file and a batch is
dominated by it (on a corpus sorted by topic, one topic per file, 2.9x a full shuffle's top-file
share). Here every file's row groups, in a random order of their own, are *spread* over the epoch:
row group ``i`` of file ``f`` is placed at the time ``(rows of f before it + u_f * its rows) /
rows of f``, where the per-file offsets ``u_f`` are a random arrangement of ``(j + 1/2) / F``, and
the epoch visits row groups by that time. So consecutive row groups come from different files in
proportion to their sizes, like a stratified sample, and a window mixes as many files as it holds
row groups (1.6x a full shuffle's share at the default window; ``benchmarks/shuffle_quality.py``).
"""

from __future__ import annotations

import numpy as np

from .permutation import Permutation


def spread_order(rg_rows: np.ndarray, rg_file: np.ndarray, num_files: int, in_file_key: int, offset_key: int) -> np.ndarray:
    """Catalog indices of all row groups in spread order (``rg_file`` non-decreasing, catalog order);
    ``in_file_key`` seeds each file's own order, ``offset_key`` the files' offsets."""
    n = len(rg_rows)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    tiebreak = Permutation(n, in_file_key)[np.arange(n, dtype=np.int64)]
    grouped = np.argsort(rg_file * n + tiebreak, kind="stable").astype(np.int64)  # file major, random inside
    files = rg_file[grouped]
    rows = rg_rows[grouped].astype(np.float64)
    per_file = np.bincount(files, weights=rows, minlength=num_files)
    file_start = np.concatenate([[0.0], np.cumsum(per_file)[:-1]])
    before = np.cumsum(rows) - rows - file_start[files]  # rows of the same file earlier in its own order
    offset = (Permutation(num_files, offset_key)[np.arange(num_files, dtype=np.int64)] + 0.5) / max(num_files, 1)
    time = (before + offset[files] * rows) / np.maximum(per_file[files], 1.0)
    return grouped[np.argsort(time, kind="stable")]
