"""Megatron's blended-dataset index arrays, placed by arithmetic in two tiers (pure: numpy only).

:meth:`streamshard.plan.blend_schedule.BlendSchedule.export_megatron` fills a span of positions by walking
up the blend tree for every sample of a subtree at once: clusters of corpora are placed once per
superchunk and scattered into cluster order, clusters per window and scattered into it, and each
window is written in order. Steps run in float64 on offsets within a window where rounding provably
cannot change a floor (:meth:`_Tier.place`), in int64 otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .blend_tree import INT63, _exact_muldiv, _Tree

_PACK = 48  # export packs corpus << 48 | index into one int64 (indices < MAX_SAMPLES = 2**48)
_CLUSTER = 32  # corpora per cluster: ~sqrt(K) at K ~ 1000 balances numpy calls between the two tiers
_SUPER = 1 << 23  # positions per superchunk: clusters are placed once per superchunk (~2K numpy calls)
_WINDOW = 1 << 19  # positions per window: the top tier's scatter stays within 4 MiB
_RUN = 1 << 19  # at most this many samples of one cluster placed at once (bounds the work buffers)
_FLOAT_EXACT = 2**50  # a float64 step is exact while (parent count + 1) * div < this (see _Tier.place)
_ROUND = np.array(1.5 * 2**52)  # |t| < 2**51: t + _ROUND rounds t, and its bits less _ROUND's are that int64
_ROUND_BITS = _ROUND.view(np.int64)


class _Tier:
    """A subtree of the blend tree cut at *unit* nodes, which places the units' samples by arithmetic.

    Units are kept in depth-first order, so each node's samples in a range of positions form one
    contiguous slice of a flat array (unit by unit, each unit's samples in its own order). Walking
    the edges bottom-up maps each child's slice from its local offsets to its parent's with
    :meth:`_Tree.lift`: about three numpy calls per edge, each over every sample below that edge.
    """

    def __init__(self, tree: _Tree, root: int, is_unit: Any) -> None:
        units, span, stack = [], {}, [(root, False)]
        while stack:  # depth-first; span[v] = v's units as a range of unit numbers
            v, children_done = stack.pop()
            if children_done:
                span[v] = span[int(tree.left[v])][0], span[int(tree.right[v])][1]
            elif is_unit(v):
                span[v] = len(units), len(units) + 1
                units.append(v)
            else:
                stack += [(v, True), (int(tree.right[v]), False), (int(tree.left[v]), False)]
        edges = sorted((tree.parent[c], c) for c in span if c != root)  # parents ascend: bottom-up
        self.root, self.units = root, np.asarray(units, np.int64)
        self.child = np.asarray([c for _, c in edges], np.int64)
        self.parent = np.asarray([v for v, _ in edges], np.int64)
        self.child_unit = np.asarray([span[c][0] for _, c in edges], np.int64)
        self.steps = []
        for v, c in edges:
            mul, add, div = tree.lift(c)
            self.steps.append((mul, add, div, np.array(mul / div), bool(is_unit(c)), v == root))

    def place(
        self, first: np.ndarray, count: np.ndarray, ramp: np.ndarray, work: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        """Write, in unit order, the positions relative to ``first[root]`` of the samples
        ``first[u] .. first[u] + count[u] - 1`` of each unit ``u`` into ``out`` (int64); return the
        units' start offsets in ``out``. ``first``/``count``: per node (root-local start and sample
        count of one range of root positions). ``ramp``: float64 ``0, 1, 2, ...``; ``work``: float64
        scratch; both at least as long as the output.

        A step maps a child's offsets ``d`` to its parent's: with ``q0, r0 = divmod(mul *
        first[child] + add, div)`` the parent offset is ``floor((r0 + mul * d) / div) + q0 -
        first[parent]``. It runs in float64 as ``floor(d * (mul / div) + ((r0 + 1/2) / div + q0 -
        first[parent]))``: the exact sum sits at least ``1 / (2 * div)`` from an integer, and its three
        roundings, on values below ``n + 1`` (``n`` the parent's count), err by less than
        ``4 * (n + 1) * 2**-53``; so the floor is exact while ``(n + 1) * div < 2**50``. Steps into
        the root take that floor as the rounding of the sum less 1/2 (the same margin holds), read
        from float bits as int64. Steps past the bound (schedules far above 2e9 samples) run in int64.
        """
        ustart = np.zeros(len(self.units) + 1, np.int64)
        np.cumsum(count[self.units], out=ustart[1:])
        if not self.steps:
            out[: ustart[-1]] = np.arange(ustart[-1])
            return ustart
        rows = zip(self.steps, first[self.child].tolist(), first[self.parent].tolist(),
                   count[self.child].tolist(), count[self.parent].tolist(), ustart[self.child_unit].tolist())
        # ~2K edges per call: keep the loop lean (0-d array operands dispatch fastest)
        multiply, add_to, floor, constant = np.multiply, np.add, np.floor, np.zeros(())
        for (mul, add, div, ratio, from_unit, to_root), f_c, f_v, n_c, n_v, s in rows:
            if not n_c:
                continue
            q0, r0 = divmod(mul * f_c + add, div)
            x = work[s : s + n_c]
            if (n_v + 1) * div < _FLOAT_EXACT:
                multiply(ramp[:n_c] if from_unit else x, ratio, x)
                if to_root:  # floor(t) = round(t - 1/2), read as int64 bits: cheaper than a cast
                    constant[()] = (r0 + 0.5) / div + (q0 - f_v - 0.5)
                    add_to(x, constant, x)
                    add_to(x, _ROUND, x)
                    np.subtract(x.view(np.int64), _ROUND_BITS, out=out[s : s + n_c])
                else:
                    constant[()] = (r0 + 0.5) / div + (q0 - f_v)
                    add_to(x, constant, x)
                    floor(x, x)
            else:
                d = np.arange(n_c, dtype=np.int64) if from_unit else x.astype(np.int64)
                z = _exact_muldiv(d, mul, r0, div, mul * n_c + r0 < INT63) + (q0 - f_v)
                (out[s : s + n_c] if to_root else x)[:] = z
        return ustart


class _Placement:
    """Writes the fair order's positions ``[lo, hi)`` as packed ``corpus << 48 | index`` in two tiers.

    *Clusters* are the largest subtrees with at most ``L = max(_CLUSTER, sqrt(K))`` of the K corpora.
    Bottom tier: once per superchunk, each cluster places its corpora's samples and scatters them,
    packed, into cluster order in one buffer. Top tier: per window, the clusters' (and lone
    corpora's) samples are placed at the root and scattered from that buffer into the window, which
    is unpacked into the output. So numpy calls cover many samples each (~3 per edge: ~2K edges per
    superchunk below, ~2K/L per window above), both scatters write within a few MiB, and the output
    is written in order. With at most 2L corpora there are no clusters: one tier, one scatter.
    """

    def __init__(self, tree: _Tree) -> None:
        k = tree.num_leaves
        leaves = np.zeros(len(tree.size), np.int64)
        leaves[:k] = 1
        for v in range(k, len(tree.size)):  # children have smaller ids than their parent
            leaves[v] = leaves[tree.left[v]] + leaves[tree.right[v]]
        in_tree = [v for v in range(len(tree.size)) if v == tree.root or tree.parent[v] >= 0]
        most = max(_CLUSTER, math.isqrt(k))
        clusters = {v for v in in_tree if v < k or leaves[v] <= most < leaves[tree.parent[v]]}
        if leaves[tree.root] <= 2 * most:  # few corpora: one tier beats a second scatter
            clusters = set(range(k))
        self.tree = tree
        self.top = _Tier(tree, tree.root, clusters.__contains__)
        self.bottom = {f: _Tier(tree, f, lambda v: v < k) for f in self.top.units.tolist() if f >= k}
        # Windows up to _WINDOW, smaller while that keeps every float step of the top tier exact
        # (see _Tier.place); far above 2e9 samples the widest steps go int64 instead.
        widest = max((step[2] for step in self.top.steps), default=1)
        self.window = int(min(_WINDOW, max(_WINDOW >> 3, _FLOAT_EXACT // widest - 2)))

    def fill(self, lo: int, hi: int, out_c: np.ndarray, out_i: np.ndarray) -> None:
        """Write corpus ids to ``out_c`` and indices to ``out_i`` for positions ``[lo, hi)``."""
        window = self.window
        superchunk = min(window * max(1, _SUPER // window), hi - lo)  # whole windows
        size = min(max(_RUN, window), hi - lo) + 1  # a run is one window or several within _RUN
        s = _Scratch(size, superchunk, window)
        for s_lo in range(lo, hi, superchunk):
            s_hi = min(s_lo + superchunk, hi)
            bounds = list(range(s_lo, s_hi, window)) + [s_hi]
            counts = self.tree.counts_at(np.asarray(bounds, np.int64))
            offset = self._place_clusters(counts, s)
            for i in range(len(bounds) - 1):
                w, a, b = self._place_window(counts, i, offset, s), bounds[i] - lo, bounds[i + 1] - lo
                np.right_shift(w, _PACK, out=out_c[a:b], casting="unsafe")
                np.bitwise_and(w, (1 << _PACK) - 1, out=out_i[a:b])

    def _place_clusters(self, counts: np.ndarray, s: _Scratch) -> dict[int, int]:
        """Bottom tier: each cluster's samples of the superchunk, packed, in cluster order into
        ``s.clustered``; returns where each cluster's part starts. Runs of windows bound the work."""
        offset, total = {}, 0
        for f, tier in self.bottom.items():
            offset[f], row = total, counts[f]
            total += int(row[-1] - row[0])
            i = 0
            while i < len(row) - 1:
                j = i + 1 + int(np.searchsorted(row[i + 2 :], row[i] + _RUN, side="right"))
                first, count = counts[:, i], counts[:, j] - counts[:, i]
                n = int(count[f])
                ustart = tier.place(first, count, s.ramp, s.work, s.where).tolist()
                for u, a, b in zip(tier.units.tolist(), ustart, ustart[1:]):
                    np.add(s.count_up[: b - a], (u << _PACK) + int(first[u]), out=s.values[a:b])
                s.clustered[offset[f] + int(row[i] - row[0]) :][s.where[:n]] = s.values[:n]
                i = j
        return offset

    def _place_window(self, counts: np.ndarray, i: int, offset: dict[int, int], s: _Scratch) -> np.ndarray:
        """Top tier: the packed samples of window ``i`` of the superchunk, in order."""
        first, count = counts[:, i], counts[:, i + 1] - counts[:, i]
        if not self.top.steps:  # the root is the only unit: its samples are the window
            return self._source(self.top.root, first, count, counts, offset, s)
        ustart = self.top.place(first, count, s.ramp, s.work, s.where).tolist()
        for u, a, b in zip(self.top.units.tolist(), ustart, ustart[1:]):
            if b > a:
                s.window[s.where[a:b]] = self._source(u, first, count, counts, offset, s)
        return s.window[: ustart[-1]]

    @staticmethod
    def _source(u: int, first: np.ndarray, count: np.ndarray, counts: np.ndarray, offset: dict[int, int],
                s: _Scratch) -> np.ndarray:
        """Packed samples ``first[u] ..`` of unit ``u``, in its order: a cluster's part of
        ``s.clustered``, or a lone corpus's indices counting up."""
        n = int(count[u])
        if u in offset:
            at = offset[u] + int(first[u] - counts[u, 0])
            return s.clustered[at : at + n]
        return np.add(s.count_up[:n], (u << _PACK) + int(first[u]), out=s.values[:n])


class _Scratch:
    """Work arrays of one export, allocated once: fresh arrays per step would cost page faults."""

    def __init__(self, size: int, superchunk: int, window: int) -> None:
        self.ramp, self.count_up = np.arange(size, dtype=np.float64), np.arange(size, dtype=np.int64)
        self.work, self.where, self.values = np.empty(size), np.empty(size, np.int64), np.empty(size, np.int64)
        self.clustered, self.window = np.empty(superchunk + 1, np.int64), np.empty(window, np.int64)
