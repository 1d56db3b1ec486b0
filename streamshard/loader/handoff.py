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

``StreamLoader``'s worker processes go one step further: DataLoader's own work per message (its
queues, the worker's feeder thread and pipe, the main process's bookkeeping) costs more than gathering a
small batch, so they send a ``ParquetStream``'s small batches several a message (:func:`chunks`, up to
``CHUNK_BATCHES``, the tensors of all in one slot), and the loader puts them back in the order of one
batch a message (:func:`merged`). A plain ``DataLoader`` still gets one batch a message.

Shared memory can run out (Docker gives a container 64 MB of ``/dev/shm``). Pickling runs on the
queue's feeder thread, where an exception is printed and the batch dropped: the pass would end
early, or the loader wait forever for the lost batch. So a batch never fails to pickle here: when no
slot (or segment) can be allocated it travels as bytes through the worker's pipe (slower, never
lost), and the first such batch of a worker carries a warning to the training process naming
``/dev/shm`` and the remedies. Before its first slot a worker compares what its slots will likely
need with ``/dev/shm``'s free space and warns the same way when it will not fit. A value of the batch
that cannot be pickled, or a pipe copy that fails too, becomes a :class:`HandOffError` raised in the
training loop (unpickled as DataLoader's own exception carrier, which its pin-memory thread passes on).
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler  # torch registers its tensor reductions here
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from torch._utils import ExceptionWrapper  # what DataLoader's workers send an exception in
from torch.utils.data import default_convert, get_worker_info

from ..errors import HandOffError

MAX_SLOTS = 32  # per worker process; past this a batch goes through torch's ordinary queue
_ALIGN = 64
_GROWTH = 1.25  # a slot reallocated for a larger batch gets this much headroom
SHM_DIR = "/dev/shm"
LIKELY_SLOTS = 6  # slots a worker usually fills at once: the loader's 4 batches in flight, 2 the loop holds
_REMEDIES = ("Give it more (docker run --shm-size=2g, or a larger emptyDir medium: Memory in Kubernetes), "
             "or use smaller batches, fewer worker processes, or StreamLoader(workers='threads')")


class WorkerSlots:
    """One worker process's slots, and the tables it shares with the main process: ``leases``
    (int8 per slot: 1 while a batch in it is in flight or in use) and ``mapped`` (int64 per slot: the
    buffer generation the main process has mapped). Each entry has one writer per transition."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.token = f"{self.pid}-{os.urandom(8).hex()}"  # these slots, not a later process with this pid
        self.leases: torch.Tensor | None = None  # the shared tables, made with the first slot
        self.mapped: torch.Tensor | None = None
        self.buffers: list[torch.Tensor | None] = [None] * MAX_SLOTS
        self.generations = [0] * MAX_SLOTS  # of each slot's buffer, counted in this process
        self._lock = threading.Lock()  # pickling runs on the queue's feeder thread
        self._warning: str | None = None  # to send with the next batch (once per kind of trouble)
        self._warned: set[str] = set()

    def wrap(self, batch: Any) -> Any:
        """``batch`` as a :class:`SlotBatch` when it is a dict with CPU tensors; else itself."""
        if isinstance(batch, dict) and not isinstance(batch, SlotBatch) and _cpu_tensors(batch):
            return SlotBatch(batch, self)
        return batch

    def pack(self, batch: dict[Any, Any]) -> tuple[Any, tuple[Any, ...]]:
        """The pickled form of ``batch`` (it must not fail: see the module docstring). Its tensors go
        into a free slot (the slot's buffer and the tables ride along until the main process has
        them); with every slot held, into one new segment; without shared memory for either, into
        bytes for the pipe. Its other values are pickled here, so that one that cannot be is an error
        in the training loop rather than a batch the queue drops."""
        tensors = _cpu_tensors(batch)
        need = sum(_aligned(v.nbytes) for v in tensors.values())
        with self._lock:
            try:
                others = _pickled_others(batch, tensors)
            except HandOffError as error:
                return _hand_off_failure, (str(error),)
            try:
                return self._pack_shared(batch, tensors, need, others)
            except Exception as error:  # torch: "unable to allocate shared memory(shm) ..."
                self._warn_once("failed", f"a DataLoader worker process (pid {self.pid}) could not allocate "
                                f"{need / 2**20:.1f} MB of shared memory in {SHM_DIR} ({error}); its batches "
                                f"travel through a pipe instead, which is slower. {SHM_DIR} is too small. "
                                f"{_REMEDIES}")
            try:
                data = bytearray(max(need, 1))
                layout = _lay_out(batch, tensors, torch.frombuffer(data, dtype=torch.uint8))
                return _from_bytes, (data, layout, others, self._take_warning())
            except Exception as error:
                return _hand_off_failure, (f"a batch could not leave DataLoader worker process {self.pid}: neither "
                                         f"shared memory in {SHM_DIR} nor the pipe took it ({error!r})",)

    def _pack_shared(self, batch: dict[Any, Any], tensors: dict[Any, torch.Tensor], need: int, others: bytes
                     ) -> tuple[Any, tuple[Any, ...]]:
        if self.leases is None:
            self._check_room(need)
            self.leases = torch.zeros(MAX_SLOTS, dtype=torch.int8).share_memory_()
            self.mapped = torch.zeros(MAX_SLOTS, dtype=torch.int64).share_memory_()
            self._leases, self._mapped = self.leases.numpy(), self.mapped.numpy()
        slot = self._free_slot(need)
        if slot is None:  # every slot held by batches the loop keeps: one new segment (torch passes its fd)
            segment = torch.empty(max(need, _ALIGN), dtype=torch.uint8).share_memory_()
            return _from_segment, (segment, _lay_out(batch, tensors, segment), others, self._take_warning())
        buffer = self.buffers[slot]
        assert buffer is not None
        layout = _lay_out(batch, tensors, buffer)
        self._leases[slot] = 1
        generation = self.generations[slot]
        fresh = int(self._mapped[slot]) != generation
        return _rebuild, (self.token, self.pid, slot, generation, need, layout, others,
                          buffer if fresh else None, (self.leases, self.mapped) if fresh else None,
                          self._take_warning())

    def _check_room(self, need: int) -> None:
        """Before the first slot: warn when the slots of this loader's workers will likely not fit in
        ``/dev/shm`` (they still work: batches past its room travel through the pipe)."""
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        likely = int(need * _GROWTH) * LIKELY_SLOTS * workers
        try:
            stat = os.statvfs(SHM_DIR)
        except OSError:
            return
        free = stat.f_bavail * stat.f_frsize
        if likely > free:
            self._warn_once("room", f"{SHM_DIR} has {free / 2**20:.0f} MB free; the hand-off slots of {workers} "
                            f"DataLoader worker process(es) will likely need about {likely / 2**20:.0f} MB "
                            f"({LIKELY_SLOTS} batches of {need / 2**20:.1f} MB each, +25%). Batches that do not "
                            f"fit travel through a pipe, slower. {_REMEDIES}")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            self._warning = message if self._warning is None else f"{self._warning}\n{message}"

    def _take_warning(self) -> str | None:
        warning, self._warning = self._warning, None
        return warning

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


# -- several batches a message (StreamLoader's worker processes) ------------------------------------

CHUNK_BATCHES = 16  # a worker process's batches in one message to StreamLoader, at most
CHUNK_BYTES = 2 << 20  # ... and about this many bytes (estimated before the pass: every worker must agree)


def batches_per_message(batch_bytes: float) -> int:
    """How many batches of about ``batch_bytes`` (an estimate) a worker process sends in one message."""
    return int(np.clip(CHUNK_BYTES // max(batch_bytes, 1.0), 1, CHUNK_BATCHES))


class BatchChunk:
    """Consecutive batches of one worker process's pass on their way to ``StreamLoader``, in one message.

    DataLoader pays per message: its index and result queues, the worker's feeder thread and pipe,
    the main process's bookkeeping (~0.3 ms of CPU a message on 2 cores, where gathering a 256-row batch
    takes ~0.035 ms). A chunk pays it once for up to ``CHUNK_BATCHES`` batches: the tensors of its dict
    batches travel in one slot (``WorkerSlots.pack``), and arrive as :class:`ChunkOf`. ``last`` marks
    the worker's final chunk of the pass; ``error`` the exception that ended the pass, raised in the
    loop after the batches before it (``StreamLoader`` merges the chunks back into round-robin order)."""

    __slots__ = ("worker", "batches", "last", "error", "_slots")

    def __init__(self, worker: int, batches: list[Any], last: bool, error: ExceptionWrapper | None,
                 slots: "WorkerSlots | None") -> None:
        self.worker, self.batches, self.last, self.error, self._slots = worker, batches, last, error, slots

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        dicts = [i for i, batch in enumerate(self.batches) if isinstance(batch, dict)]
        flat = {(i, key): value for i in dicts for key, value in self.batches[i].items()}
        plain = {i: batch for i, batch in enumerate(self.batches) if not isinstance(batch, dict)}
        head = (self.worker, len(self.batches), dicts, self.last, self.error)
        if self._slots is None or not _cpu_tensors(flat):
            return _unchunk, (head, plain, _as_is, (flat,))
        rebuild, args = self._slots.pack(flat)
        return _unchunk, (head, plain, rebuild, args)


class ChunkOf(NamedTuple):
    """A :class:`BatchChunk` as the main process receives it."""

    worker: int
    batches: list[Any]
    last: bool
    error: ExceptionWrapper | None


def _as_is(value: Any) -> Any:
    return value


def _unchunk(head: tuple[Any, ...], plain: dict[int, Any], rebuild: Any, args: tuple[Any, ...]) -> Any:
    """In the receiving process: the chunk's batches, each dict rebuilt from the one slot they share."""
    flat = rebuild(*args)
    if isinstance(flat, ExceptionWrapper):  # a hand-off failure: DataLoader raises it in the loop
        return flat
    worker, count, dicts, last, error = head
    batches: list[Any] = [None] * count
    for i in dicts:
        batches[i] = {}
    for (i, key), value in flat.items():
        batches[i][key] = value
    for i, batch in plain.items():
        batches[i] = batch
    return ChunkOf(worker, batches, last, error)


def chunks(worker: int, batches: Iterator[Any], slots: "WorkerSlots | None", per_chunk: int,
           convert: bool) -> Iterator[BatchChunk]:
    """``batches`` (one worker process's pass) as chunks of ``per_chunk`` batches, each sent as soon as
    it is full, then a last one (shorter, possibly empty, marked ``last``); an exception of the pass
    ends it in a last chunk carrying it.
    ``convert``: each batch through ``default_convert`` first (what DataLoader would do to it alone)."""
    held: list[Any] = []
    try:
        for batch in batches:
            held.append(default_convert(batch) if convert else batch)
            if len(held) >= per_chunk:  # sent at once: a slow next batch holds none of these back
                yield BatchChunk(worker, held, False, None, slots)
                held = []
    except Exception:  # noqa: BLE001 - raised in the training loop, with its type, after the batches before it
        error = ExceptionWrapper(sys.exc_info(), where=f"in DataLoader worker process {worker}")
        yield BatchChunk(worker, held, True, error, slots)
        return
    yield BatchChunk(worker, held, True, None, slots)


def merged(items: Iterator[Any], workers: int) -> Iterator[Any]:
    """The batches of ``items`` (:class:`ChunkOf` from DataLoader, which returns its workers' messages in
    turn) in the order of one batch a message: round robin over workers, an exhausted worker skipped
    (as ``thread_workers.round_robin``). Every worker's chunks hold the same number of batches, so at
    most about one chunk per worker waits here."""
    waiting: list[deque[Any]] = [deque() for _ in range(max(workers, 1))]
    ended = [False] * len(waiting)
    errors: list[ExceptionWrapper | None] = [None] * len(waiting)

    def pull() -> None:
        try:
            chunk = next(items)
        except StopIteration:
            ended[:] = [True] * len(ended)
            return
        if not isinstance(chunk, ChunkOf):
            raise HandOffError(f"a worker process sent {type(chunk).__name__} where StreamLoader expects its "
                               "chunks of batches; this is a bug in streamshard")
        waiting[chunk.worker].extend(chunk.batches)
        if chunk.last:
            ended[chunk.worker], errors[chunk.worker] = True, chunk.error

    try:
        active = list(range(len(waiting)))
        while active:
            for w in list(active):
                while not waiting[w] and not ended[w]:
                    pull()
                if waiting[w]:
                    yield waiting[w].popleft()
                    continue
                active.remove(w)
                error = errors[w]
                if error is not None:
                    error.reraise()
    finally:
        for queue in waiting:
            queue.clear()


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
             others: bytes, buffer: torch.Tensor | None, tables: tuple[torch.Tensor, torch.Tensor] | None,
             warning: str | None = None) -> dict[Any, Any]:
    """In the receiving process: the batch a worker packed into ``slot``, as views of the slot's buffer
    that free the slot once the last of them is gone."""
    _show(warning)
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
    batch = _views(torch.from_numpy(region), layout, others)
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


def _pickled_others(batch: dict[Any, Any], tensors: dict[Any, torch.Tensor]) -> bytes:
    """The values of ``batch`` that are not CPU tensors, pickled as torch's queue would pickle them."""
    others = {k: v for k, v in batch.items() if k not in tensors}
    try:
        return bytes(ForkingPickler.dumps(others))
    except Exception as error:
        for key, value in others.items():
            try:
                ForkingPickler.dumps(value)
            except Exception as per_key:
                error = per_key
                raise HandOffError(f"the batch's value under {key!r} ({type(value).__name__}) cannot be sent from a "
                                   f"DataLoader worker process: {error!r}") from None
        raise HandOffError(f"the batch cannot be sent from a DataLoader worker process: {error!r}") from None


def _lay_out(batch: dict[Any, Any], tensors: dict[Any, torch.Tensor], buffer: torch.Tensor) -> list[tuple[Any, ...]]:
    """``tensors`` copied into ``buffer`` one after the other, in ``batch``'s order; the layout: per
    key, the key alone (a value sent pickled) or key, dtype, shape and byte offset."""
    layout: list[tuple[Any, ...]] = []
    offset = 0
    raw = buffer.numpy()  # the copies go through numpy: a view and a copy per tensor, ~1 us each
    for key, value in batch.items():
        if key not in tensors:
            layout.append((key,))
            continue
        _copy_into(buffer, raw, offset, value)
        layout.append((key, value.dtype, tuple(value.shape), offset))
        offset += _aligned(value.nbytes)
    return layout


def _views(base: torch.Tensor, layout: list[tuple[Any, ...]], others: bytes) -> dict[Any, Any]:
    """The batch :func:`_lay_out` laid out in ``base`` (bytes), its tensors views of ``base``."""
    values = pickle.loads(others)  # made by this package's worker process (as torch's queue would send it)
    storage, start = base.untyped_storage(), base.storage_offset()  # ``base`` is bytes (uint8)
    batch: dict[Any, Any] = {}
    for entry in layout:
        if len(entry) == 1:
            batch[entry[0]] = values[entry[0]]
            continue
        key, dtype, shape, offset = entry
        # One ``set_`` onto the shared storage (bounds checked by torch) rather than a slice and two views:
        # ~2 us a tensor against ~7 (the main process pays this for every tensor of every batch).
        batch[key] = torch.empty(0, dtype=dtype).set_(storage, (start + offset) // dtype.itemsize, shape)
    return batch


def _from_bytes(data: bytearray, layout: list[tuple[Any, ...]], others: bytes, warning: str | None
                ) -> dict[Any, Any]:
    """In the receiving process: a batch that came through the pipe, its tensors views of its bytes."""
    _show(warning)
    return _views(torch.frombuffer(data, dtype=torch.uint8), layout, others)


def _from_segment(segment: torch.Tensor, layout: list[tuple[Any, ...]], others: bytes, warning: str | None
                  ) -> dict[Any, Any]:
    """In the receiving process: a batch sent in a segment of its own, its tensors views of it."""
    _show(warning)
    return _views(segment, layout, others)


def _hand_off_failure(message: str) -> Any:
    """Unpickled in the training process: the error in DataLoader's own carrier of worker exceptions.
    A pin-memory thread (``pin_memory=True``, StreamLoader's default on a CUDA machine) unpickles the
    batch first and passes a carrier on untouched; an exception raised there instead killed that
    thread, and the loop saw only "pin memory thread exited unexpectedly". The loop re-raises it as a
    :class:`HandOffError`, with or without that thread."""
    try:
        raise HandOffError(message)
    except HandOffError:
        return ExceptionWrapper(sys.exc_info(), where="in a DataLoader worker process's hand-off")


def _show(warning: str | None) -> None:
    """A worker's warning, raised in the process that receives its batch (the training process)."""
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=2)


def _forget_exited_workers() -> None:
    """Drop the maps of worker processes that have exited (their batches still in use keep theirs)."""
    for token, worker in list(_received.items()):
        try:
            os.kill(worker.pid, 0)
        except ProcessLookupError:
            del _received[token]
        except PermissionError:  # alive, another user's: not ours to judge
            pass


def _cpu_tensors(batch: dict[Any, Any]) -> dict[Any, torch.Tensor]:
    return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.is_cpu}


def _copy_into(buffer: torch.Tensor, raw: np.ndarray, offset: int, value: torch.Tensor) -> None:
    """``value`` copied into ``buffer`` (``raw``: the same bytes as numpy) at byte ``offset``."""
    dtype = _NUMPY_DTYPES.get(value.dtype)
    if dtype is not None and not value.requires_grad:
        np.copyto(np.ndarray(value.shape, dtype, raw, offset), value.numpy(), casting="no")
    else:  # a dtype numpy lacks (bfloat16, ...), or a tensor autograd tracks
        buffer[offset:offset + value.nbytes].view(value.dtype).view(value.shape).copy_(value)


_NUMPY_DTYPES = {torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
                 torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
                 torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                 torch.float64: np.dtype(np.float64)}


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
