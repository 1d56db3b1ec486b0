"""Specification of StreamLoader over a map-style dataset with an ElasticSampler, and of the
sampler's checkpoint: exact resume, elastic resume, refusals, and torchdata's StatefulDataLoader."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, SequentialSampler

import streamshard as ss
from resume_harness import as_checkpoint, check_made_loader_resume, same_batches


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    """Tests describe their topology explicitly; a torchrun environment must not leak in."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


class Indexed(Dataset):
    """Sample ``i`` is ``{"idx": i}``: a batch says exactly which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i)}


def make_loader(n, replicas=1, rank=0, nodes=1, batch_size=4, num_workers=0, seed=3, drop_last=False, **kwargs):
    sampler = ss.ElasticSampler(n, replicas, rank, nodes, seed=seed, **kwargs)
    return ss.StreamLoader(Indexed(n), sampler=sampler, batch_size=batch_size, num_workers=num_workers,
                           drop_last=drop_last)


def indices(batches):
    return [i for b in batches for i in b["idx"].tolist()]


def take(loader, k):
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(k)]
    del iterator
    return batches


# -- same topology: exact resume ---------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_over_a_sampler_resumes_byte_for_byte(num_workers):
    # 50 samples, 2 replicas, batches of 4: 7 batches per replica, the last one short (1 sample).
    check_made_loader_resume(lambda: make_loader(50, 2, 1, batch_size=4, num_workers=num_workers), stops=[0, 1, 6, 7],
                             epoch=2)


def test_resume_with_drop_last_batches_skips_only_the_short_last_batch():
    check_made_loader_resume(lambda: make_loader(50, 2, 0, batch_size=4, drop_last=True), stops=[0, 3, 6],
                             random_stops=1)
    assert len(make_loader(50, 2, 0, batch_size=4, drop_last=True)) == 6


def test_len_is_the_whole_epoch_through_it_and_an_exhausted_epoch_advances():
    sampler = ss.ElasticSampler(30, 3, 2, seed=3)  # 10 samples per replica: batches of 4, 4, 2
    loader = ss.StreamLoader(Indexed(30), sampler=sampler, batch_size=4)
    assert len(loader) == 3
    head = take(loader, 1)
    assert len(loader) == 3
    rest = list(loader)  # iterating again after a break continues where the loop stopped
    assert [len(b["idx"]) for b in head + rest] == [4, 4, 2]
    assert indices(head + rest) == list(ss.ElasticSampler(30, 3, 2, seed=3))
    assert loader.epoch == sampler.epoch == 1 and len(loader) == 3
    expected = ss.ElasticSampler(30, 3, 2, seed=3)
    expected.set_epoch(1)
    assert indices(list(loader)) == list(expected)


def test_set_epoch_starts_that_epoch_and_the_sampler_s_epoch_is_followed():
    sampler = ss.ElasticSampler(40, 2, 0, seed=3)
    loader = ss.StreamLoader(Indexed(40), sampler=sampler, batch_size=4)
    take(loader, 2)
    loader.set_epoch(4)
    expected = ss.ElasticSampler(40, 2, 0, seed=3)
    expected.set_epoch(4)
    assert indices(list(loader)) == list(expected)
    take(loader, 1)
    sampler.set_epoch(7)  # a training loop that only talks to the sampler
    assert len(loader) == 5 and loader.epoch == 7
    expected.set_epoch(7)
    assert indices(list(loader)) == list(expected)


def test_a_pass_that_fails_before_its_first_batch_is_retried_from_the_resume_point():
    n, batch = 40, 4
    full = indices(list(make_loader(n)))
    failures = []

    def collate_once_failing(samples):
        if not failures:
            failures.append(1)
            raise RuntimeError("transient")
        return torch.utils.data.default_collate(samples)

    first = make_loader(n)
    take(first, 3)
    state = as_checkpoint(first.state_dict())
    resumed = ss.StreamLoader(Indexed(n), sampler=ss.ElasticSampler(n, 1, 0, seed=3), batch_size=batch,
                              collate_fn=collate_once_failing)
    resumed.load_state_dict(state)
    with pytest.raises(RuntimeError, match="transient"):
        next(iter(resumed))  # the sampler handed out a batch of indices, training got none
    assert len(resumed) == 10, "3 batches before the resume + the 7 it yields"
    assert resumed.state_dict()["yielded"] == 12, "the state still says 3 batches of 4 were consumed"
    assert full[:12] + indices(list(resumed)) == full


# -- elastic: another number of replicas --------------------------------------------------------


def run_job(n, replicas, nodes, take_batches, state=None, batch_size=4, num_workers=0):
    """Every replica of a job loads ``state`` (or starts the epoch), takes ``take_batches`` batches
    (None: to the end); returns the indices per replica and the one state they all saved."""
    delivered, states, lengths = [], [], set()
    for rank in range(replicas):
        loader = make_loader(n, replicas, rank, nodes, batch_size, num_workers)
        if state is not None:
            loader.load_state_dict(state)
        lengths.add(len(loader))
        batches = take(loader, take_batches) if take_batches is not None else list(loader)
        delivered.append(indices(batches))
        states.append(as_checkpoint(loader.state_dict()) if take_batches is not None else None)
    assert len(lengths) == 1, f"replicas of one job have different lengths: {lengths}"
    assert all(s == states[0] for s in states), "replicas of one job must save the same state"
    return delivered, states[0]


@pytest.mark.parametrize("new_replicas, new_nodes", [(2, 2), (2, 1), (3, 1)])
@pytest.mark.parametrize("stop", [0, 1, 3, 5])
def test_four_replicas_resumed_on_fewer_deliver_the_epoch_exactly_once(stop, new_replicas, new_nodes):
    n = 96  # 24 samples per replica on 4 replicas: 6 batches of 4
    before, state = run_job(n, 4, 2, stop)
    rest = n - 4 * 4 * stop
    after, _ = run_job(n, new_replicas, new_nodes, None, state)
    assert {len(x) for x in after} == {-(-rest // new_replicas)}, "equal counts per replica after the resize"
    counts = Counter(itertools.chain(*before, *after))
    assert sorted(counts) == list(range(n)), "a sample was lost"
    if rest % new_replicas == 0:
        assert set(counts.values()) == {1}, "a sample was delivered twice"
    else:
        # The documented padding: fewer than num_replicas repeats, all in every replica's last step.
        assert 0 < sum(counts.values()) - n < new_replicas
        assert max(Counter(itertools.chain(*before, *(x[:-1] for x in after))).values()) == 1


def test_a_chain_of_resumes_on_4_then_2_then_3_replicas_delivers_each_sample_once():
    n = 120  # 4 x 8 samples, then 2 x 4: 80 left for 3 replicas, 27 each (one repeat)
    first, state = run_job(n, 4, 2, 2)
    second, state = run_job(n, 2, 1, 1, state, num_workers=2)
    assert state["yielded"] == 12, "samples per replica so far: 8 before the resize, 4 after"
    third, _ = run_job(n, 3, 1, None, state)
    counts = Counter(itertools.chain(*first, *second, *third))
    assert sorted(counts) == list(range(n))
    assert sum(counts.values()) - n == (-(n - 32 - 8)) % 3


def test_padding_guarantee_holds_when_the_dataset_does_not_divide_and_workers_prefetch():
    n = 90  # 4 replicas: 23 each (2 padded); stop after 2 batches of 4, then 3 replicas
    before, state = run_job(n, 4, 1, 2, num_workers=2)
    after, _ = run_job(n, 3, 1, None, state, num_workers=2)
    counts = Counter(itertools.chain(*before, *after))
    assert sorted(counts) == list(range(n))
    assert sum(counts.values()) - n < 3
    assert max(Counter(itertools.chain(*before, *(x[:-1] for x in after))).values()) == 1


def test_a_state_saved_at_the_end_of_the_epoch_resumes_with_the_next_epoch():
    _, state = run_job(40, 4, 1, 3)  # 10 per replica: 3 batches is the whole epoch
    loader = make_loader(40, 2, 1)
    loader.load_state_dict(state)
    assert state["epoch"] == 1 and loader.epoch == 1, "a state of the whole epoch is the next one's beginning"
    expected = ss.ElasticSampler(40, 2, 1, seed=3)
    expected.set_epoch(1)
    assert len(loader) == -(-len(expected) // 4)
    assert indices(list(loader)) == list(expected)


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("field, change", [("seed", dict(seed=4)), ("dataset_len", dict(n=41)),
                                           ("shuffle", dict(shuffle=False)), ("drop_last", dict(drop_last=True))])
def test_a_state_of_other_data_or_order_is_refused_naming_the_field(field, change):
    first = make_loader(40, 2, 0)
    take(first, 2)
    state = as_checkpoint(first.state_dict())
    n = change.pop("n", 40)
    if "drop_last" in change:  # the sampler's drop_last, not the loader's
        other = ss.StreamLoader(Indexed(n), sampler=ss.ElasticSampler(n, 2, 0, seed=3, drop_last=True), batch_size=4)
    else:
        other = make_loader(n, 2, 0, **change)
    before = other.state_dict()
    with pytest.raises(ss.StateError, match=f"{field}="):
        other.load_state_dict(state)
    assert other.state_dict() == before, "a refused state must leave the loader as it was"


def _saved_state():
    loader = make_loader(40, 4, 0)
    take(loader, 2)
    return as_checkpoint(loader.state_dict())


@pytest.mark.parametrize(
    "edit, field",
    [
        (dict(version=1), "version"),
        (dict(kind="rank"), "kind"),
        (dict(yielded=10**12), "yielded"),
        (dict(consumed=10**12), "consumed"),
        (dict(consumed=-1), "consumed"),
        (dict(offset=-3), "offset"),
        (dict(offset=10**12), "offset"),
        (dict(segment_start=-1), "segment_start"),
        (dict(segment_start=10**12), "segment_start"),
        (dict(epoch=-1), "epoch"),
        (dict(epoch="0"), "epoch"),
        (dict(num_replicas=2.0), "num_replicas"),
        (dict(num_replicas=True), "num_replicas"),
        (dict(num_replicas=10**12), "num_replicas"),
        (dict(num_nodes=3), "num_nodes"),
        (dict(yielded=None), "yielded"),
        (dict(layouts="[]"), "layouts"),
        (dict(layouts=[[1, 0]] * 10**6), "layouts"),
        (dict(layouts=[[0, 1]]), "layouts"),
        (dict(layouts=[[2, -1]]), "layouts"),
        (dict(layouts=[[2, 1, 0]]), "layouts"),
        (dict(fingerprint=[40, 0]), "fingerprint"),
        (dict(fingerprint={"dataset_len": 40, "seed": 3, "shuffle": True}), "drop_last"),
        (dict(fingerprint={"dataset_len": 40, "seed": 3, "shuffle": True, "drop_last": False, "x": 1}), "x"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_field(edit, field):
    state = {**_saved_state(), **edit}
    loader = make_loader(40, 4, 0)
    with pytest.raises(ss.StateError, match=field):
        loader.load_state_dict(state)


@pytest.mark.parametrize("missing", ["fingerprint", "layouts", "segment_start", "yielded", "consumed"])
def test_a_state_missing_a_key_is_refused_naming_it(missing):
    state = _saved_state()
    del state[missing]
    with pytest.raises(ss.StateError, match=missing):
        make_loader(40, 4, 0).load_state_dict(state)


@pytest.mark.parametrize("state", [None, [], "state", {"epoch": 0}])
def test_something_that_is_not_a_sampler_state_is_refused(state):
    with pytest.raises(ss.StateError):
        make_loader(40).load_state_dict(state)


def test_wrong_arguments_for_the_kind_of_dataset_are_value_errors_naming_them(small_corpus):
    stream = ss.ParquetStream(small_corpus, batch_size=4)
    with pytest.raises(ValueError, match="sampler="):
        ss.StreamLoader(stream, sampler=ss.ElasticSampler(10, 1, 0))
    with pytest.raises(ValueError, match="batch_size="):
        ss.StreamLoader(stream, batch_size=4)
    with pytest.raises(ValueError, match="ElasticSampler"):
        ss.StreamLoader(Indexed(10), batch_size=4)
    with pytest.raises(ValueError, match="ElasticSampler"):
        ss.StreamLoader(Indexed(10), sampler=SequentialSampler(range(10)), batch_size=4)
    with pytest.raises(ValueError, match="dataset_len=12"):
        ss.StreamLoader(Indexed(10), sampler=ss.ElasticSampler(12, 1, 0))
    with pytest.raises(ValueError, match="batch_size"):
        ss.StreamLoader(Indexed(10), sampler=ss.ElasticSampler(10, 1, 0), batch_size=0)
    with pytest.raises(ValueError, match="drop_last"):
        ss.StreamLoader(Indexed(10), sampler=ss.ElasticSampler(10, 1, 0), drop_last="no")


# -- torchdata's StatefulDataLoader ------------------------------------------------------------


def test_stateful_dataloader_with_workers_resumes_a_sampler_exactly():
    from torchdata.stateful_dataloader import StatefulDataLoader

    n, batch = 50, 4

    def make():
        sampler = ss.ElasticSampler(n, 2, 1, seed=5)
        sampler.set_epoch(1)
        return StatefulDataLoader(Indexed(n), sampler=sampler, batch_size=batch, num_workers=2)

    full = list(make())
    assert len(full) == 7
    after = make()
    after.sampler.set_epoch(2)
    next_epoch = list(after)
    for k in [0, 1, 4, 6, 7]:
        loader = make()
        iterator = iter(loader)
        head = [next(iterator) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator
        resumed = make()
        resumed.load_state_dict(state)
        rest = list(resumed)
        if k == len(full):  # saved on the epoch's last batch: the next epoch, nothing of this one again
            assert same_batches(rest, next_epoch)
            continue
        assert same_batches(head + rest, full), f"StatefulDataLoader resume after {k} of {len(full)} batches differs"
