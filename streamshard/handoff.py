"""Moving batches from worker processes without a fresh shared-memory segment per tensor.

A DataLoader worker that yields ordinary tensors makes torch copy each one into a new
shared-memory segment, which the main process maps and later unmaps: at ~1 GB/s here that hand-off,
not decoding, was the bottleneck. Tensors that already live in shared memory travel as a handle.
So each ``StreamLoader`` worker keeps a small pool of shared-memory *slots*, copies every batch
into a free slot (one memcpy into memory that is already mapped), and the main process maps each
slot once and keeps it mapped.

A slot goes back to its worker only when the training loop has let go of the batch: the loader
holds the batch's tensors and releases a slot once no one else references any of them (views
count: a view keeps its base tensor referenced). A batch the user keeps is never overwritten; the
worker then takes another slot, and with every slot held it hands the batch over the ordinary way.
The leases are one int8 per (worker, slot) in shared memory: the worker sets a slot busy, the main
process frees it; each transition has one writer.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from typing import Any

import torch

SLOT_KEY = "__streamshard_slot__"
MAX_SLOTS = 32  # per worker; past this the batch goes through torch's ordinary queue
_ALIGN = 64
_GROWTH = 1.25  # a slot reallocated for a larger batch gets this much headroom


def new_leases(num_workers: int) -> torch.Tensor:
    """The shared lease table of a loader's workers (0 = free, 1 = holding a batch in flight or in use)."""
    return torch.zeros((num_workers, MAX_SLOTS), dtype=torch.int8).share_memory_()


class SlotPool:
    """One worker's slots: each batch is copied into a free slot and sent by handle."""

    def __init__(self, leases: torch.Tensor, worker_id: int) -> None:
        self.leases, self.worker_id, self.pid = leases, worker_id, os.getpid()
        self.buffers: list[torch.Tensor | None] = [None] * MAX_SLOTS
        self.fallbacks = 0  # batches sent the ordinary way because every slot was held

    def place(self, batch: Any) -> Any:
        """``batch`` with its CPU tensors moved into a free slot (other values and structures unchanged)."""
        if not isinstance(batch, dict):
            return batch
        tensors = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"]
        need = sum(_aligned(v.numel() * v.element_size()) for _, v in tensors)
        slot = self._free_slot(need)
        if slot is None:
            self.fallbacks += 1
            return batch
        buffer = self.buffers[slot]
        assert buffer is not None
        out = dict(batch)
        offset = 0
        for key, value in tensors:
            size = value.numel() * value.element_size()
            view = buffer[offset:offset + size].view(value.dtype).view(value.shape)
            view.copy_(value)
            out[key] = view
            offset += _aligned(size)
        self.leases[self.worker_id, slot] = 1
        out[SLOT_KEY] = (self.worker_id, slot)
        return out

    def _free_slot(self, need: int) -> int | None:
        free = [s for s, busy in enumerate(self.leases[self.worker_id].tolist()) if not busy]
        if not free:
            return None
        for s in free:
            buffer = self.buffers[s]
            if buffer is not None and buffer.numel() >= need:
                return s
        s = free[0]  # grow (or create) one free slot
        self.buffers[s] = torch.empty(max(_aligned(int(need * _GROWTH)), _ALIGN), dtype=torch.uint8).share_memory_()
        return s


class SlotLeases:
    """The main process's side: hold each slotted batch's tensors, free a slot once they are let go."""

    def __init__(self, leases: torch.Tensor) -> None:
        self.leases = leases
        self.held: deque[tuple[tuple[int, int], list[torch.Tensor]]] = deque()
        self.mapped: dict[tuple[int, int], Any] = {}  # keeps each slot's mapping alive: received again, it is reused

    def receive(self, batch: Any, copied: bool) -> Any:
        """Take the slot tag off a batch; ``copied``: the batch was already copied out (pinned memory)."""
        if not isinstance(batch, dict) or SLOT_KEY not in batch:
            return batch
        worker, index = batch.pop(SLOT_KEY)  # DataLoader turns the tuple into a list
        slot = (int(worker), int(index))
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        if copied or not tensors:
            self.leases[slot] = 0
            return batch
        self.mapped[slot] = tensors[0].untyped_storage()
        self.held.append((slot, tensors))
        return batch

    def sweep(self) -> None:
        """Free the slots of batches no one references any more (only ``held`` and the call itself)."""
        kept: deque[tuple[tuple[int, int], list[torch.Tensor]]] = deque()
        while self.held:
            slot, tensors = self.held.popleft()
            if all(sys.getrefcount(t) <= 3 for t in tensors):  # the list, the loop variable, the argument
                self.leases[slot] = 0
            else:
                kept.append((slot, tensors))
        self.held = kept

    def reset(self) -> None:
        """Before a pass: every slot not held by a batch the user may still have is free (batches
        prefetched by an abandoned pass were never received, and no one can reference them)."""
        self.sweep()
        self.leases.zero_()
        for slot, _ in self.held:
            self.leases[slot] = 1


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
