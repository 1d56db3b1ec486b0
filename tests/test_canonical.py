"""Topology-independent order: each global step holds the same rows whatever the world size."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import streamshard as ss

PARTITIONS, WORKERS, GLOBAL_BATCH = 12, 2, 48


def make(path, rank, world, **kwargs):
    return ss.ParquetStream(
        path, batch_size=GLOBAL_BATCH // world, partitions=PARTITIONS, shuffle=True, seed=3,
        rank=rank, world_size=world, **kwargs,
    )


def global_steps(path, world, state=None, take=None):
    """Global step j = the union of every rank's batch j (non-padding ids), through real DataLoaders."""
    per_rank, states = [], []
    for rank in range(world):
        loader = ss.StreamLoader(make(path, rank, world), num_workers=WORKERS)
        loader.set_epoch(1)
        if state is not None:
            loader.load_state_dict(state)
        batches = list(itertools.islice(loader, take))
        per_rank.append(batches)
        states.append(loader.state_dict())
    assert len({len(b) for b in per_rank}) == 1, "unequal steps"
    steps = []
    for j in range(len(per_rank[0])):
        ids = np.concatenate([b[j]["sample_id"].numpy() for b in per_rank])
        steps.append(np.sort(ids[ids >= 0]))
    return steps, states[0]


def test_global_steps_are_the_same_rows_for_every_world_size(skewed_corpus):
    reference, _ = global_steps(skewed_corpus, 1)
    total = make(skewed_corpus, 0, 1).catalog.num_rows
    np.testing.assert_array_equal(np.sort(np.concatenate(reference)), np.arange(total))  # exactly once
    plan = make(skewed_corpus, 0, 1).canonical_plan(num_workers=WORKERS, epoch=1)
    for j, ids in enumerate(reference):
        np.testing.assert_array_equal(ids, np.sort(plan.global_step_ids(j)))
    for world in (2, 3, 6):
        steps, _ = global_steps(skewed_corpus, world)
        assert len(steps) == len(reference)
        for j, (a, b) in enumerate(zip(steps, reference)):
            np.testing.assert_array_equal(a, b, err_msg=f"world size {world}, global step {j}")


def test_resume_on_another_world_size_continues_the_same_global_steps(skewed_corpus):
    reference, _ = global_steps(skewed_corpus, 1)
    head, state = global_steps(skewed_corpus, 3, take=5)
    tail, _ = global_steps(skewed_corpus, 2, state=state)
    got = head + tail
    assert len(got) == len(reference)
    for j, (a, b) in enumerate(zip(got, reference)):
        np.testing.assert_array_equal(a, b, err_msg=f"global step {j}")


def test_canonical_mode_rejects_what_it_cannot_keep(skewed_corpus):
    with pytest.raises(ValueError, match="multiple of world_size"):
        list(ss.ParquetStream(skewed_corpus, batch_size=8, partitions=10, rank=0, world_size=3))
    with pytest.raises(ValueError, match="batch_size=5 must be a multiple"):
        list(ss.ParquetStream(skewed_corpus, batch_size=5, partitions=12, rank=0, world_size=2))
    with pytest.raises(ValueError, match="batch_size"):
        ss.ParquetStream(skewed_corpus, batch_size=None, partitions=12)
    loader = ss.StreamLoader(make(skewed_corpus, 0, 2), num_workers=2)
    list(itertools.islice(loader, 2))
    other = ss.StreamLoader(make(skewed_corpus, 0, 2), num_workers=3)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ss.StateError, match="same number of DataLoader workers"):
        list(other)
