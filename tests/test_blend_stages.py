"""A packed blend of text corpora planned in stages (``plan/blend_stages.py``): every position of the blend
epoch once, each its corpus's sequence exactly as with every count known, equal steps per global worker,
the first plan needing only the corpora's first stages counted, the same batches warm as cold, and
resume on another topology through the stages."""

from __future__ import annotations

from functools import partial

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from hypothesis import HealthCheck, settings

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
from streamshard.plan.blend_plan import BlendMap, position_config
from streamshard.plan.blend_stages import BlendStages, CorpusTokens, StagedBlendBatches, corpus_first_bytes
from streamshard.plan.elastic import Segment
from streamshard.plan.epoch_plan import Layout, PlanConfig, stream_order
from streamshard.plan.packing_stages import StageCounts, StagedPlanner, Stages
from streamshard.plan.resume import Position


class Blend:
    """Corpora of random token counts per row group and a blend of them, planned cold (``known=False``:
    each count asked for when a plan needs it, recorded in ``calls``) or warm."""

    def __init__(self, corpora, weights, num_samples, seq_len, batch_size, order, first, known):
        self.corpora, self.weights, self.num_samples = corpora, weights, num_samples
        self.seq_len, self.batch_size, self.order, self.first, self.known = seq_len, batch_size, order, first, known
        self.calls: list[list[tuple[int, int]]] = []
        self.tokens_of: list[CorpusTokens] = []
        shares = BlendMap(weights, num_samples, order, 7, 0).counts
        firsts = corpus_first_bytes(first, shares)
        for k, (tokens, rg_file, docs, seed) in enumerate(corpora):
            layout, config = Layout(docs, rg_file), PlanConfig(shuffle=True, seed=seed)

            def count(units, k=k, tokens=tokens):
                self.calls.append([(k, int(u)) for u in units])
                return tokens[units]

            counts = StageCounts(rg_file, count, tokens if known else None)
            stages = Stages.split(stream_order(layout, config, 0), docs * 10.0, max(float(firsts[k]), 1.0))
            self.tokens_of.append(CorpusTokens(f"c{k}", stages, counts, partial(stream_order, layout, config),
                                               seq_len))
        self.stages: dict[int, BlendStages] = {}
        self.planner = StagedPlanner(self.epoch_stages, None, position_config(batch_size))

    def epoch_stages(self, epoch):
        if epoch not in self.stages:
            self.stages[epoch] = BlendStages(BlendMap(self.weights, self.num_samples, self.order, 7, epoch),
                                             self.tokens_of)
        return self.stages[epoch]

    def schedule(self, epoch, position, rank, world, worker, n):
        start = self.planner.start(epoch, position, rank, world, worker, n)
        stages = self.epoch_stages(epoch)
        return StagedBlendBatches(start.schedule, stages.blend, self.tokens_of, self.seq_len, self.batch_size), start

    def reference(self, epoch):
        """Each position's tokens, ``(corpus, corpus epoch, row group, row)``, from every count known (an
        independent walk of the corpora's endless token streams)."""
        blend = BlendMap(self.weights, self.num_samples, self.order, 7, epoch)
        corpus, sequence = blend.samples(np.arange(self.num_samples, dtype=np.int64))
        out = []
        for k, j in zip(corpus.tolist(), sequence.tolist()):
            tokens, rg_file, docs, seed = self.corpora[k]
            layout, config = Layout(docs, rg_file), PlanConfig(shuffle=True, seed=seed)
            total = int(tokens[stream_order(layout, config, 0)].sum())
            per_epoch = -(-total // self.seq_len)
            e, s = divmod(j, per_epoch)
            stream = [(k, e, int(u), i) for u in stream_order(layout, config, e).tolist() for i in range(int(tokens[u]))]
            out.append(stream[s * self.seq_len:(s + 1) * self.seq_len])
        return out


def delivered(schedule, start, limit=None):
    """Per batch: its positions and each position's tokens ``(corpus, corpus epoch, row group, row)``."""
    out = []
    index = start.start
    for spec in schedule._specs(start.start):
        if limit is not None and index - start.start >= limit:
            break
        positions = schedule.positions.batch(index)
        assert spec.rows + spec.padding == schedule.slots
        seqs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(len(positions.sample_id))]
        for key, row, slot in zip(spec.read.tolist(), spec.row.tolist(), spec.slot.tolist()):
            read = spec.reads[key]
            seqs[slot // schedule.seq_len].append((read.source, read.epoch, read.rg, row))
        out.append((positions.sample_id.tolist(), seqs))
        index += 1
    return out


@st.composite
def blends(draw):
    corpora = []
    for k in range(draw(st.integers(1, 3))):
        units = draw(st.integers(1, 30))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        tokens = rng.integers(0, 50, units).astype(np.int64)
        tokens[rng.random(units) < 0.15] = 0
        tokens[0] = max(int(tokens[0]), 1)  # a corpus with tokens (one of none is refused when located)
        docs = rng.integers(1, 8, units).astype(np.int64)
        corpora.append((tokens, np.sort(rng.integers(0, 4, units)).astype(np.int64), docs, k + 11))
    weights = [draw(st.integers(1, 5)) / 8.0 for _ in corpora]
    sizes = [-(-int(t.sum()) // 8) for t, *_ in corpora]
    num_samples = draw(st.integers(1, 3 * max(sum(sizes), 1)))  # short of a corpus epoch, or past it
    return dict(corpora=corpora, weights=weights, num_samples=num_samples, seq_len=draw(st.integers(1, 16)),
                batch_size=draw(st.integers(1, 4)), order=draw(st.sampled_from(["fair", "shuffled"])),
                first=draw(st.sampled_from([1.0, 20.0, 100.0])))


def all_worker_batches(blend, epoch, position, world, n):
    per_worker, steps = {}, set()
    for rank in range(world):
        for w in range(max(n, 1)):
            schedule, start = blend.schedule(epoch, position, rank, world, w, n)
            got = delivered(schedule, start)
            steps.add(len(got))
            per_worker[(rank, w)] = got
    return per_worker, steps


@PROPERTY
@given(blends(), st.sampled_from([(1, 0), (2, 2), (3, 1)]), st.integers(0, 2))
def test_every_position_once_each_its_sequence_and_equal_steps(spec, topology, epoch):
    world, n = topology
    cold = Blend(**spec, known=False)
    per_worker, steps = all_worker_batches(cold, epoch, Position(epoch), world, n)
    assert len(steps) == 1, "equal steps for every global worker"
    reference = cold.reference(epoch)
    positions = []
    for batches in per_worker.values():
        for pos, seqs in batches:
            positions += pos
            for p, tokens in zip(pos, seqs):
                assert tokens == reference[p], f"position {p}: not its corpus sequence"
    assert sorted(positions) == list(range(spec["num_samples"])), "every position once"
    warm = Blend(**spec, known=True)  # every count known: the very same batches
    assert all_worker_batches(warm, epoch, Position(epoch), world, n)[0] == per_worker
    padding = sum(max(spec["batch_size"] - len(pos), 0) for b in per_worker.values() for pos, _ in b)
    assert padding < world * max(n, 1) * spec["batch_size"], "padding of one plan: under a batch per worker"


@PROPERTY
@given(blends(), st.data())
def test_elastic_resume_through_stages_delivers_every_position_once(spec, data):
    steps = Blend(**spec, known=True).planner.rank_batches(0, Position(0), 2, 2)
    blend = Blend(**spec, known=False)  # cold: each plan counts its stages as the resume reaches them
    if steps < 2:
        return
    k = data.draw(st.integers(1, steps - 1))
    first = []
    for rank in range(2):  # 2 ranks x 2 workers, k batches per rank (round robin over its workers)
        for w in range(2):
            schedule, start = blend.schedule(0, Position(0), rank, 2, w, 2)
            first += [p for pos, _ in delivered(schedule, start, limit=(k - w + 1) // 2) for p in pos]
    position = Position(0, [Segment(2, 2, k)])
    per_worker, steps_after = all_worker_batches(blend, 0, position, 3, 1)
    assert len(steps_after) == 1, "equal steps on the new topology"
    rest = [p for b in per_worker.values() for pos, _ in b for p in pos]
    assert sorted(first + rest) == list(range(spec["num_samples"]))
    same = [p for r in range(2) for w in range(2)
            for pos, _ in delivered(*blend.schedule(0, position, r, 2, w, 2)) for p in pos]
    assert sorted(first + same) == list(range(spec["num_samples"])), "resumed on the same topology"


def test_the_first_plan_needs_only_the_first_stages_counted():
    rng = np.random.default_rng(4)
    corpora = [(rng.integers(20, 60, 40).astype(np.int64), np.repeat(np.arange(8), 5), np.full(40, 4), 11 + k)
               for k in range(2)]
    spec = dict(corpora=corpora, weights=[0.75, 0.25], num_samples=200, seq_len=8, batch_size=2, order="shuffled",
                first=120.0)
    cold = Blend(**spec, known=False)
    schedules = [cold.schedule(0, Position(0), r, 2, w, 2) for r in range(2) for w in range(2)]
    for schedule, start in schedules:
        schedule.batch(start.start)  # every global worker's first batch
    counted = {u for call in cold.calls for u in call}
    first = {(k, int(u)) for k, c in enumerate(cold.tokens_of) for u in c.stages.units(0)}
    assert counted == first, "the first batches counted the first stage of each corpus, nothing more"
    assert len(cold.tokens_of[0].stages) > 3 and len(counted) < 20
    upcoming = list(schedules[-1][0].upcoming_reads(0))  # read-ahead pauses where the next stage is not counted
    assert upcoming and {u for call in cold.calls for u in call} == first
    assert cold.stages[0].bound(0) > 0


def test_positions_over_chunks_and_where_each_corpus_index_lies():
    """The pieces of ``[a, b)`` over several position chunks, and ``BlendStages._occurrence`` (where a
    corpus's m-th index of the epoch lies) against the map itself, in both orders, across chunks."""
    from streamshard.plan.blend_plan import CHUNK
    from streamshard.plan.blend_stages import position_pieces

    n = 3 * CHUNK + 5
    for a, b in [(0, n), (CHUNK - 3, 2 * CHUNK + 7), (5, 6), (7, 7)]:
        pieces = position_pieces(a, b, n)
        got = np.concatenate([np.arange(lo, hi) + rg * CHUNK for rg, lo, hi in
                              zip(pieces.rg.tolist(), pieces.lo.tolist(), pieces.hi.tolist())] or [np.zeros(0)])
        assert got.tolist() == list(range(a, b))
    for order in ("fair", "shuffled"):
        blend = BlendMap([0.7, 0.2, 0.1], n, order, 3, 1)
        stages = BlendStages(blend, [None, None, None])
        corpus, _ = blend.locate(np.arange(n, dtype=np.int64))
        for k in range(3):
            where = np.flatnonzero(corpus == k)
            for m in (0, 1, 2, len(where) // 3, len(where) // 2 + 1, len(where) - 1):
                assert stages._occurrence(k, m) == where[m], (order, k, m)
            assert stages._occurrence(k, -4) == where[0] and stages._occurrence(k, len(where)) == n
