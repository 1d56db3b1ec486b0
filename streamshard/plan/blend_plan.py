"""The pure arithmetic of a blend epoch (numpy, no I/O, no torch).

* One blend epoch is ``N`` *positions* (``num_samples``, or derived from ``stop`` by
  :func:`blend_length`); corpus ``k`` gets exactly ``c_k = blend_counts(weights, N)[k]`` of them.
* :class:`BlendMap` maps a position to ``(corpus, index)``: the fair
  :class:`~streamshard.plan.blend_schedule.BlendSchedule` (every prefix within 2 samples of each
  share), or ``order="shuffled"``: inside each chunk of :data:`CHUNK` positions the corpus labels
  are permuted by a (seed, epoch, chunk) key. In both orders each corpus's indices rise along the
  positions, so any contiguous range of positions reads each corpus sequentially, and the map does
  not depend on the topology.
* Positions are planned exactly like rows of a dataset (``plan/epoch_plan.py``): laid end to end in chunks,
  cut into one contiguous block per global worker, batched, padded to equal steps; so resuming
  and elastic resizing are the same arithmetic as for a ``ParquetStream``.
* Each corpus is an endless sequence of its own epochs (its stream order for ``(its seed, E)``
  with one global worker). Index ``j`` of blend epoch ``e`` is sample ``J = e * c_k + j`` of that
  sequence: stream row ``J % L_k`` of corpus epoch ``J // L_k`` (``L_k`` rows). Every row appears
  once per corpus epoch; a corpus with fewer samples than rows continues where it stopped in the
  next blend epoch, one with more cycles through freshly reshuffled corpus epochs.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from .batch_plan import BatchSpec, Read, Schedule, StreamSchedule, occurrence_rank
from .blend_schedule import BlendSchedule, blend_counts
from .permutation import Permutation, mix_seed
from .epoch_plan import EpochPlan, Layout, PlanConfig

__all__ = ["BlendMap", "BlendBatches", "blend_length", "position_layout"]

STOPS = ("all_exhausted", "first_exhausted")
CHUNK = 1 << 16  # positions whose corpus labels a shuffled blend permutes together
_MAX_CHUNKS = 1 << 20
_CHUNK_TAG = 0x424C4B5348  # ASCII "BLKSH": the shuffled order's own seed domain


def _scaled_weights(weights: np.ndarray) -> tuple[list[int], int]:
    """Weights as exact integers over a common denominator (floats are dyadic rationals)."""
    ratios = [float(x).as_integer_ratio() for x in weights]
    denom = max(q for _, q in ratios)
    scaled = [p * (denom // q) for p, q in ratios]
    return scaled, sum(scaled)


def blend_length(weights: Any, sizes: Any, stop: str = "all_exhausted") -> int:
    """Samples in one blend epoch for corpora of ``sizes`` rows under the ``stop`` rule.

    ``"all_exhausted"``: the smallest N giving every positive-weight corpus at least its size;
    ``"first_exhausted"``: the largest N giving no corpus more than its size. Counts are
    ``blend_counts(weights, N)``; since largest-remainder apportionment is not monotone in N,
    the answer is found by a scan between exact integer bounds (a handful of steps, usually).
    """
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")
    w = np.asarray(weights, dtype=np.float64)
    blend_counts(w, 0)  # validates the weights
    lengths = [int(x) for x in sizes]
    scaled, total = _scaled_weights(w)
    active = [k for k, s in enumerate(scaled) if s > 0]
    if stop == "all_exhausted":
        lo = max((lengths[k] - 1) * total // scaled[k] + 1 for k in active)
        hi = max(-(-lengths[k] * total // scaled[k]) for k in active)
        candidates = range(lo, hi + 1)
    else:
        lo = min(lengths[k] * total // scaled[k] for k in active)
        hi = min(-(-(lengths[k] + 1) * total // scaled[k]) - 1 for k in active)
        candidates = range(hi, lo - 1, -1)
    for n in candidates:
        counts = blend_counts(w, n)
        if stop == "all_exhausted" and all(counts[k] >= lengths[k] for k in active):
            return n
        if stop == "first_exhausted" and all(counts[k] <= lengths[k] for k in active):
            return n
    return candidates[-1]  # unreachable: the last candidate satisfies the rule by construction


def chunk_size(num_samples: int) -> int:
    return max(CHUNK, -(-num_samples // _MAX_CHUNKS))


def position_layout(num_samples: int) -> Layout:
    """The positions of a blend epoch as a layout of chunks (one "file"), for ``plan/epoch_plan.py``."""
    size = chunk_size(num_samples)
    full, rest = divmod(num_samples, size)
    rows = np.full(full + (rest > 0), size, dtype=np.int64)
    if rest:
        rows[-1] = rest
    return Layout(rows, np.zeros(len(rows), dtype=np.int64))


def position_config(batch_size: int) -> PlanConfig:
    """Positions are never reordered by the plan itself: the blend map owns the order."""
    return PlanConfig(unit="row_group", shuffle=False, batch_size=batch_size, uneven="pad")


class BlendMap:
    """Blend positions of one epoch -> ``(corpus, index)``; see the module docstring."""

    def __init__(self, weights: Any, num_samples: int, order: str, seed: int, epoch: int) -> None:
        self.schedule = BlendSchedule(weights, num_samples)
        self.counts = self.schedule.counts
        self.order, self.seed, self.epoch = order, seed, epoch
        self.chunk = chunk_size(num_samples)
        self._memo: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(corpus, corpus sample)`` of each position: index ``j`` of this epoch is sample
        ``epoch * c_k + j`` of the corpus's endless sequence (``plan/blend_steer.py`` when weights changed)."""
        corpus, index = self.locate(positions)
        return corpus, self.epoch * self.counts[corpus] + index

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.order == "fair" or len(positions) == 0:
            return self.schedule.lookup(positions)
        corpus, index = np.empty_like(positions), np.empty_like(positions)
        chunks = positions // self.chunk
        for c in np.unique(chunks).tolist():
            mask = chunks == c
            labels, rank, first = self._chunk(c)
            local = positions[mask] - c * self.chunk
            corpus[mask] = labels[local]
            index[mask] = first[labels[local]] + rank[local]
        return corpus, index

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._memo is None or self._memo[0] != c:
            lo = c * self.chunk
            n = min(self.chunk, self.schedule.num_samples - lo)
            perm = Permutation(n, mix_seed(_CHUNK_TAG, self.seed, self.epoch, c))
            labels = self.schedule.lookup(lo + np.asarray(perm[np.arange(n, dtype=np.int64)], dtype=np.int64))[0]
            self._memo = (c, labels, occurrence_rank(labels), self.schedule.prefix_counts(lo))
        return self._memo[1], self._memo[2], self._memo[3]


class CorpusOrder:
    """Where corpus sample ``J`` (over its endless sequence of epochs) lives: row group and row."""

    def __init__(self, layout: Layout, config: PlanConfig) -> None:
        self.layout, self.config = layout, config
        self.size = int(layout.rg_rows.sum())
        self._plan = lru_cache(maxsize=4)(lambda e: EpochPlan(layout, config, e, 1))

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(corpus epoch, row group, row)`` of each sample (rising samples: sequential reads)."""
        epoch, stream_row = np.divmod(samples, self.size)
        rg, row = np.empty_like(samples), np.empty_like(samples)
        for e in np.unique(epoch).tolist():
            mask = epoch == e
            plan = self._plan(e)
            ends = plan.ends
            piece = np.searchsorted(ends, stream_row[mask], side="right")
            position = plan.stream.lo[piece] + stream_row[mask] - (ends[piece] - plan.stream.rows[piece])
            rg[mask] = plan.stream.rg[piece]
            row[mask] = plan.rows_at(plan.stream.rg[piece], position)
        return epoch, rg, row


class BlendBatches(Schedule):
    """A worker's blend batches: its schedule of positions, each position read from its corpus."""

    def __init__(self, positions: StreamSchedule, blend: Any, corpora: list[CorpusOrder]) -> None:
        """``blend``: a ``BlendMap``, or a ``blend_steer.SteeredMap`` (its ``samples``, ``counts``, ``epoch``)."""
        self.positions, self.blend, self.corpora = positions, blend, corpora
        self.steps, self.real_batches = positions.steps, positions.real_batches
        self._keys: dict[tuple[int, int, int], int] = {}

    def batch(self, index: int) -> BatchSpec:
        spec = self.positions.batch(index)
        if not spec.rows:
            return spec
        corpus, samples = self.blend.samples(spec.sample_id)
        reads, key, row, sample_id = self.place(corpus, samples)
        return BatchSpec(index, reads, key, row, sample_id, spec.padding, corpus=corpus)

    def place(self, corpus: np.ndarray, samples: np.ndarray) -> tuple[dict[int, Read], np.ndarray, np.ndarray, np.ndarray]:
        """Where each corpus sample lives: ``(reads in first-use order, read key, row, sample id)`` per sample.

        One key per (corpus, corpus epoch, row group), stable over the pass: a Python step per
        distinct read, not per row."""
        n = len(corpus)
        key, row, sample_id = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        reads: dict[int, Read] = {}
        for k in np.unique(corpus).tolist():
            mask = corpus == k
            order = self.corpora[k]
            epoch, rg, rows = order.locate(samples[mask])
            groups = len(order.layout.rg_rows)
            pairs, inverse = np.unique(epoch * groups + rg, return_inverse=True)  # (corpus epoch, row group)
            pair_epoch, pair_rg = np.divmod(pairs, groups)
            ids = np.array([self._keys.setdefault((k, e, g), len(self._keys))
                            for e, g in zip(pair_epoch.tolist(), pair_rg.tolist())], dtype=np.int64)
            key[mask] = ids[inverse.reshape(-1)]
            row[mask] = rows
            sample_id[mask] = order.layout.rg_first_id[rg] + rows
            for kid, e, g in zip(ids.tolist(), pair_epoch.tolist(), pair_rg.tolist()):
                reads[kid] = Read(k, g, e)
        keys, first = np.unique(key, return_index=True)
        return {kid: reads[kid] for kid in keys[np.argsort(first)].tolist()}, key, row, sample_id

    def batches(self, start: int = 0) -> Iterator[BatchSpec]:
        """Specs in order, each naming the reads no later batch needs: a corpus is read in order, so a
        read is finished once a batch uses a later read of the same corpus."""
        open_reads: dict[int, set[int]] = {}
        for spec in self._specs(start):
            used: dict[int, set[int]] = {}
            for kid, what in spec.reads.items():
                used.setdefault(what.source, set()).add(kid)
            done: list[int] = []
            for source, kids in used.items():
                done.extend(open_reads.get(source, set()) - kids)
                open_reads[source] = kids
            yield replace(spec, done=tuple(sorted(set(done))))

    def _specs(self, start: int) -> Iterator[BatchSpec]:
        return (self.batch(index) for index in range(start, self.steps))

    def shape_donor(self) -> BatchSpec | None:
        if self.real_batches > 0:
            return self.batch(self.real_batches - 1)
        k = int(np.flatnonzero(self.blend.counts)[0]) if self.blend.counts.any() else None
        if k is None:
            return None
        order = self.corpora[k]
        _, rg, row = order.locate(np.zeros(1, dtype=np.int64))
        rows = self.positions.plan.config.batch_size or 1
        return BatchSpec(-1, {0: Read(k, int(rg[0]))}, np.zeros(1, np.int64), row,
                         order.layout.rg_first_id[rg] + row, rows - 1, corpus=np.full(1, k, np.int64))
