"""Moving batches from worker processes without a fresh shared-memory segment per tensor.

A DataLoader worker that yields ordinary tensors makes torch copy each one into a new
shared-memory segment, which the main process maps and later unmaps: at ~1 GB/s here that hand-off,
not decoding, was the bottleneck. So each ``StreamLoader`` worker keeps a small pool of shared-memory
*slots* and copies every batch into a free slot (one memcpy into memory that is already mapped).
The main process receives each slot's buffer once (torch passes its file descriptor) and keeps it
mapped; after that a batch travels as a few bytes of layout (slot, and per tensor its key, dtype,
shape and offset), and the main process rebuilds the tensors over the mapped buffer: no descriptor
passing, no socket round trip, no copy per batch.

A slot goes back to its worker only when the training loop has let go of the batch: the loader
holds the batch's tensors and releases a slot once no one else references any of them (views
count: a view keeps its base tensor referenced). A batch the user keeps is never overwritten; the
worker then takes another slot, and with every slot held it hands the batch over the ordinary way.
Shared tables (``SlotTables``) hold one lease per (worker, slot), set busy by the worker and freed
by the main process, and which buffer of each slot the main process has mapped (a buffer reallocated
for a larger batch, or a new worker process, sends its buffer again); each entry has one writer per
transition.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

SLOT_KEY = "__streamshard_slot__"
MAX_SLOTS = 32  # per worker; past this the batch goes through torch's ordinary queue
_ALIGN = 64
_GROWTH = 1.25  # a slot reallocated for a larger batch gets this much headroom


LAYOUT_KEY = "__streamshard_layout__"
BUFFER_KEY = "__streamshard_buffer__"


@dataclass(frozen=True)
class SlotTables:
    """Shared between a loader and its workers: ``leases`` (int8 per worker and slot: 0 free, 1 holding
    a batch in flight or in use) and ``mapped`` (int64: the buffer generation the main process holds)."""

    leases: torch.Tensor
    mapped: torch.Tensor


def new_leases(num_workers: int) -> SlotTables:
    """The shared tables of a loader's workers."""
    return SlotTables(torch.zeros((num_workers, MAX_SLOTS), dtype=torch.int8).share_memory_(),
                      torch.zeros((num_workers, MAX_SLOTS), dtype=torch.int64).share_memory_())


class SlotPool:
    """One worker's slots: each batch is copied into a free slot and sent as its layout."""

    def __init__(self, tables: SlotTables, worker_id: int) -> None:
        self.tables, self.worker_id, self.pid = tables, worker_id, os.getpid()
        self.leases = tables.leases
        self.buffers: list[torch.Tensor | None] = [None] * MAX_SLOTS
        self.generations = [0] * MAX_SLOTS  # of each slot's buffer, counted in this process
        self.fallbacks = 0  # batches sent the ordinary way because every slot was held
        tables.mapped[worker_id].zero_()  # a new process: whatever the main process mapped for this worker is stale

    def place(self, batch: Any) -> Any:
        """``batch`` copied into a free slot, as a message of its layout (the slot's buffer rides along
        the first time); other values pass as they are. Not a dict, or no free slot: ``batch`` itself."""
        if not isinstance(batch, dict):
            return batch
        tensors = _cpu_tensors(batch)
        need = sum(_aligned(_nbytes(v)) for v in tensors.values())
        slot = self._free_slot(need)
        if slot is None:
            self.fallbacks += 1
            return batch
        buffer = self.buffers[slot]
        assert buffer is not None
        layout: list[tuple[Any, ...]] = []
        message: dict[Any, Any] = {}
        offset = 0
        for key, value in batch.items():
            if key not in tensors:
                layout.append((key,))
                message[key] = value
                continue
            _copy_into(buffer, offset, value)
            layout.append((key, value.dtype, tuple(value.shape), offset))
            offset += _aligned(_nbytes(value))
        self.leases[self.worker_id, slot] = 1
        generation = self.generations[slot]
        message[SLOT_KEY] = (self.worker_id, slot, generation)
        message[LAYOUT_KEY] = layout
        if int(self.tables.mapped[self.worker_id, slot]) != generation:
            message[BUFFER_KEY] = buffer
        return message

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
        self.generations[s] += 1
        return s


class SlotLeases:
    """The main process's side: rebuild each slotted batch over its mapped slot, hold its tensors, and
    free the slot once they are let go."""

    def __init__(self, tables: SlotTables) -> None:
        self.tables = tables
        self.leases = tables.leases
        self.held: deque[tuple[tuple[int, int], list[torch.Tensor]]] = deque()
        self.mapped: dict[tuple[int, int], tuple[int, Any]] = {}  # slot -> (generation, storage), kept mapped

    def receive(self, message: Any, pin: bool) -> Any:
        """The batch a worker's message describes; ``pin``: copy it into page-locked memory (the slot
        is then free at once), otherwise its tensors live in the slot until they are let go."""
        if not isinstance(message, dict) or SLOT_KEY not in message:
            return message
        worker, index, generation = (int(x) for x in message[SLOT_KEY])  # DataLoader may turn tuples into lists
        slot = (worker, index)
        if BUFFER_KEY in message:
            self.mapped[slot] = (generation, message[BUFFER_KEY].untyped_storage())
            self.tables.mapped[slot] = generation
        held, storage = self.mapped.get(slot, (None, None))
        if held != generation:
            raise RuntimeError(f"StreamLoader: worker {worker} sent a batch in slot {index} (buffer {generation}) "
                               f"whose buffer never arrived (holding {held}); this is a bug in streamshard")
        batch: dict[Any, Any] = {}
        for entry in message[LAYOUT_KEY]:
            if len(entry) == 1:
                batch[entry[0]] = message[entry[0]]
                continue
            key, dtype, shape, offset = entry
            tensor = torch.empty(0, dtype=dtype).set_(storage, offset // dtype.itemsize, shape)
            batch[key] = tensor.pin_memory() if pin else tensor
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        if pin or not tensors:
            self.leases[slot] = 0
            return batch
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


def in_one_segment(batch: Any) -> Any:
    """``batch`` with its CPU tensors copied into one new shared-memory segment, as views of it.

    For torch's ordinary worker hand-off (a plain ``DataLoader``): torch creates a segment and passes
    a file descriptor per tensor storage, so a batch of six tensors costs six of each; views of one
    shared storage travel as one. Small batches (the default 256 rows) gain the most."""
    if not isinstance(batch, dict):
        return batch
    tensors = _cpu_tensors(batch)
    if len(tensors) < 2:
        return batch
    buffer = torch.empty(max(sum(_aligned(_nbytes(v)) for v in tensors.values()), _ALIGN),
                         dtype=torch.uint8).share_memory_()
    out, offset = dict(batch), 0
    for key, value in tensors.items():
        out[key] = _copy_into(buffer, offset, value)
        offset += _aligned(_nbytes(value))
    return out


def _cpu_tensors(batch: dict[Any, Any]) -> dict[Any, torch.Tensor]:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _copy_into(buffer: torch.Tensor, offset: int, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into ``buffer`` at byte ``offset``; the copy, as a view of the buffer."""
    view = buffer[offset:offset + _nbytes(value)].view(value.dtype).view(value.shape)
    view.copy_(value)
    return view


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
