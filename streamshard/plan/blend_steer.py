"""A blend whose weights changed mid-run: blend position -> (corpus, corpus sample), pure (numpy, no I/O).

``BlendedStream.set_weights`` records a ``WeightChange``: the weights, and the rank position they
apply from (an epoch and the topology history of what was consumed of it; an empty history is the
epoch's start). Positions are planned as always (``plan/blend_plan.py``: each global worker a contiguous
block), so what a position had consumed at a change is not a prefix of the epoch: it is the set the
elastic fold leaves out (``elastic.remaining_stream``). The arithmetic:

* **Segments.** Epoch ``e`` starts as segment 0: the weights in force (the last change before it),
  all ``N`` positions, the plain ``BlendMap`` of that epoch. A change at position ``P_i`` of the epoch
  starts segment ``i``: the positions still to come at ``P_i`` (``R_i``, sorted) are blended anew
  with its weights (``BlendMap`` over ``|R_i|`` positions: position ``p``'s place is its rank in
  ``R_i``). A position belongs to the last segment it was still to come in.
* **Pools.** Each corpus is an endless sequence of samples (``J``: stream row ``J % L`` of corpus
  epoch ``J // L``, as before). A segment draws its corpus-``k`` samples, in order, from the front of
  that corpus's *pool*: the samples not yet drawn, in order. At a change, the samples the previous
  segment had assigned to positions still to come go back to the front of the pool; at the epoch's
  end every assignment was delivered. Without changes the pool of epoch ``e`` starts at
  ``e * c_k``: exactly the unsteered blend. So every sample is drawn once over the whole run (each
  row once per corpus epoch), whatever the weights did; a corpus whose weight drops keeps its
  undrawn samples for later.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from .blend_plan import BlendMap, chunk_size
from .blend_schedule import blend_counts
from .elastic import Segment, remaining_stream
from .permutation import mix_seed
from .epoch_plan import EpochPlan, Layout, PlanConfig

_SEGMENT_TAG = 0x5354454552  # ASCII "STEER": the seed domain of a changed segment's shuffled order


@dataclass(frozen=True)
class WeightChange:
    """From rank position ``(epoch, history)`` on, the blend follows ``weights`` (corpus order)."""

    epoch: int
    history: tuple[Segment, ...]
    weights: tuple[float, ...]


class Pool:
    """A corpus's samples not yet drawn, in draw order: ``ranges`` (``[lo, hi)`` each) then ``tail, tail+1, ...``."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray, tail: int) -> None:
        self.lo, self.hi, self.tail = lo.astype(np.int64), hi.astype(np.int64), int(tail)
        self.ends = np.cumsum(self.hi - self.lo)  # items before the end of each range

    @property
    def finite(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def take(self, index: np.ndarray) -> np.ndarray:
        """The samples at draw places ``index``."""
        index = np.asarray(index, dtype=np.int64)
        r = np.searchsorted(self.ends, index, side="right")
        out = self.tail + index - self.finite
        inside = r < len(self.ends)
        ri = r[inside]
        out[inside] = self.lo[ri] + index[inside] - (self.ends[ri] - (self.hi[ri] - self.lo[ri]))
        return out

    def ranges(self, x: int, y: int) -> list[tuple[int, int]]:
        """Draw places ``[x, y)`` as sample ranges, in draw order."""
        out: list[tuple[int, int]] = []
        begin = 0
        for lo, hi in zip(self.lo.tolist(), self.hi.tolist()):
            length = hi - lo
            a, b = max(x, begin), min(y, begin + length)
            if a < b:
                out.append((lo + a - begin, lo + b - begin))
            begin += length
        if y > begin:
            a = max(x, begin)
            out.append((self.tail + a - begin, self.tail + y - begin))
        return out

    def drop(self, count: int) -> "Pool":
        """The pool after its first ``count`` samples were drawn."""
        return Pool.of(self.ranges(count, max(count, self.finite)), self.tail + max(count - self.finite, 0))

    @staticmethod
    def of(ranges: Sequence[tuple[int, int]], tail: int) -> "Pool":
        kept = [(lo, hi) for lo, hi in ranges if hi > lo]
        lo = np.array([r[0] for r in kept], dtype=np.int64)
        hi = np.array([r[1] for r in kept], dtype=np.int64)
        return Pool(lo, hi, tail)


def prefix_counts(blend: BlendMap, x: int) -> np.ndarray:
    """Samples of each corpus among the first ``x`` positions of ``blend`` (both orders)."""
    n = blend.schedule.num_samples
    if x >= n or blend.order == "fair":
        return blend.schedule.prefix_counts(min(x, n))
    c = x // blend.chunk
    labels, _, first = blend._chunk(c)
    return first + np.bincount(labels[: x - c * blend.chunk], minlength=len(first))


def remaining_ranges(num_samples: int, config: PlanConfig, epoch: int, history: Sequence[Segment],
                     layout: Layout) -> np.ndarray:
    """The positions of an epoch still to come after ``history``: sorted, merged ``[lo, hi)`` rows."""
    if not history:
        return np.array([[0, num_samples]], dtype=np.int64)
    stream = None
    plan = None
    for segment in history:
        plan = EpochPlan(layout, config, epoch, segment.global_workers, stream)
        stream = remaining_stream(plan, segment)
    assert stream is not None
    size = chunk_size(num_samples)
    lo, hi = stream.rg * size + stream.lo, stream.rg * size + stream.hi
    order = np.argsort(lo, kind="stable")
    merged: list[list[int]] = []
    for a, b in zip(lo[order].tolist(), hi[order].tolist()):
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return np.array(merged, dtype=np.int64).reshape(-1, 2)


class _Part:
    """One segment of an epoch: its positions (``ranges``), their blend, and each corpus's pool."""

    def __init__(self, ranges: np.ndarray, blend: BlendMap, pools: list[Pool]) -> None:
        self.ranges, self.blend, self.pools = ranges, blend, pools
        self.offsets = np.concatenate([[0], np.cumsum(ranges[:, 1] - ranges[:, 0])]).astype(np.int64)

    def local(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(inside, place)``: whether each position is in this segment's ranges, and its rank there."""
        if not len(self.ranges):
            return np.zeros(len(positions), dtype=bool), np.zeros(len(positions), dtype=np.int64)
        r = np.maximum(np.searchsorted(self.ranges[:, 0], positions, side="right") - 1, 0)
        inside = (positions >= self.ranges[r, 0]) & (positions < self.ranges[r, 1])
        return inside, self.offsets[r] + positions - self.ranges[r, 0]

    def returned(self, later: np.ndarray) -> list[list[tuple[int, int]]]:
        """Per corpus, the samples this segment assigned to ``later``'s positions (all inside this
        segment's), as ranges in draw order."""
        out: list[list[tuple[int, int]]] = [[] for _ in self.pools]
        for a, b in later.tolist():
            _, places = self.local(np.array([a, b - 1], dtype=np.int64))
            x = prefix_counts(self.blend, int(places[0]))
            y = prefix_counts(self.blend, int(places[1]) + 1)
            for k, pool in enumerate(self.pools):
                if y[k] > x[k]:
                    out[k].extend(pool.ranges(int(x[k]), int(y[k])))
        return out


class SteeredMap:
    """One epoch's positions -> ``(corpus, corpus sample)`` under weight changes (the module docstring).

    It offers what ``BlendBatches`` uses of a ``BlendMap``: ``samples(positions)``, ``counts``, ``epoch``.
    """

    def __init__(self, parts: list[_Part], epoch: int) -> None:
        self.parts, self.epoch = parts, epoch
        self.counts = sum(p.blend.counts for p in parts)  # nonzero for every corpus drawn in the epoch

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        part = np.zeros(len(positions), dtype=np.int64)
        places = positions.copy()
        for i, p in enumerate(self.parts[1:], start=1):
            inside, local = p.local(positions)
            part[inside] = i
            places[inside] = local[inside]
        corpus = np.empty_like(positions)
        sample = np.empty_like(positions)
        for i in np.unique(part).tolist():
            mask = part == i
            p = self.parts[i]
            c, j = p.blend.locate(places[mask])
            corpus[mask] = c
            out = np.empty_like(j)
            for k in np.unique(c).tolist():
                km = c == k
                out[km] = p.pools[k].take(j[km])
            sample[mask] = out
        return corpus, sample


class Steering:
    """Every epoch's ``SteeredMap`` for one blend and its list of changes (epochs are computed in order,
    each from the pools the epoch before left)."""

    def __init__(self, base: np.ndarray, changes: Sequence[WeightChange], num_samples: int, order: str, seed: int,
                 layout: Layout, config: PlanConfig, sizes: np.ndarray) -> None:
        self.base, self.changes = np.asarray(base, dtype=np.float64), list(changes)
        self.num_samples, self.order, self.seed = num_samples, order, seed
        self.layout, self.config, self.sizes = layout, config, sizes
        self._epochs = lru_cache(maxsize=8)(self._epoch)

    def epoch_map(self, epoch: int) -> SteeredMap:
        return self._epochs(epoch)[0]

    def weights_at_start(self, epoch: int) -> np.ndarray:
        """The weights in force when ``epoch`` starts (a change at its very start included)."""
        weights = self.base
        for change in self.changes:
            if change.epoch < epoch or (change.epoch == epoch and not change.history):
                weights = np.asarray(change.weights, dtype=np.float64)
        return weights

    def _epoch(self, epoch: int) -> tuple[SteeredMap, list[Pool]]:
        """The epoch's map and the pools it leaves to the next epoch."""
        if epoch == 0 or not any(c.epoch < epoch for c in self.changes):
            counts = blend_counts(self.base, self.num_samples)  # no change before: the plain blend's pools
            pools = [Pool.of([], epoch * int(c)) for c in counts]
        else:
            pools = self._epochs(epoch - 1)[1]
        n = self.num_samples
        parts = [_Part(np.array([[0, n]], dtype=np.int64),
                       self._blend(self.weights_at_start(epoch), n, epoch, 0), pools)]
        for i, change in enumerate(c for c in self.changes if c.epoch == epoch and c.history):
            ranges = remaining_ranges(n, self.config, epoch, change.history, self.layout)
            last = parts[-1]
            returned = last.returned(ranges)
            pools = [_join(back, last.pools[k].drop(int(last.blend.counts[k]))) for k, back in enumerate(returned)]
            size = int((ranges[:, 1] - ranges[:, 0]).sum())
            parts.append(_Part(ranges, self._blend(np.asarray(change.weights), size, epoch, i + 1), pools))
        last = parts[-1]
        after = [last.pools[k].drop(int(last.blend.counts[k])) for k in range(len(last.pools))]
        return SteeredMap(parts, epoch), after

    def _blend(self, weights: np.ndarray, size: int, epoch: int, part: int) -> BlendMap:
        counts = blend_counts(weights, size)
        empty = np.flatnonzero((counts > 0) & (self.sizes == 0))
        if empty.size:
            raise ValueError(f"corpus {int(empty[0])} has no rows but the weights give it {int(counts[empty[0]])} samples")
        seed = self.seed if part == 0 else mix_seed(_SEGMENT_TAG, self.seed, part)
        return BlendMap(weights, size, self.order, seed, epoch)


def _join(front: list[tuple[int, int]], rest: Pool) -> Pool:
    """``front`` ranges, then everything in ``rest``."""
    return Pool.of(list(front) + list(zip(rest.lo.tolist(), rest.hi.tolist())), rest.tail)
