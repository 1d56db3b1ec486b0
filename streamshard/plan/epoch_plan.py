"""Pure planning: (row-group layout, config, epoch, number of global workers) -> each worker's slices.

No I/O and no torch here: this is where the invariants live (exactly once, equal steps,
determinism), so property tests aim at it directly.

The model: an epoch is a *stream*, a sequence of segments ``(row_group, lo, hi)`` meaning rows
``[lo, hi)`` of a row group in its emitted order (a (seed, epoch, row group) permutation of its
rows when shuffling, file order otherwise). At the start of an epoch the stream is every
non-empty row group, whole, in *stream order* (catalog order, or a (seed, epoch) permutation of
units: row groups, or files with their row groups kept together). The stream's T rows are cut
into ``G`` contiguous blocks balanced by rows (``T // G`` each, the first ``T % G`` one more),
and global worker ``g`` delivers block ``g`` in stream order. A row group on a block boundary is
split between two workers. Everything a worker needs is a cumulative sum and two binary
searches: O(stream length) memory, never O(row groups x workers).

Because the rest of an interrupted epoch is again a stream (``plan/elastic.py``), resuming on a
different topology is the same planning problem.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .permutation import Permutation, mix_seed
from .sized_lru import SizedLRU
from .unit_order import spread_order, window_starts
from .validate import check_int

_ROW_ORDER_CACHE = 1 << 21  # rows of row-group orders an epoch plan keeps (int64: 16 MiB)

UNITS = ("row_group", "file")
UNEVEN_POLICIES = ("pad", "drop")

# Which rows a configuration delivers in which order changes with these rules; checkpoints record it
# (3: files spread over the epoch, shuffle windows widened around dominating row groups).
ORDER_VERSION = 3

# Domain tags keep the seeds of different shuffles apart.
_UNIT_ORDER, _IN_FILE_ORDER, _ROW_ORDER, _WINDOW_ORDER = 1, 2, 3, 4


@dataclass(frozen=True)
class PlanConfig:
    """How a dataset is cut into batches; validated on construction."""

    unit: str = "row_group"
    shuffle: bool = False
    seed: int = 0
    batch_size: int | None = None
    uneven: str = "pad"
    shuffle_window: int = 1  # consecutive pieces of a worker whose rows are interleaved at random
    shuffle_rows: bool = True  # with shuffle, permute the rows inside each row group (False: tokens, kept in order)

    def __post_init__(self) -> None:
        check_int(self.shuffle_window, "shuffle_window", 1)
        if self.shuffle_window > 1 and not self.shuffle:
            raise ValueError("shuffle_window > 1 mixes rows at random, so it needs shuffle=True")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.uneven not in UNEVEN_POLICIES:
            raise ValueError(f"uneven must be one of {UNEVEN_POLICIES}, got {self.uneven!r}")
        check_int(self.batch_size, "batch_size", 1, none_ok=True)
        check_int(self.seed, "seed", 0, 2**64 - 1)


@dataclass(frozen=True)
class Layout:
    """The shape of a catalog that planning needs: rows per row group and its file."""

    rg_rows: np.ndarray  # int64 per row group, catalog order
    rg_file: np.ndarray  # int64 per row group: file index, non-decreasing

    @cached_property
    def rg_first_id(self) -> np.ndarray:
        first = np.zeros(len(self.rg_rows), dtype=np.int64)
        if len(self.rg_rows) > 1:
            np.cumsum(self.rg_rows[:-1], out=first[1:])
        return first

    @cached_property
    def num_files(self) -> int:
        return int(self.rg_file[-1]) + 1 if len(self.rg_file) else 0


@dataclass(frozen=True)
class Pieces:
    """Segments in order: rows ``[lo, hi)`` of row group ``rg`` (catalog index), in its emitted order."""

    rg: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def __len__(self) -> int:
        return len(self.rg)

    @property
    def rows(self) -> np.ndarray:
        return self.hi - self.lo

    def take(self, index: np.ndarray | slice) -> "Pieces":
        return Pieces(self.rg[index], self.lo[index], self.hi[index])

    @staticmethod
    def empty() -> "Pieces":
        none = np.zeros(0, dtype=np.int64)
        return Pieces(none, none, none)

    @staticmethod
    def concat(parts: list["Pieces"]) -> "Pieces":
        if not parts:
            return Pieces.empty()
        return Pieces(*(np.concatenate([getattr(p, f) for p in parts]).astype(np.int64) for f in ("rg", "lo", "hi")))


@dataclass(frozen=True)
class WorkerPlan:
    """What one global worker delivers in one epoch.

    ``steps`` batches in total: the first ``real_batches`` carry rows, the rest are padding
    (``uneven="pad"``). With ``uneven="drop"`` the worker stops after ``steps`` batches.
    """

    worker: int
    pieces: Pieces
    steps: int
    real_batches: int
    rows: int  # rows this worker delivers (after dropping)


class EpochPlan:
    """The plan of one epoch (or of the rest of one) for ``num_workers`` global workers."""

    def __init__(
        self, layout: Layout, config: PlanConfig, epoch: int, num_workers: int, stream: Pieces | None = None
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"number of global workers must be >= 1, got {num_workers}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.layout, self.config, self.epoch, self.num_workers = layout, config, epoch, num_workers
        self._row_orders: SizedLRU[int, np.ndarray] = SizedLRU(_ROW_ORDER_CACHE, len)  # recent groups' row orders
        self._row_orders_lock = threading.Lock()  # a plan's schedules may run in several threads
        self.stream = stream if stream is not None else initial_stream(layout, config, epoch)
        self.ends = np.cumsum(self.stream.rows, dtype=np.int64)
        self.total_rows = int(self.ends[-1]) if len(self.ends) else 0

    # -- blocks -----------------------------------------------------------------------------
    def block_bounds(self, workers: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Stream row range ``[begin, end)`` of the given global worker(s)."""
        g = np.asarray(workers, dtype=np.int64)
        base, rem = divmod(self.total_rows, self.num_workers)
        begin = g * base + np.minimum(g, rem)
        return begin, begin + base + (g < rem)

    def pieces_per_worker(self, workers: np.ndarray | None = None) -> np.ndarray:
        """Number of pieces each worker's block holds (vectorised over workers)."""
        g = np.arange(self.num_workers) if workers is None else np.asarray(workers)
        begin, end = self.block_bounds(g)
        first = np.searchsorted(self.ends, begin, side="right")
        last = np.searchsorted(self.ends, end, side="left")
        return np.where(end > begin, last - first + 1, 0)

    def batches_per_worker(self) -> np.ndarray:
        """Batches of real rows each worker could yield before equalising."""
        if self.config.batch_size is None:
            return self.pieces_per_worker()
        begin, end = self.block_bounds(np.arange(self.num_workers))
        rows, bs = end - begin, self.config.batch_size
        return -(-rows // bs) if self.config.uneven == "pad" else rows // bs

    @cached_property
    def steps(self) -> int:
        """Batches every worker yields: the max (pad) or min (drop) of the per-worker counts."""
        if self.config.batch_size is not None:
            # Blocks differ by at most one row, so the extremes come from the first and last block.
            begin, end = self.block_bounds(np.array([0, self.num_workers - 1]))
            rows, bs = end - begin, self.config.batch_size
            if self.config.uneven == "pad":
                return int((-(-rows // bs)).max())
            return int((rows // bs).min())
        counts = self.pieces_per_worker()
        return int(counts.max() if self.config.uneven == "pad" else counts.min())

    # -- one worker -------------------------------------------------------------------------
    def pieces(self, worker: int) -> Pieces:
        """The pieces of worker ``worker``'s block, in delivery order (before dropping)."""
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker}")
        begin, end = (int(x) for x in self.block_bounds(worker))
        return self.pieces_in(begin, end)

    def pieces_in(self, begin: int, end: int) -> Pieces:
        """The pieces holding stream rows ``[begin, end)``, in stream order."""
        if not 0 <= begin <= end <= self.total_rows:
            raise ValueError(f"stream range [{begin}, {end}) is outside [0, {self.total_rows})")
        if end == begin:
            return Pieces.empty()
        first = int(np.searchsorted(self.ends, begin, side="right"))
        last = int(np.searchsorted(self.ends, end, side="left"))
        segments = self.stream.take(slice(first, last + 1))
        seg_begin = self.ends[first : last + 1] - segments.rows
        lo = segments.lo + np.maximum(begin - seg_begin, 0)
        hi = segments.lo + np.minimum(end - seg_begin, segments.rows)
        return Pieces(segments.rg, lo, hi)

    def worker_plan(self, worker: int) -> WorkerPlan:
        """What ``worker`` delivers: its block, cut to ``steps`` batches, in delivery order."""
        pieces = self.pieces(worker)
        steps, bs = self.steps, self.config.batch_size
        if bs is None:
            real = min(len(pieces), steps)
            pieces = pieces.take(slice(0, real))
        else:
            rows = int(pieces.rows.sum())
            real = min(-(-rows // bs), steps)
            pieces = keep_rows(pieces, min(rows, steps * bs))
        return WorkerPlan(worker, pieces, steps, real, int(pieces.rows.sum()))

    def dropped_rows(self) -> int:
        """Rows no worker delivers this epoch (always 0 with ``uneven="pad"``)."""
        if self.config.uneven == "pad":
            return 0
        steps, bs = self.steps, self.config.batch_size
        begin, end = self.block_bounds(np.arange(self.num_workers))
        if bs is not None:
            return int(np.maximum(end - begin - steps * bs, 0).sum())
        if steps == 0:
            return self.total_rows
        # steps is the smallest piece count, so every worker has a piece number steps-1.
        first = np.searchsorted(self.ends, begin, side="right")
        kept = np.minimum(self.ends[first + steps - 1], end) - begin
        return int((end - begin - kept).sum())

    def windows(self, pieces: Pieces) -> list[slice]:
        """The groups of consecutive pieces whose rows are interleaved (one piece each without a window):
        ``shuffle_window`` pieces, more when one would dominate (``unit_order.window_starts``)."""
        starts = window_starts(pieces.rows, self.config.shuffle_window, self.mean_group_rows).tolist()
        return [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]

    @cached_property
    def mean_group_rows(self) -> float:
        """Mean rows of the layout's non-empty row groups (what bounds a shuffle window's rows)."""
        rows = self.layout.rg_rows[self.layout.rg_rows > 0]
        return float(rows.mean()) if len(rows) else 1.0

    def window_labels(self, window: Pieces) -> np.ndarray:
        """For each emitted row of a window, which of its pieces it comes from.

        Each piece keeps its own row order (already a permutation of its row group), and the
        pieces are interleaved by a uniformly random arrangement of their labels, so the
        window's rows come out in a uniformly random order while any prefix of the window is
        a prefix of every piece: the rest stays a stream of segments (elastic resume).
        """
        rows = window.rows
        labels = np.repeat(np.arange(len(window), dtype=np.int64), rows)
        if len(window) <= 1:
            return labels
        key = mix_seed(self.config.seed, self.epoch, _WINDOW_ORDER, int(window.rg[0]), int(window.lo[0]))
        return labels[Permutation(len(labels), key)[np.arange(len(labels), dtype=np.int64)]]

    def split_delivered(self, pieces: Pieces, rows: int) -> tuple[Pieces, Pieces]:
        """``pieces`` split after the first ``rows`` delivered rows: (consumed, remaining), as segments."""
        counts = self.delivered_counts(pieces, rows)
        keep = lambda p: p.take(p.rows > 0)  # noqa: E731
        return keep(Pieces(pieces.rg, pieces.lo, pieces.lo + counts)), keep(Pieces(pieces.rg, pieces.lo + counts, pieces.hi))

    def delivered_counts(self, pieces: Pieces, rows: int) -> np.ndarray:
        """How many rows of each piece the first ``rows`` delivered rows took (each a prefix of its piece)."""
        if self.config.shuffle_window == 1:
            ends = np.cumsum(pieces.rows)
            return np.clip(rows - (ends - pieces.rows), 0, pieces.rows).astype(np.int64)
        counts, start = [], 0
        for window in self.windows(pieces):
            part = pieces.take(window)
            size = int(part.rows.sum())
            taken = int(np.clip(rows - start, 0, size))
            if 0 < taken < size:
                counts.append(np.bincount(self.window_labels(part)[:taken], minlength=len(part)))
            else:
                counts.append(part.rows if taken == size else np.zeros(len(part), dtype=np.int64))
            start += size
        return np.concatenate(counts).astype(np.int64) if counts else np.zeros(0, dtype=np.int64)

    def row_positions(self, rg: int, lo: int, hi: int) -> np.ndarray:
        """Row indices (within row group ``rg``) of emitted positions ``[lo, hi)``."""
        return self.rows_at(np.full(hi - lo, rg, dtype=np.int64), np.arange(lo, hi, dtype=np.int64))

    def piece_rows(self, rg: int, lo: int, hi: int) -> np.ndarray | None:
        """Sorted row numbers (file order) of emitted positions ``[lo, hi)`` of row group ``rg``; None
        when that is the whole group. What a worker owning only part of a group reads of it."""
        if lo == 0 and hi == int(self.layout.rg_rows[rg]):
            return None
        rows = self.row_positions(rg, lo, hi)
        return rows if not (self.config.shuffle and self.config.shuffle_rows) else np.sort(rows)

    def rows_at(self, rg: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Row numbers (file order) of emitted positions ``positions[i]`` of row groups ``rg[i]``.

        Without shuffling the emitted order is the file order; with it, each row group's rows
        follow a (seed, epoch, row group) permutation, so a position's row does not depend on
        where the row group was cut into pieces.
        """
        positions = np.asarray(positions, dtype=np.int64)
        if not (self.config.shuffle and self.config.shuffle_rows):
            return positions
        rg = np.asarray(rg, dtype=np.int64)
        out = np.empty_like(positions)
        for group in np.unique(rg).tolist():
            mask = rg == group
            out[mask] = self._row_order(group, positions[mask])
        return out

    def _row_order(self, group: int, positions: np.ndarray) -> np.ndarray:
        """Rows of emitted ``positions`` of row group ``group``. A batch of a shuffle window takes a few
        rows from each of its row groups, so a group's whole order is computed once and kept (the
        most recent ones, up to ``_ROW_ORDER_CACHE`` rows in all) instead of walking the
        permutation a few positions at a time, batch after batch."""
        n = int(self.layout.rg_rows[group])
        with self._row_orders_lock:
            order = self._row_orders.get(group)
        if order is None:
            permutation = Permutation(n, mix_seed(self.config.seed, self.epoch, _ROW_ORDER, group))
            if n > self._row_orders.max_size // 8:  # a huge group: only the positions asked for
                return permutation[positions]
            order = permutation[np.arange(n, dtype=np.int64)]
            with self._row_orders_lock:
                self._row_orders.put(group, order)
        return order[positions]


def keep_rows(pieces: Pieces, keep: int) -> Pieces:
    """The first ``keep`` rows of ``pieces`` (in order), cutting the last piece short."""
    ends = np.cumsum(pieces.rows)
    count = int(np.searchsorted(ends, keep, side="left")) + 1 if keep else 0
    hi = pieces.hi[:count].copy()
    if count:
        hi[-1] -= ends[count - 1] - keep
    return Pieces(pieces.rg[:count], pieces.lo[:count], hi)


def initial_stream(layout: Layout, config: PlanConfig, epoch: int) -> Pieces:
    """Every non-empty row group, whole, in the epoch's stream order."""
    order = stream_order(layout, config, epoch)
    rows = layout.rg_rows[order]
    return Pieces(order, np.zeros(len(order), dtype=np.int64), rows.astype(np.int64))


def stream_order(layout: Layout, config: PlanConfig, epoch: int) -> np.ndarray:
    """Catalog indices of the non-empty row groups in the order the stream visits them."""
    rows = layout.rg_rows
    n = len(rows)
    if not config.shuffle:
        order = np.arange(n, dtype=np.int64)
    elif config.unit == "row_group":  # each file's row groups spread over the epoch (plan/unit_order.py)
        order = spread_order(rows, layout.rg_file, layout.num_files, mix_seed(config.seed, epoch, _IN_FILE_ORDER),
                             mix_seed(config.seed, epoch, _UNIT_ORDER))
    else:
        # Files in a permuted order; inside each file, its row groups in a permuted order too.
        file_rank = Permutation(layout.num_files, mix_seed(config.seed, epoch, _UNIT_ORDER)).inverse(
            np.arange(layout.num_files, dtype=np.int64)
        )
        tiebreak = Permutation(n, mix_seed(config.seed, epoch, _IN_FILE_ORDER))[np.arange(n, dtype=np.int64)]
        # One int64 key (file rank major, unique tiebreak minor): ~15x faster than np.lexsort here.
        order = np.argsort(file_rank[layout.rg_file] * max(n, 1) + tiebreak, kind="stable").astype(np.int64)
    return order[rows[order] > 0]
