"""``BlendPlan`` and ``blend_length``: the pure arithmetic of a blend epoch (numpy, no I/O, no torch).

How long a blend epoch is, which positions each global worker owns, which corpus fills each row
of each batch, and which stream rows of which corpus epoch a worker reads.
:class:`~streamshard.blend.BlendedStream` reads those rows; this module never touches a file.

The model:

* One blend epoch is ``N`` samples (``num_samples``, or derived from ``stop``); corpus ``k``
  gets exactly ``c_k = blend_counts(weights, N)[k]`` of them, laid out by the fair
  :class:`~streamshard.blend_schedule.BlendSchedule`.
* Each corpus is an endless sequence of its own epochs, corpus epoch ``E`` being the corpus's
  stream order for ``(its seed, E)`` with ONE global worker. Blend epoch ``e`` takes samples
  ``[e * c_k, (e + 1) * c_k)`` of that sequence: sample ``J`` is stream row ``J % L_k`` of corpus
  epoch ``J // L_k`` (``L_k`` rows in the corpus). So every row appears exactly once per corpus
  epoch, a corpus that yields fewer rows than its size continues where it stopped in the next
  blend epoch (no row is starved), and a corpus that yields more cycles through freshly
  reshuffled corpus epochs.
* The ``N`` positions are cut into ``G = world_size * max(num_workers, 1)`` contiguous blocks
  balanced like ``plan.py``. In the fair order each corpus's share of a block is a contiguous
  range of its samples, so a worker reads one contiguous stretch of each corpus stream.
* ``order="shuffled"`` keeps the blocks and their per-corpus totals and reads, and permutes the
  corpus labels *within each worker's block* (a keyed permutation, so batch composition varies
  like sampling without replacement). A globally shuffled interleave would scatter every
  worker's reads over all of every corpus; this keeps reads sequential.
* Every worker yields ``steps`` batches of ``batch_size`` rows; the short last one and any
  extra ones are padded (``sample_id`` and ``corpus`` -1), like ``ParquetStream(uneven="pad")``.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from .blend_schedule import ORDERS, BlendSchedule, blend_counts
from .permutation import Permutation, mix_seed

__all__ = ["BlendPlan", "blend_length"]

STOPS = ("all_exhausted", "first_exhausted")
_WITHIN_BLOCK_TAG = 0x424C4B5348  # ASCII "BLKSH": the within-block shuffle's own seed domain
_COUNT_CHUNK = 1 << 16  # positions per vector op when counting labels to resume a shuffled block


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
    the answer is found by a scan between exact integer bounds (about ``sum(w) / min(w)`` steps
    at worst, usually a handful).
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


class BlendPlan:
    """Pure plan of one blend epoch for ``num_workers`` global workers (see the module docstring).

    ``weights`` and ``sizes`` are per corpus (same order); the plan never touches a file.
    """

    def __init__(self, weights: Any, sizes: Any, num_samples: int, batch_size: int, num_workers: int,
                 epoch: int = 0, seed: int = 0, order: str = "fair") -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if num_workers < 1 or batch_size < 1 or epoch < 0:
            raise ValueError(f"need num_workers >= 1, batch_size >= 1, epoch >= 0; got "
                             f"{num_workers}, {batch_size}, {epoch}")
        self.schedule = BlendSchedule(weights, num_samples)  # fair; "shuffled" is applied per block
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.counts = self.schedule.counts
        empty = np.flatnonzero((self.counts > 0) & (self.sizes == 0))
        if empty.size:
            raise ValueError(f"corpus {int(empty[0])} has no rows but its weight gives it "
                             f"{int(self.counts[empty[0]])} of {num_samples} samples")
        self.num_samples, self.batch_size, self.num_workers = int(num_samples), int(batch_size), int(num_workers)
        self.epoch, self.seed, self.order = int(epoch), int(seed), order
        self._perm: tuple[int, Permutation] | None = None

    def block_bounds(self, worker: int) -> tuple[int, int]:
        """Positions ``[begin, end)`` of the fair schedule owned by global worker ``worker``."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker}")
        base, rem = divmod(self.num_samples, self.num_workers)
        begin = worker * base + min(worker, rem)
        return begin, begin + base + (worker < rem)

    @property
    def steps(self) -> int:
        """Batches every worker yields (the largest block's batch count; the rest pad)."""
        largest_block = -(-self.num_samples // self.num_workers)
        return -(-largest_block // self.batch_size)

    def real_batches(self, worker: int) -> int:
        """Batches of ``worker`` that hold at least one real row."""
        begin, end = self.block_bounds(worker)
        return -(-(end - begin) // self.batch_size)

    def corpus_ranges(self, worker: int, skip: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per corpus: the block's blend-index range ``[first, last)`` and where reading starts
        after the worker's first ``skip`` batches."""
        begin, end = self.block_bounds(worker)
        first, last = self.schedule.prefix_counts(begin), self.schedule.prefix_counts(end)
        done = min(begin + skip * self.batch_size, end)
        if self.order == "fair":
            return first, last, self.schedule.prefix_counts(done)
        start = first.copy()
        for lo in range(begin, done, _COUNT_CHUNK):  # a shuffled block's prefix must be counted
            corpus = self._labels(begin, end, np.arange(lo - begin, min(lo + _COUNT_CHUNK, done) - begin))
            start += np.bincount(corpus, minlength=len(start))
        return first, last, start

    def batches(self, worker: int, skip: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(corpus, blend index)`` of each real row of ``worker``'s batches, from batch ``skip``.

        Within a block each corpus's indices rise by one at a time, so rows are read in order."""
        begin, end = self.block_bounds(worker)
        counters = self.corpus_ranges(worker, skip)[2].copy()
        for s in range(skip, self.real_batches(worker)):
            local = np.arange(s * self.batch_size, min((s + 1) * self.batch_size, end - begin), dtype=np.int64)
            if self.order == "fair":
                yield self.schedule.lookup(begin + local)
                continue
            corpus = self._labels(begin, end, local)
            by_corpus = np.argsort(corpus, kind="stable")
            sorted_c = corpus[by_corpus]
            group_start = np.searchsorted(sorted_c, sorted_c, side="left")
            index = np.empty_like(corpus)
            index[by_corpus] = counters[sorted_c] + np.arange(len(corpus)) - group_start
            counters += np.bincount(corpus, minlength=len(counters))
            yield corpus, index

    def segments(self, corpus: int, start: int, last: int) -> list[tuple[int, int, int]]:
        """Blend indices ``[start, last)`` of ``corpus`` as ``(corpus_epoch, begin, end)`` ranges of
        stream rows, one per corpus epoch they touch."""
        size, offset = int(self.sizes[corpus]), self.epoch * int(self.counts[corpus])
        out = []
        j = offset + start
        while j < offset + last:
            corpus_epoch, row = divmod(j, size)
            stop = min(offset + last, (corpus_epoch + 1) * size)
            out.append((corpus_epoch, row, stop - corpus_epoch * size))
            j = stop
        return out

    def _labels(self, begin: int, end: int, local: np.ndarray) -> np.ndarray:
        """Corpus of each local position of the block ``[begin, end)`` in the shuffled order."""
        n = end - begin
        if n > 1:
            if self._perm is None or self._perm[0] != begin:  # one permutation per block, built once
                self._perm = (begin, Permutation(n, mix_seed(_WITHIN_BLOCK_TAG, self.seed, self.epoch, begin, n)))
            local = np.asarray(self._perm[1][local])
        return self.schedule.lookup(begin + local)[0]
