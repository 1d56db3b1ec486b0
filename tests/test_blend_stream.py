"""BlendedStream: exact mix, exactly once per corpus epoch, equal steps, determinism, resume."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from streamshard.blend import BlendedStream, BlendPlan, blend_length
from streamshard.blend_schedule import blend_counts
from streamshard.dataset import ParquetStream
from streamshard.testing import write_corpus
from helpers import assert_equal_steps, assert_rows_match_ids, run_epoch

LAYOUTS = {  # three corpora of different sizes and row-group shapes
    "web": [[50, 30], [7], [], [64, 64, 1], [13]],  # 229 rows
    "code": [[11, 40], [3, 5]],  # 59 rows
    "math": [[4] * 6, [17]],  # 41 rows
}
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
W = [WEIGHTS[n] for n in LAYOUTS]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        write_corpus(str(root / name), layout, seed=i)
    return {name: str(root / name) for name in LAYOUTS}


def blender(corpora, shuffle=True, **kwargs):
    def make(rank, world_size):
        streams = {n: ParquetStream(p, shuffle=shuffle, seed=7 + i) for i, (n, p) in enumerate(corpora.items())}
        args = {"weights": WEIGHTS, "batch_size": 16, **kwargs}
        return BlendedStream(streams, rank=rank, world_size=world_size, **args)
    return make


def flat(per_rank, key):
    return torch.cat([b[key] for batches in per_rank for b in batches]).numpy()


def per_corpus_ids(per_rank):
    corpus, ids = flat(per_rank, "corpus"), flat(per_rank, "sample_id")
    assert np.array_equal(corpus < 0, ids < 0), "padding rows must have corpus -1 and sample_id -1 together"
    return {k: ids[corpus == k] for k in range(len(LAYOUTS))}


def sizes():
    return [sum(map(sum, layout)) for layout in LAYOUTS.values()]


# -- the mix over a real DataLoader ----------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("order", ["fair", "shuffled"])
def test_mix_equals_blend_counts_with_rows_matching_ids_and_equal_steps(corpora, num_workers, order):
    make = blender(corpora, order=order)
    per_rank = run_epoch(make, world_size=2, num_workers=num_workers)
    ds = make(0, 2)
    counts = blend_counts(W, ds.num_samples)
    observed = [len(v) for v in per_corpus_ids(per_rank).values()]
    assert observed == counts.tolist()
    assert list(ds.counts().values()) == counts.tolist()
    assert_rows_match_ids(per_rank)
    assert_equal_steps(per_rank)
    assert len(per_rank[0]) == ds.steps_per_epoch(num_workers)
    assert all(len(b["sample_id"]) == 16 and b["corpus"].dtype == torch.int64 for r in per_rank for b in r)


def test_exactly_once_per_corpus_epoch_while_cycling(corpora):
    """Label every delivered row with its corpus epoch (from the pure plan) and check each epoch."""
    make = blender(corpora, num_samples=500)  # web 300 > 229, code 150 > 59, math 50 > 41: all cycle
    rows: dict[tuple[int, int], list[int]] = {}
    for epoch in range(2):
        for rank in range(2):
            ds = make(rank, 2)
            ds.set_epoch(epoch)
            batches = list(DataLoader(ds, batch_size=None, num_workers=0))
            plan = ds.plan(0, epoch)
            for (corpus, index), batch in zip(plan.batches(rank), batches):
                real = batch["sample_id"] >= 0
                assert np.array_equal(batch["corpus"][real].numpy(), corpus)
                J = epoch * plan.counts[corpus] + index
                for k, corpus_epoch, sid in zip(corpus, J // plan.sizes[corpus], batch["sample_id"][real].tolist()):
                    rows.setdefault((int(k), int(corpus_epoch)), []).append(sid)
    for (k, corpus_epoch), ids in rows.items():
        assert len(set(ids)) == len(ids), f"corpus {k} epoch {corpus_epoch} repeats a row"
        if len(ids) == sizes()[k]:
            assert sorted(ids) == list(range(sizes()[k]))
    full = [key for key, ids in rows.items() if len(ids) == sizes()[key[0]]]
    assert len(full) >= 6, "two blend epochs of this mix complete at least two epochs of every corpus"


def test_unshuffled_corpora_continue_where_the_last_blend_epoch_stopped(corpora):
    """Corpus k's samples over E blend epochs are stream rows 0, 1, ... of an endless cycle."""
    make = blender(corpora, shuffle=False, stop="first_exhausted")
    seen = {k: [] for k in range(3)}
    for epoch in range(3):
        for k, ids in per_corpus_ids(run_epoch(make, 2, 0, epoch)).items():
            seen[k].extend(ids.tolist())
    counts = blend_counts(W, make(0, 2).num_samples)
    for k, size in enumerate(sizes()):
        expected = np.bincount(np.arange(3 * counts[k]) % size, minlength=size)
        assert np.array_equal(np.bincount(seen[k], minlength=size), expected)


# -- stop rules and num_samples --------------------------------------------------------------------
def test_all_exhausted_delivers_every_row_of_every_corpus(corpora):
    ids = per_corpus_ids(run_epoch(blender(corpora, stop="all_exhausted"), 2, 2))
    for k, size in enumerate(sizes()):
        assert set(ids[k].tolist()) == set(range(size))


def test_first_exhausted_repeats_no_row(corpora):
    make = blender(corpora, stop="first_exhausted")
    ids = per_corpus_ids(run_epoch(make, 2, 2))
    assert all(len(set(v.tolist())) == len(v) for v in ids.values())
    assert make(0, 2).num_samples == blend_length(W, sizes(), "first_exhausted")


def test_num_samples_overrides_the_stop_rule(corpora):
    per_rank = run_epoch(blender(corpora, num_samples=101, stop="first_exhausted"), 2, 2)
    assert [len(v) for v in per_corpus_ids(per_rank).values()] == blend_counts(W, 101).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=3), st.data())
def test_blend_length_is_the_extreme_n_of_its_rule(weights, data):
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=len(weights), max_size=len(weights)))
    n = blend_length(weights, lengths, "all_exhausted")
    assert (blend_counts(weights, n) >= lengths).all()
    assert not any((blend_counts(weights, m) >= lengths).all() for m in range(n))
    n = blend_length(weights, lengths, "first_exhausted")
    assert (blend_counts(weights, n) <= lengths).all()
    beyond = range(n + 1, n + 2 * sum(weights) // min(weights) + 3)  # past this no N can pass
    assert not any((blend_counts(weights, m) <= lengths).all() for m in beyond)


# -- the pure plan -----------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]), min_size=1, max_size=4).filter(any),
    st.data(),
)
def test_plan_covers_each_blend_index_once_in_order_and_resumes(weights, data):
    sizes_ = data.draw(st.lists(st.integers(1, 40), min_size=len(weights), max_size=len(weights)))
    n, workers, batch = data.draw(st.integers(0, 300)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 9))
    order, epoch = data.draw(st.sampled_from(["fair", "shuffled"])), data.draw(st.integers(0, 3))
    plan = BlendPlan(weights, sizes_, n, batch, workers, epoch, seed=5, order=order)
    taken = [[] for _ in weights]
    for g in range(workers):
        batches = list(plan.batches(g))
        assert len(batches) == plan.real_batches(g) <= plan.steps
        first, last, _ = plan.corpus_ranges(g)
        for k in range(len(weights)):
            mine = np.concatenate([i[c == k] for c, i in batches]) if batches else np.zeros(0, np.int64)
            assert np.array_equal(mine, np.arange(first[k], last[k])), "a worker reads one range, in order"
            taken[k].extend(mine.tolist())
            reads = plan.segments(k, int(first[k]), int(last[k])) if last[k] > first[k] else []
            assert sum(end - begin for _, begin, end in reads) == last[k] - first[k]
            assert all(0 <= begin < end <= sizes_[k] for _, begin, end in reads)
        skip = data.draw(st.integers(0, len(batches)))
        resumed = list(plan.batches(g, skip))
        assert len(resumed) == len(batches) - skip
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(resumed, batches[skip:]))
    for k, count in enumerate(plan.counts):
        assert sorted(taken[k]) == list(range(count))


def test_shuffled_order_varies_batch_composition_but_not_worker_totals():
    fair = BlendPlan([0.5, 0.5], [1000, 1000], 2000, 20, 2, order="fair")
    mixed = BlendPlan([0.5, 0.5], [1000, 1000], 2000, 20, 2, order="shuffled")
    for g in range(2):
        fair_mix = [np.bincount(c, minlength=2)[0] for c, _ in fair.batches(g)]
        shuffled_mix = [np.bincount(c, minlength=2)[0] for c, _ in mixed.batches(g)]
        assert set(fair_mix) == {10}
        assert len(set(shuffled_mix)) > 3
        assert sum(shuffled_mix) == sum(fair_mix)


# -- determinism, resume ---------------------------------------------------------------------------
def same_batches(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
                                     for k in x) for x, y in zip(a, b))


def test_same_inputs_give_the_same_batches_and_the_seed_matters(corpora):
    first = run_epoch(blender(corpora, order="shuffled"), 2, 2, epoch=1)
    again = run_epoch(blender(corpora, order="shuffled"), 2, 2, epoch=1)
    other = run_epoch(blender(corpora, order="shuffled", seed=1), 2, 2, epoch=1)
    assert all(same_batches(a, b) for a, b in zip(first, again))
    assert not same_batches(first[0], other[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_after_k_batches_gives_the_rest_of_the_uninterrupted_run(corpora, num_workers):
    make = blender(corpora, order="shuffled", batch_size=8)
    full = run_epoch(make, 2, num_workers, epoch=1)[1]
    for k in (1, 3, len(full) - 1, len(full)):
        saved = make(1, 2)
        saved.set_epoch(1)
        state = saved.state_dict(consumed_batches=k, num_workers=num_workers)
        resumed = make(1, 2)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # a training loop calls this again; it must keep the resume point
        assert same_batches(list(DataLoader(resumed, batch_size=None, num_workers=num_workers)), full[k:])


def test_state_dict_counts_delivered_batches_in_the_main_process(corpora):
    ds = blender(corpora)(0, 2)
    ds.set_epoch(0)
    taken = list(itertools.islice(iter(DataLoader(ds, batch_size=None)), 5))
    state = ds.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 5)
    resumed = blender(corpora)(0, 2)
    resumed.load_state_dict(state)
    rest = list(DataLoader(resumed, batch_size=None))
    assert same_batches(taken + rest, list(DataLoader(blender(corpora)(0, 2), batch_size=None)))


def test_state_dict_needs_the_batch_count_with_workers_and_matching_workers_on_resume(corpora):
    ds = blender(corpora)(0, 1)
    ds.set_epoch(0)
    next(iter(DataLoader(ds, batch_size=None, num_workers=2)))
    with pytest.raises(ValueError, match="consumed_batches"):
        ds.state_dict()
    state = ds.state_dict(consumed_batches=4)
    assert state["num_workers"] == 2
    resumed = blender(corpora)(0, 1)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers"):
        next(iter(DataLoader(resumed, batch_size=None, num_workers=0)))
    with pytest.raises(ValueError, match="world_size"):
        blender(corpora)(0, 2).load_state_dict(state)


# -- small and bad inputs ------------------------------------------------------------------------------
def test_more_workers_than_samples_pad_every_worker_to_equal_steps(corpora):
    per_rank = run_epoch(blender(corpora, num_samples=3, batch_size=4), 2, 2)
    assert_equal_steps(per_rank)
    assert sorted(len(v) for v in per_corpus_ids(per_rank).values()) == sorted(blend_counts(W, 3).tolist())


def test_construction_opens_nothing(corpora):
    ds = blender(corpora)(0, 1)
    assert all(stream._catalog is None for stream in ds.datasets)


def test_weights_must_name_the_same_corpora(corpora):
    streams = {n: ParquetStream(p) for n, p in corpora.items()}
    with pytest.raises(ValueError, match=r"missing \['math'\].*unknown \['books'\]"):
        BlendedStream(streams, {"web": 1, "code": 1, "books": 1}, batch_size=4)
    with pytest.raises(ValueError, match="code"):
        BlendedStream(streams, {"web": 1, "code": float("nan"), "math": 1}, batch_size=4)
    with pytest.raises(ValueError, match="all zero"):
        BlendedStream(streams, {"web": 0, "code": 0, "math": 0}, batch_size=4)


def test_schema_mismatch_names_both_corpora_and_the_column(corpora, tmp_path):
    pq.write_table(pa.table({"id": pa.array([0, 1], pa.int32()), "input_ids": [[1], [2]],
                             "score": pa.array([0.0, 1.0], pa.float32()), "label": [0, 1]}), str(tmp_path / "x.parquet"))
    odd = {"web": ParquetStream(corpora["web"]), "odd": ParquetStream(str(tmp_path / "x.parquet"))}
    with pytest.raises(ValueError, match=r"'web' and 'odd' differ in column 'id'"):
        BlendedStream(odd, {"web": 1, "odd": 1}, batch_size=4).set_epoch(0)
    projected = {"web": ParquetStream(corpora["web"], columns=["id", "label"]),
                 "code": ParquetStream(corpora["code"], columns=["id", "score"])}
    with pytest.raises(ValueError, match=r"'web' and 'code' differ in column 'label'"):
        BlendedStream(projected, {"web": 1, "code": 1}, batch_size=4).set_epoch(0)


def test_empty_corpus_with_weight_and_corpus_transform_are_refused(corpora, tmp_path):
    write_corpus(str(tmp_path / "empty"), [[]])
    streams = {"web": ParquetStream(corpora["web"]), "empty": ParquetStream(str(tmp_path / "empty"))}
    with pytest.raises(ValueError, match="corpus 1 has no rows"):
        BlendedStream(streams, {"web": 1, "empty": 1}, batch_size=4).plan()
    streams = {"web": ParquetStream(corpora["web"], transform=lambda b: b)}
    with pytest.raises(ValueError, match="transform"):
        BlendedStream(streams, {"web": 1}, batch_size=4).set_epoch(0)


def test_a_zero_weight_corpus_is_never_read(corpora):
    streams = lambda: {n: ParquetStream(p) for n, p in corpora.items()}  # noqa: E731
    weights = {"web": 1.0, "code": 0.0, "math": 1.0}
    per_rank = [list(DataLoader(BlendedStream(streams(), weights, batch_size=8, rank=r, world_size=2),
                                batch_size=None)) for r in range(2)]
    ids = per_corpus_ids(per_rank)
    n = blend_length([1.0, 0.0, 1.0], sizes(), "all_exhausted")
    assert [len(v) for v in ids.values()] == blend_counts([1.0, 0.0, 1.0], n).tolist()
    assert len(ids[1]) == 0 and set(ids[0].tolist()) == set(range(229))
