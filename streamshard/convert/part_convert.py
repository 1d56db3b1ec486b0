"""A streamed read (a huge row group's part, ``reader.StreamedPart``) converted piece by piece.

``gather.convert_read`` converts a read's Arrow table at once; for a table of many record batches
that first joins them (a copy of the whole part) and then keeps the part in Arrow while batches are
gathered from it, so a worker owning part of a huge row group held its part two or three times
over. Here each piece (a record batch of the part, as it is decoded) is converted on its own and
appended to growing flat columns, and let go before the next is decoded: the worker holds the part
once, in the flat form batches gather from, plus one piece. The columns grow by ``realloc`` (for
arrays this large glibc moves pages rather than copying them) from a size estimated from the
rows already seen, and are cut to their size at the end. A wide part comes in passes over subsets of
its columns (``reader.column_passes``): each pass is converted the same way into its own columns.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import torch

from .gather import Converted, _item_offsets
from .tensors import BatchConverter

_SPARE = 1.02  # a column's room, estimated from the rows seen so far, is this much above the estimate


class _Growing:
    """One flat numpy column appended to, piece after piece."""

    def __init__(self) -> None:
        self.array: np.ndarray | None = None
        self.size = 0

    def append(self, values: np.ndarray, rows_seen: int, rows: int) -> None:
        """Append ``values`` (``rows_seen`` of the part's ``rows`` rows have now come)."""
        n = len(values)
        need = self.size + n
        if self.array is None or need > len(self.array):
            per_row = need / max(rows_seen, 1)
            room = max(need, math.ceil(per_row * rows * _SPARE) if rows_seen else need)
            if self.array is None:
                self.array = np.empty((room,) + values.shape[1:], dtype=values.dtype)
            else:
                room = max(room, len(self.array) + len(self.array) // 4)
                self.array.resize((room,) + self.array.shape[1:], refcheck=False)  # realloc: no copy held
        self.array[self.size:need] = values
        self.size = need

    def result(self, empty: np.ndarray) -> np.ndarray:
        if self.array is None:
            return empty
        if self.size < len(self.array):
            self.array.resize((self.size,) + self.array.shape[1:], refcheck=False)
        return self.array


def convert_part(part: Iterable[Iterable[tuple[pa.Table, np.ndarray | None]]], rows: int,
                 converter: BatchConverter) -> Converted:
    """``gather.convert_read`` of the ``rows`` rows of ``part``'s pieces taken together, converting one
    piece at a time and letting it go before the next is taken. ``part`` (``reader.StreamedPart``) is
    one or more passes over the part's rows, each over some of its columns; a pass's pieces are each a
    table and the positions of the part's rows in it (None: all). A column already converted in an
    earlier pass is not converted again. Scattered rows are picked out of the converted piece by numpy
    (a gather per column, no Arrow ``take``)."""
    flat = converter.flat_twin()
    items_of = converter.items_of or {}
    growing: dict[str, _Growing] = {}
    texts: dict[str, list[Any]] = {}
    empty: dict[str, np.ndarray] = {}
    done: set[str] = set()
    for pieces in part:
        seen, names, pass_converter = 0, None, flat
        for table, picks in pieces:
            if names is None:
                names = [name for name in table.column_names if name not in done]
                pass_converter = flat.of_columns(names)
            if not names:  # only columns converted already
                continue
            if names != table.column_names:
                table = table.select(names)
            columns = pass_converter.convert(table, copy=False)
            table = None  # noqa: F841 - the piece goes as soon as it is copied out
            if picks is not None:
                columns = _picked(columns, picks, items_of)
            seen += len(picks) if picks is not None else _rows_of(columns, items_of)
            for key, value in columns.items():
                if isinstance(value, torch.Tensor):
                    value = value.numpy()
                if isinstance(value, np.ndarray):
                    empty.setdefault(key, value[:0].copy())
                    growing.setdefault(key, _Growing()).append(value, seen, rows)
                else:
                    texts.setdefault(key, []).extend(value)
            columns = None  # noqa: F841
        if names and seen != rows:
            raise AssertionError(f"a streamed part held {seen} rows, announced {rows}")  # the reader checks this
        done.update(names or ())
    out: dict[str, Any] = {}
    for key in flat.keys:
        out[key] = growing[key].result(empty[key]) if key in growing else texts.get(key, [])
    return Converted(rows, out, _item_offsets(out, converter), streamed=True)


def _rows_of(columns: dict[str, Any], items_of: dict[str, str | None]) -> int:
    """Rows of a converted piece: the length of any per-row key."""
    for key, value in columns.items():
        if items_of.get(key) is None:
            return len(value)
    raise AssertionError("a converted piece without a per-row key")  # every list has its lengths key


def _picked(columns: dict[str, Any], picks: np.ndarray, items_of: dict[str, str | None]) -> dict[str, Any]:
    """Rows ``picks`` of a converted piece: per-row keys gathered, list items gathered by their rows'
    offsets (``items_of`` names each item key's lengths key)."""
    items: dict[str, np.ndarray] = {}  # lengths key -> the picked rows' item positions
    out: dict[str, Any] = {}
    for key, value in columns.items():
        lengths = items_of.get(key)
        if isinstance(value, torch.Tensor):
            value = value.numpy()
        if lengths is None:
            out[key] = np.take(value, picks, axis=0) if isinstance(value, np.ndarray) else [value[i] for i in picks.tolist()]
            continue
        where = items.get(lengths)
        if where is None:
            counts = np.asarray(columns[lengths] if not isinstance(columns[lengths], torch.Tensor)
                                else columns[lengths].numpy(), dtype=np.int64)
            starts = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=starts[1:])
            wanted = counts[picks]
            before = np.cumsum(wanted) - wanted  # items of the picked rows before each one
            where = items[lengths] = np.repeat(starts[picks] - before, wanted) + np.arange(int(wanted.sum()), dtype=np.int64)
        out[key] = np.take(value, where, axis=0) if isinstance(value, np.ndarray) else [value[i] for i in where.tolist()]
    return out
