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
one code path, which is what the CPU tests exercise. The buffer bookkeeping lives in
:mod:`streamshard.loader.pinned_pool` and the batch walking in :mod:`streamshard.loader.tensor_tree`; their
public names are re-exported here.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .pinned_pool import BufferPool, Fence, size_class, stage_into_pool
from .tensor_tree import map_tensors
from ..plan.validate import check_int

__all__ = ["BufferPool", "DevicePrefetcher", "Fence", "map_tensors", "size_class", "stage_into_pool"]

# How long close() waits for the loader thread; a source stuck in next() is left to the
# daemon thread, which exits as soon as next() returns because the stop flag is set.
_JOIN_TIMEOUT_S = 1.0


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
        check_int(depth, "depth", 1)
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
