"""Mid-epoch resume and elastic resizing of ParquetStream through StreamLoader's own checkpoint."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.plan.elastic import Segment, remaining_stream, resume_plan, rows_delivered, worker_batches_delivered
from streamshard.testing import write_corpus

from helpers import ids_of
from resume_harness import check_elastic_resume, check_loader_resume, check_stateful_resume
from strategies import configs, layouts, make_layout


def make_stream(path, rank=1, world=2, **kwargs):
    defaults = dict(batch_size=37, shuffle=True, seed=11, rank=rank, world_size=world)
    return lambda: ss.ParquetStream(path, **{**defaults, **kwargs})


def make_ranked(path, **kwargs):
    return lambda rank, world: make_stream(path, rank=rank, world=world, **kwargs)()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size, unit", [(37, "row_group"), (None, "file"), (500, "row_group")])
def test_stream_loader_resume_gives_exactly_the_remaining_batches(skewed_corpus, num_workers, batch_size, unit):
    make = make_stream(skewed_corpus, batch_size=batch_size, unit=unit)
    check_loader_resume(make, num_workers, stops=[0, 1, 5, 12, 10_000], epoch=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resume_gives_exactly_the_remaining_batches(skewed_corpus, num_workers):
    check_stateful_resume(make_stream(skewed_corpus), num_workers, stops=[1, 4, 11], epoch=1)


def test_resume_past_the_last_real_batch_reproduces_padding_exactly(tmp_path):
    write_corpus(str(tmp_path), [[5], [300]])  # rank 0's block is short: it pads
    make = make_stream(str(tmp_path), rank=0, world=2, batch_size=None, unit="row_group", shuffle=False)
    assert make().epoch_summary()["padding_batches"] > 0
    check_loader_resume(make, 0, stops=[1, 2, 3])


def test_a_loader_moves_to_the_next_epoch_itself_and_it_matches_a_fresh_one(skewed_corpus):
    make = make_stream(skewed_corpus)
    first = ss.StreamLoader(make(), num_workers=2)
    iterator = iter(first)
    [next(iterator) for _ in range(3)]
    resumed = ss.StreamLoader(make(), num_workers=2)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    list(resumed)  # the rest of epoch 0
    assert resumed.epoch == 1
    fresh = ss.StreamLoader(make(), num_workers=2)
    fresh.set_epoch(1)
    np.testing.assert_array_equal(ids_of(list(resumed)), ids_of(list(fresh)))


def test_breaking_out_and_iterating_again_continues_where_the_loop_stopped(skewed_corpus):
    make = make_stream(skewed_corpus)
    full = list(ss.StreamLoader(make(), num_workers=2))
    loader = ss.StreamLoader(make(), num_workers=2)
    got = []
    for stop in (3, 4, 10_000):
        for batch in loader:
            got.append(batch)
            if len(got) >= stop:
                break
        if len(got) == len(full):
            break
        assert len(loader) == len(full), "len(loader) is the whole epoch, constant through it"
    np.testing.assert_array_equal(ids_of(got), ids_of(full))
    assert loader.epoch == 1 and len(loader) == len(full), "a finished epoch moves the loader to the next"


@pytest.mark.parametrize("phases", [
    [(4, 2, 3), (2, 0, 2), (3, 3, None)],
    [(4, 2, 1), (2, 0, 7), (3, 3, None)],
    [(2, 1, 0), (3, 2, None)],
    [(1, 0, 5), (1, 0, 3), (5, 1, 2), (2, 2, None)],
])
def test_elastic_resume_delivers_every_row_once_with_equal_steps(skewed_corpus, phases):
    check_elastic_resume(make_ranked(skewed_corpus), phases)


def test_windowed_shuffle_resumes_exactly_and_elastically(skewed_corpus):
    check_loader_resume(make_stream(skewed_corpus, batch_size=45, shuffle_window=3), 2, stops=[1, 3, 8], epoch=1)
    check_loader_resume(make_stream(skewed_corpus, batch_size=None, shuffle_window=3), 0, stops=[2], epoch=1)
    check_elastic_resume(make_ranked(skewed_corpus, shuffle_window=4, batch_size=29), [(3, 2, 5), (2, 1, None)])


def test_windowed_shuffle_mixes_rows_of_several_row_groups_in_one_batch(tmp_path):
    write_corpus(str(tmp_path), [[100] * 8])
    plain = ss.ParquetStream(str(tmp_path), batch_size=50, shuffle=True, shuffle_window=1, rank=0, world_size=1)
    mixed = ss.ParquetStream(str(tmp_path), batch_size=50, shuffle=True, shuffle_window=4, rank=0, world_size=1)
    sources = lambda ds: [len(set((b["sample_id"] // 100).tolist())) for b in ds]  # noqa: E731
    assert max(sources(plain)) <= 2 < min(sources(mixed))


def _saved_state(path, **kwargs):
    loader = ss.StreamLoader(make_stream(path, **kwargs)(), num_workers=2)
    iterator = iter(loader)
    [next(iterator) for _ in range(2)]
    return loader.state_dict()


@pytest.mark.parametrize("field, change", [
    ("seed", {"seed": 12}), ("batch_size", {"batch_size": 64}), ("unit", {"unit": "file"}),
    ("shuffle_window", {"shuffle_window": 4}), ("columns", {"columns": ["id", "input_ids"]}),
    ("shuffle", {"shuffle": False}), ("uneven", {"uneven": "drop"}),
])
def test_a_state_saved_with_other_settings_is_refused_naming_the_field(skewed_corpus, field, change):
    state = _saved_state(skewed_corpus)
    with pytest.raises(ss.StateError, match=f"{field}="):
        ss.StreamLoader(make_stream(skewed_corpus, **change)()).load_state_dict(state)


def test_a_state_of_other_data_or_rewritten_row_groups_is_refused(tmp_path, small_corpus):
    write_corpus(str(tmp_path / "a"), [[40, 60], [100]])
    state = _saved_state(str(tmp_path / "a"))
    with pytest.raises(ss.StateError, match="catalog="):
        ss.StreamLoader(make_stream(small_corpus)()).load_state_dict(state)
    write_corpus(str(tmp_path / "a"), [[50, 50], [100]])  # same files and rows, other row groups
    with pytest.raises(ss.StateError, match="catalog=.*row groups changed"):
        ss.StreamLoader(make_stream(str(tmp_path / "a"))()).load_state_dict(state)


def test_a_state_saved_by_an_older_planner_is_refused_not_resumed_into_other_rows(skewed_corpus):
    """The shuffled order changed (spread files, widened windows): an older checkpoint names its rows
    by the old order, so resuming it must fail, saying why."""
    state = _saved_state(skewed_corpus, shuffle=True)
    state["fingerprint"]["order"] = 2
    with pytest.raises(ss.StateError, match="order=2 but this .* has order=3"):
        ss.StreamLoader(make_stream(skewed_corpus, shuffle=True)()).load_state_dict(state)
    del state["fingerprint"]["order"]  # saved before the order was recorded at all
    with pytest.raises(ss.StateError, match="has no 'order'"):
        ss.StreamLoader(make_stream(skewed_corpus, shuffle=True)()).load_state_dict(state)


@pytest.mark.parametrize("tamper", [
    lambda s: s["history"][-1].__setitem__(2, 10**12),
    lambda s: s.update(history={}),
    lambda s: s["history"][-1].__setitem__(1, 10**9),
    lambda s: s["history"][-1].__setitem__(0, 0),
    lambda s: s["history"][-1].__setitem__(2, "3"),
    lambda s: s["history"][-1].append(1),
    lambda s: s["history"].__setitem__(-1, {"world_size": 2, "num_workers": 2}),
    lambda s: s.update(epoch=-1),
    lambda s: s.update(version=1),
    lambda s: s.pop("fingerprint"),
    lambda s: s["fingerprint"].update(extra=1),
    lambda s: s.update(kind="blend"),
])
def test_a_malformed_or_out_of_range_state_is_refused_at_once(skewed_corpus, tamper):
    state = _saved_state(skewed_corpus)
    tamper(state)
    started = time.monotonic()
    with pytest.raises(ss.StateError):
        ss.StreamLoader(make_stream(skewed_corpus)()).load_state_dict(state)
    assert time.monotonic() - started < 5  # refused, never a hang (loose: a shared machine)


def test_the_main_process_cannot_save_what_dataloader_workers_delivered(skewed_corpus):
    ds = make_stream(skewed_corpus)()
    ds.set_epoch(0)
    iterator = iter(DataLoader(ds, batch_size=None, num_workers=2))
    [next(iterator) for _ in range(3)]
    with pytest.raises(ss.StateError, match="StreamLoader"):
        ds.state_dict()


def test_len_and_steps_per_epoch_say_what_is_delivered_after_resizing(skewed_corpus):
    loader = ss.StreamLoader(make_stream(skewed_corpus, rank=0, world=4)(), num_workers=2)
    iterator = iter(loader)
    [next(iterator) for _ in range(5)]
    state = loader.state_dict()
    for rank in range(3):
        ds = make_stream(skewed_corpus, rank=rank, world=3)()
        resumed = ss.StreamLoader(ds, num_workers=1)
        resumed.load_state_dict(state)
        expected = len(resumed) - 5  # len counts the 5 batches before the resize, as a framework's index does
        assert ds.steps_per_epoch(num_workers=1) == expected
        assert len(list(resumed)) == expected
    plain = make_stream(skewed_corpus)()
    with pytest.raises(TypeError, match="num_workers"):
        len(plain)
    plain.set_epoch(0)
    list(DataLoader(plain, batch_size=None, num_workers=2))
    assert len(plain) == plain.steps_per_epoch(num_workers=2)


def test_a_stream_loader_refuses_what_is_not_a_stream(skewed_corpus):
    with pytest.raises(ValueError, match="streamshard stream"):
        ss.StreamLoader([1, 2, 3])
    with pytest.raises(ValueError, match="num_workers"):
        ss.StreamLoader(make_stream(skewed_corpus)(), num_workers=-1)


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
    plan, _ = resume_plan(layout, config, 0, history[:-1], history[-1].world_size, history[-1].num_workers)
    rest = remaining_stream(plan, history[-1])
    pieces = consumed + list(zip(rest.rg.tolist(), rest.lo.tolist(), rest.hi.tolist()))
    first = layout.rg_first_id
    spans = sorted((int(first[rg] + lo), int(first[rg] + hi)) for rg, lo, hi in pieces if hi > lo)
    for (a0, b0), (a1, _) in zip(spans, spans[1:]):
        assert b0 <= a1, "a row was delivered twice"
    # With "drop" too: a resize loses nothing; only the final topology's own equal steps drop rows.
    assert sum(b - a for a, b in spans) == int(layout.rg_rows.sum()), "a row was lost"


def test_resizing_with_drop_loses_only_what_the_final_topology_drops(skewed_corpus):
    def make(rank, world):
        return make_stream(skewed_corpus, rank=rank, world=world, uneven="drop", batch_size=64)()

    total = make(0, 1).catalog.num_rows
    state, delivered = None, []
    for world, workers, take in [(4, 2, 2), (3, 1, None)]:
        for rank in range(world):
            loader = ss.StreamLoader(make(rank, world), num_workers=workers)
            if state is not None:
                loader.load_state_dict(state)
            if rank == 0 and take is None:
                final = loader.dataset.planner.start(0, loader.dataset.origin(), 0, world, 0, workers)
                dropped = final.schedule.plan.dropped_rows()
            batches = list(itertools.islice(loader, take))
            delivered.append(ids_of(batches))
            saved = loader.state_dict()
        state = saved
    ids = np.concatenate(delivered)
    real = ids[ids >= 0]
    assert len(np.unique(real)) == len(real), "a row delivered twice"
    assert len(real) == total - dropped, f"{total - dropped - len(real)} rows lost beyond what the final topology drops"


def test_changing_the_epoch_inside_a_pass_is_refused_not_miscounted(skewed_corpus):
    ds = make_stream(skewed_corpus)()
    loader = ss.StreamLoader(ds, num_workers=2)
    with pytest.raises(ss.StateError, match=r"set_epoch\(1\) was called .* while StreamLoader was delivering epoch 0"):
        for step, _ in enumerate(loader):
            if step == 2:
                ds.set_epoch(1)  # a plausible slip: the epoch bump moved into the loop


def test_a_state_written_before_segments_were_lists_still_resumes(skewed_corpus):
    state = _saved_state(skewed_corpus)
    old = {**state, "history": [dict(zip(("world_size", "num_workers", "batches"), s)) for s in state["history"]]}
    for saved in (state, old):
        loader = ss.StreamLoader(make_stream(skewed_corpus)(), num_workers=2)
        loader.load_state_dict(saved)
        assert loader.state_dict() == state
