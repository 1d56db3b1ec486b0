"""Mid-epoch resume and elastic resizing of ParquetStream."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.elastic import Segment, remaining_stream, resume_plan, rows_delivered, worker_batches_delivered

from helpers import ids_of
from resume_harness import check_plain_resume, check_stateful_resume
from test_plan import configs, layouts, make_layout


def make_stream(path, rank=1, world=2, **kwargs):
    defaults = dict(batch_size=37, shuffle=True, seed=11, rank=rank, world_size=world)
    return lambda: ss.ParquetStream(path, **{**defaults, **kwargs})


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size, unit", [(37, "row_group"), (None, "file"), (500, "row_group")])
def test_plain_dataloader_resume_gives_exactly_the_remaining_batches(skewed_corpus, num_workers, batch_size, unit):
    make = make_stream(skewed_corpus, batch_size=batch_size, unit=unit)
    check_plain_resume(make, num_workers, stops=[0, 1, 5, 12, 10_000], epoch=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume_gives_exactly_the_remaining_batches(skewed_corpus, num_workers):
    check_stateful_resume(make_stream(skewed_corpus), num_workers, stops=[1, 4, 11], epoch=1)


def test_resume_past_the_last_real_batch_reproduces_padding_exactly(tmp_path):
    from streamshard.testing import write_corpus

    write_corpus(str(tmp_path), [[5], [300]])  # rank 0's block is short: it pads
    make = make_stream(str(tmp_path), rank=0, world=2, batch_size=None, unit="row_group", shuffle=False)
    ds = make()
    assert ds.epoch_summary()["padding_batches"] > 0
    check_plain_resume(make, 0, stops=[1, 2, 3])


def test_state_is_small_json_and_the_next_epoch_runs_normally(skewed_corpus):
    make = make_stream(skewed_corpus)
    ds = make()
    state = ds.state_dict(consumed_batches=3, num_workers=2)
    assert json.loads(json.dumps(state)) == state
    resumed = make()
    resumed.load_state_dict(state)
    list(DataLoader(resumed, batch_size=None, num_workers=2))
    resumed.set_epoch(1)
    fresh = make()
    fresh.set_epoch(1)
    after = ids_of(list(DataLoader(resumed, batch_size=None, num_workers=2)))
    np.testing.assert_array_equal(after, ids_of(list(DataLoader(fresh, batch_size=None, num_workers=2))))


def test_a_state_from_other_data_or_seed_is_refused(skewed_corpus, small_corpus):
    state = make_stream(skewed_corpus)().state_dict(consumed_batches=1)
    with pytest.raises(ValueError, match="seed"):
        make_stream(skewed_corpus, seed=12)().load_state_dict(state)
    with pytest.raises(ValueError, match="rows"):
        make_stream(small_corpus)().load_state_dict(state)
    with pytest.raises(ValueError, match="consumed_batches"):
        make_stream(skewed_corpus)().state_dict(consumed_batches=-1)


def run_phase(path, world, workers, state, take=None):
    """Every rank of a topology resumes from `state`; returns (per-rank batches consumed, next state)."""
    per_rank = []
    for rank in range(world):
        ds = make_stream(path, rank=rank, world=world)()
        if state is not None:
            ds.load_state_dict(state)
        batches = list(DataLoader(ds, batch_size=None, num_workers=workers))
        per_rank.append(batches if take is None else batches[:take])
    counts = {len(b) for b in per_rank}
    assert take is not None or len(counts) == 1, f"unequal steps after resume: {counts}"
    k = len(per_rank[0])
    return per_rank, ds.state_dict(consumed_batches=k, num_workers=workers)


@pytest.mark.parametrize("k1, k2", [(3, 2), (1, 7), (0, 0)])
def test_elastic_resume_4_to_2_to_3_ranks_delivers_every_row_once(skewed_corpus, k1, k2):
    total = make_stream(skewed_corpus)().catalog.num_rows
    first, state = run_phase(skewed_corpus, 4, 2, None, take=k1)
    second, state = run_phase(skewed_corpus, 2, 0, state, take=k2)
    third, _ = run_phase(skewed_corpus, 3, 3, state)
    ids = np.concatenate([ids_of(b) for phase in (first, second, third) for b in phase])
    real = np.sort(ids[ids >= 0])
    np.testing.assert_array_equal(real, np.arange(total))


@settings(max_examples=150, deadline=None)
@given(
    files=layouts,
    config=configs,
    topologies=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4), st.floats(0, 1)), min_size=1, max_size=4),
)
def test_folding_any_resize_history_leaves_each_unconsumed_row_exactly_once(files, config, topologies):
    layout = make_layout(files)
    history: list[Segment] = []
    consumed: list[tuple[int, int, int]] = []  # (rg, lo, hi) pieces delivered so far
    for world, workers, fraction in topologies:
        if history and (history[-1].world_size, history[-1].num_workers) == (world, workers):
            continue  # the dataset merges a continuation on the same topology into one segment
        plan, _ = resume_plan(layout, config, 0, history, world, workers)
        n = max(workers, 1)
        k = int(fraction * plan.steps * n)
        for g in range(plan.num_workers):
            done = rows_delivered(plan, g, worker_batches_delivered(k, workers, g % n))
            taken, _ = plan.split_delivered(plan.worker_plan(g).pieces, done)
            consumed.extend(zip(taken.rg.tolist(), taken.lo.tolist(), taken.hi.tolist()))
        history.append(Segment(world, workers, k))
    rest = remaining_stream(*_last(layout, config, history))
    pieces = consumed + list(zip(rest.rg.tolist(), rest.lo.tolist(), rest.hi.tolist()))
    first = layout.rg_first_id
    spans = sorted((int(first[rg] + lo), int(first[rg] + hi)) for rg, lo, hi in pieces if hi > lo)
    delivered_total = sum(b - a for a, b in spans)
    for (a0, b0), (a1, _) in zip(spans, spans[1:]):
        assert b0 <= a1, "a row was delivered twice"
    if config.uneven == "pad":
        assert delivered_total == int(layout.rg_rows.sum()), "a row was lost"


def _last(layout, config, history):
    plan, _ = resume_plan(layout, config, 0, history[:-1], history[-1].world_size, history[-1].num_workers)
    return plan, history[-1]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 45])
def test_windowed_shuffle_resumes_exactly(skewed_corpus, num_workers, batch_size):
    make = make_stream(skewed_corpus, batch_size=batch_size, shuffle_window=3)
    check_plain_resume(make, num_workers, stops=[1, 3, 8], epoch=1)


def test_windowed_shuffle_survives_elastic_resizing(skewed_corpus):
    total = make_stream(skewed_corpus)().catalog.num_rows

    def phase(world, workers, state, take=None):
        per_rank = []
        for rank in range(world):
            ds = make_stream(skewed_corpus, rank=rank, world=world, shuffle_window=4, batch_size=29)()
            if state is not None:
                ds.load_state_dict(state)
            batches = list(DataLoader(ds, batch_size=None, num_workers=workers))
            per_rank.append(batches if take is None else batches[:take])
        return per_rank, ds.state_dict(consumed_batches=len(per_rank[0]), num_workers=workers)

    first, state = phase(3, 2, None, take=5)
    second, _ = phase(2, 1, state)
    ids = np.concatenate([ids_of(b) for p in (first, second) for b in p])
    np.testing.assert_array_equal(np.sort(ids[ids >= 0]), np.arange(total))


def test_windowed_shuffle_mixes_rows_of_several_row_groups_in_one_batch(tmp_path):
    from streamshard.testing import write_corpus

    write_corpus(str(tmp_path), [[100] * 8])
    plain = ss.ParquetStream(str(tmp_path), batch_size=50, shuffle=True, rank=0, world_size=1)
    mixed = ss.ParquetStream(str(tmp_path), batch_size=50, shuffle=True, shuffle_window=4, rank=0, world_size=1)
    sources = lambda ds: [len(set((b["sample_id"] // 100).tolist())) for b in ds]  # noqa: E731
    assert max(sources(plain)) <= 2 < min(sources(mixed))
