"""The host-memory tier of the activation cache: raw record bytes in one growable numpy array."""

from __future__ import annotations

import numpy as np

from .index import IdIndex

__all__ = ["HostTier"]


class HostTier:
    """In-memory records, keep-first once ``capacity`` is reached; storage grows by doubling."""

    def __init__(self, budget_bytes: int, record_bytes: int) -> None:
        self.capacity = budget_bytes // record_bytes
        self.record_bytes = record_bytes
        self.index = IdIndex()
        self._store = np.empty((0, record_bytes), np.uint8)

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self._store[slots]

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows of unique ids not yet present, while there is room."""
        n = self.index.size
        fresh = np.flatnonzero(self.index.get(ids) < 0)[: self.capacity - n]
        if fresh.size == 0:
            return
        end = n + fresh.size
        if end > self._store.shape[0]:
            rows_alloc = min(self.capacity, max(end, 2 * self._store.shape[0], 1024))
            grown = np.empty((rows_alloc, self.record_bytes), np.uint8)
            grown[:n] = self._store[:n]
            self._store = grown
        self._store[n:end] = rows[fresh]
        self.index.insert(ids[fresh], np.arange(n, end, dtype=np.int64))
