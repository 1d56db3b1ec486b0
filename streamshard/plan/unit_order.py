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


# A window's largest piece may hold at most 1 / (WINDOW_BALANCE * shuffle_window) of its rows ...
WINDOW_BALANCE = 0.75
# ... unless the window already holds this many times shuffle_window pieces, or this many times the
# rows of shuffle_window average row groups (what bounds a worker's memory).
WINDOW_MAX_PIECES, WINDOW_MAX_ROWS = 3, 1.5


def window_starts(rows: np.ndarray, window: int, mean_rows: float) -> np.ndarray:
    """Where each shuffle window starts among consecutive pieces of ``rows`` rows (plus the end).

    A window holds ``window`` pieces, and more when one of them would dominate it: with row groups
    of 3 to 4,096 rows, 16 of them hold a median share of 1/9 in their largest, so a batch drawn
    from the window leans on one file (2.3x a full shuffle's top-file share). Growing the window
    until its largest piece holds at most ``1 / (0.75 * window)`` of its rows brings that to ~1.7x,
    bounded by ``3 * window`` pieces and ``1.5 * window * mean_rows`` rows. Deterministic in
    ``rows`` alone, so a plan and its resume cut the same windows.
    """
    n = len(rows)
    if window <= 1:
        return np.arange(n + 1, dtype=np.int64)
    if n <= window:
        return np.array([0, n] if n else [0], dtype=np.int64)
    balance = WINDOW_BALANCE * window
    sums = np.convolve(rows, np.ones(window, dtype=np.int64), mode="valid")
    if sums.min() >= balance * rows.max():  # no piece can dominate any window: plain fixed windows
        return np.append(np.arange(0, n, window, dtype=np.int64), n)
    max_pieces, max_rows = WINDOW_MAX_PIECES * window, WINDOW_MAX_ROWS * window * mean_rows
    starts, start, total, biggest = [0], 0, 0, 0
    for i, r in enumerate(rows.tolist()):
        total += r
        biggest = max(biggest, r)
        count = i + 1 - start
        if count >= window and (total >= balance * biggest or total >= max_rows or count >= max_pieces):
            start, total, biggest = i + 1, 0, 0
            starts.append(start)
    if starts[-1] != n:
        starts.append(n)
    return np.asarray(starts, dtype=np.int64)
