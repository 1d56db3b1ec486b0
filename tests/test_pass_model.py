"""The pass/epoch model (docs/concepts.md, "Passes and epochs"), the same for every entry point.

* A state saved after the last batch of epoch e resumes at the start of e + 1.
* A loaded state applies to the first pass after the load, and to no other.
* ``set_epoch(e)`` starts a full pass of e, unless a state for e was loaded and not yet used.
* ``len(loader)`` is the epoch as a framework counts it: constant through the epoch, a restored
  batch index + the resumed pass.
* Nothing starts before the first batch is asked for (a framework's ``iter()`` probe).
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader

import streamshard as ss

from helpers import ids_of
from resume_harness import as_checkpoint

WORKERS = [("threads", 2), ("processes", 2), ("none", 0)]


def make(path, **kwargs):
    return ss.ParquetStream(path, **{**dict(batch_size=50, shuffle=True, seed=3, rank=0, world_size=1), **kwargs})


def real(batches) -> list[int]:
    ids = ids_of(batches)
    return ids[ids >= 0].tolist()


def loader_of(path, kind, workers, **kwargs):
    options = {} if kind == "none" else {"workers": kind}
    return ss.StreamLoader(make(path, **kwargs), num_workers=workers, **options)


@pytest.mark.parametrize("kind, workers", WORKERS)
def test_a_state_saved_on_an_epochs_last_batch_resumes_at_the_next_epoch(skewed_corpus, kind, workers):
    # examples/train_ddp.py's loop, stopped right after the last batch of epoch 0 (before it saw the end)
    reference = loader_of(skewed_corpus, kind, workers)
    epochs = [real(list(reference)) for _ in range(2)]
    first = loader_of(skewed_corpus, kind, workers)
    iterator = iter(first)
    head = [next(iterator) for _ in range(len(first))]
    state = as_checkpoint(first.state_dict())
    assert state["epoch"] == 1 and state["history"] == []
    resumed = loader_of(skewed_corpus, kind, workers)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and len(resumed) == len(first)
    trained = []
    for epoch in range(resumed.epoch, 2):  # the documented loop: set_epoch, then the pass
        resumed.set_epoch(epoch)
        trained.append(real(list(resumed)))
    assert real(head) == epochs[0] and trained == [epochs[1]], "each epoch exactly once, in its own order"


def test_the_dataset_itself_saves_the_next_epoch_after_its_last_batch(skewed_corpus):
    ds = make(skewed_corpus)
    batches = list(ds)  # in-process pass
    state = ds.state_dict()
    assert state["epoch"] == 1 and state["history"] == []
    again = make(skewed_corpus)
    again.load_state_dict(state)
    assert again.epoch == 1
    nxt = make(skewed_corpus)
    nxt.set_epoch(1)
    assert real(list(again)) == real(list(nxt)) != real(batches)


@pytest.mark.parametrize("kind, workers", WORKERS)
def test_set_epoch_after_an_abandoned_pass_gives_the_whole_epoch(skewed_corpus, kind, workers):
    # Lightning's sanity check takes 2 validation batches, then calls sampler.set_epoch(0) and iterates
    full = real(list(loader_of(skewed_corpus, kind, workers)))
    loader = loader_of(skewed_corpus, kind, workers)
    iterator = iter(loader)
    next(iterator), next(iterator)
    del iterator
    assert loader.batches_left() == len(loader) - 2
    for _ in range(2):  # and every later validation too
        loader.sampler.set_epoch(0)
        assert real(list(loader)) == full


def test_a_loaded_state_applies_to_the_first_pass_only(skewed_corpus):
    first = ss.StreamLoader(make(skewed_corpus), num_workers=2)
    iterator = iter(first)
    head = [next(iterator) for _ in range(5)]
    state = first.state_dict()
    for resumed in (make(skewed_corpus), ss.StreamLoader(make(skewed_corpus), num_workers=2)):
        full = real(list(resumed))  # a whole epoch 0 as this object delivers it
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert sorted(real(head) + real(rest)) == sorted(full)
        if isinstance(resumed, ss.StreamLoader):
            assert real(head) + real(rest) == full, "the same topology resumes in the same order"
        resumed.set_epoch(0)  # the state was used: epoch 0 again is the whole epoch 0
        assert real(list(resumed)) == full


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_a_plain_dataloader_uses_a_loaded_state_in_its_first_pass_only(skewed_corpus, persistent):
    full = real(list(make(skewed_corpus)))
    first = ss.StreamLoader(make(skewed_corpus), num_workers=2)
    iterator = iter(first)
    head = [next(iterator) for _ in range(7)]
    ds = make(skewed_corpus)
    ds.load_state_dict(first.state_dict())
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    rest = list(loader)
    assert len(loader) == len(first), "a DataLoader's len: the 7 batches before + the rest"
    assert sorted(real(head) + real(rest)) == sorted(full)  # plain DataLoader order: worker by worker
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the repeated-epoch warning: this second pass is on purpose
        again = real(list(loader))  # no set_epoch: a new pass of epoch 0, not the resume again
    assert sorted(again) == sorted(full)
    ds.set_epoch(0)
    assert sorted(real(list(loader))) == sorted(full)


@pytest.mark.slow
def test_loading_a_state_after_persistent_workers_started_is_an_error_not_ignored(skewed_corpus):
    ds = make(skewed_corpus)
    ds.set_epoch(0)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    list(loader)
    other = ss.StreamLoader(make(skewed_corpus), num_workers=2)
    iterator = iter(other)
    [next(iterator) for _ in range(3)]
    ds.load_state_dict(other.state_dict())
    with pytest.raises(ss.StateError, match="after these DataLoader workers started"):
        list(loader)


@pytest.mark.parametrize("kind, workers", WORKERS)
def test_set_epoch_keeps_a_loaded_state_of_its_epoch_and_drops_it_for_another(skewed_corpus, kind, workers):
    first = loader_of(skewed_corpus, kind, workers)
    iterator = iter(first)
    head = [next(iterator) for _ in range(4)]
    state = first.state_dict()
    keep = loader_of(skewed_corpus, kind, workers)
    keep.load_state_dict(state)
    keep.set_epoch(0)
    assert real(head) + real(list(keep)) == real(list(loader_of(skewed_corpus, kind, workers)))
    drop = loader_of(skewed_corpus, kind, workers)
    drop.load_state_dict(state)
    drop.set_epoch(1)
    other = loader_of(skewed_corpus, kind, workers)
    other.set_epoch(1)
    assert real(list(drop)) == real(list(other))


@pytest.mark.parametrize("kind, workers", WORKERS)
def test_an_iter_probe_that_takes_no_batch_changes_nothing(skewed_corpus, kind, workers):
    first = loader_of(skewed_corpus, kind, workers)
    iterator = iter(first)
    head = [next(iterator) for _ in range(3)]
    resumed = loader_of(skewed_corpus, kind, workers)
    resumed.load_state_dict(first.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "another pass over epoch 0" warning either
        iter(resumed)  # Lightning's _check_dataloader_iterable
        iter(resumed.dataset)
        rest = list(resumed)
    assert real(head) + real(rest) == real(list(loader_of(skewed_corpus, kind, workers)))


def test_len_is_the_epoch_as_a_framework_counts_it_after_an_elastic_resume(skewed_corpus):
    # 2 ranks take 5 batches each; resumed on 3: Lightning's restored index (5) + what each rank yields
    def loader(rank, world):
        return ss.StreamLoader(make(skewed_corpus, rank=rank, world_size=world), num_workers=2)

    first = loader(0, 2)
    iterator = iter(first)
    [next(iterator) for _ in range(5)]
    state = first.state_dict()
    seen: Counter = Counter()
    for rank in range(2):
        part = loader(rank, 2)
        part_iter = iter(part)
        seen.update(real([next(part_iter) for _ in range(5)]))
    for rank in range(3):
        resumed = loader(rank, 3)
        resumed.load_state_dict(state)
        length, left = len(resumed), resumed.batches_left()
        rest = list(resumed)
        assert length == 5 + len(rest) and left == len(rest)
        seen.update(real(rest))
    total = make(skewed_corpus).catalog.num_rows
    assert sorted(seen) == list(range(total)) and max(seen.values()) == 1


def test_a_dataset_in_a_plain_loop_warns_only_when_an_epoch_repeats_by_accident(skewed_corpus):
    ds = make(skewed_corpus)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(ds)
        ds.set_epoch(0)  # on purpose: no warning
        list(ds)
    with pytest.warns(UserWarning, match="another pass over epoch 0 without set_epoch"):
        list(ds)


def test_a_stream_built_before_its_rank_is_known_resolves_it_on_first_use(skewed_corpus, monkeypatch):
    # Lightning's DDP children: WORLD_SIZE and LOCAL_RANK, no RANK, until init_process_group
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ds = ss.ParquetStream(skewed_corpus, batch_size=50)  # no error, no guess
    with pytest.raises(ss.TopologyError, match="WORLD_SIZE=2, LOCAL_RANK=1.*no RANK|no RANK.*WORLD_SIZE=2"):
        len(ss.StreamLoader(ds, num_workers=2))
    with pytest.raises(ss.TopologyError):
        ss.ParquetStream(skewed_corpus).rank  # noqa: B018
    monkeypatch.setenv("RANK", "1")  # what the process group would say
    assert (ds.rank, ds.world_size) == (1, 2)
    explicit = ss.ParquetStream(skewed_corpus, batch_size=50, rank=1, world_size=2)
    np.testing.assert_array_equal(ids_of(list(ds)), ids_of(list(explicit)))


MESH_SCRIPT = """
import os, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import streamshard as ss
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
try:
    ss.ParquetStream(sys.argv[1], mesh=mesh)
except ValueError as exc:
    print("refused:", exc)
ds = ss.ParquetStream(sys.argv[1], mesh=mesh["dp"])
print("dp:", ds.rank, ds.world_size)
try:
    ss.ParquetStream(sys.argv[1], mesh=mesh["dp"], rank=0, world_size=1)
except ValueError as exc:
    print("both:", exc)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_data_parallel_device_mesh_gives_the_rank(skewed_corpus):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", MESH_SCRIPT, skewed_corpus, str(port)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: mesh must be the 1-D data-parallel mesh, got 2 dimensions ('dp', 'tp')" in done.stdout
    assert "dp: 0 1" in done.stdout
    assert "both: pass either mesh= or rank=/world_size=, not both" in done.stdout


def _with_pid(batch):
    import os

    import torch

    return {**batch, "pid": torch.full((1,), os.getpid())}


@pytest.mark.slow
def test_persistent_worker_processes_serve_fresh_epochs_and_restart_for_a_resumed_pass(skewed_corpus):
    loader = ss.StreamLoader(make(skewed_corpus, transform=_with_pid), num_workers=2, persistent_workers=True)
    pids = [{int(b["pid"]) for b in list(loader)} for _ in range(2)]  # epochs 0 and 1
    assert pids[0] == pids[1] and len(pids[0]) == 2, "fresh epochs run on the same worker processes"
    iterator = iter(loader)
    head = [next(iterator) for _ in range(3)]  # epoch 2, stopped
    del iterator
    rest = list(loader)  # continues epoch 2: workers must start from that position
    assert {int(b["pid"]) for b in rest}.isdisjoint(pids[0])
    reference = ss.StreamLoader(make(skewed_corpus), num_workers=2)
    reference.set_epoch(2)
    assert real(head) + real(rest) == real(list(reference))
