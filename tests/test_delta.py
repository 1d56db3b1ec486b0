"""Delta Lake tables (issue 24 item 1): the live files of a version, through deltalake, never plain files.

Tables are written by ``deltalake.write_deltalake`` (delta-rs) and compared with what deltalake
itself reads at the same version. Before, a table after an overwrite streamed 1,300 rows where it
has 300 (every file the log had removed).
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")  # the delta extra; in dev, so it runs under make test

import streamshard as ss  # noqa: E402
from streamshard.io.catalog_share import catalog_from_json, catalog_to_json  # noqa: E402


def _write(path, first: int, rows: int, mode: str = "append", partition_by=None) -> None:
    ids = np.arange(first, first + rows, dtype=np.int64)
    table = pa.table({"x": ids, "part": (ids % 3).astype(np.int64), "name": [f"r{i}" for i in ids]})
    deltalake.write_deltalake(str(path), table, mode=mode, partition_by=partition_by)


def _rows(paths, **kwargs) -> list[tuple]:
    stream = ss.ParquetStream(paths, batch_size=64, rank=0, world_size=1, **kwargs)
    out = []
    for batch in stream:
        keep = batch["sample_id"] >= 0
        columns = [k for k in ("x", "part", "name") if k in batch]
        values = [batch[k][keep].tolist() if hasattr(batch[k], "tolist") else
                  [v for v, k2 in zip(batch[k], keep.tolist()) if k2] for k in columns]
        out.extend(zip(*values))
    return sorted(out)


def _expected(path, version=None) -> list[tuple]:
    table = deltalake.DeltaTable(str(path), version=version).to_pyarrow_table()
    return sorted(zip(table["x"].to_pylist(), table["part"].to_pylist(), table["name"].to_pylist()))


@pytest.fixture
def table(tmp_path):
    """Version 0: 1,000 rows; 1: overwritten by 300; 2: rows x < 100 deleted (200 live)."""
    path = tmp_path / "table"
    _write(path, 0, 1000)
    time.sleep(0.05)  # commits apart in time, for the timestamp test
    _write(path, 10_000, 300, mode="overwrite")
    time.sleep(0.05)
    deltalake.DeltaTable(str(path)).delete("x < 10100")
    return path


def test_a_table_path_streams_the_live_rows_of_its_latest_version(table):
    assert len(_expected(table)) == 200
    assert _rows(str(table)) == _expected(table)  # before: 1,500 rows, removed files included
    assert _rows(ss.DeltaTable(str(table))) == _expected(table)


@pytest.mark.parametrize("version, rows", [(0, 1000), (1, 300), (2, 200)])
def test_a_pinned_version_streams_that_version(table, version, rows):
    got = _rows(ss.DeltaTable(str(table), version=version))
    assert len(got) == rows and got == _expected(table, version)


def test_a_timestamp_pins_the_version_current_then(table):
    history = {h["version"]: h["timestamp"] for h in deltalake.DeltaTable(str(table)).history()}
    at = datetime.fromtimestamp((history[1] + history[2]) / 2000, tz=timezone.utc)  # after commit 1, before 2
    assert _rows(ss.DeltaTable(str(table), timestamp=at)) == _expected(table, 1)
    assert ss.Catalog.build(ss.DeltaTable(str(table), timestamp=at)).tables[0].endswith("@1")


def test_the_version_is_in_the_snapshot_and_a_checkpoint_of_another_version_is_refused(table):
    def stream(source):
        return ss.ParquetStream(source, batch_size=16, shuffle=True, seed=3, rank=0, world_size=1)

    first = stream(str(table))
    catalog = first.catalog
    assert catalog.tables == (f"delta:file://{table}@2",)
    assert catalog_from_json(catalog_to_json(catalog)).digest == catalog.digest  # what workers load
    loader = ss.StreamLoader(first)
    seen = []
    for i, batch in enumerate(loader):
        seen.extend(batch["sample_id"][batch["sample_id"] >= 0].tolist())
        if i == 3:
            break
    state = loader.state_dict()
    _write(table, 50_000, 40)  # version 3: the latest is no longer the checkpoint's
    later = ss.StreamLoader(stream(str(table)))
    with pytest.raises(ss.StateError, match=r"tables.*@2.*@3"):
        later.load_state_dict(state)
    pinned = ss.StreamLoader(stream(ss.DeltaTable(str(table), version=2)))
    pinned.load_state_dict(state)  # the saved version, pinned: the rest of the epoch, exactly once
    for batch in pinned:
        seen.extend(batch["sample_id"][batch["sample_id"] >= 0].tolist())
    assert sorted(seen) == list(range(200))


def test_a_partitioned_table_delivers_its_partition_columns_typed_as_the_table_says(tmp_path):
    path = tmp_path / "parted"
    _write(path, 0, 90, partition_by=["part"])
    _write(path, 0, 30, mode="overwrite", partition_by=["part"])
    catalog = ss.Catalog.build(str(path))
    assert catalog.partition_keys == ["part"] and catalog.schema.field("part").type == pa.int64()
    assert _rows(str(path)) == _expected(path)
    only = ss.ParquetStream(str(path), columns=["part"], batch_size=64, rank=0, world_size=1)
    parts = np.concatenate([b["part"][b["sample_id"] >= 0].numpy() for b in only])
    assert sorted(parts.tolist()) == sorted(x % 3 for x in range(30))


def test_a_table_is_never_read_as_plain_files(table, tmp_path):
    with pytest.raises(ss.CatalogError, match=r"Delta Lake table .*table"):
        ss.Catalog.build(str(table / "*.parquet"))
    with pytest.raises(ss.CatalogError, match=r"holds the Delta Lake table .*table.*ss.DeltaTable"):
        ss.Catalog.build(str(tmp_path))  # a directory above the table


def test_without_deltalake_the_error_says_to_install_the_extra(table, monkeypatch):
    monkeypatch.setitem(sys.modules, "deltalake", None)  # what an environment without the extra imports
    with pytest.raises(ss.CatalogError, match=r"Delta Lake table.*pip install 'streamshard\[delta\]'"):
        ss.Catalog.build(str(table))
    with pytest.raises(ss.CatalogError, match=r"pip install 'streamshard\[delta\]'"):
        ss.Catalog.build(ss.DeltaTable(str(table)))


def test_bad_arguments_and_missing_tables_are_named(tmp_path):
    with pytest.raises(ValueError, match="version"):
        ss.DeltaTable(str(tmp_path), version=-1)
    with pytest.raises(ValueError, match="not both"):
        ss.DeltaTable(str(tmp_path), version=1, timestamp="2024-01-01T00:00:00Z")
    with pytest.raises(ss.CatalogError, match=r"Delta table .*nothing.*cannot load"):
        ss.Catalog.build(ss.DeltaTable(str(tmp_path / "nothing")))


# -- deletion vectors: delta-rs does not write them, so the test writes one as the protocol says -----------

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def _z85(data: bytes) -> str:
    out = []
    for i in range(0, len(data), 4):
        value, chunk = int.from_bytes(data[i:i + 4], "big"), []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(_Z85[digit])
        out.extend(reversed(chunk))
    return "".join(out)


def _inline_deletion_vector(rows: list[int]) -> bytes:
    """Delta's RoaringBitmapArray (magic, one bucket) holding ``rows`` in one portable roaring array container."""
    import struct

    bitmap = (struct.pack("<II", 12346, 1) + struct.pack("<HH", 0, len(rows) - 1) + struct.pack("<I", 16)
              + b"".join(struct.pack("<H", r) for r in sorted(rows)))
    return struct.pack("<iqI", 1681511377, 1, 0) + bitmap


def _table_with_deletion_vector(path, deleted: list[int], table: pa.Table | None = None) -> None:
    """Version 0: x = 0..9 in row groups of 3 rows; version 1: the same file with an inline deletion vector
    deleting ``deleted`` (the commit a Spark/Databricks DELETE writes on a table with deletion vectors)."""
    import json

    table = pa.table({"x": list(range(10))}) if table is None else table
    deltalake.write_deltalake(str(path), table,
                              configuration={"delta.enableDeletionVectors": "true"},
                              writer_properties=deltalake.WriterProperties(max_row_group_size=3))
    add = pa.table(deltalake.DeltaTable(str(path)).get_add_actions(flatten=True)).to_pylist()[0]
    vector = _inline_deletion_vector(deleted)
    commit = [
        {"commitInfo": {"timestamp": 1, "operation": "DELETE", "operationParameters": {}}},
        {"remove": {"path": add["path"], "deletionTimestamp": 1, "dataChange": True, "extendedFileMetadata": True,
                    "partitionValues": {}, "size": add["size_bytes"]}},
        {"add": {"path": add["path"], "partitionValues": {}, "size": add["size_bytes"], "modificationTime": 1,
                 "dataChange": True, "stats": json.dumps({"numRecords": table.num_rows}),
                 "deletionVector": {"storageType": "i", "pathOrInlineDv": _z85(vector), "sizeInBytes": len(vector),
                                    "cardinality": len(deleted)}}},
    ]
    (path / "_delta_log" / "00000000000000000001.json").write_text("\n".join(json.dumps(c) for c in commit) + "\n")


def test_deletion_vectors_are_honoured(tmp_path):
    path = tmp_path / "dv"
    deleted = [0, 2, 4, 9]  # row groups [0,1,2] [3,4,5] [6,7,8] [9]: keeps 1, 2, 3 and 0 rows
    _table_with_deletion_vector(path, deleted)
    mask = pa.table(deltalake.DeltaTable(str(path)).deletion_vectors())["selection_vector"][0].as_py()
    assert [i for i, keep in enumerate(mask) if not keep] == deleted  # deltalake reads the vector we wrote
    live = [x for x in range(10) if x not in deleted]
    catalog = ss.Catalog.build(str(path))
    assert catalog.rg_rows.tolist() == [1, 2, 3, 0] and catalog.num_rows == len(live)
    assert catalog_from_json(catalog_to_json(catalog)).rg_stored_rows.tolist() == [3, 3, 3, 1]
    for shuffle in (False, True):
        stream = ss.ParquetStream(str(path), batch_size=4, shuffle=shuffle, rank=0, world_size=1)
        got = {}
        for batch in stream:
            for sid, x in zip(batch["sample_id"].tolist(), batch["x"].tolist()):
                if sid >= 0:
                    got[sid] = x
        assert sorted(got) == list(range(len(live))) and sorted(got.values()) == live  # before: all 10 rows
    # two ranks, one row group's kept rows split between them: still each live row once
    halves = [ss.ParquetStream(str(path), batch_size=2, shuffle=True, rank=r, world_size=2) for r in (0, 1)]
    xs = [x for ds in halves for b in ds for x, s in zip(b["x"].tolist(), b["sample_id"].tolist()) if s >= 0]
    assert sorted(xs) == live
    assert ss.Catalog.build(ss.DeltaTable(str(path), version=0)).num_rows == 10  # before the delete


def test_packing_a_table_with_deletion_vectors_is_refused_by_name(tmp_path):
    path = tmp_path / "dv"
    _table_with_deletion_vector(path, [1], pa.table({"ids": [[i, i] for i in range(10)]}))
    tokens = ss.ParquetStream(str(path), batch_size=4, rank=0, world_size=1)
    with pytest.raises(ss.CatalogError, match="deletion vectors cannot be packed"):
        list(ss.PackedStream(tokens, column="ids", seq_len=4, batch_size=1))


def test_a_table_on_s3_reads_its_log_with_options_derived_from_the_streams(table, s3):
    """The table's files uploaded as they are to moto's S3; deltalake reads the log with the endpoint and
    keys taken from the stream's s3fs storage_options, fsspec the data files."""
    fs = s3.filesystem()
    fs.mkdir("streamshard-delta")
    fs.put(str(table), "streamshard-delta/table", recursive=True)
    url = "s3://streamshard-delta/table"
    assert _rows(url, storage_options=s3.storage_options) == _expected(table)
    assert _rows(ss.DeltaTable(url, version=1), storage_options=s3.storage_options) == _expected(table, 1)
    assert ss.Catalog.build(url, storage_options=s3.storage_options).tables == (f"delta:{url}@2",)


def test_inspect_says_which_rows_deletion_vectors_delete(tmp_path):
    import io
    import json

    from streamshard.cli import main

    path = tmp_path / "dv"
    _table_with_deletion_vector(path, [0, 2, 4, 9])
    out, err = io.StringIO(), io.StringIO()
    assert main(["inspect", str(path), "--json"], out=out, err=err) == 0, err.getvalue()
    report = json.loads(out.getvalue())
    assert report["tables"] == [f"delta:file://{path}@1"]
    assert any(w["kind"] == "deleted_rows" and "delivers 6 rows" in w["message"] for w in report["warnings"])
