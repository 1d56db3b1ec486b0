"""The hand-off from worker processes (StreamLoader's workers="processes" and a plain DataLoader): recycled
shared-memory slots, never overwritten while used, whatever the collate function does."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.handoff import MAX_SLOTS
from streamshard.testing import write_corpus

from resume_harness import same_batches


def corpus(tmp_path):
    write_corpus(str(tmp_path), [[200] * 6, [150] * 4, [90]])
    return str(tmp_path)


def stream(path):
    ds = ss.ParquetStream(path, batch_size=32, shuffle=True, seed=1, rank=0, world_size=1)
    ds.set_epoch(0)  # a plain DataLoader's workers need the parent's catalog
    return ds


LOADERS = {
    "StreamLoader processes": lambda ds, **kw: ss.StreamLoader(ds, num_workers=2, workers="processes", **kw),
    "plain DataLoader": lambda ds, **kw: DataLoader(ds, batch_size=None, num_workers=2, **kw),
}


def in_process(path, epoch=0):
    """What two DataLoader workers deliver, read by thread workers: no hand-off between processes at all."""
    ds = stream(path)
    ds.set_epoch(epoch)
    return list(ss.StreamLoader(ds, num_workers=2, workers="threads"))


def cloned(batch):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_dropped_batches_recycle_their_slots_and_kept_ones_are_never_overwritten(tmp_path, make):
    path = corpus(tmp_path)
    reference = in_process(path)
    kept, views, copies, storages = {}, {}, {}, set()
    for i, batch in enumerate(make(stream(path))):
        assert type(batch) is dict
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1, "one batch, one slot"
        storages.add(batch["input_ids"].untyped_storage().data_ptr())
        if i % 5 == 0:
            kept[i] = batch  # the whole batch, held to the end
        elif i % 5 == 1:
            views[i] = batch["input_ids"][:3]  # only a view: it must keep the slot too
        copies[i] = cloned(batch)
    assert same_batches([copies[i] for i in range(len(reference))], reference)
    assert same_batches([kept[i] for i in sorted(kept)], [reference[i] for i in sorted(kept)])
    for i, view in views.items():
        assert torch.equal(view, reference[i]["input_ids"][:3]), f"a kept view of batch {i} was overwritten"
    held = len(kept) + len(views)
    assert len(storages) < len(reference) - held, "dropped batches' slots were not reused"


def test_a_user_who_keeps_every_batch_gets_them_all_intact_past_the_last_free_slot(tmp_path):
    path = corpus(tmp_path)
    ds = ss.ParquetStream(path, batch_size=8, rank=0, world_size=1)
    reference = list(ss.StreamLoader(ds, num_workers=2, workers="threads"))
    ds.set_epoch(0)
    assert len(reference) > 2 * MAX_SLOTS + 10  # more batches than two workers have slots
    kept = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert same_batches(kept, reference)


def test_a_collate_function_sees_a_dict_and_whatever_it_returns_arrives_intact(tmp_path):
    path = corpus(tmp_path)
    reference = in_process(path)

    def pieces(batch):  # takes tensors out of the batch: they must travel on their own, never in a slot
        assert isinstance(batch, dict)
        return batch["input_ids"][:, :4], batch["sample_id"]

    got = list(DataLoader(stream(path), batch_size=None, num_workers=2, collate_fn=pieces))
    assert len(got) == len(reference)
    for (ids, sample_id), want in zip(got, reference):  # all held to the end: none overwritten
        assert torch.equal(ids, want["input_ids"][:, :4]) and torch.equal(sample_id, want["sample_id"])

    def edit(batch):  # changes the dict it is given: the change arrives, the rest too
        batch = dict(batch, doubled=batch["id"] * 2)
        batch["id"] = batch["id"] + 1
        return batch

    got = list(DataLoader(stream(path), batch_size=None, num_workers=2, collate_fn=edit))
    for batch, want in zip(got, reference):
        assert torch.equal(batch["id"], want["id"] + 1) and torch.equal(batch["doubled"], want["id"] * 2)
        assert torch.equal(batch["input_ids"], want["input_ids"])


def test_dataloader_batching_of_a_stream_collates_its_batches(tmp_path):
    path = corpus(tmp_path)
    ds = ss.ParquetStream(path, columns=["id", "score"], batch_size=30, rank=0, world_size=1)  # 63 full batches
    ds.set_epoch(0)
    reference = list(ds)  # one worker's order, read in this process
    got = list(DataLoader(ds, batch_size=3, num_workers=1))  # default_collate stacks three batches
    assert len(got) == 21 and all(type(b) is dict for b in got)
    for i, batch in enumerate(got):
        for key in ("id", "score", "sample_id"):
            assert torch.equal(batch[key], torch.stack([b[key] for b in reference[3 * i:3 * i + 3]]))


@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_persistent_workers_and_abandoned_passes_keep_delivering_correct_batches(tmp_path, make):
    path = corpus(tmp_path)
    reference = in_process(path)
    loader = make(stream(path), persistent_workers=True)
    got = []
    for stop in (3, 7, 10_000):  # abandon two passes mid-way (prefetched batches are never received)
        if isinstance(loader, DataLoader):
            got = []  # a plain DataLoader starts the epoch over; StreamLoader continues it
        for batch in loader:
            got.append(cloned(batch))
            if len(got) >= stop:
                break
        if len(got) == len(reference):
            break
    assert same_batches(got, reference)


def test_a_device_loader_counts_the_batches_it_hands_out_not_those_copied_ahead(tmp_path):
    path = corpus(tmp_path)
    plain = ss.StreamLoader(stream(path), num_workers=2, workers="processes")
    on_device = ss.StreamLoader(stream(path), num_workers=2, device="cpu", prefetch_depth=3)
    head = list(itertools.islice(plain, 4))
    assert same_batches(list(itertools.islice(on_device, 4)), head)
    assert on_device.state_dict() == plain.state_dict()
    resumed = ss.StreamLoader(stream(path), num_workers=1, device="cpu")
    resumed.load_state_dict(on_device.state_dict())
    rest = list(resumed)
    ids = torch.cat([b["sample_id"] for b in head + rest])
    assert sorted(ids[ids >= 0].tolist()) == list(range(6 * 200 + 4 * 150 + 90)), "every row once across the resume"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_arrive_on_the_device_with_the_same_values(tmp_path):
    path = corpus(tmp_path)
    reference = list(DataLoader(stream(path), batch_size=None, num_workers=2))
    got = list(ss.StreamLoader(stream(path), num_workers=2, device="cuda"))
    assert all(v.device.type == "cuda" for b in got for v in b.values() if isinstance(v, torch.Tensor))
    cpu = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in got]
    assert same_batches(cpu, reference)


@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_fresh_worker_processes_every_pass_never_read_a_stale_slot_mapping(tmp_path, make):
    """Without persistent workers each pass forks new workers whose slot buffers are new: the main
    process must map them afresh (same slot numbers, same buffer generations as the old workers')."""
    path = corpus(tmp_path)
    ds = stream(path)
    loader = make(ds)
    for epoch in range(3):
        reference = in_process(path, epoch)
        (loader if isinstance(loader, ss.StreamLoader) else ds).set_epoch(epoch)
        got = [cloned(b) for b in loader]
        assert same_batches(got, reference), f"epoch {epoch} differs from the batches read in process"


def test_the_slots_memory_is_reported_and_bounded_by_the_batches_in_flight(tmp_path):
    path = corpus(tmp_path)
    before = ss.StreamLoader(stream(path), num_workers=2, workers="threads").slot_bytes  # other tests' live workers
    loader = ss.StreamLoader(stream(path), num_workers=2, workers="processes", persistent_workers=True)
    largest = 0
    for batch in loader:
        largest = max(largest, sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor)))
    assert loader.slot_bytes > 0
    used = loader.slot_bytes - before
    # each worker holds a few slots (4 in flight by default, one being used), each up to 1.25x a batch
    assert used <= 2 * 8 * 1.25 * largest + 2 * 8 * 64, f"{used} bytes of slots for batches of {largest}"
