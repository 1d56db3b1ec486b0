"""Correct values where pyarrow offers them (issue 24 item 5): INT96 timestamps outside 1677-2262 (Spark's
9999-12-31, 0001-01-01) keep their dates, and page checksums are verified when a file has them.

The INT96 files are written here by pyarrow (``use_deprecated_int96_timestamps=True``: the 12-byte
Julian-day + nanosecond encoding Spark and Impala write); Spark itself needs Java, which this machine
does not have, so no Spark-written file is checked in."""

from __future__ import annotations

import datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss

DATES = [datetime.datetime(9999, 12, 31, 23, 59, 59), datetime.datetime(1, 1, 1),
         datetime.datetime(2020, 5, 5, 1, 2, 3, 456789), datetime.datetime(1600, 2, 29, 12)]
EPOCH = datetime.datetime(1970, 1, 1)


def micros(d: datetime.datetime) -> int:
    return (d - EPOCH) // datetime.timedelta(microseconds=1)


def write_int96(path, store_schema: bool = False) -> None:
    table = pa.table({"ts": pa.array(DATES, pa.timestamp("us")), "id": pa.array(range(len(DATES)), pa.int64())})
    pq.write_table(table, path, use_deprecated_int96_timestamps=True, store_schema=store_schema)
    assert pq.read_metadata(path).schema.column(0).physical_type == "INT96"


@pytest.mark.parametrize("store_schema", [False, True])  # Spark writes no Arrow schema; pyarrow does
def test_int96_timestamps_outside_1677_2262_keep_their_dates(tmp_path, store_schema):
    # They were read at nanoseconds: 9999-12-31 came out as 1816-03-30, 0001-01-01 as 1754-08-30.
    write_int96(tmp_path / "spark.parquet", store_schema)
    ds = ss.ParquetStream(str(tmp_path / "spark.parquet"), rank=0, world_size=1, batch_size=len(DATES))
    assert ds.catalog.schema.field("ts").type == pa.timestamp("us")
    (batch,) = list(ds)
    assert batch["ts"].tolist() == [micros(d) for d in DATES]


def test_a_cast_picks_the_unit_int96_is_decoded_at(tmp_path):
    write_int96(tmp_path / "spark.parquet")
    ds = ss.ParquetStream(str(tmp_path / "spark.parquet"), rank=0, world_size=1, batch_size=len(DATES),
                          cast={"ts": "timestamp[ms]"}, columns=["ts"])
    (batch,) = list(ds)
    assert batch["ts"].tolist() == [micros(d) // 1000 for d in DATES]  # decoded at ms, never wrapped at ns
    ns = ss.ParquetStream(str(tmp_path / "spark.parquet"), rank=0, world_size=1, batch_size=len(DATES),
                          cast={"ts": "timestamp[ns]"}, columns=["ts"])
    (batch,) = list(ns)
    assert batch["ts"].tolist()[2] == micros(DATES[2]) * 1000  # Impala's precision, for dates 1677-2262


def test_a_page_whose_checksum_fails_is_an_error_naming_file_and_row_group(tmp_path):
    table = pa.table({"id": pa.array(range(1000), pa.int64())})
    pq.write_table(table, tmp_path / "ok.parquet", write_page_checksum=True, row_group_size=500, compression="none",
                   use_dictionary=False)
    chunk = pq.read_metadata(tmp_path / "ok.parquet").row_group(1).column(0)
    data = bytearray((tmp_path / "ok.parquet").read_bytes())
    data[chunk.data_page_offset + chunk.total_compressed_size - 8] ^= 0x01  # a value of row group 1's page
    (tmp_path / "bad.parquet").write_bytes(bytes(data))
    assert pq.read_table(tmp_path / "bad.parquet").column("id").to_pylist() != list(range(1000))  # silent
    ds = ss.ParquetStream(str(tmp_path / "bad.parquet"), rank=0, world_size=1, batch_size=500)
    with pytest.raises(ss.ReadError, match=r"bad\.parquet: reading row group 1 failed: .*CRC checksum"):
        list(ds)
    ok = ss.ParquetStream(str(tmp_path / "ok.parquet"), rank=0, world_size=1, batch_size=500)
    assert [i for b in ok for i in b["id"].tolist()] == list(range(1000))
