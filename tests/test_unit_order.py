"""The shuffled row-group order spreads each file over the epoch, so a shuffle window mixes files."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.plan.batch_plan import StreamSchedule
from streamshard.plan.epoch_plan import EpochPlan, Layout, PlanConfig, stream_order
from streamshard.plan.unit_order import WINDOW_BALANCE, WINDOW_MAX_PIECES, WINDOW_MAX_ROWS, spread_order, window_starts


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


@pytest.mark.parametrize("sizes", ["uniform", "skewed"])
def test_a_corpus_sorted_by_topic_mixes_within_twice_a_full_shuffle_at_the_default_window(sizes):
    """One topic per file (32 files x 8 row groups of 200 rows, or of 3..2,048 rows as real exports
    have), batches of 128, 2 global workers, the window ParquetStream uses by default (16): no
    single-file batch, and the mean share of a batch taken by its most common file is at most 2x that
    of a full random permutation, for every seed tried."""
    files, groups, batch = 32, 8, 128
    if sizes == "uniform":
        rows = np.full(files * groups, 200, dtype=np.int64)
    else:  # 16 of these in a window give their largest a median share of ~1/9: 2.3x before windows grew
        rows = np.random.default_rng(3).integers(3, 2049, files * groups).astype(np.int64)
    layout = Layout(rows, np.repeat(np.arange(files), groups).astype(np.int64))
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5_000), max_size=120), st.integers(1, 20), st.floats(1.0, 3_000.0))
def test_shuffle_windows_cover_every_piece_once_and_stay_bounded(rows, window, mean_rows):
    rows = np.array(rows, dtype=np.int64)
    starts = window_starts(rows, window, mean_rows)
    assert starts[0] == 0 and starts[-1] == len(rows) and np.all(np.diff(starts) > 0)  # a partition, in order
    assert np.array_equal(starts, window_starts(rows, window, mean_rows))
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        part = rows[a:b]
        last = b == len(rows)
        assert len(part) >= window or last  # never fewer pieces than asked, but at the end
        if window == 1:
            assert len(part) == 1
            continue
        assert len(part) <= WINDOW_MAX_PIECES * window
        # it closes at the first piece where it is balanced or at a bound: one piece earlier it was neither
        if len(part) > window:
            before = part[:-1]
            assert before.sum() < WINDOW_BALANCE * window * before.max()
            assert before.sum() < WINDOW_MAX_ROWS * window * mean_rows
        if not last:
            balanced = part.sum() >= WINDOW_BALANCE * window * part.max()
            assert balanced or part.sum() >= WINDOW_MAX_ROWS * window * mean_rows or len(part) == WINDOW_MAX_PIECES * window


def test_a_dominating_row_group_widens_its_window_and_uniform_ones_do_not():
    uniform = np.full(64, 1_000, dtype=np.int64)
    assert window_starts(uniform, 16, 1_000.0).tolist() == [0, 16, 32, 48, 64]
    skewed = uniform.copy()
    skewed[3] = 4_000  # 16 pieces would give it 4,000 / 19,000 of the rows: more than 1 / (0.75 * 16)
    starts = window_starts(skewed, 16, float(skewed.mean()))
    # it grows until the rows of 1.5 x 16 average row groups (what bounds memory), diluting the big one
    assert starts[1] == 23 and skewed[:23].sum() >= WINDOW_MAX_ROWS * 16 * skewed.mean() > skewed[:22].sum()
    assert rows_share(skewed[:23]) < 0.75 * rows_share(skewed[:16])
    assert starts[2:].tolist() == [39, 55, 64]  # then plain windows again


def rows_share(part: np.ndarray) -> float:
    return float(part.max() / part.sum())
