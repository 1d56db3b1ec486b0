"""Stage plans of a packed text epoch (``packing_stages.py``): planned stage by stage, counted stage by
stage, and still every token once in stream order, equal steps, padding of one plan, exact and
elastic resume, and the same batches warm (all counted) as cold (counted when reached)."""

from __future__ import annotations

import numpy as np
import pytest

from streamshard.plan.elastic import Segment
from streamshard.errors import StateError
from streamshard.plan.packing_stages import StageCounts, StagedPlanner, Stages, StagePlans
from streamshard.plan.epoch_plan import Layout, PlanConfig, stream_order
from streamshard.plan.resume import Position

Q = 12  # tokens per batch (batch_size x seq_len)


def corpus(seed: int, units: int = 40):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 60, units)
    tokens[rng.random(units) < 0.15] = 0  # units whose texts give no tokens
    rg_file = np.sort(rng.integers(0, 6, units))
    docs = rng.integers(1, 9, units)
    return tokens.astype(np.int64), rg_file.astype(np.int64), docs.astype(np.int64)


def planner(tokens, rg_file, docs, *, first=40.0, shuffle=True, known=True, calls=None):
    config = PlanConfig(shuffle=shuffle, seed=5, batch_size=Q, uneven="pad", shuffle_rows=False)
    doc_config = PlanConfig(shuffle=shuffle, seed=5)

    def stages(epoch):  # from the documents only: what the catalog knows before counting
        return Stages.split(stream_order(Layout(docs, rg_file), doc_config, epoch), docs * 10, first)

    def count(units):
        if calls is not None:
            calls.append(units.tolist())
        return tokens[units]

    counts = StageCounts(rg_file, count, tokens if known else None)
    return StagedPlanner(stages, counts, config)


def rank_batches(p: StagedPlanner, position: Position, rank: int, world: int, n: int, limit: int | None = None):
    """Rank ``rank``'s batches from ``position`` (round robin over its ``n`` workers), as lists of (rg, token)."""
    starts = [p.start(position.epoch, position, rank, world, w, n) for w in range(max(n, 1))]
    total = p.rank_batches(position.epoch, position, world, n) if limit is None else limit
    out = []
    for t in range(total):
        s = starts[t % max(n, 1)]
        spec = s.schedule.batch(s.start + t // max(n, 1))
        rgs = np.array([spec.reads[k].rg for k in spec.read.tolist()], dtype=np.int64)
        out.append((list(zip(rgs.tolist(), spec.row.tolist())), spec.padding))
    return out


def all_tokens(tokens):
    return {(rg, i) for rg, t in enumerate(tokens.tolist()) for i in range(t)}


def test_stages_cover_the_order_and_grow():
    order = np.random.default_rng(0).permutation(100).astype(np.int64)
    weights = np.full(100, 3.0)
    stages = Stages.split(order, weights, first=6.0, growth=2.0)
    assert np.array_equal(np.concatenate([stages.units(k) for k in range(len(stages))]), order)
    sizes = np.diff(stages.bounds).tolist()
    assert sizes[:4] == [2, 4, 8, 16]  # 6, 12, 24, 48 weight: 2, 4, 8, 16 units of 3
    assert all(s >= 1 for s in sizes)
    heavy = Stages.split(order, np.full(100, 1e9), first=1.0)  # a unit heavier than a stage: one unit each
    assert np.diff(heavy.bounds)[:20].tolist() == [1] * 20


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world,n", [(1, 0), (2, 2), (3, 1), (5, 2)])
def test_every_token_once_in_stream_order_equal_steps(seed, world, n):
    tokens, rg_file, docs = corpus(seed)
    p = planner(tokens, rg_file, docs, shuffle=seed % 2 == 0)
    G = world * max(n, 1)
    lengths, seen, padding = set(), [], 0
    per_worker = {}
    for rank in range(world):
        for w in range(max(n, 1)):
            start = p.start(0, Position(0), rank, world, w, n)
            lengths.add(start.schedule.steps)
            specs = list(start.schedule.batches())
            assert len(specs) == start.schedule.steps
            got = []
            for spec in specs:
                got += [(spec.reads[k].rg, r) for k, r in zip(spec.read.tolist(), spec.row.tolist())]
                padding += spec.padding
                assert spec.rows + spec.padding == Q
            per_worker[rank * max(n, 1) + w] = (got, specs)
            seen += got
    assert len(lengths) == 1  # equal steps for every global worker
    assert len(seen) == len(set(seen)) and set(seen) == all_tokens(tokens)
    assert padding < G * Q  # the padding of one plan: under one batch per global worker
    # The stream: plan by plan, worker by worker, is the units in stream order, each unit's tokens in order.
    stages = p.stages(0)
    expected = [(int(u), i) for u in stages.order.tolist() for i in range(int(tokens[u]))]
    plans = StagePlans(stages, p.counts, p.config, 0, G)
    plans.steps
    stream = []
    for j in range(len(plans.plans)):
        for g in range(G):
            got, specs = per_worker[g]
            local = [s for s in specs[plans.starts[j]:plans.starts[j + 1]]]
            stream += [(s.reads[k].rg, r) for s in local for k, r in zip(s.read.tolist(), s.row.tolist())]
    assert stream == expected


def test_cold_counts_only_the_stages_it_reaches_and_matches_warm():
    tokens, rg_file, docs = corpus(3, units=60)
    calls: list[list[int]] = []
    cold = planner(tokens, rg_file, docs, known=False, calls=calls)
    warm = planner(tokens, rg_file, docs)
    stages = cold.stages(0)
    first_batches = []
    for w in range(2):
        start = cold.start(0, Position(0), 0, 1, w, 2)
        first_batches.append(start.schedule.batch(0))
    reached = sorted(u for c in calls for u in c)
    assert reached and len(reached) < len(tokens)  # the first batches needed only the first stages counted
    assert set(reached) == set(np.concatenate([stages.units(k) for k in range(len(calls))]).tolist())
    for w in range(2):  # the same batches as with every count known
        both = [cold.start(0, Position(0), 0, 1, w, 2).schedule, warm.start(0, Position(0), 0, 1, w, 2).schedule]
        assert both[0].steps == both[1].steps
        for i in range(both[1].steps):
            a, b = both[0].batch(i), both[1].batch(i)
            assert a.padding == b.padding and np.array_equal(a.row, b.row)
            assert [a.reads[k].rg for k in a.read.tolist()] == [b.reads[k].rg for k in b.read.tolist()]
    assert sorted(u for c in calls for u in c) == list(range(len(tokens)))  # each unit counted once


def _plan_boundaries(p, world, n):
    plans = StagePlans(p.stages(0), p.counts, p.config, 0, world * max(n, 1))
    plans.steps
    return [s * max(n, 1) for s in plans.starts]


@pytest.mark.parametrize("seed", range(4))
def test_resume_same_topology_mid_stage_and_at_a_boundary(seed):
    tokens, rg_file, docs = corpus(seed, units=50)
    p = planner(tokens, rg_file, docs)
    world, n = 2, 2
    whole = [rank_batches(p, Position(0), r, world, n) for r in range(world)]
    bounds = _plan_boundaries(p, world, n)
    inner = [b for b in bounds if 0 < b < len(whole[0])]
    assert inner, "the corpus must give more than one plan"
    for k in {inner[0], inner[0] + 1, max(inner[0] - 3, 1), len(whole[0]) // 2}:
        position = Position(0, [Segment(world, n, k)])
        for r in range(world):
            assert rank_batches(p, position, r, world, n) == whole[r][k:]


@pytest.mark.parametrize("seed", range(4))
def test_elastic_2x2_to_3x1_and_on(seed):
    tokens, rg_file, docs = corpus(seed, units=50)
    p = planner(tokens, rg_file, docs)
    bounds = _plan_boundaries(p, 2, 2)
    steps = bounds[-1]
    for k in sorted({bounds[1], bounds[1] + 1, steps // 2, 1}):
        if not 0 < k < steps:
            continue
        before = [t for r in range(2) for b, _ in rank_batches(p, Position(0), r, 2, 2, limit=k) for t in b]
        position = Position(0, [Segment(2, 2, k)])
        after = [rank_batches(p, position, r, 3, 1) for r in range(3)]
        assert len({len(a) for a in after}) == 1  # equal steps on the new topology
        rest = [t for a in after for b, _ in a for t in b]
        assert len(before) + len(rest) == len(set(before) | set(rest)) and set(before) | set(rest) == all_tokens(tokens)
        # and once more: 3x1 for two batches, then 1 rank x 2 workers
        if len(after[0]) > 2:
            mid = [t for r in range(3) for b, _ in rank_batches(p, position, r, 3, 1, limit=2) for t in b]
            again = Position(0, [Segment(2, 2, k), Segment(3, 1, 2)])
            last = [t for b, _ in rank_batches(p, again, 0, 1, 2) for t in b]
            done = before + mid + last
            assert len(done) == len(set(done)) and set(done) == all_tokens(tokens)


def test_a_state_past_the_epoch_is_refused():
    tokens, rg_file, docs = corpus(1)
    p = planner(tokens, rg_file, docs)
    steps = p.rank_batches(0, Position(0), 2, 2)
    p.check(Position(0, [Segment(2, 2, steps)]))
    with pytest.raises(StateError, match=r"history'\]\[0\]"):
        p.check(Position(0, [Segment(2, 2, steps + 1)]))


def test_a_stage_being_counted_elsewhere_is_waited_for_not_counted_again():
    """``StageCounts.claimed``: while a counting thread splits a stage over the ranks, training that needs
    it waits for those counts instead of tokenizing the same row groups itself (before: no claim)."""
    import threading

    asked = []
    counts = StageCounts(np.zeros(6, dtype=np.int64), lambda rgs: asked.append(rgs.tolist()) or rgs * 10)
    units = np.array([1, 2, 3])
    got = []
    with counts.claimed(units):
        reader = threading.Thread(target=lambda: got.append(counts.of(np.array([2, 3]))))
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not asked, "it waits for the claimed stage, counting nothing"
        counts.fill(units, np.array([7, 8, 9]))
    reader.join(5)
    assert got[0].tolist() == [8, 9] and not asked
    with counts.claimed(np.array([4])):  # a claim that ends without its counts: what is missing is counted
        pass
    assert counts.of(np.array([4, 5])).tolist() == [40, 50] and asked == [[4, 5]]
