"""Arrow -> torch: how each column type becomes tensors (decided once per schema, applied per batch).

| Arrow type                                   | batch entries                                            |
|----------------------------------------------|----------------------------------------------------------|
| bool, int8..int64, uint8, float16/32/64       | 1-D tensor of the same dtype                             |
| uint16 / uint32 / uint64                      | 1-D int32 / int64 / int64 (uint64 above 2**63-1 is an error) |
| timestamp, date64, time64, duration           | 1-D int64 in the column's unit since the epoch            |
| date32, time32                                | 1-D int32                                                |
| dictionary<numeric>                           | decoded, then as its value type                          |
| list / large_list<numeric>                    | 2-D tensor padded with 0 + ``<name>_lengths`` (int64);    |
|                                              | with ``lists="flat"``: 1-D values of all rows + lengths   |
| fixed_size_list<numeric>[k]                   | 2-D tensor ``[rows, k]``                                 |
| struct                                        | one entry per field, named ``<name>.<field>``, recursively |
| string, binary (also large/dictionary/lists)  | Python list, ``None`` for nulls                          |
| decimal, map, list<list>, union, ...          | ``ConversionError`` naming the file and column           |

A column whose statistics do not rule out nulls (schema field ``nullable``) also gets
``<name>_mask`` (bool, True = present) in every batch; null values read as 0 and null lists as
length 0. The keys of a batch never depend on its contents, so every batch of an epoch, on
every worker, has the same structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from .errors import ConversionError

Batch = dict[str, Any]

_WIDENED = {pa.uint16(): pa.int32(), pa.uint32(): pa.int64(), pa.uint64(): pa.int64()}


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_temporal(t: pa.DataType) -> bool:
    return pa.types.is_temporal(t)


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


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


@dataclass(frozen=True)
class _Column:
    path: tuple[str, ...]  # how to reach the array from the table (struct fields)
    keys: tuple[str, ...]  # the batch entries this column produces
    convert: Callable[[pa.Array], dict[str, Any]]
    ragged: bool = False  # keys[0] holds all rows' values end to end


LIST_FORMATS = ("padded", "flat")


class BatchConverter:
    """Turns Arrow tables of one schema into ``dict[str, tensor | list]`` batches."""

    def __init__(self, schema: pa.Schema, source: str = "", lists: str = "padded") -> None:
        """Check every column once; ``source`` (a file URL) is named in errors.

        ``lists="flat"`` gives variable-length list columns as 1-D values plus lengths (no
        padding: fewer bytes to move between processes); ``pad_lists`` pads them later,
        on any device.
        """
        if lists not in LIST_FORMATS:
            raise ValueError(f"lists must be one of {LIST_FORMATS}, got {lists!r}")
        self.schema = schema
        self._columns: list[_Column] = []
        for field in schema:
            self._columns.extend(_plan_field(field, (field.name,), source, lists == "flat"))

    @property
    def ragged_keys(self) -> frozenset[str]:
        """Keys whose tensors hold the values of all rows end to end (not one entry per row)."""
        return frozenset(c.keys[0] for c in self._columns if c.ragged)

    @property
    def keys(self) -> list[str]:
        """Every key a batch holds (besides ``sample_id``), in order."""
        return [k for column in self._columns for k in column.keys]

    def __call__(self, table: pa.Table | pa.RecordBatch) -> Batch:
        if isinstance(table, pa.Table):
            table = table.combine_chunks().to_batches()[0] if table.num_rows else pa.RecordBatch.from_pylist([], schema=table.schema)
        out: Batch = {}
        for column in self._columns:
            array = table.column(column.path[0])
            for part in column.path[1:]:
                array = array.flatten()[array.type.get_field_index(part)]  # applies the parent's nulls
            out.update(column.convert(array))
        return out


def _plan_field(field: pa.Field, path: tuple[str, ...], source: str, flat: bool = False) -> list[_Column]:
    name, t, nullable = ".".join(path), field.type, field.nullable
    mask = (f"{name}_mask",) if nullable else ()
    if pa.types.is_struct(t):
        out = []
        for child in t:
            out.extend(_plan_field(child.with_nullable(child.nullable or nullable), path + (child.name,), source, flat))
        return out
    decode = pa.types.is_dictionary(t)
    value_type = t.value_type if decode else t
    if _is_number(value_type) or _is_temporal(value_type):
        _refuse_inexact(value_type, name, source)
        return [_Column(path, (name,) + mask, _scalar_converter(name, nullable, decode))]
    if _is_text(value_type):
        return [_Column(path, (name,) + mask, _python_converter(name, nullable, decode))]
    if _is_list(t):
        item = t.value_type
        if _is_number(item) or _is_temporal(item):
            _refuse_inexact(item, name, source)
            fixed = pa.types.is_fixed_size_list(t)
            keys = (name,) + (() if fixed else (f"{name}_lengths",)) + mask
            return [_Column(path, keys, _list_converter(name, nullable, fixed, flat), ragged=flat and not fixed)]
        if _is_text(item):
            return [_Column(path, (name,) + mask, _python_converter(name, nullable, False))]
    raise ConversionError(
        f"{source or 'schema'}: column {name!r} of type {field.type} has no tensor conversion "
        "(leave it out with columns=)"
    )


def _refuse_inexact(t: pa.DataType, name: str, source: str) -> None:
    if pa.types.is_decimal(t) or pa.types.is_interval(t):
        raise ConversionError(
            f"{source or 'schema'}: column {name!r} of type {t} has no exact tensor conversion "
            "(cast it to float64 or an integer when writing, or leave it out with columns=)"
        )


def _numeric_view(array: pa.Array, name: str) -> pa.Array:
    t = array.type
    if pa.types.is_temporal(t):
        return array.view(pa.int32() if t.bit_width == 32 else pa.int64())
    if t == pa.uint64() and len(array):
        top = pc.max(array).as_py()
        if top is not None and top >= 2**63:
            raise ConversionError(f"column {name!r}: uint64 value {top} does not fit int64")
    return array.cast(_WIDENED[t]) if t in _WIDENED else array


def _to_numpy(array: pa.Array) -> np.ndarray:
    if pa.types.is_boolean(array.type):
        return array.to_numpy(zero_copy_only=False)
    # Copy so the tensor owns writable memory (Arrow buffers are immutable).
    return np.array(array.to_numpy(zero_copy_only=False), copy=True)


def _mask(array: pa.Array) -> torch.Tensor:
    return torch.from_numpy(array.is_valid().to_numpy(zero_copy_only=False))


def _scalar_converter(name: str, nullable: bool, decode: bool) -> Callable[[pa.Array], dict[str, Any]]:
    def convert(array: pa.Array) -> dict[str, Any]:
        if decode:
            array = array.dictionary_decode()
        out: dict[str, Any] = {}
        if nullable:
            out[f"{name}_mask"] = _mask(array)
        values = _numeric_view(array, name)
        if values.null_count:
            values = values.fill_null(False if pa.types.is_boolean(values.type) else 0)
        out[name] = torch.from_numpy(_to_numpy(values))
        return out

    return convert


def _python_converter(name: str, nullable: bool, decode: bool) -> Callable[[pa.Array], dict[str, Any]]:
    def convert(array: pa.Array) -> dict[str, Any]:
        out: dict[str, Any] = {name: array.to_pylist()}
        if nullable:
            out[f"{name}_mask"] = _mask(array)
        return out

    return convert


def _list_converter(name: str, nullable: bool, fixed: bool, flat: bool = False) -> Callable[[pa.Array], dict[str, Any]]:
    def convert(array: pa.Array) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if nullable:
            out[f"{name}_mask"] = _mask(array)
        if fixed:
            out[name] = _fixed_list_tensor(array, name)
        elif flat:
            values, lengths = _list_values(array, name)
            out[name], out[f"{name}_lengths"] = torch.from_numpy(np.array(values, copy=True)), torch.from_numpy(lengths)
        else:
            out[name], out[f"{name}_lengths"] = _padded_list_tensor(array, name)
        return out

    return convert


def _refuse_inner_nulls(values: pa.Array, name: str) -> None:
    raise ConversionError(
        f"column {name!r}: null values inside lists have no tensor meaning here "
        "(null lists are fine; fill inner nulls when writing)"
    )


def _fixed_list_tensor(array: pa.FixedSizeListArray, name: str) -> torch.Tensor:
    width, rows = array.type.list_size, len(array)
    values = array.values.slice(array.offset * width, rows * width)  # aligned with rows, nulls included
    row_valid = array.is_valid().to_numpy(zero_copy_only=False)
    if values.null_count:
        value_valid = values.is_valid().to_numpy(zero_copy_only=False).reshape(rows, width)
        if (~value_valid & row_valid[:, None]).any():
            _refuse_inner_nulls(values, name)
        values = values.fill_null(False if pa.types.is_boolean(values.type) else 0)
    out = _to_numpy(_numeric_view(values, name)).reshape(rows, width)
    if not row_valid.all():
        out[~row_valid] = 0  # the slots behind a null list are unspecified
    return torch.from_numpy(out)


def _list_values(array: pa.Array, name: str) -> tuple[np.ndarray, np.ndarray]:
    """All rows' values end to end (read-only view where possible) and each row's length."""
    offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.diff(offsets)
    if array.null_count:
        lengths = np.where(array.is_valid().to_numpy(zero_copy_only=False), lengths, 0)
    flat = array.flatten()  # respects slicing and skips the values behind null lists
    if flat.null_count:
        _refuse_inner_nulls(flat, name)
    return _numeric_view(flat, name).to_numpy(zero_copy_only=False), lengths


def _padded_list_tensor(array: pa.Array, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    values, lengths = _list_values(array, name)
    rows = len(array)
    width = int(lengths.max()) if rows else 0
    padded = np.zeros((rows, width), dtype=values.dtype)
    if values.size:
        # A boolean mask visits cells in row-major order, the order of the flattened values:
        # one vectorised pass, several times faster than scattering through (row, col) indices.
        padded[np.arange(width) < lengths[:, None]] = values
    return torch.from_numpy(padded), torch.from_numpy(lengths)


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
