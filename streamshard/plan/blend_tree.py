"""The Huffman tree behind a fair blend: splits by rounding, walks down and up (pure: numpy only).

See :mod:`streamshard.plan.blend_schedule` for why the order is fair. Every per-sample step here is exact
integer arithmetic (int64, with a corrected float64 estimate where ``2 * m * a`` could pass 2**63).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

INT63 = 2**63


def _exact_muldiv(x: np.ndarray, mul: Any, add: Any, div: Any, fits: bool) -> np.ndarray:
    """``floor((x * mul + add) / div)`` exactly for int64 ``x`` and positive ``div``.

    With ``fits`` the int64 expression cannot overflow and is computed directly. Otherwise a
    float64 estimate (off by at most one below MAX_SAMPLES) is fixed with the true remainder,
    computed in wrap-around int64: it is small, so the wrapped value is the true one.
    """
    if fits:
        x = x * mul
        x += add
        x //= div
        return x
    est = np.floor((x * (np.asarray(mul, np.float64) / div)) + np.asarray(add, np.float64) / div)
    q = est.astype(np.int64)
    r = x * mul + add - q * div
    q -= r < 0
    q += r >= div
    return q


def _is_contiguous(flat: np.ndarray) -> bool:
    """Whether ``flat`` is ``lo, lo + 1, ..., hi - 1`` (at least two positions)."""
    return flat.size > 1 and flat[-1] - flat[0] == flat.size - 1 and bool((np.diff(flat) == 1).all())


class _Tree:
    """Huffman tree over the positive counts; node ids 0..K-1 are the corpora themselves.

    Leaves point to themselves with an all-left split, so a walk down can run extra steps safely.
    """

    def __init__(self, counts: np.ndarray) -> None:
        k = len(counts)
        heap = [(int(c), i) for i, c in enumerate(counts) if c > 0]
        heapq.heapify(heap)
        left, right, size = list(range(k)), list(range(k)), [int(c) for c in counts]
        parent = [-1] * k
        while len(heap) > 1:
            (ca, na), (cb, nb) = heapq.heappop(heap), heapq.heappop(heap)
            node = len(size)
            left.append(na), right.append(nb), size.append(ca + cb), parent.append(-1)
            parent[na], parent[nb] = node, node
            heapq.heappush(heap, (ca + cb, node))
        self.root = heap[0][1] if heap else -1
        self.num_leaves = k
        self.left, self.right = np.asarray(left, np.int64), np.asarray(right, np.int64)
        self.size = np.asarray(size, np.int64)
        self.parent = parent
        self.a = np.where(np.arange(len(size)) < k, self.size, self.size[self.left])
        self.ratio = self.a / np.maximum(self.size, 1)
        total = int(self.size[self.root]) if heap else 0
        self.fits = 2 * total * total + total < INT63
        self.levels, level = [], [self.root] if self.root >= k else []
        while level:  # internal nodes by depth, root first
            self.levels.append(np.asarray(level, np.int64))
            level = [c for v in level for c in (left[v], right[v]) if c >= k]

    def split(self, m: np.ndarray, node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Left-child count among the first ``m`` local positions, and whether ``m`` goes left."""
        a, g = self.a[node], self.size[node]
        if self.fits:
            num = 2 * m * a + g
            q = num // (2 * g)
            r = num - q * (2 * g)
        else:
            q = np.floor(m * self.ratio[node] + 0.5).astype(np.int64)
            r = 2 * m * a + g - q * (2 * g)  # wraps harmlessly: the true value is small
            low, high = r < 0, r >= 2 * g
            q += high.astype(np.int64) - low
            r += (low.astype(np.int64) - high) * (2 * g)
        # Position m is the left child's iff the left count steps up between m and m + 1.
        return q, r >= 2 * (g - a)

    def descend(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Leaf (corpus) and index within it for each root-local position in ``m`` (1-D int64)."""
        corpus, index = np.full(m.shape, self.root, np.int64), m.copy()
        if self.root < self.num_leaves:
            return corpus, index
        todo, node = np.arange(m.size), corpus.copy()
        while todo.size:
            q, go_left = self.split(m, node)
            m = np.where(go_left, q, m - q)
            node = np.where(go_left, self.left[node], self.right[node])
            done = node < self.num_leaves
            if done.any():  # retire finished positions so deep corpora do not slow shallow ones
                corpus[todo[done]], index[todo[done]] = node[done], m[done]
                todo, node, m = todo[~done], node[~done], m[~done]
        return corpus, index

    def counts_at(self, ms: np.ndarray) -> np.ndarray:
        """Samples of every node among the first ``m`` root positions, for each ``m`` in ``ms``:
        shape ``(nodes, len(ms))``, exact int64, one vectorised split per depth."""
        out = np.zeros((len(self.size), len(ms)), np.int64)
        if self.root >= 0:
            out[self.root] = ms
        for level in self.levels:
            p = out[level]
            q, _ = self.split(p, level[:, None])
            out[self.left[level]], out[self.right[level]] = q, p - q
        return out

    def lift(self, child: int) -> tuple[int, int, int]:
        """``(mul, add, div)``: ``x -> (x * mul + add) // div`` maps a local index of ``child`` to
        its parent's local position (the closed-form inverse of :meth:`split`)."""
        node = self.parent[child]
        a, g = int(self.a[node]), int(self.size[node])
        if child == self.left[node]:
            return 2 * g, g - 1, 2 * a
        return 2 * g, g, 2 * (g - a)
