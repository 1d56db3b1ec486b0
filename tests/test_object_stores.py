"""ParquetStream over real object stores on 127.0.0.1: SeaweedFS (S3, through s3fs) and
fake-gcs-server (GCS, through gcsfs). The same specification holds for every store."""

from __future__ import annotations

import dataclasses
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.io.catalog import Catalog
from streamshard.io.footer import SHARED_FOOTERS
from streamshard.io.reader import RowGroupReader
from streamshard.testing import faulty_proxy, write_corpus
from helpers import assert_equal_steps, assert_exactly_once, assert_rows_match_ids, run_epoch
from strategies import SKEWED_LAYOUT

NUM_ROWS = sum(sum(f) for f in SKEWED_LAYOUT)
BUCKET = "streamshard-tests"
# Projection layout: several row groups per file, so per-row-group reads and per-file footers both show.
RANGES_LAYOUT = [[4000, 4000, 4000], [3000, 10]]
METADATA_BYTES = 4096  # per file: object-metadata requests (under 1 KiB each on fake-gcs-server)


@pytest.fixture(scope="module", params=["seaweedfs", "gcs"])
def store(request):
    """The running store (session fixtures in conftest.py): SeaweedFS over s3://, fake-gcs-server over gs://."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def skewed_url(store, tmp_path_factory):
    local = tmp_path_factory.mktemp("skewed")
    write_corpus(str(local), SKEWED_LAYOUT)
    return store.upload(str(local), BUCKET, "skewed")


@pytest.fixture(scope="module")
def ranges_url(store, tmp_path_factory):
    local = tmp_path_factory.mktemp("ranges")
    paths = write_corpus(str(local), RANGES_LAYOUT)
    return store.upload(str(local), BUCKET, "ranges"), [pq.read_metadata(p) for p in paths]


def test_every_row_once_with_equal_steps_over_2_ranks_x_2_workers(store, skewed_url):
    def make(rank, world):
        return ss.ParquetStream(
            f"{skewed_url}/*.parquet", columns=["id", "input_ids"], batch_size=128, shuffle=True,
            rank=rank, world_size=world, storage_options=store.storage_options,
        )

    per_rank = run_epoch(make, world_size=2, num_workers=2, epoch=1)
    assert_exactly_once(per_rank, NUM_ROWS)
    assert_equal_steps(per_rank)
    assert_rows_match_ids(per_rank)


def test_a_projected_read_fetches_exactly_its_column_chunks_and_each_footer_once(store, ranges_url):
    url, footers = ranges_url
    with faulty_proxy(store.endpoint_url) as proxy:  # counts the bytes that really cross HTTP
        options = dataclasses.replace(store, endpoint_url=proxy.endpoint_url).storage_options
        catalog = Catalog.build(url, ["score"], options)
        SHARED_FOOTERS.clear()  # as in a process that did not build the catalog: the reader fetches the footers
        proxy.reset_counts()
        reader = RowGroupReader.from_catalog(catalog, options)
        tables = [reader.read(f, g) for f, groups in enumerate(RANGES_LAYOUT) for g in range(len(groups))]

        chunks = sum(column_bytes(metadata, "score") for metadata in footers)
        footer_tails = sum(metadata.serialized_size + 8 for metadata in footers)  # + length and magic
        assert sum(catalog.file_sizes) > 10 * (chunks + footer_tails)  # a whole-object read would show
        assert reader.stats.bytes_fetched == chunks + footer_tails
        assert reader.stats.requests == catalog.num_row_groups + catalog.num_files
        assert reader.stats.misses == 0
        # On the wire: those ranges, plus at most some object metadata per file (the version check).
        on_the_wire = proxy.bytes("GET")
        assert reader.stats.bytes_fetched <= on_the_wire <= reader.stats.bytes_fetched + METADATA_BYTES * catalog.num_files
        # The next reader of this process (another pass, another thread worker) fetches the chunks alone.
        again = RowGroupReader.from_catalog(catalog, options)
        assert [again.read(f, g) for f, groups in enumerate(RANGES_LAYOUT) for g in range(len(groups))] == tables
        assert (again.stats.bytes_fetched, again.stats.footers_fetched) == (chunks, 0)
    expected = pa.concat_tables(pq.read_table(u, columns=["score"], filesystem=store.filesystem())
                                for u in catalog.urls)
    assert pa.concat_tables(tables).equals(expected)


@pytest.mark.parametrize("where", ["a missing prefix", "a missing object", "a missing bucket"])
def test_a_missing_path_is_a_catalog_error_naming_the_url(store, skewed_url, where):
    url = {
        "a missing prefix": f"{skewed_url}/nothing-here/*.parquet",
        "a missing object": f"{skewed_url}/part-99999.parquet",
        "a missing bucket": f"{store.protocol}://no-such-bucket-here/skewed/part-00000.parquet",
    }[where]
    ds = ss.ParquetStream(url, storage_options=store.storage_options, rank=0, world_size=1)
    with pytest.raises(ss.CatalogError, match=re.escape(url)):
        ds.catalog


def test_an_object_deleted_after_cataloging_fails_the_read_naming_its_url(store, tmp_path):
    write_corpus(str(tmp_path), [[40, 30], [25]])
    url = store.upload(str(tmp_path), BUCKET, f"deleted-{tmp_path.name}")
    catalog = Catalog.build(url, ["id"], store.storage_options)
    store.filesystem().rm(f"{url.split('://')[1]}/part-00001.parquet")
    reader = RowGroupReader.from_catalog(catalog, store.storage_options)
    assert reader.read(0, 1).num_rows == 30
    with pytest.raises(ss.ReadError, match=r"part-00001\.parquet: reading row group 0 failed: FileNotFoundError"):
        reader.read(1, 0)


def column_bytes(metadata: pq.FileMetaData, name: str) -> int:
    index = metadata.schema.names.index(name)
    return sum(metadata.row_group(g).column(index).total_compressed_size for g in range(metadata.num_row_groups))
