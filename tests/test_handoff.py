"""The hand-off from worker processes (StreamLoader's workers="processes" and a plain DataLoader): recycled
shared-memory slots, never overwritten while used, whatever the collate function does."""

from __future__ import annotations

import itertools
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.loader.handoff import CHUNK_BATCHES, MAX_SLOTS
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
    # pin_memory=False: the hand-off itself (on a CUDA machine pinning is the default, and copies each batch)
    "StreamLoader processes": lambda ds, **kw: ss.StreamLoader(ds, num_workers=2, workers="processes",
                                                               **{"pin_memory": False, **kw}),
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_cuda_pinned_batches_leave_their_slots_with_the_same_values(tmp_path, make):
    """pin_memory=True (StreamLoader's default on a CUDA machine): the pin thread copies each batch out of
    its slot; the copies are pinned, right, and the slots recycle."""
    path = corpus(tmp_path)
    reference = in_process(path)
    got = list(make(stream(path), pin_memory=True))
    assert all(v.is_pinned() for b in got for v in b.values() if isinstance(v, torch.Tensor))
    assert same_batches(got, reference)


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
    largest, per_message = 0, loader.dataset._batches_a_message()
    assert per_message == CHUNK_BATCHES  # small batches: as many a message as allowed
    for batch in loader:
        largest = max(largest, sum(v.nbytes for v in batch.values() if isinstance(v, torch.Tensor)))
    assert loader.slot_bytes > 0
    used = loader.slot_bytes - before
    # each worker holds a few slots (2 messages in flight by default, one being used, one the loop may
    # hold), each up to 1.25x a message of ``per_message`` batches
    assert used <= 2 * 4 * 1.25 * per_message * largest + 2 * 8 * 64, f"{used} bytes of slots for batches of {largest}"


def _small_files(_worker_id):
    """A worker whose files may not grow past 1 KB: torch's shared-memory segments are files under /dev/shm,
    so every slot and segment allocation fails there as it does when /dev/shm is full (a real failure
    of the OS, reachable without root; ENOSPC and EFBIG take the same path)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the process is killed instead of failing the write
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # the slot tables fit, batches not


@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_batches_travel_through_the_pipe_when_shared_memory_fails_and_the_loop_is_told(tmp_path, make):
    """Before: the allocation failed on the queue's feeder thread, which prints the error and drops the
    batch: the pass ended normally with rows missing, or (here) waited for the lost batch forever."""
    path = corpus(tmp_path)
    reference = in_process(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [cloned(b) for b in make(stream(path), worker_init_fn=_small_files, timeout=60)]
    assert same_batches(got, reference)
    told = [str(w.message) for w in caught if "/dev/shm" in str(w.message)]
    assert told and all("travel through a pipe" in m and "--shm-size" in m for m in told), told


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not today")


def _with_unpicklable(batch):
    return dict(batch, handle=_Unpicklable())


def test_a_batch_value_that_cannot_be_pickled_is_an_error_in_the_loop_naming_its_key(tmp_path):
    """Before: the feeder thread printed the pickling error and dropped the batch; the loop waited forever."""
    path = corpus(tmp_path)
    ds = ss.ParquetStream(path, batch_size=32, rank=0, world_size=1, transform=_with_unpicklable)
    with pytest.raises(ss.HandOffError, match="'handle'.*not today"):
        next(iter(ss.StreamLoader(ds, num_workers=1, workers="processes", timeout=60)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_cuda_an_unpicklable_value_is_an_error_in_the_loop_behind_the_pin_memory_thread(tmp_path, make):
    """Before: the pin-memory thread unpickled the batch, raised, and died; the loop saw a RuntimeError."""
    path = corpus(tmp_path)
    ds = ss.ParquetStream(path, batch_size=32, rank=0, world_size=1, transform=_with_unpicklable)
    ds.set_epoch(0)
    with pytest.raises(ss.HandOffError, match="'handle'.*not today"):
        next(iter(make(ds, pin_memory=True, timeout=60)))


SMALL_SHM_JOB = """
import warnings, streamshard as ss
from streamshard.testing import write_corpus
write_corpus({path!r}, [[5000] * 4] * 4, min_tokens=64, max_tokens=512, tokens="random")
ds = ss.ParquetStream({path!r}, batch_size=8192, rank=0, world_size=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ids = [i for b in ss.StreamLoader(ds, num_workers=2, workers="processes") for i in b["sample_id"].tolist()]
assert sorted(i for i in ids if i >= 0) == list(range(80000)), "rows lost or repeated"
told = [str(w.message) for w in caught]
assert any("/dev/shm has" in m and "will likely need" in m for m in told), told
print("ok", len(told))
"""


def _can_mount_a_private_shm():
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_a_private_shm(), reason="needs a mount namespace (unshare -m) for a private /dev/shm")
def test_a_64_mb_dev_shm_like_dockers_delivers_every_row_and_warns_before_the_first_slot(tmp_path):
    """Docker's default /dev/shm (64 MB), 8192-row batches of ~16 MB: before, the loop ended normally after
    32,768 of 80,000 rows."""
    script = tmp_path / "job.py"
    script.write_text(SMALL_SHM_JOB.format(path=str(tmp_path / "data")))
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64m tmpfs /dev/shm && "
                           f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))}"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr[-3000:]


def test_tensors_of_every_dtype_and_layout_arrive_exactly_as_sent():
    # The slot copy goes through numpy where numpy has the dtype; the rest (bfloat16, complex, a tensor
    # autograd tracks) through torch. Packed and unpacked in this process: the same code both sides run.
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from streamshard.loader.handoff import WorkerSlots

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=generator)
    batch = {dtype: (base * 10).to(dtype) for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                                                       torch.int64, torch.float16, torch.bfloat16, torch.float32,
                                                       torch.float64, torch.complex64)}
    batch = {str(k): v for k, v in batch.items()}
    batch.update(strided=base.t()[1:, ::2], scalar=torch.tensor(3.5), empty=torch.zeros(0, 4, dtype=torch.int32),
                 tracked=base.clone().requires_grad_(), text=["a", "b"])
    slots = WorkerSlots()
    for _ in range(2):  # a fresh slot, then the same slot again
        got = pickle.loads(ForkingPickler.dumps(slots.wrap(dict(batch))))
        assert list(got) == list(batch)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
                assert torch.equal(got[key], value.detach()), key
            else:
                assert got[key] == value
        del got


def test_chunks_of_batches_merge_back_into_round_robin_order_and_an_error_comes_after_the_batches_before_it():
    """A worker process sends several batches a message (``handoff.chunks``); the loader puts them back in
    the order of one batch a message: worker 0, 1, 2, 0, 1, 2, ... (an exhausted worker skipped), and a
    worker's error after the batches it made before it. Messages go through pickling as the queue's would."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from streamshard.loader.handoff import WorkerSlots, chunks, merged

    def worker(w, n, fail_after=None):
        for i in range(n):
            if fail_after is not None and i == fail_after:
                raise KeyError(f"worker {w} broke")
            yield {"w": torch.tensor(w), "i": torch.tensor(i), "x": torch.zeros(3), "note": f"{w}.{i}"}

    def data_loader(workers):  # DataLoader's order: one message from each worker in turn, an exhausted one skipped
        sources = [chunks(w, batches, WorkerSlots(), 8, convert=False) for w, batches in enumerate(workers)]
        while sources:
            for source in list(sources):
                try:
                    message = next(source)
                except StopIteration:
                    sources.remove(source)
                    continue
                yield pickle.loads(ForkingPickler.dumps(message))

    def pairs(batches):
        return [(int(b["w"]), int(b["i"]), b["note"]) for b in batches]

    got = pairs(merged(data_loader([worker(0, 50), worker(1, 50), worker(2, 49)]), 3))
    assert got == [(w, i, f"{w}.{i}") for i in range(50) for w in range(3) if (w, i) != (2, 49)]
    assert pairs(merged(data_loader([worker(0, 3), worker(1, 0)]), 2)) == [(0, 0, "0.0"), (0, 1, "0.1"), (0, 2, "0.2")]

    got = []
    with pytest.raises(KeyError, match="worker 1 broke"):
        for b in merged(data_loader([worker(0, 50), worker(1, 50, fail_after=37), worker(2, 50)]), 3):
            got.append((int(b["w"]), int(b["i"])))
    assert got == [(w, i) for i in range(37) for w in range(3)] + [(0, 37)]


def through_processes_counting_messages(dataset, monkeypatch) -> tuple[list, list[int]]:
    """``dataset``'s batches through StreamLoader's 2 worker processes, and the batches each message carried."""
    import streamshard.loader.stream_loader as stream_loader

    messages: list[int] = []
    real = stream_loader.merged

    def counted(items, workers):
        def each():
            for item in items:
                messages.append(len(item.batches))
                yield item
        return real(each(), workers)

    monkeypatch.setattr(stream_loader, "merged", counted)
    return list(ss.StreamLoader(dataset, num_workers=2, workers="processes", pin_memory=False)), messages


def test_stream_loader_worker_processes_send_small_batches_several_a_message(tmp_path, monkeypatch):
    path = corpus(tmp_path)
    reference = in_process(path)
    got, messages = through_processes_counting_messages(stream(path), monkeypatch)
    assert same_batches(got, reference)
    assert sum(messages) == len(reference) and len(messages) <= len(reference) // CHUNK_BATCHES + 2 * 2


def test_only_small_batches_share_a_message(tmp_path):
    """The chunk size is estimated from the catalog (every worker must agree before any batch exists):
    small batches go many a message, large ones one a message, and a row group a batch alone."""
    small, wide = tmp_path / "small", tmp_path / "wide"
    write_corpus(str(small), [[400, 400]])
    write_corpus(str(wide), [[300]], min_tokens=3000, max_tokens=3000, tokens="random")
    for path, batch_size, expected in ((small, 32, CHUNK_BATCHES), (small, None, 1), (wide, 256, 1)):
        ds = ss.ParquetStream(str(path), batch_size=batch_size)
        ds.set_epoch(0)
        assert ds._batches_a_message() == expected, (path.name, batch_size)


def _blend(path):
    corpora = {name: ss.ParquetStream(path, shuffle=True, seed=i) for i, name in enumerate(("a", "b"))}
    return ss.BlendedStream(corpora, weights={"a": 0.7, "b": 0.3}, batch_size=16, rank=0, world_size=1)


def _pack(path):
    return ss.PackedStream(ss.ParquetStream(path, shuffle=True, seed=2, rank=0, world_size=1),
                           column="input_ids", seq_len=32, batch_size=4)


@pytest.mark.parametrize("make", [_blend, _pack], ids=["BlendedStream", "PackedStream"])
def test_blends_and_packs_send_small_batches_several_a_message_too(tmp_path, monkeypatch, make):
    """Before: one message a batch for these streams (~0.3 ms of CPU each); the batches are the thread
    workers' all the same."""
    path = corpus(tmp_path)
    reference = list(ss.StreamLoader(make(path), num_workers=2, workers="threads"))
    got, messages = through_processes_counting_messages(make(path), monkeypatch)
    assert same_batches(got, reference)
    assert sum(messages) == len(reference) and len(messages) <= len(reference) // CHUNK_BATCHES + 2 * 2


def _ids_and_numpy(batch):
    return batch["id"].numpy() * 2, {"sample_id": batch["sample_id"], "text": [str(i) for i in batch["id"].tolist()]}


def test_a_transforms_batches_arrive_as_a_plain_dataloader_delivers_them(tmp_path):
    # A transform (worker processes) may return anything: in chunks, each batch still goes through
    # DataLoader's default_convert (numpy -> tensor) and arrives as it would one a message.
    path = corpus(tmp_path)
    loader = ss.StreamLoader(_transformed(path), num_workers=2, pin_memory=False)
    assert loader.workers == "processes"
    got = list(loader)
    want = list(DataLoader(_transformed(path), batch_size=None, num_workers=2))
    assert len(got) == len(want) > CHUNK_BATCHES
    for (ids, rest), (want_ids, want_rest) in zip(got, want):
        assert isinstance(ids, torch.Tensor) and torch.equal(ids, want_ids)
        assert torch.equal(rest["sample_id"], want_rest["sample_id"]) and rest["text"] == want_rest["text"]


def _transformed(path):
    ds = ss.ParquetStream(path, batch_size=32, shuffle=True, seed=1, rank=0, world_size=1, transform=_ids_and_numpy)
    ds.set_epoch(0)
    return ds
