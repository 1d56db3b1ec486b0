"""Object storage at full speed: StreamLoader over S3 (behind a 20 ms-latency proxy) vs local disk
and vs raw pyarrow reading the same objects.

The S3 server is SeaweedFS (``weed mini`` on 127.0.0.1), a real object store that serves ranged
GETs from its stored chunks; ``--server moto`` uses moto's server instead (it materialises the
whole object on every ranged GET, so it understates what a real store does). The latency proxy
runs in a child process (its CPU and GIL are not the client's; ``--proxy-in-process`` puts it back).

One run measures, epochs interleaved round by round (best of ``--repeats`` each):

* ``StreamLoader(ds, num_workers=2)`` with its default thread workers, on local disk and on S3
  through each backend (s3fs, the default, and obstore);
* raw pyarrow in 2 processes (each half of the files, ``ParquetFile(pre_buffer=True).iter_batches``)
  on local disk and on the same S3 objects through pyarrow's own S3 client (through the proxy):
  ``decode`` (Arrow only) and ``padded`` (also the tensors of 256-row batches a loader hands over:
  ids, tokens padded to the longest row, lengths);

and per row group: requests and bytes (as the proxy saw them) and the client's CPU (ms of this
process, every thread; S3 server and proxy CPU apart), with the peak RSS growth of the process
during the epoch. Then the catalog of 2,000 small files (cold, warm cache) per backend. Prints a
table, writes ``benchmarks/out/remote.json``.

    .venv/bin/python benchmarks/remote.py              # SeaweedFS, full size, both backends
    .venv/bin/python benchmarks/remote.py --quick      # a smaller corpus, one repeat (a smoke run)
    .venv/bin/python benchmarks/remote.py --backends obstore --no-catalog
    .venv/bin/python benchmarks/remote.py --catalog-only --backends obstore   # the cold/warm catalog only
    .venv/bin/python benchmarks/remote.py --no-catalog --ab shared-footers,if-match,shared-footers+if-match
    .venv/bin/python benchmarks/remote.py --reader-cpu --no-catalog   # CPU per row group, one reader, one thread
    .venv/bin/python benchmarks/remote.py --no-catalog --shuffle      # the stream epochs with shuffle=True

A new loader per epoch, catalog included (a restarted job, a small corpus): ``benchmarks/fresh_remote.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamshard.io.first_reads import FIRST_READS  # noqa: E402
from streamshard.io.catalog import Catalog  # noqa: E402
from streamshard.streams.dataset import DEFAULT_BATCH_SIZE, ParquetStream  # noqa: E402
from streamshard.loader.stream_loader import StreamLoader  # noqa: E402
from streamshard.testing import FaultConfig, faulty_proxy, local_s3, local_seaweedfs, write_corpus  # noqa: E402

from json_workers import JsonWorkers, serve_json  # noqa: E402  (benchmarks/, this script's directory)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_process import proxy_process  # noqa: E402

LATENCY = 0.020
COLUMNS = ["id", "input_ids"]
LAYOUT = [[20_000] * 4] * 16  # 16 files x 4 row groups x 20,000 rows
SMALL_FILES = 2000
REPEATS = 3
READ_AHEAD = 6
RAW_BATCH_ROWS = 20_000
QUICK = {"layout": [[20_000] * 4] * 4, "small_files": 200, "repeats": 1}
SERVERS = {"seaweedfs": local_seaweedfs, "moto": local_s3}
BACKENDS = ("fsspec", "obstore")


# -- process accounting ---------------------------------------------------------------------------


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default: every thread), from /proc."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib() -> float:
    """This process's resident set now (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, grouped: the fsspec event loop (s3fs's I/O),
    native threads (obstore's tokio runtime, Arrow's pools) and the other Python threads."""
    python = {t.native_id: t.name for t in threading.enumerate()}
    out = {"fsspec_io_loop": 0.0, "native_threads": 0.0, "python_threads": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick
        name = python.get(int(task.name))
        key = "native_threads" if name is None else "fsspec_io_loop" if name == "fsspecIO" else "python_threads"
        out[key] += seconds
    return out


class Accounting:
    """CPU of this process, the S3 server and the proxy over one measured epoch."""

    def __init__(self, server_pid: int | None, proxy_pid: int | None) -> None:
        self.server_pid, self.proxy_pid = server_pid, proxy_pid

    def __enter__(self) -> "Accounting":
        self._before = (cpu_seconds(), self._of(self.server_pid), self._of(self.proxy_pid), thread_cpu())
        return self

    def __exit__(self, *exc: Any) -> None:
        threads = thread_cpu()
        self.cpu = {"client": cpu_seconds() - self._before[0], "s3_server": self._of(self.server_pid) - self._before[1],
                    "proxy": self._of(self.proxy_pid) - self._before[2],
                    **{f"client_{k}": threads[k] - self._before[3][k] for k in ("fsspec_io_loop", "native_threads")}}

    @staticmethod
    def _of(pid: int | None) -> float:
        return cpu_seconds(pid) if pid else 0.0


# -- StreamLoader ---------------------------------------------------------------------------------


def stream_epoch(paths: str, options: dict, catalog_rgs: int, server_pid: int | None = None, proxy=None,
                 shuffle: bool = False) -> dict:
    """One epoch of ``StreamLoader(ds, num_workers=2)`` (thread workers), every row checked once."""
    ds = ParquetStream(paths, columns=COLUMNS, rank=0, world_size=1, storage_options=options, read_ahead=READ_AHEAD,
                       shuffle=shuffle)
    reads: dict[int, Any] = {}
    ds.stats_hook = lambda stats: reads.setdefault(stats.worker, stats.reads)
    # No early reads (io/first_reads.py): a catalog built in a process that read these files before would send
    # the epoch's first data GETs before the clock and the counters start (fresh_remote.py measures those).
    FIRST_READS.clear()
    ds.set_epoch(0)  # the catalog is read here, before the clock and the counters start
    loader = StreamLoader(ds, num_workers=2)
    if proxy is not None:
        proxy.reset_counts()
    rss_before, rss_peak = rss_mib(), 0.0
    rows = id_sum = 0
    with Accounting(server_pid, getattr(proxy, "pid", None)) as account:
        started = time.perf_counter()
        for k, batch in enumerate(loader):
            ids = batch["sample_id"]
            real = ids >= 0
            rows += int(real.sum())
            id_sum += int(ids[real].sum())
            if k % 64 == 0:
                rss_peak = max(rss_peak, rss_mib())
        seconds = time.perf_counter() - started
    total = ds.catalog.num_rows
    if rows != total or id_sum != total * (total - 1) // 2:
        raise RuntimeError(f"{paths}: the epoch delivered {rows} rows (id sum {id_sum}); expected each of {total} once")
    out = {"workers": loader.workers, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds,
           "cpu_seconds": account.cpu, "client_cpu_ms_per_row_group": 1000 * account.cpu["client"] / catalog_rgs,
           "rss_growth_mib": max(rss_peak - rss_before, 0.0),
           "reader": {k: sum(getattr(r, k) for r in reads.values())
                      for k in ("requests", "bytes_fetched", "footers_fetched", "footers_shared", "row_groups_read",
                                "misses")},
           "projected_bytes": ds.catalog.projected_bytes()}
    if proxy is not None:
        out.update(proxy_counts(proxy, catalog_rgs, out["projected_bytes"]))
    return out


def proxy_counts(proxy, row_groups: int, projected: int) -> dict:
    """Requests and bytes the proxy forwarded for the ``.parquet`` objects, per row group."""
    gets, heads = proxy.count("GET", ".parquet"), proxy.count("HEAD", ".parquet")
    fetched = proxy.bytes("GET", ".parquet")
    return {"gets": gets, "heads": heads, "bytes_fetched": fetched, "requests_per_row_group": (gets + heads) / row_groups,
            "kib_per_row_group": fetched / 1024 / row_groups, "fetched_over_projected": fetched / projected}


def _no_shared_footers(run):
    """``run()`` with this process keeping no footers (each reader fetches its files' footers, as before they were shared)."""
    from streamshard.io.footer import SHARED_FOOTERS

    budget, SHARED_FOOTERS.budget = SHARED_FOOTERS.budget, 0
    SHARED_FOOTERS.clear()
    try:
        return run()
    finally:
        SHARED_FOOTERS.budget = budget


def _no_conditional_gets(run):
    """``run()`` with S3 versions checked by one HEAD per file per reader (as before GETs carried If-Match)."""
    from streamshard.io import storage

    storage.CONDITIONAL_GETS = False
    try:
        return run()
    finally:
        storage.CONDITIONAL_GETS = True


WITHOUT = {"shared-footers": _no_shared_footers, "if-match": _no_conditional_gets}


def without_feature(features: str, run):
    """``run()`` with each of ``features`` (``WITHOUT`` names joined by ``+``) switched off."""
    for feature in features.split("+"):
        run = _wrapped(WITHOUT[feature], run)
    return run()


def _wrapped(switch, run):
    return lambda: switch(run)


# -- client CPU per row group, one thread, no latency ----------------------------------------------


def reader_cpu(local: str, url: str, options: dict[str, dict], repeats: int) -> dict:
    """CPU ms of this process per row group read by one ``RowGroupReader`` in one thread (no proxy, no
    workers): local disk and each backend, with the version check on the GET (If-Match) or by HEAD, and
    the backend's fetch of the same ranges alone (what the client library costs per request)."""
    import statistics

    from streamshard.io import storage
    from streamshard.io.reader import RowGroupReader
    from streamshard.io.storage import FileSystems, cat_ranges_if_match

    def read_all(catalog, opts) -> None:
        reader = RowGroupReader.from_catalog(catalog, opts)
        for f, g in zip(catalog.rg_file.tolist(), catalog.rg_index.tolist()):
            reader.read(f, g)
        reader.close()

    def fetch_all(catalog, opts, if_match: bool) -> None:
        fs, _ = FileSystems(opts).resolve(catalog.urls[0])
        for rg in range(catalog.num_row_groups):
            f = int(catalog.rg_file[rg])
            path = fs._strip_protocol(catalog.urls[f])
            start, end = int(catalog.rg_ranges[rg, :, 0].min()), int(catalog.rg_ranges[rg, :, 1].max())
            if if_match:
                cat_ranges_if_match(fs, path, [start], [end], catalog.versions[f][5:], 30)
            else:
                fs.cat_ranges([path], [start], [end], on_error="return", timeout=30)

    def by_head(run):
        storage.CONDITIONAL_GETS = False
        try:
            run()
        finally:
            storage.CONDITIONAL_GETS = True

    configs: list[tuple[str, Any]] = []
    catalog = Catalog.build(local, COLUMNS)
    configs.append(("reader, local", lambda c=catalog: read_all(c, {})))
    for backend, opts in options.items():
        c = Catalog.build(url, COLUMNS, opts)
        configs += [(f"reader, s3 {backend} (If-Match)", lambda c=c, o=opts: read_all(c, o)),
                    (f"reader, s3 {backend} (HEAD per file)", lambda c=c, o=opts: by_head(lambda: read_all(c, o))),
                    (f"fetch only, s3 {backend} (If-Match)", lambda c=c, o=opts: fetch_all(c, o, True)),
                    (f"fetch only, s3 {backend} (plain cat_ranges)", lambda c=c, o=opts: fetch_all(c, o, False))]
    cpu: dict[str, list[float]] = {}
    for name, run in configs:  # warm-up
        run()
    for _ in range(max(repeats, 5)):
        for name, run in configs:
            before = time.process_time()
            run()
            cpu.setdefault(name, []).append(1000 * (time.process_time() - before) / catalog.num_row_groups)
    return {name: {"median_ms_per_row_group": statistics.median(v), "all": v} for name, v in cpu.items()}


# -- raw pyarrow in 2 processes -------------------------------------------------------------------


def _raw_filesystem(spec: dict | None) -> Any:
    if spec is None:
        return None
    from pyarrow import fs

    return fs.S3FileSystem(access_key=spec["key"], secret_key=spec["secret"], region=spec["region"],
                           endpoint_override=spec["endpoint"], scheme="http")


def _padded(batch: Any) -> tuple[Any, ...]:
    """The tensors a loader hands over for one record batch: ids, tokens padded to the longest row, lengths."""
    import numpy as np
    import torch

    tokens = batch.column(1)
    offsets = tokens.offsets.to_numpy()
    values = tokens.flatten().to_numpy()
    lengths = np.diff(offsets)
    padded = np.zeros((len(lengths), int(lengths.max()) if len(lengths) else 0), dtype=values.dtype)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = values
    ids = batch.column(0).to_numpy().copy()  # writable, as a loader hands it over (Arrow's view is read-only)
    return torch.from_numpy(ids), torch.from_numpy(padded), torch.from_numpy(lengths)


def _raw_worker(conn: Any) -> None:
    """Serve ``{"paths", "s3", "mode"}`` tasks (JSON, never pickles) until an empty message."""
    serve_json(conn, _raw_epoch)


def _raw_epoch(task: dict[str, Any]) -> dict[str, Any]:
    """Read every row group's projected columns (``decode``: Arrow only; ``padded``: also the tensors
    of batches of ``DEFAULT_BATCH_SIZE`` rows a loader yields); rows, seconds and this process's CPU
    seconds."""
    filesystem = _raw_filesystem(task["s3"])
    padded = task["mode"] == "padded"
    cpu, started, rows = time.process_time(), time.perf_counter(), 0
    for path in task["paths"]:
        parquet = pq.ParquetFile(path, filesystem=filesystem, pre_buffer=True)
        for batch in parquet.iter_batches(batch_size=DEFAULT_BATCH_SIZE if padded else RAW_BATCH_ROWS,
                                          columns=COLUMNS):
            rows += batch.num_rows
            if padded:
                _padded(batch)
    return {"rows": rows, "seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu}


class RawPool(JsonWorkers):
    """Two persistent spawned processes (warm imports); each epoch gives each half of the files."""

    def __init__(self, processes: int = 2) -> None:
        super().__init__(_raw_worker, processes)

    def epoch(self, paths: list[str], s3: dict | None, mode: str, row_groups: int, server_pid: int | None = None,
              proxy=None, projected: int = 0) -> dict:
        half = (len(paths) + 1) // 2
        if proxy is not None:
            proxy.reset_counts()
        before = (cpu_seconds(server_pid) if server_pid else 0.0, cpu_seconds(proxy.pid) if getattr(proxy, "pid", None) else 0.0)
        started = time.perf_counter()
        parts = self.ask([{"paths": part, "s3": s3, "mode": mode} for part in (paths[:half], paths[half:])])
        seconds = time.perf_counter() - started
        rows = sum(p["rows"] for p in parts)
        client = sum(p["cpu"] for p in parts)
        out = {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds,
               "cpu_seconds": {"client": client, "s3_server": (cpu_seconds(server_pid) - before[0]) if server_pid else 0.0,
                               "proxy": (cpu_seconds(proxy.pid) - before[1]) if getattr(proxy, "pid", None) else 0.0},
               "client_cpu_ms_per_row_group": 1000 * client / row_groups}
        if proxy is not None:
            out.update(proxy_counts(proxy, row_groups, projected))
        return out

# -- the run --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=sorted(SERVERS), default="seaweedfs", help="the S3 server (default: seaweedfs)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK['layout'])} files, {QUICK['small_files']} small files, one repeat; "
                             "writes benchmarks/out/remote-quick.json")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated storage_options backends for s3:// (default: fsspec,obstore)")
    parser.add_argument("--catalog-only", action="store_true", help="only the catalog of the small files (cold, warm)")
    parser.add_argument("--no-catalog", action="store_true", help="skip the catalog of the small files")
    parser.add_argument("--proxy-in-process", action="store_true",
                        help="run the latency proxy in this process (its CPU then counts as the client's)")
    parser.add_argument("--repeats", type=int, default=None, help="epochs of each configuration (the best is kept)")
    parser.add_argument("--shuffle", action="store_true",
                        help="stream epochs with shuffle=True (the raw pyarrow epochs read in file order either way)")
    parser.add_argument("--reader-cpu", action="store_true",
                        help="instead of epochs: CPU per row group of one reader in one thread, no proxy")
    parser.add_argument("--ab", default="", help=f"comma-separated reader features to also measure switched off, "
                                                 f"interleaved with the runs that have them: {sorted(WITHOUT)}; "
                                                 f"a+b: both off in one run")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    without = [f for f in args.ab.split(",") if f]
    if {name for f in without for name in f.split("+")} - set(WITHOUT):
        parser.error(f"--ab: choose from {sorted(WITHOUT)}")
    if set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {BACKENDS}")
    layout, small_files, repeats = ((QUICK["layout"], QUICK["small_files"], QUICK["repeats"]) if args.quick
                                    else (LAYOUT, SMALL_FILES, REPEATS))
    repeats = args.repeats or repeats
    out: dict = {"latency_ms": LATENCY * 1000, "server": args.server, "read_ahead": READ_AHEAD, "backends": backends,
                 "shuffle": args.shuffle,
                 "layout": f"{len(layout)} files x {len(layout[0])} row groups x {layout[0][0]} rows",
                 "proxy": "in process" if args.proxy_in_process else "child process", "repeats": repeats,
                 "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, SERVERS[args.server]() as s3:
        local = os.path.join(tmp, "corpus")
        if not args.catalog_only:
            write_corpus(local, layout)
            url = s3.upload(local, "bench", "corpus")
        if not args.no_catalog:
            small = os.path.join(tmp, "small")
            write_corpus(small, [[5]] * small_files)
            s3.upload(small, "bench", "small")
        proxied = (faulty_proxy(s3.endpoint_url, FaultConfig(latency=LATENCY)) if args.proxy_in_process
                   else proxy_process(s3.endpoint_url, LATENCY))
        with proxied as proxy:
            base = dict(s3.storage_options)
            base["client_kwargs"] = {**base["client_kwargs"], "endpoint_url": proxy.endpoint_url}
            options = {b: (base if b == "fsspec" else {**base, "backend": b}) for b in backends}
            if args.reader_cpu:
                direct = {b: (dict(s3.storage_options) if b == "fsspec" else {**s3.storage_options, "backend": b})
                          for b in backends}
                out["reader_cpu"] = reader_cpu(local, url, direct, repeats)
            elif not args.catalog_only:
                out["epochs"] = epochs(local, url, s3, proxy, options, repeats, without, args.shuffle)
            if not args.no_catalog:
                out["catalog"] = {b: catalogs(options[b], proxy, s3.pid, os.path.join(tmp, b), repeats) for b in backends}
    finish(out, args)


def epochs(local: str, url: str, s3, proxy, options: dict[str, dict], repeats: int, without: list[str] = (),
           shuffle: bool = False) -> dict:
    """Every configuration once per round (interleaved: the machine is shared), best of ``repeats``; the S3
    runs also without each feature named in ``without`` (``WITHOUT``), for an A/B in the same rounds."""
    catalog = Catalog.build(local, COLUMNS)
    rgs, projected = catalog.num_row_groups, catalog.projected_bytes()
    local_files = list(catalog.urls)
    s3_files = [f"bench/corpus/{Path(p).name}" for p in local_files]
    raw_s3 = {"key": s3.key, "secret": s3.secret, "region": s3.region, "endpoint": proxy.endpoint_url.split("://", 1)[1]}
    pool = RawPool(2)
    runs: dict[str, list[dict]] = {}
    try:
        configs = [("local", lambda: stream_epoch(local, {}, rgs, shuffle=shuffle))]
        configs += [(f"s3 {b}", lambda b=b: stream_epoch(url, options[b], rgs, s3.pid, proxy, shuffle)) for b in options]
        configs += [(f"s3 {b} -{feature}", lambda b=b, f=feature: without_feature(f, lambda: stream_epoch(
            url, options[b], rgs, s3.pid, proxy, shuffle))) for feature in without for b in options]
        for mode in ("decode", "padded"):
            configs += [(f"raw {mode} local", lambda m=mode: pool.epoch(local_files, None, m, rgs)),
                        (f"raw {mode} s3", lambda m=mode: pool.epoch(s3_files, raw_s3, m, rgs, s3.pid, proxy, projected))]
        for name, run in configs:  # warm-up round: clients, connections, page cache
            run()
        for _ in range(repeats):
            for name, run in configs:
                result = run()
                result["load_average"] = os.getloadavg()[0]
                runs.setdefault(name, []).append(result)
    finally:
        pool.close()
    best = {name: max(results, key=lambda r: r["rows_per_s"]) for name, results in runs.items()}
    for name, result in best.items():
        result["all_rows_per_s"] = [r["rows_per_s"] for r in runs[name]]
        result["x_local"] = result["rows_per_s"] / best["local"]["rows_per_s"]
        result["x_raw_decode_s3"] = result["rows_per_s"] / best["raw decode s3"]["rows_per_s"]
        result["x_raw_padded_s3"] = result["rows_per_s"] / best["raw padded s3"]["rows_per_s"]
    return {"row_groups": rgs, "projected_bytes": projected, "runs": best}


def catalogs(options: dict, proxy, server_pid: int | None, tmp: str, repeats: int) -> dict:
    """The catalog of the small files: cold (``repeats`` builds, each with an empty cache; the best kept), then warm."""
    out: dict = {}
    colds = []
    proxy_pid = getattr(proxy, "pid", None)
    for k in range(repeats + 1):
        label = "cold" if k < repeats else "warm_cache"
        cache_dir = os.path.join(tmp, f"catalog-cache-{min(k, repeats - 1)}")
        proxy.reset_counts()
        with Accounting(server_pid, proxy_pid) as account:
            started = time.perf_counter()
            small_catalog = Catalog.build("s3://bench/small", COLUMNS, options, cache_dir=cache_dir)
            seconds = time.perf_counter() - started
        result = {"seconds": seconds, "files": small_catalog.num_files, "requests": proxy.count(),
                  "client_cpu_ms_per_file": 1000 * account.cpu["client"] / small_catalog.num_files,
                  "cpu_seconds": account.cpu}
        if label == "cold":
            colds.append(result)
        else:
            out[label] = result
    out["cold"] = min(colds, key=lambda r: r["seconds"])
    out["cold"]["all_seconds"] = [r["seconds"] for r in colds]
    return out


def finish(out: dict, args) -> None:
    out["load_average_after"] = os.getloadavg()
    print_table(out)
    Path("benchmarks/out").mkdir(parents=True, exist_ok=True)
    name = ("remote" + ("-catalog" if args.catalog_only else "") + ("-reader-cpu" if args.reader_cpu else "")
            + ("-shuffle" if args.shuffle else "") + ("-quick" if args.quick else ""))
    Path(f"benchmarks/out/{name}.json").write_text(json.dumps(out, indent=2))


def print_table(out: dict) -> None:
    print(f"\nS3 server: {out['server']}; {out['latency_ms']:.0f} ms added latency per request (proxy in "
          f"{out['proxy']}); load average {out['load_average_before'][0]:.2f} -> {out['load_average_after'][0]:.2f}")
    if "epochs" in out:
        e = out["epochs"]
        print(f"{out['layout']} ({e['row_groups']} row groups); columns {COLUMNS}; StreamLoader(num_workers=2), "
              f"read_ahead={READ_AHEAD}{', shuffle=True' if out.get('shuffle') else ''}; best of {out['repeats']}")
        print(f"{'run':34} {'rows/s':>9} {'x local':>8} {'x raw s3 decode/padded':>23} {'req/rg':>7} {'KiB/rg':>7} {'client CPU ms/rg':>17} "
              f"{'CPU s: client/server/proxy':>27} {'RSS +MiB':>9} {'load':>5}")
        for name, r in e["runs"].items():
            cpu = r["cpu_seconds"]
            print(f"{name:34} {r['rows_per_s']:>9.0f} {r['x_local']:>8.2f} {r['x_raw_decode_s3']:>11.2f}/{r['x_raw_padded_s3']:<11.2f} "
                  f"{r.get('requests_per_row_group', 0):>7.2f} {r.get('kib_per_row_group', 0):>7.0f} "
                  f"{r['client_cpu_ms_per_row_group']:>17.2f} "
                  f"{cpu['client']:>9.2f}/{cpu['s3_server']:.2f}/{cpu['proxy']:.2f}        "
                  f"{r.get('rss_growth_mib', 0):>9.0f} {r['load_average']:>5.2f}")
        for name, r in e["runs"].items():
            extra = (f"; reader: {r['reader']['requests']} requests, {r['reader']['footers_fetched']} footers "
                     f"(+{r['reader'].get('footers_shared', 0)} shared), "
                     f"{r['reader']['misses']} misses; I/O threads' CPU: fsspec loop {r['cpu_seconds']['client_fsspec_io_loop']:.2f} s, "
                     f"native {r['cpu_seconds']['client_native_threads']:.2f} s") if "reader" in r else ""
            print(f"  {name}: {r['seconds']:.2f} s; all rows/s {', '.join(f'{x:.0f}' for x in r['all_rows_per_s'])}{extra}")
    for name, r in out.get("reader_cpu", {}).items():
        print(f"{name:44} client CPU {r['median_ms_per_row_group']:5.2f} ms per row group (median; all: "
              f"{', '.join(f'{x:.2f}' for x in r['all'])})")
    for backend, c in out.get("catalog", {}).items():
        for key in ("cold", "warm_cache"):
            r = c[key]
            print(f"catalog {SMALL_FILES if r['files'] == SMALL_FILES else r['files']} files {key:10} {backend:8} "
                  f"{r['seconds']:>6.2f} s, {r['requests']} requests; client CPU {r['client_cpu_ms_per_file']:.2f} ms per file"
                  + (f" (cold builds: {', '.join(f'{s:.2f}' for s in r['all_seconds'])} s)" if "all_seconds" in r else ""))


if __name__ == "__main__":
    main()
