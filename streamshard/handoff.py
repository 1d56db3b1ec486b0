"""Moving batches from DataLoader worker processes without a fresh shared-memory segment per batch.

A DataLoader worker that yields ordinary tensors makes torch copy each one into a new
shared-memory segment, which the main process maps, faults in and later unmaps: at ~1 GB/s here
that hand-off, not decoding, was the bottleneck, and more so for small batches. So each worker
process keeps a few shared-memory *slots* and copies every batch into a free one (one memcpy into
memory that is already mapped). The main process receives a slot's buffer once (torch passes its
file descriptor) and keeps it mapped; after that a batch travels as a few bytes of layout (slot,
and per tensor its key, dtype, shape and offset), and the main process rebuilds the tensors as
views of the mapped buffer.

This works for ``StreamLoader`` and for a plain ``DataLoader`` alike, because the batch does it
itself: a worker yields a :class:`SlotBatch`, an ordinary dict to collate functions, whose pickled
form (made as torch's queue sends it) is the slot layout, and whose unpickling in the main process
rebuilds a plain dict of tensors. A slot goes back to its worker only when the training loop has let
go of the batch: the tensors of one batch share one storage, and when it is freed (the last view
gone, a pinned copy made, ...) a finalizer marks the slot free in a table shared with the worker.
A batch the user keeps is never overwritten; the worker then takes another slot, and with every
slot held sends the batch the ordinary way. The slots are never handed to user code in the worker
(a collate function sees the batch's own tensors; only pickling copies them into a slot), so a
collate function that returns something else than the batch sends it the ordinary way, intact.
"""

from __future__ import annotations

import copy
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MAX_SLOTS = 32  # per worker process; past this a batch goes through torch's ordinary queue
_ALIGN = 64
_GROWTH = 1.25  # a slot reallocated for a larger batch gets this much headroom


class WorkerSlots:
    """One worker process's slots, and the tables it shares with the main process: ``leases``
    (int8 per slot: 1 while a batch in it is in flight or in use) and ``mapped`` (int64 per slot: the
    buffer generation the main process has mapped). Each entry has one writer per transition."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = f"{self.pid}-{os.urandom(8).hex()}"  # these slots, not a later process with this pid
        self.leases = torch.zeros(MAX_SLOTS, dtype=torch.int8).share_memory_()
        self.mapped = torch.zeros(MAX_SLOTS, dtype=torch.int64).share_memory_()
        self._leases, self._mapped = self.leases.numpy(), self.mapped.numpy()
        self.buffers: list[torch.Tensor | None] = [None] * MAX_SLOTS
        self.generations = [0] * MAX_SLOTS  # of each slot's buffer, counted in this process
        self._lock = threading.Lock()  # pickling runs on the queue's feeder thread

    def wrap(self, batch: Any) -> Any:
        """``batch`` as a :class:`SlotBatch` when it is a dict with CPU tensors; else itself."""
        if isinstance(batch, dict) and not isinstance(batch, SlotBatch) and _cpu_tensors(batch):
            return SlotBatch(batch, self)
        return batch

    def pack(self, batch: dict[Any, Any]) -> tuple[Any, tuple[Any, ...]]:
        """The pickled form of ``batch``: its layout over a free slot (the slot's buffer and the
        tables ride along until the main process has them), or, with every slot held, a plain dict."""
        tensors = _cpu_tensors(batch)
        with self._lock:
            slot = self._free_slot(sum(_aligned(_nbytes(v)) for v in tensors.values()))
            if slot is None:  # every slot held by batches the loop keeps: the ordinary way
                return dict, (in_one_segment(dict(batch)),)
            buffer = self.buffers[slot]
            assert buffer is not None
            layout: list[tuple[Any, ...]] = []
            others: dict[Any, Any] = {}
            offset = 0
            for key, value in batch.items():
                if key not in tensors:
                    layout.append((key,))
                    others[key] = value
                    continue
                _copy_into(buffer, offset, value)
                layout.append((key, value.dtype, tuple(value.shape), offset))
                offset += _aligned(_nbytes(value))
            self._leases[slot] = 1
            generation = self.generations[slot]
            fresh = int(self._mapped[slot]) != generation
            return _rebuild, (self.token, self.pid, slot, generation, offset, layout, others,
                              buffer if fresh else None, (self.leases, self.mapped) if fresh else None)

    def _free_slot(self, need: int) -> int | None:
        free = np.flatnonzero(self._leases == 0).tolist()
        if not free:
            return None
        for s in free:
            buffer = self.buffers[s]
            if buffer is not None and buffer.numel() >= need:
                return s
        s = free[0]  # grow (or create) the first free slot
        self.buffers[s] = torch.empty(max(_aligned(int(need * _GROWTH)), _ALIGN), dtype=torch.uint8).share_memory_()
        self.generations[s] += 1
        return s


class SlotBatch(dict):  # type: ignore[type-arg]
    """A batch on its way out of a worker process: a dict to whoever looks at it there (collate
    functions, ``copy.copy``), pickled as its layout over one of the worker's slots."""

    __slots__ = ("_slots",)

    def __init__(self, batch: dict[Any, Any], slots: WorkerSlots) -> None:
        super().__init__(batch)
        self._slots = slots

    def __copy__(self) -> "SlotBatch":
        return SlotBatch(self, self._slots)

    def __deepcopy__(self, memo: dict[int, Any]) -> "SlotBatch":
        return SlotBatch({k: copy.deepcopy(v, memo) for k, v in self.items()}, self._slots)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self._slots.pack(self)


@dataclass
class _Received:
    """The main process's view of one worker's slots: its tables, and each slot's mapped buffer."""

    pid: int
    leases: np.ndarray  # views of the shared tables (they keep the tables' tensors alive)
    mapped: np.ndarray
    buffers: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # slot -> (generation, bytes)


_received: dict[str, _Received] = {}
_received_lock = threading.Lock()


def _rebuild(token: str, pid: int, slot: int, generation: int, size: int, layout: list[tuple[Any, ...]],
             others: dict[Any, Any], buffer: torch.Tensor | None, tables: tuple[torch.Tensor, torch.Tensor] | None
             ) -> dict[Any, Any]:
    """In the receiving process: the batch a worker packed into ``slot``, as views of the slot's buffer
    that free the slot once the last of them is gone."""
    with _received_lock:
        worker = _received.get(token)
        if worker is None:
            if tables is None:
                raise RuntimeError(f"a batch from worker process {pid} names slot tables that never arrived; "
                                   "this is a bug in streamshard")
            _forget_exited_workers()
            worker = _received[token] = _Received(pid, tables[0].numpy(), tables[1].numpy())
        if buffer is not None:
            worker.buffers[slot] = (generation, buffer.numpy())
            worker.mapped[slot] = generation
        held, data = worker.buffers.get(slot, (None, None))
        if held != generation or data is None:
            raise RuntimeError(f"worker process {pid} sent a batch in slot {slot} (buffer {generation}) whose "
                               f"buffer never arrived (holding {held}); this is a bug in streamshard")
    region = data[:size]  # one new array per batch: the storage of all its tensors holds it
    base = torch.from_numpy(region)
    batch: dict[Any, Any] = {}
    for entry in layout:
        if len(entry) == 1:
            batch[entry[0]] = others[entry[0]]
            continue
        key, dtype, shape, offset = entry
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        batch[key] = base[offset:offset + nbytes].view(dtype).view(shape)
    weakref.finalize(region, _release, worker.leases, slot).atexit = False
    return batch


def mapped_bytes() -> int:
    """Bytes of worker processes' slots this process has mapped (the hand-off's memory: at most
    ``MAX_SLOTS`` per live worker, each the size of the largest batch it carried plus 25%)."""
    with _received_lock:
        _forget_exited_workers()
        return sum(data.nbytes for worker in _received.values() for _, data in worker.buffers.values())


def _release(leases: np.ndarray, slot: int) -> None:
    leases[slot] = 0


def _forget_exited_workers() -> None:
    """Drop the maps of worker processes that have exited (their batches still in use keep theirs)."""
    for token, worker in list(_received.items()):
        try:
            os.kill(worker.pid, 0)
        except ProcessLookupError:
            del _received[token]
        except PermissionError:  # alive, another user's: not ours to judge
            pass


def in_one_segment(batch: Any) -> Any:
    """``batch`` with its CPU tensors copied into one new shared-memory segment, as views of it: what a
    worker sends the ordinary way when every slot is held (torch then passes one descriptor, not one
    per tensor)."""
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
