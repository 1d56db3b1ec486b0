"""Batches gathered from row groups converted once: how delivery turns decoded rows into tensors.

Converting Arrow to tensors costs a few dozen library calls whatever the number of rows. Paid per
batch (256 rows drawn from the ~16 row groups of a shuffle window: a take from each, a concat, a
reorder, then the conversion), that Python is most of a worker thread's time, and it holds the
GIL the other workers need. So each read is converted once, on the read-ahead thread that decoded
it (:func:`convert_read`, to flat numpy columns), and a batch is a few numpy gathers from each
read it draws from (:class:`Gatherer`), written straight into its padded shape. Joining a shuffle
window's reads into one array first would save gathers, but a fresh copy of a window costs more in
page faults than the gathers it saves.

Schemas with inner list levels (lists of lists, whose entries hang off items rather than rows)
keep the whole-batch conversion (``delivery.build``); :func:`gatherable` says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from .batch_plan import BatchSpec
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


def gatherable(converter: BatchConverter | None) -> bool:
    """Whether batches of ``converter``'s schema can be gathered from converted reads."""
    return converter is not None and converter.items_of is not None


def convert_read(table: pa.Table, converter: BatchConverter) -> Converted:
    """``table`` (a read's decoded rows) converted once, in the flat form batches gather from."""
    flat = converter.flat_twin()(table)
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
        self.padded = not converter.flat_lists

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
        if len(keys) == 1 or spec.rows == 0:
            picks = [_Pick(parts[keys[0]], index, slice(0, len(index)))]
        else:
            picks = _picks(spec.read, index, parts)
        batch = self.gather(picks, spec.rows + spec.padding)
        size = spec.rows + spec.padding
        batch[SAMPLE_ID] = _with_padding(spec.sample_id, size)
        if spec.corpus is not None:
            batch[CORPUS] = _with_padding(spec.corpus, size)
        return batch

    def gather(self, picks: list[_Pick], size: int) -> Batch:
        """Every pick's rows at its places, the rest of the ``size`` rows padding (zeros, False,
        None; no items), as one batch of :attr:`BatchConverter.keys`."""
        lists: dict[str, _Items] = {}
        out: Batch = {}
        for key in self.keys:
            lengths_key = self.items_of[key]
            if lengths_key is None:
                out[key] = _rows(key, picks, size)
                continue
            if lengths_key not in lists:
                lists[lengths_key] = _Items(picks, lengths_key, size, self.padded)
            out[key] = torch.from_numpy(lists[lengths_key].values(key, picks))
        return out


class _Pick:
    """Rows ``index`` of ``source``, delivered at places ``at`` of the batch (a slice when they are
    consecutive there)."""

    def __init__(self, source: Converted, index: np.ndarray, at: slice | np.ndarray) -> None:
        self.source, self.index, self.at, self.n = source, index, at, len(index)
        first = int(index[0]) if self.n else 0
        # Consecutive rows of the read (no shuffle): slices instead of gathers.
        self.run = slice(first, first + self.n) if not self.n or int(index[-1]) - first == self.n - 1 and bool(
            np.all(np.diff(index) == 1)) else None

    def rows(self, column: Any) -> Any:
        if self.run is not None:
            return column[self.run]
        if isinstance(column, np.ndarray):
            return np.take(column, self.index, axis=0)
        return [column[i] for i in self.index.tolist()]

    def bounds(self, lengths_key: str) -> tuple[np.ndarray, np.ndarray]:
        """Where each row's items begin in the read, and how many it has."""
        offsets = self.source.offsets[lengths_key]
        if self.run is not None:
            bounds = offsets[self.run.start:self.run.stop + 1]
            return bounds[:-1], np.diff(bounds)
        starts = offsets[self.index]
        return starts, offsets[self.index + 1] - starts


class _Items:
    """Where the items of one list (every key sharing its lengths) go: per pick the items to take
    from its read, and their places in the batch's output (flat, or ``[rows, longest]``)."""

    def __init__(self, picks: list[_Pick], lengths_key: str, size: int, padded: bool) -> None:
        bounds = [pick.bounds(lengths_key) for pick in picks]
        self.lengths = lengths = np.zeros(size, dtype=np.int64)
        for pick, (_, counts) in zip(picks, bounds):
            lengths[pick.at] = counts
        self.offsets = offsets = np.zeros(size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        self.width = int(lengths.max(initial=0)) if padded else None
        self.total = int(offsets[-1])
        self.runs = all(p.run is not None and isinstance(p.at, slice) for p in picks)
        if self.runs:  # no shuffle: each pick's items are one slice of its read and one of the batch
            self.take = [slice(int(b[0][0]), int(b[0][0]) + int(b[1].sum())) if p.n else slice(0, 0)
                         for p, b in zip(picks, bounds)]
            return
        # Shuffled: all picks at once, in pick order; item j of a row goes to its row's start + j.
        starts = np.concatenate([b[0] for b in bounds])
        counts = np.concatenate([b[1] for b in bounds])
        before = np.cumsum(counts) - counts  # items of earlier rows, in pick order
        shift = np.arange(self.total, dtype=np.int64) - np.repeat(before, counts)
        take = np.repeat(starts, counts) + shift
        cut = before[np.cumsum([p.n for p in picks[:-1]], dtype=np.int64)] if len(picks) > 1 else []
        self.take = np.split(take, cut)
        rows = np.concatenate([np.arange(p.at.start, p.at.stop) if isinstance(p.at, slice) else p.at for p in picks])
        first = rows * self.width if padded else offsets[rows]  # where each row's first item goes
        assert self.width is not None or not padded
        self.place = np.repeat(first, counts) + shift

    def values(self, key: str, picks: list[_Pick]) -> np.ndarray:
        """Key ``key``'s items, laid out as the batch holds them (its own memory)."""
        dtype = picks[0].source.columns[key].dtype
        size = len(self.lengths)
        if self.runs:
            parts = [pick.source.columns[key][where] for pick, where in zip(picks, self.take)]
            flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if self.width is None:
                return flat.copy() if len(parts) == 1 else flat  # never a view of rows held for later
            padded = np.zeros((size, self.width), dtype=dtype)
            if flat.size:  # a boolean mask visits cells row-major: the items' order
                padded[np.arange(self.width) < self.lengths[:, None]] = flat
            return padded
        taken = np.empty(self.total, dtype=dtype)
        at = 0
        for pick, where in zip(picks, self.take):
            np.take(pick.source.columns[key], where, out=taken[at:at + len(where)])
            at += len(where)
        if self.width is None:
            out = np.empty(self.total, dtype=dtype)
            out[self.place] = taken
            return out
        padded = np.zeros((size, self.width), dtype=dtype)
        padded.reshape(-1)[self.place] = taken
        return padded


def _picks(read: np.ndarray, index: np.ndarray, parts: dict[int, Converted]) -> list[_Pick]:
    """The rows of a batch drawing from several reads, grouped by read: consecutive runs when each
    read's rows come together (no shuffle), else each read's rows wherever they sit."""
    cut = np.flatnonzero(read[1:] != read[:-1]) + 1
    begins, ends = np.r_[0, cut], np.r_[cut, len(read)]
    runs = read[begins].tolist()
    if len(runs) == len(set(runs)):
        return [_Pick(parts[key], index[a:b], slice(a, b)) for key, a, b in zip(runs, begins.tolist(), ends.tolist())]
    order = np.argsort(read, kind="stable")
    grouped = read[order]
    cut = np.flatnonzero(grouped[1:] != grouped[:-1]) + 1
    return [_Pick(parts[int(grouped[a])], index[order[a:b]], order[a:b])
            for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, len(read)].tolist())]


def _rows(key: str, picks: list[_Pick], size: int) -> Any:
    """A per-row key: every pick's rows at their places, the rest padding (zeros; None for text)."""
    column = picks[0].source.columns[key]
    if not isinstance(column, np.ndarray):
        values: list[Any] = [None] * size
        for pick in picks:
            rows = pick.rows(pick.source.columns[key])
            if isinstance(pick.at, slice):
                values[pick.at] = rows
            else:
                for place, value in zip(pick.at.tolist(), rows):
                    values[place] = value
        return values
    out = np.zeros((size,) + column.shape[1:], dtype=column.dtype)
    for pick in picks:
        out[pick.at] = pick.rows(pick.source.columns[key])
    return torch.from_numpy(out)


def _with_padding(values: np.ndarray, size: int) -> torch.Tensor:
    out = np.full(size, -1, dtype=np.int64)
    out[: len(values)] = values
    return torch.from_numpy(out)
