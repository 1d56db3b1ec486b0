"""Read-ahead keeps its row groups in flight however many batches away they start."""

from __future__ import annotations

import threading
import time

import pytest

import streamshard as ss
from streamshard.testing import write_corpus


def reads_started_after_first_batch(path, **kwargs):
    seen = []
    ds = ss.ParquetStream(path, columns=["id"], rank=0, world_size=1, **kwargs)
    ds.stats_hook = seen.append
    ds.set_epoch(0)
    batches = iter(ds)
    first = next(batches)
    deadline = time.monotonic() + 10
    while seen[-1].reads.row_groups_read < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # and no more than asked for arrives later
    read = seen[-1].reads.row_groups_read
    rest = list(batches)
    ids = [int(i) for b in [first] + rest for i in b["id"][b["sample_id"] >= 0]]
    return read, ids


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_next_row_groups_are_read_while_the_first_one_is_delivered(tmp_path, shuffle):
    """4 row groups of 5,000 rows in batches of 16: the next row group starts 313 batches away.
    With read_ahead=2 the two after the first are read at once (they were not, past 64 batches)."""
    write_corpus(str(tmp_path), [[5_000] * 4])
    read, ids = reads_started_after_first_batch(str(tmp_path), batch_size=16, read_ahead=2, shuffle=shuffle,
                                                shuffle_window=1)
    assert read == 3, f"{read} row groups read by the first batch: read-ahead did not reach the next ones"
    assert sorted(ids) == list(range(20_000))  # and each row still arrives once


def test_a_shuffle_windows_row_groups_are_read_at_once_whatever_read_ahead(tmp_path, monkeypatch):
    """A shuffled batch draws from every row group of its window, so all of them are needed before
    the first batch: they are read concurrently, not ``read_ahead`` at a time (on object storage,
    one round trip per ``read_ahead`` reads)."""
    from streamshard.io.reader import RowGroupReader

    write_corpus(str(tmp_path), [[500] * 4] * 4)  # 16 row groups: one shuffle window
    inner = RowGroupReader.read
    lock, running, most = threading.Lock(), [0], [0]

    def slow_read(self, *args, **kwargs):  # a store with ~0.2 s per request
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.2)
            return inner(self, *args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(RowGroupReader, "read", slow_read)
    ds = ss.ParquetStream(str(tmp_path), columns=["id"], rank=0, world_size=1, batch_size=64, read_ahead=1,
                          shuffle=True, shuffle_window=16)
    ds.set_epoch(0)
    ids = [int(i) for b in ds for i in b["id"][b["sample_id"] >= 0]]
    assert sorted(ids) == list(range(8_000))
    assert most[0] >= 16, f"at most {most[0]} of the window's 16 row groups were read at once"
