"""One epoch of the same corpus, 2 workers, read by streamshard and by its peers.

Readers (each in a fresh Python process, so peak memory and imports do not leak between them):

* ``streamshard``: ``ParquetStream(batch_size=B)`` + ``DataLoader(batch_size=None, num_workers=2)``;
  yields ``input_ids`` padded to ``[B, max_len]`` int32 + lengths, ``id``, ``label``.
* ``streamshard_loader``: the same stream through ``StreamLoader(num_workers=2)``.
* ``textbook``: the IterableDataset most tutorials write (``read_row_group().to_pandas()``, one
  tensor dict per row, every n-th row group per worker) + ``DataLoader(batch_size=B, num_workers=2)``
  with the padding collate below.
* ``hf_datasets``: ``load_dataset("parquet", data_files=..., streaming=True).with_format("torch")``
  + ``DataLoader(batch_size=B, num_workers=2)`` with a collate that pads ``input_ids`` the same way
  (``datasets.IterableDataset`` gives each DataLoader worker a share of the files).
* ``litdata``: its Parquet path, if the package is installed (skipped otherwise).
* ``pyarrow_ceiling``: raw ``ParquetFile.iter_batches(B)`` in 2 processes, half the files each,
  decode + zero-copy numpy views only (no padding, no tensors, no IPC of data): the ceiling.

Each reader runs on local disk and, where it accepts an fsspec endpoint, through SeaweedFS's S3
server on 127.0.0.1. Every run collects the ``id`` of every delivered row and checks that the
ids are exactly ``0..N-1`` once each. Peak RSS is sampled from /proc every 20 ms over the
process and all its descendants (DataLoader workers included); ``ru_maxrss`` is the fallback.
The clock runs from constructing the dataset to the last batch: listing and footers, worker
start-up and the whole epoch; imports are done before it starts (see ``WARM_UP``).

    .venv/bin/python benchmarks/peers.py [--rows 72000] [--skip-s3] [--repeats 3]

Writes ``benchmarks/out/peers.json`` and, if matplotlib is installed, ``benchmarks/peers.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from streamshard.testing import write_corpus  # noqa: E402

OUT_JSON = HERE / "out" / "peers.json"
OUT_PNG = HERE / "peers.png"
CORPUS = HERE / "out" / "peers_corpus"
COLUMNS = ["id", "input_ids", "label"]
FILES, ROW_GROUPS_PER_FILE = 16, 4
MIN_TOKENS, MAX_TOKENS, VOCAB = 64, 512, 50_000
BATCH = 256
NUM_WORKERS = 2
CORPUS_VERSION = 2
REPEAT_UNDER_S = 10.0  # slower readers run once, to keep the whole benchmark near two minutes


# -- corpus -----------------------------------------------------------------------------------


def ensure_corpus(rows: int) -> list[str]:
    """16 files x 4 row groups of random tokens (cached); ``id`` is the row's global index."""
    marker = CORPUS.parent / "peers_corpus.done"  # outside the corpus, so directory reads see Parquet only
    stamp = f"v{CORPUS_VERSION} rows={rows}"
    paths = [str(CORPUS / f"part-{f:05d}.parquet") for f in range(FILES)]
    if marker.exists() and marker.read_text() == stamp:
        return paths
    CORPUS.mkdir(parents=True, exist_ok=True)
    for old in CORPUS.iterdir():
        old.unlink()
    per_group = -(-rows // (FILES * ROW_GROUPS_PER_FILE))
    sizes = [min(per_group, max(rows - i * per_group, 0)) for i in range(FILES * ROW_GROUPS_PER_FILE)]
    layout = [sizes[f * ROW_GROUPS_PER_FILE : (f + 1) * ROW_GROUPS_PER_FILE] for f in range(FILES)]
    write_corpus(str(CORPUS), layout, MIN_TOKENS, MAX_TOKENS, seed=0, tokens="random", vocab=VOCAB)
    marker.write_text(stamp)
    return paths


# -- readers (each runs inside a child process) ------------------------------------------------


def read_streamshard(urls: list[str], storage_options: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    import torch
    from torch.utils.data import DataLoader

    from streamshard.streams.dataset import ParquetStream

    ds = ParquetStream(urls, columns=COLUMNS, batch_size=BATCH, storage_options=storage_options, rank=0, world_size=1)
    ds.set_epoch(0)
    ids, tokens = [], 0
    for batch in DataLoader(ds, batch_size=None, num_workers=NUM_WORKERS):
        real = batch["sample_id"] >= 0
        ids.append(batch["id"][real].numpy())
        tokens += int(batch["input_ids_lengths"][real].sum())
        assert isinstance(batch["input_ids"], torch.Tensor)
    return ids, tokens


def read_streamshard_loader(urls: list[str], storage_options: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    """The same stream through ``StreamLoader`` (recycled shared-memory slots, its own checkpoint)."""
    from streamshard import ParquetStream, StreamLoader

    ds = ParquetStream(urls, columns=COLUMNS, batch_size=BATCH, storage_options=storage_options, rank=0, world_size=1)
    ids, tokens = [], 0
    for batch in StreamLoader(ds, num_workers=NUM_WORKERS):
        real = batch["sample_id"] >= 0
        ids.append(batch["id"][real].numpy())
        tokens += int(batch["input_ids_lengths"][real].sum())
    return ids, tokens


class _Textbook:
    """The IterableDataset most tutorials write: each worker takes every n-th row group,
    ``read_row_group().to_pandas()``, one tensor dict per row, DataLoader batches and pads them."""

    def __init__(self, urls: list[str], storage_options: dict[str, Any]) -> None:
        self.urls, self.storage_options = urls, storage_options

    def __iter__(self):
        import fsspec
        import pyarrow.parquet as pq
        import torch
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        units = []
        for url in self.urls:
            with fsspec.open(url, "rb", **self.storage_options) as f:
                units += [(url, rg) for rg in range(pq.ParquetFile(f).num_row_groups)]
        for url, rg in units[worker::workers]:
            with fsspec.open(url, "rb", **self.storage_options) as f:
                frame = pq.ParquetFile(f).read_row_group(rg, columns=COLUMNS).to_pandas()
            for row in frame.itertuples(index=False):
                yield {"id": torch.tensor(row.id), "label": torch.tensor(row.label),
                       "input_ids": torch.tensor(row.input_ids)}


def read_textbook(urls: list[str], storage_options: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    from torch.utils.data import DataLoader, IterableDataset

    class Textbook(_Textbook, IterableDataset):
        pass

    ids, tokens = [], 0
    for batch in DataLoader(Textbook(urls, storage_options), batch_size=BATCH, num_workers=NUM_WORKERS,
                            collate_fn=_pad_collate):
        ids.append(batch["id"].numpy())
        tokens += int(batch["input_ids_lengths"].sum())
    return ids, tokens


def _pad_collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import torch
    from torch.nn.utils.rnn import pad_sequence

    tokens = [r["input_ids"] for r in rows]
    return {
        "id": torch.stack([r["id"] for r in rows]),
        "label": torch.stack([r["label"] for r in rows]),
        "input_ids": pad_sequence(tokens, batch_first=True),
        "input_ids_lengths": torch.tensor([len(t) for t in tokens], dtype=torch.int64),
    }


def read_hf_datasets(urls: list[str], storage_options: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    from datasets import load_dataset
    from torch.utils.data import DataLoader

    kwargs = {"storage_options": storage_options} if storage_options else {}
    ds = load_dataset("parquet", data_files=urls, split="train", streaming=True, **kwargs)
    ds = ds.select_columns(COLUMNS).with_format("torch")
    ids, tokens = [], 0
    for batch in DataLoader(ds, batch_size=BATCH, num_workers=NUM_WORKERS, collate_fn=_pad_collate):
        ids.append(batch["id"].numpy())
        tokens += int(batch["input_ids_lengths"].sum())
    return ids, tokens


def read_litdata(urls: list[str], storage_options: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    raise NotImplementedError("litdata is not installed")  # replaced when the package is present


def _ceiling_worker(urls: list[str], storage_options: dict[str, Any], out: str) -> None:
    fs = None
    if urls and urls[0].startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem(**storage_options)
    ids, tokens = [], 0
    for url in urls:
        source = fs.open(url, "rb") if fs is not None else url
        for batch in pq.ParquetFile(source).iter_batches(batch_size=BATCH, columns=COLUMNS):
            ids.append(batch.column(0).to_numpy())
            tokens_array = batch.column(1)
            tokens_array.values.to_numpy()  # zero-copy view of the decoded token values
            tokens += int(tokens_array.offsets[-1].as_py() - tokens_array.offsets[0].as_py())
    np.save(out, np.concatenate(ids) if ids else np.zeros(0, np.int64), allow_pickle=False)
    with open(out + ".tokens", "w") as f:
        f.write(str(tokens))


def read_pyarrow_ceiling(urls: list[str], storage_options: dict[str, Any]) -> tuple[list[np.ndarray], int]:
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"ids{i}.npy") for i in range(NUM_WORKERS)]
        procs = [ctx.Process(target=_ceiling_worker, args=(urls[i::NUM_WORKERS], storage_options, outs[i]))
                 for i in range(NUM_WORKERS)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"pyarrow ceiling worker exited with {p.exitcode}")
        ids = [np.load(o, allow_pickle=False) for o in outs]
        tokens = sum(int(open(o + ".tokens").read()) for o in outs)
    return ids, tokens


READERS: dict[str, Callable[[list[str], dict[str, Any]], tuple[list[np.ndarray], int]]] = {
    "streamshard": read_streamshard,
    "streamshard_loader": read_streamshard_loader,
    "textbook": read_textbook,
    "hf_datasets": read_hf_datasets,
    "litdata": read_litdata,
    "pyarrow_ceiling": read_pyarrow_ceiling,
}
# Which readers accept an fsspec endpoint (storage_options) for S3.
S3_CAPABLE = {"streamshard", "streamshard_loader", "textbook", "hf_datasets", "pyarrow_ceiling"}


def available(name: str) -> str | None:
    """None if the reader can run here, else why it is skipped."""
    module = {"hf_datasets": "datasets", "litdata": "litdata"}.get(name)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError:
        why = {"litdata": "litdata is not installed (its wheel requires torch 2.15 via torchvision; "
                          "installing it would replace this venv's torch 2.13.0+cpu)"}
        return why.get(name, f"{module} is not installed")
    if name == "litdata":
        return "litdata is installed but its Parquet path is not wired into this benchmark yet"
    return None


# -- one measured run (child process) -----------------------------------------------------------


class PeakRss:
    """Peak resident memory of this process and all its descendants, sampled from /proc."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _tree_rss(os.getpid()))
            self._stop.wait(self.interval)


def _tree_rss(pid: int) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/statm") as f:
            total = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    total += _tree_rss(int(child))
    except (OSError, ValueError):  # a process exited while we looked
        pass
    return total


# Imported before the clock starts: a training script has them loaded already. pandas too, because
# pyarrow imports it lazily (about 0.5 s) on its first array conversion in every process that has
# not, which would charge each DataLoader worker for a one-time import instead of for reading.
WARM_UP = {
    "streamshard": ["torch", "streamshard.streams.dataset", "pandas"],
    "streamshard_loader": ["torch", "streamshard.streams.dataset", "pandas"],
    "textbook": ["torch", "fsspec", "pandas"],
    "hf_datasets": ["torch", "datasets", "pandas"],
    "litdata": ["torch", "litdata", "pandas"],
    "pyarrow_ceiling": ["pandas"],
}


def run_one(name: str, urls: list[str], storage_options: dict[str, Any], rows: int) -> dict[str, Any]:
    for module in WARM_UP[name]:
        try:
            __import__(module)
        except ImportError:
            pass
    with PeakRss() as rss:
        start = time.perf_counter()
        ids, tokens = READERS[name](urls, storage_options)
        seconds = time.perf_counter() - start
    all_ids = np.sort(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
    exactly_once = bool(len(all_ids) == rows and np.array_equal(all_ids, np.arange(rows)))
    usage = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return {
        "reader": name,
        "seconds": seconds,
        "rows": int(len(all_ids)),
        "unique_rows": int(len(np.unique(all_ids))),
        "tokens": tokens,
        "exactly_once": exactly_once,
        "rows_per_s": len(all_ids) / seconds,
        "tokens_per_s": tokens / seconds,
        "peak_rss_mb": (rss.peak or usage * 1024) / 1e6,
    }


# -- driver -------------------------------------------------------------------------------------


def measure(name: str, where: str, urls: list[str], storage_options: dict[str, Any], rows: int) -> dict[str, Any]:
    spec = json.dumps({"name": name, "urls": urls, "storage_options": storage_options, "rows": rows})
    done = subprocess.run([sys.executable, __file__, "--child", spec], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"reader": name, "where": where, "error": tail}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "where": where}


def corpus_info(paths: list[str]) -> dict[str, Any]:
    metas = [pq.read_metadata(p) for p in paths]
    return {
        "files": len(paths),
        "row_groups": sum(m.num_row_groups for m in metas),
        "rows": sum(m.num_rows for m in metas),
        "bytes": sum(os.path.getsize(p) for p in paths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=72_000)
    parser.add_argument("--repeats", type=int, default=3,
                        help=f"runs per reader and place, median kept (only readers faster than {REPEAT_UNDER_S:.0f} s are repeated)")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(run_one(spec["name"], spec["urls"], spec["storage_options"], spec["rows"])))
        return

    paths = ensure_corpus(args.rows)
    info = corpus_info(paths)
    print(f"corpus: {info['files']} files, {info['row_groups']} row groups, {info['rows']:,} rows, "
          f"{info['bytes'] / 1e6:.1f} MB; batch {BATCH}, {NUM_WORKERS} workers")
    results: list[dict[str, Any]] = []
    places = [("local", paths, {})]
    s3_context = None
    if not args.skip_s3:
        from streamshard.testing import local_seaweedfs

        s3_context = local_seaweedfs()
        server = s3_context.__enter__()
        base = server.upload(str(CORPUS), "peers")
        places.append(("s3", [f"{base}/{Path(p).name}" for p in paths], server.storage_options))
    try:
        for where, urls, options in places:
            for name in READERS:
                skip = available(name)
                if skip is None and where == "s3" and name not in S3_CAPABLE:
                    skip = "no fsspec endpoint option"
                if skip:
                    print(f"skip {name} ({where}): {skip}")
                    results.append({"reader": name, "where": where, "skipped": skip})
                    continue
                runs = [measure(name, where, urls, options, info["rows"])]
                while len(runs) < args.repeats and runs[0].get("seconds", REPEAT_UNDER_S) < REPEAT_UNDER_S:
                    runs.append(measure(name, where, urls, options, info["rows"]))
                for run in runs:
                    run["runs"] = [r.get("seconds") for r in runs]
                ok = [r for r in runs if "error" not in r]
                result = sorted(ok, key=lambda r: r["seconds"])[len(ok) // 2] if ok else runs[0]
                results.append(result)
                print(_line(result))
    finally:
        if s3_context is not None:
            s3_context.__exit__(None, None, None)
    _add_ratios(results)
    table = render(results)
    print()
    print(table)
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "corpus": info, "batch_size": BATCH, "num_workers": NUM_WORKERS, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "versions": _versions(), "results": results,
    }
    OUT_JSON.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {OUT_JSON.relative_to(ROOT)}")
    if _chart(results):
        print(f"wrote {OUT_PNG.relative_to(ROOT)}")


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['reader']:<16} {r['where']:<6} ERROR {r['error']}"
    return (f"{r['reader']:<16} {r['where']:<6} {r['seconds']:6.2f} s  {r['rows_per_s']:>10,.0f} rows/s  "
            f"{r['tokens_per_s'] / 1e6:6.1f} M tok/s  peak {r['peak_rss_mb']:7.0f} MB  exactly once: {r['exactly_once']}")


def _add_ratios(results: list[dict[str, Any]]) -> None:
    ceiling = {r["where"]: r["rows_per_s"] for r in results if r["reader"] == "pyarrow_ceiling" and "rows_per_s" in r}
    for r in results:
        if "rows_per_s" in r and r["where"] in ceiling:
            r["ratio_to_ceiling"] = r["rows_per_s"] / ceiling[r["where"]]


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| reader | where | seconds | rows/s | tokens/s | peak RSS (MB) | exactly once | vs ceiling |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['reader']} | {r['where']} | - | - | - | - | - | {'skipped: ' + r['skipped'] if 'skipped' in r else 'error: ' + r['error']} |")
            continue
        lines.append(
            f"| {r['reader']} | {r['where']} | {r['seconds']:.2f} | {r['rows_per_s']:,.0f} | {r['tokens_per_s'] / 1e6:.1f} M | "
            f"{r['peak_rss_mb']:.0f} | {'yes' if r['exactly_once'] else 'NO (' + str(r['rows']) + ' rows, ' + str(r['unique_rows']) + ' unique)'} | "
            f"{r.get('ratio_to_ceiling', float('nan')):.2f} |")
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    out = {}
    for module in ("torch", "pyarrow", "datasets", "litdata", "s3fs", "fsspec"):
        try:
            out[module] = __import__(module).__version__
        except ImportError:
            out[module] = "not installed"
    return out


def _chart(results: list[dict[str, Any]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("skip chart: matplotlib is not installed")
        return False
    measured = [r for r in results if "rows_per_s" in r]
    places = sorted({r["where"] for r in measured}, key=["local", "s3"].index)
    readers = [name for name in READERS if any(r["reader"] == name for r in measured)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(len(readers), 1)
    for i, name in enumerate(readers):
        values = [next((r["rows_per_s"] / 1e3 for r in measured if r["reader"] == name and r["where"] == w), 0) for w in places]
        bars = ax.bar(np.arange(len(places)) + i * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(np.arange(len(places)) + width * (len(readers) - 1) / 2, places)
    ax.set_ylabel("thousand rows / s (higher is better)")
    ax.set_title(f"One epoch, {NUM_WORKERS} workers, batch {BATCH}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT_PNG, dpi=120)
    return True


if __name__ == "__main__":
    main()
