"""Steering a run (README, "Steering a run"): skip batches, watch data stalls, trace a step to its rows.

* ``loader.skip(n)``: the state afterwards is the state of a run that iterated those ``n`` batches,
  the next batches are that run's next batches, nothing of the skipped ones is read, and it holds
  after a resume on another topology.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset

import streamshard as ss

from helpers import ids_of
from resume_harness import as_checkpoint, row_keys, same_batches

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
