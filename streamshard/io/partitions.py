"""Partition keys: columns whose values live in the directory names (``year=2024/month=1/part-0.parquet``)
or in a Delta table's log, not in the files.

Hive-style keys are read under every directory or glob given in ``paths`` (the ``k=v`` components
between it and the file; other components are ignored, as ``pyarrow.dataset`` does) and typed as
``pyarrow.dataset``'s ``partitioning="hive"`` infers them: int32 when every value parses as one
(Arrow's own parser: ``0x10`` is 16), else string; ``__HIVE_DEFAULT_PARTITION__`` is null; names and
values are percent-decoded. A key the files also hold as a column (polars writes both) is read from
the path, as Hive defines it. A file named explicitly has no keys. Files of one catalog must agree
on their keys (names and order), or none has them: anything else is a ``CatalogError`` saying how
to read them (``partitioning=None`` ignores directory names).

Keys are appended to the catalog's schema after the file columns (or where ``columns=`` puts them)
and added to each row group read as constant columns (``with_partition_columns``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence
from urllib.parse import unquote

import numpy as np
import pyarrow as pa

from ..format.catalog_records import FileFooter
from ..errors import CatalogError

HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
PARTITIONINGS = ("hive", None)


def check_partitioning(partitioning: str | None) -> str | None:
    if partitioning not in PARTITIONINGS:
        raise ValueError(f"partitioning must be one of {PARTITIONINGS}, got {partitioning!r}")
    return partitioning


def hive_pairs(relative: str) -> list[tuple[str, str | None]]:
    """The ``(key, value)`` of each ``k=v`` directory of a file's path relative to the directory given."""
    pairs = []
    for part in relative.split("/")[:-1]:
        key, eq, value = part.partition("=")
        if eq and key:
            decoded = unquote(value)
            pairs.append((unquote(key), None if decoded == HIVE_NULL else decoded))
    return pairs


def hive_table(urls: Sequence[str], pairs: Sequence[list[tuple[str, str | None]]]) -> pa.Table | None:
    """The typed key columns of files whose ``hive_pairs`` are ``pairs`` (one row per file), or None
    when no file has keys; ``CatalogError`` when files disagree on them."""
    keyed = [i for i, p in enumerate(pairs) if p]
    if not keyed:
        return None
    first = keyed[0]
    names = [k for k, _ in pairs[first]]
    if len(set(names)) != len(names):
        raise CatalogError(f"{urls[first]}: the partition key(s) {sorted({n for n in names if names.count(n) > 1})} "
                           "appear twice in its path")
    for i, p in enumerate(pairs):
        if [k for k, _ in p] != names:
            has = [k for k, _ in p]
            raise CatalogError(
                f"files disagree on their partition keys (the k=v directories): {urls[first]} has {names} but "
                f"{urls[i]} has {has}; give directories of one layout, or partitioning=None to read no keys")
    columns = {}
    for j, name in enumerate(names):
        values = pa.array([p[j][1] for p in pairs], pa.string())
        columns[name] = _infer(values)
    return pa.table(columns)


def _infer(values: pa.Array) -> pa.Array:
    """int32 when every non-null value parses as one (pyarrow.dataset's hive inference), else string."""
    if values.null_count == len(values):
        return values
    try:
        return values.cast(pa.int32())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return values


def combine(parts: Sequence[tuple[Sequence[str], pa.Table | None, str]]) -> pa.Table | None:
    """One key table for several sources (``(urls, keys or None, what)`` each, in the order of their urls):
    they must all have the same key names, or none has keys."""
    keyed = [(urls, table, what) for urls, table, what in parts if table is not None]
    if not keyed:
        return None
    names = keyed[0][1].column_names
    for urls, table, what in parts:
        have = table.column_names if table is not None else []
        if have != names:
            raise CatalogError(f"sources disagree on their partition keys: {keyed[0][2]} has {names} but {what} has "
                               f"{have}; read them as separate streams, or partitioning=None to read no keys")
    try:
        return pa.concat_tables([t for _, t, _ in parts], promote_options="permissive")  # type: ignore[misc]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise CatalogError(f"sources disagree on the types of their partition keys {names}: {exc}") from None


def drop_columns(footer: FileFooter, names: set[str]) -> FileFooter:
    """``footer`` without the columns ``names`` (keys the file also holds: the path's value is the key's)."""
    keep = [i for i, f in enumerate(footer.schema) if f.name not in names]
    if len(keep) == len(footer.schema):
        return footer
    rows = len(footer.row_group_rows)
    ranges = None if footer.ranges is None else footer.ranges.reshape(rows, len(footer.schema), 2)[:, keep]
    values = None if footer.values is None else footer.values.reshape(rows, len(footer.schema))[:, keep]
    return replace(footer, schema=pa.schema([footer.schema.field(i) for i in keep], metadata=footer.schema.metadata),
                   maybe_null=frozenset(footer.maybe_null - names),
                   ranges=None if ranges is None else np.ascontiguousarray(ranges),
                   values=None if values is None else np.ascontiguousarray(values))


def full_schema(files: pa.Schema, keys: pa.Table | None, order: Sequence[str] | None) -> pa.Schema:
    """The catalog's schema: the file columns, then the keys (nullable where a value is null), in
    ``order`` when ``columns=`` gave one."""
    if keys is None:
        return files
    fields = list(files) + [pa.field(name, keys.column(name).type, nullable=keys.column(name).null_count > 0)
                            for name in keys.column_names]
    if order is not None:
        by_name = {f.name: f for f in fields}
        fields = [by_name[name] for name in order]
    return pa.schema(fields, metadata=files.metadata)


def with_partition_columns(table: pa.Table, keys: pa.Table, file_index: int, schema: pa.Schema) -> pa.Table:
    """``table`` (a row group's file columns) with the file's key values as constant columns, in ``schema``'s order."""
    columns = []
    for field in schema:
        if field.name in keys.column_names:
            scalar = keys.column(field.name)[file_index]
            columns.append(pa.repeat(scalar, table.num_rows) if scalar.is_valid
                           else pa.nulls(table.num_rows, scalar.type))
        else:
            columns.append(table.column(field.name))
    return pa.Table.from_arrays(columns, names=schema.names)
