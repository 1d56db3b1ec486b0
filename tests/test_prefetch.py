"""DevicePrefetcher: order, structure, errors, shutdown, depth, overlap, buffer-pool reuse.

The CPU tests drive the same pipeline the CUDA path uses (only the mover differs); the
pool's bookkeeping is exercised with fake fences. CUDA-only tests check pinning and streams.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import threading
import traceback
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamshard.loader.prefetch import (
    BufferPool,
    DevicePrefetcher,
    _Pass,
    _PooledMover,
    map_tensors,
    size_class,
    stage_into_pool,
)

WAIT_S = 10.0  # generous liveness bound for event waits; never a performance threshold


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "streamshard-prefetch"]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every test must leave no loader thread behind."""
    before = set(threading.enumerate())
    yield
    gc.collect()
    leaked = [t for t in set(threading.enumerate()) - before if t.name == "streamshard-prefetch"]
    assert leaked == []


def batches(n: int, width: int = 3) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.full((width,), i), "sample_id": torch.tensor([i])} for i in range(n)]


class Pair(NamedTuple):
    left: torch.Tensor
    right: Any


@dataclasses.dataclass
class Sample:
    tokens: torch.Tensor
    text: list[str]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    tokens: torch.Tensor
    length: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass
class Box:
    a: Any
    b: Any


# --------------------------------------------------------------------------- behaviour


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 30), depth=st.integers(1, 4))
def test_yields_every_batch_in_source_order(n, depth):
    source = batches(n)
    with DevicePrefetcher(source, "cpu", depth=depth) as prefetcher:
        got = [int(b["sample_id"]) for b in prefetcher]
    assert got == list(range(n))


def test_nested_structures_keep_their_types_and_passthrough_leaves():
    texts = ["a", "b"]
    batch = {
        "pair": Pair(torch.ones(2), texts),
        "seq": [torch.zeros(1), (torch.arange(3), "tag", 7, None)],
        "sample": Sample(torch.arange(4), texts, {"w": torch.ones(1)}),
        "frozen": FrozenSample(torch.arange(2)),
        "ordered": collections.OrderedDict(b=torch.ones(1), a=1.5),
        "texts": texts,
    }
    (out,) = list(DevicePrefetcher([batch], torch.device("cpu")))
    assert isinstance(out["pair"], Pair) and out["pair"].right is texts
    assert isinstance(out["seq"], list) and isinstance(out["seq"][1], tuple)
    assert out["seq"][1][1:] == ("tag", 7, None)
    assert isinstance(out["sample"], Sample) and out["sample"].text is texts
    assert torch.equal(out["sample"].extra["w"], torch.ones(1))
    assert isinstance(out["frozen"], FrozenSample)
    assert isinstance(out["ordered"], collections.OrderedDict)
    assert list(out["ordered"]) == ["b", "a"]
    assert out["texts"] is texts


def _trees():
    leaves = st.one_of(
        st.integers(-5, 5).map(lambda v: torch.tensor([v])),
        st.text(max_size=3),
        st.none(),
        st.integers(),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.text(max_size=2), children, max_size=3),
            st.tuples(children, children).map(lambda t: Pair(*t)),
            st.tuples(children, children).map(lambda t: Box(*t)),
        ),
        max_leaves=12,
    )


def _plus_one_reference(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree + 1
    if isinstance(tree, dict):
        return {k: _plus_one_reference(v) for k, v in tree.items()}
    if isinstance(tree, Pair):
        return Pair(*(_plus_one_reference(v) for v in tree))
    if isinstance(tree, Box):
        return Box(_plus_one_reference(tree.a), _plus_one_reference(tree.b))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plus_one_reference(v) for v in tree)
    return tree


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Box):
        return _same(a.a, b.a) and _same(a.b, b.b)
    return a == b


def _has_tensor(tree: Any) -> bool:
    found = []
    map_tensors(found.append, tree)
    return bool(found)


@settings(max_examples=60, deadline=None)
@given(tree=_trees())
def test_map_tensors_keeps_structure_and_reuses_tensor_free_containers(tree):
    out = map_tensors(lambda t: t + 1, tree)
    assert _same(out, _plus_one_reference(tree))
    if not _has_tensor(tree):
        assert out is tree


def test_map_tensors_reaches_into_frozen_dataclasses_and_mapping_subclasses():
    counts = collections.defaultdict(int, n=torch.ones(1))
    sample = Sample(torch.zeros(1), ["t"], {"w": torch.zeros(1)})
    batch = [FrozenSample(torch.zeros(2)), counts, sample]
    frozen, mapped_counts, sample = map_tensors(lambda t: t + 1, batch)
    assert isinstance(frozen, FrozenSample) and torch.equal(frozen.tokens, torch.ones(2))
    assert batch[0].tokens.sum() == 0  # the input is not mutated
    assert isinstance(mapped_counts, collections.defaultdict) and mapped_counts["missing"] == 0
    assert torch.equal(mapped_counts["n"], torch.full((1,), 2.0))
    assert torch.equal(sample.extra["w"], torch.ones(1)) and sample.text is batch[2].text


def _failing_source(n_good: int, error: Exception):
    yield from batches(n_good)
    raise error


def test_source_error_is_reraised_where_it_happened_with_its_traceback():
    error = ValueError("bad row group")
    got = []
    iterator = iter(DevicePrefetcher(_failing_source(3, error), "cpu", depth=2))
    with pytest.raises(ValueError) as raised:
        for batch in iterator:
            got.append(int(batch["sample_id"]))
    assert got == [0, 1, 2]
    assert raised.value is error
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "_failing_source" in frames
    with pytest.raises(StopIteration):  # the pass is over after the error
        next(iterator)


def _counting_source(pulls: list[int], n: int | None = None):
    for i in itertools.count() if n is None else range(n):
        pulls.append(i)
        yield {"sample_id": torch.tensor([i])}


def test_break_out_of_an_endless_source_stops_the_thread():
    pulls: list[int] = []
    prefetcher = DevicePrefetcher(_counting_source(pulls), "cpu", depth=3)
    for batch in prefetcher:
        if int(batch["sample_id"]) == 5:
            break
    assert _prefetch_threads() == []
    stopped_at = len(pulls)
    assert stopped_at <= 6 + 3


def test_close_and_context_manager_stop_running_passes():
    prefetcher = DevicePrefetcher(_counting_source([]), "cpu")
    iterator = iter(prefetcher)
    next(iterator)
    assert len(_prefetch_threads()) == 1
    prefetcher.close()
    assert _prefetch_threads() == []
    with pytest.raises(StopIteration):
        next(iterator)

    with DevicePrefetcher(_counting_source([]), "cpu") as managed:
        held = iter(managed)
        next(held)
        assert len(_prefetch_threads()) == 1
    assert _prefetch_threads() == []


def test_deleting_the_prefetcher_and_its_iterator_stops_the_thread():
    prefetcher = DevicePrefetcher(_counting_source([]), "cpu")
    iterator = iter(prefetcher)
    next(iterator)
    del prefetcher
    next(iterator)  # an iterator still held keeps working
    del iterator
    gc.collect()
    assert _prefetch_threads() == []


def test_close_returns_while_the_source_is_stuck_in_next():
    entered, release = threading.Event(), threading.Event()
    pulls: list[int] = []

    def stuck_source():
        yield {"sample_id": torch.tensor([0])}
        pulls.append(1)
        entered.set()
        release.wait(WAIT_S)
        pulls.append(2)
        yield {"sample_id": torch.tensor([1])}
        pulls.append(3)
        yield {"sample_id": torch.tensor([2])}

    iterator = iter(DevicePrefetcher(stuck_source(), "cpu", depth=1))
    next(iterator)
    assert entered.wait(WAIT_S)
    loader = _prefetch_threads()[0]
    closer = threading.Thread(target=iterator.close, kwargs={"timeout": 0.1})
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close() hung on a source stuck in next()"
    assert loader.is_alive()  # still inside the source's next(): a daemon, not a hang
    release.set()
    loader.join(WAIT_S)
    assert not loader.is_alive()
    assert pulls == [1, 2], "the loader pulled again after close()"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_source_is_never_more_than_depth_batches_ahead(depth):
    n = 8
    pulls: list[int] = []
    received = 0
    pulled_while_received: list[tuple[int, int]] = []

    def source():
        for i in range(n):
            pulled_while_received.append((i, received))
            pulls.append(i)
            yield {"sample_id": torch.tensor([i])}

    prefetcher = DevicePrefetcher(source(), "cpu", depth=depth)
    for batch in prefetcher:
        received += 1
        target = min(n, received + depth)
        for _ in range(int(WAIT_S / 0.005)):  # wait for the loader to fill its window
            if len(pulls) >= target:
                break
            threading.Event().wait(0.005)
        assert len(pulls) == target, "the loader did not fill its depth window"
        threading.Event().wait(0.02)  # give an over-eager loader the chance to overshoot
        assert len(pulls) == target
    # at pull time, counting the batch being handed over, the gap never exceeds depth
    assert all(i <= r + depth for i, r in pulled_while_received)


@pytest.mark.parametrize("depth", [1, 2])
def test_loading_runs_while_the_consumer_computes(depth):
    """Two-way rendezvous: it can only complete if load k+1 and compute k run concurrently."""
    n = 5
    loading = [threading.Event() for _ in range(n)]
    computing = [threading.Event() for _ in range(n)]
    rendezvous_ok = []

    def source():
        for i in range(n):
            loading[i].set()
            if i > 0:  # "load" i only while the consumer is computing i - 1
                rendezvous_ok.append(computing[i - 1].wait(WAIT_S))
            yield {"sample_id": torch.tensor([i])}

    for batch in DevicePrefetcher(source(), "cpu", depth=depth):
        i = int(batch["sample_id"])
        computing[i].set()
        if i + 1 < n:  # "compute" i only while the loader is loading i + 1
            assert loading[i + 1].wait(WAIT_S), "the source did not run during compute"
    assert rendezvous_ok == [True] * (n - 1)


def test_loader_thread_uses_one_intra_op_thread_without_touching_the_consumer():
    consumer_threads = torch.get_num_threads()
    seen = []

    def source():
        seen.append(torch.get_num_threads())
        yield torch.zeros(1)

    list(DevicePrefetcher(source(), "cpu"))
    assert seen == [1]
    assert torch.get_num_threads() == consumer_threads


@pytest.mark.parametrize("depth", [0, -1, 1.5, True, "2"])
def test_depth_must_be_a_positive_int(depth):
    with pytest.raises(ValueError, match="depth"):
        DevicePrefetcher([], "cpu", depth=depth)


def test_device_accepts_str_and_torch_device():
    assert DevicePrefetcher([], "cpu").device == torch.device("cpu")
    assert DevicePrefetcher([], torch.device("cpu")).device == torch.device("cpu")


def test_len_follows_the_source():
    assert len(DevicePrefetcher(batches(7), "cpu")) == 7
    with pytest.raises(TypeError, match="len"):
        len(DevicePrefetcher(iter(batches(7)), "cpu"))


def test_each_iter_is_a_new_pass_over_a_reiterable_source():
    prefetcher = DevicePrefetcher(batches(4), "cpu")
    first = [int(b["sample_id"]) for b in prefetcher]
    second = [int(b["sample_id"]) for b in prefetcher]
    assert first == second == [0, 1, 2, 3]
    one_shot = DevicePrefetcher(iter(batches(4)), "cpu")
    assert len(list(one_shot)) == 4
    assert list(one_shot) == []


# --------------------------------------------------------------------------- buffer pool


class FakeFence:
    """A fence the test completes by hand; records whether someone blocked on it."""

    def __init__(self) -> None:
        self.done = False
        self.synchronized = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = True
        self.done = True


def _counting_pool() -> tuple[BufferPool, list[int]]:
    sizes: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return BufferPool(allocate), sizes


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(1, 1 << 40))
def test_size_class_bounds_waste_and_is_stable(nbytes):
    cls = size_class(nbytes)
    assert nbytes <= cls <= nbytes + nbytes // 8 + 1
    assert size_class(cls) == cls


def test_buffer_returns_to_the_pool_only_after_its_fence_completes():
    pool, sizes = _counting_pool()
    first = pool.acquire(1000)
    fence = FakeFence()
    pool.release_after(fence, [first])
    pool.reclaim()
    second = pool.acquire(1000)
    assert second is not first and pool.allocations == 2  # still being read: not reused
    fence.done = True
    pool.reclaim()
    third = pool.acquire(990)  # same size class
    assert third is first and pool.reuses == 1
    assert sizes == [size_class(1000)] * 2


def test_reclaim_blocks_on_the_oldest_fence_only_when_over_the_limit():
    pool, _ = _counting_pool()
    fences = [FakeFence() for _ in range(3)]
    for fence in fences:
        pool.release_after(fence, [pool.acquire(64)])
    pool.reclaim(max_pending=3)
    assert not any(f.synchronized for f in fences)
    pool.reclaim(max_pending=1)
    assert [f.synchronized for f in fences] == [True, True, False]
    assert pool.pending == 1 and pool.free_buffers == 2


def test_close_waits_for_outstanding_copies_and_drops_every_buffer():
    pool, _ = _counting_pool()
    fence = FakeFence()
    pool.release_after(fence, [pool.acquire(64)])
    pool.release_after(FakeFence(), [])
    done = FakeFence()
    done.done = True
    pool.release_after(done, [pool.acquire(64)])
    pool.reclaim()
    pool.close()
    assert fence.synchronized
    assert pool.pending == 0 and pool.free_buffers == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["take", "give", "finish"]), st.integers(1, 3000))))
def test_pool_never_hands_out_a_buffer_that_is_held_or_being_read(ops):
    pool, sizes = _counting_pool()
    held: list[torch.Tensor] = []
    in_flight: list[tuple[FakeFence, torch.Tensor]] = []
    peak_busy: collections.Counter[int] = collections.Counter()
    for op, size in ops:
        if op == "take":
            buffer = pool.acquire(size)
            busy = held + [b for _, b in in_flight]
            assert all(buffer is not other for other in busy)
            assert buffer.numel() == size_class(size)
            held.append(buffer)
        elif op == "give" and held:
            fence = FakeFence()
            buffer = held.pop(0)
            pool.release_after(fence, [buffer])
            in_flight.append((fence, buffer))
        elif op == "finish" and in_flight:
            in_flight.pop(0)[0].done = True
            pool.reclaim()
        busy_now = collections.Counter(b.numel() for b in held + [b for _, b in in_flight])
        peak_busy |= busy_now  # per size class maximum
    # warm buffers are reused: a class never allocates more than it ever had busy at once
    allocated = collections.Counter(sizes)
    assert all(allocated[cls] <= peak_busy[cls] for cls in allocated)
    assert pool.allocations + pool.reuses == sum(1 for op, _ in ops if op == "take")


def test_stage_into_pool_copies_values_into_pool_buffers():
    pool, sizes = _counting_pool()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    batch = {
        "strided": base.t(),  # non-contiguous source
        "half": torch.ones(5, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "text": ["x"],
    }
    staged, buffers, keep_alive = stage_into_pool(batch, pool)
    for key in ("strided", "half", "mask"):
        assert torch.equal(staged[key], batch[key]) and staged[key].dtype == batch[key].dtype
    assert staged["empty"] is batch["empty"] and staged["text"] is batch["text"]
    assert len(buffers) == len(sizes) == 3 and keep_alive == []
    pointers = [staged[k].untyped_storage().data_ptr() for k in ("strided", "half", "mask")]
    assert pointers == [b.data_ptr() for b in buffers]


class CopyOnDeliverMover(_PooledMover):
    """CPU stand-in for the CUDA mover: the 'copy' runs at delivery, then its fence completes.

    If the pool handed out a buffer before its copy ran, a later batch would overwrite an
    earlier one and the delivered values would be wrong.
    """

    def __init__(self, depth: int) -> None:
        pool, self.sizes = _counting_pool()
        super().__init__(torch.device("cpu"), depth, pool)

    def copy(self, host):
        return host, CopyFence(), []

    def deliver(self, staged):
        host, fence, _ = staged
        moved = map_tensors(torch.clone, host)
        fence.copied.set()
        return moved


class CopyFence:
    """Completes when the stand-in copy has run; synchronize() really waits for it."""

    def __init__(self) -> None:
        self.copied = threading.Event()

    def query(self) -> bool:
        return self.copied.is_set()

    def synchronize(self) -> None:
        assert self.copied.wait(WAIT_S)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pooled_pipeline_reuses_buffers_once_warm_and_never_corrupts_batches(depth):
    n = 40
    mover = CopyOnDeliverMover(depth)
    run = _Pass(batches(n, width=100), mover, depth)
    got = [b for b in run]
    assert [int(b["sample_id"]) for b in got] == list(range(n))
    assert all(torch.equal(b["x"], torch.full((100,), i)) for i, b in enumerate(got))
    per_batch = 2  # two tensors per batch
    # buffers are busy from staging until their copy ran; the loader waits once `depth`
    # copies are pending, so at most depth + 1 batches' worth ever exist
    assert mover.pool.allocations <= per_batch * (depth + 1)
    assert mover.pool.reuses >= per_batch * n - mover.pool.allocations
    mover.close()
    assert mover.pool.free_buffers == 0 and mover.pool.pending == 0


class LaggingCopyMover(_PooledMover):
    """Copies that only finish when someone waits for them: a GPU far behind the host."""

    def __init__(self, depth: int) -> None:
        pool, self.sizes = _counting_pool()
        super().__init__(torch.device("cpu"), depth, pool)
        self.fences: list[FakeFence] = []

    def copy(self, host):
        self.fences.append(FakeFence())
        return host, self.fences[-1], []


@pytest.mark.parametrize("depth", [1, 3])
def test_pinned_memory_stays_bounded_when_copies_lag_behind(depth):
    mover = LaggingCopyMover(depth)
    for i in range(20):
        mover.stage({"x": torch.full((64,), i)})
        assert mover.pool.pending <= depth + 1
    assert mover.pool.allocations <= depth + 1
    assert all(f.synchronized for f in mover.fences[: 20 - depth - 1])
    mover.close()
    assert mover.pool.free_buffers == 0 and mover.pool.pending == 0


# --------------------------------------------------------------------------- CUDA only

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_batches_arrive_on_device_with_the_right_values():
    source = [
        {"x": torch.randn(256, 256), "sample_id": torch.tensor([i]), "t": ["s"]} for i in range(12)
    ]
    with DevicePrefetcher(source, "cuda", depth=2) as prefetcher:
        for expected, batch in zip(source, prefetcher):
            assert batch["x"].is_cuda and batch["t"] is expected["t"]
            assert torch.equal(batch["x"].cpu(), expected["x"])


@cuda
def test_cuda_pool_is_pinned_reused_once_warm_and_released_on_close():
    source = [{"x": torch.full((1024,), float(i))} for i in range(30)]
    prefetcher = DevicePrefetcher(source, "cuda:0", depth=2)
    total = sum(float(b["x"][0]) for b in prefetcher)
    assert total == float(sum(range(30)))
    pool = prefetcher._mover.pool
    assert pool.allocations <= 2 + 1 and pool.reuses >= 30 - pool.allocations
    assert pool.acquire(1024 * 4).is_pinned()
    prefetcher.close()
    assert pool.free_buffers == 0 and pool.pending == 0


@cuda
def test_cuda_consumer_stream_sees_the_completed_copy():
    # a slow kernel on the consumer stream after each batch: the next copy must not be read early
    size = 1 << 22
    source = [torch.full((size,), float(i)) for i in range(8)]
    stream = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(stream):
        for batch in DevicePrefetcher(source, "cuda", depth=3):
            torch.cuda._sleep(1_000_000)
            sums.append(batch.sum())
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [float(i * size) for i in range(8)]
