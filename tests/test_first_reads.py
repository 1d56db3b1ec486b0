"""A fresh loader in a process that read the same files before sends its first data reads beside its
listing (``io/first_reads.py``, issue 25 item 3), and never delivers bytes of a file as it was before.

A new catalog over the same paths sends the first reads the last loader made, each conditioned on the
ETag the last listing saw, while it lists; the readers take those bytes only for files the new listing
has at that same size and ETag. Files rewritten or added between two loaders are read as they are now.
"""

from __future__ import annotations

import time

import pytest

import streamshard as ss
import streamshard.io.first_reads as first_reads
from streamshard.io.first_reads import FIRST_READS
from streamshard.testing import faulty_proxy, write_corpus

from test_shared_footers import via, write_at_size

LAYOUT = [[500] * 4] * 4  # 16 small row groups: each file's 4 come in one GET


def epoch_ids(url, options) -> list[int]:
    """A fresh dataset's whole pass (one worker, batches of 100 rows): every id delivered."""
    ds = ss.ParquetStream(url, columns=["id"], batch_size=100, rank=0, world_size=1, storage_options=options)
    return [int(i) for b in ds for i in b["id"][b["sample_id"] >= 0]]


def data_gets_within(proxy, expected: int, seconds: float = 5.0) -> int:
    """The data GETs the proxy has seen, waiting up to ``seconds`` for ``expected`` of them (a GET still
    in flight when the catalog returned counts once it is answered)."""
    deadline = time.monotonic() + seconds
    while proxy.count("GET", ".parquet") < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.count("GET", ".parquet")


def test_a_second_loader_in_the_same_process_reads_its_first_data_while_it_lists(seaweedfs, tmp_path):
    """The first pass reads each file's 4 groups in one GET, after the catalog. A new dataset over the
    same paths sends those 4 GETs while its catalog lists (they are there when the catalog is done:
    before, none was) and its pass asks nothing more. Every row arrives once."""
    write_corpus(str(tmp_path), LAYOUT)
    url = seaweedfs.upload(str(tmp_path), "first-reads", "again")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        options = via(proxy, seaweedfs)
        assert sorted(epoch_ids(url, options)) == list(range(8_000))
        proxy.reset_counts()
        ds = ss.ParquetStream(url, columns=["id"], batch_size=100, rank=0, world_size=1, storage_options=options)
        ds.set_epoch(0)  # the catalog: a listing (and a HEAD), the footers from this process
        assert data_gets_within(proxy, 4) == 4, "the first data GETs did not go out beside the listing"
        ids = [int(i) for b in ds for i in b["id"][b["sample_id"] >= 0]]
        assert proxy.count("GET", ".parquet") == 4  # the pass took the early bytes: no GET of its own
        proxy.reset_counts()  # a third loader gets bytes of its own (early reads are no data cache)
        assert sorted(epoch_ids(url, options)) == list(range(8_000))
        assert proxy.count("GET", ".parquet") == 4
    assert sorted(ids) == list(range(8_000))


def test_early_reads_stay_within_their_byte_budget(seaweedfs, tmp_path, monkeypatch):
    """With room for one file's first reads only, one early GET goes out and the other files are read as
    before; the rows are the same."""
    write_corpus(str(tmp_path), LAYOUT)
    url = seaweedfs.upload(str(tmp_path), "first-reads", "budget")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        options = via(proxy, seaweedfs)
        epoch_ids(url, options)
        one_file = max(sum(e - s for s, e in spans) for (u, _, _), spans in FIRST_READS._first.items()
                       if u.startswith(url.rstrip("/") + "/"))
        monkeypatch.setattr(first_reads, "EARLY_BYTES", one_file)
        proxy.reset_counts()
        ds = ss.ParquetStream(url, columns=["id"], batch_size=100, rank=0, world_size=1, storage_options=options)
        ds.set_epoch(0)
        assert data_gets_within(proxy, 1, seconds=1.0) == 1
        ids = [int(i) for b in ds for i in b["id"][b["sample_id"] >= 0]]
        assert proxy.count("GET", ".parquet") == 4  # 1 early, 3 by the pass
    assert sorted(ids) == list(range(8_000))


@pytest.mark.parametrize("change", ["rewritten at the same size", "added"])
def test_files_changed_between_two_loaders_give_their_rows_as_they_are_now(change, seaweedfs, tmp_path):
    """A file rewritten (same size, other ids: another ETag) or added between two loaders in one process:
    the second loader's early reads go out as remembered, and its rows are the files as they are now
    (the rewritten file's new ids, the added file's ids), each once: never the old bytes."""
    write_corpus(str(tmp_path / "data"), LAYOUT)
    prefix = f"changed-{change.split()[0]}"
    url = seaweedfs.upload(str(tmp_path / "data"), "first-reads", prefix)
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        options = via(proxy, seaweedfs)
        assert sorted(epoch_ids(url, options)) == list(range(8_000))
        if change == "added":
            write_at_size(tmp_path / "new.parquet", 100_000, [300, 300])
            name, expected = "part-00009.parquet", list(range(8_000)) + list(range(100_000, 100_600))
        else:
            size = (tmp_path / "data" / "part-00001.parquet").stat().st_size
            write_at_size(tmp_path / "new.parquet", 100_000, [500] * 4, size=size)
            name, expected = "part-00001.parquet", sorted([*range(2_000), *range(4_000, 8_000), *range(100_000, 102_000)])
        seaweedfs.filesystem().put_file(str(tmp_path / "new.parquet"), f"first-reads/{prefix}/{name}")
        sent, taken = FIRST_READS.sent, FIRST_READS.taken
        ids = epoch_ids(url, options)
        assert FIRST_READS.sent - sent == 4  # the remembered reads went out (the rewritten file's refused)
        assert FIRST_READS.taken - taken == (4 if change == "added" else 3)
    assert sorted(ids) == expected


def loader_ids(url, options) -> list[int]:
    """A fresh dataset and ``StreamLoader`` (2 thread workers): every id delivered."""
    ds = ss.ParquetStream(url, columns=["id"], batch_size=100, rank=0, world_size=1, storage_options=options)
    return [int(i) for b in ss.StreamLoader(ds, num_workers=2) for i in b["id"][b["sample_id"] >= 0]]


def test_a_fresh_stream_loader_reads_and_decodes_while_its_listing_runs(seaweedfs, tmp_path, monkeypatch):
    """The second loader over the same paths in one process starts from the catalog of the last listing
    (every footer held) and lists beside its first reads: with the listing slowed by 0.5 s, its row groups
    are read and decoded before the listing is back (before, nothing was read until the catalog was
    listed). One listing per loader; every row once."""
    import streamshard.io.catalog as catalog_module
    from streamshard.io.reader import RowGroupReader

    write_corpus(str(tmp_path), LAYOUT)
    url = seaweedfs.upload(str(tmp_path), "first-reads", "speculate")
    listed, read = [], []
    original_list, original_read = catalog_module.list_sources, RowGroupReader.read_part

    def slow_listing(*args, **kwargs):
        time.sleep(0.5)
        try:
            return original_list(*args, **kwargs)
        finally:
            listed.append(time.monotonic())

    def timed_read(self, *args, **kwargs):
        try:
            return original_read(self, *args, **kwargs)
        finally:
            read.append(time.monotonic())

    monkeypatch.setattr(catalog_module, "list_sources", slow_listing)
    monkeypatch.setattr(RowGroupReader, "read_part", timed_read)
    assert sorted(loader_ids(url, seaweedfs.storage_options)) == list(range(8_000))
    listed.clear(), read.clear()
    assert sorted(loader_ids(url, seaweedfs.storage_options)) == list(range(8_000))
    assert len(listed) == 1
    assert sum(t < listed[0] for t in read) >= 2, "no row group was read before the listing came back"


@pytest.mark.parametrize("change", ["rewritten at the same size", "added", "removed"])
def test_a_stream_loader_on_files_changed_since_the_last_listing_delivers_them_as_they_are_now(
        change, seaweedfs, tmp_path, monkeypatch):
    """Between two loaders in one process a file is rewritten (same size, other ids), added or removed:
    the second loader's catalog, taken from the last listing, is refused by the listing made beside it,
    nothing it read is delivered, and the pass runs on the files as they are now: each of their ids once."""
    write_corpus(str(tmp_path / "data"), LAYOUT)
    prefix = f"loader-{change.split()[0]}"
    url = seaweedfs.upload(str(tmp_path / "data"), "first-reads", prefix)
    options = seaweedfs.storage_options
    assert sorted(loader_ids(url, options)) == list(range(8_000))
    store = seaweedfs.filesystem()
    if change == "removed":
        store.rm(f"first-reads/{prefix}/part-00001.parquet")
        expected = [*range(2_000), *range(4_000, 8_000)]
    elif change == "added":
        write_at_size(tmp_path / "new.parquet", 100_000, [300, 300])
        store.put_file(str(tmp_path / "new.parquet"), f"first-reads/{prefix}/part-00009.parquet")
        expected = list(range(8_000)) + list(range(100_000, 100_600))
    else:
        size = (tmp_path / "data" / "part-00001.parquet").stat().st_size
        write_at_size(tmp_path / "new.parquet", 100_000, [500] * 4, size=size)
        store.put_file(str(tmp_path / "new.parquet"), f"first-reads/{prefix}/part-00001.parquet")
        expected = sorted([*range(2_000), *range(4_000, 8_000), *range(100_000, 102_000)])
    answers = []
    confirm = ss.ParquetStream.confirm_catalog
    monkeypatch.setattr(ss.ParquetStream, "confirm_catalog", lambda self: answers.append(confirm(self)) or answers[-1])
    assert sorted(loader_ids(url, options)) == expected
    assert answers == [False], "the catalog of the last listing was not refused"
