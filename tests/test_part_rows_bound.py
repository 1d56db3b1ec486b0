"""A schedule keeps the owned-row numbers of the partial row groups it reads under a bound
(``batch_plan._PART_ROWS_HELD``), and a bound small enough to evict reads a shuffle window still
uses changes nothing that is delivered: every row once, the same batches, the same batches on resume.

The held numbers are observed from outside the schedule: the ``Read``s its batches name are tracked
by weak reference, so what is still alive between batches is what the schedule keeps.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest

from streamshard.plan import batch_plan
from streamshard.plan.batch_plan import StreamSchedule
from streamshard.plan.elastic import Segment, resume_plan
from streamshard.plan.epoch_plan import EpochPlan, PlanConfig

from strategies import make_layout

LAYOUT = make_layout([[500] * 4 for _ in range(6)])  # 24 row groups of 500 rows
CONFIG = PlanConfig(shuffle=True, seed=7, batch_size=50, shuffle_window=8)
FIRST = Segment(world_size=8, num_workers=1, batches=3)  # then resumed on one worker
BOUND = 2_000  # owned-row numbers: about four of the resumed stream's partial reads, half a window's


def resumed() -> EpochPlan:
    """The rest of the epoch after 8 workers delivered 3 batches each, on one worker: each of them
    took a prefix of every piece of its first window, so every piece left is part of a row group."""
    plan, done = resume_plan(LAYOUT, CONFIG, 0, [FIRST], 1, 1)
    assert done == 0 and bool((plan.stream.lo > 0).all())
    return plan


def deliver(schedule: StreamSchedule, start: int = 0) -> tuple[list[tuple], int, int]:
    """Batches ``start..`` as plain values, the most owned-row numbers the schedule held between two
    batches (after each), and the owned-row numbers of every partial read the batches named."""
    tracked: list[weakref.ref] = []
    batches, most, named = [], 0, 0
    for index in range(start, schedule.steps):
        spec = schedule.batch(index)
        batches.append((spec.index, spec.sample_id.tolist(), spec.row.tolist(), spec.read.tolist(), spec.padding,
                        spec.done, [(k, r.rg, None if r.rows is None else r.rows.tolist()) for k, r in spec.reads.items()]))
        seen = {id(ref()) for ref in tracked}
        for read in spec.reads.values():
            if read.rows is not None and id(read) not in seen:
                tracked.append(weakref.ref(read))
                named += len(read.rows)
        spec = read = None  # only the schedule keeps reads now
        most = max(most, held(tracked))
    return batches, most, named


def held(tracked: list[weakref.ref]) -> int:
    alive = {id(read): read for read in (ref() for ref in tracked) if read is not None}
    if len(alive) <= 1:  # one read is always kept, however large
        return 0
    return sum(len(read.rows) for read in alive.values())


def test_a_schedule_holds_at_most_the_bound_of_owned_rows_and_delivers_the_same_batches(monkeypatch):
    reference, _, _ = deliver(StreamSchedule(resumed(), 0))  # the default bound (16 MiB) keeps every read here
    monkeypatch.setattr(batch_plan, "_PART_ROWS_HELD", BOUND)
    plan = resumed()
    batches, most, named = deliver(StreamSchedule(plan, 0))
    assert named > 4 * BOUND  # the bound binds: unbounded, the schedule would keep far more
    assert most <= BOUND
    assert batches == reference

    first = EpochPlan(LAYOUT, CONFIG, 0, FIRST.global_workers)
    before = [StreamSchedule(first, w).batch(i).sample_id for w in range(first.num_workers) for i in range(FIRST.batches)]
    after = [np.array(ids, dtype=np.int64) for _, ids, *_ in batches]
    delivered = np.sort(np.concatenate(before + after))
    np.testing.assert_array_equal(delivered, np.arange(int(LAYOUT.rg_rows.sum())))  # every row exactly once


@pytest.mark.parametrize("stop", [1, 37, 120])  # inside the first window, mid-epoch, near the end
def test_resuming_a_schedule_under_the_bound_gives_the_rest_of_the_same_batches(monkeypatch, stop):
    monkeypatch.setattr(batch_plan, "_PART_ROWS_HELD", BOUND)
    uninterrupted, _, _ = deliver(StreamSchedule(resumed(), 0))
    schedule = StreamSchedule(resumed(), 0)  # a new process: nothing kept
    upcoming = [(key, read.rg, read.rows.tolist()) for key, read in schedule.upcoming_reads(stop)]
    rest, most, _ = deliver(schedule, stop)
    assert rest == uninterrupted[stop:]
    assert most <= BOUND
    used = {(key, rg, tuple(rows)) for *_, reads in rest for key, rg, rows in reads}
    assert {(key, rg, tuple(rows)) for key, rg, rows in upcoming} == used  # read-ahead names the same reads
