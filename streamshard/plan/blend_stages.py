"""A packed blend of raw-text corpora planned in stages, so its first batches need only a first stage counted.

Pure (numpy only; counting is each corpus's ``StageCounts``). A packed blend (``plan/packing_plan.py``,
``PackedBlendBatches``) blends *sequences*: blend position ``p`` of blend epoch ``e`` is sequence
``J = e * c_k + j`` of corpus ``k``'s endless token stream (``BlendMap``: corpus ``k`` holds
``c_k`` of the epoch's ``N`` positions, its ``j``-th at ``p``), cut every ``seq_len`` tokens, a corpus
epoch's last sequence short. With a tokenizer the tokens are known only once counted, and one plan of
the whole epoch (its positions cut into one contiguous block per global worker) needs nearly every
count before the first batch: the last global worker starts ``(W - 1) / W`` into the blend. So here,
with ``N`` explicit (the map then needs no count):

* each corpus's epoch-0 unit order (its ``stream_order``) is cut into ``Stages`` (``first_bytes *
  c_k / N`` bytes of text first, each next stage twice the last), counted stage after stage;
* blend stage ``i`` is every corpus's stages ``0..i`` counted. Its *bound* ``P_i`` is the longest
  prefix of the epoch's positions whose sequences lie inside those counts: sequence ``J`` of corpus
  ``k`` is *locatable* when the corpus is counted whole (stage ``i`` is its last), or when its tokens
  ``[J * seq_len, (J + 1) * seq_len)`` lie inside the counted prefix of corpus epoch 0 (then it is
  that epoch's full sequence ``J``, whatever the corpus's total turns out to be). The bound depends on
  the counts of stages ``0..i`` only, so a warm start (everything counted) finds the same bounds;
  the last blend stage (every corpus whole) ends at ``N``;
* ``BlendStages`` gives positions ``[P_{i-1}, P_i)`` as stage ``i``'s stream to ``StagePlans``
  (``plan/packing_stages.py``), which plans them as it plans a text corpus's tokens: equal full
  batches per global worker, the rest carried, only the last plan padded, and resume on any topology
  through the same ``Rest``;
* ``StagedBlendBatches`` turns a worker's positions into token reads as ``PackedBlendBatches`` does,
  locating each sequence from the counts at hand (``CorpusTokens``).

A corpus's epoch wrap (sequence ``J`` past its first epoch) is reached only once it is counted whole,
since where epoch 0 ends needs its total. Blend epochs after the first start deep into a large
corpus (``J = e * c_k``): their first plans need the stages up to there (counted on demand, or by the
background count of epoch 0, or from the count cache). The blend's weights cannot change mid-run here
(``set_weights`` is refused by ``PackedStream``): the steered map needs every corpus's sequence count.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import numpy as np

from .batch_plan import BatchSpec, Read
from .blend_plan import BlendMap, chunk_size, position_layout
from .blend_steer import prefix_counts
from .epoch_plan import Layout, Pieces
from .packing_plan import PackedBlendBatches
from .packing_stages import StageCounts, StagedSchedule, Stages

__all__ = ["BlendStages", "CorpusTokens", "StagedBlendBatches", "corpus_first_bytes"]


def corpus_first_bytes(first_bytes: float, counts: np.ndarray) -> np.ndarray:
    """Each corpus's first stage, in bytes of text: ``first_bytes`` shared by the corpora's positions
    (a corpus of no positions is never counted: 0)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = max(int(counts.sum()), 1)
    return np.where(counts > 0, np.maximum(first_bytes * counts / total, 1.0), 0.0)


class CorpusTokens:
    """One corpus of a staged packed blend: where its sequences' tokens are, from the counts at hand.

    ``stages`` cut its epoch-0 unit order; ``orders(E)`` gives corpus epoch ``E``'s unit order (needed
    only once the corpus is counted whole). ``locate`` and ``layout`` are what ``BlendBatches.place``
    asks of a corpus."""

    def __init__(self, name: str, stages: Stages, counts: StageCounts, orders: Any, seq_len: int) -> None:
        self.name, self.stages, self.counts, self.orders, self.seq_len = name, stages, counts, orders, seq_len
        self._cum: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None

    @property
    def layout(self) -> Layout:
        return self.counts.layout()

    def locatable(self, i: int) -> int | None:
        """Sequences of corpus epoch 0 locatable with its stages ``0..i`` counted (counting them now where
        not yet); None when stage ``i`` is its last (counted whole: every sequence, every epoch)."""
        if i >= len(self.stages) - 1:
            self.counts.of(self.stages.order)
            return None
        units = self.stages.order[: self.stages.bounds[i + 1]]
        return int(self.counts.of(units).sum()) // self.seq_len

    def _counted_prefix(self) -> tuple[int, bool]:
        """(units of the epoch-0 order counted from its start, whether that is all of them)."""
        known = self.counts.tokens[self.stages.order] >= 0
        n = len(known) if known.all() else int(np.argmin(known))
        return n, n == len(known)

    def total(self) -> int:
        return int(self.counts.tokens[self.stages.order].sum())

    def sequences(self, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(first token in the endless stream, tokens)`` of each sequence (see ``PackedBlendBatches``)."""
        n, whole = self._counted_prefix()
        if whole:
            tokens = self.total()
            if not tokens:
                raise ValueError(f"corpus {self.name!r} has no tokens but its weight gives it sequences")
            epoch, s = np.divmod(sequence, -(-tokens // self.seq_len))
            return epoch * tokens + s * self.seq_len, np.minimum(self.seq_len, tokens - s * self.seq_len)
        counted = int(self.counts.tokens[self.stages.order[:n]].sum())
        if len(sequence) and int(sequence.max()) >= counted // self.seq_len:
            raise AssertionError(f"corpus {self.name!r}: sequence {int(sequence.max())} planned before it was counted")
        return sequence * self.seq_len, np.full(len(sequence), self.seq_len, dtype=np.int64)

    def _cumulative(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Corpus epoch ``epoch``'s counted units in order and their tokens' running end."""
        n, whole = self._counted_prefix()
        key = (epoch, n)
        if self._cum is None or self._cum[0] != key:
            order = self.stages.order[:n] if epoch == 0 else np.asarray(self.orders(epoch), dtype=np.int64)
            if epoch and not whole:
                raise AssertionError(f"corpus {self.name!r}: epoch {epoch} located before the corpus was counted whole")
            self._cum = (key, order, np.cumsum(self.counts.tokens[order]))
        return self._cum[1], self._cum[2]

    def locate(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(corpus epoch, row group, row)`` of each token of the endless stream (row: the token's
        offset in its row group's document-ordered tokens)."""
        _, whole = self._counted_prefix()
        if whole:
            epoch, offset = np.divmod(tokens, max(self.total(), 1))
        else:
            epoch, offset = np.zeros_like(tokens), tokens
        rg, row = np.empty_like(tokens), np.empty_like(tokens)
        for e in np.unique(epoch).tolist():
            mask = epoch == e
            order, ends = self._cumulative(int(e))
            at = np.searchsorted(ends, offset[mask], side="right")
            if len(at) and int(at.max()) >= len(order):
                raise AssertionError(f"corpus {self.name!r}: a token located past the counted units")
            rg[mask] = order[at]
            row[mask] = offset[mask] - (ends[at] - self.counts.tokens[order[at]])
        return epoch, rg, row


class BlendStages:
    """A packed blend epoch's positions cut into stages: the source ``StagePlans`` plans (see the module
    docstring). ``corpora[k]`` is None for a corpus the epoch gives no position."""

    def __init__(self, blend: BlendMap, corpora: list[CorpusTokens | None]) -> None:
        self.blend, self.corpora = blend, corpora
        self.num_samples = int(blend.schedule.num_samples)
        active = [c for c in corpora if c is not None]
        self._len = max([len(c.stages) for c in active] + [1])  # (corpora of no row groups: one stage, whole)
        self._bounds: dict[int, int] = {}

    def __len__(self) -> int:
        return self._len

    def bound(self, i: int) -> int:
        """``P_i``: the positions ``[0, P_i)`` whose sequences are locatable with every corpus's stages
        ``0..i`` counted (counts them now where not yet); ``N`` at the last stage."""
        if i < 0:
            return 0
        if i not in self._bounds:
            bound = self.num_samples
            for k, corpus in enumerate(self.corpora):
                if corpus is None:
                    continue
                q = corpus.locatable(i)
                if q is not None:
                    bound = min(bound, self._occurrence(k, q - self.blend.epoch * int(self.blend.counts[k])))
            self._bounds[i] = bound if i < self._len - 1 else self.num_samples
        return self._bounds[i]

    def _occurrence(self, k: int, m: int) -> int:
        """Where corpus ``k``'s ``m``-th index of the epoch (from 0; its first below 0) lies; ``N`` past
        its last: the end of the prefix of positions holding only its indices before ``m``."""
        m = max(m, 0)
        if m >= int(self.blend.counts[k]):
            return self.num_samples
        lo, hi = m, self.num_samples  # the least x with m + 1 of corpus k among positions [0, x)
        while lo < hi:
            mid = (lo + hi) // 2
            if int(prefix_counts(self.blend, mid)[k]) >= m + 1:
                hi = mid
            else:
                lo = mid + 1
        return lo - 1

    def stream(self, i: int) -> Pieces:
        """Positions ``[P_{i-1}, P_i)`` over the epoch's position layout (chunks of ``chunk_size``)."""
        return position_pieces(self.bound(i - 1), self.bound(i), self.num_samples)

    def ready(self, i: int) -> bool:
        """Whether stage ``i``'s bound needs no counting (every corpus's stages up to ``i`` counted)."""
        for corpus in self.corpora:
            if corpus is not None:
                last = min(i, len(corpus.stages) - 1)
                if not corpus.counts.counted(corpus.stages.order[: corpus.stages.bounds[last + 1]]):
                    return False
        return True

    def layout(self) -> Layout:
        return position_layout(self.num_samples)


def position_pieces(a: int, b: int, num_samples: int) -> Pieces:
    """Positions ``[a, b)`` as pieces of ``position_layout(num_samples)``'s chunks."""
    if b <= a:
        return Pieces.empty()
    size = chunk_size(num_samples)
    chunks = np.arange(a // size, (b - 1) // size + 1, dtype=np.int64)
    lo = np.maximum(a - chunks * size, 0)
    hi = np.minimum(b - chunks * size, size)
    return Pieces(chunks, lo, hi)


class StagedBlendBatches(PackedBlendBatches):
    """A worker's batches of a staged packed blend: its positions from stage plans (``StagedSchedule``),
    each a sequence located by ``CorpusTokens``. Nothing past the plans reached is built or counted,
    and ``upcoming_reads`` pauses at a plan whose stage is still being counted."""

    def __init__(self, positions: StagedSchedule, blend: BlendMap, corpora: list[CorpusTokens], seq_len: int,
                 batch_size: int) -> None:
        self.positions, self.blend, self.corpora = positions, blend, corpora  # type: ignore[assignment]
        self._keys: dict[tuple[int, int, int], int] = {}
        self.seq_len, self.slots = seq_len, seq_len * batch_size

    @property
    def steps(self) -> int:  # type: ignore[override]
        return self.positions.steps  # counts every stage

    @property
    def real_batches(self) -> int:  # type: ignore[override]
        return self.positions.real_batches

    def sequences(self, corpus: np.ndarray, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        first, length = np.empty_like(sequence), np.empty_like(sequence)
        for k in np.unique(corpus).tolist():
            mask = corpus == k
            first[mask], length[mask] = self.corpora[k].sequences(sequence[mask])
        return first, length

    def _specs(self, start: int) -> Iterator[BatchSpec]:
        index = start
        while self.positions.plans.locate(index) is not None:
            yield self.batch(index)
            index += 1

    def upcoming_reads(self, start: int) -> Iterator[tuple[int, Read]]:
        return _UpcomingBlend(self, start)


class _UpcomingBlend:
    """``StagedBlendBatches.upcoming_reads``: the reads of batches ``start..`` spec by spec; it pauses
    (``next`` says none for now; a later ``next`` goes on) where the next plan's stage is not counted."""

    def __init__(self, schedule: StagedBlendBatches, start: int) -> None:
        self.schedule, self.index, self.pending = schedule, start, deque()  # type: ignore[var-annotated]
        self.ended = False

    def __iter__(self) -> "_UpcomingBlend":
        return self

    def __next__(self) -> tuple[int, Read]:
        while not self.pending:
            plans = self.schedule.positions.plans
            while not self.ended and self.index >= plans.starts[-1]:  # (``starts`` grows last when a plan is built)
                j = len(plans.starts) - 1  # the next plan to build
                if j >= len(plans.sources):
                    self.ended = True
                elif not plans.ready(j):
                    raise StopIteration  # for now: its stage is being counted
                else:
                    plans.plan(j)
            if self.ended:
                raise StopIteration
            self.pending.extend(self.schedule.batch(self.index).reads.items())
            self.index += 1
        return self.pending.popleft()
