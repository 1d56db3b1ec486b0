"""Arrow -> torch: how each column type becomes tensors (decided once per schema, applied per batch).

| Arrow type                                     | batch entries                                               |
|------------------------------------------------|-------------------------------------------------------------|
| bool, int8..int64, uint8, float16/32/64         | 1-D tensor of the same dtype                                |
| uint16 / uint32 / uint64                        | 1-D int32 / int64 / int64 (uint64 above 2**63-1 is an error)  |
| timestamp, date64, time64, duration             | 1-D int64 in the column's unit since the epoch               |
| date32, time32                                  | 1-D int32                                                   |
| decimal32/64/128/256, any precision and scale   | 1-D float64: the nearest double while the unscaled integer is |
|                                                | below 2**53, else within one unit in the last place (float64 |
|                                                | holds 15-16 significant digits); ``decimals="scaled_int64"``: |
|                                                | exact int64 value * 10**scale (``BatchConverter.scales``);    |
|                                                | a value beyond int64 is an error                            |
| dictionary<...>                                 | decoded, then as its value type                             |
| list / large_list<number>                       | 2-D tensor padded with 0 + ``<name>_lengths`` (int64);       |
|                                                | with ``lists="flat"``: 1-D values of all rows + lengths      |
| fixed_size_list<number>[k] (column, struct field) | 2-D tensor ``[rows, k]``                                  |
| lists of lists, any depth and list kind         | 1-D values of all rows end to end (whatever ``lists=``),     |
|                                                | ``<name>_lengths`` (level-1 items per row), ``<name>_lengths.1`` |
|                                                | (level-2 items per level-1 item), ``<name>_lengths.2``, ...   |
| struct                                          | one entry per field, named ``<name>.<field>``, recursively   |
| list<struct>                                    | per field a list entry ``<name>.<field>`` shaped as its depth |
|                                                | says, all sharing ``<name>_lengths``, recursively             |
| map<k, v>                                       | as list<struct<key, value>>: ``<name>.key``, ``<name>.value``, |
|                                                | ``<name>_lengths``                                          |
| string, binary (also large/dictionary/lists)    | Python list, nested per list level, ``None`` for nulls       |
| null, list<null>, union, interval, ...          | ``ConversionError`` naming the file, the column and the cause |

Nulls are decided from the schema, so a batch's keys never depend on its contents (every batch
of an epoch, on every worker, has the same keys):

* a nullable column (the catalog clears ``nullable`` when no file's statistics allow a null)
  gets ``<name>_mask`` (bool, True = present); null values read as 0, null lists as length 0;
* a nullable list below the rows gets ``<name>_mask.<k>``: one entry per level-k item;
* a nullable list element field (``list<item: int32>``, unlike ``list<item: int32 not null>``)
  gets ``<name>_values_mask`` shaped like ``<name>`` (padded or flat); null elements read as 0;
* a struct's nulls are nulls of its fields (text keeps ``None`` in its Python lists instead).

Keys in :attr:`BatchConverter.ragged_keys` hold entries of all rows end to end rather than one
per row (flat values and their masks, inner-level lengths and masks): padding rows add none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import pyarrow as pa
import torch

from ..errors import ConversionError
from .tensors_lists import Level, is_list, map_entries, pad, regroup, slots, unnest
from .tensors_values import DECIMAL_FORMATS, ValueFault, is_number, numbers, valid

Batch = dict[str, Any]

LIST_FORMATS = ("padded", "flat")


@dataclass(frozen=True)
class _Leaf:
    """Values of one kind at one depth: numbers become a tensor, text a Python list."""

    key: str
    mask: str | None  # key of the validity mask; None when the schema rules nulls out
    text: bool = False
    padded: bool = False  # one list level above and lists="padded": [rows, longest]
    width: int | None = None  # a top-level fixed_size_list: [rows, width]


@dataclass(frozen=True)
class _Struct:
    fields: tuple[tuple[int, _Node], ...]  # (child index, plan)


@dataclass(frozen=True)
class _List:
    item: _Node
    lengths: str | None  # None for a top-level fixed_size_list of numbers
    mask: str | None


_Node = _Leaf | _Struct | _List


INNER_NULLS = ("error", "mask")


def check_conversion_options(lists: str, decimals: str, inner_nulls: str) -> None:
    """ValueError naming the first of ``lists``, ``decimals``, ``inner_nulls`` that is not a known choice."""
    for name, value, choices in (("lists", lists, LIST_FORMATS), ("decimals", decimals, DECIMAL_FORMATS),
                                 ("inner_nulls", inner_nulls, INNER_NULLS)):
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")


class _How(NamedTuple):
    decimals: str
    copy: bool = True  # False: numbers may be read-only views of Arrow's buffers


class BatchConverter:
    """Turns Arrow tables of one schema into ``dict[str, tensor | list]`` batches."""

    def __init__(self, schema: pa.Schema, source: str = "", lists: str = "padded", decimals: str = "float64",
                 inner_nulls: str = "error") -> None:
        """Check every column once; ``source`` (a file URL) is named in errors.

        ``lists="flat"`` gives single-level list columns as 1-D values plus lengths (no
        padding: fewer bytes to move between processes); ``pad_lists`` pads them later, on any
        device. Deeper lists are always flat. ``decimals="scaled_int64"`` gives decimals as
        exact int64 ``value * 10**scale`` instead of float64 (see :attr:`scales`).
        """
        check_conversion_options(lists, decimals, inner_nulls)
        self.schema = schema
        self._how = _How(decimals)
        planner = _Planner(source, lists == "flat", decimals, inner_nulls == "mask")
        self._columns = [(field.name, planner.column(field)) for field in schema]
        self._keys = list(planner.keys)
        self._ragged = frozenset(planner.ragged)
        self._scales = dict(planner.scales)
        self._args = (source, decimals, inner_nulls)
        self._flat = lists == "flat"
        # Keys with one entry per row map to None, list items to their list's lengths key.
        self.items_of: dict[str, str | None] | None = None if planner.deep else dict(planner.items_of)
        self._flat_twin: BatchConverter | None = self if self._flat else None

    @property
    def ragged_keys(self) -> frozenset[str]:
        """Keys whose tensors hold entries of all rows end to end (not one entry per row).

        Flat list values and their ``_values_mask``, and the lengths and masks of inner list
        levels (``<name>_lengths.1``, ``<name>_mask.1``, ...): a padding row (length 0 at the
        outer level) adds no entries to them, and joining two batches concatenates them.
        """
        return self._ragged

    @property
    def flat_lists(self) -> bool:
        """Whether single-level list columns come as 1-D values of all rows (``lists="flat"``)."""
        return self._flat

    def flat_twin(self) -> BatchConverter:
        """This converter with ``lists="flat"``: the form whole row groups are converted to once,
        before batches gather their rows (``convert/gather.py``)."""
        if self._flat_twin is None:
            self._flat_twin = BatchConverter(self.schema, self._args[0], "flat", *self._args[1:])
        return self._flat_twin

    def of_columns(self, names: Sequence[str]) -> BatchConverter:
        """This converter for the columns ``names`` of its schema only (a streamed part decoded in passes
        over subsets of its columns, ``convert/part_convert.py``): the same keys, for those columns."""
        if list(names) == self.schema.names:
            return self
        schema = pa.schema([self.schema.field(name) for name in names])
        return BatchConverter(schema, self._args[0], "flat" if self._flat else "padded", *self._args[1:])

    @property
    def keys(self) -> list[str]:
        """Every key a batch holds (besides ``sample_id``), in order."""
        return list(self._keys)

    @property
    def scales(self) -> dict[str, int]:
        """With ``decimals="scaled_int64"``: each decimal key's scale (the value is ``tensor / 10**scale``)."""
        return dict(self._scales)

    def __call__(self, table: pa.Table | pa.RecordBatch) -> Batch:
        """The batch of ``table``'s rows: exactly :attr:`keys`, in that order."""
        return self.convert(table)

    def convert(self, table: pa.Table | pa.RecordBatch, copy: bool = True) -> Batch:
        """``self(table)``; with ``copy=False`` number entries are numpy arrays, possibly read-only
        views of Arrow's buffers (for rows gathered into batches later, never handed out as they are)."""
        how = self._how if copy else self._how._replace(copy=False)
        if isinstance(table, pa.Table):
            table = table.combine_chunks().to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema=table.schema)
        out: Batch = {}
        for name, node in self._columns:
            _walk(node, table.column(name), [], out, how)
        return {key: out[key] for key in self._keys}


def _walk(node: _Node, array: pa.Array, levels: list[Level], out: Batch, how: _How) -> None:
    """Convert ``array`` (the items at depth ``len(levels)``) as ``node`` plans, into ``out``."""
    if isinstance(node, _Struct):
        children = array.flatten()  # the struct's own nulls become nulls of its fields
        for index, child in node.fields:
            _walk(child, children[index], levels, out, how)
    elif isinstance(node, _List):
        level, items = unnest(array)
        if node.lengths is not None:
            out[node.lengths] = torch.from_numpy(level.lengths)
        if node.mask is not None:
            out[node.mask] = torch.from_numpy(level.present)
        _walk(node.item, items, levels + [level], out, how)
    elif node.text:
        out[node.key] = regroup(array.to_pylist(), levels)
        if node.mask is not None:
            out[node.mask] = torch.from_numpy(valid(array))
    else:
        _numbers_leaf(node, array, levels, out, how)


def _numbers_leaf(node: _Leaf, array: pa.Array, levels: list[Level], out: Batch, how: _How) -> None:
    try:
        values = numbers(array, how.decimals, how.copy)
    except ValueFault as exc:
        raise ConversionError(f"column {node.key!r}: {exc}") from None  # delivery adds the file and row group
    if node.mask is None and levels and array.null_count:
        raise ConversionError(f"column {node.key!r}: null values inside lists; "
                              "pass inner_nulls='mask' to read them as 0 with a <name>_values_mask entry")
    present = valid(array) if node.mask is not None else None
    if node.padded and node.width is not None and values.size == len(levels[0].lengths) * node.width:
        # A fixed-size list with no null lists: its items end to end are the rows, reshaped (no
        # mask pass over every cell; the same array).
        values = values.reshape(len(levels[0].lengths), node.width)
        if present is not None:
            present = present.reshape(values.shape)
    elif node.padded:
        where = slots(levels[0].lengths, node.width)
        values = pad(values, where)
        if present is not None:
            present = where if not array.null_count else pad(present, where)  # no nulls: present = filled
    out[node.key] = torch.from_numpy(values) if how.copy else values  # torch wants writable memory
    if present is not None:
        out[node.mask] = torch.from_numpy(present)


_VALUES, _LENGTHS, _VALUES_MASK, _MASK = range(4)  # the order of a top-level value's keys


class _Planner:
    """Reads a schema once into plans; collects the keys they produce and how each behaves."""

    def __init__(self, source: str, flat: bool, decimals: str, inner_masks: bool) -> None:
        self.source, self.flat, self.decimals, self.inner_masks = source, flat, decimals, inner_masks
        self.keys: list[str] = []
        self._seen: set[str] = set()
        self.ragged: set[str] = set()
        self.scales: dict[str, int] = {}
        self._column: list[tuple[int, int, str]] = []  # (value, rank, key)
        self._values = 0
        # Per key, the lengths key of the list whose items it holds (None: one entry per row); and
        # whether some key sits deeper (inner list levels), which only whole-batch conversion handles.
        self.items_of: dict[str, str | None] = {}
        self.deep = False
        self._items: str | None = None  # the lengths key of the list being planned, at depth 1

    def column(self, field: pa.Field) -> _Node:
        """The plan of one column; its keys join :attr:`keys`: per top-level value (a column or
        struct field), values first, then lengths, values masks and masks."""
        self._column = []
        node = self._plan(field.type, field.name, field.nullable, 0, field)
        self.keys.extend(key for *_, key in sorted(self._column, key=lambda entry: entry[:2]))  # stable
        return node

    def _add(self, key: str, rank: int, ragged: bool, field: pa.Field, items_of: str | None = None) -> str:
        if key in self._seen:
            raise self._refusal(field, f"its entry {key!r} is also the name of another entry")
        self._seen.add(key)
        self.items_of[key] = items_of
        self._column.append((self._values, rank, key))
        if ragged:
            self.ragged.add(key)
        return key

    def _plan(self, t: pa.DataType, name: str, nullable: bool, depth: int, top: pa.Field, width: int | None = None) -> _Node:
        if depth == 0 and not pa.types.is_struct(t):
            self._values += 1
        if pa.types.is_struct(t):
            return _Struct(tuple(
                (i, self._plan(f.type, f"{name}.{f.name}", f.nullable or nullable, depth, top)) for i, f in enumerate(t)
            ))
        if _is_text_tree(t):
            self._add(name, _VALUES, False, top)
            mask = self._add(f"{name}_mask", _MASK, False, top) if nullable and depth == 0 else None
            return _Leaf(name, mask, text=True)
        if is_list(t):
            item = (map_entries(t) if pa.types.is_map(t) else t).value_field
            fixed = depth == 0 and pa.types.is_fixed_size_list(t) and is_number(_decoded(item.type))
            level = "" if depth == 0 else f".{depth}"  # inner levels hold one entry per item, end to end
            lengths = None if fixed else self._add(f"{name}_lengths{level}", _LENGTHS, depth > 0, top)
            mask = self._add(f"{name}_mask{level}", _MASK, depth > 0, top) if nullable else None
            self.deep = self.deep or depth > 0
            outer, self._items = self._items, lengths
            child = self._plan(item.type, name, item.nullable, depth + 1, top, t.list_size if fixed else None)
            self._items = outer
            return _List(child, lengths, mask)
        if is_number(_decoded(t)):
            ragged = depth >= 2 or (depth == 1 and self.flat and width is None)
            items_of = self._items if depth == 1 and width is None else None  # fixed width: [rows, width]
            self.deep = self.deep or depth > 1
            self._add(name, _VALUES, ragged, top, items_of)
            mask = None
            # Writers mark list elements nullable by default (pyarrow does): a mask the size of every
            # token only when asked for; otherwise a null element is an error (see _numbers_leaf).
            if nullable and (depth == 0 or self.inner_masks):
                mask = self._add(f"{name}_mask" if depth == 0 else f"{name}_values_mask",
                                 _MASK if depth == 0 else _VALUES_MASK, ragged, top, items_of)
            if pa.types.is_decimal(_decoded(t)) and self.decimals == "scaled_int64":
                self.scales[name] = _decoded(t).scale
            return _Leaf(name, mask, padded=depth == 1 and not ragged, width=width)
        raise self._refusal(top, _cause(t) + ("" if name == top.name else f" (in {name!r})"))

    def _refusal(self, field: pa.Field, cause: str) -> ConversionError:
        return ConversionError(
            f"{self.source or 'schema'}: column {field.name!r} of type {field.type} (unsupported) has no tensor "
            f"conversion: "
            f"{cause} (leave it out with columns=)"
        )


def _decoded(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_text(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or getattr(pa.types, "is_string_view", lambda _: False)(t)
        or getattr(pa.types, "is_binary_view", lambda _: False)(t)
    )


def _is_text_tree(t: pa.DataType) -> bool:
    """Text, or lists of text to any depth: one Python value per row, nested as the lists are."""
    t = _decoded(t)
    if is_list(t) and not pa.types.is_map(t):
        return _is_text_tree(t.value_type)
    return _is_text(t)


def _cause(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "type null holds no values"
    if pa.types.is_union(t):
        return f"a union ({t}) has no single tensor type"
    if pa.types.is_interval(t):
        return f"{t} (months, days and nanoseconds) has no exact tensor form"
    return f"{t} has no tensor meaning"


def pad_lists(values: torch.Tensor, lengths: torch.Tensor, width: int | None = None, value: float = 0) -> torch.Tensor:
    """Pad a flat list column (``lists="flat"``) to ``[rows, width]`` on the tensors' own device.

    ``width`` defaults to the longest row; rows longer than ``width`` are an error.
    """
    lengths = lengths.to(values.device)
    longest = int(lengths.max()) if lengths.numel() else 0
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a row has {longest} values, more than width={width}")
    out = values.new_full((lengths.numel(), width), value)
    out[torch.arange(width, device=values.device) < lengths[:, None]] = values
    return out
