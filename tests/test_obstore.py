"""The obstore backend (``storage_options={"backend": "obstore"}``) against a real S3 server (SeaweedFS on
127.0.0.1): the same guarantees as through s3fs (every row once, exact byte ranges, errors that name the
URL and cause, transient faults retried by our policy, changed objects refused), its options mapped from
s3fs's, and its one limit (a tokio runtime does not survive fork) handled by falling back to s3fs."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("obstore")

import streamshard as ss  # noqa: E402
from streamshard.io.catalog import Catalog  # noqa: E402
from streamshard.io.footer import SHARED_FOOTERS  # noqa: E402
from streamshard.io.obstore_fs import ObstoreFileSystem, _error, store_config  # noqa: E402
from streamshard.io.reader import RowGroupReader  # noqa: E402
from streamshard.io.retry import RetryPolicy, TransientError, is_transient  # noqa: E402
from streamshard.io.storage import FileSystems  # noqa: E402
from streamshard.testing import FaultConfig, faulty_proxy, write_corpus  # noqa: E402
from helpers import assert_equal_steps, assert_exactly_once, assert_rows_match_ids, run_epoch  # noqa: E402
from strategies import SKEWED_LAYOUT  # noqa: E402

BUCKET = "streamshard-obstore"
NUM_ROWS = sum(sum(f) for f in SKEWED_LAYOUT)
RANGES_LAYOUT = [[4000, 4000, 4000], [3000, 10]]
FAST_RETRY = RetryPolicy(max_attempts=8, base_delay=0.01, max_delay=0.05, deadline=30)


def obstore_options(store) -> dict:
    return {**store.storage_options, "backend": "obstore"}


@pytest.fixture(scope="module")
def skewed_url(seaweedfs, tmp_path_factory):
    local = tmp_path_factory.mktemp("obstore-skewed")
    write_corpus(str(local), SKEWED_LAYOUT)
    return seaweedfs.upload(str(local), BUCKET, "skewed")


def test_the_backend_option_selects_obstore_for_s3_only(seaweedfs, tmp_path):
    filesystems = FileSystems(obstore_options(seaweedfs))
    assert isinstance(filesystems.resolve(f"s3://{BUCKET}/x.parquet")[0], ObstoreFileSystem)
    assert not isinstance(filesystems.resolve(str(tmp_path))[0], ObstoreFileSystem)  # local disk: fsspec
    with pytest.raises(ValueError, match="backend='rust'"):
        FileSystems({"backend": "rust"}).resolve("s3://b/k")


def test_every_row_once_with_equal_steps_over_2_ranks_in_process(seaweedfs, skewed_url):
    def make(rank, world):
        return ss.ParquetStream(f"{skewed_url}/*.parquet", columns=["id", "input_ids"], batch_size=128, shuffle=True,
                                rank=rank, world_size=world, storage_options=obstore_options(seaweedfs))

    per_rank = run_epoch(make, world_size=2, num_workers=0, epoch=1)
    assert_exactly_once(per_rank, NUM_ROWS)
    assert_equal_steps(per_rank)
    assert_rows_match_ids(per_rank)


def test_every_row_once_with_forkserver_workers_that_use_obstore(seaweedfs, skewed_url):
    ds = ss.ParquetStream(skewed_url, columns=["id", "input_ids"], batch_size=256, rank=0, world_size=1,
                          storage_options=obstore_options(seaweedfs))
    ds.set_epoch(0)
    loader = ss.StreamLoader(ds, num_workers=2, multiprocessing_context="forkserver")
    assert_exactly_once([list(loader)], NUM_ROWS)


def test_streamloader_thread_workers_keep_obstore_and_deliver_every_row_once(seaweedfs, skewed_url, caplog):
    ds = ss.ParquetStream(skewed_url, columns=["id", "input_ids"], batch_size=256, rank=0, world_size=1,
                          storage_options=obstore_options(seaweedfs))
    loader = ss.StreamLoader(ds, num_workers=2)
    assert loader.workers == "threads"
    with caplog.at_level("WARNING", logger="streamshard"):
        assert_exactly_once([list(loader)], NUM_ROWS)
    assert not [r for r in caplog.records if "s3fs" in r.getMessage()], "thread workers fell back to s3fs"


def test_forked_workers_fall_back_to_s3fs_and_deliver_every_row_once(seaweedfs, skewed_url, caplog):
    def make(rank, world):
        return ss.ParquetStream(skewed_url, columns=["id", "input_ids"], batch_size=128, rank=rank, world_size=world,
                                storage_options=obstore_options(seaweedfs))

    per_rank = run_epoch(make, world_size=2, num_workers=2)  # fork after obstore read the catalog here
    assert_exactly_once(per_rank, NUM_ROWS)
    assert_rows_match_ids(per_rank)


def _resolve_in_child(options: dict, queue) -> None:
    queue.put(type(FileSystems(options).resolve("s3://b/k")[0]).__name__)


def test_a_process_forked_after_obstore_ran_resolves_s3_to_s3fs(seaweedfs, skewed_url):
    options = obstore_options(seaweedfs)
    Catalog.build(skewed_url, ["id"], options)  # obstore has run in this process
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_resolve_in_child, args=(options, queue))
    child.start()
    child.join(60)
    assert queue.get(timeout=5) == "S3FileSystem"


def test_a_projected_read_fetches_exactly_its_column_chunks_and_each_footer_once(seaweedfs, tmp_path):
    paths = write_corpus(str(tmp_path), RANGES_LAYOUT)
    footers = [pq.read_metadata(p) for p in paths]
    url = seaweedfs.upload(str(tmp_path), BUCKET, f"ranges-{tmp_path.name}")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        options = obstore_options(dataclasses.replace(seaweedfs, endpoint_url=proxy.endpoint_url))
        catalog = Catalog.build(url, ["score"], options)
        SHARED_FOOTERS.clear()  # as in a process that did not build the catalog: the reader fetches the footers
        proxy.reset_counts()
        reader = RowGroupReader.from_catalog(catalog, options)
        tables = [reader.read(f, g) for f, groups in enumerate(RANGES_LAYOUT) for g in range(len(groups))]
        chunks = sum(_column_bytes(metadata, "score") for metadata in footers)
        footer_tails = sum(metadata.serialized_size + 8 for metadata in footers)
        assert reader.stats.bytes_fetched == chunks + footer_tails
        assert reader.stats.requests == catalog.num_row_groups + catalog.num_files
        assert proxy.bytes("GET") == chunks + footer_tails  # exactly those ranges crossed HTTP (HEADs have no body)
        assert proxy.count("HEAD") == 0  # the version check rides on every GET (If-Match)
        proxy.reset_counts()  # the next reader of this process fetches the chunks alone
        again = RowGroupReader.from_catalog(catalog, options)
        assert [again.read(f, g) for f, groups in enumerate(RANGES_LAYOUT) for g in range(len(groups))] == tables
        assert proxy.bytes("GET") == chunks and again.stats.footers_shared == catalog.num_files
    expected = pa.concat_tables(pq.read_table(p, columns=["score"]) for p in paths)
    assert pa.concat_tables(tables).equals(expected)


def test_versions_match_s3fs_so_caches_and_checkpoints_agree_across_backends(seaweedfs, skewed_url):
    through_s3fs = Catalog.build(skewed_url, ["id"], seaweedfs.storage_options)
    through_obstore = Catalog.build(skewed_url, ["id"], obstore_options(seaweedfs))
    assert through_obstore.urls == through_s3fs.urls
    assert through_obstore.versions == through_s3fs.versions
    assert through_obstore.digest == through_s3fs.digest


@pytest.mark.parametrize("where", ["a missing prefix", "a missing object", "a missing bucket"])
def test_a_missing_path_is_a_catalog_error_naming_the_url(seaweedfs, skewed_url, where):
    url = {
        "a missing prefix": f"{skewed_url}/nothing-here/*.parquet",
        "a missing object": f"{skewed_url}/part-99999.parquet",
        "a missing bucket": "s3://no-such-bucket-here/skewed/part-00000.parquet",
    }[where]
    with pytest.raises(ss.CatalogError, match=re.escape(url)):
        Catalog.build(url, storage_options=obstore_options(seaweedfs))


def test_a_missing_bucket_is_named_as_such(seaweedfs):
    fs = FileSystems(obstore_options(seaweedfs)).resolve("s3://no-such-bucket-here/a")[0]
    with pytest.raises(FileNotFoundError, match="NoSuchBucket"):
        fs.cat_file("no-such-bucket-here/a/b.parquet", start=0, end=4)


def test_an_object_deleted_after_cataloging_fails_the_read_naming_its_url(seaweedfs, tmp_path):
    write_corpus(str(tmp_path), [[40, 30], [25]])
    url = seaweedfs.upload(str(tmp_path), BUCKET, f"deleted-{tmp_path.name}")
    options = obstore_options(seaweedfs)
    catalog = Catalog.build(url, ["id"], options)
    seaweedfs.filesystem().rm(f"{url.split('://')[1]}/part-00001.parquet")
    reader = RowGroupReader.from_catalog(catalog, options)
    assert reader.read(0, 1).num_rows == 30
    with pytest.raises(ss.ReadError, match=r"part-00001\.parquet: reading row group 0 failed: FileNotFoundError"):
        reader.read(1, 0)


def test_an_object_rewritten_after_cataloging_is_refused_naming_both_etags(seaweedfs, tmp_path):
    write_corpus(str(tmp_path / "a"), [[40, 30]])
    write_corpus(str(tmp_path / "b"), [[40, 30]], seed=1)  # same size and layout, other bytes
    url = seaweedfs.upload(str(tmp_path / "a"), BUCKET, f"rewritten-{tmp_path.name}")
    options = obstore_options(seaweedfs)
    catalog = Catalog.build(url, ["id", "input_ids"], options)
    seaweedfs.upload(str(tmp_path / "b"), BUCKET, f"rewritten-{tmp_path.name}")
    reader = RowGroupReader.from_catalog(catalog, options)
    with pytest.raises(ss.ReadError, match=r"part-00000\.parquet.*changed since it was cataloged.*ETag=.*ETag="):
        reader.read(0, 0)


def test_transient_faults_are_retried_by_our_policy_and_the_epoch_is_unchanged(seaweedfs, skewed_url, caplog):
    clean = Catalog.build(skewed_url, ["id"], obstore_options(seaweedfs))
    expected = RowGroupReader.from_catalog(clean, obstore_options(seaweedfs))
    wanted = [expected.read(int(clean.rg_file[g]), int(clean.rg_index[g])) for g in range(clean.num_row_groups)]
    config = FaultConfig(fault_rate=0.3, faults=("503", "500", "reset", "truncate"), fault_methods=("GET", "HEAD"))
    with faulty_proxy(seaweedfs.endpoint_url, config) as proxy, caplog.at_level(logging.WARNING, "streamshard"):
        options = obstore_options(dataclasses.replace(seaweedfs, endpoint_url=proxy.endpoint_url))
        catalog = Catalog.build(skewed_url, ["id"], options, retry=FAST_RETRY)
        reader = RowGroupReader.from_catalog(catalog, options, retry=FAST_RETRY)
        got = [reader.read(int(catalog.rg_file[g]), int(catalog.rg_index[g])) for g in range(catalog.num_row_groups)]
        assert sum(proxy.faults_injected.values()) > 0
    assert catalog.digest == clean.digest
    assert all(a.equals(b) for a, b in zip(got, wanted))
    assert "transient" in caplog.text


def test_a_permanent_http_error_fails_at_once_naming_the_url_and_code(seaweedfs, skewed_url):
    config = FaultConfig(permanent={r"part-00001": 403})
    with faulty_proxy(seaweedfs.endpoint_url, config) as proxy:
        options = obstore_options(dataclasses.replace(seaweedfs, endpoint_url=proxy.endpoint_url))
        SHARED_FOOTERS.clear()  # the footer is read through the proxy, not taken from an earlier build's reads
        with pytest.raises(ss.CatalogError, match=r"part-00001\.parquet.*PermissionError.*403 AccessDenied"):
            Catalog.build(skewed_url, ["id"], options, retry=FAST_RETRY)
        assert proxy.count(path="part-00001") == 1  # not retried


def test_s3fs_style_options_map_to_obstore_settings():
    config = store_config({"key": "AKIA1234", "secret": "s3cr3t", "token": "tok", "backend": "obstore",
                           "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"},
                           "config_kwargs": {"connect_timeout": 3, "s3": {"addressing_style": "path"}}})
    assert (config["access_key_id"], config["secret_access_key"], config["session_token"]) == ("AKIA1234", "s3cr3t", "tok")
    assert (config["endpoint"], config["region"]) == ("http://127.0.0.1:9000", "eu-west-1")
    assert config["virtual_hosted_style_request"] is False
    assert config["client_options"]["allow_http"] is True
    assert config["client_options"]["connect_timeout"] == "3.0s"
    assert config["retry_config"] == {"max_retries": 0}  # ours retry
    anonymous = store_config({"anon": True, "region": "us-east-1"})
    assert anonymous["skip_signature"] is True and anonymous["virtual_hosted_style_request"] is True
    assert "allow_http" not in anonymous["client_options"]


def test_an_option_obstore_cannot_honour_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\['session', 'client_kwargs.verify'\].*not supported"):
        store_config({"session": object(), "profile": "dev", "client_kwargs": {"verify": False}})


@pytest.mark.parametrize("message, kind, transient", [
    ("Generic S3 error: Error performing GET http://h/b/k in 2ms - Server returned non-2xx status code: "
     "503 Service Unavailable: <Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
     "</Error>\n\nDebug source: ...", TransientError, True),
    ("Generic S3 error: Error performing GET http://h/b/k in 3ms - HTTP error: error sending request", TransientError, True),
    ("Generic S3 error: HTTP error: request or response body error", TransientError, True),
    ("Generic S3 error: Error performing GET http://h/b/k in 3ms - Server returned non-2xx status code: "
     "416 Range Not Satisfiable: <Error><Code>InvalidRange</Code><Message>no</Message></Error>", OSError, False),
])
def test_obstore_errors_are_classified_for_our_retries(message, kind, transient):
    error = _error("s3://b/k", RuntimeError(message))
    assert type(error) is kind and is_transient(error) is transient
    assert str(error).startswith("s3://b/k: ") and "Debug source" not in str(error)


def _column_bytes(metadata: pq.FileMetaData, name: str) -> int:
    index = metadata.schema.names.index(name)
    return sum(metadata.row_group(g).column(index).total_compressed_size for g in range(metadata.num_row_groups))
