"""A fresh loader over object storage (issue 25 item 3): small row groups keep enough reads in flight to
cover a round trip, a file's small groups read at once come in one GET, and the first reads do not wait
for pyarrow's pandas import.

On object storage each read is a round trip; ``read_ahead=2`` small groups in flight left a worker waiting
on the store between them (a fresh epoch's reads came in 4-5 rounds, one GET per row group). Now reads
ahead go on past ``read_ahead`` while they fetch at most ``READ_AHEAD_FETCH_BYTES`` compressed bytes
(``streams/delivery.py``), and the reads started together are announced to the reader, which fetches the
small groups of one file in one ranged GET (``RowGroupReader.read_together``): the latency proxy sees one
GET per file before the first row group is consumed, and none after. On local disk, or for groups above
the budget, ``read_ahead`` stays the limit.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import streamshard as ss
import streamshard.streams.delivery as delivery
from streamshard.testing import faulty_proxy, write_corpus

LAYOUT = [[500] * 4] * 4  # 16 small row groups (a few KB each)


def via(proxy, store) -> dict:
    options = dict(store.storage_options)
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return options


def gets_before_the_first_group_is_consumed(url, options, proxy) -> tuple[int, int, list[int]]:
    """One pass of one worker in batches of 10 rows: the data GETs the proxy saw while the first batch
    was held (the first row group is 50 batches long), the most reads held, and every id delivered."""
    seen = []
    ds = ss.ParquetStream(url, columns=["id"], batch_size=10, rank=0, world_size=1, storage_options=options)
    ds.stats_hook = seen.append
    ds.set_epoch(0)  # the catalog (listing, footers) before the count
    proxy.reset_counts()
    batches = iter(ds)
    first = next(batches)
    deadline = time.monotonic() + 10
    while proxy.count("GET", ".parquet") < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # and no more than that arrives later
    gets = proxy.count("GET", ".parquet")
    rest = list(batches)
    ids = [int(i) for b in [first] + rest for i in b["id"][b["sample_id"] >= 0]]
    return gets, seen[-1].most_reads_held, ids


@pytest.mark.slow
def test_a_fresh_epoch_reads_each_files_small_groups_in_one_get_all_at_once(seaweedfs, tmp_path):
    """4 files of 4 groups of 500 rows: the old read-ahead had 3 groups (1 + ``read_ahead``) in flight before
    the first group was consumed, one GET each (16 in the epoch); now all 16, in 4 GETs (one per file;
    the footers came with the catalog), and no other GET in the epoch. Every row arrives once."""
    write_corpus(str(tmp_path), LAYOUT)
    url = seaweedfs.upload(str(tmp_path), "remote-read-ahead", "all")
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        gets, held, ids = gets_before_the_first_group_is_consumed(url, via(proxy, seaweedfs), proxy)
        assert proxy.count("GET", ".parquet") == 4  # none after the first round
    assert gets == 4, f"{gets} data GETs before the first row group was consumed (expected one per file)"
    assert held == 16
    assert sorted(ids) == list(range(8_000))


def test_a_file_rewritten_after_the_catalog_is_refused_by_the_coalesced_get(seaweedfs, tmp_path):
    """The one GET of a file's groups carries the cataloged ETag like any other: a file rewritten (same
    size, other content) between catalog and read is a ReadError, never other rows under the old ids."""
    write_corpus(str(tmp_path), LAYOUT)
    url = seaweedfs.upload(str(tmp_path), "remote-read-ahead", "rewritten")
    ds = ss.ParquetStream(url, columns=["id"], batch_size=10, rank=0, world_size=1,
                          storage_options=seaweedfs.storage_options)
    ds.set_epoch(0)  # cataloged
    first = sorted(p.name for p in tmp_path.iterdir())[0]
    other = write_corpus(str(tmp_path / "other"), [[500] * 4], tokens="random")[0]  # same layout, other bytes
    seaweedfs.filesystem().put_file(other, f"remote-read-ahead/rewritten/{first}")
    with pytest.raises(ss.ReadError, match="changed"):
        list(ds)


@pytest.mark.slow
def test_remote_read_ahead_past_read_ahead_is_bounded_by_fetched_bytes(seaweedfs, tmp_path, monkeypatch):
    """With no room in the fetch budget, ``read_ahead`` is the limit again (groups larger than the budget):
    3 groups held, still fetched in one GET (they start together)."""
    write_corpus(str(tmp_path), LAYOUT)
    url = seaweedfs.upload(str(tmp_path), "remote-read-ahead", "bounded")
    monkeypatch.setattr(delivery, "READ_AHEAD_FETCH_BYTES", 0)
    with faulty_proxy(seaweedfs.endpoint_url) as proxy:
        gets, held, ids = gets_before_the_first_group_is_consumed(url, via(proxy, seaweedfs), proxy)
    assert (gets, held) == (1, 3)
    assert sorted(ids) == list(range(8_000))


def test_local_disk_reads_ahead_read_ahead_groups_only(tmp_path):
    """A local read costs no round trip: no reads past ``read_ahead`` (1 + 2 held)."""
    write_corpus(str(tmp_path), LAYOUT)
    seen = []
    ds = ss.ParquetStream(str(tmp_path), columns=["id"], batch_size=10, rank=0, world_size=1)
    ds.stats_hook = seen.append
    ds.set_epoch(0)
    ids = [int(i) for b in ds for i in b["id"][b["sample_id"] >= 0]]
    assert seen[-1].most_reads_held == 3
    assert sorted(ids) == list(range(8_000))


FORK_SCRIPT = """
import os, sys, threading
import streamshard as ss
assert "pandas" not in sys.modules, "imported before set_epoch: the test proves nothing"
ds = ss.ParquetStream(sys.argv[1], columns=["id"], rank=0, world_size=1)
ds.set_epoch(0)
warming = any(t.name == "streamshard-arrow-warm-up" and t.is_alive() for t in threading.enumerate())
pid = os.fork()
if pid == 0:  # the child must hold the whole import (its module locks were not held by a thread it lacks)
    pandas = sys.modules.get("pandas")
    os._exit(0 if pandas is not None and hasattr(pandas, "DataFrame") else 3)
_, status = os.waitpid(pid, 0)
print(warming, os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow
def test_set_epoch_leaves_the_pandas_import_to_the_background_and_a_fork_waits_for_it(tmp_path):
    """``set_epoch`` used to make pyarrow's first ``pa.array()`` (its pandas import, 0.15-0.5 s) before
    returning, so thread workers sent their first reads only after it; now it runs in the background, and
    a fork (forked DataLoader workers) waits for it, so the child inherits the whole import."""
    pytest.importorskip("pandas")
    write_corpus(str(tmp_path), [[30, 20]])
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0"], done.stdout
