"""Reusable host staging buffers, handed out again only after the copy reading them is done.

:class:`BufferPool` keeps flat byte buffers by :func:`size_class` and parks released ones
behind a :class:`Fence` (a ``torch.cuda.Event`` in practice) until the device copy that reads
them has completed; :func:`stage_into_pool` copies a batch's CPU tensors into such buffers.
The allocator is injected (page-locked on CUDA), so the bookkeeping runs and is tested on CPU.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .tensor_tree import map_tensors

__all__ = ["BufferPool", "Fence", "size_class", "stage_into_pool"]


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
