"""Bad input fails with an error that names the file, column or argument at fault."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.testing import write_corpus


def catalog_of(path, **kwargs):
    return ss.ParquetStream(path, rank=0, world_size=1, **kwargs).catalog


def test_no_files_matched_names_the_pattern(tmp_path):
    with pytest.raises(ss.CatalogError, match="nope"):
        catalog_of(str(tmp_path / "nope*.parquet"))


def test_one_pattern_of_several_matching_nothing_is_an_error(tmp_path):
    write_corpus(str(tmp_path), [[5]])
    with pytest.raises(ss.CatalogError, match="typo"):
        ss.Catalog.build([str(tmp_path / "*.parquet"), str(tmp_path / "typo*.parquet")])


def test_non_parquet_file_is_named(tmp_path):
    write_corpus(str(tmp_path), [[5]])
    (tmp_path / "notes.txt").write_text("hello, this is not parquet at all")
    with pytest.raises(ss.CatalogError, match="notes.txt.*not a readable Parquet"):
        catalog_of(str(tmp_path))


def test_truncated_file_is_named(tmp_path):
    path = write_corpus(str(tmp_path), [[100, 100]])[0]
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ss.CatalogError, match="part-00000.parquet"):
        catalog_of(str(tmp_path))


def test_tiny_and_empty_files_are_rejected_by_name(tmp_path):
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(ss.CatalogError, match="zero.parquet.*too small"):
        catalog_of(str(tmp_path / "zero.parquet"))


def test_missing_column_names_file_and_column(tmp_path):
    write_corpus(str(tmp_path), [[5]])
    with pytest.raises(ss.CatalogError, match=r"part-00000.parquet.*\['nope'\]"):
        catalog_of(str(tmp_path), columns=["id", "nope"])


def test_schemas_that_disagree_name_both_files(tmp_path):
    pq.write_table(pa.table({"x": pa.array([1, 2], pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1.0, 2.0], pa.float64())}), tmp_path / "b.parquet")
    with pytest.raises(ss.CatalogError, match=r"'x'.*a\.parquet.*b\.parquet"):
        catalog_of(str(tmp_path))


def test_hidden_and_marker_files_in_directories_are_skipped(tmp_path):
    write_corpus(str(tmp_path), [[5], [6]])
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / ".part-00000.parquet.crc").write_bytes(b"crc")
    assert catalog_of(str(tmp_path)).num_rows == 11


def test_overlapping_patterns_do_not_duplicate_files(tmp_path):
    write_corpus(str(tmp_path), [[5], [6]])
    catalog = ss.Catalog.build([str(tmp_path), str(tmp_path / "part-00001.parquet")])
    assert catalog.num_files == 2 and catalog.num_rows == 11


def test_zero_row_files_and_row_groups_contribute_nothing(tmp_path):
    write_corpus(str(tmp_path), [[], [0, 4, 0], []])
    catalog = catalog_of(str(tmp_path))
    assert catalog.num_rows == 4 and catalog.num_files == 3
    batches = list(ss.ParquetStream(str(tmp_path), batch_size=None, rank=0, world_size=1))
    assert [b["sample_id"].tolist() for b in batches] == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -1}, "batch_size"),
        ({"unit": "rows"}, "unit"),
        ({"uneven": "repeat"}, "uneven"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"columns": "id"}, "columns"),
        ({"read_ahead": -1}, "read_ahead"),
        ({"transform": 3}, "transform"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ss.ParquetStream(str(tmp_path), **kwargs)


@pytest.mark.parametrize("paths", [[], "", None, [1]])
def test_bad_paths_are_rejected(paths):
    with pytest.raises(ValueError, match="paths"):
        ss.ParquetStream(paths)


def test_set_epoch_rejects_negative():
    with pytest.raises(ValueError, match="epoch"):
        ss.ParquetStream("x.parquet", rank=0, world_size=1).set_epoch(-1)


def test_a_file_that_changed_after_cataloging_fails_loudly(tmp_path):
    write_corpus(str(tmp_path), [[50, 50]])
    ds = ss.ParquetStream(str(tmp_path), rank=0, world_size=1)
    ds.catalog
    write_corpus(str(tmp_path), [[10]], seed=1)  # same name, different content and size
    with pytest.raises(ss.ReadError, match="part-00000.parquet"):
        list(ds)
