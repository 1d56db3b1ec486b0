"""INT96 timestamps (Spark, Impala, Hive): read at microseconds unless a cast asks for another unit.

pyarrow reads INT96 as nanoseconds by default, and a date outside 1677-09-21 .. 2262-04-11 (Spark's
9999-12-31 "forever", 0001-01-01) then wraps into another date without a word (9999 -> 1816). Spark
writes microsecond precision, so reading at microseconds loses nothing of its files and is right for
every date of the years 1 to 9999. The unit is the catalog's type of the column: ``cast={"ts":
"timestamp[ns]"}`` reads INT96 at nanoseconds (Impala's precision, dates 1677-2262), ``"timestamp[ms]"``
at milliseconds; each file's INT96 columns are decoded at that unit directly (pyarrow's
``coerce_int96_timestamp_unit``), never converted after a wrap.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

INT96_UNIT = "us"


def int96_columns(metadata: pq.FileMetaData) -> set[str]:
    """Top-level columns of a file that hold INT96 values (at any depth)."""
    schema = metadata.schema
    return {schema.column(j).path.split(".")[0] for j in range(metadata.num_columns)
            if schema.column(j).physical_type == "INT96"}


def arrow_schema(metadata: pq.FileMetaData) -> pa.Schema:
    """The file's Arrow schema with its INT96 columns as ``timestamp[INT96_UNIT]``."""
    if not int96_columns(metadata):
        return metadata.schema.to_arrow_schema()
    # With ``metadata`` given, pyarrow reads nothing from the source: the empty buffer is never touched.
    return pq.ParquetFile(pa.BufferReader(b""), metadata=metadata, coerce_int96_timestamp_unit=INT96_UNIT).schema_arrow


def read_unit(metadata: pq.FileMetaData, schema: pa.Schema | None) -> str | None:
    """The unit to decode a file's INT96 columns at: the unit of their timestamps in ``schema`` (the catalog's;
    None: ``INT96_UNIT``); None when the file has no INT96 column. ``ValueError`` when two of its INT96 columns
    ask for different units (pyarrow decodes one file at one unit)."""
    names = int96_columns(metadata)
    if not names:
        return None
    units = set()
    for name in names:
        index = -1 if schema is None else schema.get_field_index(name)
        unit = _timestamp_unit(schema.field(index).type) if index >= 0 else None
        units.add(unit or INT96_UNIT)
    if len(units) > 1:
        raise ValueError(f"its INT96 columns {sorted(names)} are cast to timestamps of different units "
                         f"{sorted(units)}; a file's INT96 values are decoded at one unit")
    return units.pop()


def _timestamp_unit(t: pa.DataType) -> str | None:
    if pa.types.is_timestamp(t):
        return t.unit
    if pa.types.is_struct(t):
        return next((u for f in t if (u := _timestamp_unit(f.type))), None)
    if hasattr(t, "value_type"):  # lists, dictionaries
        return _timestamp_unit(t.value_type)
    return None
