"""The exact batches of one global worker: pure (numpy only), no I/O, no torch.

A *schedule* turns an epoch plan into :class:`BatchSpec`s. Batch ``i`` of a worker names the rows
it holds (which decoded row group, which row of it), in delivered order, their sample ids, and
how many padding rows follow. The dataset only reads and converts what a spec names; the test
simulation is the same schedule without reading (:meth:`Schedule.sample_ids`). Every mode
(the row-balanced stream, ``partitions=`` and blends) produces this one shape, and padding is
decided here only.

A spec also says which decoded row groups ("reads", by a key unique within the worker) no later
batch needs (``done``), so the reader holds only what is still to be delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .epoch_plan import EpochPlan
from .sized_lru import SizedLRU

_EMPTY = np.zeros(0, dtype=np.int64)
_PART_ROWS_KEPT = 32  # reads (with partial pieces' owned-row arrays) a schedule keeps: a window's worth
_PART_ROWS_HELD = 1 << 21  # ... and at most this many owned-row numbers in them (16 MiB)
_BLOCK_ROWS = 1 << 16  # rows of the batches built together at most (a shuffle window's, usually)


class _PartRows:
    """The reads of a schedule's pieces (with ``EpochPlan.piece_rows``), made once per piece while a
    window uses them (bounded LRU)."""

    def __init__(self, plan: EpochPlan) -> None:
        self.plan = plan
        self._kept: SizedLRU[tuple[int, int, int], Read] = SizedLRU(
            _PART_ROWS_HELD, lambda read: 0 if read.rows is None else len(read.rows), _PART_ROWS_KEPT)

    def read(self, rg: int, lo: int, hi: int) -> Read:
        key = (rg, lo, hi)
        read = self._kept.get(key)
        if read is None:
            read = Read(0, rg, rows=self.plan.piece_rows(rg, lo, hi))
            self._kept.put(key, read)
        return read


@dataclass(frozen=True)
class Read:
    """One decoded row group: row group ``rg`` (catalog index) of corpus ``source`` (0 for one stream).

    ``epoch``: the corpus epoch whose row order the read lays out, for reads whose decoded form
    depends on it (a packed blend's token groups); 0 otherwise.

    ``rows``: when a worker owns only part of the row group, the sorted row numbers (file order)
    it owns: the decoded table then holds just those rows, in that order (``local_rows``), so
    a huge group split between workers is never held whole. None: the whole group."""

    source: int
    rg: int
    epoch: int = 0
    rows: np.ndarray | None = field(default=None, compare=False, repr=False)

    def local_rows(self, rows: np.ndarray) -> np.ndarray:
        """Where row numbers ``rows`` (file order) sit in this read's decoded table."""
        return rows if self.rows is None else np.searchsorted(self.rows, rows)


@dataclass(frozen=True)
class BatchSpec:
    """Batch ``index`` of a worker, exactly: rows in order, then ``padding`` padding rows."""

    index: int
    reads: dict[int, Read]  # key -> read, for every key this batch uses, in first-use order
    read: np.ndarray  # int64 per real row: the key of the read holding it
    row: np.ndarray  # int64 per real row: its row number inside that row group (file order)
    sample_id: np.ndarray  # int64 per real row
    padding: int
    done: tuple[int, ...] = ()  # keys no later batch of this worker uses
    corpus: np.ndarray | None = field(default=None)  # int64 per real row, for blends
    slot: np.ndarray | None = field(default=None)  # int64 per real row: its place in the batch (None: in order)

    @property
    def rows(self) -> int:
        return len(self.sample_id)

    @property
    def size(self) -> int:
        return self.rows + self.padding


@dataclass(frozen=True)
class BatchBlock:
    """Consecutive batches ``first .. first + len(padding) - 1`` of a worker, built together (one
    vectorised gather per key for all of them, ``Gatherer.build_block``): their real rows end to
    end, as in :class:`BatchSpec` (``read``, ``row``, ``sample_id``, ``corpus``), batch ``j``'s being
    ``cuts[j]:cuts[j + 1]``, then ``padding[j]`` padding rows. ``reads``: every read the block uses,
    in first-use order; ``done``: the keys no batch after the block uses."""

    first: int
    reads: dict[int, Read]
    read: np.ndarray
    row: np.ndarray
    sample_id: np.ndarray
    cuts: np.ndarray  # int64 [batches + 1]
    padding: tuple[int, ...]
    done: tuple[int, ...] = ()
    corpus: np.ndarray | None = field(default=None)
    single: BatchSpec | None = field(default=None, repr=False)  # the spec of a block of one, as it came

    @classmethod
    def of(cls, spec: BatchSpec) -> BatchBlock:
        """One batch as a block (``spec(0)`` gives ``spec`` back, every field of it)."""
        return cls(spec.index, spec.reads, spec.read, spec.row, spec.sample_id,
                   np.array([0, spec.rows], dtype=np.int64), (spec.padding,), spec.done, spec.corpus, spec)

    @property
    def count(self) -> int:
        return len(self.padding)

    def spec(self, j: int) -> BatchSpec:
        """Batch ``j`` of the block on its own (for the paths that build batch by batch)."""
        if self.single is not None:
            return self.single
        if self.count == 1:
            return BatchSpec(self.first, self.reads, self.read, self.row, self.sample_id, self.padding[0],
                             self.done, self.corpus)
        a, b = int(self.cuts[j]), int(self.cuts[j + 1])
        read = self.read[a:b]
        reads = {k: self.reads[k] for k in _first_use(read)} if b > a else {}
        return BatchSpec(self.first + j, reads, read, self.row[a:b], self.sample_id[a:b], self.padding[j],
                         self.done if j == self.count - 1 else (),
                         None if self.corpus is None else self.corpus[a:b])


def padding_spec(index: int, rows: int) -> BatchSpec:
    return BatchSpec(index, {}, _EMPTY, _EMPTY, _EMPTY, rows)


class Schedule:
    """What every schedule offers: ``steps`` batches, of which the first ``real_batches`` hold rows."""

    steps: int
    real_batches: int

    def batch(self, index: int) -> BatchSpec:  # pragma: no cover - interface
        raise NotImplementedError

    def shape_donor(self) -> BatchSpec | None:
        """A real batch whose shapes padding copies when no real batch is built (resume past the
        last real one, or a worker with no rows); None for an empty dataset."""
        raise NotImplementedError  # pragma: no cover - interface

    def batches(self, start: int = 0) -> Iterator[BatchSpec]:
        for index in range(start, self.steps):
            yield self.batch(index)

    def blocks(self, start: int = 0) -> Iterator[BatchBlock]:
        """Batches ``start..`` grouped into blocks that delivery builds together (here one batch
        each; schedules that can group many override it)."""
        for spec in self.batches(start):
            yield BatchBlock.of(spec)

    def upcoming_reads(self, start: int) -> Iterator[tuple[int, Read]] | None:
        """Every read batches ``start..`` use, as ``(key, read)`` in order of first use, without
        building their specs (so read-ahead can reach row groups many batches away); None when this
        schedule only knows them through its specs."""
        return None

    def sample_ids(self, start: int = 0) -> np.ndarray:
        """The real rows' sample ids from batch ``start`` on, in delivery order, without reading."""
        ids = [self.batch(i).sample_id for i in range(start, min(self.real_batches, self.steps))]
        return np.concatenate(ids) if ids else _EMPTY.copy()


class StreamSchedule(Schedule):
    """Global worker ``worker`` of an :class:`EpochPlan`: its block of the stream, cut into batches.

    With an int ``batch_size`` batch ``i`` holds delivered rows ``[i * bs, (i + 1) * bs)``;
    with None it holds one piece's worth of rows (a row-group slice). Rows of the pieces of one
    shuffle window are interleaved (``EpochPlan.window_labels``).
    """

    def __init__(self, plan: EpochPlan, worker: int) -> None:
        work = plan.worker_plan(worker)
        self.plan, self.worker, self.pieces = plan, worker, work.pieces
        self.steps, self.real_batches = work.steps, work.real_batches
        rows = self.pieces.rows
        self.piece_start = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        total = int(self.piece_start[-1])
        bs = plan.config.batch_size
        if bs is None:
            self.bounds = self.piece_start[: self.real_batches + 1]
        else:
            self.bounds = np.minimum(np.arange(self.real_batches + 1, dtype=np.int64) * bs, total)
        windows = plan.windows(self.pieces)
        self.window_first = np.array([w.start for w in windows] + [len(self.pieces)], dtype=np.int64)
        self.window_start = self.piece_start[self.window_first]
        # A piece is needed until the last row of its window (its rows are spread over the window).
        window_of_piece = np.repeat(np.arange(len(windows)), np.diff(self.window_first))
        last_row = self.window_start[window_of_piece + 1] - 1
        self.piece_last_batch = np.searchsorted(self.bounds, last_row, side="right") - 1
        self._labels: tuple[int, np.ndarray, np.ndarray] | None = None  # (window, labels, occurrence)
        self._rows: np.ndarray | None = None  # the current window's row numbers, per delivered row
        self._parts = _PartRows(plan)
        # The reads of the current batches' windows, by piece: a shuffle window's batches each name
        # most of its ~16-48 pieces, and a dict lookup costs a fraction of the LRU's (whole row
        # groups only: the LRU alone bounds the owned-row numbers of partial ones).
        self._piece_reads: dict[int, Read] = {}
        self._piece_reads_window = -1

    def batch(self, index: int) -> BatchSpec:
        if not 0 <= index < self.steps:
            raise IndexError(f"batch {index} is outside [0, {self.steps})")
        bs = self.plan.config.batch_size
        if index >= self.real_batches:
            return padding_spec(index, bs if bs is not None else self._padding_rows())
        begin, end = int(self.bounds[index]), int(self.bounds[index + 1])
        p = self.pieces
        piece, row = self._locate(begin, end)
        rg = p.rg[piece]
        keys = _first_use(piece)
        # Pieces end in window order, so their last batches never decrease.
        done = tuple(range(*np.searchsorted(self.piece_last_batch, [index, index + 1]).tolist()))
        reads = self._reads(keys, begin)
        sample_id = self.plan.layout.rg_first_id[rg] + row
        padding = 0 if bs is None else bs - (end - begin)
        return BatchSpec(index, reads, piece, row, sample_id, padding, done)

    def blocks(self, start: int = 0) -> Iterator[BatchBlock]:
        """The batches of one shuffle window (of one piece, without shuffle) together, at most
        ``_BLOCK_ROWS`` rows; a batch across two windows alone. Planned with one ``_locate`` per
        block rather than per batch."""
        index = start
        while index < self.steps:
            if index >= self.real_batches:
                yield BatchBlock.of(self.batch(index))
                index += 1
                continue
            begin = int(self.bounds[index])
            window = int(np.searchsorted(self.window_start, begin, side="right")) - 1
            last = min(int(self.window_start[window + 1]), begin + _BLOCK_ROWS)
            stop = int(np.searchsorted(self.bounds, last, side="right")) - 1  # batches ending by `last`
            stop = min(max(stop, index + 1), self.real_batches)
            yield self._block(index, stop)
            index = stop

    def _block(self, first: int, stop: int) -> BatchBlock:
        """Batches ``first..stop - 1`` as one block: what ``batch`` gives for each, end to end."""
        bs = self.plan.config.batch_size
        begin, end = int(self.bounds[first]), int(self.bounds[stop])
        p = self.pieces
        piece, row = self._locate(begin, end)
        rg = p.rg[piece]
        keys = _first_use(piece)
        done = tuple(range(*np.searchsorted(self.piece_last_batch, [first, stop]).tolist()))
        reads = self._reads(keys, begin)
        cuts = self.bounds[first:stop + 1] - begin
        padding = (0,) * (stop - first) if bs is None else tuple((bs - np.diff(cuts)).tolist())
        return BatchBlock(first, reads, piece, row, self.plan.layout.rg_first_id[rg] + row, cuts, padding, done)

    def _reads(self, keys: list[int], begin: int) -> dict[int, Read]:
        """The reads of pieces ``keys``, for batches from delivered row ``begin``."""
        p = self.pieces
        window = int(np.searchsorted(self.window_start, begin, side="right")) - 1
        if window != self._piece_reads_window:  # held for the batches of one window (and the next's first)
            self._piece_reads, self._piece_reads_window = {}, window
        known = self._piece_reads
        reads = {}
        for k in keys:
            read = known.get(k)
            if read is None:
                read = self._parts.read(int(p.rg[k]), int(p.lo[k]), int(p.hi[k]))
                if read.rows is None:  # owned-row arrays stay within the LRU's bound
                    known[k] = read
            reads[k] = read
        return reads

    def shape_donor(self) -> BatchSpec | None:
        if self.real_batches > 0:
            return self.batch(self.real_batches - 1)
        return first_rows_spec(self.plan, self._padding_rows())

    def upcoming_reads(self, start: int) -> Iterator[tuple[int, Read]]:
        if start >= self.real_batches:
            return
        # Windows follow each other, pieces in order; of the window batch `start` begins in, only
        # the pieces with rows left (a resume mid-window has delivered some pieces' rows already).
        begin = int(self.bounds[start])
        w = int(np.searchsorted(self.window_start, begin, side="right")) - 1
        p0, p1 = int(self.window_first[w]), int(self.window_first[w + 1])
        keys = [p0]
        if p1 - p0 > 1:
            labels, _ = self._window(w, p0, p1)
            keys = (p0 + np.unique(labels[begin - int(self.window_start[w]):])).tolist()
        p = self.pieces
        for k in keys + list(range(p1, len(p))):
            yield k, self._parts.read(int(p.rg[k]), int(p.lo[k]), int(p.hi[k]))

    def _padding_rows(self) -> int:
        bs = self.plan.config.batch_size
        if bs is not None:
            return bs
        if self.real_batches > 0:
            return int(self.bounds[-1] - self.bounds[-2])
        return max(1, -(-self.plan.total_rows // self.plan.num_workers))

    def _locate(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(piece, row number inside its row group) of delivered rows ``[begin, end)``."""
        first = int(np.searchsorted(self.window_start, begin, side="right")) - 1
        last = int(np.searchsorted(self.window_start, end, side="left"))
        pieces, positions = [], []
        for w in range(first, last):
            a, b = int(self.window_start[w]), int(self.window_start[w + 1])
            lo, hi = max(begin, a) - a, min(end, b) - a
            p0, p1 = int(self.window_first[w]), int(self.window_first[w + 1])
            if p1 - p0 == 1:
                pieces.append(np.full(hi - lo, p0, dtype=np.int64))
                rg = np.full(hi - lo, self.pieces.rg[p0], dtype=np.int64)
                positions.append(self.plan.rows_at(rg, self.pieces.lo[p0] + np.arange(lo, hi, dtype=np.int64)))
                continue
            labels, _ = self._window(w, p0, p1)
            pieces.append(p0 + labels[lo:hi])
            positions.append(self._window_rows(w, p0)[lo:hi])
        if len(pieces) == 1:
            return pieces[0], positions[0]
        return np.concatenate(pieces), np.concatenate(positions)

    def _window(self, w: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray]:
        """Labels of window ``w`` and, per delivered row, how many rows of its piece came before."""
        if self._labels is None or self._labels[0] != w:
            labels = self.plan.window_labels(self.pieces.take(slice(p0, p1)))
            self._labels = (w, labels, *_ranks(labels))
            self._rows = None
        return self._labels[1], self._labels[2]

    def _window_rows(self, w: int, p0: int) -> np.ndarray:
        """Per delivered row of window ``w`` (the current one), its row number inside its row group:
        worked out once per window rather than a few rows of every row group per batch. Each piece's
        rows are its emitted positions in order (``row_positions``), so the window's are those of
        its pieces end to end, picked in delivered order."""
        if self._rows is None:
            assert self._labels is not None and self._labels[0] == w
            p = self.pieces
            count = int(self._labels[1].max(initial=-1)) + 1
            joined = [self.plan.row_positions(int(p.rg[k]), int(p.lo[k]), int(p.hi[k])) for k in range(p0, p0 + count)]
            self._rows = np.concatenate(joined)[self._labels[3]] if joined else _EMPTY
        return self._rows


def _small(labels: np.ndarray) -> bool:
    """Whether ``labels`` are all in ``[0, 2**15)`` (a window's pieces, a blend's corpora)."""
    return bool(len(labels)) and 0 <= int(labels.min()) and int(labels.max()) < 2**15


def _stable_order(labels: np.ndarray, small: bool | None = None) -> np.ndarray:
    """``np.argsort(labels, kind="stable")``; labels of a small range sorted as int16 (a radix sort,
    ~10x faster on a window's ~65,536 rows), which gives the same order."""
    if _small(labels) if small is None else small:
        return np.argsort(labels.astype(np.int16), kind="stable")
    return np.argsort(labels, kind="stable")


def _ranks(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position: how many earlier positions carry its label (``occurrence_rank``), and its place
    among all positions sorted stably by label (its row in the pieces' rows end to end)."""
    small = _small(labels)
    order = _stable_order(labels, small)
    place = np.empty(len(labels), dtype=np.int64)
    place[order] = np.arange(len(labels), dtype=np.int64)
    if small:
        counts = np.bincount(labels)
        before = np.cumsum(counts) - counts  # positions of smaller labels
        return place - before[labels], place
    sorted_labels = labels[order]
    return place - np.searchsorted(sorted_labels, sorted_labels, side="left")[place], place


def occurrence_rank(labels: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions carry the same label."""
    return _ranks(labels)[0]


def _first_use(keys: np.ndarray) -> list[int]:
    """Distinct keys in order of first appearance."""
    if len(keys) and keys[0] == keys[-1]:  # one read (no shuffle window): the common case
        if bool((keys == keys[0]).all()):
            return [int(keys[0])]
    order = _stable_order(keys)
    ordered = keys[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])  # each key's first place, by key
    return ordered[starts][np.argsort(order[starts])].tolist()


def first_rows_spec(plan: EpochPlan, rows: int) -> BatchSpec | None:
    """The first ``rows`` rows of the dataset's first non-empty row group (a shape donor)."""
    nonempty = np.flatnonzero(plan.layout.rg_rows)
    if len(nonempty) == 0:
        return None
    rg = int(nonempty[0])
    row = np.arange(min(rows, int(plan.layout.rg_rows[rg])), dtype=np.int64)
    read = Read(0, rg, rows=row if len(row) < plan.layout.rg_rows[rg] else None)  # a shape only: no whole huge group
    return BatchSpec(-1, {0: read}, np.zeros(len(row), dtype=np.int64), row,
                     plan.layout.rg_first_id[rg] + row, rows - len(row))


class PieceBatches(Schedule):
    """Batches whose rows are given as stream ranges: batch ``i`` holds, for each owned range, the
    rows ``[i * micro, (i + 1) * micro)`` of it (the ``partitions=`` order of ``plan/canonical.py``).

    ``ranges`` are ``(begin, rows)`` of contiguous stream ranges of ``plan``; every batch is
    topped up to ``batch_size`` rows with padding.
    """

    def __init__(self, plan: EpochPlan, ranges: list[tuple[int, int]], micro: int, batch_size: int,
                 steps: int) -> None:
        self.plan, self.micro, self.batch_size, self.steps = plan, micro, batch_size, steps
        self.ranges = ranges
        self.real_batches = min(max((-(-rows // micro) for _, rows in ranges), default=0), steps)
        parts = [plan.pieces_in(begin, begin + rows) for begin, rows in ranges]
        self.key_base = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
        self.parts = parts
        self.part_ends = [np.cumsum(p.rows).astype(np.int64) for p in parts]
        last = [(ends - 1) // micro for ends in self.part_ends]
        self.piece_last_batch = np.concatenate(last) if last else _EMPTY
        self._parts = _PartRows(plan)

    def batch(self, index: int) -> BatchSpec:
        if not 0 <= index < self.steps:
            raise IndexError(f"batch {index} is outside [0, {self.steps})")
        if index >= self.real_batches:
            return padding_spec(index, self.batch_size)
        keys, positions, rgs, pieces = [], [], [], {}
        for part, (_, rows), ends, base in zip(self.parts, self.ranges, self.part_ends, self.key_base):
            lo, hi = min(index * self.micro, rows), min((index + 1) * self.micro, rows)
            if hi <= lo:
                continue
            offsets = np.arange(lo, hi, dtype=np.int64)
            piece = np.searchsorted(ends, offsets, side="right")
            keys.append(base + piece)
            for j in np.unique(piece).tolist():
                pieces[int(base) + j] = (int(part.rg[j]), int(part.lo[j]), int(part.hi[j]))
            positions.append(part.lo[piece] + offsets - (ends[piece] - part.rows[piece]))
            rgs.append(part.rg[piece])
        key, position, rg = (np.concatenate(x) for x in (keys, positions, rgs))
        row = self.plan.rows_at(rg, position)
        keys, first = np.unique(key, return_index=True)
        order = np.argsort(first)  # keys in order of first use
        reads = {int(k): self._parts.read(*pieces[int(k)]) for k in keys[order]}
        done = tuple(np.flatnonzero(self.piece_last_batch == index).tolist())
        return BatchSpec(index, reads, key, row, self.plan.layout.rg_first_id[rg] + row,
                         self.batch_size - len(row), done)

    def shape_donor(self) -> BatchSpec | None:
        if self.real_batches > 0:
            return self.batch(self.real_batches - 1)
        return first_rows_spec(self.plan, self.batch_size)

