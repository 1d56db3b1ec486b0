"""Read throughput of ParquetStream against the raw pyarrow decode ceiling of this machine.

One run measures, over the same cached corpus (16 files, uneven row groups, ``id`` int64,
``input_ids`` list<int32> of 128..1024 random tokens, ``score`` float32):

* raw pyarrow ``ParquetFile.iter_batches`` in 1 process and in 2 processes (half the rows
  each), three ways: decode only; decode + ``to_numpy`` of the columns (flattened token
  values, zero copy); decode + the same padded ``[rows, max_len]`` output ParquetStream yields;
* ``ParquetStream(batch_size=None)`` through ``DataLoader(batch_size=None, num_workers=2)`` on
  local disk and through moto's S3 server on 127.0.0.1, ``batch_size=1024`` and 1 worker on
  local disk, and ``num_workers=0`` on local disk (no IPC) to separate the DataLoader hand-off.

Configurations run interleaved, round after round, and the table shows the median of the
timed rounds (DataLoaders use persistent workers; their first epoch, which forks the workers,
is reported apart). A stream epoch's loop copies each batch's ids and token counts out; after the
clock stops, the ids must be every row exactly once. A stage breakdown (one process, no
read-ahead) times reading and the whole-batch conversion (what streams use for lists of lists;
other schemas gather from row groups converted once, ``gather.py``), next to cheaper ways to build
the same padded tensor.

Every configuration reports rows/s, its ratio to raw decoding into *unpadded* tensors in as many
processes as it has workers (the ceiling: padding is work the loader does), its ratio to the
padded raw baseline, and CPU-seconds per million rows (every thread and process doing the work:
the loader's process and its worker processes, or the raw processes).

    .venv/bin/python benchmarks/throughput.py [--quick] [--repeats 3]
    .venv/bin/python benchmarks/throughput.py --corpus short --set ceiling --repeats 3   # issue 25

Writes ``benchmarks/out/throughput.json`` (``throughput-<corpus>[-<set>].json`` otherwise); the
corpus is cached under ``benchmarks/out/corpus/`` (rewritten when its manifest differs).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamshard.convert import tensors as ss_tensors  # noqa: E402
from streamshard.io.cpu_usage import tree_cpu_seconds  # noqa: E402
from streamshard.streams.dataset import ParquetStream  # noqa: E402
from streamshard.loader.stream_loader import StreamLoader  # noqa: E402
from streamshard.streams.delivery import spec_table  # noqa: E402
from streamshard.io.reader import RowGroupReader  # noqa: E402
from streamshard.testing import write_corpus  # noqa: E402

from json_workers import JsonWorkers, serve_json  # noqa: E402  (benchmarks/, this script's directory)

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "throughput.json"
CORPUS_ROOT = HERE / "out" / "corpus"
COLUMNS = ["id", "input_ids", "score"]
VOCAB = 50_000
MIN_TOKENS, MAX_TOKENS = 128, 1024
RAW_BATCH_ROWS = 8192
RAW_MODES = ("decode", "numpy", "unpadded", "padded")
CORPUS_VERSION = 2


# -- corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusSpec:
    """Shape of the synthetic corpus: row-group sizes vary ~10x across files and row groups, or
    (``groups`` given) every file has ``groups`` row groups of ``base_rows`` rows."""

    name: str
    files: int
    base_rows: int  # smallest possible row group
    seed: int = 7
    min_tokens: int = MIN_TOKENS
    max_tokens: int = MAX_TOKENS
    groups: int | None = None

    def layout(self) -> list[list[int]]:
        """Row counts per row group per file (file scale x row-group scale, each 1..~3.2x)."""
        if self.groups is not None:
            return [[self.base_rows] * self.groups for _ in range(self.files)]
        rng = np.random.default_rng(self.seed)
        out = []
        for _ in range(self.files):
            file_scale = 10 ** rng.uniform(0, 0.5)
            groups = int(rng.integers(3, 9))
            out.append([int(self.base_rows * file_scale * 10 ** rng.uniform(0, 0.5)) for _ in range(groups)])
        return out


SPECS = {
    "full": CorpusSpec("full", 16, 620),
    "quick": CorpusSpec("quick", 16, 45),
    # Issue 25's corpus: 16 files x 8 row groups x 4,096 rows = 524,288 rows of 8..40 tokens (24 on
    # average): short rows make the loader's per-batch and per-row cost visible next to decoding.
    "short": CorpusSpec("short", 16, 4096, min_tokens=8, max_tokens=40, groups=8),
}


def ensure_corpus(spec: CorpusSpec) -> Path:
    """The corpus directory, written unless a manifest says it matches ``spec`` already."""
    directory, manifest = CORPUS_ROOT / spec.name, CORPUS_ROOT / f"{spec.name}.json"
    wanted = {"version": CORPUS_VERSION, "layout": spec.layout(), "seed": spec.seed,
              "tokens": [spec.min_tokens, spec.max_tokens]}
    if manifest.exists() and directory.is_dir():
        have = json.loads(manifest.read_text())
        files = sorted(directory.glob("*.parquet"))
        if {k: have.get(k) for k in wanted} == wanted and len(files) == spec.files:
            return directory
    print(f"writing corpus {directory} ...", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*"):
        stale.unlink()
    write_corpus(str(directory), wanted["layout"], spec.min_tokens, spec.max_tokens, seed=spec.seed, tokens="random",
                 vocab=VOCAB)
    manifest.write_text(json.dumps(wanted))
    return directory


@dataclass(frozen=True)
class CorpusStats:
    files: list[str]
    file_bytes: list[int]
    file_rows: list[int]
    rows: int
    tokens: int
    row_groups: int
    rg_rows_min: int
    rg_rows_max: int

    @property
    def bytes(self) -> int:
        return sum(self.file_bytes)


def corpus_stats(directory: Path) -> CorpusStats:
    files = [str(p) for p in sorted(directory.glob("*.parquet"))]
    rg_rows, file_rows, tokens = [], [], 0
    for path in files:
        meta = pq.ParquetFile(path).metadata
        file_rows.append(meta.num_rows)
        rg_rows.extend(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    for path in files:  # exact token count: sum of list lengths
        offsets = pq.read_table(path, columns=["input_ids"]).column(0).combine_chunks().offsets
        tokens += int(offsets[-1].as_py() - offsets[0].as_py())
    return CorpusStats(
        files, [os.path.getsize(p) for p in files], file_rows, sum(file_rows), tokens,
        len(rg_rows), min(rg_rows), max(rg_rows),
    )


def split_by_rows(stats: CorpusStats, parts: int) -> list[list[str]]:
    """Whole files dealt to ``parts`` processes, largest first to the lightest (balanced by rows)."""
    groups: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for rows, path in sorted(zip(stats.file_rows, stats.files), reverse=True):
        i = load.index(min(load))
        groups[i].append(path)
        load[i] += rows
    return groups


# -- raw pyarrow ----------------------------------------------------------------------------


def pad_rowwise(offsets: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A zero-padded ``[rows, max_len]`` copy of a list column, one slice copy per row."""
    lengths = np.diff(offsets)
    padded = np.zeros((len(lengths), int(lengths.max()) if len(lengths) else 0), dtype=values.dtype)
    base = int(offsets[0])
    for row, (a, b) in enumerate(zip((offsets[:-1] - base).tolist(), (offsets[1:] - base).tolist())):
        padded[row, : b - a] = values[a:b]
    return padded, lengths


def pad_mask(offsets: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same padded copy through a boolean mask (no int64 index arrays)."""
    lengths = np.diff(offsets)
    width = int(lengths.max()) if len(lengths) else 0
    padded = np.zeros((len(lengths), width), dtype=values.dtype)
    padded[np.arange(width) < lengths[:, None]] = values  # values start at offsets[0] (flatten)
    return padded, lengths


def pad_rowwise_shared(offsets: np.ndarray, values: np.ndarray) -> torch.Tensor:
    """The per-row padded copy written straight into a shared-memory tensor (no second copy)."""
    lengths = np.diff(offsets)
    out = torch.empty((len(lengths), int(lengths.max()) if len(lengths) else 0), dtype=torch.int32).share_memory_()
    padded = out.numpy()
    base = int(offsets[0])
    for row, (a, b) in enumerate(zip((offsets[:-1] - base).tolist(), (offsets[1:] - base).tolist())):
        padded[row, : b - a] = values[a:b]
        padded[row, b - a :] = 0
    return out


def _list_parts(array: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    offsets = array.offsets.to_numpy()
    return offsets, array.flatten().to_numpy()


def raw_pass(paths: list[str], mode: str) -> dict[str, float]:
    """Read ``paths`` with iter_batches; ``mode`` is "decode", "numpy", "unpadded" or "padded".

    "unpadded" builds the tensors a loader with ``lists="flat"`` hands over (each column copied
    into memory the tensor owns: token values end to end, per-row token counts, ids, scores): the
    ceiling issue 25 measures against. "padded" builds ``[rows, max_len]`` tokens instead."""
    mode, _, batch_rows = mode.partition("@")  # "unpadded@256": batches of the loader's size
    rows = tokens = 0
    start, cpu = time.perf_counter(), time.process_time()
    for path in paths:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=int(batch_rows or RAW_BATCH_ROWS), columns=COLUMNS):
            tokens_array = batch.column(1)
            rows += batch.num_rows
            if mode == "decode":
                offsets = tokens_array.offsets
                tokens += offsets[-1].as_py() - offsets[0].as_py()
                continue
            offsets, values = _list_parts(tokens_array)
            ids, scores = batch.column(0).to_numpy(), batch.column(2).to_numpy()
            if mode == "padded":
                padded, lengths = pad_rowwise(offsets, values)
                # The tensors a loader would hand over (then dropped, as the other modes drop theirs).
                torch.from_numpy(padded), torch.from_numpy(lengths), torch.from_numpy(ids.copy()), torch.from_numpy(scores.copy())
            elif mode == "unpadded":
                torch.from_numpy(values.copy()), torch.from_numpy(np.diff(offsets)), torch.from_numpy(ids.copy()), torch.from_numpy(scores.copy())
            tokens += int(offsets[-1] - offsets[0])
    return {"rows": rows, "tokens": tokens, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}


def _raw_worker(conn: Any) -> None:
    """Serve ``{"paths", "mode"}`` tasks until an empty message; messages are JSON, not pickles."""
    serve_json(conn, lambda task: raw_pass(task["paths"], task["mode"]))


class RawPool(JsonWorkers):
    """Persistent spawned processes (warm imports), one task each per measurement."""

    def __init__(self, processes: int) -> None:
        super().__init__(_raw_worker, processes)

    def run(self, groups: list[list[str]], mode: str) -> dict[str, float]:
        start = time.perf_counter()
        parts = self.ask([{"paths": paths, "mode": mode} for paths in groups])
        seconds = time.perf_counter() - start
        return {"rows": sum(p["rows"] for p in parts), "tokens": sum(p["tokens"] for p in parts), "seconds": seconds,
                "cpu_seconds": sum(p["cpu_seconds"] for p in parts)}


# -- ParquetStream --------------------------------------------------------------------------


def stream_pass(loader: Any, total_rows: int) -> dict[str, float]:
    """One epoch through ``loader``, timed; then a check that every row arrived exactly once.

    The loop only copies each batch's ids and lengths out (a training loop touches its batch, and
    the copies free shared-memory slots as a real step would); the check runs after the clock
    stops: the real ids of the epoch must be exactly 0..total_rows-1, each once. CPU: this process
    (every thread) and its worker processes (``tree_cpu_seconds``), and the main process alone."""
    ids, lengths = [], []
    start, cpu, tree = time.perf_counter(), time.process_time(), tree_cpu_seconds()
    for batch in loader:
        ids.append(batch["sample_id"].numpy().copy())
        lengths.append(batch["input_ids_lengths"].numpy().copy())
    seconds, cpu, tree = time.perf_counter() - start, time.process_time() - cpu, tree_cpu_seconds() - tree
    every = np.concatenate(ids)
    real = every >= 0
    if not np.array_equal(np.sort(every[real]), np.arange(total_rows)):
        raise RuntimeError(f"epoch delivered {int(real.sum())} rows; expected each of {total_rows} once")
    tokens = int(np.concatenate(lengths)[real].sum())
    return {"rows": total_rows, "tokens": tokens, "seconds": seconds, "main_cpu_seconds": cpu, "cpu_seconds": tree}


def make_loader(
    paths: str, batch_size: int | None, num_workers: int, options: dict[str, Any] | None, loader: str = "dataloader",
    workers: str = "auto", **kwargs: Any,
) -> Any:
    ds = ParquetStream(paths, columns=COLUMNS, batch_size=batch_size, storage_options=options, **kwargs)
    ds.set_epoch(0)  # footers read here, once, in the main process
    if loader == "stream":  # every pass is the next epoch: another order, the same work
        return StreamLoader(ds, num_workers=num_workers, persistent_workers=num_workers > 0, workers=workers)
    if num_workers == 0:
        return ds
    return DataLoader(ds, batch_size=None, num_workers=num_workers, persistent_workers=True)


# -- measurement rounds ---------------------------------------------------------------------


@dataclass
class Config:
    name: str
    run: Callable[[], dict[str, float]]


def run_rounds(configs: list[Config], repeats: int) -> dict[str, dict[str, Any]]:
    """Every config once per round (round 0 is warm-up), interleaved; keeps all samples."""
    samples: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    for r in range(repeats + 1):
        for config in configs:
            result = config.run()
            samples[config.name].append(result)
            tag = "warm-up" if r == 0 else f"round {r}"
            print(f"  {tag:8s} {config.name:44s} {result['seconds']:7.2f} s", flush=True)
    return {name: {"warmup": runs[0], "timed": runs[1:]} for name, runs in samples.items()}


def summarise(samples: dict[str, Any], stats: CorpusStats) -> dict[str, dict[str, float]]:
    out = {}
    for name, runs in samples.items():
        seconds = statistics.median(r["seconds"] for r in runs["timed"])
        rows, tokens = runs["timed"][0]["rows"], runs["timed"][0]["tokens"]
        out[name] = {
            "seconds": seconds,
            "seconds_all": [r["seconds"] for r in runs["timed"]],
            "first_epoch_seconds": runs["warmup"]["seconds"],
            "rows_per_s": rows / seconds,
            "best_rows_per_s": rows / min(r["seconds"] for r in runs["timed"]),  # steadier on a shared machine
            "tokens_per_s": tokens / seconds,
            "parquet_mb_per_s": stats.bytes / 1e6 / seconds,
            # CPU of every process and thread doing the work, per million rows (median over rounds)
            "cpu_s_per_mrows": statistics.median(r["cpu_seconds"] for r in runs["timed"]) / rows * 1e6,
        }
        if "main_cpu_seconds" in runs["timed"][0]:  # CPU the consuming (main) process spent per epoch
            out[name]["main_cpu_seconds"] = statistics.median(r["main_cpu_seconds"] for r in runs["timed"])
    return out


# -- where the time goes --------------------------------------------------------------------


def _timed(fn: Callable[[], Any], into: dict[str, float], key: str) -> Any:
    start = time.perf_counter()
    value = fn()
    into[key] = into.get(key, 0.0) + time.perf_counter() - start
    return value


def stage_breakdown(directory: Path) -> dict[str, float]:
    """Seconds per stage for one pass over the corpus in this process (no read-ahead, no IPC).

    Reads the stream's own schedule (``ds.schedule()``, ``delivery.spec_table``) with a timing reader, then
    its converter, then the copy into shared memory that a DataLoader worker does per tensor;
    the convert stage is split further, and cheaper ways to pad the token column run on the
    same arrays for comparison.
    """
    ds = ParquetStream(str(directory), columns=COLUMNS, batch_size=None, read_ahead=0)
    catalog, converter = ds.catalog, ds.converter
    t: dict[str, float] = {}
    reader = _TimedReader(RowGroupReader.from_catalog(catalog), t, catalog.urls)
    decoded: dict[int, pa.Table] = {}
    try:
        for spec in ds.schedule().batches():  # the exact batches the stream delivers, read the same way
            if not spec.rows:
                continue
            start = time.perf_counter()
            for key, what in spec.reads.items():
                if key not in decoded:
                    decoded[key] = reader.read(int(catalog.rg_file[what.rg]), int(catalog.rg_index[what.rg]))
            table = spec_table(spec, decoded).append_column("sample_id", pa.array(spec.sample_id))
            for key in spec.done:
                decoded.pop(key, None)
            t[_PIECE] = t.get(_PIECE, 0.0) + time.perf_counter() - start
            batch = _timed(lambda: converter(table.drop_columns(["sample_id"])), t, "3 convert to tensors, whole batch (BatchConverter)")
            _convert_parts(table, t)
            _timed(lambda: [v.share_memory_() for v in batch.values()], t, "4 copy into shared memory (worker side of IPC)")
    finally:
        reader.close()
    t["2 slice + sample_id column"] = t.pop(_PIECE) - t[_READ] - t[_NATIVE_READ]
    return t


_PIECE = "piece total"
_READ = "1 read row group (RowGroupReader)"
_NATIVE_READ = "1' same read, pyarrow native file (comparison)"


class _TimedReader:
    """Wraps a RowGroupReader, adding the time of each read (and of a native-file read) to ``into``."""

    def __init__(self, reader: Any, into: dict[str, float], urls: Any) -> None:
        self.reader, self.into, self.urls = reader, into, urls

    def read(self, file_index: int, row_group: int) -> pa.Table:
        url = self.urls[file_index]
        _timed(lambda: _native_file(url).read_row_group(row_group, columns=COLUMNS), self.into, _NATIVE_READ)
        return _timed(lambda: self.reader.read(file_index, row_group), self.into, _READ)

    def close(self) -> None:
        self.reader.close()


_NATIVE: dict[str, pq.ParquetFile] = {}


def _native_file(url: str) -> pq.ParquetFile:
    if url not in _NATIVE:
        _NATIVE.clear()
        _NATIVE[url] = pq.ParquetFile(url.removeprefix("file://"))
    return _NATIVE[url]


def _convert_parts(table: pa.Table, t: dict[str, float]) -> None:
    batch = _timed(lambda: table.drop_columns(["sample_id"]).combine_chunks().to_batches()[0], t, "3a combine_chunks")
    tokens = batch.column(1)
    one_column = ss_tensors.BatchConverter(pa.schema([pa.field("input_ids", tokens.type)]))
    _timed(lambda: one_column(pa.table({"input_ids": tokens})), t, "3b pad input_ids: whole-batch BatchConverter")
    offsets, values = _list_parts(tokens)
    _timed(lambda: pad_mask(offsets, values), t, "alt pad input_ids: boolean mask")
    _timed(lambda: pad_rowwise(offsets, values), t, "alt pad input_ids: per-row slice copy")
    _timed(lambda: torch.from_numpy(values.copy()), t, "alt flat input_ids + offsets (no padding)")
    _timed(lambda: pad_rowwise_shared(offsets, values), t, "alt per-row pad written into shared memory (3b+4 for input_ids)")
    _timed(lambda: torch.from_numpy(values.copy()).share_memory_(), t, "alt flat input_ids copied into shared memory")


def profile_worker(directory: Path, files: int = 4) -> list[dict[str, Any]]:
    """cProfile of ParquetStream iterated in this process over the first ``files`` files."""
    paths = sorted(str(p) for p in directory.glob("*.parquet"))[:files]
    ds = ParquetStream(paths, columns=COLUMNS, batch_size=None, read_ahead=0)
    ds.set_epoch(0)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in ds:
        pass
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(filename).name}:{line}({func})", "calls": calls, "tottime": tottime, "cumtime": cumtime})
    return sorted(rows, key=lambda r: -r["tottime"])[:15]


class _Replay(IterableDataset):
    """Yields fresh copies of a fixed batch: measures the DataLoader hand-off of tensors alone."""

    def __init__(self, template: dict[str, torch.Tensor], count: int) -> None:
        super().__init__()
        self.template, self.count = template, count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        share = self.count // (info.num_workers if info else 1)
        for _ in range(share):
            yield {k: v.clone() for k, v in self.template.items()}


def ipc_cost(directory: Path, repeats: int) -> dict[str, float]:
    """GB/s of cloning a real batch in-process vs through DataLoader(num_workers=2)."""
    ds = ParquetStream(str(directory), columns=COLUMNS, batch_size=None, read_ahead=0)
    template = next(iter(ds))
    nbytes = sum(v.numel() * v.element_size() for v in template.values())
    count = max(8, 2 * round(2e8 / nbytes))  # ~400 MB per pass
    replay = _Replay(template, count)
    loader = DataLoader(replay, batch_size=None, num_workers=2, persistent_workers=True)

    def clone_only() -> float:
        start = time.perf_counter()
        for _ in replay:
            pass
        return time.perf_counter() - start

    def through_loader() -> float:
        start = time.perf_counter()
        for batch in loader:
            int(batch["sample_id"][0])
        return time.perf_counter() - start

    through_loader()  # start the workers
    clone, loaded = [], []
    for _ in range(repeats):
        clone.append(clone_only())
        loaded.append(through_loader())
    gb = nbytes * count / 1e9
    return {
        "batch_mb": nbytes / 1e6,
        "batches": count,
        "clone_in_process_gb_per_s": gb / statistics.median(clone),
        "clone_plus_dataloader_2_workers_gb_per_s": gb / statistics.median(loaded),
    }


# -- report ---------------------------------------------------------------------------------


def print_table(results: dict[str, dict[str, float]], ceiling: str, padded_ceiling: str) -> list[str]:
    """The table: ratios are to ``ceiling`` (raw decoding into unpadded tensors, as many processes
    as workers) and ``padded_ceiling`` (the same into padded tensors), both from the same run."""
    head = (
        "| configuration | rows/s | x raw 2-proc unpadded | x raw 2-proc padded | CPU-s per M rows | best round: rows/s "
        "| best: x raw unpadded | Mtokens/s | median s (all) | first epoch s | main-process CPU s |"
    )
    lines = [head, "|---|" + "---:|" * 10]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['rows_per_s']:,.0f} | {r['rows_per_s'] / results[ceiling]['rows_per_s']:.2f} | "
            f"{r['rows_per_s'] / results[padded_ceiling]['rows_per_s']:.2f} | {r['cpu_s_per_mrows']:.2f} | "
            f"{r['best_rows_per_s']:,.0f} | {r['best_rows_per_s'] / results[ceiling]['best_rows_per_s']:.2f} | "
            f"{r['tokens_per_s'] / 1e6:.1f} | {r['seconds']:.2f} ({', '.join(f'{x:.2f}' for x in r['seconds_all'])}) | "
            f"{r['first_epoch_seconds']:.2f} | {_cpu(r)} |"
        )
    print("\n".join(lines))
    return lines


def ceiling_streams(directory: str) -> list[tuple[str, str, int | None, int, dict[str, Any] | None, dict[str, Any]]]:
    """Issue 25's table: StreamLoader with 2 workers, from the cheapest output to what training uses."""
    stream = {"loader": "stream"}
    return [
        ("StreamLoader, bs=None, lists=flat", directory, None, 2, None, {**stream, "lists": "flat"}),
        ("StreamLoader, bs=256, lists=flat", directory, 256, 2, None, {**stream, "lists": "flat"}),
        ("StreamLoader, bs=None (padded)", directory, None, 2, None, stream),
        ("StreamLoader, defaults (bs=256, padded, threads)", directory, 256, 2, None, stream),
        ("StreamLoader, shuffle=True, lists=flat", directory, 256, 2, None, {**stream, "shuffle": True, "lists": "flat"}),
        ("StreamLoader, shuffle=True", directory, 256, 2, None, {**stream, "shuffle": True}),
        ("StreamLoader, defaults, worker processes", directory, 256, 2, None, {**stream, "workers": "processes"}),
        ("StreamLoader, shuffle=True, worker processes", directory, 256, 2, None,
         {**stream, "shuffle": True, "workers": "processes"}),
    ]


def measure(directory: Path, stats: CorpusStats, spec: CorpusSpec, repeats: int, with_s3: bool,
            config_set: str = "all") -> dict[str, Any]:
    """Run every configuration ``repeats`` times (plus a warm-up round), interleaved."""
    streams: list[tuple[str, str, int | None, int, dict[str, Any] | None, dict[str, Any]]] = [
        ("ParquetStream local, bs=None, 2 workers", str(directory), None, 2, None, {}),
        ("ParquetStream local, defaults (bs=256), 2 workers", str(directory), 256, 2, None, {}),
        ("StreamLoader local, defaults (bs=256), 2 workers", str(directory), 256, 2, None, {"loader": "stream"}),
        ("StreamLoader local, bs=256, 2 worker processes", str(directory), 256, 2, None,
         {"loader": "stream", "workers": "processes"}),
        ("StreamLoader local, defaults + shuffle=True, 2 workers", str(directory), 256, 2, None,
         {"loader": "stream", "shuffle": True}),
        ("ParquetStream local, bs=None, 1 worker", str(directory), None, 1, None, {}),
        ("ParquetStream local, bs=1024, 2 workers", str(directory), 1024, 2, None, {}),
        ("ParquetStream local, bs=None, 2 workers, lists=flat", str(directory), None, 2, None, {"lists": "flat"}),
        ("ParquetStream local, bs=None, 0 workers (no IPC)", str(directory), None, 0, None, {}),
        ("ParquetStream local, bs=None, 0 workers, read_ahead=4", str(directory), None, 0, None, {"read_ahead": 4}),
    ]
    one_proc, two_proc = RAW_MODES, RAW_MODES
    if config_set == "ceiling":
        streams, one_proc, two_proc = ceiling_streams(str(directory)), (), ("unpadded", "padded", "unpadded@256")
        with_s3 = False
    with contextlib.ExitStack() as stack:
        pool = RawPool(2)
        stack.callback(pool.close)
        halves = split_by_rows(stats, 2)
        configs = [Config(f"raw pyarrow 1 proc: {m}", (lambda m=m: raw_pass(stats.files, m))) for m in one_proc]
        configs += [Config(f"raw pyarrow 2 proc: {m}", (lambda m=m: pool.run(halves, m))) for m in two_proc]
        if with_s3:
            from streamshard.testing import local_s3

            s3 = stack.enter_context(local_s3())
            upload = time.perf_counter()
            url = s3.upload(str(directory), "bench", spec.name)
            print(f"uploaded to {url} in {time.perf_counter() - upload:.1f} s", flush=True)
            streams.append(("ParquetStream S3 (moto), bs=None, 2 workers", url, None, 2, s3.storage_options, {}))
            streams.append(("ParquetStream S3 (moto), bs=None, 0 workers, read_ahead=4", url, None, 0, s3.storage_options, {"read_ahead": 4}))
        for name, paths, bs, workers, options, kwargs in streams:
            loader = make_loader(paths, bs, workers, options, **kwargs)
            configs.append(Config(name, (lambda ld=loader: stream_pass(ld, stats.rows))))
        return run_rounds(configs, repeats)


def diagnose(directory: Path, stats: CorpusStats, repeats: int) -> dict[str, Any]:
    """Stage breakdown, cProfile of an in-process pass, and the DataLoader hand-off cost."""
    print("stage breakdown (one process, no read-ahead) ...", flush=True)
    stages = stage_breakdown(directory)
    for key, seconds in stages.items():
        print(f"  {key:66s} {seconds:7.2f} s  ({stats.rows / seconds:,.0f} rows/s)")
    ipc = ipc_cost(directory, repeats)
    print(f"IPC: {ipc}")
    return {"stages_seconds": stages, "profile_top_tottime": profile_worker(directory), "ipc": ipc}


def _git_head() -> str:
    try:
        import subprocess

        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    except OSError:
        return ""


def _cpu(result: dict[str, float]) -> str:
    return f"{result['main_cpu_seconds']:.2f}" if "main_cpu_seconds" in result else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~35 MB corpus instead of ~290 MB")
    parser.add_argument("--corpus", choices=sorted(SPECS), help="which corpus (default: full, or quick with --quick)")
    parser.add_argument("--set", dest="config_set", choices=("all", "ceiling"), default="all",
                        help="ceiling: only issue 25's table (raw unpadded/padded, StreamLoader variants), no diagnosis")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--no-s3", action="store_true", help="skip the moto S3 configuration")
    args = parser.parse_args()
    load_start = os.getloadavg()
    wall = time.perf_counter()
    spec = SPECS[args.corpus or ("quick" if args.quick else "full")]
    directory = ensure_corpus(spec)
    stats = corpus_stats(directory)
    print(
        f"corpus {directory}: {len(stats.files)} files, {stats.row_groups} row groups "
        f"({stats.rg_rows_min}..{stats.rg_rows_max} rows), {stats.rows:,} rows, {stats.tokens:,} tokens, "
        f"{stats.bytes / 1e6:.0f} MB on disk; load average {load_start}",
        flush=True,
    )
    results = summarise(measure(directory, stats, spec, args.repeats, not args.no_s3, args.config_set), stats)
    lines = print_table(results, "raw pyarrow 2 proc: unpadded", "raw pyarrow 2 proc: padded")
    diagnosis = diagnose(directory, stats, args.repeats) if args.config_set == "all" else {}
    load_end = os.getloadavg()
    record = {
        "command": " ".join(["benchmarks/throughput.py", *sys.argv[1:]]),
        "git": _git_head(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "pyarrow": pa.__version__, "torch": torch.__version__},
        "loadavg_start": load_start,
        "loadavg_end": load_end,
        "corpus": {
            "dir": str(directory), "files": len(stats.files), "row_groups": stats.row_groups, "rows": stats.rows,
            "tokens": stats.tokens, "bytes": stats.bytes, "rg_rows_min": stats.rg_rows_min, "rg_rows_max": stats.rg_rows_max,
            "file_rows": stats.file_rows,
        },
        "raw_batch_rows": RAW_BATCH_ROWS,
        "repeats": args.repeats,
        "results": results,
        "table": lines,
        **diagnosis,
        "wall_seconds": time.perf_counter() - wall,
    }
    name = "throughput" + ("" if spec.name == "full" else f"-{spec.name}") + ("" if args.config_set == "all" else f"-{args.config_set}")
    out = OUT.with_name(f"{name}.json")  # a quick or partial run never replaces the full one
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out} ({record['wall_seconds']:.0f} s, load average {load_start} -> {load_end})")


if __name__ == "__main__":
    main()
