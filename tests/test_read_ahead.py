"""Read-ahead keeps its row groups in flight however many batches away they start."""

from __future__ import annotations

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
