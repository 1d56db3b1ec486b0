"""One logical schema for files from different writers (pure: Arrow types only, no I/O).

polars writes ``large_list``/``large_string``, pyarrow, DuckDB and Spark ``list``/``string``;
Spark names a list's item ``element`` where pyarrow says ``item``; some writers dictionary-encode
a column in one file and not in the next; nullability follows each file's statistics. Those are
physical differences: the column becomes the same tensors either way, so they stream together,
each file's row groups cast on read to one canonical type per column. Types that really differ
(int32 vs int64, another timestamp unit or time zone, float vs decimal) still fail with both files
named, unless the caller asks for a cast of that column (``cast={"column": type}``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pyarrow as pa

from ..errors import CatalogError, ConversionError


def canonical_type(t: pa.DataType) -> pa.DataType:
    """The type every physical variant of ``t`` is read as: 32-bit offsets, decoded dictionaries,
    list items named ``item``, extension types as their storage. Nested nullability is kept (it decides
    which mask keys a batch has).

    An extension type (Hugging Face ``Array2D``, pandas ``Period``/``Interval``) is only an extension type
    when the package that defines it was imported (pyarrow rebuilds it from the file's schema then, and
    reads plain storage otherwise), so its storage is what a column holds whatever was imported first."""
    if isinstance(t, pa.BaseExtensionType):
        return canonical_type(t.storage_type)
    if pa.types.is_dictionary(t):
        return canonical_type(t.value_type)
    if pa.types.is_large_string(t) or _is(t, "is_string_view"):
        return pa.string()
    if pa.types.is_large_binary(t) or _is(t, "is_binary_view"):
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t) or _is(t, "is_list_view") or _is(t, "is_large_list_view"):
        return pa.list_(pa.field("item", canonical_type(t.value_type), t.value_field.nullable))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(pa.field("item", canonical_type(t.value_type), t.value_field.nullable), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(canonical_type(t.key_type), pa.field("value", canonical_type(t.item_type), t.item_field.nullable))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, canonical_type(f.type), f.nullable) for f in t])
    return t


def _loose(t: pa.DataType, nullable: bool = True) -> pa.DataType:
    """``t`` (canonical) with every nested field nullable, or with every nested field's nullability
    replaced by ``nullable``: the logical shape two files must share."""
    if pa.types.is_list(t):
        return pa.list_(pa.field("item", _loose(t.value_type, nullable), nullable))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(pa.field("item", _loose(t.value_type, nullable), nullable), t.list_size)
    if pa.types.is_map(t):
        return pa.map_(_loose(t.key_type, nullable), pa.field("value", _loose(t.item_type, nullable), nullable))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _loose(f.type, nullable), nullable) for f in t])
    return t


def same_logical_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Whether two types become the same tensors (physical representation and nullability aside)."""
    return _loose(canonical_type(a)).equals(_loose(canonical_type(b)))


def _merge(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """Two canonical types of one logical shape, a nested field nullable where either one is."""
    if pa.types.is_list(a) or pa.types.is_fixed_size_list(a):
        item = pa.field("item", _merge(a.value_type, b.value_type), a.value_field.nullable or b.value_field.nullable)
        return pa.list_(item, a.list_size) if pa.types.is_fixed_size_list(a) else pa.list_(item)
    if pa.types.is_map(a):
        value = pa.field("value", _merge(a.item_type, b.item_type), a.item_field.nullable or b.item_field.nullable)
        return pa.map_(_merge(a.key_type, b.key_type), value)
    if pa.types.is_struct(a):
        return pa.struct([pa.field(x.name, _merge(x.type, y.type), x.nullable or y.nullable) for x, y in zip(a, b)])
    return a


def _is(t: pa.DataType, predicate: str) -> bool:
    check = getattr(pa.types, predicate, None)
    return bool(check and check(t))


def parse_cast(cast: Mapping[str, Any] | None) -> dict[str, pa.DataType]:
    """``{"column": arrow type or its name}`` -> Arrow types; ValueError naming a bad entry."""
    if cast is None:
        return {}
    if not isinstance(cast, Mapping):
        raise ValueError(f"cast must be a mapping of column name -> Arrow type, got {type(cast).__name__}")
    out = {}
    for name, target in cast.items():
        if not isinstance(name, str):
            raise ValueError(f"cast keys must be column names, got {name!r}")
        if isinstance(target, str):
            try:
                target = pa.type_for_alias(target)
            except ValueError:
                raise ValueError(f"cast[{name!r}] = {target!r} is not an Arrow type name (e.g. 'int64', 'float32')") from None
        if not isinstance(target, pa.DataType):
            raise ValueError(f"cast[{name!r}] must be an Arrow type or its name, got {target!r}")
        out[name] = target
    return out


def unify(schemas: Sequence[tuple[str, pa.Schema]], nullable: set[str], cast: Mapping[str, pa.DataType],
          rows: Sequence[int] | None = None) -> pa.Schema:
    """The one schema of ``(url, schema)`` pairs, or a ``CatalogError`` naming two files that disagree.

    ``nullable``: columns some file may hold nulls in. ``cast``: columns read as the given type
    whatever each file says (Arrow must be able to cast each file's type to it). ``rows``: each file's
    row count. Files may hold the columns in another order: the first file's order is the catalog's and
    every file's columns are read by name. A file without rows has no say on types (it delivers nothing;
    pandas writes an empty frame's text columns as ``null`` or ``double``), and a ``null`` column (every
    value null: pandas' all-None column) takes the type the other files give it.
    """
    first_url, first = schemas[0]
    unknown = sorted(set(cast) - set(first.names))
    if unknown:
        raise CatalogError(f"cast names column(s) {unknown} that {first_url} does not have (columns {first.names})")
    for url, other in schemas[1:]:
        if other.names != first.names and sorted(other.names) != sorted(first.names):
            shared = [n for n in first.names if n in set(other.names)]
            raise CatalogError(f"schemas disagree: {first_url} has columns {first.names} but {url} has "
                               f"{other.names}; pass columns={shared} to read the columns they share")
    counts = rows if rows is not None else [1] * len(schemas)
    voters = [pair for pair, n in zip(schemas, counts) if n > 0] or list(schemas[:1])
    types: dict[str, pa.DataType] = {}
    source: dict[str, str] = {}
    all_null = set()
    seen: set[pa.Schema] = set()  # files written by one writer share a schema: each distinct one votes once
    for url, other in voters:
        if other in seen:
            continue
        seen.add(other)
        for b in other:
            if b.name in cast:
                continue
            mine, have = canonical_type(b.type), types.get(b.name)
            if pa.types.is_null(mine):
                all_null.add(b.name)
            if have is None or (pa.types.is_null(have) and not pa.types.is_null(mine)):
                types[b.name], source[b.name] = mine, url
            elif pa.types.is_null(mine):
                continue
            elif not same_logical_type(have, mine):
                raise CatalogError(
                    f"schemas disagree on column {b.name!r}: {have} in {source[b.name]} but {b.type} in {url}; "
                    f"pass cast={{{b.name!r}: <type>}} to read both as one type"
                )
            else:
                types[b.name] = _merge(have, mine)
    fields = []
    for name in first.names:
        kind = cast.get(name, types.get(name))
        fields.append(pa.field(name, kind, nullable=name in nullable or name in all_null or pa.types.is_null(kind)))
    return pa.schema(fields)


def column_order(names: Sequence[str], schema: pa.Schema) -> list[int] | None:
    """Where each of ``schema``'s columns is in a file's ``names`` (None: the same order)."""
    if list(names) == schema.names:
        return None
    return [list(names).index(n) for n in schema.names]


def read_as(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """``table`` with the catalog's column types (a no-op when they already match; top-level
    nullability is the catalog's to decide, so it is not compared)."""
    if table.schema.names == schema.names and all(a.type.equals(b.type) for a, b in zip(table.schema, schema)):
        return table
    try:
        return table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowIndexError) as exc:
        raise ConversionError(f"{where}: cannot read it as the catalog's schema ({exc})") from None
