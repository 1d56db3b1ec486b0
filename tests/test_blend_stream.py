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

import streamshard as ss
from streamshard.streams.blend import BlendedStream, blend_length
from streamshard.plan.blend_plan import BlendMap
from streamshard.plan.blend_schedule import blend_counts
from streamshard.streams.dataset import ParquetStream
from streamshard.testing import write_corpus
from helpers import assert_equal_steps, assert_rows_match_ids, run_epoch
from resume_harness import check_elastic_resume, check_loader_resume, check_stateful_resume, same_batches

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
            schedule = ds.schedule()
            for i, batch in enumerate(batches):
                spec = schedule.batch(i)
                real = batch["sample_id"] >= 0
                if not spec.rows:
                    assert not real.any()
                    continue
                assert np.array_equal(batch["corpus"][real].numpy(), spec.corpus)
                assert np.array_equal(batch["sample_id"][real].numpy(), spec.sample_id)
                corpus, index = schedule.blend.locate(schedule.positions.batch(i).sample_id)
                J = epoch * schedule.blend.counts[corpus] + index
                for k, corpus_epoch, sid in zip(corpus, J // np.asarray(sizes())[corpus], spec.sample_id.tolist()):
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
    st.integers(0, 200_000), st.sampled_from(["fair", "shuffled"]), st.integers(0, 3),
)
def test_the_blend_map_gives_each_corpus_its_count_in_rising_order(weights, n, order, epoch):
    """Every corpus's indices 0..c_k-1 appear once, rising along the positions: any contiguous range of
    positions (a worker's block, a resumed rest) reads each corpus sequentially."""
    blend = BlendMap(weights, n, order, seed=5, epoch=epoch)
    corpus, index = blend.locate(np.arange(n, dtype=np.int64))
    for k, count in enumerate(blend.counts):
        np.testing.assert_array_equal(index[corpus == k], np.arange(count))


def test_shuffled_order_varies_batch_composition_but_not_the_totals():
    positions = np.arange(2000, dtype=np.int64)
    fair = BlendMap([0.5, 0.5], 2000, "fair", seed=0, epoch=0).locate(positions)[0]
    mixed = BlendMap([0.5, 0.5], 2000, "shuffled", seed=0, epoch=0).locate(positions)[0]
    fair_mix = {int(np.bincount(c, minlength=2)[0]) for c in fair.reshape(-1, 20)}
    shuffled_mix = {int(np.bincount(c, minlength=2)[0]) for c in mixed.reshape(-1, 20)}
    assert fair_mix == {10} and len(shuffled_mix) > 3
    assert np.bincount(mixed).tolist() == np.bincount(fair).tolist()


# -- determinism, resume ---------------------------------------------------------------------------
def test_same_inputs_give_the_same_batches_and_the_seed_matters(corpora):
    first = run_epoch(blender(corpora, order="shuffled"), 2, 2, epoch=1)
    again = run_epoch(blender(corpora, order="shuffled"), 2, 2, epoch=1)
    other = run_epoch(blender(corpora, order="shuffled", seed=1), 2, 2, epoch=1)
    assert all(same_batches(a, b) for a, b in zip(first, again))
    assert not same_batches(first[0], other[0])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("order", ["fair", "shuffled"])
def test_stream_loader_resumes_a_blend_exactly(corpora, num_workers, order):
    make = blender(corpora, order=order, batch_size=8)
    check_loader_resume(lambda: make(1, 2), num_workers, stops=[1, 3, 10_000], epoch=1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_a_blend_with_workers(corpora, num_workers):
    make = blender(corpora, order="shuffled", batch_size=8)
    check_stateful_resume(lambda: make(1, 2), num_workers, stops=[1, 5], epoch=1)


@pytest.mark.parametrize("phases", [[(2, 2, 3), (3, 1, None)], [(1, 0, 4), (4, 2, 1), (2, 0, None)]])
def test_a_blend_resumes_elastically_with_each_row_once(corpora, phases):
    check_elastic_resume(blender(corpora, order="shuffled", batch_size=8), phases, epoch=1)


def test_state_dict_counts_delivered_batches_in_the_main_process(corpora):
    ds = blender(corpora)(0, 2)
    ds.set_epoch(0)
    taken = list(itertools.islice(iter(DataLoader(ds, batch_size=None)), 5))
    state = ds.state_dict()
    assert (state["epoch"], state["history"]) == (0, [[2, 0, 5]])  # [world_size, num_workers, batches]
    resumed = blender(corpora)(0, 2)
    resumed.load_state_dict(state)
    rest = list(DataLoader(resumed, batch_size=None))
    assert same_batches(taken + rest, list(DataLoader(blender(corpora)(0, 2), batch_size=None)))


def test_a_blend_state_refuses_other_mixes_and_the_main_process_guess(corpora):
    ds = blender(corpora)(0, 1)
    ds.set_epoch(0)
    next(iter(DataLoader(ds, batch_size=None, num_workers=2)))
    with pytest.raises(ss.StateError, match="StreamLoader"):
        ds.state_dict()
    loader = ss.StreamLoader(blender(corpora)(0, 1), num_workers=2)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ss.StateError, match="order="):
        ss.StreamLoader(blender(corpora, order="shuffled")(0, 1)).load_state_dict(state)
    with pytest.raises(ss.StateError, match="weights="):
        ss.StreamLoader(blender(corpora, weights={"web": 0.5, "code": 0.3, "math": 0.2})(0, 1)).load_state_dict(state)


def test_a_blend_takes_its_corpora_topology_or_refuses_a_disagreement(corpora):
    def streams(rank, world):
        return {n: ParquetStream(p, rank=rank, world_size=world) for n, p in corpora.items()}
    per_rank = [list(DataLoader(BlendedStream(streams(r, 2), WEIGHTS, batch_size=8), batch_size=None)) for r in range(2)]
    ids = per_corpus_ids(per_rank)
    n = blend_length(W, sizes(), "all_exhausted")
    assert [len(v) for v in ids.values()] == blend_counts(W, n).tolist(), "each rank must take its own share"
    with pytest.raises(ValueError, match="disagrees"):
        BlendedStream(streams(0, 2), WEIGHTS, batch_size=8, rank=1, world_size=2)
    mixed = {**streams(0, 2), "math": ParquetStream(corpora["math"], rank=1, world_size=2)}
    with pytest.raises(ValueError, match="different ranks"):
        BlendedStream(mixed, WEIGHTS, batch_size=8)


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
    with pytest.raises(ValueError, match="corpus 'empty' has no rows"):
        BlendedStream(streams, {"web": 1, "empty": 1}, batch_size=4).steps_per_epoch()
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
