"""Read-ahead is bounded in bytes as well as in reads (issue 25 item 4: several huge row groups per worker).

``read_ahead`` counts reads; a worker whose next reads are huge row groups would otherwise hold
``read_ahead`` more of them. These tests scale the byte budget down (``READ_AHEAD_BYTES``) to a few
3 MB groups instead of writing 200 MB ones, and observe when each group's read starts.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.streams import delivery

ROWS = 400_000  # per file, one row group: random int64, 3.2 MB compressed (not "surely small"), ~3.3 MB decoded
BATCH = 100_000  # 4 batches per group


def write_groups(path, files: int = 4) -> None:
    rng = np.random.default_rng(0)
    for f in range(files):
        x = rng.integers(0, 2**62, ROWS, dtype=np.int64)
        pq.write_table(pa.table({"x": x}), f"{path}/part-{f}.parquet", row_group_size=ROWS)


def read_starts(path, monkeypatch, **kwargs):
    """For each row group read, how many batches the consumer had taken when the read began; the
    batches; the last delivery stats."""
    taken, starts, lock = [0], {}, threading.Lock()
    ds = ss.ParquetStream(str(path), columns=["x"], rank=0, world_size=1, batch_size=BATCH, **kwargs)
    inner = ds._read_part

    def recording(reader, what):
        with lock:
            starts.setdefault(int(what.rg), taken[0])
        return inner(reader, what)

    monkeypatch.setattr(ds, "_read_part", recording)
    seen = []
    ds.stats_hook = seen.append
    ds.set_epoch(0)
    batches = []
    for batch in ds:
        batches.append(batch)
        taken[0] += 1
    return [starts[g] for g in sorted(starts)], batches, seen[-1]


def test_huge_groups_are_not_read_ahead_beyond_the_byte_budget(tmp_path, monkeypatch):
    """With a budget of 1.5 groups, the next group is read only once its batches are due (on the old
    code, two groups were read ahead before the first batch: starts 0, 0, 0, 4-6); the batches are
    the same as with the default budget, where read_ahead=2 keeps two groups in flight."""
    write_groups(tmp_path)
    free_starts, free_batches, free_stats = read_starts(tmp_path, monkeypatch, read_ahead=2)
    # small enough groups keep their full read-ahead: the next two are read before their batches are due
    assert free_starts[1] < 4 and free_starts[2] < 8, free_starts

    monkeypatch.setattr(delivery, "READ_AHEAD_BYTES", 5_000_000, raising=False)  # 1.5 groups decoded
    starts, batches, stats = read_starts(tmp_path, monkeypatch, read_ahead=2)
    assert starts == [0, 4, 8, 12], f"groups read ahead beyond the byte budget: reads began at batches {starts}"
    assert free_stats.most_reads_held == 3 and stats.most_reads_held == 1
    assert 3_200_000 <= stats.most_held_bytes <= 3_500_000  # one group's estimate
    assert len(batches) == len(free_batches) == 16
    for a, b in zip(batches, free_batches):  # only timing changed
        assert a.keys() == b.keys()
        for key in a:
            assert np.array_equal(a[key].numpy(), b[key].numpy())


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_budget_of_two_groups_reads_one_ahead(tmp_path, monkeypatch, shuffle):
    """2.5 groups of budget: the current group and one ahead (read_ahead=2 would read two), shuffled
    or not; each row still arrives once."""
    write_groups(tmp_path)
    monkeypatch.setattr(delivery, "READ_AHEAD_BYTES", 8_500_000, raising=False)
    starts, batches, stats = read_starts(tmp_path, monkeypatch, read_ahead=2, shuffle=shuffle, shuffle_window=1)
    starts = sorted(starts)  # shuffled, the groups come in another order
    assert starts[1] < 4, starts  # one group read ahead...
    assert all(s >= 4 * (k - 1) for k, s in enumerate(starts)), starts  # ... not two (old code: 0, 0, 0, 4)
    assert stats.most_reads_held == 2
    ids = np.sort(np.concatenate([b["sample_id"].numpy() for b in batches]))
    assert np.array_equal(ids[ids >= 0], np.arange(4 * ROWS))


def test_a_blend_weighs_its_reads_too(tmp_path, monkeypatch):
    """A blend's reads are weighed too (each corpus's reader estimates its groups), and a budget below
    one group changes no batch. (Here a blend's blocks already hold 4 reads at once, so the bound does
    not show in how many are held.)"""
    from streamshard.streams.blend import BlendedStream

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_groups(tmp_path / name, files=3)

    def run():
        streams = {n: ss.ParquetStream(str(tmp_path / n), columns=["x"], seed=i) for i, n in enumerate("ab")}
        blend = BlendedStream(streams, {"a": 0.5, "b": 0.5}, batch_size=4_000, rank=0, world_size=1)
        seen = []
        blend.stats_hook = seen.append
        blend.set_epoch(0)
        digests = [{k: v.numpy().tobytes() for k, v in b.items()} for b in blend]
        return digests, seen[-1]

    free, free_stats = run()
    monkeypatch.setattr(delivery, "READ_AHEAD_BYTES", 1_000_000, raising=False)
    bounded, stats = run()
    assert stats.most_held_bytes >= 3_200_000 * stats.most_reads_held  # each read weighed, ~3.3 MB a group
    assert stats.most_reads_held <= free_stats.most_reads_held
    assert bounded == free


def test_a_group_is_weighed_without_fetching_a_footer_the_process_lacks(tmp_path):
    """A restart over object storage with a catalog cache holds no footer: weighing a group for read-ahead
    must not fetch one on the consumer's thread (one round trip per file, serially, before any read); it is
    weighed from its compressed bytes. A footer at hand (this reader's, or this process's earlier readers')
    gives the footer's estimate."""
    from streamshard.io import footer
    from streamshard.io.reader import RowGroupReader

    write_groups(tmp_path, files=2)
    catalog = ss.Catalog.build(str(tmp_path))
    footer.SHARED_FOOTERS.clear()
    reader = RowGroupReader.from_catalog(catalog, None, columns=["x"])
    compressed = int(np.sum(catalog.file_sizes)) // 2
    guess = reader.decoded_estimate(0, 0)
    assert reader.stats.footers_fetched == 0 and reader.stats.footers_shared == 0
    assert 0.8 * 4 * compressed < guess <= 4 * compressed  # the group's chunks, not its whole file
    reader.read(0, 0)  # the read brings the footer
    assert reader.decoded_estimate(0, 0) == pytest.approx(ROWS * 8, rel=0.2)
    other = RowGroupReader.from_catalog(catalog, None, columns=["x"])
    assert other.decoded_estimate(0, 0) == pytest.approx(ROWS * 8, rel=0.2)  # this process's footer
    assert other.stats.footers_fetched == 0
    reader.close()
    other.close()
