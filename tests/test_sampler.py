"""Specification of streamshard.streams.sampler.ElasticSampler: node-local shuffling, equal counts, resume, resize."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from streamshard.errors import StateError
from streamshard.streams.sampler import ElasticSampler


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    """Tests describe their topology explicitly; a torchrun environment must not leak in."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


# -- a simulated job: one sampler per replica --------------------------------------------------


@st.composite
def topologies(draw, max_nodes: int = 4, max_local: int = 4):
    """(num_replicas, num_nodes) with num_nodes dividing num_replicas."""
    nodes = draw(st.integers(1, max_nodes))
    return nodes * draw(st.integers(1, max_local)), nodes


def samplers(n, replicas, nodes, **kwargs):
    return [ElasticSampler(n, replicas, rank, nodes, **kwargs) for rank in range(replicas)]


def epoch_lists(n, replicas, nodes, epoch=0, **kwargs):
    """What each replica yields in one epoch."""
    out = []
    for sampler in samplers(n, replicas, nodes, **kwargs):
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def per_node(lists, nodes):
    """Indices delivered to each node (its ranks are contiguous)."""
    local = len(lists) // nodes
    return [sorted(itertools.chain(*lists[j * local:(j + 1) * local])) for j in range(nodes)]


def take(iterator, k):
    return list(itertools.islice(iterator, k))


def run_resized_epoch(n, stages, use_resize=True, **kwargs):
    """Run one epoch through topology stages [(replicas, nodes, k), ...]; every replica consumes k
    samples in each stage but the last, which runs to the end. The job moves to the next stage
    with resize() on surviving replicas (new replicas load rank 0's state), or, with
    ``use_resize=False``, with brand-new samplers loading rank 0's state.
    Returns (everything consumed, the last stage's lists, the per-stage lengths)."""
    replicas, nodes, _ = stages[0]
    job = samplers(n, replicas, nodes, **kwargs)
    consumed, lengths = [], []
    for (replicas, nodes, k), (next_replicas, next_nodes, _) in zip(stages, stages[1:]):
        lengths.append({len(s) for s in job})
        for sampler in job:
            consumed += take(iter(sampler), k)
        state = job[0].state_dict()
        new_job = []
        for rank in range(next_replicas):
            if use_resize and rank < len(job):
                job[rank].resize(next_replicas, rank, next_nodes)
                new_job.append(job[rank])
            else:
                fresh = ElasticSampler(n, next_replicas, rank, next_nodes, **kwargs)
                fresh.load_state_dict(json.loads(json.dumps(state)))
                new_job.append(fresh)
        job = new_job
    lengths.append({len(s) for s in job})
    return consumed, [list(s) for s in job], lengths


# -- exactly once, equal counts ----------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 300), topo=topologies(), shuffle=st.booleans(), seed=st.integers(0, 2**64 - 1),
       epoch=st.integers(0, 5))
def test_every_sample_once_when_divisible_else_padding_at_most_one_step(n, topo, shuffle, seed, epoch):
    replicas, nodes = topo
    lists = epoch_lists(n, replicas, nodes, epoch, shuffle=shuffle, seed=seed)
    assert {len(x) for x in lists} == {-(-n // replicas)}, "replicas yield different counts"
    counts = Counter(itertools.chain(*lists))
    assert sorted(counts) == list(range(n)), "some sample was never delivered"
    assert sum(counts.values()) - n == (-n) % replicas  # padding only fills the last step
    # Padding sits in the last step only: without it, nothing repeats.
    assert max(Counter(itertools.chain(*(x[:-1] for x in lists))).values(), default=1) == 1


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 300), topo=topologies(), shuffle=st.booleans(), seed=st.integers(0, 2**32))
def test_drop_last_delivers_distinct_samples_and_drops_less_than_one_step(n, topo, shuffle, seed):
    replicas, nodes = topo
    lists = epoch_lists(n, replicas, nodes, shuffle=shuffle, seed=seed, drop_last=True)
    assert {len(x) for x in lists} == {n // replicas}
    delivered = list(itertools.chain(*lists))
    assert len(set(delivered)) == len(delivered) == n - n % replicas
    assert set(delivered) <= set(range(n))


def test_fewer_samples_than_nodes_still_gives_every_replica_a_sample():
    lists = epoch_lists(3, 8, 4)
    assert [len(x) for x in lists] == [1] * 8
    assert set(itertools.chain(*lists)) == {0, 1, 2}


# -- node affinity -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), topo=topologies(), seed=st.integers(0, 2**32), drop_last=st.booleans())
def test_a_sample_never_changes_node_across_epochs(n, topo, seed, drop_last):
    replicas, nodes = topo
    if n < nodes:
        return  # some node owns nothing: its padding must come from elsewhere
    homes = {}
    for epoch in range(3):
        for node, ids in enumerate(per_node(epoch_lists(n, replicas, nodes, epoch, seed=seed,
                                                        drop_last=drop_last), nodes)):
            for i in ids:
                assert homes.setdefault(i, node) == node, f"sample {i} moved from node {homes[i]} to {node}"


def test_node_subsets_depend_on_seed_and_node_count_not_on_epoch_or_ranks_per_node():
    def subsets(replicas, nodes, epoch=0, seed=0):
        return [set(ids) for ids in per_node(epoch_lists(1000, replicas, nodes, epoch, seed=seed), nodes)]

    assert subsets(2, 2) == subsets(8, 2, epoch=3) == subsets(6, 2, epoch=1)
    assert subsets(4, 2, seed=1) != subsets(4, 2, seed=2)
    # Shuffled subsets are not plain contiguous blocks; unshuffled ones are.
    assert subsets(4, 2)[0] != set(range(500))
    unshuffled = per_node(epoch_lists(1000, 4, 2, shuffle=False), 2)
    assert unshuffled == [list(range(500)), list(range(500, 1000))]


def test_epochs_reorder_samples_within_a_node():
    orders = [epoch_lists(1000, 4, 2, epoch) for epoch in range(3)]
    for a, b in itertools.combinations(orders, 2):
        assert a[0] != b[0] and sorted(a[0] + a[1]) == sorted(b[0] + b[1])
    first = [lists[0][:20] for lists in orders]
    assert len({tuple(x) for x in first}) == 3


def test_without_shuffle_ranks_of_a_node_interleave_in_order():
    assert epoch_lists(8, 4, 2, shuffle=False) == [[0, 2], [1, 3], [4, 6], [5, 7]]


# -- determinism -------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 500), topo=topologies(), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6))
def test_same_arguments_give_the_same_indices(n, topo, seed, epoch):
    replicas, nodes = topo
    once = epoch_lists(n, replicas, nodes, epoch, seed=seed)
    assert once == epoch_lists(n, replicas, nodes, epoch, seed=seed)


def test_seeds_give_different_orders():
    assert epoch_lists(200, 2, 1, seed=1) != epoch_lists(200, 2, 1, seed=2)


# -- resume ------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), topo=topologies(), seed=st.integers(0, 2**32), epoch=st.integers(0, 4),
       drop_last=st.booleans(), data=st.data())
def test_resume_from_any_stop_point_matches_the_uninterrupted_run(n, topo, seed, epoch, drop_last, data):
    replicas, nodes = topo
    rank = data.draw(st.integers(0, replicas - 1))
    make = lambda: ElasticSampler(n, replicas, rank, nodes, seed=seed, drop_last=drop_last)  # noqa: E731
    reference = make()
    reference.set_epoch(epoch)
    full = list(reference)
    stop = data.draw(st.integers(0, len(full)))
    ahead = data.draw(st.integers(0, len(full) - stop))  # what a prefetching DataLoader pulled extra

    first = make()
    first.set_epoch(epoch)
    take(iter(first), stop + ahead)
    state = json.loads(json.dumps(first.state_dict(consumed=stop if ahead else None)))

    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(resumed.epoch)  # a training loop re-entering the loaded epoch keeps the resume point
    if stop == len(full) > 0:  # a state of the whole epoch is the next epoch's beginning
        assert resumed.epoch == epoch + 1
        reference.set_epoch(epoch + 1)
        assert list(resumed) == list(reference)
        return
    assert len(resumed) == len(full) - stop
    assert list(resumed) == full[stop:]
    resumed.set_epoch(epoch + 1)
    reference.set_epoch(epoch + 1)
    assert list(resumed) == list(reference), "the epoch after a resume must be a normal one"


def test_consumed_set_in_the_state_dict_is_honoured():
    sampler = ElasticSampler(50, 2, 1, 1, seed=3)
    full = list(sampler)
    take(iter(sampler), 20)
    state = sampler.state_dict()
    assert state["yielded"] == 20 and state["consumed"] is None
    state["consumed"] = 3 * 4  # batches_done * batch_size
    other = ElasticSampler(50, 2, 1, 1, seed=3)
    other.load_state_dict(state)
    assert list(other) == full[12:]


def test_consumed_past_the_end_is_clamped_for_a_short_last_batch():
    sampler = ElasticSampler(10, 1, 0, 1)
    list(sampler)
    fresh = ElasticSampler(10, 1, 0, 1)
    fresh.load_state_dict(sampler.state_dict(consumed=3 * 4))  # three batches of 4, the last one short
    sampler.set_epoch(1)
    assert fresh.epoch == 1 and list(fresh) == list(sampler), "the whole epoch consumed: the next one begins"


def test_a_plain_second_iteration_restarts_the_epoch():
    sampler = ElasticSampler(30, 3, 2, 1, seed=5)
    first = list(sampler)
    assert list(sampler) == first
    take(iter(sampler), 4)
    assert list(sampler) == first  # only a load_state_dict / resize makes the next pass resume


def test_states_of_all_replicas_agree_and_the_state_is_small_json():
    job = samplers(10**9, 8, 2, seed=7)
    for sampler in job:
        take(iter(sampler), 5)
    states = [s.state_dict() for s in job]
    assert all(state == states[0] for state in states)
    job[0].resize(6, 0, 3)
    take(iter(job[0]), 3)
    job[0].resize(4, 0, 2)
    state = job[0].state_dict(consumed=9)
    text = json.dumps(state)
    assert json.loads(text) == state
    assert len(text) < 500


def test_the_state_follows_the_shared_contract_and_another_seed_is_refused_not_adopted():
    sampler = ElasticSampler(50, 2, 1, 1, seed=3)
    take(iter(sampler), 7)
    state = sampler.state_dict()
    assert (state["version"], state["kind"], state["epoch"]) == (2, "sampler", 0)
    assert state["fingerprint"] == {"dataset_len": 50, "seed": 3, "shuffle": True, "drop_last": False}
    other = ElasticSampler(50, 2, 1, 1, seed=4)
    before = other.state_dict()
    with pytest.raises(StateError, match="seed=3.*seed=4"):
        other.load_state_dict(state)
    assert other.state_dict() == before and list(other) == list(ElasticSampler(50, 2, 1, 1, seed=4))


def test_an_iterator_from_before_a_resize_or_a_load_no_longer_counts():
    sampler = ElasticSampler(40, 2, 0, seed=1)
    stale = iter(sampler)
    take(stale, 5)
    sampler.resize(4, 0)
    take(stale, 3)  # e.g. a DataLoader iterator still prefetching from the old pass
    assert sampler.state_dict()["yielded"] == 5
    sampler.load_state_dict(ElasticSampler(40, 4, 1, seed=1).state_dict())
    take(stale, 2)
    assert sampler.state_dict()["yielded"] == 0


# -- resize mid-epoch --------------------------------------------------------------------------


@pytest.mark.parametrize("use_resize", [True, False])
def test_resize_4_to_2_to_3_replicas_delivers_the_epoch_exactly_once(use_resize):
    n = 120  # 4 x 10 consumed, then 2 x 10, then 60 left for 3 replicas: no padding needed
    stages = [(4, 1, 10), (2, 1, 10), (3, 1, None)]
    consumed, last, lengths = run_resized_epoch(n, stages, use_resize, seed=11)
    assert lengths == [{30}, {40}, {20}]
    delivered = consumed + list(itertools.chain(*last))
    assert sorted(delivered) == list(range(n))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 250), first=topologies(3, 3), seed=st.integers(0, 2**32), drop_last=st.booleans(),
       shuffle=st.booleans(), data=st.data())
def test_any_chain_of_resizes_loses_nothing_and_repeats_only_final_padding(n, first, seed, drop_last,
                                                                           shuffle, data):
    stages = [(*first, None)]
    for _ in range(data.draw(st.integers(1, 3))):
        stages.append((*data.draw(topologies(3, 3)), None))
    # Each stage but the last is interrupted strictly before its end.
    kwargs = dict(seed=seed, drop_last=drop_last, shuffle=shuffle)
    stages = _with_stop_points(n, stages, data, kwargs)
    consumed, last, lengths = run_resized_epoch(n, stages, **kwargs)
    assert all(len(sizes) == 1 for sizes in lengths), f"unequal counts per replica: {lengths}"
    final_replicas = stages[-1][0]
    real = consumed + [i for lst in last for i in lst[:-1]]
    assert len(set(real)) == len(real), "a sample was delivered twice outside the final padding"
    delivered = set(real) | {lst[-1] for lst in last if lst}
    if drop_last:
        assert len(delivered) == len(real) + sum(1 for lst in last if lst)
        assert n - final_replicas < len(delivered) <= n
    else:
        assert delivered == set(range(n))
        assert len(consumed) + sum(map(len, last)) - n < final_replicas


def _with_stop_points(n, stages, data, kwargs):
    """Draw each interrupted stage's per-replica stop point below that stage's length."""
    out = []
    for stage in stages[:-1]:
        _, _, lengths = run_resized_epoch(n, [*out, (stage[0], stage[1], None)], **kwargs)
        length = lengths[-1].pop()
        out.append((stage[0], stage[1], data.draw(st.integers(0, max(0, length - 1)))))
    return [*out, stages[-1]]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), local=st.tuples(st.integers(1, 4), st.integers(1, 4)), nodes=st.integers(1, 3),
       seed=st.integers(0, 2**32), data=st.data())
def test_resize_keeping_the_node_count_keeps_samples_on_their_node(n, local, nodes, seed, data):
    if n < nodes:
        return
    homes = per_node(epoch_lists(n, nodes, nodes, seed=seed), nodes)
    length = -(-n // (nodes * local[0]))
    k = data.draw(st.integers(0, max(0, length - 1)))
    stages = [(nodes * local[0], nodes, k), (nodes * local[1], nodes, None)]
    _, last, _ = run_resized_epoch(n, stages, seed=seed)
    for node, ids in enumerate(per_node(last, nodes)):
        assert set(ids) <= set(homes[node])


def test_after_a_resize_the_next_epoch_is_a_normal_epoch_of_the_new_topology():
    job = samplers(100, 4, 2, seed=1)
    for sampler in job:
        take(iter(sampler), 7)
    job[1].resize(3, 1, 1)
    job[1].set_epoch(1)
    assert list(job[1]) == epoch_lists(100, 3, 1, epoch=1, seed=1)[1]


def test_resize_before_anything_is_consumed_starts_the_epoch_on_the_new_topology():
    sampler = ElasticSampler(64, 4, 0, 2, seed=2)
    sampler.resize(2, 1, 1)
    assert sampler.state_dict()["layouts"] == []
    assert list(sampler) == epoch_lists(64, 2, 1, seed=2)[1]


# -- DataLoader --------------------------------------------------------------------------------


def test_works_in_a_dataloader_and_resumes_from_batches_done():
    n, replicas, batch = 37, 2, 4
    data = TensorDataset(torch.arange(n) * 10)
    per_rank = []
    for rank in range(replicas):
        loader = DataLoader(data, sampler=ElasticSampler(n, replicas, rank, seed=4), batch_size=batch)
        per_rank.append([b[0] for b in loader])
    assert len({len(b) for b in per_rank}) == 1
    values = torch.cat([torch.cat(b) for b in per_rank]) // 10
    assert set(values.tolist()) == set(range(n)) and len(values) == n + (-n) % replicas

    sampler = ElasticSampler(n, replicas, 1, seed=4)
    loader = DataLoader(data, sampler=sampler, batch_size=batch)
    stop = 2
    take(iter(loader), stop)
    state = sampler.state_dict(consumed=stop * batch)
    resumed = ElasticSampler(n, replicas, 1, seed=4)
    resumed.load_state_dict(state)
    rest = [b[0] for b in DataLoader(data, sampler=resumed, batch_size=batch)]
    assert torch.equal(torch.cat(rest), torch.cat(per_rank[1][stop:]))


def test_prefetching_workers_run_the_count_ahead_and_consumed_corrects_it():
    n, batch = 64, 4
    data = TensorDataset(torch.arange(n))
    sampler = ElasticSampler(n, 1, 0, seed=9)
    full = list(sampler)
    loader = DataLoader(data, sampler=sampler, batch_size=batch, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    got = [next(iterator)[0] for _ in range(2)]
    assert sampler.state_dict()["yielded"] > 2 * batch  # the workers were handed more indices
    state = sampler.state_dict(consumed=2 * batch)
    del iterator
    resumed = ElasticSampler(n, 1, 0, seed=9)
    resumed.load_state_dict(state)
    assert torch.cat(got).tolist() + list(resumed) == full


# -- defaults and bad input --------------------------------------------------------------------


def test_topology_defaults_come_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    sampler = ElasticSampler(100)
    assert (sampler.num_replicas, sampler.rank, sampler.num_nodes) == (8, 5, 2)
    assert (sampler.node_rank, sampler.local_rank) == (1, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ElasticSampler(100).num_nodes == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(dataset_len=-1), "dataset_len"),
        (dict(dataset_len=2.5), "dataset_len"),
        (dict(dataset_len=10, num_replicas=0, rank=0), "num_replicas"),
        (dict(dataset_len=10, num_replicas=2, rank=2), "rank"),
        (dict(dataset_len=10, num_replicas=2, rank=-1), "rank"),
        (dict(dataset_len=10, num_replicas=4, rank=0, num_nodes=3), "num_nodes"),
        (dict(dataset_len=10, num_replicas=4, rank=0, num_nodes=0), "num_nodes"),
        (dict(dataset_len=10, num_replicas=4, rank=3, num_nodes=2, node_rank=0), "node_rank"),
        (dict(dataset_len=10, num_replicas=1, rank=0, seed=-1), "seed"),
        (dict(dataset_len=10, num_replicas=1, rank=0, shuffle="yes"), "shuffle"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ElasticSampler(**kwargs)


def test_bad_local_world_size_is_reported(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ElasticSampler(10, 4, 0)


def test_bad_epoch_and_resize_arguments_name_the_argument():
    sampler = ElasticSampler(40, 2, 0)
    with pytest.raises(ValueError, match="epoch"):
        sampler.set_epoch(-1)
    with pytest.raises(ValueError, match="rank"):
        sampler.resize(2, 5)
    take(iter(sampler), 5)
    sampler.resize(4, 0)
    with pytest.raises(ValueError, match="consumed"):
        sampler.resize(2, 0, consumed=3)  # before the last resize: cannot be undone
    with pytest.raises(ValueError, match="consumed"):
        sampler.state_dict(consumed=3)


def test_a_running_pass_keeps_its_order_when_the_epoch_changes_midway():
    n = 40_000  # more than one internal chunk of indices
    reference = list(ElasticSampler(n, num_replicas=1, rank=0, num_nodes=1, seed=3))
    sampler = ElasticSampler(n, num_replicas=1, rank=0, num_nodes=1, seed=3)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(20_000)]
    sampler.set_epoch(5)  # e.g. a training loop preparing the next epoch early
    assert head + list(iterator) == reference
