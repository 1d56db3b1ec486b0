"""Weighted blending of corpora as arithmetic: exact counts and a random-access interleave.

Pure planning (numpy only, no I/O, no torch). :func:`blend_counts` splits ``n`` samples over
corpora by weight; :class:`BlendSchedule` maps a global position to ``(corpus, index within
corpus)`` without materialising anything per sample, so a schedule of 2 * 10**12 samples costs
what one of 10**3 does: O(K log K) to build and O(K) memory for K corpora.

How the fair order works (and why it is fair):

* The corpora with a positive count are the leaves of a Huffman tree built on their counts. An
  internal node with children of counts ``a`` and ``b`` (``g = a + b``) interleaves them by
  rounding: among its first ``m`` local positions, ``floor((2*m*a + g) / (2*g))`` belong to the
  left child. That is ``m * a / g`` rounded to nearest, so each split is within 1/2 of its share,
  both children's counts are non-decreasing in steps of 0 or 1, and at ``m = g`` the split is exact.
* A corpus's prefix error is the sum, over the splits on its path from the root, of that split's
  error (at most 1/2) times (the corpus's count / the count of the side of the split it is on).
  The last split contributes at most 1/2. In a Huffman tree a node's grandparent holds at least
  twice the node, and the parent plus grandparent terms are at most 1.5 times the node's own;
  the geometric series sums to at most 1/2 * (1 + 1.5 * 2) = 2. So every prefix of length ``m``
  holds each corpus within 2 samples of ``m * count_k / num_samples`` (measured: at most 1.0 on
  uniform, Pareto and geometric mixes of 1,000 corpora, where Megatron's greedy reaches 1.2).
* Position -> (corpus, index) walks down the tree (depth ~ entropy of the weights in bits, ~10
  for 1,000 similar weights); (corpus, index) -> position walks up with a closed-form inverse of
  each split. :meth:`BlendSchedule.export_megatron` fills contiguous ranges by walking up, for
  all samples of a subtree at once (:class:`_Tier`, :class:`_Placement`).
* Each corpus is read in its own order 0, 1, 2, ...: the index of a sample is the number of that
  corpus's samples before it.

All per-sample arithmetic is exact. Walks down are int64; where ``2 * m * a`` could pass 2**63
(schedules above ~2.1e9 samples) a float64 estimate is corrected with an exact wrap-around
remainder, which is valid up to :data:`MAX_SAMPLES`. Walks up run in float64 on offsets within a
window, where rounding provably cannot change a floor (see :meth:`_Tier.place`), and in int64
where that proof does not cover a step.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .validate import check_int

from streamshard.permutation import Permutation, mix_seed

__all__ = ["MAX_SAMPLES", "BlendSchedule", "blend_counts"]

MAX_SAMPLES = 2**48
ORDERS = ("fair", "shuffled")
_INT63 = 2**63
_BLEND_TAG = 0x424C454E44  # ASCII "BLEND": shuffles here never coincide with other uses of a seed
_BLOCK = 1 << 15  # positions per block of a walk down the tree
_PACK = 48  # export packs corpus << 48 | index into one int64 (indices < MAX_SAMPLES = 2**48)
_CLUSTER = 32  # corpora per cluster: ~sqrt(K) at K ~ 1000 balances numpy calls between the two tiers
_SUPER = 1 << 23  # positions per superchunk: clusters are placed once per superchunk (~2K numpy calls)
_WINDOW = 1 << 19  # positions per window: the top tier's scatter stays within 4 MiB
_RUN = 1 << 19  # at most this many samples of one cluster placed at once (bounds the work buffers)
_FLOAT_EXACT = 2**50  # a float64 step is exact while (parent count + 1) * div < this (see _Tier.place)
_ROUND = np.array(1.5 * 2**52)  # |t| < 2**51: t + _ROUND rounds t, and its bits less _ROUND's are that int64
_ROUND_BITS = _ROUND.view(np.int64)


def _check_weights(weights: Any) -> np.ndarray:
    """Weights as a float64 vector, or ValueError naming the first bad corpus index."""
    if isinstance(weights, Mapping):
        raise ValueError("weights must be a sequence or 1-D array; map names to weights before calling")
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"weights must be numbers: {exc}") from None
    if w.ndim != 1:
        raise ValueError(f"weights must be 1-D, got shape {w.shape}")
    if w.size == 0:
        raise ValueError("weights is empty: need at least one corpus")
    for problem, bad in (("NaN", np.isnan(w)), ("infinite", np.isinf(w)), ("negative", w < 0)):
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(f"weights[{k}] is {problem} ({w[k]!r}); weights must be finite and >= 0")
    if not (w > 0).any():
        raise ValueError("weights are all zero: at least one corpus needs a positive weight")
    return w


def blend_counts(weights: Any, n: int) -> np.ndarray:
    """Split ``n`` samples over corpora in proportion to ``weights`` (int64, sums exactly to ``n``).

    Largest-remainder (Hamilton) apportionment, computed exactly: every float weight is a dyadic
    rational, so quotas ``w_k * n / sum(w)`` are compared as integers and the result is the same on
    every platform. Each count is its quota rounded down or up. The ``n - sum(floors)`` leftover
    samples go to the largest remainders; equal remainders go to the lower corpus index first.
    Zero weights get zero samples.
    """
    w = _check_weights(weights)
    n = check_int(n, "n", 0, MAX_SAMPLES)
    ratios = [float(x).as_integer_ratio() for x in w]
    denom = max(q for _, q in ratios)  # powers of two, so this is a common denominator
    scaled = [p * (denom // q) for p, q in ratios]
    total = sum(scaled)
    counts = [s * n // total for s in scaled]
    remainders = [s * n % total for s in scaled]
    leftover = n - sum(counts)
    for k in sorted(range(len(scaled)), key=lambda k: (-remainders[k], k))[:leftover]:
        counts[k] += 1
    return np.asarray(counts, dtype=np.int64)


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
        self.fits = 2 * total * total + total < _INT63
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
                z = _exact_muldiv(d, mul, r0, div, mul * n_c + r0 < _INT63) + (q0 - f_v)
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


class BlendSchedule:
    """Random-access blend of corpora: global position -> ``(corpus, index within corpus)``.

    Over the whole schedule corpus ``k`` appears exactly ``blend_counts(weights, num_samples)[k]``
    times, with indices ``0 .. count_k - 1`` each exactly once. ``order="fair"`` keeps every
    prefix within 2 samples of each corpus's share and reads each corpus in its own order;
    ``order="shuffled"`` is a uniform pseudorandom interleave, position ``i`` -> the fair schedule
    at ``Permutation(num_samples, mix_seed(TAG, seed))[i]`` (``seed`` is ignored for "fair").
    Construction is O(K log K) for K corpora and independent of ``num_samples``.
    """

    def __init__(self, weights: Any, num_samples: int, seed: int = 0, order: str = "fair") -> None:
        self._num_samples = check_int(num_samples, "num_samples", 0, MAX_SAMPLES)
        self._seed = check_int(seed, "seed", 0, 2**64 - 1)
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        self._order = order
        self._counts = blend_counts(weights, self._num_samples)
        self._counts.setflags(write=False)
        self._tree = _Tree(self._counts)
        self._placement: _Placement | None = None  # built on the first export or contiguous lookup
        self._perm = None
        if order == "shuffled":
            self._perm = Permutation(self._num_samples, mix_seed(_BLEND_TAG, self._seed))

    @property
    def num_samples(self) -> int:
        """Length of the schedule."""
        return self._num_samples

    @property
    def counts(self) -> np.ndarray:
        """Read-only int64 samples per corpus over the whole schedule."""
        return self._counts

    @property
    def order(self) -> str:
        """``"fair"`` or ``"shuffled"``."""
        return self._order

    @property
    def seed(self) -> int:
        """Seed of the shuffled order."""
        return self._seed

    def __len__(self) -> int:
        return self._num_samples

    def __repr__(self) -> str:
        return (f"BlendSchedule(corpora={len(self._counts)}, num_samples={self._num_samples}, "
                f"order={self._order!r}, seed={self._seed})")

    def __getitem__(self, position: int) -> tuple[int, int]:
        """Scalar convenience: ``(corpus, index)`` of one position."""
        return self.lookup(position)

    def lookup(self, positions: Any) -> Any:
        """``(corpus, index)`` for an int (Python ints back) or an integer array (two int64 arrays
        of the same shape). Positions must lie in ``[0, num_samples)``: IndexError otherwise."""
        if np.ndim(positions) == 0 and not isinstance(positions, np.ndarray):
            p = check_int(positions, "positions", -_INT63, _INT63 - 1)
            corpus, index = self._lookup_flat(self._validated(np.asarray([p], np.int64)))
            return int(corpus[0]), int(index[0])
        arr = np.asarray(positions)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"positions must have an integer dtype, got {arr.dtype}")
        flat = self._validated(arr.reshape(-1).astype(np.int64))
        corpus, index = self._lookup_flat(flat)
        return corpus.reshape(arr.shape), index.reshape(arr.shape)

    def prefix_counts(self, m: int) -> np.ndarray:
        """Samples of each corpus among positions ``[0, m)`` of the fair order (int64).

        This is also where each corpus resumes after ``m`` fair-order steps."""
        m = check_int(m, "m", 0, self._num_samples)
        return self._tree.counts_at(np.asarray([m], np.int64))[: len(self._counts), 0]

    def export_megatron(self, span: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Materialise ``(dataset_index int16, dataset_sample_index int64)`` as Megatron's
        blended-dataset indices: for the first ``span`` positions (int), a step-1 ``range``, or the
        whole schedule (None). Fills in superchunks: at most ~90 MiB of temporaries beside the
        output (2 GiB per 2e8 positions). The fair order costs ~8 ns per position on one core."""
        start, stop = self._span(span)
        if not self._packable():
            raise ValueError(f"weights has {len(self._counts)} corpora; int16 dataset_index holds 32768")
        corpus = np.empty(stop - start, np.int16)
        index = np.empty(stop - start, np.int64)
        if self._perm is None:
            self._fill_fair(start, stop, corpus, index)
            return corpus, index
        for lo in range(start, stop, 64 * _BLOCK):  # blocks bound the shuffled path's temporaries
            hi = min(lo + 64 * _BLOCK, stop)
            corpus[lo - start : hi - start], index[lo - start : hi - start] = self._lookup_flat(
                np.arange(lo, hi, dtype=np.int64))
        return corpus, index

    def _span(self, span: Any) -> tuple[int, int]:
        if span is None:
            return 0, self._num_samples
        if isinstance(span, range):
            if span.step != 1:
                raise ValueError(f"span must be a range with step 1, got {span!r}")
            if not 0 <= span.start <= span.stop <= self._num_samples:
                raise ValueError(f"span {span!r} is not inside range(0, {self._num_samples})")
            return span.start, span.stop
        return 0, check_int(span, "span", 0, self._num_samples)

    def _packable(self) -> bool:
        """Corpus ids fit int16 (Megatron's dataset_index) and the ``corpus << 48`` packing."""
        return len(self._counts) <= 1 << 15

    def _validated(self, flat: np.ndarray) -> np.ndarray:
        if flat.size and (flat.min() < 0 or flat.max() >= self._num_samples):
            bad = flat[(flat < 0) | (flat >= self._num_samples)][0]
            raise IndexError(f"position {bad} out of range for a schedule of {self._num_samples} samples")
        return flat

    def _lookup_flat(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._perm is not None:
            flat = np.asarray(self._perm[flat], np.int64)
        elif self._packable() and _is_contiguous(flat):
            # A contiguous run: walking up from each corpus beats walking down from each position.
            lo, hi = int(flat[0]), int(flat[-1]) + 1
            corpus, index = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
            self._fill_fair(lo, hi, corpus, index)
            return corpus, index
        corpus, index = np.empty_like(flat), np.empty_like(flat)
        for lo in range(0, flat.size, _BLOCK):  # blocks keep the walk's work arrays in L2
            corpus[lo : lo + _BLOCK], index[lo : lo + _BLOCK] = self._tree.descend(flat[lo : lo + _BLOCK])
        return corpus, index

    def _fill_fair(self, lo: int, hi: int, out_c: np.ndarray, out_i: np.ndarray) -> None:
        """Write the fair order's positions ``[lo, hi)`` (see :class:`_Placement`), on one thread."""
        if hi > lo:
            if self._placement is None:
                self._placement = _Placement(self._tree)
            self._placement.fill(lo, hi, out_c, out_i)
