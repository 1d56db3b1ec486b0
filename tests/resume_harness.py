"""One resume harness for everything that iterates: stop after k batches, resume, compare byte for byte."""

from __future__ import annotations

import json
import random
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader


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


def check_plain_resume(
    make: Callable[[], Any], num_workers: int, stops: list[int], epoch: int = 0, random_stops: int = 3
) -> None:
    """Resume with a plain DataLoader from the count of batches the rank consumed."""
    ds = make()
    ds.set_epoch(epoch)
    full = list(DataLoader(ds, batch_size=None, num_workers=num_workers))
    for k in with_random_stops(stops, len(full), random_stops, seed=epoch * 1000 + num_workers):
        k = min(k, len(full))
        state = json.loads(json.dumps(ds.state_dict(consumed_batches=k, num_workers=num_workers)))
        assert len(json.dumps(state)) < 2_000, "state must stay small"
        resumed = make()
        resumed.load_state_dict(state)
        rest = list(DataLoader(resumed, batch_size=None, num_workers=num_workers))
        assert same_batches(rest, full[k:]), f"resume after {k} of {len(full)} batches differs"


def check_stateful_resume(
    make: Callable[[], Any], num_workers: int, stops: list[int], epoch: int = 0, random_stops: int = 2
) -> None:
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
