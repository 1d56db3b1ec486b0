"""One logical schema: files from different writers stream together; real type differences need a cast."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamshard as ss

ROWS = 6


def tokens(offset: int) -> list[list[int]]:
    return [[offset + i] * (i % 3 + 1) for i in range(ROWS)]


def write(path, ids, token_type, text_type, dictionary=False, item="item", nullable_item=True):
    """One file with ``id``, ``input_ids`` and ``text`` columns in the given physical types."""
    item_field = pa.field(item, pa.int32(), nullable=nullable_item)
    list_type = pa.large_list(item_field) if token_type == "large" else pa.list_(item_field)
    text = pa.array([f"row {i}" for i in ids], type=text_type)
    if dictionary:
        text = text.dictionary_encode()
    table = pa.table({"id": pa.array(ids, pa.int64()), "input_ids": pa.array(tokens(ids[0]), list_type), "text": text})
    pq.write_table(table, str(path))


@pytest.fixture
def mixed_writers(tmp_path):
    """pyarrow-style, polars-style (large types), Spark/DuckDB-style (``element`` items, required) files."""
    write(tmp_path / "a-pyarrow.parquet", list(range(0, ROWS)), "list", pa.string())
    write(tmp_path / "b-polars.parquet", list(range(ROWS, 2 * ROWS)), "large", pa.large_string())
    write(tmp_path / "c-spark.parquet", list(range(2 * ROWS, 3 * ROWS)), "list", pa.string(), dictionary=True,
          item="element", nullable_item=False)
    return str(tmp_path)


def test_files_that_differ_only_physically_stream_together_with_one_dtype_per_column(mixed_writers):
    ds = ss.ParquetStream(mixed_writers, batch_size=4, rank=0, world_size=1)
    ds.set_epoch(0)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert {tuple(sorted(b)) for b in batches} == {tuple(sorted(batches[0]))}, "every batch has the same keys"
    assert {b["input_ids"].dtype for b in batches} == {torch.int32}
    ids = torch.cat([b["sample_id"] for b in batches])
    real = ids >= 0
    assert sorted(ids[real].tolist()) == list(range(3 * ROWS))
    for b in batches:
        for row in np.flatnonzero((b["sample_id"] >= 0).numpy()):
            sid = int(b["sample_id"][row])
            length = int(b["input_ids_lengths"][row])
            expected = tokens((sid // ROWS) * ROWS)[sid % ROWS]
            assert b["input_ids"][row, :length].tolist() == expected
            assert b["text"][row] == f"row {sid}"


def test_a_real_type_difference_names_both_files_and_a_cast_resolves_it(tmp_path):
    pq.write_table(pa.table({"id": pa.array([0, 1], pa.int32())}), str(tmp_path / "a.parquet"))
    pq.write_table(pa.table({"id": pa.array([2, 3], pa.int64())}), str(tmp_path / "b.parquet"))
    with pytest.raises(ss.CatalogError, match=r"'id': int32 in .*a\.parquet but int64 in .*b\.parquet.*cast="):
        ss.ParquetStream(str(tmp_path), rank=0, world_size=1).catalog
    ds = ss.ParquetStream(str(tmp_path), batch_size=4, cast={"id": "int64"}, rank=0, world_size=1)
    (batch,) = list(ds)
    assert batch["id"].dtype == torch.int64 and batch["id"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("a, b", [
    (pa.timestamp("ms"), pa.timestamp("us")),
    (pa.timestamp("us", tz="UTC"), pa.timestamp("us")),
    (pa.float32(), pa.float64()),
])
def test_timestamps_of_other_units_or_zones_and_floats_of_other_widths_still_disagree(tmp_path, a, b):
    pq.write_table(pa.table({"x": pa.array([1, 2]).cast(a)}), str(tmp_path / "a.parquet"))
    pq.write_table(pa.table({"x": pa.array([3, 4]).cast(b)}), str(tmp_path / "b.parquet"))
    with pytest.raises(ss.CatalogError, match="schemas disagree on column 'x'"):
        ss.Catalog.build(str(tmp_path))


def test_a_bad_cast_argument_is_refused_by_name(tmp_path):
    pq.write_table(pa.table({"id": [1]}), str(tmp_path / "a.parquet"))
    with pytest.raises(ValueError, match="cast\\['id'\\]"):
        ss.ParquetStream(str(tmp_path), cast={"id": "no-such-type"})
    with pytest.raises(ss.CatalogError, match="cast names column"):
        ss.ParquetStream(str(tmp_path), cast={"nope": "int64"}).catalog


def test_blends_of_corpora_from_different_writers_mix(mixed_writers, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    write(other / "polars.parquet", list(range(0, ROWS)), "large", pa.large_string())
    corpora = {"mixed": ss.ParquetStream(mixed_writers), "polars": ss.ParquetStream(str(other))}
    blend = ss.BlendedStream(corpora, {"mixed": 0.5, "polars": 0.5}, batch_size=4, rank=0, world_size=1)
    batches = list(blend)
    assert sum(int((b["corpus"] == 1).sum()) for b in batches) == blend.counts()["polars"]
