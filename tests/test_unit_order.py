"""The shuffled row-group order spreads each file over the epoch, so a shuffle window mixes files."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.batch_plan import StreamSchedule
from streamshard.plan import EpochPlan, Layout, PlanConfig, stream_order
from streamshard.unit_order import spread_order


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), max_size=12), min_size=1, max_size=30), st.integers(0, 2**64 - 1),
       st.integers(0, 2**64 - 1))
def test_spread_order_visits_every_row_group_once(files, in_file_key, offset_key):
    rows = np.array([r for f in files for r in f], dtype=np.int64)
    rg_file = np.array([i for i, f in enumerate(files) for _ in f], dtype=np.int64)
    order = spread_order(rows, rg_file, len(files), in_file_key, offset_key)
    assert sorted(order.tolist()) == list(range(len(rows)))
    assert np.array_equal(order, spread_order(rows, rg_file, len(files), in_file_key, offset_key))


def _top_file_share(batches: list[np.ndarray], file_of_row: np.ndarray, files: int) -> tuple[float, float]:
    shares = [np.bincount(file_of_row[ids], minlength=files).max() / len(ids) for ids in batches]
    single = sum(np.count_nonzero(np.bincount(file_of_row[ids], minlength=files)) == 1 for ids in batches)
    return float(np.mean(shares)), single / len(batches)


def test_a_corpus_sorted_by_topic_mixes_within_twice_a_full_shuffle_at_the_default_window():
    """One topic per file (32 files x 8 row groups x 200 rows), batches of 128, 2 global workers, the
    window ParquetStream uses by default (16): no single-file batch, and the mean share of a batch taken
    by its most common file is at most 2x that of a full random permutation, for every seed tried."""
    files, groups, rows, batch = 32, 8, 200, 128
    layout = Layout(np.full(files * groups, rows, dtype=np.int64), np.repeat(np.arange(files), groups).astype(np.int64))
    file_of_row = np.repeat(np.arange(files * groups), rows) // groups
    perm = np.random.default_rng(0).permutation(len(file_of_row))
    full, _ = _top_file_share([perm[i:i + batch] for i in range(0, len(perm) - batch + 1, batch)], file_of_row, files)
    for seed in range(5):
        plan = EpochPlan(layout, PlanConfig(shuffle=True, seed=seed, batch_size=batch, shuffle_window=16), 0, 2)
        batches = [spec.sample_id for w in range(2) for spec in StreamSchedule(plan, w).batches() if spec.rows == batch]
        share, single = _top_file_share(batches, file_of_row, files)
        assert single == 0, f"seed {seed}: {single:.1%} of batches from one file"
        assert share <= 2 * full, f"seed {seed}: top-file share {share:.3f} > 2 x full shuffle's {full:.3f}"


def test_each_file_is_spread_over_the_epoch_not_bunched():
    """Every quarter of the epoch's row groups holds a quarter of each file's (within one)."""
    files, groups = 10, 8
    layout = Layout(np.full(files * groups, 100, dtype=np.int64), np.repeat(np.arange(files), groups).astype(np.int64))
    for epoch in range(3):
        order = stream_order(layout, PlanConfig(shuffle=True, seed=7), epoch)
        for quarter in np.array_split(order, 4):
            counts = np.bincount(layout.rg_file[quarter], minlength=files)
            assert counts.min() >= groups // 4 - 1 and counts.max() <= groups // 4 + 1, (epoch, counts)
