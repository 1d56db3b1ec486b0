"""Move batches to a device ahead of the training step so the step never waits for a copy.

``DevicePrefetcher`` runs a small pipeline per pass over its source::

    load (+pin, +issue copy)  ──ready queue──►  deliver  ──►  compute
         background thread       depth slots    consumer       consumer

The background thread pulls batches from the source at most ``depth`` ahead of the
consumer. On CUDA it copies each CPU tensor into a reusable page-locked buffer from a
:class:`BufferPool` and enqueues a ``non_blocking`` copy on a side stream, recording an
event; the consumer's current stream waits on that event (a GPU-side wait, not a host one)
and the device tensors are ``record_stream``-ed so the caching allocator keeps them until
the consumer's work is done. A pinned buffer goes back to the free list only after the
event of the copy that read it has completed. On CPU (and other devices) the same pipeline
runs with no pinning: loading still overlaps compute.

Only the mover differs between devices; ordering, nesting, errors, depth and shutdown are
one code path, which is what the CPU tests exercise.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

__all__ = ["BufferPool", "DevicePrefetcher", "Fence", "map_tensors", "size_class", "stage_into_pool"]

# How long close() waits for the loader thread; a source stuck in next() is left to the
# daemon thread, which exits as soon as next() returns because the stop flag is set.
_JOIN_TIMEOUT_S = 1.0


# --------------------------------------------------------------------------- batch trees


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Return ``batch`` with ``fn`` applied to every tensor leaf, keeping the structure.

    Walks dicts (and other mappings), lists, tuples, namedtuples and dataclass instances.
    Every other leaf (strings, numbers, ``None``, numpy arrays, ...) is returned as is, and a
    container holding no tensor is returned as the very same object.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return _map_mapping(fn, batch)
    if isinstance(batch, (list, tuple)):
        return _map_sequence(fn, batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return _map_dataclass(fn, batch)
    return batch


def _map_mapping(fn: Callable[[torch.Tensor], Any], batch: Mapping) -> Any:
    items = {key: map_tensors(fn, value) for key, value in batch.items()}
    if all(items[key] is value for key, value in batch.items()):
        return batch
    if type(batch) is dict:
        return items
    try:  # keep the mapping's own type (OrderedDict, defaultdict, ...) when it copies
        clone = copy.copy(batch)
        clone.update(items)
        return clone
    except (TypeError, AttributeError):
        return items


def _map_sequence(fn: Callable[[torch.Tensor], Any], batch: list | tuple) -> Any:
    items = [map_tensors(fn, value) for value in batch]
    if all(new is old for new, old in zip(items, batch)):
        return batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*items)
    if type(batch) in (list, tuple):
        return type(batch)(items)
    try:
        return type(batch)(items)
    except TypeError:
        return items


def _map_dataclass(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    mapped = {name: map_tensors(fn, value) for name, value in fields.items()}
    if all(mapped[name] is value for name, value in fields.items()):
        return batch
    # copy + object.__setattr__ works for frozen and init=False fields and skips __post_init__
    clone = copy.copy(batch)
    for name, value in mapped.items():
        object.__setattr__(clone, name, value)
    return clone


# --------------------------------------------------------------------------- buffer pool


class Fence(Protocol):
    """Something that completes later: ``torch.cuda.Event`` satisfies it."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to one of 8 classes per power of two (at most 12.5% waste).

    Batches whose sizes differ a little (variable-length text) then share buffers, while a
    fixed-shape batch keeps hitting one class.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    step = max(1, (1 << (nbytes.bit_length() - 1)) // 8)
    return -(-nbytes // step) * step


class BufferPool:
    """Reusable flat byte buffers keyed by size class, returned only once their reader is done.

    ``acquire`` hands out a free buffer of the right class or allocates one;
    ``release_after(fence, buffers)`` parks buffers until ``fence`` completes; ``reclaim``
    moves completed ones back to the free list. The pool is independent of pinning (the
    allocator is injected), so its bookkeeping is testable without a GPU. Thread-safe.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: deque[tuple[Fence, list[torch.Tensor], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        self.allocations = 0
        self.reuses = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Return a 1-D uint8 buffer of at least ``nbytes`` bytes that nobody else holds."""
        key = size_class(nbytes)
        with self._lock:
            free = self._free.get(key)
            if free:
                self.reuses += 1
                return free.pop()
            self.allocations += 1
        return self._allocate(key)

    def release_after(
        self, fence: Fence, buffers: list[torch.Tensor], keep_alive: tuple[Any, ...] = ()
    ) -> None:
        """Return ``buffers`` to the free list once ``fence`` has completed.

        ``keep_alive`` objects (e.g. caller-pinned tensors being read by the same copy) are
        only referenced until then, never pooled.
        """
        with self._lock:
            self._pending.append((fence, buffers, keep_alive))

    def reclaim(self, max_pending: int | None = None) -> None:
        """Free buffers whose fence completed; block on the oldest while over ``max_pending``.

        Fences complete in order on one stream, so only the head is ever waited on.
        """
        while True:
            with self._lock:
                if not self._pending:
                    return
                head = self._pending[0]
                over = max_pending is not None and len(self._pending) > max_pending
            if over:
                head[0].synchronize()
            elif not head[0].query():
                return
            with self._lock:
                if self._pending and self._pending[0] is head:  # another thread may have won
                    self._pending.popleft()
                    for buffer in head[1]:
                        self._free.setdefault(buffer.numel(), []).append(buffer)

    def close(self) -> None:
        """Wait for outstanding readers, then drop every buffer (frees pinned memory)."""
        with self._lock:
            pending, self._pending = self._pending, deque()
            self._free.clear()
        for fence, _, _ in pending:
            fence.synchronize()

    @property
    def pending(self) -> int:
        """Number of release_after groups still waiting for their fence."""
        with self._lock:
            return len(self._pending)

    @property
    def free_buffers(self) -> int:
        """Number of buffers ready to be handed out again."""
        with self._lock:
            return sum(len(free) for free in self._free.values())


def stage_into_pool(batch: Any, pool: BufferPool) -> tuple[Any, list[torch.Tensor], list[Any]]:
    """Copy the CPU tensors of ``batch`` into pool buffers (pinned, when the pool pins).

    Returns ``(staged_batch, buffers, keep_alive)``: the batch whose CPU tensors now view pool
    buffers, the buffers to release once the device copy has read them, and the tensors
    that were already pinned (used directly, so they must outlive the copy).
    """
    buffers: list[torch.Tensor] = []
    keep_alive: list[Any] = []

    def stage(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.nbytes == 0:
            return tensor
        if tensor.is_pinned():
            keep_alive.append(tensor)
            return tensor
        buffer = pool.acquire(tensor.nbytes)
        buffers.append(buffer)
        host = buffer[: tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        return host.copy_(tensor)

    return map_tensors(stage, batch), buffers, keep_alive


# --------------------------------------------------------------------------- movers


class _Mover:
    """Device-specific half of the pipeline; this base moves synchronously (CPU, MPS, ...)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stage(self, batch: Any) -> Any:
        """Runs in the loader thread: return something ``deliver`` turns into the batch."""
        return map_tensors(lambda t: t.to(self.device), batch)

    def deliver(self, staged: Any) -> Any:
        """Runs in the consumer thread, right before the batch is handed out."""
        return staged

    def close(self) -> None:
        """Release device-side resources."""


class _PooledMover(_Mover):
    """Stages CPU tensors through a :class:`BufferPool`; subclasses issue the copy and fence.

    A buffer is released to the pool with the fence of the copy that reads it, and the loader
    waits for the oldest copy once ``depth`` are in flight, which bounds the pool's size.
    """

    def __init__(self, device: torch.device, depth: int, pool: BufferPool) -> None:
        super().__init__(device)
        self.depth = depth
        self.pool = pool

    def stage(self, batch: Any) -> Any:
        self.pool.reclaim(max_pending=self.depth)
        host, buffers, keep_alive = stage_into_pool(batch, self.pool)
        moved, fence, created = self.copy(host)
        self.pool.release_after(fence, buffers, tuple(keep_alive))
        return moved, fence, created

    def copy(self, host: Any) -> tuple[Any, Fence, list[torch.Tensor]]:
        """Start copying ``host`` to the device: ``(batch, fence, tensors created)``."""
        raise NotImplementedError

    def close(self) -> None:
        self.pool.close()


class _CudaMover(_PooledMover):
    """Pinned pool + side stream + event: the consumer stream waits on the GPU, not the host."""

    def __init__(self, device: torch.device, depth: int) -> None:
        pool = BufferPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        super().__init__(device, depth, pool)
        self._stream = torch.cuda.Stream(device=device)

    def copy(self, host: Any) -> tuple[Any, Fence, list[torch.Tensor]]:
        created: list[torch.Tensor] = []

        def copy_to_device(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device == self.device:
                return tensor
            moved = tensor.to(self.device, non_blocking=True)
            created.append(moved)
            return moved

        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            on_device = map_tensors(copy_to_device, host)
            event = torch.cuda.Event()
            event.record(self._stream)
        return on_device, event, created

    def deliver(self, staged: Any) -> Any:
        on_device, event, created = staged
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for tensor in created:  # allocated on the side stream, used on the consumer's
            tensor.record_stream(consumer)
        return on_device


# --------------------------------------------------------------------------- the pipeline


class _Failure:
    """Carries an exception raised by the source (or staging) to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _load(
    source: Iterator[Any],
    mover: _Mover,
    ready: queue.SimpleQueue,
    slots: threading.Semaphore,
    stop: threading.Event,
) -> None:
    """Loader thread body; holds no reference to the pass object, so it can be collected."""
    # Thread-local: keeps the pinning copies (and the source's own ops) from fighting the
    # training thread's intra-op pool for cores, as torch's pin-memory thread also does.
    torch.set_num_threads(1)
    try:
        while True:
            slots.acquire()
            if stop.is_set():
                return
            try:
                item = mover.stage(next(source))
            except StopIteration:
                ready.put(_END)
                return
            except BaseException as error:  # noqa: BLE001 - forwarded, re-raised by the consumer
                ready.put(_Failure(error))
                return
            if stop.is_set():
                return
            ready.put(item)
    finally:
        del source  # drop our reference promptly so the source can clean up


class _Pass(Iterator[Any]):
    """One pass over the source: a loader thread, ``depth`` slots and a ready queue."""

    def __init__(self, source: Iterable[Any], mover: _Mover, depth: int) -> None:
        self._mover = mover
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_load,
            args=(iter(source), mover, self._ready, self._slots, self._stop),
            name="streamshard-prefetch",
            daemon=True,
        )
        self._thread.start()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._ready.get()
        if item is _END or isinstance(item, _Failure):
            self.close()
            if item is _END:
                raise StopIteration
            raise item.error  # same object: its traceback still shows the source's frames
        self._slots.release()  # the consumer holds this batch; the loader may fetch one more
        return self._mover.deliver(item)

    def close(self, timeout: float = _JOIN_TIMEOUT_S) -> None:
        """Stop the loader thread and wait for it at most ``timeout`` seconds."""
        self._done = True
        self._stop.set()
        self._slots.release()  # wake a loader waiting for a slot
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._drain()
        self._ready.put(_END)  # wakes a consumer blocked in __next__ on another thread

    def _drain(self) -> None:
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                return

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None and not stop.is_set():
            self.close()


class DevicePrefetcher:
    """Iterate ``iterable`` with each batch already on ``device``, loaded up to ``depth`` ahead.

    Batches may be tensors or dicts/lists/tuples/namedtuples/dataclasses of them; other
    leaves pass through untouched. Order is the source's order. An exception raised by the
    source is re-raised (same object, same traceback) where it happened in the stream.

    Each ``iter()`` starts a new pass over the source with its own loader thread, so a
    prefetcher over a re-iterable source (a ``DataLoader``, a list) serves many epochs; over a
    one-shot iterator the second pass is empty. A pass stops its thread when exhausted, when
    its iterator is closed or garbage-collected (breaking out of a ``for`` loop does this),
    or when the prefetcher is closed (also as a context manager). Deleting the prefetcher
    does not cut short an iterator you still hold; once nothing references a pass, its thread
    stops. Pinned buffers are reused across passes and freed by ``close()`` (or when the
    prefetcher and its passes are collected).
    """

    def __init__(self, iterable: Iterable[Any], device: str | torch.device, depth: int = 2) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        if not isinstance(iterable, Iterable):
            raise TypeError(f"iterable must be iterable, got {type(iterable).__name__}")
        self.iterable = iterable
        self.device = torch.device(device)
        self.depth = depth
        self._mover: _Mover | None = None
        self._passes: weakref.WeakSet[_Pass] = weakref.WeakSet()

    def __iter__(self) -> Iterator[Any]:
        run = _Pass(self.iterable, self._get_mover(), self.depth)
        self._passes.add(run)
        return run

    def __len__(self) -> int:
        """Length of the source; ``TypeError`` when the source has none."""
        if not hasattr(self.iterable, "__len__"):
            raise TypeError(f"the source {type(self.iterable).__name__} has no len()")
        return len(self.iterable)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop every running pass and release the pinned buffer pool."""
        for run in list(self._passes):
            run.close()
        if self._mover is not None:
            self._mover.close()
            self._mover = None

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        source = type(self.iterable).__name__
        return f"DevicePrefetcher({source}, device={str(self.device)!r}, depth={self.depth})"

    def _get_mover(self) -> _Mover:
        if self._mover is None:
            if self.device.type == "cuda":
                index = self.device.index
                if index is None:
                    index = torch.cuda.current_device()
                self._mover = _CudaMover(torch.device("cuda", index), self.depth)
            else:
                self._mover = _Mover(self.device)
        return self._mover
