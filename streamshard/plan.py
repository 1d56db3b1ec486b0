"""Pure planning: (row-group layout, config, epoch, number of global workers) -> each worker's slices.

No I/O and no torch here: this is where the invariants live (exactly once, equal steps,
determinism), so property tests aim at it directly.

The model: the non-empty row groups are laid end to end in *stream order* (catalog order, or a
(seed, epoch) permutation of units: row groups, or whole files with their row groups kept
together). The stream's T rows are cut into ``G`` contiguous blocks balanced by rows
(``T // G`` each, the first ``T % G`` blocks one more), and global worker ``g`` reads block
``g``. A row group that straddles a block boundary is split between two workers. Everything a
worker needs is a cumulative sum and two binary searches: O(row groups) memory, never
O(row groups x workers).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .permutation import Permutation, mix_seed

UNITS = ("row_group", "file")
UNEVEN_POLICIES = ("pad", "drop")

# Domain tags keep the seeds of different shuffles apart.
_UNIT_ORDER, _PIECE_ORDER, _ROW_ORDER = 1, 2, 3


@dataclass(frozen=True)
class PlanConfig:
    """How a dataset is cut into batches; validated on construction."""

    unit: str = "row_group"
    shuffle: bool = False
    seed: int = 0
    batch_size: int | None = None
    uneven: str = "pad"

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")
        if self.uneven not in UNEVEN_POLICIES:
            raise ValueError(f"uneven must be one of {UNEVEN_POLICIES}, got {self.uneven!r}")
        if self.batch_size is not None:
            if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, (int, np.integer)):
                raise ValueError(f"batch_size must be a positive int or None, got {self.batch_size!r}")
            if self.batch_size <= 0:
                raise ValueError(f"batch_size must be a positive int or None, got {self.batch_size}")
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")


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
    """A worker's reads in order: rows ``[start, stop)`` of row group ``rg`` (catalog index)."""

    rg: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    def __len__(self) -> int:
        return len(self.rg)

    @property
    def rows(self) -> np.ndarray:
        return self.stop - self.start


@dataclass(frozen=True)
class WorkerPlan:
    """What one global worker does in one epoch.

    ``steps`` batches in total: the first ``real_batches`` carry rows, the rest are padding
    (``uneven="pad"``). With ``uneven="drop"`` the worker stops after ``steps`` batches.
    """

    worker: int
    pieces: Pieces
    steps: int
    real_batches: int
    rows: int  # rows this worker delivers (after dropping)


class EpochPlan:
    """The plan of one epoch for ``num_workers`` global workers, shared by all of them."""

    def __init__(self, layout: Layout, config: PlanConfig, epoch: int, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"number of global workers must be >= 1, got {num_workers}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.layout, self.config, self.epoch, self.num_workers = layout, config, epoch, num_workers
        self.order = stream_order(layout, config, epoch)
        self.ends = np.cumsum(layout.rg_rows[self.order], dtype=np.int64)
        self.total_rows = int(self.ends[-1]) if len(self.ends) else 0

    # -- blocks -----------------------------------------------------------------------------
    def block_bounds(self, workers: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Stream row range ``[begin, end)`` of the given global worker(s)."""
        g = np.asarray(workers, dtype=np.int64)
        base, rem = divmod(self.total_rows, self.num_workers)
        begin = g * base + np.minimum(g, rem)
        return begin, begin + base + (g < rem)

    def pieces_per_worker(self, workers: np.ndarray | None = None) -> np.ndarray:
        """Number of row-group pieces each worker reads (vectorised over workers)."""
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
        rows = end - begin
        bs = self.config.batch_size
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
        """The row-group slices of worker ``worker``'s block, in stream order (before dropping)."""
        self._check_worker(worker)
        begin, end = (int(x) for x in self.block_bounds(worker))
        return self.pieces_in(begin, end)

    def pieces_in(self, begin: int, end: int) -> Pieces:
        """The row-group slices holding stream rows ``[begin, end)``, in stream order."""
        if not 0 <= begin <= end <= self.total_rows:
            raise ValueError(f"stream range [{begin}, {end}) is outside [0, {self.total_rows})")
        if end == begin:
            empty = np.zeros(0, dtype=np.int64)
            return Pieces(empty, empty, empty)
        first = int(np.searchsorted(self.ends, begin, side="right"))
        last = int(np.searchsorted(self.ends, end, side="left"))
        positions = np.arange(first, last + 1)
        rgs = self.order[positions]
        rg_begin = self.ends[positions] - self.layout.rg_rows[rgs]
        start = np.maximum(begin - rg_begin, 0)
        stop = np.minimum(end - rg_begin, self.layout.rg_rows[rgs])
        return Pieces(rgs.astype(np.int64), start.astype(np.int64), stop.astype(np.int64))

    def worker_plan(self, worker: int) -> WorkerPlan:
        """What ``worker`` reads and delivers: its block, cut to ``steps`` batches, in read order."""
        pieces = self.pieces(worker)
        steps, bs = self.steps, self.config.batch_size
        if bs is None:
            real = min(len(pieces), steps)
            pieces = Pieces(pieces.rg[:real], pieces.start[:real], pieces.stop[:real])
        else:
            rows = int(pieces.rows.sum())
            real = min(-(-rows // bs), steps)
            pieces = _truncate_rows(pieces, min(rows, steps * bs))
        if self.config.shuffle and self.config.unit == "file":
            pieces = self._shuffle_within_files(pieces)
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

    def row_order(self, rg: int, start: int, stop: int) -> np.ndarray | None:
        """Offsets (relative to ``start``) in which to emit a piece's rows; None keeps file order."""
        if not self.config.shuffle or stop - start <= 1:
            return None
        seed = mix_seed(self.config.seed, self.epoch, _ROW_ORDER, int(rg), int(start))
        return Permutation(stop - start, seed)[np.arange(stop - start, dtype=np.int64)]

    def _shuffle_within_files(self, pieces: Pieces) -> Pieces:
        # A worker's pieces of one file are adjacent; permute their order inside each run of a file.
        files = self.layout.rg_file[pieces.rg]
        cuts = np.flatnonzero(np.diff(files)) + 1
        index = np.arange(len(pieces))
        for run in np.split(index, cuts):
            if len(run) > 1:
                seed = mix_seed(self.config.seed, self.epoch, _PIECE_ORDER, int(files[run[0]]))
                run[:] = run[Permutation(len(run), seed)[np.arange(len(run))]]
        return Pieces(pieces.rg[index], pieces.start[index], pieces.stop[index])

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker must be in [0, {self.num_workers}), got {worker}")


def _truncate_rows(pieces: Pieces, keep: int) -> Pieces:
    """The first ``keep`` rows of ``pieces`` (in order), cutting the last piece short."""
    ends = np.cumsum(pieces.rows)
    count = int(np.searchsorted(ends, keep, side="left")) + 1 if keep else 0
    stop = pieces.stop[:count].copy()
    if count:
        stop[-1] -= ends[count - 1] - keep
    return Pieces(pieces.rg[:count], pieces.start[:count], stop)


def stream_order(layout: Layout, config: PlanConfig, epoch: int) -> np.ndarray:
    """Catalog indices of the non-empty row groups in the order the stream visits them."""
    rows = layout.rg_rows
    if not config.shuffle:
        order = np.arange(len(rows), dtype=np.int64)
    elif config.unit == "row_group":
        seed = mix_seed(config.seed, epoch, _UNIT_ORDER)
        order = Permutation(len(rows), seed)[np.arange(len(rows), dtype=np.int64)]
    else:
        order = _shuffled_files(layout, mix_seed(config.seed, epoch, _UNIT_ORDER))
    return order[rows[order] > 0]


def _shuffled_files(layout: Layout, seed: int) -> np.ndarray:
    """Row groups in a permuted order of files, each file's row groups kept together."""
    n_files = layout.num_files
    per_file = np.bincount(layout.rg_file, minlength=n_files).astype(np.int64)
    file_start = np.cumsum(per_file) - per_file
    files = Permutation(n_files, seed)[np.arange(n_files, dtype=np.int64)]
    counts = per_file[files]
    out_start = np.cumsum(counts) - counts
    return np.repeat(file_start[files] - out_start, counts) + np.arange(int(counts.sum()), dtype=np.int64)
