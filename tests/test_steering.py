"""Steering a run (docs/steering.md): skip batches, watch data stalls, trace a step to its rows.

* ``loader.skip(n)``: the state afterwards is the state of a run that iterated those ``n`` batches,
  the next batches are that run's next batches, nothing of the skipped ones is read, and it holds
  after a resume on another topology.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import streamshard as ss

from helpers import ids_of
from resume_harness import as_checkpoint, row_keys, same_batches
from test_packed import write_documents

WORKERS = [("threads", 2), ("processes", 2), ("none", 0)]


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    """Tests describe their topology explicitly; a torchrun environment must not leak in."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def make(path, **kwargs):
    return ss.ParquetStream(path, **{**dict(batch_size=50, shuffle=True, seed=3, rank=0, world_size=1), **kwargs})


def loader_of(path, kind, workers, **kwargs):
    options = {} if kind == "none" else {"workers": kind}
    return ss.StreamLoader(make(path, **kwargs), num_workers=workers, **options)


def take(loader, k):
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(k)]
    del iterator
    return batches


def real(batches) -> list[int]:
    ids = ids_of(batches)
    return ids[ids >= 0].tolist()


# -- skip ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, workers", WORKERS)
def test_skip_leaves_the_state_and_the_next_batches_of_a_run_that_iterated_them(skewed_corpus, kind, workers):
    reference = loader_of(skewed_corpus, kind, workers)
    epoch_length = len(reference)
    run = list(reference) + list(reference)  # two epochs, uninterrupted
    for k in (1, 5, epoch_length - 1, epoch_length, epoch_length + 3):
        iterated = loader_of(skewed_corpus, kind, workers)
        if k <= epoch_length:
            take(iterated, k)
        else:
            list(iterated)
            take(iterated, k - epoch_length)
        skipping = loader_of(skewed_corpus, kind, workers)
        skipping.skip(k)
        assert as_checkpoint(skipping.state_dict()) == as_checkpoint(iterated.state_dict()), f"skip({k})"
        assert skipping.epoch == iterated.epoch and len(skipping) == len(iterated), f"skip({k})"
        rest = list(skipping)
        end = epoch_length if k < epoch_length else 2 * epoch_length
        assert same_batches(rest, run[k:end]), f"the batches after skip({k}) are not the run's next ones"


def test_skipped_batches_are_not_read(skewed_corpus):
    produced = []  # the stream calls its stats_hook in the worker once per batch it makes
    loader = loader_of(skewed_corpus, "threads", 2)
    loader.dataset.stats_hook = lambda stats: produced.append(stats.worker)
    total = len(loader)
    loader.skip(total - 3)
    rest = list(loader)
    assert len(rest) == 3 and len(produced) == 3, f"workers made {len(produced)} batches for 3"


@pytest.mark.parametrize("kind, workers", [("threads", 2), ("processes", 2)])
def test_skip_inside_the_loop_goes_on_after_the_skipped_batches(skewed_corpus, kind, workers):
    reference = loader_of(skewed_corpus, kind, workers)
    epoch_length = len(reference)
    run = list(reference) + list(reference)
    loader = loader_of(skewed_corpus, kind, workers)
    seen = []
    for batch in loader:
        seen.append(batch)
        if len(seen) == 3:
            loader.skip(4)  # batches 3..6 of the epoch
    assert same_batches(seen, run[:3] + run[7:epoch_length])
    seen = []
    for batch in loader:  # the next epoch; a skip past its end ends the loop and goes on into epoch 2
        seen.append(batch)
        if len(seen) == 2:
            loader.skip(epoch_length)
    assert same_batches(seen, run[epoch_length:epoch_length + 2]) and loader.epoch == 2
    assert loader.batches_left() == epoch_length - 2


def test_skip_after_a_resume_on_another_topology_is_iterating_there(skewed_corpus):
    """2 ranks take 3 batches; 3 ranks resume and skip 2 (compared with 3 ranks iterating 2);
    1 rank resumes the skip's state: every row exactly once over what was trained and skipped."""

    def loader(rank, world):
        return ss.StreamLoader(make(skewed_corpus, rank=rank, world_size=world), num_workers=2)

    trained: Counter = Counter()
    for rank in range(2):
        first = loader(rank, 2)
        trained.update(row_keys(take(first, 3)))
    state = as_checkpoint(first.state_dict())
    skipped: Counter = Counter()
    for rank in range(3):
        iterated, skipping = loader(rank, 3), loader(rank, 3)
        iterated.load_state_dict(state)
        skipped.update(row_keys(take(iterated, 2)))
        skipping.load_state_dict(state)
        skipping.skip(2)
        assert skipping.state_dict() == iterated.state_dict()
        assert len(skipping) == len(iterated) and skipping.batches_left() == iterated.batches_left()
    after = as_checkpoint(skipping.state_dict())
    last = ss.StreamLoader(make(skewed_corpus, rank=0, world_size=1), num_workers=3)
    last.load_state_dict(after)
    trained.update(row_keys(list(last)))
    assert not (trained & skipped), "a skipped row was delivered"
    total = make(skewed_corpus).catalog.num_rows
    assert sorted(trained + skipped) == [(0, i) for i in range(total)], "every row once, trained or skipped"


class Indexed(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i)}


def test_skip_on_a_map_style_loader(skewed_corpus):
    def make_loader():
        return ss.StreamLoader(Indexed(37), sampler=ss.ElasticSampler(37, 1, 0, seed=3), batch_size=4)

    run = list(make_loader())
    loader = make_loader()
    loader.skip(3)
    assert same_batches(list(loader), run[3:])
    iterated = make_loader()
    take(iterated, 3)
    loader = make_loader()
    loader.skip(3)
    assert loader.state_dict() == iterated.state_dict()


def test_skip_refuses_a_negative_count(skewed_corpus):
    with pytest.raises(ValueError, match="num_batches"):
        loader_of(skewed_corpus, "none", 0).skip(-1)


# -- stats -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, workers", WORKERS)
def test_stats_count_what_the_loop_and_every_worker_did(skewed_corpus, kind, workers):
    loader = loader_of(skewed_corpus, kind, workers, shuffle=False)
    total = loader.dataset.catalog.num_rows
    batches = list(loader)
    stats = loader.stats()
    assert stats["batches"] == len(batches) and stats["rows"] == len(real(batches)) == total
    assert 0 < stats["wait_s"] and stats["max_wait_s"] <= stats["wait_s"]
    assert len(stats["workers"]) == max(workers, 1)
    assert sum(w["rows"] for w in stats["workers"]) == total, "each worker counts the rows it made, over all"
    assert sum(w["batches"] for w in stats["workers"]) == len(batches)
    assert all(w["busy_s"] > 0 and w["read_bytes"] > 0 and w["read_s"] >= w["io_s"] for w in stats["workers"])
    assert stats["bytes_read"] == sum(w["read_bytes"] for w in stats["workers"]) > 0
    list(loader)  # a second epoch adds to the counts
    again = loader.stats()
    assert again["batches"] == 2 * len(batches) and sum(w["rows"] for w in again["workers"]) == 2 * total
    assert again["bytes_read"] > stats["bytes_read"]


def test_stats_of_blended_and_packed_streams_count_their_workers_reads(skewed_corpus, small_corpus, tmp_path):
    corpora = {"a": make(skewed_corpus), "b": make(small_corpus)}
    blend = ss.BlendedStream(corpora, weights={"a": 0.5, "b": 0.5}, batch_size=32, rank=0, world_size=1)
    documents = tmp_path / "docs"
    write_documents(documents, [[120, 40], [60]])
    packed = ss.PackedStream(make(str(documents)), column="input_ids", seq_len=64, batch_size=4)
    for stream in (blend, packed):
        loader = ss.StreamLoader(stream, num_workers=2)
        batches = list(loader)
        stats = loader.stats()
        assert stats["batches"] == len(batches) and stats["rows"] == len(real(batches))
        assert all(w["batches"] > 0 and w["read_bytes"] > 0 for w in stats["workers"]), type(stream).__name__


def _slow_batch(batch):
    if int(batch["sample_id"][0]) == SLOW_FIRST_ID:
        time.sleep(0.5)
    return batch


SLOW_FIRST_ID = 150  # unshuffled, batch_size 50: the fourth batch (step 3)


def test_a_stall_is_counted_with_the_step_it_held_up(skewed_corpus):
    loader = ss.StreamLoader(make(skewed_corpus, shuffle=False, transform=_slow_batch), num_workers=0, stall_s=0.3)
    batches = list(loader)
    stats = loader.stats()
    assert int(batches[3]["sample_id"][0]) == SLOW_FIRST_ID
    steps = [s["step"] for s in stats["recent_stalls"]]
    assert 3 in steps and set(steps) <= {0, 3}, stats["recent_stalls"]  # step 0 may wait for start-up
    assert stats["stalls"] == len(steps) and stats["stall_wait_s"] >= 0.5 and stats["wait_s"] >= 0.5
    assert stats["stall_threshold_s"] == 0.3
    with pytest.raises(ValueError, match="stall_s"):
        ss.StreamLoader(make(skewed_corpus), stall_s=-1)


# -- provenance ----------------------------------------------------------------------------------


def delivered_rows(batch, keys=("sample_id",)):
    real = batch["sample_id"].reshape(-1) >= 0
    return {k: batch[k].reshape(-1)[real].numpy() for k in keys}


def assert_same_rows(planned, batches_per_rank, step, keys=("sample_id",)):
    assert len(planned) == len(batches_per_rank), f"step {step}: ranks"
    for rank, (rows, batches) in enumerate(zip(planned, batches_per_rank)):
        got = delivered_rows(batches[step], keys)
        for key in keys:
            assert rows[key].tolist() == got[key].tolist(), f"step {step}, rank {rank}, {key}"


def test_the_rows_of_a_global_step_on_every_rank_are_the_rows_delivered(skewed_corpus):
    world, workers = 2, 2
    run = []
    for rank in range(world):
        loader = ss.StreamLoader(make(skewed_corpus, rank=rank, world_size=world, shuffle_window=3), num_workers=workers)
        run.append(list(loader) + list(loader))  # epochs 0 and 1, back to back
    probe = make(skewed_corpus, rank=0, world_size=world, shuffle_window=3)
    steps = len(run[0])
    for step in sorted({0, 1, 5, steps // 2 - 1, steps // 2, steps // 2 + 3, steps - 1}):
        assert_same_rows(probe.step_sample_ids(step, num_workers=workers), run, step)
    per_epoch = steps // 2
    assert_same_rows(probe.step_sample_ids(4, num_workers=workers, epoch=1), run, per_epoch + 4)
    with pytest.raises(ValueError, match="past the end of epoch 0"):
        probe.step_sample_ids(per_epoch, num_workers=workers, epoch=0)


def test_steps_before_a_resize_are_answered_for_the_ranks_that_ran_them(skewed_corpus):
    def loader(rank, world):
        return ss.StreamLoader(make(skewed_corpus, rank=rank, world_size=world), num_workers=2)

    before = [take(loader(rank, 2), 3) for rank in range(2)]
    state = as_checkpoint(_state_after(loader(0, 2), 3))
    after = []
    for rank in range(3):
        resumed = loader(rank, 3)
        resumed.load_state_dict(state)
        after.append(list(resumed))
    probe = make(skewed_corpus, rank=0, world_size=3)
    probe.load_state_dict(state)
    for step in range(3):
        assert_same_rows(probe.step_sample_ids(step, num_workers=2, epoch=0), before, step)
    for step in (3, 4, 3 + len(after[0]) - 1):
        assert_same_rows(probe.step_sample_ids(step, num_workers=2, epoch=0), after, step - 3)


def _state_after(loader, k):
    take(loader, k)
    return loader.state_dict()


def test_the_rows_of_a_blend_step_name_their_corpus(skewed_corpus, small_corpus):
    def blend(rank):
        corpora = {"a": make(skewed_corpus, rank=rank, world_size=2), "b": make(small_corpus, rank=rank, world_size=2)}
        return ss.BlendedStream(corpora, weights={"a": 0.6, "b": 0.4}, batch_size=16, order="shuffled")

    run = []
    for rank in range(2):
        loader = ss.StreamLoader(blend(rank), num_workers=2)
        run.append(list(loader) + list(loader))  # two epochs: the blend map differs by epoch
    for step in (0, 3, len(run[0]) // 2, len(run[0]) - 1):
        assert_same_rows(blend(0).step_sample_ids(step, num_workers=2), run, step, keys=("sample_id", "corpus"))


def test_a_packed_stream_says_it_cannot_name_a_steps_documents(tmp_path):
    write_documents(tmp_path / "docs", [[40]])
    packed = ss.PackedStream(make(str(tmp_path / "docs")), seq_len=64, batch_size=4)
    with pytest.raises(NotImplementedError, match="document"):
        packed.step_sample_ids(0)


def test_the_docs_tensorboard_snippet_logs_the_stats(skewed_corpus, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    page = (Path(__file__).resolve().parents[1] / "docs" / "steering.md").read_text()
    snippet = page.split("<!-- stats-tensorboard -->\n```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    loader = loader_of(skewed_corpus, "threads", 2, batch_size=1)  # more than 100 steps
    exec(compile(snippet, "docs/steering.md", "exec"), {"loader": loader})
    events = EventAccumulator(str(tmp_path / "runs" / "data"))
    events.Reload()
    rows = events.Scalars("data/rows")
    assert [e.step for e in rows][:2] == [0, 100] and rows[1].value == 101
    assert {"data/wait_s", "data/worker0/busy_s", "data/worker1/decode_s"} <= set(events.Tags()["scalars"])


# -- set_weights -----------------------------------------------------------------------------------

BASE = {"a": 0.5, "b": 0.5}
STEERED = {"a": 0.9, "b": 0.1}


def blend_of(skewed_corpus, small_corpus, rank, world, **kwargs):
    corpora = {"a": make(skewed_corpus, rank=rank, world_size=world), "b": make(small_corpus, rank=rank, world_size=world)}
    options = {**dict(weights=BASE, batch_size=16, num_samples=200, order="shuffled"), **kwargs}
    return ss.BlendedStream(corpora, **options)


def epoch_of(loader):
    """The rest of the loader's epoch."""
    return list(loader)


def test_new_weights_from_where_the_loader_stands_follow_the_rest_of_the_epoch_exactly_once(skewed_corpus,
                                                                                             small_corpus):
    world, workers, k = 2, 2, 2
    before, after, later = Counter(), Counter(), Counter()
    for rank in range(world):
        loader = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, rank, world), num_workers=workers)
        before.update(row_keys(take(loader, k)))
        loader.dataset.set_weights(STEERED)
        after.update(row_keys(epoch_of(loader)))
        later.update(row_keys(epoch_of(loader)))
    n = 200
    remaining = n - sum(before.values())
    by_corpus = lambda rows: [sum(c for (corpus, _), c in rows.items() if corpus == k) for k in (0, 1)]  # noqa: E731
    assert by_corpus(after) == ss.blend_counts([0.9, 0.1], remaining).tolist(), "the rest follows the new weights"
    assert by_corpus(later) == ss.blend_counts([0.9, 0.1], n).tolist(), "and so does the next epoch"
    everything = before + after + later
    assert max(everything.values()) == 1, "no row twice (no corpus finished an epoch of itself here)"



def by_corpus(rows):
    return [sum(c for (corpus, _), c in rows.items() if corpus == k) for k in (0, 1)]


def test_a_state_after_a_change_resumes_it_in_a_blend_built_with_the_original_weights(skewed_corpus, small_corpus):
    def loader(rank, world, workers):
        return ss.StreamLoader(blend_of(skewed_corpus, small_corpus, rank, world), num_workers=workers)

    # same topology: byte for byte
    first = loader(0, 2, 2)
    take(first, 2)
    first.dataset.set_weights(STEERED)
    take(first, 3)
    state = as_checkpoint(first.state_dict())
    assert state["weight_changes"] and state["fingerprint"]["weights"] == [0.5, 0.5]
    rest = epoch_of(first) + epoch_of(first)
    resumed = loader(0, 2, 2)
    resumed.load_state_dict(state)
    assert same_batches(epoch_of(resumed) + epoch_of(resumed), rest)
    # another topology: 2x2 -> 3x1, the same rows for the rest of the epoch and the next one
    expected_rest, expected_next = Counter(), Counter()
    for rank in range(2):
        run = loader(rank, 2, 2)
        take(run, 2)
        run.dataset.set_weights(STEERED)
        take(run, 3)
        expected_rest.update(row_keys(epoch_of(run)))
        expected_next.update(row_keys(epoch_of(run)))
    got_rest, got_next = Counter(), Counter()
    for rank in range(3):
        resized = loader(rank, 3, 1)
        resized.load_state_dict(state)
        got_rest.update(row_keys(epoch_of(resized)))
        got_next.update(row_keys(epoch_of(resized)))
    assert got_rest == expected_rest and got_next == expected_next


def test_changes_on_several_topologies_deliver_each_row_once_by_the_weights_in_force(skewed_corpus, small_corpus):
    delivered = Counter()
    phases = [(2, 2, 2, STEERED), (3, 1, 1, {"a": 0.2, "b": 0.8}), (1, 3, None, None)]
    state, consumed = None, 0
    for world, workers, take_n, weights in phases:
        states = []
        for rank in range(world):
            loader = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, rank, world), num_workers=workers)
            if state is not None:
                loader.load_state_dict(state)
            batches = take(loader, take_n) if take_n is not None else epoch_of(loader)
            delivered.update(row_keys(batches))
            if weights is not None:
                loader.dataset.set_weights(weights)
            states.append(as_checkpoint(loader.state_dict()))
        assert all(s == states[0] for s in states)
        state = states[0]
        if weights is not None:
            consumed = sum(delivered.values())
            before_last = Counter(delivered)
    assert state["epoch"] == 1 and [c[0] for c in state["weight_changes"]] == [0, 0]
    assert [[s[0], s[1]] for s in state["weight_changes"][1][1]] == [[2, 2], [3, 1]], "the second change saw both"
    assert max(delivered.values()) == 1 and sum(delivered.values()) == 200, "the epoch's 200 positions, once each"
    assert by_corpus(delivered - before_last) == ss.blend_counts([0.2, 0.8], 200 - consumed).tolist()


def test_a_corpus_can_be_added_and_dropped_between_epochs(skewed_corpus, small_corpus):
    blend = blend_of(skewed_corpus, small_corpus, 0, 1, weights={"a": 1.0, "b": 0.0})
    loader = ss.StreamLoader(blend, num_workers=2)
    first = row_keys(epoch_of(loader))
    blend.set_weights({"a": 0.5, "b": 0.5})  # the loader stands at the start of epoch 1
    second = row_keys(epoch_of(loader))
    blend.set_weights({"a": 0.4, "b": 0.6})
    third = row_keys(epoch_of(loader))
    blend.set_weights({"a": 1.0, "b": 0.0})
    fourth = row_keys(epoch_of(loader))
    assert [by_corpus(e) for e in (first, second, third, fourth)] == [[200, 0], [100, 100], [80, 120], [200, 0]]
    assert max((first + second + third + fourth).values()) == 1, "b draws 220 of its 229 rows, a 580 of its own"
    state = as_checkpoint(loader.state_dict())
    assert state["epoch"] == 4 and [c[0] for c in state["weight_changes"]] == [1, 2, 3]


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_set_weights_inside_the_loop_replans_after_the_batch_in_hand(skewed_corpus, small_corpus, kind):
    loader = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1), num_workers=2, workers=kind)
    seen = []
    for batch in loader:
        seen.append(batch)
        if len(seen) == 3:
            loader.dataset.set_weights(STEERED)
    head, rest = row_keys(seen[:3]), row_keys(seen[3:])
    assert by_corpus(rest) == ss.blend_counts([0.9, 0.1], 200 - sum(head.values())).tolist()
    assert max((head + rest).values()) == 1


def test_persistent_worker_processes_take_new_weights_between_epochs(skewed_corpus, small_corpus):
    blend = blend_of(skewed_corpus, small_corpus, 0, 1)
    loader = ss.StreamLoader(blend, num_workers=2, workers="processes", persistent_workers=True)
    first = row_keys(epoch_of(loader))
    blend.set_weights(STEERED)
    second = row_keys(epoch_of(loader))
    assert by_corpus(first) == [100, 100] and by_corpus(second) == [180, 20]


def test_changing_the_past_is_refused(skewed_corpus, small_corpus):
    blend = blend_of(skewed_corpus, small_corpus, 0, 1)
    blend.set_epoch(1)
    blend.set_weights(STEERED)
    blend.set_epoch(0)
    with pytest.raises(ss.StateError, match="weights"):
        blend.set_weights(BASE)
    plain = blend_of(skewed_corpus, small_corpus, 0, 1)
    next(iter(plain))  # a pass of epoch 0 without a StreamLoader: its start is behind us
    with pytest.raises(ss.StateError, match="weights"):
        plain.set_weights(STEERED)


def test_a_malformed_weight_change_in_a_state_is_refused_by_name(skewed_corpus, small_corpus):
    loader = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1))
    take(loader, 2)
    loader.dataset.set_weights(STEERED)
    state = as_checkpoint(loader.state_dict())
    for bad in ([[0, [], [0.5]]], [[0, [[1, 0, 2]], ["x", 1]]], "no", [[0, [[1, 0, 999]], [0.5, 0.5]]]):
        with pytest.raises(ss.StateError, match="weight_changes"):
            ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1)).load_state_dict({**state, "weight_changes": bad})


def test_each_row_once_per_corpus_epoch_when_weights_fall_and_rise_while_a_corpus_cycles(skewed_corpus, small_corpus):
    """Corpus b (229 rows) is lowered then raised mid-epoch on 2 ranks x 2 workers, then cycles through
    its own epochs: over the run, b's draws D must be whole corpus epochs plus the first D % 229 rows
    of the next (every row q or q + 1 times, and exactly D % 229 rows q + 1 times)."""
    delivered = Counter()
    for rank in range(2):
        loader = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, rank, 2), num_workers=2)
        delivered.update(row_keys(take(loader, 1)))
        loader.dataset.set_weights({"a": 0.9, "b": 0.1})
        delivered.update(row_keys(take(loader, 1)))
        loader.dataset.set_weights({"a": 0.1, "b": 0.9})
        for _ in range(3):
            delivered.update(row_keys(epoch_of(loader)))
    b = Counter({i: c for (k, i), c in delivered.items() if k == 1})
    draws = sum(b.values())
    whole, part = divmod(draws, 229)
    assert draws > 2 * 229, "b went through more than two of its epochs"
    assert len(b) == 229 and set(b.values()) <= {whole, whole + 1}
    assert sum(1 for c in b.values() if c == whole + 1) == part


def packed_blend(tmp_path, rank, world):
    if not (tmp_path / "x").exists():
        write_documents(tmp_path / "x", [[60, 40], [30]])
        write_documents(tmp_path / "y", [[50, 20]], seed=1)
    corpora = {"x": make(str(tmp_path / "x"), rank=rank, world_size=world),
               "y": make(str(tmp_path / "y"), rank=rank, world_size=world)}
    blend = ss.BlendedStream(corpora, weights={"x": 0.5, "y": 0.5}, batch_size=4, num_samples=120)
    return ss.PackedStream(blend, seq_len=16, batch_size=2)


def sequences(batches):
    """(corpus, first token) of every sequence (a pack's row holds one corpus's tokens; token values are
    their index in the corpus's token stream, so this names the sequence)."""
    out = Counter()
    for b in batches:
        for row in range(b["input_ids"].shape[0]):
            if b["sample_id"][row, 0] >= 0:
                out[(int(b["corpus"][row, 0]), int(b["input_ids"][row, 0]))] += 1
    return out


def test_a_packed_blend_takes_new_weights_for_its_sequences_and_resumes_them(tmp_path):
    first = ss.StreamLoader(packed_blend(tmp_path, 0, 2), num_workers=2)
    take(first, 2)
    first.dataset.set_weights({"x": 0.9, "y": 0.1})
    take(first, 1)
    state = as_checkpoint(first.state_dict())
    assert state["weight_changes"]
    expected, before, after = Counter(), Counter(), Counter()
    for rank in range(2):
        run = ss.StreamLoader(packed_blend(tmp_path, rank, 2), num_workers=2)
        before.update(sequences(take(run, 2)))
        run.dataset.set_weights({"x": 0.9, "y": 0.1})
        after.update(sequences(take(run, 1)))
        expected.update(sequences(epoch_of(run)))
    after.update(expected)
    assert by_corpus(after) == ss.blend_counts([0.9, 0.1], 120 - sum(before.values())).tolist()
    assert max((before + after).values()) == 1
    got = Counter()
    for rank in range(3):
        resized = ss.StreamLoader(packed_blend(tmp_path, rank, 3), num_workers=1)
        resized.load_state_dict(state)
        got.update(sequences(epoch_of(resized)))
    assert got == expected and sum(got.values()) > 0
    blend = packed_blend(tmp_path, 0, 1).source
    blend.set_weights({"x": 0.2, "y": 0.8})
    with pytest.raises(ValueError, match="set_weights on the PackedStream"):
        list(ss.StreamLoader(ss.PackedStream(blend, seq_len=16, batch_size=2)))


def test_new_weights_after_load_state_dict_apply_from_the_loaded_position(skewed_corpus, small_corpus):
    from torch.utils.data import DataLoader

    run = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1), num_workers=2)
    take(run, 3)
    state = as_checkpoint(run.state_dict())
    run.dataset.set_weights(STEERED)
    expected = epoch_of(run)
    loader = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1), num_workers=2)
    loader.load_state_dict(state)
    loader.dataset.set_weights(STEERED)
    assert same_batches(epoch_of(loader), expected)
    plain = blend_of(skewed_corpus, small_corpus, 0, 1)  # no StreamLoader: the pending state is where it applies
    plain.load_state_dict(state)
    plain.set_weights(STEERED)
    assert row_keys(DataLoader(plain, batch_size=None, num_workers=2)) == row_keys(expected)


def test_skip_on_a_blend_is_iterating_it(skewed_corpus, small_corpus):
    iterated = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1), num_workers=2)
    take(iterated, 4)
    skipping = ss.StreamLoader(blend_of(skewed_corpus, small_corpus, 0, 1), num_workers=2)
    skipping.skip(4)
    assert skipping.state_dict() == iterated.state_dict()
    assert same_batches(epoch_of(skipping), epoch_of(iterated))
