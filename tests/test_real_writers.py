"""Files written by the writers people use (issue 24 item 7) stream value by value as pyarrow reads them.

DuckDB, polars' Rust writer, fastparquet, pandas, deltalake (the Parquet file of a table's first version,
read as a plain file) and Hugging Face ``datasets`` each write the same small table: int64, float64 with
nulls, strings with nulls, a list of int64 with nulls and empty lists, booleans and microsecond timestamps.
Every row ParquetStream delivers is compared with ``pyarrow.parquet.read_table`` of the same file.
"""

from __future__ import annotations

import datetime
import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from helpers import rows_of

N = 37


def source() -> pa.Table:
    start = datetime.datetime(2024, 2, 28, 23, 59)
    return pa.table({
        "id": pa.array(range(N), pa.int64()),
        "x": pa.array([None if i % 7 == 3 else i * 0.25 for i in range(N)], pa.float64()),
        "s": pa.array([None if i % 5 == 1 else f"row {i} é" * (i % 3) for i in range(N)], pa.string()),
        "l": pa.array([None if i % 9 == 2 else list(range(i % 4)) for i in range(N)], pa.list_(pa.int64())),
        "b": pa.array([i % 3 == 0 for i in range(N)], pa.bool_()),
        "ts": pa.array([start + datetime.timedelta(minutes=7 * i) for i in range(N)], pa.timestamp("us")),
    })


def write_duckdb(table: pa.Table, path: str) -> None:
    import duckdb
    con = duckdb.connect()
    con.register("t", table)
    con.execute(f"COPY (SELECT * FROM t ORDER BY id) TO '{path}' (FORMAT PARQUET, ROW_GROUP_SIZE 16)")
    con.close()


def write_polars(table: pa.Table, path: str) -> None:
    import polars as pl
    pl.from_arrow(table).write_parquet(path, row_group_size=16)


def write_fastparquet(table: pa.Table, path: str) -> None:
    import fastparquet
    frame = table.drop_columns(["l"]).to_pandas()  # fastparquet writes no nested lists from pandas
    fastparquet.write(path, frame, row_group_offsets=16, stats=True)


def write_pandas(table: pa.Table, path: str) -> None:
    import pandas  # noqa: F401 - a dev dependency: its absence fails the test
    table.to_pandas().to_parquet(path, engine="pyarrow", row_group_size=16)


def write_deltalake(table: pa.Table, path: str) -> None:
    """The Parquet file deltalake writes for a table's first version, taken out of the table (a directory
    holding a table's _delta_log is read only as that table)."""
    import shutil
    import tempfile

    import deltalake
    root = tempfile.mkdtemp(prefix="delta-table-")
    try:
        deltalake.write_deltalake(root, table)
        (data,) = glob.glob(os.path.join(root, "*.parquet"))
        shutil.move(data, path)
    finally:
        shutil.rmtree(root)


def write_datasets(table: pa.Table, path: str) -> None:
    import datasets
    datasets.Dataset(table).to_parquet(path, batch_size=16)


WRITERS = {"duckdb": write_duckdb, "polars": write_polars, "fastparquet": write_fastparquet, "pandas": write_pandas,
           "deltalake": write_deltalake, "datasets": write_datasets}


def as_python(column: pa.ChunkedArray) -> list:
    """pyarrow's values as the stream's tensors hold them: timestamps as integers of their unit."""
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.int64())
    return column.to_pylist()


def streamed_columns(path: str, columns: list[str]) -> dict[str, list]:
    """Each column's values as ParquetStream delivers them, in sample-id order (None where masked)."""
    rows: dict[int, dict[str, object]] = {}
    for batch in ss.ParquetStream(path, rank=0, world_size=1, batch_size=10, shuffle=True, seed=3):
        rows.update(rows_of(batch, columns))
    assert sorted(rows) == list(range(len(rows)))
    return {c: [rows[i][c] for i in range(len(rows))] for c in columns}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_files_of_real_writers_stream_the_values_pyarrow_reads(tmp_path, writer):
    path = str(tmp_path / f"{writer}.parquet")
    WRITERS[writer](source(), path)
    expected = pq.read_table(path)
    columns = [c for c in expected.column_names if not c.startswith("__")]  # pandas' index, if any
    assert expected.num_rows == N and {"id", "x", "s", "b", "ts"} <= set(columns)
    got = streamed_columns(path, columns)
    for c in columns:
        want = as_python(expected.column(c))
        if c == "l":  # a null list is delivered as an empty one under a False mask
            want = [None if v is None else v for v in want]
        assert got[c] == want, f"{writer}: column {c!r} differs"
    assert got["id"] == list(range(N))


def test_one_directory_of_five_writers_streams_as_one_table(tmp_path):
    # The base the issue keeps: files of several writers stream together (polars' large types, DuckDB's and
    # Spark-style names, pandas' metadata), in URL order, each value as pyarrow reads it from its file.
    writers = ["datasets", "deltalake", "duckdb", "pandas", "polars"]
    for writer in writers:
        WRITERS[writer](source(), str(tmp_path / f"{writer}.parquet"))
    expected = {c: [] for c in source().column_names}
    for writer in writers:  # sorted, as the catalog orders the files
        table = pq.read_table(tmp_path / f"{writer}.parquet")
        for c in expected:
            expected[c].extend(as_python(table.column(c)))
    got = streamed_columns(str(tmp_path), list(expected))
    for c, want in expected.items():
        assert got[c] == want, f"column {c!r} differs"
