"""What ``StreamLoader.stats()`` reports: where the time of the data path went, cheap enough to leave on.

Two halves, each counted where it happens, once per batch (no per-row work):

* ``WorkerTimes``: each worker's stages (busy, read/io/decode, convert, bytes read), written by the
  worker itself, thread or process, into its own row of a shared-memory table after every batch it
  makes (a stream calls it with its cumulative ``DeliveryStats``; the table adds what changed, so
  the rows sum over passes). ``streamshard bench`` reads the same table.
* ``LoopStats``: what the training loop saw, counted in its own thread: seconds it waited inside
  ``next()``, batches and rows handed out, and stalls (waits above a threshold), with the steps
  they happened at.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterator

import numpy as np
import torch

from ..streams.delivery import DeliveryStats

MAX_STALLS_KEPT = 16  # the most recent stalls listed with their step (the count covers all)


class WorkerTimes:
    """Each worker's stage times, one row of a shared-memory float64 table per worker.

    Installed on a stream (``stats_hook`` or ``StreamLoader``'s own): the stream calls it inside the
    worker after every batch with its cumulative ``DeliveryStats`` of the pass.

    rows       rows the worker put into batches (padding excluded), read ahead of the loop included
    batches    batches it made
    busy_s     time inside the worker's ``next()``: producing batches, not idling on the loader
    wait_s     part of busy_s spent blocked on row-group reads (read-ahead threads)
    read_s     wall time of ``RowGroupReader.read`` calls (read-ahead threads): fetch + Parquet decode
    io_s       part of read_s spent fetching byte ranges from storage
    decode_s   read_s - io_s: decompression and decoding to Arrow (reported, not stored)
    prepare_s  converting each row group to numpy once, for gathering (read-ahead threads)
    convert_s  gathering batches of tensors from the converted row groups, on the worker's thread
    read_bytes bytes the reader fetched from storage
    With several read-ahead threads, read_s, io_s and prepare_s are sums over threads and can exceed busy_s.
    """

    FIELDS = ("rows", "batches", "busy_s", "wait_s", "read_s", "io_s", "prepare_s", "convert_s", "read_bytes")

    def __init__(self, num_workers: int) -> None:
        self.table = torch.zeros((max(num_workers, 1), len(self.FIELDS)), dtype=torch.float64).share_memory_()
        self._values = self.table.numpy()  # written per batch: numpy indexing, no torch dispatch
        self._base: dict[int, tuple[DeliveryStats, list[float]]] = {}  # a worker's row when its pass began

    def __getstate__(self) -> dict[str, Any]:
        return {"table": self.table}  # shared memory travels to worker processes; the rest is per process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.table = state["table"]
        self._values = self.table.numpy()
        self._base = {}

    def __call__(self, stats: DeliveryStats) -> None:
        worker = stats.worker % len(self._values)
        row = self._values[worker]
        base = self._base.get(worker)
        if base is None or base[0] is not stats:  # a new pass: its counts start from 0, on top of the row
            base = self._base[worker] = (stats, row.tolist())
        b, reads = base[1], stats.reads
        row[:] = (b[0] + stats.rows, b[1] + stats.batches, b[2] + stats.busy_s, b[3] + stats.wait_s,
                  b[4] + reads.read_seconds, b[5] + reads.fetch_seconds, b[6] + stats.prepare_s, b[7] + stats.convert_s,
                  b[8] + reads.bytes_fetched)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per worker (``as_dict``)."""
        return [self.as_dict(i, row) for i, row in enumerate(self.table.tolist())]

    @classmethod
    def as_dict(cls, worker: int, row: list[float]) -> dict[str, Any]:
        d: dict[str, Any] = dict(zip(cls.FIELDS, row))
        for key in ("rows", "batches", "read_bytes"):
            d[key] = int(d[key])
        d["decode_s"] = max(d["read_s"] - d["io_s"], 0.0)
        return {"worker": worker, **d}


def sum_reads(readers: Any, into: Any) -> None:
    """Set ``into`` (a ``ReadStats``) to the sum of several readers' times and bytes: a stream that reads
    several corpora reports one worker's reads (``WorkerTimes`` uses these three)."""
    into.read_seconds = sum(r.stats.read_seconds for r in readers)
    into.fetch_seconds = sum(r.stats.fetch_seconds for r in readers)
    into.bytes_fetched = sum(r.stats.bytes_fetched for r in readers)


class LoopStats:
    """What the training loop saw: waits in ``next()``, batches and rows handed out, stalls."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.wait_s = 0.0
        self.batches = 0
        self.rows = 0
        self._device_rows: torch.Tensor | None = None  # rows of batches on a device, summed there (no sync per batch)
        self.stalls = 0
        self.stall_wait_s = 0.0
        self.recent: deque[dict[str, Any]] = deque(maxlen=MAX_STALLS_KEPT)
        self.max_wait_s = 0.0

    def timed(self, batches: Iterator[Any], where: Any) -> Iterator[Any]:
        """``batches``, timing each ``next()``; ``where()`` gives ``(epoch, step)`` of a stalled batch."""
        try:
            while True:
                began = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                waited = time.perf_counter() - began
                self.wait_s += waited
                self.batches += 1
                if waited > self.max_wait_s:
                    self.max_wait_s = waited
                if waited > self.stall_s:
                    self.stalls += 1
                    self.stall_wait_s += waited
                    epoch, step = where()
                    self.recent.append({"epoch": epoch, "step": step, "wait_s": waited})
                self._count_rows(batch)
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if callable(close):
                close()

    def _count_rows(self, batch: Any) -> None:
        ids = batch.get("sample_id") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor):
            return
        if ids.is_cpu:
            values = ids.numpy()
            # Padding rows (-1) come after a batch's rows: a batch whose last id is real has none.
            self.rows += values.size if values.ndim == 1 and values.size and values[-1] >= 0 else \
                int(np.count_nonzero(values >= 0))
            return
        real = (ids >= 0).sum()  # stays on the device: read when stats() is asked for
        self._device_rows = real if self._device_rows is None else self._device_rows + real

    def as_dict(self) -> dict[str, Any]:
        rows = self.rows + (int(self._device_rows.item()) if self._device_rows is not None else 0)
        return {"wait_s": self.wait_s, "batches": self.batches, "rows": rows, "max_wait_s": self.max_wait_s,
                "stalls": self.stalls, "stall_wait_s": self.stall_wait_s, "stall_threshold_s": self.stall_s,
                "recent_stalls": list(self.recent)}
