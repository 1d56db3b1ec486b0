"""Batches gathered from row groups converted once: how delivery turns decoded rows into tensors.

Converting Arrow to tensors costs a few dozen library calls whatever the number of rows. Paid per
batch (256 rows drawn from the ~16 row groups of a shuffle window: a take from each, a concat, a
reorder, then the conversion), that Python is most of a worker thread's time, and it holds the
GIL the other workers need. So each read is converted once, on the read-ahead thread that decoded
it (:func:`convert_read`, to flat numpy columns), and a batch is gathered from those
(:class:`Gatherer`): one gather per per-row key, and each row's list items copied as one slice
straight into its place in the padded output. A shuffle window's batches draw a few rows from each
of its ~16-28 row groups, so the window's per-row columns (a few numbers per row) are joined once
(:class:`_Window`) rather than gathered from every read per batch. List items stay in their reads and
are copied a slice per row, except short rows' (a few items each, where a slice per row is mostly
Python): those are padded once per window to ``[rows, longest]`` (one vectorised pass, when that
costs at most ``_PAD_GROWTH`` x their own cells and ``_JOIN_BYTES``), so a padded batch is one
gather of whole rows; otherwise (and for flat lists) joined once per window and gathered per batch
in one element gather.

Consecutive batches that share their reads (a shuffle window's, or one row group's without shuffle:
a ``batch_plan.BatchBlock``) are built together (:meth:`Gatherer.build_block`): where their rows
are is worked out once, each list's items are taken for all of them in one vectorised pass (padded
to the block's longest row, at most ``_PAD_GROWTH`` x the batches' own cells and ``_JOIN_BYTES``,
or flat), and each batch is then a few numpy copies out of that, into memory it owns. Per batch
that is a handful of numpy calls and no per-row Python; the bytes move with the GIL released.
Per-row keys of wide rows (fixed-size lists of ``_WIDE_ROW`` bytes or more, such as 4,096 tokens)
are not joined for a window: a batch gathers them read by read.

Schemas with inner list levels (lists of lists, whose entries hang off items rather than rows)
keep the whole-batch conversion (``delivery.build``); :func:`gatherable` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch

from ..plan.batch_plan import BatchBlock, BatchSpec, Read
from .batches import CORPUS, SAMPLE_ID
from .tensors import Batch, BatchConverter


@dataclass
class Converted:
    """A read's rows converted once, in flat form: per key, a numpy array with one entry per row
    (or, for a key of ``BatchConverter.items_of``, one per item of that list, all rows end to end),
    or a Python list with one value per row (text)."""

    rows: int
    columns: dict[str, Any]
    offsets: dict[str, np.ndarray]  # lengths key -> int64 [rows + 1]: where each row's items begin
    # a huge row group's part, converted as it was decoded (part_convert): held once, so its batches are
    # built one by one, never from a block's copy of its rows (which would hold it twice)
    streamed: bool = False


def gatherable(converter: BatchConverter | None) -> bool:
    """Whether batches of ``converter``'s schema can be gathered from converted reads."""
    return converter is not None and converter.items_of is not None


def convert_read(table: pa.Table, converter: BatchConverter) -> Converted:
    """``table`` (a read's decoded rows) converted once, in the flat form batches gather from."""
    flat = converter.flat_twin().convert(table, copy=False)  # batches copy what they gather
    columns = {key: value.numpy() if isinstance(value, torch.Tensor) else value for key, value in flat.items()}
    return Converted(table.num_rows, columns, _item_offsets(columns, converter))


def _item_offsets(columns: dict[str, Any], converter: BatchConverter) -> dict[str, np.ndarray]:
    assert converter.items_of is not None
    offsets = {}
    for lengths in {key for key in converter.items_of.values() if key is not None}:
        counts = columns[lengths]
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        offsets[lengths] = starts
    return offsets


class Gatherer:
    """Builds a pass's batches from converted reads."""

    def __init__(self, converter: BatchConverter) -> None:
        assert converter.items_of is not None
        self.keys = converter.keys
        self.items_of = converter.items_of
        self.lists = sorted({k for k in self.items_of.values() if k is not None})
        self._item_keys = {lengths: [k for k in self.keys if self.items_of[k] == lengths] for lengths in self.lists}
        self.padded = not converter.flat_lists
        self._window: _Window | None = None

    def build(self, spec: BatchSpec, parts: dict[int, Converted]) -> Batch:
        """Batch ``spec`` (its real rows then its padding) from the converted reads it names."""
        keys = list(spec.reads)
        index = spec.row
        partial = [k for k in keys if spec.reads[k].rows is not None]
        if partial:  # reads holding only the rows this worker owns: row numbers -> positions
            index = index.copy()
            for key in partial:
                mine = spec.read == key if len(keys) > 1 else slice(None)
                index[mine] = spec.reads[key].local_rows(spec.row[mine])
        n, size = spec.rows, spec.rows + spec.padding
        if len(keys) == 1 or n == 0:
            pieces = [_Piece(parts[keys[0]], index, slice(0, n))]
        else:
            pieces = _runs(spec.read, index, parts, len(keys))
        if pieces is not None:
            batch = self._rows([(p.source.columns, p.rows, p.at) for p in pieces], size)
            for lengths_key in self.lists:
                self._items(batch, lengths_key, pieces)
        else:  # rows interleaving several reads: a shuffle window
            window = self._window
            if window is None or not window.holds.issuperset(keys):
                window = self._window = None  # the old one goes first
                window = self._window = _Window(sorted(keys), parts, self.keys, self.items_of)
            rows = window.rows(spec.read, index)
            batch = self._rows([(window.columns, rows, slice(0, n))], size, skip=window.wide)
            for key in window.wide:
                batch[key] = window.wide_rows(key, rows, size - n)
            for lengths_key in self.lists:
                if window.joins(lengths_key, self._item_keys[lengths_key]):  # a few items a row
                    self._window_gather(batch, lengths_key, window, rows)
                else:
                    self._window_items(batch, lengths_key, window, rows)
        batch = {key: batch[key] for key in self.keys}
        batch[SAMPLE_ID] = _with_padding(spec.sample_id, size)
        if spec.corpus is not None:
            batch[CORPUS] = _with_padding(spec.corpus, size)
        return {key: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for key, v in batch.items()}

    def build_block(self, block: BatchBlock, parts: dict[int, Converted]) -> Iterator[Batch]:
        """The batches of ``block``, each exactly what ``build`` makes of it, with the work that is
        per batch in ``build`` done once for the block: where its rows are (a run of one read, runs
        of several, or a shuffle window's joined rows), each list's items gathered and padded for
        all its rows in one vectorised pass (or, for a window of short rows padded once, gathered
        as whole rows), then each batch a few copies out of that: numpy calls, no per-row Python,
        the GIL released for the bytes."""
        count = block.count
        if count == 1:
            return iter([self.build(block.spec(0), parts)])
        if not bool(np.all(np.diff(block.cuts) > 0)):  # a batch of padding only (none are, from schedules)
            return self._one_by_one(block, parts)
        keys = list(block.reads)
        if any(parts[key].streamed for key in keys):
            return self._one_by_one(block, parts)
        index = self._local(block.reads, block.read, block.row)
        total = len(index)
        window = None
        if len(keys) == 1:
            pieces: list[_Piece] | None = [_Piece(parts[keys[0]], index, slice(0, total))]
            source, rows = parts[keys[0]].columns, pieces[0].rows
        else:
            pieces = _runs(block.read, index, parts, len(keys))
            if pieces is not None:  # runs of several reads: their per-row keys joined for the block
                source, rows = self._rows([(p.source.columns, p.rows, p.at) for p in pieces], total), slice(0, total)
            else:
                window = self._window
                if window is None or not window.holds.issuperset(keys):
                    window = self._window = None  # the old one goes first
                    window = self._window = _Window(sorted(keys), parts, self.keys, self.items_of)
                source, rows = window.columns, window.rows(block.read, index)
        cuts = block.cuts.tolist()
        # Per list: its lengths for the whole block, and how each batch's items are taken.
        lists: dict[str, tuple[np.ndarray, Any]] = {}
        for lengths_key in self.lists:
            lengths = _pick(source[lengths_key], rows)
            item_keys = self._item_keys[lengths_key]
            itemsize = sum(parts[keys[0]].columns[key].itemsize for key in item_keys)
            if not self.padded:  # flat: every item of the block in order, each batch a slice of it
                if int(lengths.sum()) * itemsize > _JOIN_BYTES:  # long rows: batch by batch holds less
                    return self._one_by_one(block, parts)
                held: dict[str, np.ndarray] = {lengths_key: lengths}
                padded = [window.padded(key, lengths_key) for key in item_keys] \
                    if window is not None and window.joins(lengths_key, item_keys) else [None]
                if padded[0] is not None:  # the window's rows padded once: whole rows, then their items
                    cells = _columns(padded[0].shape[1]) < lengths[:, None]
                    held.update((key, rows_of_window[rows][cells]) for key, rows_of_window in zip(item_keys, padded))
                else:
                    self._block_items(held, lengths_key, pieces, window, rows)
                starts = np.zeros(total + 1, dtype=np.int64)
                np.cumsum(lengths, out=starts[1:])
                lists[lengths_key] = (lengths, ("flat", held, starts[cuts].tolist()))
                continue
            widths = np.maximum.reduceat(lengths, cuts[:-1]).tolist() if total else [0] * count
            longest = max(widths, default=0)
            if window is not None and window.joins(lengths_key, item_keys):
                padded = [window.padded(key, lengths_key) for key in item_keys]
                if padded[0] is not None:  # the window's rows padded once: each batch gathers whole rows
                    lists[lengths_key] = (lengths, ("rows", dict(zip(item_keys, padded)), widths))
                    continue
            cells = sum((b - a) * w for a, b, w in zip(cuts[:-1], cuts[1:], widths))
            if total * longest > _PAD_GROWTH * max(cells, total) or total * longest * itemsize > _JOIN_BYTES:
                # A few long rows: padding the block to its longest row would cost more than its batches.
                return self._one_by_one(block, parts)
            held = {lengths_key: lengths}
            self._block_items(held, lengths_key, pieces, window, rows)
            lists[lengths_key] = (lengths, ("block", held, widths))
        # Per-row keys gathered once for the block, into memory the block owns: each batch is a
        # view of its rows (batches never overlap, so a loop writing into one leaves the others).
        wide = window.wide if window is not None else frozenset()
        owned: dict[str, Any] = {}
        for key in self.keys:
            if self.items_of[key] is None and key not in wide:
                owned[key] = lists[key][0] if key in lists else _pick(source[key], rows)
                if isinstance(rows, slice) and isinstance(owned[key], np.ndarray):
                    owned[key] = owned[key].copy()  # a slice of the read's own column
        ids = np.array(block.sample_id, dtype=np.int64)
        corpus = None if block.corpus is None else np.array(block.corpus, dtype=np.int64)
        return self._batches(block, lists, owned, wide, window, rows, ids, corpus)

    def _one_by_one(self, block: BatchBlock, parts: dict[int, Converted]) -> Iterator[Batch]:
        """A block's batches built each on its own (``build``), as they are asked for."""
        return (self.build(block.spec(j), parts) for j in range(block.count))

    def _batches(self, block: BatchBlock, lists: dict[str, tuple[np.ndarray, Any]], owned: dict[str, Any],
                 wide: frozenset[str], window: _Window | None, rows: Any, ids: np.ndarray,
                 corpus: np.ndarray | None) -> Iterator[Batch]:
        """The batches of a block prepared by ``build_block``, each made as it is asked for (the
        block holds its per-row keys and list items once; its batches are not all alive at once)."""
        cuts = block.cuts.tolist()
        for j in range(block.count):
            a, b, pad = cuts[j], cuts[j + 1], block.padding[j]
            batch: dict[str, Any] = {}
            for key in self.keys:
                lengths_key = self.items_of[key]
                if lengths_key is None:
                    if key in wide:
                        batch[key] = torch.from_numpy(window.wide_rows(key, rows[a:b], pad))
                        continue
                    values = owned[key][a:b]
                    if not isinstance(values, np.ndarray):
                        batch[key] = values + [None] * pad if pad else values
                        continue
                    batch[key] = torch.from_numpy(_with_zeros(values, pad))
                    continue
                kind, held, where = lists[lengths_key][1]
                if kind == "flat":  # the block's own array: a view
                    batch[key] = torch.from_numpy(held[key][where[j]:where[j + 1]])
                elif kind == "rows":
                    picked = held[key][rows[a:b], :where[j]]
                    batch[key] = torch.from_numpy(_with_zeros(picked, pad))
                elif where[j] == held[key].shape[1] and not pad:  # as wide as the block: its rows, a view
                    batch[key] = torch.from_numpy(held[key][a:b])
                else:
                    batch[key] = torch.from_numpy(_with_zeros(held[key][a:b, :where[j]], pad, copy=True))
            batch[SAMPLE_ID] = torch.from_numpy(ids[a:b] if not pad else _with_minus_ones(ids[a:b], pad))
            if corpus is not None:
                batch[CORPUS] = torch.from_numpy(corpus[a:b] if not pad else _with_minus_ones(corpus[a:b], pad))
            yield batch

    def _local(self, reads: dict[int, Read], read: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Positions in their reads of rows ``row`` of reads ``read`` (reads holding only the rows
        this worker owns map row numbers to positions)."""
        partial = [k for k in reads if reads[k].rows is not None]
        if not partial:
            return row
        index = row.copy()
        for key in partial:
            mine = read == key if len(reads) > 1 else slice(None)
            index[mine] = reads[key].local_rows(row[mine])
        return index

    def _block_items(self, held: dict[str, Any], lengths_key: str, pieces: list[_Piece] | None,
                     window: _Window | None, rows: Any) -> None:
        """The items of list ``lengths_key`` of a block's rows (``held[lengths_key]``: their
        lengths), padded to the block's longest row or flat, into ``held``."""
        if window is None:
            assert pieces is not None
            self._items(held, lengths_key, pieces)
        elif window.joins(lengths_key, self._item_keys[lengths_key]):
            self._window_gather(held, lengths_key, window, rows)
        else:
            self._window_items(held, lengths_key, window, rows)

    def _rows(self, sources: list[tuple[dict[str, Any], Any, Any]], size: int,
              skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The per-row keys (but ``skip``): each source's rows (an index array or a slice) at its
        places, the rest of the ``size`` rows padding (zeros; None for text)."""
        out: dict[str, Any] = {}
        for key in self.keys:
            if self.items_of[key] is not None or key in skip:
                continue
            first = sources[0][0][key]
            if isinstance(first, np.ndarray):
                values = np.zeros((size,) + first.shape[1:], dtype=first.dtype)
                for columns, rows, at in sources:
                    if isinstance(rows, slice):
                        values[at] = columns[key][rows]
                    elif isinstance(at, slice) and at.start == 0 and at.stop == len(rows):  # into place, no temporary
                        np.take(columns[key], rows, axis=0, out=values[:len(rows)], mode="clip")
                    else:
                        values[at] = np.take(columns[key], rows, axis=0)
            else:
                values = [None] * size
                for columns, rows, at in sources:
                    picked = columns[key][rows] if isinstance(rows, slice) else [columns[key][i] for i in rows.tolist()]
                    places = range(size)[at] if isinstance(at, slice) else at.tolist()
                    for place, value in zip(places, picked):
                        values[place] = value
            out[key] = values
        return out

    def _items(self, batch: dict[str, Any], lengths_key: str, pieces: list[_Piece]) -> None:
        """The items of one list, every key sharing its lengths, into ``batch``: padded
        ``[rows, longest]`` or flat. A run of consecutive rows, flat, is one copy. Otherwise rows of
        a few items each go through one vectorised pass (a boolean mask for a run, an element gather
        for scattered rows), and longer rows are copied a slice each, which moves the same bytes
        with far less index arithmetic (at ~576 items a row: 2.5x faster than the element gather,
        1.7x faster than the mask pass)."""
        lengths = batch[lengths_key]
        size, total = len(lengths), int(lengths.sum())
        width = int(lengths.max(initial=0)) if self.padded else None
        starts = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        keys = self._item_keys[lengths_key]
        outs = {k: np.zeros((size, width), dtype=pieces[0].source.columns[k].dtype) if width is not None
                else np.empty(total, dtype=pieces[0].source.columns[k].dtype) for k in keys}
        for piece in pieces:
            offsets = piece.source.offsets[lengths_key]
            if isinstance(piece.rows, slice) and isinstance(piece.at, slice):  # one run of rows (no shuffle)
                a, b = int(offsets[piece.rows.start]), int(offsets[piece.rows.stop])
                if width is None:
                    at = int(starts[piece.at.start])
                    for k in keys:
                        outs[k][at:at + b - a] = piece.source.columns[k][a:b]
                    continue
                if b - a >= _SLICE_ROWS_FROM * (piece.rows.stop - piece.rows.start):  # long rows: a slice each
                    bounds = offsets[piece.rows.start:piece.rows.stop + 1]
                    first = np.arange(piece.at.start, piece.at.stop, dtype=np.int64) * width
                    spans = list(zip([0] * (len(bounds) - 1), bounds[:-1].tolist(), np.diff(bounds).tolist(), first.tolist()))
                    for k in keys:
                        _copy_spans(outs[k], [piece.source.columns[k]], spans)
                    continue
                # Short rows: one vectorised pass (it releases the GIL, and costs less than a loop).
                cells = np.arange(width) < lengths[piece.at, None]
                for k in keys:
                    outs[k][piece.at][cells] = piece.source.columns[k][a:b]
                continue
            rows = np.arange(piece.rows.start, piece.rows.stop) if isinstance(piece.rows, slice) else piece.rows
            places = np.arange(piece.at.start, piece.at.stop) if isinstance(piece.at, slice) else piece.at
            begin = offsets[rows]
            counts = offsets[rows + 1] - begin
            first = places * width if width is not None else starts[places]  # where each row's items go
            if len(rows) and int(counts.sum()) < _SLICE_ROWS_FROM * len(rows):
                shift = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
                source, target = np.repeat(begin, counts) + shift, np.repeat(first, counts) + shift
                for k in keys:
                    outs[k].reshape(-1)[target] = np.take(piece.source.columns[k], source)
                continue
            spans = list(zip([0] * len(rows), begin.tolist(), counts.tolist(), first.tolist()))
            for k in keys:
                _copy_spans(outs[k], [piece.source.columns[k]], spans)
        batch.update(outs)

    def _window_items(self, batch: dict[str, Any], lengths_key: str, window: _Window, rows: np.ndarray) -> None:
        """``_items`` for the joined rows ``rows`` of a shuffle window, a slice per row: where each
        row's items are is worked out for the whole batch at once, whichever read holds them."""
        lengths = batch[lengths_key]
        n, size = len(rows), len(lengths)
        width = int(lengths.max(initial=0)) if self.padded else None
        if width is None:
            starts = np.zeros(size + 1, dtype=np.int64)
            np.cumsum(lengths, out=starts[1:])
            first = starts[:n]
        else:
            first = np.arange(n, dtype=np.int64) * width
        spans = list(zip(window.part[rows].tolist(), window.starts[lengths_key][rows].tolist(),
                         lengths[:n].tolist(), first.tolist()))
        for key in self._item_keys[lengths_key]:
            dtype = window.parts[0].columns[key].dtype
            values = np.zeros((size, width), dtype=dtype) if width is not None else np.empty(int(lengths.sum()), dtype=dtype)
            _copy_spans(values, window.views(key), spans)
            batch[key] = values

    def _window_gather(self, batch: dict[str, Any], lengths_key: str, window: _Window, rows: np.ndarray) -> None:
        """``_items`` for the joined rows ``rows`` of a window of short rows: one element gather per
        key from the window's items joined end to end (``_Window.items``), wherever the rows are."""
        lengths = batch[lengths_key]
        n, size = len(rows), len(lengths)
        counts = lengths[:n]
        if self.padded:
            width = int(lengths.max(initial=0))
            keys = self._item_keys[lengths_key]
            padded = [window.padded(key, lengths_key) for key in keys]
            if padded[0] is not None:  # the window's rows padded once: a batch is a gather of rows
                for key, rows_of_window in zip(keys, padded):
                    if size == n:
                        batch[key] = rows_of_window[rows, :width]
                    else:
                        values = np.zeros((size, width), dtype=rows_of_window.dtype)
                        values[:n] = rows_of_window[rows, :width]
                        batch[key] = values
                return
            # A [rows, width] index of every cell, the empty ones pointing at the zero after the
            # window's items: one gather fills the padded batch, padding included, with no scatter.
            starts = window.item_starts(lengths_key)[rows]
            cells = _columns(width)
            source = np.add(starts[:, None], cells)
            source[cells >= counts[:, None]] = window.zero_at(lengths_key)
            for key in self._item_keys[lengths_key]:
                values = np.zeros((size, width), dtype=window.parts[0].columns[key].dtype)
                np.take(window.items(key), source, out=values[:n], mode="clip")  # in range: clip skips a buffer
                batch[key] = values
            return
        starts = window.item_starts(lengths_key)[rows]
        counts = counts.astype(np.int64, copy=False)
        total = int(counts.sum())
        before = np.cumsum(counts) - counts  # items of the batch's earlier rows
        shift = np.arange(total, dtype=np.int64) - np.repeat(before, counts)  # each item's place in its row
        source = np.repeat(starts, counts) + shift
        for key in self._item_keys[lengths_key]:  # flat: the rows' items end to end, in order
            batch[key] = np.take(window.items(key), source)


def _columns(width: int) -> np.ndarray:
    """``[0, 1, ..., width - 1]`` (int64), shared: read only."""
    global _COLUMNS
    if len(_COLUMNS) < width:
        grown = np.arange(max(width, 2 * len(_COLUMNS)), dtype=np.int64)
        grown.flags.writeable = False
        _COLUMNS = grown
    return _COLUMNS[:width]


_COLUMNS = np.zeros(0, dtype=np.int64)
_SLICE_ROWS_FROM = 32  # items per row, on average, from which rows are copied a slice each
_PAD_GROWTH = 2.5  # a window's short rows are padded once when that takes at most this x their items' cells
_JOIN_BYTES = 64 << 20  # at most this much of a shuffle window's short rows' items joined for gathering
_WIDE_ROW = 1024  # bytes a row from which a per-row key (a fixed-size list) stays in its reads in a window


def _copy_spans(out: np.ndarray, sources: list[Any], spans: list[tuple[int, int, int, int]]) -> None:
    """For each ``(source, begin, count, first)``: ``count`` items of ``sources[source]`` from
    ``begin`` into the flattened ``out`` from ``first``, a slice each. ``sources`` are 1-D arrays
    or their ``_flat_view``s."""
    target, views = _flat_view(out.reshape(-1)), [_flat_view(source) for source in sources]
    for p, b, c, f in spans:
        target[f:f + c] = views[p][b:b + c]


def _flat_view(array: np.ndarray) -> Any:
    """A 1-D array as a memoryview when it can be one: slicing and assigning memoryviews costs half
    what numpy's slices cost, per row copied."""
    if isinstance(array, memoryview):
        return array
    try:
        return memoryview(array) if array.flags.c_contiguous else array
    except (TypeError, ValueError, BufferError):  # a dtype without a buffer format
        return array


class _Piece:
    """Rows ``rows`` of ``source`` (a slice when consecutive), delivered at places ``at`` of the
    batch (a slice when consecutive there)."""

    def __init__(self, source: Converted, rows: np.ndarray, at: slice | np.ndarray) -> None:
        self.source, self.at = source, at
        n = len(rows)
        first = int(rows[0]) if n else 0
        consecutive = not n or int(rows[-1]) - first == n - 1 and bool(np.all(np.diff(rows) == 1))
        self.rows: slice | np.ndarray = slice(first, first + n) if consecutive else rows


def _runs(read: np.ndarray, index: np.ndarray, parts: dict[int, Converted], distinct: int) -> list[_Piece] | None:
    """The pieces of a batch whose rows come read after read (no shuffle: each read's rows
    together); None when they interleave. ``distinct``: how many reads the rows come from."""
    cut = np.flatnonzero(read[1:] != read[:-1]) + 1
    if len(cut) >= distinct:  # more runs than reads: interleaved (a shuffle window)
        return None
    begins, ends = np.r_[0, cut].tolist(), np.r_[cut, len(read)].tolist()
    keys = read[begins].tolist()
    if len(keys) != len(set(keys)):
        return None
    return [_Piece(parts[key], index[a:b], slice(a, b)) for key, a, b in zip(keys, begins, ends)]


class _Window:
    """The reads a shuffle window's batches draw from, with their per-row columns joined (a few
    numbers per row), so each per-row key of a batch is one gather whichever reads its rows come
    from. List items stay in their reads; ``part`` and ``starts`` say where a joined row's are."""

    def __init__(self, keys: list[int], parts: dict[int, Converted], batch_keys: list[str],
                 items_of: dict[str, str | None]) -> None:
        self.keys = np.asarray(keys, dtype=np.int64)
        self.holds = frozenset(keys)
        self.parts = [parts[k] for k in keys]
        self._views: dict[str, list[Any]] = {}
        self._items: dict[str, np.ndarray] = {}
        self._joins: dict[str, bool] = {}
        self._item_starts: dict[str, np.ndarray] = {}
        self._counts: dict[str, list[int]] = {}
        self._padded: dict[str, np.ndarray | None] = {}
        self._grouped: tuple[np.ndarray, list[tuple[int, np.ndarray, np.ndarray]]] | None = None
        self.row_base = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([p.rows for p in self.parts], out=self.row_base[1:])
        self.part = np.repeat(np.arange(len(keys)), np.diff(self.row_base))  # per joined row, its read
        # Per list: where each joined row's items begin in its own read.
        self.starts = {lengths: np.concatenate([p.offsets[lengths][:-1] for p in self.parts])
                       for lengths in self.parts[0].offsets}
        self.columns: dict[str, Any] = {}
        wide: set[str] = set()
        # Huge groups' parts (streamed) whose per-row numbers together would be a large copy (512 int32
        # columns: the whole window again) leave them in their reads too; list lengths stay joined.
        leave = any(p.streamed for p in self.parts) and sum(
            p.columns[k].nbytes for p in self.parts for k in batch_keys
            if items_of[k] is None and isinstance(p.columns[k], np.ndarray)) > _JOIN_BYTES
        for key in batch_keys:
            if items_of[key] is None:
                values = [p.columns[key] for p in self.parts]
                if isinstance(values[0], np.ndarray) and (values[0].ndim > 1 and values[0].itemsize * int(
                        np.prod(values[0].shape[1:])) >= _WIDE_ROW or leave and key not in self.starts):
                    wide.add(key)  # whole rows of tokens: gathered from their reads, not copied once more
                    continue
                self.columns[key] = np.concatenate(values) if isinstance(values[0], np.ndarray) else [
                    v for part in values for v in part]
        self.wide = frozenset(wide)

    def wide_rows(self, key: str, rows: np.ndarray, pad: int) -> np.ndarray:
        """Joined rows ``rows`` of ``key``, a per-row key of wide rows (fixed-size lists, such as
        4,096 tokens a row) that the window leaves in its reads, then ``pad`` rows of zeros: one
        gather per read the rows come from."""
        first = self.parts[0].columns[key]
        out = np.empty((len(rows) + pad,) + first.shape[1:], dtype=first.dtype)
        out[len(rows):] = 0
        for k, places, local in self._by_read(rows):
            out[places] = self.parts[k].columns[key][local]
        return out

    def _by_read(self, rows: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``rows`` grouped by the read holding them: (read, places in ``rows``, rows in the read);
        the last grouping kept, as each wide key of a batch asks for the same rows."""
        if self._grouped is not None and self._grouped[0] is rows:
            return self._grouped[1]
        part = self.part[rows]
        order = np.argsort(part, kind="stable")
        cuts = (np.flatnonzero(np.diff(part[order])) + 1).tolist()
        groups = []
        for a, b in zip([0] + cuts, cuts + [len(rows)]):
            places = order[a:b]
            if len(places):
                k = int(part[places[0]])
                groups.append((k, places, rows[places] - self.row_base[k]))
        self._grouped = (rows, groups)
        return groups

    def views(self, key: str) -> list[Any]:
        """Each read's column ``key`` as a ``_flat_view``, made once per window."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [_flat_view(p.columns[key]) for p in self.parts]
        return views

    def rows(self, read: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Joined row numbers of rows ``index`` of reads ``read``."""
        return index + self.row_base[np.searchsorted(self.keys, read)]

    def joins(self, lengths: str, keys: list[str]) -> bool:
        """Whether batches gather the items of list ``lengths`` (keys ``keys``) element by element
        from the window's items joined end to end: when its rows hold few items on average (else a
        slice per row costs less) and the joined copy stays within ``_JOIN_BYTES``."""
        joins = self._joins.get(lengths)
        if joins is None:
            items = sum(int(p.offsets[lengths][-1]) for p in self.parts)
            size = items * sum(self.parts[0].columns[k].itemsize for k in keys)
            joins = self._joins[lengths] = items < _SLICE_ROWS_FROM * int(self.row_base[-1]) and size <= _JOIN_BYTES
        return joins

    def items(self, key: str) -> np.ndarray:
        """The items of list key ``key`` of every read, end to end, then one zero (``zero_at``),
        which padded cells gather (made once per window)."""
        joined = self._items.get(key)
        if joined is None:
            columns = [p.columns[key] for p in self.parts]
            joined = self._items[key] = np.concatenate(columns + [np.zeros(1, dtype=columns[0].dtype)])
        return joined

    def padded(self, key: str, lengths: str) -> np.ndarray | None:
        """The items of list key ``key`` of every joined row, padded to ``[rows, longest]`` once per
        window (one vectorised pass; a batch then gathers whole rows), or None when that array would
        exceed ``_PAD_GROWTH`` x the items' own size or ``_JOIN_BYTES`` (a few long rows among
        short ones): batches then gather items one by one."""
        if key in self._padded:
            return self._padded[key]
        counts = self.columns[lengths]
        width = int(counts.max(initial=0))
        items = sum(self._item_counts(lengths))
        itemsize = self.parts[0].columns[key].itemsize
        out = None
        if len(counts) * width <= _PAD_GROWTH * max(items, 1) and len(counts) * width * itemsize <= _JOIN_BYTES:
            out = np.zeros((len(counts), width), dtype=self.parts[0].columns[key].dtype)
            out[_columns(width) < counts[:, None]] = np.concatenate([p.columns[key] for p in self.parts])
        self._padded[key] = out
        return out

    def zero_at(self, lengths: str) -> int:
        """Where the zero after the items of list ``lengths`` is, in ``items``."""
        return sum(self._item_counts(lengths))

    def _item_counts(self, lengths: str) -> list[int]:
        counts = self._counts.get(lengths)
        if counts is None:
            counts = self._counts[lengths] = [int(p.offsets[lengths][-1]) for p in self.parts]
        return counts

    def item_starts(self, lengths: str) -> np.ndarray:
        """Per joined row, where its items of list ``lengths`` begin in ``items``."""
        starts = self._item_starts.get(lengths)
        if starts is None:
            ends = np.cumsum([int(p.offsets[lengths][-1]) for p in self.parts])
            base = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            starts = self._item_starts[lengths] = self.starts[lengths] + base[self.part]
        return starts


def _pick(values: Any, rows: Any) -> Any:
    """Rows ``rows`` (a slice or an index array) of a per-row column (an array or a list)."""
    if isinstance(rows, slice):
        return values[rows]
    if isinstance(values, np.ndarray):
        return values[rows]
    return [values[i] for i in rows.tolist()]


def _sub(rows: Any, a: int, b: int) -> Any:
    """Entries ``a:b`` of ``rows`` (a slice or an index array)."""
    if isinstance(rows, slice):
        return slice(rows.start + a, rows.start + b)
    return rows[a:b]


def _rows_of(values: Any, rows: Any, pad: int) -> Any:
    """A batch's own copy of rows ``rows`` of a per-row column, then ``pad`` padding rows (zeros;
    None for text)."""
    if not isinstance(values, np.ndarray):
        picked = values[rows] if isinstance(rows, slice) else [values[i] for i in rows.tolist()]
        return picked + [None] * pad if pad else picked
    if isinstance(rows, slice):
        return _with_zeros(values[rows], pad, copy=True)
    if not pad:
        return values[rows]  # an index: a third of np.take's call cost, on a few hundred rows
    out = np.zeros((len(rows) + pad,) + values.shape[1:], dtype=values.dtype)
    out[:len(rows)] = values[rows]
    return out


def _with_zeros(values: np.ndarray, pad: int, copy: bool = False) -> np.ndarray:
    """``values`` then ``pad`` rows of zeros, in a new array (``values`` itself, or a copy of it
    with ``copy``, when ``pad`` is 0)."""
    if not pad:
        return np.array(values, copy=True) if copy else values
    out = np.zeros((len(values) + pad,) + values.shape[1:], dtype=values.dtype)
    out[:len(values)] = values
    return out


def _with_minus_ones(values: np.ndarray, pad: int) -> np.ndarray:
    out = np.full(len(values) + pad, -1, dtype=np.int64)
    out[:len(values)] = values
    return out


def _with_padding(values: np.ndarray, size: int) -> torch.Tensor:
    out = np.full(size, -1, dtype=np.int64)
    out[: len(values)] = values
    return torch.from_numpy(out)
