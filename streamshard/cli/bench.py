"""``streamshard bench``: stream one epoch through ParquetStream + StreamLoader and time each worker.

The main process measures what the training loop sees (rows, batches, bytes, wall time); each
worker reports its own stages into ``StreamLoader.stats()``'s shared-memory table
(``loader_stats.WorkerTimes``), which the main process reads once the workers have stopped.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

import torch

from ..io.cpu_usage import tree_cpu_seconds
from ..streams.dataset import ParquetStream
from ..loader.stream_loader import StreamLoader
from ..progress import progress_bar


def run_bench(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Stream one epoch through ParquetStream + StreamLoader, timing each worker's stages.

    Measured in the main process: rows (padding excluded), batches, wall time from the first
    ``iter(loader)`` (worker start-up included), tensor bytes delivered, and CPU seconds of this
    process's threads and its worker processes over the same span (``tree_cpu_seconds``: what data
    loading takes from a node's cores). Measured inside each worker: ``StreamLoader.stats()["workers"]``
    (``loader_stats.WorkerTimes``).
    """
    ds = ParquetStream(
        args.urls, columns=args.columns, batch_size=args.batch_size, storage_options=args.storage_options,
        partitioning=None if args.partitioning == "none" else args.partitioning,
        rank=0, world_size=1, read_ahead=args.read_ahead,
    )
    with progress_bar(err, total=None, unit="footers", desc="catalog", quiet=args.quiet) as footers:
        ds.catalog_progress = footers.update
        ds.set_epoch(0)  # reads the footers once here, so the workers inherit the catalog
    ds.catalog_progress = None
    loader = StreamLoader(ds, num_workers=args.num_workers)
    rows = batches = nbytes = 0
    stopped_early = False
    start, cpu = time.perf_counter(), tree_cpu_seconds()
    batches_in = iter(loader)  # forks the workers before tqdm starts its monitor thread
    with progress_bar(err, total=ds.catalog.num_rows, unit="rows", desc="bench", quiet=args.quiet) as bar:
        for batch in batches_in:
            ids = batch["sample_id"]
            real = int((ids >= 0).sum())
            rows += real
            nbytes += sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))
            batches += 1
            bar.set_postfix_str(f"{nbytes / 1e6 / max(time.perf_counter() - start, 1e-9):.1f} MB/s", refresh=False)
            bar.update(real)
            if args.max_batches is not None and batches >= args.max_batches:
                stopped_early = True
                break
    seconds, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu
    del batches_in  # stop the workers before reading what they wrote
    workers = loader.stats()["workers"]
    storage_bytes = sum(w["read_bytes"] for w in workers)
    return {
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "rows_per_s": rows / seconds if seconds else 0.0,
        "cpu_seconds": cpu,
        "cpu_s_per_mrows": cpu / rows * 1e6 if rows else 0.0,
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
        f"  {r['cpu_seconds']:.2f} CPU-s ({r['cpu_s_per_mrows']:.2f} CPU-s per million rows: this process's threads "
        "and its worker processes, start-up included)",
        "",
        f"{'worker':>6} {'rows':>10} {'batches':>8} {'busy s':>7} {'wait s':>7} {'io s':>7} {'decode s':>9} "
        f"{'prepare s':>9} {'convert s':>9} {'read MB':>8}",
    ]
    for w in r["workers"]:
        lines.append(
            f"{w['worker']:>6} {w['rows']:>10,} {w['batches']:>8} {w['busy_s']:>7.2f} {w['wait_s']:>7.2f} "
            f"{w['io_s']:>7.2f} {w['decode_s']:>9.2f} {w['prepare_s']:>9.2f} {w['convert_s']:>9.2f} "
            f"{w['read_bytes'] / 1e6:>8.1f}"
        )
    lines += [
        "",
        "busy: time the worker spent producing batches; wait: part of it blocked on the read-ahead thread;",
        "io: time in storage reads, decode: rest of RowGroupReader.read (both on the read-ahead thread);",
        "prepare: converting each row group to numpy once (read-ahead threads); convert: gathering",
        "batches of tensors from those (the worker). MB are 10**6 bytes.",
    ]
    return "\n".join(lines) + "\n"
