"""StreamLoader's hand-off from worker processes (workers="processes"): recycled shared-memory slots, never overwritten while used."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.handoff import SLOT_KEY
from streamshard.testing import write_corpus

from resume_harness import same_batches


def corpus(tmp_path):
    write_corpus(str(tmp_path), [[200] * 6, [150] * 4, [90]])
    return str(tmp_path)


def stream(path):
    ds = ss.ParquetStream(path, batch_size=32, shuffle=True, seed=1, rank=0, world_size=1)
    ds.set_epoch(0)  # a plain DataLoader's workers need the parent's catalog
    return ds


def test_dropped_batches_recycle_their_slots_and_kept_ones_are_never_overwritten(tmp_path):
    path = corpus(tmp_path)
    reference = list(DataLoader(stream(path), batch_size=None, num_workers=2))  # torch's ordinary hand-off
    kept, views, copies, storages = {}, {}, {}, set()
    for i, batch in enumerate(ss.StreamLoader(stream(path), num_workers=2, workers="processes")):
        assert SLOT_KEY not in batch
        storages.add(batch["input_ids"].untyped_storage().data_ptr())
        if i % 5 == 0:
            kept[i] = batch  # the whole batch, held to the end
        elif i % 5 == 1:
            views[i] = batch["input_ids"][:3]  # only a view: it must keep the slot too
        copies[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    assert same_batches([copies[i] for i in range(len(reference))], reference)
    assert same_batches([kept[i] for i in sorted(kept)], [reference[i] for i in sorted(kept)])
    for i, view in views.items():
        assert torch.equal(view, reference[i]["input_ids"][:3]), f"a kept view of batch {i} was overwritten"
    held = len(kept) + len(views)
    assert len(storages) < len(reference) - held, "dropped batches' slots were not reused"


def test_a_plain_dataloader_over_the_same_dataset_is_not_affected(tmp_path):
    path = corpus(tmp_path)
    ds = stream(path)
    list(ss.StreamLoader(ds, num_workers=2, workers="processes"))
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert batches and all(SLOT_KEY not in b for b in batches)


def test_persistent_workers_and_abandoned_passes_keep_delivering_correct_batches(tmp_path):
    path = corpus(tmp_path)
    reference = list(DataLoader(stream(path), batch_size=None, num_workers=2))
    loader = ss.StreamLoader(stream(path), num_workers=2, persistent_workers=True, workers="processes")
    got = []
    for stop in (3, 7, 10_000):  # abandon two passes mid-way (prefetched batches are never received)
        for batch in loader:
            got.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
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


def test_fresh_worker_processes_every_pass_never_read_a_stale_slot_mapping(tmp_path):
    """Without persistent workers each pass forks new workers whose slot buffers are new: the main
    process must map them afresh (same slot numbers, same buffer generations as the old workers')."""
    path = corpus(tmp_path)
    loader = ss.StreamLoader(stream(path), num_workers=2, workers="processes")
    for epoch in range(3):
        reference_ds = stream(path)
        reference_ds.set_epoch(epoch)
        reference = list(DataLoader(reference_ds, batch_size=None, num_workers=2))
        loader.set_epoch(epoch)
        got = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]
        assert same_batches(got, reference), f"epoch {epoch} differs from torch's ordinary hand-off"


def test_a_plain_dataloaders_batch_travels_as_one_shared_segment_with_the_same_values(tmp_path):
    """Without StreamLoader, a worker puts all tensors of a batch in one shared-memory segment, so
    torch passes one segment per batch instead of one per tensor; the values are unchanged."""
    path = corpus(tmp_path)
    in_process = list(stream(path))
    from_workers = list(DataLoader(stream(path), batch_size=None, num_workers=1))
    assert same_batches(from_workers, in_process)
    for batch in from_workers:
        storages = {v.untyped_storage().data_ptr() for v in batch.values() if isinstance(v, torch.Tensor)}
        assert len(storages) == 1, f"{len(storages)} segments for one batch"
