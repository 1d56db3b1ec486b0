"""A vectorised id -> slot map for the activation cache tiers: open addressing, one batch per call.

Pure numpy, no I/O: a tier asks for a whole batch of ids at once, so probing runs as array
operations over the batch instead of a Python loop per id.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "IdIndex"]

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier, also a final mixer for checksums
_EMPTY, _TOMB = -1, -2


class IdIndex:
    """Open-addressing (linear probing) map from ids >= 0 to int64 slots, vectorised over a batch."""

    def __init__(self) -> None:
        self._alloc(10)
        self.size = 0

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._keys = np.full(1 << bits, _EMPTY, np.int64)
        self._vals = np.zeros(1 << bits, np.int64)
        self._used = 0  # live keys + tombstones

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return ((ids.astype(np.uint64) * GOLDEN) >> np.uint64(64 - self._bits)).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """Table position of each id, -1 if absent."""
        out = np.full(ids.size, -1, np.int64)
        idx, pos, mask = np.arange(ids.size), self._home(ids), (1 << self._bits) - 1
        while idx.size:
            k = self._keys[pos]
            found = k == ids[idx]
            out[idx[found]] = pos[found]
            go = ~found & (k != _EMPTY)
            idx, pos = idx[go], (pos[go] + 1) & mask
        return out

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 if absent."""
        pos = self._find(ids)
        return np.where(pos >= 0, self._vals[np.maximum(pos, 0)], -1)

    def insert(self, ids: np.ndarray, vals: np.ndarray) -> None:
        """Add ids, which must be unique and absent."""
        if 2 * (self._used + ids.size) > (1 << self._bits):
            live = self._keys >= 0
            keys, old = self._keys[live], self._vals[live]
            self._alloc(max(self._bits, int(4 * (keys.size + ids.size)).bit_length()))
            self._place(keys, old)
        self._place(ids, vals)
        self.size += ids.size

    def _place(self, ids: np.ndarray, vals: np.ndarray) -> None:
        idx, pos, mask = np.arange(ids.size), self._home(ids), (1 << self._bits) - 1
        while idx.size:
            k = self._keys[pos]
            cand = np.flatnonzero(k < 0)  # empty or tombstone
            _, first = np.unique(pos[cand], return_index=True)  # one winner per free position
            win = cand[first]
            self._used += int(np.count_nonzero(k[win] == _EMPTY))
            self._keys[pos[win]], self._vals[pos[win]] = ids[idx[win]], vals[idx[win]]
            rest = np.ones(idx.size, bool)
            rest[win] = False
            idx, pos = idx[rest], (pos[rest] + 1) & mask

    def remove(self, ids: np.ndarray) -> None:
        pos = np.unique(self._find(ids))
        pos = pos[pos >= 0]
        self._keys[pos] = _TOMB
        self.size -= pos.size
