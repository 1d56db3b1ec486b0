"""ParquetStream over a real S3 endpoint (moto's server on 127.0.0.1, real HTTP through s3fs)."""

from __future__ import annotations

import pytest

import streamshard as ss
from streamshard.testing import write_corpus
from helpers import assert_equal_steps, assert_exactly_once, assert_rows_match_ids, run_epoch
from strategies import SKEWED_LAYOUT

NUM_ROWS = sum(sum(f) for f in SKEWED_LAYOUT)


@pytest.fixture(scope="module")
def s3_corpus(s3, tmp_path_factory):
    local = tmp_path_factory.mktemp("s3src")
    write_corpus(str(local), SKEWED_LAYOUT)
    return s3.upload(str(local), "corpus-bucket", "skewed")


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_s3_glob_every_row_once_with_equal_steps(s3, s3_corpus, num_workers):
    def make(rank, world):
        return ss.ParquetStream(
            f"{s3_corpus}/*.parquet", columns=["id", "input_ids"], batch_size=128, shuffle=True,
            rank=rank, world_size=world, storage_options=s3.storage_options,
        )

    per_rank = run_epoch(make, 2, num_workers, epoch=1)
    assert_exactly_once(per_rank, NUM_ROWS)
    assert_equal_steps(per_rank)
    assert_rows_match_ids(per_rank)


def test_s3_directory_and_local_copy_give_identical_batches(s3, s3_corpus, tmp_path):
    write_corpus(str(tmp_path), SKEWED_LAYOUT)
    remote = ss.ParquetStream(s3_corpus, shuffle=True, seed=5, rank=0, world_size=1, storage_options=s3.storage_options)
    local = ss.ParquetStream(str(tmp_path), shuffle=True, seed=5, rank=0, world_size=1)
    for a, b in zip(remote, local, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert (a[key] == b[key]).all()


def test_s3_missing_prefix_is_a_clear_error(s3):
    ds = ss.ParquetStream("s3://corpus-bucket/nothing-here/*.parquet", storage_options=s3.storage_options, rank=0, world_size=1)
    with pytest.raises(ss.CatalogError, match="nothing-here"):
        ds.catalog


def test_one_s3_client_per_process_and_options(s3):
    from streamshard.io.storage import FileSystems

    a = FileSystems(s3.storage_options).resolve("s3://corpus-bucket/x")[0]
    b = FileSystems(dict(s3.storage_options)).resolve("s3://corpus-bucket/y")[0]
    other = FileSystems({**s3.storage_options, "secret": "other-secret-value"}).resolve("s3://corpus-bucket/x")[0]
    assert a is b and a is not other


def test_a_rebuilt_catalog_sees_files_added_since_the_last_build(s3, tmp_path):
    write_corpus(str(tmp_path / "v1"), [[5], [6]])
    url = s3.upload(str(tmp_path / "v1"), "growing-bucket", "c")
    assert ss.Catalog.build(url, storage_options=s3.storage_options).num_files == 2
    write_corpus(str(tmp_path / "v2"), [[5], [6], [7]])
    s3.filesystem().put_file(str(tmp_path / "v2" / "part-00002.parquet"), "growing-bucket/c/part-00002.parquet")
    rebuilt = ss.Catalog.build(url, storage_options=s3.storage_options)
    assert rebuilt.num_files == 3 and rebuilt.num_rows == 18


def test_a_rebuilt_catalog_sees_a_rewritten_file_size(s3, tmp_path):
    write_corpus(str(tmp_path / "v1"), [[5], [6]])
    url = s3.upload(str(tmp_path / "v1"), "rewrite-bucket", "c")
    ss.Catalog.build(url, storage_options=s3.storage_options)  # lists the directory (and may cache it)
    write_corpus(str(tmp_path / "v2"), [[50, 50]])
    s3.filesystem().put_file(str(tmp_path / "v2" / "part-00000.parquet"), "rewrite-bucket/c/part-00000.parquet")
    rebuilt = ss.Catalog.build(f"{url}/part-00000.parquet", storage_options=s3.storage_options)
    assert rebuilt.num_rows == 100
