"""Footers are read once per process while a file is unchanged, and never used for a file that changed.

The catalog and every reader of a process share the footers already read (``footer.SHARED_FOOTERS``),
keyed by URL, size and version: passes and thread workers fetch only data, and a file rewritten since
(another mtime or ETag, even at the same size) is read with its own footer, or refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.io.catalog import Catalog
from streamshard.io.footer import SHARED_FOOTERS, SharedFooters
from streamshard.io.reader import RowGroupReader
from streamshard.testing import faulty_proxy, write_corpus


def via(proxy, store):
    options = dict(store.storage_options)
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return options


def write_at_size(path, first_id: int, groups: list[int], size: int | None = None, pad: int = 0) -> int:
    """A file of ids ``first_id...`` in row groups of ``groups`` rows, its footer's key-value metadata
    padded by ``pad`` bytes, or to make the file exactly ``size`` bytes. Returns its size."""
    table = pa.table({"id": pa.array(range(first_id, first_id + sum(groups)), pa.int64())})
    for _ in range(20):
        with pq.ParquetWriter(path, table.schema, store_schema=False) as writer:
            start = 0
            for rows in groups:
                writer.write_table(table.slice(start, rows))
                start += rows
            writer.add_key_value_metadata({"pad": "x" * pad})
        now = os.path.getsize(path)
        if size is None or now == size:
            return now
        pad += size - now
        assert pad >= 0, "the rewrite must start smaller than the file it replaces"
    raise AssertionError(f"could not write {path} at {size} bytes")


def every_row(catalog, options) -> list[int]:
    reader = RowGroupReader.from_catalog(catalog, options)
    try:
        return [i for f, g in zip(catalog.rg_file.tolist(), catalog.rg_index.tolist())
                for i in reader.read(f, g).column("id").to_pylist()]
    finally:
        reader.close()


def build_in_another_process(url, options, cache_dir) -> None:
    """Catalog ``url`` in a fresh interpreter, leaving its summary in ``cache_dir`` (as another rank or job would)."""
    code = ("import json, sys; from streamshard.io.catalog import Catalog; "
            "Catalog.build(sys.argv[1], None, json.loads(sys.argv[2]), cache_dir=sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, url, json.dumps(options), cache_dir], check=True, timeout=120)


@pytest.mark.parametrize("where", ["local disk (mtime)", "S3 (ETag)"])
def test_a_footer_kept_for_a_file_is_never_used_after_the_file_changed(where, seaweedfs, tmp_path):
    # The process holds the old footer; the new catalog comes from a cache another process wrote, so
    # nothing here read the new footer: only the version in the key keeps the old one from being used.
    data = tmp_path / "data"
    data.mkdir()
    size = write_at_size(data / "a.parquet", 0, [60, 60, 60], pad=1000)
    if where.startswith("S3"):
        options = seaweedfs.storage_options
        url = seaweedfs.upload(str(data), "shared-footers", tmp_path.name)
    else:
        options, url = {}, str(data)
    cache_dir = str(tmp_path / "catalog-cache")
    old = Catalog.build(url, None, options, cache_dir=cache_dir)
    assert every_row(old, options) == list(range(180))  # the old footer is now kept in this process

    rewritten = tmp_path / "rewritten.parquet"
    write_at_size(rewritten, 1000, [100, 20], size)  # same size and name, other row groups and footer
    if where.startswith("S3"):
        seaweedfs.filesystem().put_file(str(rewritten), f"shared-footers/{tmp_path.name}/a.parquet")
    else:
        os.replace(rewritten, data / "a.parquet")
        stat = os.stat(data / "a.parquet")
        os.utime(data / "a.parquet", (stat.st_atime, stat.st_mtime + 5))
    build_in_another_process(url, options, cache_dir)
    new = Catalog.build(url, None, options, cache_dir=cache_dir)  # from the cache: no footer read here
    assert new.file_sizes.tolist() == old.file_sizes.tolist() and new.versions != old.versions
    assert new.rg_rows.tolist() == [100, 20]

    assert every_row(new, options) == list(range(1000, 1120))
    with pytest.raises(ss.ReadError, match=r"a\.parquet: reading row group \d failed: the file changed since"):
        every_row(old, options)


def test_a_new_catalog_in_the_same_process_lists_and_reads_only_the_footers_of_changed_files(seaweedfs, tmp_path):
    # A new dataset or loader in a running job: the listing is asked again (files added, removed or
    # rewritten are seen), the footers of unchanged objects come from this process, a rewritten one's
    # footer is read again (its new ETag misses), and its rows are the new object's.
    write_corpus(str(tmp_path / "data"), [[300, 300], [200, 200, 200], [250]])
    url = seaweedfs.upload(str(tmp_path / "data"), "shared-footers", f"again-{tmp_path.name}")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        options = via(proxy, seaweedfs)
        first = Catalog.build(url, ["id"], options)
        proxy.reset_counts()
        again = Catalog.build(url, ["id"], options)
        assert proxy.count("GET", ".parquet") == 0 and proxy.count() >= 1  # listed, no footer read
        assert again.digest == first.digest and (again.rg_ranges == first.rg_ranges).all()

        write_at_size(tmp_path / "new.parquet", 5000, [70, 80])
        seaweedfs.filesystem().put_file(str(tmp_path / "new.parquet"), f"shared-footers/again-{tmp_path.name}/"
                                        "part-00001.parquet")
        proxy.reset_counts()
        rebuilt = Catalog.build(url, ["id"], options)
        assert proxy.count("GET", ".parquet") == 1 and proxy.count("GET", "part-00001") == 1
        assert rebuilt.rg_rows.tolist() == [300, 300, 70, 80, 250] and rebuilt.versions[1] != first.versions[1]
        rows = every_row(rebuilt, options)
        assert rows[600:750] == list(range(5000, 5150))
        with pytest.raises(ss.ReadError, match=r"part-00001\.parquet: reading row group \d failed: the file changed"):
            every_row(first, options)


@pytest.mark.parametrize("backend", ["s3fs", "obstore"])
def test_an_s3_directory_is_listed_in_one_round_of_requests(backend, seaweedfs, tmp_path):
    # info() of a prefix is a HEAD and then a one-key listing, and the catalog's listing came after it:
    # three requests one after another. Now the HEAD and the listing go out together: two requests.
    if backend == "obstore":
        pytest.importorskip("obstore")
    write_corpus(str(tmp_path / "data"), [[30], [40]])
    url = seaweedfs.upload(str(tmp_path / "data"), "shared-footers", f"listed-{tmp_path.name}")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        options = via(proxy, seaweedfs)
        if backend == "obstore":
            options["backend"] = "obstore"
        SHARED_FOOTERS.clear()
        catalog = Catalog.build(url, ["id"], options)
        assert catalog.rg_rows.tolist() == [30, 40]
        assert proxy.count("GET", ".parquet") == 2  # the footers
        assert proxy.count() - proxy.count("GET", ".parquet") == 2  # one HEAD, one listing
        with pytest.raises(ss.CatalogError, match="does not exist"):
            Catalog.build(f"{url}-missing", ["id"], options)


def test_a_files_footer_is_fetched_once_per_process_across_passes_and_thread_workers(seaweedfs, tmp_path):
    write_corpus(str(tmp_path), [[300, 300], [200, 200, 200], [250]])
    url = seaweedfs.upload(str(tmp_path), "shared-footers", f"once-{tmp_path.name}")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        ds = ss.ParquetStream(url, columns=["id"], batch_size=50, rank=0, world_size=1,
                              storage_options=via(proxy, seaweedfs))
        ds.set_epoch(0)
        SHARED_FOOTERS.clear()  # as if the catalog came from a cache or another rank: no footer read here
        proxy.reset_counts()
        readers = {}
        ds.stats_hook = lambda stats: readers.setdefault(id(stats.reads), stats.reads)  # each worker's, each pass
        loader = ss.StreamLoader(ds, num_workers=2)
        for epoch in range(2):
            ds.set_epoch(epoch)
            ids = sorted(int(i) for batch in loader for i in batch["sample_id"] if i >= 0)
            assert ids == list(range(ds.catalog.num_rows))
        reads = list(readers.values())
        assert len(reads) == 4  # 2 passes x 2 workers
        # Each footer once in all, and at most one GET per row group read (a group both workers read from is
        # read by each): a reader's small groups of one file started together come in one GET
        # (test_remote_read_ahead.py counts those).
        assert proxy.count("GET", ".parquet") == sum(r.requests for r in reads)
        assert sum(r.requests for r in reads) <= sum(r.row_groups_read for r in reads) + ds.catalog.num_files
        assert sum(r.footers_fetched for r in reads) == ds.catalog.num_files


def test_the_shared_footers_stay_within_their_byte_budget_and_keep_nothing_without_a_version():
    shared = SharedFooters(budget=100)
    shared.put("s3://b/x", 10, "", b"f" * 10)
    assert shared.get("s3://b/x", 10, "") is None and len(shared) == 0
    for i in range(5):
        shared.put(f"s3://b/{i}", 1000, 'ETag="1"', bytes([i]) * 40)
    assert len(shared) == 2  # 80 of 100 bytes: the three oldest went
    assert shared.get("s3://b/4", 1000, 'ETag="1"') == bytes([4]) * 40
    assert shared.get("s3://b/4", 1000, 'ETag="2"') is None  # another version is another file
    assert shared.get("s3://b/4", 999, 'ETag="1"') is None
    assert shared.get("s3://b/0", 1000, 'ETag="1"') is None


def test_a_footer_fetched_again_after_another_readers_fetch_of_it_failed_is_shared(tmp_path, monkeypatch):
    # Reader ``first`` waits for another reader's fetch of the footer (here: the test's claim), which
    # fails; it fetches the footer itself, and leaves it for the process, so a later reader fetches data only.
    write_at_size(tmp_path / "a.parquet", 0, [60, 60])
    catalog = Catalog.build(str(tmp_path))
    key = (catalog.urls[0], int(catalog.file_sizes[0]), catalog.versions[0])
    SHARED_FOOTERS.clear()
    waiting = threading.Event()
    claim = SHARED_FOOTERS.claim

    def claim_noting_waiters(*args):
        tail, pending = claim(*args)
        if pending is not None:
            waiting.set()
        return tail, pending

    monkeypatch.setattr(SHARED_FOOTERS, "claim", claim_noting_waiters)
    # Readers without the catalog's byte layout: they fetch a file's footer before its data.
    first = RowGroupReader(catalog.urls, catalog.file_sizes, ["id"], versions=catalog.versions)
    later = RowGroupReader(catalog.urls, catalog.file_sizes, ["id"], versions=catalog.versions)
    try:
        assert SHARED_FOOTERS.claim(*key) == (None, None)  # "another reader" fetches the footer now
        with ThreadPoolExecutor(1) as pool:
            read = pool.submit(first.read, 0, 0)
            assert waiting.wait(30)
            SHARED_FOOTERS.settle(*key, None)  # ... and fails
            assert read.result(30).column("id").to_pylist() == list(range(60))
        assert first.stats.footers_fetched == 1
        assert later.read(0, 1).column("id").to_pylist() == list(range(60, 120))
        assert (later.stats.footers_shared, later.stats.footers_fetched, later.stats.requests) == (1, 0, 1)
    finally:
        first.close()
        later.close()
        SHARED_FOOTERS.clear()
