"""Hive-partitioned folders (issue 24 item 2): ``k=v`` directories become columns of every batch, typed as
``pyarrow.dataset``'s hive partitioning infers them, with the layouts real writers make.

Before, the keys were dropped silently and ``columns=["year"]`` said the column did not exist.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.io.catalog_share import catalog_from_json, catalog_to_json
from streamshard.cli import main

ROWS = 60


def _source() -> pa.Table:
    x = np.arange(ROWS, dtype=np.int64)
    return pa.table({"x": x, "year": (2023 + x % 2).astype(np.int64),
                     "cat": pa.array([None if i % 5 == 0 else ("a b" if i % 3 else "c/d") for i in range(ROWS)])})


def _write_pyarrow(path):
    pq.write_to_dataset(_source(), str(path), partition_cols=["year", "cat"])


def _write_duckdb(path):
    duckdb = pytest.importorskip("duckdb")
    source = _source()  # noqa: F841 - DuckDB reads the local by name
    duckdb.sql(f"COPY (SELECT * FROM source) TO '{path}' (FORMAT parquet, PARTITION_BY (year, cat))")


def _write_polars(path):
    pl = pytest.importorskip("polars")
    pl.from_arrow(_source()).write_parquet(str(path), partition_by=["year", "cat"])  # keys also in the files


def _write_fastparquet(path):
    fastparquet = pytest.importorskip("fastparquet")
    fastparquet.write(str(path), _source().to_pandas(), partition_on=["year", "cat"], file_scheme="hive")


WRITERS = {"pyarrow": _write_pyarrow, "duckdb": _write_duckdb, "polars": _write_polars,
           "fastparquet": _write_fastparquet}


def _stream_rows(paths, columns=None, **kwargs) -> tuple[list[tuple], ss.ParquetStream]:
    stream = ss.ParquetStream(paths, columns=columns, batch_size=32, rank=0, world_size=1, **kwargs)
    names = [n for n in stream.catalog.columns]
    rows = []
    for batch in stream:
        keep = (batch["sample_id"] >= 0).tolist()
        values = []
        for name in names:
            column = batch[name]
            column = column.tolist() if hasattr(column, "tolist") else list(column)
            if f"{name}_mask" in batch:
                column = [v if m else None for v, m in zip(column, batch[f"{name}_mask"].tolist())]
            values.append([v for v, k in zip(column, keep) if k])
        rows.extend(zip(*values))
    return sorted(rows, key=repr), stream


def _pyarrow_rows(path, names, schema=None) -> list[tuple]:
    table = pads.dataset(str(path), partitioning="hive", schema=schema).to_table(columns=names)
    return sorted(zip(*(table[n].to_pylist() for n in names)), key=repr)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_keys_come_through_as_pyarrow_dataset_types_and_values(tmp_path, writer):
    path = tmp_path / writer
    WRITERS[writer](path)
    rows, stream = _stream_rows(str(path))
    schema = stream.catalog.schema
    assert schema.names == ["x", "year", "cat"]
    assert schema.field("year").type == pa.int32() and schema.field("cat").type == pa.string()
    expected_schema = None
    if writer == "polars":  # the files hold year as int64 too; pyarrow.dataset refuses to merge unless told
        expected_schema = pa.schema([("x", pa.int64()), ("year", pa.int32()), ("cat", pa.string())])
    else:
        inferred = pads.dataset(str(path), partitioning="hive").schema
        assert [inferred.field(n).type for n in ("year", "cat")] == [schema.field(n).type for n in ("year", "cat")]
    assert rows == _pyarrow_rows(path, ["x", "year", "cat"], expected_schema)
    assert len(rows) == (ROWS if writer != "fastparquet" else sum(1 for i in range(ROWS) if i % 5))  # fastparquet drops null keys


def test_keys_can_be_projected_alone_or_in_any_order(tmp_path):
    _write_pyarrow(tmp_path / "t")
    rows, stream = _stream_rows(str(tmp_path / "t"), columns=["year"])
    assert stream.catalog.columns == ["year"] and rows == _pyarrow_rows(tmp_path / "t", ["year"])
    rows, stream = _stream_rows(str(tmp_path / "t"), columns=["cat", "x"])
    assert stream.catalog.columns == ["cat", "x"] and rows == _pyarrow_rows(tmp_path / "t", ["cat", "x"])


def test_a_glob_reads_keys_below_its_fixed_directories(tmp_path):
    _write_pyarrow(tmp_path / "t")
    rows, _ = _stream_rows(str(tmp_path / "t" / "year=*" / "*" / "*.parquet"))
    assert rows == _pyarrow_rows(tmp_path / "t", ["x", "year", "cat"])


def test_partitioning_none_reads_no_keys(tmp_path):
    _write_pyarrow(tmp_path / "t")
    catalog = ss.Catalog.build(str(tmp_path / "t"), partitioning=None)
    assert catalog.columns == ["x"] and catalog.partition_keys == []
    with pytest.raises(ss.CatalogError, match=r"\['year'\] not found.*\['year'\] is a partition key in the file's "
                                              r"path: pass partitioning='hive'"):
        ss.Catalog.build(str(tmp_path / "t"), ["x", "year"], partitioning=None)
    with pytest.raises(ValueError, match="partitioning"):
        ss.ParquetStream(str(tmp_path / "t"), partitioning="directory")


def test_inference_follows_pyarrow_int32_else_string(tmp_path):
    # values that do not fit int32 stay strings, as pyarrow.dataset types them
    for i, value in enumerate(["1", "3000000000", "0x10"]):
        (tmp_path / "t" / f"k={value}").mkdir(parents=True)
        pq.write_table(pa.table({"x": [i]}), tmp_path / "t" / f"k={value}" / "p.parquet")
    catalog = ss.Catalog.build(str(tmp_path / "t"))
    assert catalog.schema.field("k").type == pads.dataset(str(tmp_path / "t"), partitioning="hive").schema.field("k").type
    rows, _ = _stream_rows(str(tmp_path / "t"))
    assert rows == _pyarrow_rows(tmp_path / "t", ["x", "k"])


def test_files_that_disagree_on_their_keys_are_refused_with_the_option(tmp_path):
    (tmp_path / "t" / "year=2024").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), tmp_path / "t" / "year=2024" / "a.parquet")
    pq.write_table(pa.table({"x": [2]}), tmp_path / "t" / "b.parquet")
    with pytest.raises(ss.CatalogError, match=r"partition keys.*year=2024/a\.parquet.*\['year'\].*b\.parquet.*"
                                              r"partitioning=None"):
        ss.Catalog.build(str(tmp_path / "t"))
    assert ss.Catalog.build(str(tmp_path / "t"), partitioning=None).num_rows == 2


def test_keys_survive_the_snapshot_workers_load_and_a_distributed_build(tmp_path):
    import torch.distributed as dist

    _write_pyarrow(tmp_path / "t")
    local = ss.Catalog.build(str(tmp_path / "t"), distributed=False)
    loaded = catalog_from_json(json.loads(json.dumps(catalog_to_json(local))))
    assert loaded.partition_values.equals(local.partition_values) and loaded.schema == local.schema
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:  # rank 0 lists and broadcasts the listing, keys included
        shared = ss.Catalog.build(str(tmp_path / "t"), distributed=True)
    finally:
        dist.destroy_process_group()
    assert shared.partition_values.equals(local.partition_values) and shared.digest == local.digest


def test_keys_stream_through_workers_and_resume_exactly_once(tmp_path):
    _write_pyarrow(tmp_path / "t")
    make = lambda: ss.ParquetStream(str(tmp_path / "t"), batch_size=8, shuffle=True, rank=0,  # noqa: E731
                                    world_size=1)
    loader = ss.StreamLoader(make(), num_workers=2, workers="processes")
    seen: dict[int, tuple] = {}
    for i, batch in enumerate(loader):
        for sid, x, year in zip(batch["sample_id"].tolist(), batch["x"].tolist(), batch["year"].tolist()):
            if sid >= 0:
                seen[sid] = (x, year)
        if i == 2:
            break
    resumed = ss.StreamLoader(make(), num_workers=1)
    resumed.load_state_dict(loader.state_dict())
    for batch in resumed:
        for sid, x, year in zip(batch["sample_id"].tolist(), batch["x"].tolist(), batch["year"].tolist()):
            if sid >= 0:
                assert sid not in seen
                seen[sid] = (x, year)
    assert sorted(seen) == list(range(ROWS))
    assert all(year == 2023 + x % 2 for x, year in seen.values())


def test_blends_and_packing_carry_on_with_keyed_corpora(tmp_path):
    _write_pyarrow(tmp_path / "a")
    _write_duckdb(tmp_path / "b")
    a = ss.ParquetStream(str(tmp_path / "a"), batch_size=8, rank=0, world_size=1)
    b = ss.ParquetStream(str(tmp_path / "b"), batch_size=8, rank=0, world_size=1)
    blend = ss.BlendedStream({"a": a, "b": b}, weights={"a": 0.5, "b": 0.5}, batch_size=8, rank=0, world_size=1)
    years = [y for batch in blend for y, s in zip(batch["year"].tolist(), batch["sample_id"].tolist()) if s >= 0]
    assert len(years) == 2 * ROWS and set(years) == {2023, 2024}
    # packing: token lists in k=v folders; the keys do not break it
    for year in (2023, 2024):
        (tmp_path / "tok" / f"year={year}").mkdir(parents=True)
        tokens = pa.array([[year, i, i] for i in range(10)], pa.list_(pa.int64()))
        pq.write_table(pa.table({"input_ids": tokens}), tmp_path / "tok" / f"year={year}" / "p.parquet")
    source = ss.ParquetStream(str(tmp_path / "tok"), batch_size=4, rank=0, world_size=1)
    packed = ss.PackedStream(source, column="input_ids", seq_len=8, batch_size=2)
    total = sum(int((b["sample_id"] >= 0).sum()) for b in packed)
    assert total == 60  # every token once


def test_inspect_shows_the_keys(tmp_path):
    _write_pyarrow(tmp_path / "t")
    out, err = io.StringIO(), io.StringIO()
    assert main(["inspect", str(tmp_path / "t"), "--json"], out=out, err=err) == 0, err.getvalue()
    report = json.loads(out.getvalue())
    assert report["partition_keys"] == ["year", "cat"]
    assert {c["name"]: c["type"] for c in report["columns"]} == {"x": "int64", "year": "int32", "cat": "string"}
    out = io.StringIO()
    assert main(["inspect", str(tmp_path / "t")], out=out, err=io.StringIO()) == 0
    assert "year: int32 (partition key)" in out.getvalue()
    out = io.StringIO()
    assert main(["inspect", str(tmp_path / "t"), "--partitioning", "none", "--json"], out=out, err=io.StringIO()) == 0
    assert [c["name"] for c in json.loads(out.getvalue())["columns"]] == ["x"]
    out = io.StringIO()  # plan and bench take the same option; plan builds the catalog with the keys
    assert main(["plan", str(tmp_path / "t"), "--columns", "year", "--world-size", "2", "--num-workers", "1", "--json"],
                out=out, err=io.StringIO()) == 0
    assert json.loads(out.getvalue())["rows"] == ROWS
