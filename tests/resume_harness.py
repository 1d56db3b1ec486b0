"""One resume harness for everything that iterates: stop after k batches, resume, compare.

* ``check_loader_resume``: ``StreamLoader`` on one topology; the resumed pass must be byte for
  byte the rest of the uninterrupted one, ``len(loader)`` the whole epoch before and after (the
  frameworks' contract: their restored batch index + the resumed pass = ``len``), and a state saved
  on the epoch's last batch the start of the next epoch.
* ``check_elastic_resume``: ``StreamLoader`` over a sequence of topologies (world size, workers,
  batches taken); every rank's state must be the same, steps equal across ranks in every phase,
  and the rows delivered over all phases exactly those of an uninterrupted run.
* ``check_stateful_resume``: torchdata's ``StatefulDataLoader`` (per-worker states), same topology.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

import streamshard as ss

MAX_STATE_BYTES = 2_000


def same_batches(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, dict):
            if x.keys() != y.keys() or not all(_same(x[k], y[k]) for k in x):
                return False
        elif not _same(x, y):
            return False
    return True


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    return x == y


def with_random_stops(stops: list[int], length: int, count: int, seed: int) -> list[int]:
    """The given stop points plus ``count`` drawn uniformly from [0, length] (seeded: reproducible)."""
    rng = random.Random(seed)
    return sorted(set(stops) | {rng.randint(0, length) for _ in range(count)})


def as_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint file would give back: JSON, and small."""
    text = json.dumps(state)
    assert len(text) < MAX_STATE_BYTES, f"state must stay small, got {len(text)} bytes"
    return json.loads(text)


def row_keys(batches: list[dict[str, Any]]) -> Counter:
    """The real rows of some batches as a multiset of (corpus, sample_id)."""
    keys: Counter = Counter()
    for b in batches:
        ids = b["sample_id"].reshape(-1).numpy()
        corpus = b["corpus"].reshape(-1).numpy() if "corpus" in b else np.zeros_like(ids)
        real = ids >= 0
        keys.update(zip(corpus[real].tolist(), ids[real].tolist()))
    return keys


def check_loader_resume(make: Callable[[], Any], num_workers: int, stops: list[int], epoch: int = 0,
                        random_stops: int = 3) -> None:
    """Stop a StreamLoader after k batches, resume a fresh one from its state: the rest must match."""
    reference = ss.StreamLoader(make(), num_workers=num_workers)
    reference.set_epoch(epoch)
    assert len(reference) == reference.dataset.steps_per_epoch(num_workers)
    full = list(reference)
    next_epoch = list(reference)
    for k in with_random_stops(stops, len(full), random_stops, seed=epoch * 1000 + num_workers):
        k = min(k, len(full))
        first = ss.StreamLoader(make(), num_workers=num_workers)
        first.set_epoch(epoch)
        iterator = iter(first)
        head = [next(iterator) for _ in range(k)]
        del iterator
        assert len(first) == len(full), "len(loader) is the whole epoch, whatever was consumed"
        state = as_checkpoint(first.state_dict())
        resumed = ss.StreamLoader(make(), num_workers=num_workers)
        resumed.load_state_dict(state)
        rest = list(resumed)
        if k < len(full):
            assert resumed.epoch == epoch + 1 and len(resumed) == len(next_epoch)
            assert same_batches(head + rest, full), f"resume after {k} of {len(full)} batches differs"
        else:  # saved on the last batch: the next epoch, nothing of this one again
            assert state["epoch"] == epoch + 1 and not state["history"]
            assert same_batches(rest, next_epoch), "a state saved on the epoch's last batch must resume the next epoch"


def check_elastic_resume(make: Callable[[int, int], Any], phases: list[tuple[int, int, int | None]],
                         epoch: int = 0) -> None:
    """Run ``phases`` of (world_size, num_workers, batches per rank or None = to the end) in turn,
    each resuming from the previous one's state, and compare the rows with an uninterrupted run
    on the last topology. A phase never takes the whole epoch (at most all but one batch)."""
    world, workers, _ = phases[-1]
    expected: Counter = Counter()
    for rank in range(world):
        reference = ss.StreamLoader(make(rank, world), num_workers=workers)
        reference.set_epoch(epoch)
        expected.update(row_keys(list(reference)))
    delivered: Counter = Counter()
    state = None
    index = 0  # a framework's restored batch index: every earlier phase's batches per rank
    for world, workers, take in phases:
        states, counts = [], []
        for rank in range(world):
            loader = ss.StreamLoader(make(rank, world), num_workers=workers)
            if state is None:
                loader.set_epoch(epoch)
            else:
                loader.load_state_dict(state)
            length = len(loader) - index  # len is the epoch as counted: the index, then what is left
            limit = length if take is None else min(take, max(length - 1, 0))
            batches = []
            iterator = iter(loader)
            while len(batches) < limit:
                batches.append(next(iterator))
            if take is None:
                assert next(iterator, None) is None, "the loader yields more batches than len() said"
            del iterator
            delivered.update(row_keys(batches))
            counts.append(len(batches))
            states.append(as_checkpoint(loader.state_dict()) if take is not None else None)
        assert len(set(counts)) == 1, f"ranks yield different step counts under {world}x{workers}: {counts}"
        assert all(s == states[0] for s in states), "ranks of one job must save the same state"
        state = states[0]
        index += counts[0]
    assert delivered == expected, (
        f"{sum((delivered - expected).values())} extra or repeated rows, {sum((expected - delivered).values())} missing "
        f"after phases {phases}"
    )


def check_stateful_resume(make: Callable[[], Any], num_workers: int, stops: list[int], epoch: int = 0,
                          random_stops: int = 2) -> None:
    """Resume through torchdata's StatefulDataLoader, which calls state_dict() inside each worker."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = make()
    ds.set_epoch(epoch)
    full = list(StatefulDataLoader(ds, batch_size=None, num_workers=num_workers))
    for k in with_random_stops(stops, len(full), random_stops, seed=epoch * 1000 + num_workers + 1):
        k = min(k, len(full))
        first = make()
        first.set_epoch(epoch)
        loader = StatefulDataLoader(first, batch_size=None, num_workers=num_workers)
        iterator = iter(loader)
        head = [next(iterator) for _ in range(k)]
        state = loader.state_dict()
        del iterator
        resumed = make()
        resumed.set_epoch(epoch)
        loader2 = StatefulDataLoader(resumed, batch_size=None, num_workers=num_workers)
        loader2.load_state_dict(state)
        rest = list(loader2)
        assert same_batches(head + rest, full), f"StatefulDataLoader resume after {k} of {len(full)} batches differs"


def check_made_loader_resume(make_loader: Callable[[], Any], stops: list[int], epoch: int = 0,
                             random_stops: int = 3) -> None:
    """``check_loader_resume`` for loaders built by ``make_loader`` (a map-style dataset with its
    ElasticSampler, say): stop after k batches, resume a fresh loader from the state; the rest must
    be byte for byte the uninterrupted run's, ``len`` exact, and the epoch after it a normal one."""
    reference = make_loader()
    reference.set_epoch(epoch)
    full = list(reference)
    next_epoch = list(reference)
    for k in with_random_stops(stops, len(full), random_stops, seed=epoch * 1000 + 7):
        k = min(k, len(full))
        first = make_loader()
        first.set_epoch(epoch)
        iterator = iter(first)
        head = [next(iterator) for _ in range(k)]
        del iterator
        assert len(first) == len(full), "len(loader) is the whole epoch, whatever was consumed"
        state = as_checkpoint(first.state_dict())
        resumed = make_loader()
        resumed.load_state_dict(state)
        assert len(resumed) == (len(full) if k < len(full) else len(next_epoch)), f"len after resuming at {k}"
        rest = list(resumed)
        if k < len(full):
            assert same_batches(head + rest, full), f"resume after {k} of {len(full)} batches differs"
            rest = list(resumed)
        assert same_batches(rest, next_epoch), f"the epoch after resuming at {k} is not a normal one"
