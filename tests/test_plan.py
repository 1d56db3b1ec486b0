"""Property tests of the pure planner: exactly once, equal steps, bounded padding, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from streamshard.plan.epoch_plan import EpochPlan, Layout, PlanConfig

from strategies import PROPERTY, configs, layouts, make_layout


def worker_intervals(plan: EpochPlan, worker: int, delivered_only: bool) -> list[tuple[int, int]]:
    """Global sample-id intervals a worker delivers (or is assigned, when not delivered_only)."""
    pieces = plan.worker_plan(worker).pieces if delivered_only else plan.pieces(worker)
    first = plan.layout.rg_first_id[pieces.rg]
    return [(int(a), int(b)) for a, b in zip(first + pieces.lo, first + pieces.hi)]


def assert_tiles(intervals: list[tuple[int, int]], total: int, layout: Layout) -> None:
    """The intervals cover every row of every non-empty row group exactly once."""
    intervals = sorted(intervals)
    covered = sum(b - a for a, b in intervals)
    assert covered == total
    for (a0, b0), (a1, b1) in zip(intervals, intervals[1:]):
        assert b0 <= a1, f"overlap: {(a0, b0)} and {(a1, b1)}"
    assert all(b > a for a, b in intervals), "empty piece planned"


@PROPERTY
@given(files=layouts, world=st.integers(1, 16), workers=st.integers(0, 8), config=configs, epoch=st.integers(0, 3))
def test_every_row_is_read_by_exactly_one_worker_and_steps_are_equal(files, world, workers, config, epoch):
    layout = make_layout(files)
    g = world * max(workers, 1)
    plan = EpochPlan(layout, config, epoch, g)
    total = int(layout.rg_rows.sum())

    read = [iv for w in range(g) for iv in worker_intervals(plan, w, delivered_only=False)]
    assert_tiles(read, total, layout)

    plans = [plan.worker_plan(w) for w in range(g)]
    assert {p.steps for p in plans} == {plan.steps}
    real = np.array([p.real_batches for p in plans])
    assert np.all(real <= plan.steps)
    # Blocks are balanced by rows: sizes differ by at most one.
    sizes = np.array([int(plan.pieces(w).rows.sum()) for w in range(g)])
    assert sizes.max() - sizes.min() <= 1
    if config.uneven == "pad":
        assert sum(p.rows for p in plans) == total  # nothing dropped
        if total:
            assert real.max() == plan.steps  # padding no more than balancing needs
        if config.batch_size is not None:
            assert np.all(plan.steps - real <= 1)
            assert np.all(real == -(-sizes // config.batch_size))
        else:
            assert np.all(real == np.array([len(plan.pieces(w)) for w in range(g)]))
    else:
        delivered = [iv for w in range(g) for iv in worker_intervals(plan, w, delivered_only=True)]
        kept = sum(b - a for a, b in delivered)
        assert kept + plan.dropped_rows() == total
        assert kept == sum(p.rows for p in plans)
        assert np.all(real == plan.steps)  # every worker truncated to the same count
        if config.batch_size is not None:
            assert all(p.rows == plan.steps * config.batch_size for p in plans)


@PROPERTY
@given(files=layouts, g=st.integers(1, 64), config=configs, epoch=st.integers(0, 3))
def test_plans_are_deterministic_and_vectorised_counts_match(files, g, config, epoch):
    layout = make_layout(files)
    a, b = EpochPlan(layout, config, epoch, g), EpochPlan(layout, config, epoch, g)
    for w in range(g):
        pa_, pb = a.pieces(w), b.pieces(w)
        for x, y in ((pa_.rg, pb.rg), (pa_.lo, pb.lo), (pa_.hi, pb.hi)):
            np.testing.assert_array_equal(x, y)
    counts = a.pieces_per_worker()
    assert [len(a.pieces(w)) for w in range(g)] == counts.tolist()


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 3000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 5))
def test_rows_of_a_row_group_are_emitted_in_a_permutation_split_consistently(n, seed, epoch):
    plan = EpochPlan(make_layout([[n]]), PlanConfig(shuffle=True, seed=seed), epoch, 1)
    order = plan.row_positions(0, 0, n)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    cut = n // 3
    np.testing.assert_array_equal(np.concatenate([plan.row_positions(0, 0, cut), plan.row_positions(0, cut, n)]), order)


def test_shuffle_changes_with_epoch_and_seed_but_not_without_shuffle():
    layout = make_layout([[10] * 50])
    def order(epoch=0, **kw):
        return EpochPlan(layout, PlanConfig(**kw), epoch, 4).stream.rg

    base = order(shuffle=True, seed=1)
    assert not np.array_equal(base, order(1, shuffle=True, seed=1))
    assert not np.array_equal(base, order(shuffle=True, seed=2))
    np.testing.assert_array_equal(order(shuffle=False), np.arange(50))


def test_file_unit_keeps_each_files_row_groups_together():
    layout = make_layout([[5, 5, 5], [7, 7], [1], [2, 2, 2, 2]])
    for seed in range(20):
        plan = EpochPlan(layout, PlanConfig(unit="file", shuffle=True, seed=seed), 0, 1)
        files = layout.rg_file[plan.stream.rg]
        assert len(np.flatnonzero(np.diff(files))) == len(set(files.tolist())) - 1
    in_file_orders = {
        tuple(EpochPlan(layout, PlanConfig(unit="file", shuffle=True, seed=seed), 0, 1).stream.rg[layout.rg_file[
            EpochPlan(layout, PlanConfig(unit="file", shuffle=True, seed=seed), 0, 1).stream.rg] == 0])
        for seed in range(20)
    }
    assert len(in_file_orders) > 1  # row groups inside a file are shuffled too


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"unit": "rowgroup"}, "unit"),
        ({"uneven": "wrap"}, "uneven"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -3}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"seed": -1}, "seed"),
        ({"shuffle_window": 0}, "shuffle_window"),
        ({"shuffle_window": 2}, "shuffle=True"),
    ],
)
def test_bad_config_is_rejected_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlanConfig(**kwargs)


def test_planning_scales_without_per_worker_state():
    layout = Layout(np.full(200_000, 1000, dtype=np.int64), np.arange(200_000, dtype=np.int64) // 10)
    plan = EpochPlan(layout, PlanConfig(shuffle=True, batch_size=512), 0, 80_000)
    pieces = plan.pieces(12_345)
    assert int(pieces.rows.sum()) == 2500 and len(pieces) <= 4 and plan.steps == 5


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.integers(1, 300), min_size=1, max_size=6), seed=st.integers(0, 2**32), cut=st.floats(0, 1))
def test_window_interleave_keeps_each_piece_in_order_and_splits_into_segments(rows, seed, cut):
    layout = make_layout([rows])
    plan = EpochPlan(layout, PlanConfig(shuffle=True, seed=seed, shuffle_window=len(rows)), 0, 1)
    pieces = plan.worker_plan(0).pieces
    labels = plan.window_labels(pieces)
    assert np.array_equal(np.bincount(labels, minlength=len(pieces)), pieces.rows)
    taken = int(cut * len(labels))
    done, rest = plan.split_delivered(pieces, taken)
    assert int(done.rows.sum()) == taken and int(rest.rows.sum()) == len(labels) - taken
    for p in range(len(pieces)):  # a prefix of the window is a prefix of every piece
        assert int(done.rows[done.rg == pieces.rg[p]].sum()) == int(np.sum(labels[:taken] == p))


@PROPERTY
@given(files=layouts, world=st.integers(1, 6), workers=st.integers(0, 4), config=configs, epoch=st.integers(0, 2))
def test_the_schedules_of_all_workers_deliver_each_row_once_in_equal_uniform_steps(files, world, workers, config, epoch):
    from streamshard.plan.batch_plan import StreamSchedule

    layout = make_layout(files)
    plan = EpochPlan(layout, config, epoch, world * max(workers, 1))
    ids, sizes = [], set()
    for g in range(plan.num_workers):
        schedule = StreamSchedule(plan, g)
        assert schedule.steps == plan.steps
        specs = list(schedule.batches())
        assert len(specs) == plan.steps
        for spec in specs:
            assert len(spec.row) == len(spec.read) == len(spec.sample_id)
            assert set(spec.read.tolist()) == set(spec.reads), "a row names a read the batch does not list"
            rg = np.array([spec.reads[int(k)].rg for k in spec.read], dtype=np.int64)
            assert np.all((spec.row >= 0) & (spec.row < layout.rg_rows[rg]))
            np.testing.assert_array_equal(spec.sample_id, layout.rg_first_id[rg] + spec.row)
            if config.batch_size is not None:
                sizes.add(spec.size)
        ids.append(schedule.sample_ids())
        released = [k for spec in specs for k in spec.done]
        assert len(released) == len(set(released)), "a read released twice"
    delivered = np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
    assert len(np.unique(delivered)) == len(delivered), "a row delivered twice"
    if config.uneven == "pad":
        np.testing.assert_array_equal(delivered, np.arange(int(layout.rg_rows.sum())))
    else:
        assert len(delivered) == plan.total_rows - plan.dropped_rows()
    if config.batch_size is not None and plan.steps:
        assert sizes == {config.batch_size}, "every batch (padding included) holds batch_size rows"


@PROPERTY
@given(files=layouts, config=configs, epoch=st.integers(0, 2))
def test_one_worker_without_a_window_delivers_each_piece_in_its_row_order(files, config, epoch):
    """An independent reference: pieces in order, each piece's rows in the row group's emitted order."""
    from streamshard.plan.batch_plan import StreamSchedule

    assume(config.shuffle_window == 1)
    layout = make_layout(files)
    plan = EpochPlan(layout, config, epoch, 1)
    pieces = plan.worker_plan(0).pieces
    parts = [layout.rg_first_id[rg] + plan.row_positions(rg, lo, hi) for rg, lo, hi in zip(pieces.rg, pieces.lo, pieces.hi)]
    expected = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    np.testing.assert_array_equal(StreamSchedule(plan, 0).sample_ids(), expected)


@PROPERTY
@given(files=layouts, workers=st.integers(1, 6), config=configs, epoch=st.integers(0, 2), data=st.data())
def test_upcoming_reads_name_exactly_the_reads_the_remaining_batches_use(files, workers, config, epoch, data):
    """What read-ahead fetches without building specs (``upcoming_reads``) is every read the batches
    from ``start`` on use, once each, and the same read as the batch names."""
    from streamshard.plan.batch_plan import StreamSchedule

    plan = EpochPlan(make_layout(files), config, epoch, workers)
    schedule = StreamSchedule(plan, data.draw(st.integers(0, workers - 1)))
    start = data.draw(st.integers(0, max(schedule.steps, 0)))
    used = {}
    for spec in schedule.batches(start):
        for key, read in spec.reads.items():
            used.setdefault(key, read)
    upcoming = list(schedule.upcoming_reads(start))
    assert [k for k, _ in upcoming] == sorted({k for k, _ in upcoming})  # once each, in piece order
    assert {k for k, _ in upcoming} == set(used)
    for key, read in upcoming:
        assert read == used[key]
        assert (read.rows is None) == (used[key].rows is None)
        assert read.rows is None or np.array_equal(read.rows, used[key].rows)


@given(layout=layouts, seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 3), cache=st.sampled_from([64, 4096, 1 << 21]),
       data=st.data())
@PROPERTY
def test_kept_row_orders_give_the_rows_of_the_row_groups_own_permutation(layout, seed, epoch, cache, data):
    """Row orders kept between batches (evicted as they age, bypassed for huge groups) never change
    which row an emitted position reads."""
    import streamshard.plan.epoch_plan as plan_module
    from streamshard.plan.permutation import Permutation, mix_seed

    lay = make_layout(layout)
    assume(lay.rg_rows.sum() > 0)
    groups = np.flatnonzero(lay.rg_rows)
    kept, plan_module._ROW_ORDER_CACHE = plan_module._ROW_ORDER_CACHE, cache
    try:
        plan = EpochPlan(lay, PlanConfig(shuffle=True, seed=seed), epoch, 1)  # its cache takes the bound
        for _ in range(data.draw(st.integers(1, 6))):  # batch after batch, a few rows of a few groups each
            rg = np.array(data.draw(st.lists(st.sampled_from(groups.tolist()), min_size=1, max_size=30)), dtype=np.int64)
            positions = np.array([data.draw(st.integers(0, int(lay.rg_rows[g]) - 1)) for g in rg], dtype=np.int64)
            want = [Permutation(int(lay.rg_rows[g]), mix_seed(seed, epoch, plan_module._ROW_ORDER, int(g)))[int(p)]
                    for g, p in zip(rg, positions)]
            assert plan.rows_at(rg, positions).tolist() == want
    finally:
        plan_module._ROW_ORDER_CACHE = kept
