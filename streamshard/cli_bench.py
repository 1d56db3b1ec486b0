"""``streamshard bench``: stream one epoch through ParquetStream + DataLoader and time each worker.

The main process measures what the training loop sees (rows, batches, bytes, wall time); each
DataLoader worker times its own stages (see ``_WorkerTimes``) into a row of a shared-memory
tensor, which the main process reads once the workers have stopped.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any, TextIO

import torch
from torch.utils.data import DataLoader

from .dataset import ParquetStream
from .reader import RowGroupReader
from .topology import current_worker


def run_bench(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Stream one epoch through ParquetStream + DataLoader, timing each worker's stages.

    Measured in the main process: rows (padding excluded), batches, wall time from the first
    ``iter(loader)`` (worker start-up included) and tensor bytes delivered. Measured inside each
    worker, by ``_TimedStream``: see ``_WorkerTimes``.
    """
    stats = torch.zeros((max(args.num_workers, 1), len(_WorkerTimes.FIELDS)), dtype=torch.float64).share_memory_()
    ds = _TimedStream(
        args.urls, columns=args.columns, batch_size=args.batch_size, storage_options=args.storage_options,
        rank=0, world_size=1, read_ahead=args.read_ahead, stats=stats,
    )
    ds.set_epoch(0)  # reads the footers once here, so the workers inherit the catalog
    loader = DataLoader(ds, batch_size=None, num_workers=args.num_workers)
    progress = _Progress(err, enabled=not args.quiet)
    rows = batches = nbytes = 0
    stopped_early = False
    start = time.perf_counter()
    for batch in loader:
        ids = batch["sample_id"]
        rows += int((ids >= 0).sum())
        nbytes += sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))
        batches += 1
        progress.update(rows, nbytes, time.perf_counter() - start)
        if args.max_batches is not None and batches >= args.max_batches:
            stopped_early = True
            break
    seconds = time.perf_counter() - start
    del loader  # stop the workers before reading what they wrote
    progress.finish(rows, nbytes, seconds)
    workers = [_WorkerTimes.as_dict(i, row) for i, row in enumerate(stats.tolist())]
    storage_bytes = sum(w["read_bytes"] for w in workers)
    return {
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "rows_per_s": rows / seconds if seconds else 0.0,
        "mb_per_s": nbytes / 1e6 / seconds if seconds else 0.0,
        "storage_mb_per_s": storage_bytes / 1e6 / seconds if seconds else 0.0,
        "delivered_bytes": nbytes,
        "storage_bytes": storage_bytes,
        "num_workers": args.num_workers,
        "batch_size": args.batch_size,
        "read_ahead": args.read_ahead,
        "max_batches": args.max_batches,
        "stopped_early": stopped_early,
        "catalog_rows": ds.catalog.num_rows,
        "workers": workers,
    }


def render_bench(r: dict[str, Any], args: argparse.Namespace) -> str:
    """The ``bench`` report ``r`` as text for a terminal (``--json`` prints ``r`` itself)."""
    lines = [
        f"{r['rows']:,} rows in {r['batches']:,} batches, {r['seconds']:.2f} s "
        f"(num_workers={r['num_workers']}, batch_size={r['batch_size']}{', stopped early' if r['stopped_early'] else ''})",
        f"  {r['rows_per_s']:,.0f} rows/s   {r['mb_per_s']:.1f} MB/s delivered (tensor bytes)   "
        f"{r['storage_mb_per_s']:.1f} MB/s read from storage",
        "",
        f"{'worker':>6} {'rows':>10} {'batches':>8} {'busy s':>7} {'wait s':>7} {'io s':>7} {'decode s':>9} "
        f"{'convert s':>9} {'read MB':>8}",
    ]
    for w in r["workers"]:
        lines.append(
            f"{w['worker']:>6} {w['rows']:>10,} {w['batches']:>8} {w['busy_s']:>7.2f} {w['wait_s']:>7.2f} "
            f"{w['io_s']:>7.2f} {w['decode_s']:>9.2f} {w['convert_s']:>9.2f} {w['read_bytes'] / 1e6:>8.1f}"
        )
    lines += [
        "",
        "busy: time the worker spent producing batches; wait: part of it blocked on the read-ahead thread;",
        "io: time in storage reads, decode: rest of RowGroupReader.read (both on the read-ahead thread);",
        "convert: Arrow -> torch. MB are 10**6 bytes.",
    ]
    return "\n".join(lines) + "\n"


class _WorkerTimes:
    """One DataLoader worker's stage times, kept in a row of a shared-memory tensor.

    busy_s     time inside the worker's ``next()``: producing batches, not idling on the DataLoader
    wait_s     part of busy_s spent blocked on the read-ahead thread for the next Arrow table
    read_s     wall time of ``RowGroupReader.read`` calls (read-ahead threads): fetch + Parquet decode
    io_s       part of read_s spent fetching byte ranges from storage (``RowGroupReader.stats``)
    decode_s   read_s - io_s: decompression and decoding to Arrow (reported, not stored)
    convert_s  Arrow -> torch (``BatchConverter``), on the worker's main thread
    read_bytes bytes the reader fetched from storage (``RowGroupReader.stats``)
    With several read-ahead threads, read_s and io_s are sums over threads and can exceed busy_s.
    """

    FIELDS = ("rows", "batches", "busy_s", "wait_s", "read_s", "io_s", "convert_s", "read_bytes")

    def __init__(self, stats: Any, worker: int) -> None:
        self.row = stats[worker]
        self.values = dict.fromkeys(self.FIELDS, 0.0)
        self.readers: list[RowGroupReader] = []
        self.lock = threading.Lock()

    def add(self, field: str, amount: float) -> None:
        with self.lock:
            self.values[field] += amount

    def instrument(self, reader: RowGroupReader) -> None:
        """Collect this reader's own timings and byte counts (``RowGroupReader.stats``)."""
        self.readers.append(reader)

    def flush(self) -> None:
        totals = {name: sum(getattr(r.stats, name) for r in self.readers)
                  for name in ("bytes_fetched", "read_seconds", "fetch_seconds")}
        with self.lock:
            self.values["read_bytes"] = float(totals["bytes_fetched"])
            self.values["read_s"] = totals["read_seconds"]
            self.values["io_s"] = totals["fetch_seconds"]
            self.row.copy_(torch.tensor([self.values[f] for f in self.FIELDS], dtype=torch.float64))

    @classmethod
    def as_dict(cls, worker: int, row: list[float]) -> dict[str, Any]:
        d: dict[str, Any] = dict(zip(cls.FIELDS, row))
        for key in ("rows", "batches", "read_bytes"):
            d[key] = int(d[key])
        d["decode_s"] = max(d["read_s"] - d["io_s"], 0.0)
        return {"worker": worker, **d}


class _TimedStream(ParquetStream):
    """ParquetStream with stage timers; what it yields is exactly what ParquetStream yields."""

    def __init__(self, *args: Any, stats: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = stats
        self._times: _WorkerTimes | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_times": None}

    def __iter__(self) -> Any:
        times = self._times = _WorkerTimes(self.stats, current_worker()[0])
        batches = super().__iter__()
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                times.add("busy_s", time.perf_counter() - start)
                times.flush()
                return
            times.add("busy_s", time.perf_counter() - start)
            ids = batch["sample_id"]
            times.add("rows", int((ids >= 0).sum()))
            times.add("batches", 1)
            times.flush()
            yield batch

    @property
    def converter(self) -> Any:
        convert = super().converter
        if self._times is None:  # main process (set_epoch): nothing to time
            return convert
        return _TimedConverter(convert, self._times)

    def iter_piece_tables(self, plan: Any, pieces: Any, reader: Any = None) -> Any:
        tables = super().iter_piece_tables(plan, pieces, reader)
        times = self._times
        try:
            while True:
                start = time.perf_counter()
                try:
                    table = next(tables)
                except StopIteration:
                    return
                finally:
                    if times is not None:
                        times.add("wait_s", time.perf_counter() - start)
                yield table
        finally:
            tables.close()

    def _reader(self) -> RowGroupReader:
        reader = super()._reader()
        if self._times is not None:
            self._times.instrument(reader)
        return reader


class _TimedConverter:
    """A ``BatchConverter`` whose calls add to ``convert_s``; every other attribute is the converter's own."""

    def __init__(self, convert: Any, times: _WorkerTimes) -> None:
        self._convert, self._times = convert, times

    def __call__(self, table: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._convert(table)
        finally:
            self._times.add("convert_s", time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:  # ragged_keys, keys, schema: whatever ParquetStream asks for
        return getattr(self._convert, name)


class _Progress:
    """One status line on stderr, redrawn with a carriage return at most 4 times a second."""

    def __init__(self, err: TextIO, enabled: bool = True) -> None:
        self.err, self.enabled, self.last = err, enabled, -1.0

    def update(self, rows: int, nbytes: int, seconds: float) -> None:
        if self.enabled and seconds - self.last >= 0.25:
            self.last = seconds
            self._write(rows, nbytes, seconds, end="")

    def finish(self, rows: int, nbytes: int, seconds: float) -> None:
        if self.enabled:
            self._write(rows, nbytes, seconds, end="\n")

    def _write(self, rows: int, nbytes: int, seconds: float, end: str) -> None:
        rate = rows / seconds if seconds else 0.0
        mbs = nbytes / 1e6 / seconds if seconds else 0.0
        self.err.write(f"\r{rows:>12,} rows  {rate:>10,.0f} rows/s  {mbs:>8.1f} MB/s  {seconds:>6.1f} s{end}")
        self.err.flush()
