"""Object storage at full speed: ParquetStream over S3 (behind a 20 ms-latency proxy) vs local disk.

The S3 server is SeaweedFS (``weed mini`` on 127.0.0.1), a real object store that serves ranged
GETs from its stored chunks; ``--server moto`` uses moto's server instead (it materialises the
whole object on every ranged GET, so it understates what a real store does).

Measures rows/s with StreamLoader(num_workers=2) (S3 vs the same corpus on local disk), the catalog
time of 2,000 small remote files (cold, then warm from the catalog cache), peak RSS per worker,
bytes fetched / bytes of the projected column chunks, GETs per row group, and a naive baseline
(``pq.ParquetFile`` over a default fsspec file object). Prints a table, writes
``benchmarks/out/remote.json``.

    .venv/bin/python benchmarks/remote.py              # SeaweedFS, full size
    .venv/bin/python benchmarks/remote.py --quick      # a smaller corpus, one repeat (a smoke run)
    .venv/bin/python benchmarks/remote.py --server moto
    .venv/bin/python benchmarks/remote.py --catalog-only --backend obstore   # the cold/warm catalog only

The latency proxy runs in a child process (its CPU and GIL are not the client's; the CPU columns
name each process); ``--proxy-in-process`` puts it back in this process, as before. With
``--backend obstore`` the catalog is read through obstore; forked DataLoader workers then fall back to
s3fs (obstore does not survive a fork) unless ``--workers-context forkserver``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamshard.catalog import Catalog  # noqa: E402
from streamshard.dataset import ParquetStream  # noqa: E402
from streamshard.loader import StreamLoader  # noqa: E402
from streamshard.testing import FaultConfig, faulty_proxy, local_s3, local_seaweedfs, write_corpus  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_process import proxy_process  # noqa: E402

LATENCY = 0.020
COLUMNS = ["id", "input_ids"]
LAYOUT = [[20_000] * 4] * 16  # 16 files x 4 row groups x 20,000 rows
SMALL_FILES = 2000
REPEATS = 2
READ_AHEAD = 6
QUICK = {"layout": [[20_000] * 4] * 4, "small_files": 200, "repeats": 1}
SERVERS = {"seaweedfs": local_seaweedfs, "moto": local_s3}


def peak_rss(batch):
    """Transform run inside each worker: tag the batch with the worker's peak RSS (MiB)."""
    batch["peak_rss_mib"] = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    return batch


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one by default), from /proc."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def epoch_rate(paths, options, server_pid: int | None = None, proxy_pid: int | None = None,
               context: str | None = None) -> dict:
    """One epoch with 2 workers; also where the CPU went (workers, S3 server, this process + proxy)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = (children.ru_utime + children.ru_stime, cpu_seconds(), cpu_seconds(server_pid) if server_pid else 0.0,
              cpu_seconds(proxy_pid) if proxy_pid else 0.0)
    ds = ParquetStream(paths, columns=COLUMNS, rank=0, world_size=1, storage_options=options,
                       transform=peak_rss, read_ahead=READ_AHEAD)
    ds.set_epoch(0)
    started = time.perf_counter()
    rows, rss = 0, 0.0
    for batch in StreamLoader(ds, num_workers=2, multiprocessing_context=context):
        rows += int((batch["sample_id"] >= 0).sum())
        rss = max(rss, float(batch["peak_rss_mib"][0]))
    seconds = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {
        "workers": children.ru_utime + children.ru_stime - before[0],
        "main": cpu_seconds() - before[1],
        "s3_server": (cpu_seconds(server_pid) - before[2]) if server_pid else 0.0,
        "proxy": (cpu_seconds(proxy_pid) - before[3]) if proxy_pid else 0.0,
    }
    return {"cpu_seconds": cpu, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "peak_rss_mib_per_worker": rss,
            "projected_bytes": ds.catalog.projected_bytes()}


def naive(url, options, catalog) -> dict:
    """``pq.ParquetFile`` over ``fs.open`` with fsspec's default (read-ahead) cache."""
    fs = ParquetStream(url, storage_options=options, rank=0, world_size=1).catalog  # noqa: F841 - warm
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url, **{k: v for k, v in options.items() if k != "backend"})
    started = time.perf_counter()
    rows = 0
    for file_url in catalog.urls:
        with fs.open(file_url) as handle:
            parquet = pq.ParquetFile(handle)
            for g in range(parquet.num_row_groups):
                rows += parquet.read_row_group(g, columns=COLUMNS).num_rows
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=sorted(SERVERS), default="seaweedfs", help="the S3 server (default: seaweedfs)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK['layout'])} files, {QUICK['small_files']} small files, one repeat; "
                             "writes benchmarks/out/remote-quick.json")
    parser.add_argument("--catalog-only", action="store_true", help="only the catalog of the small files (cold, warm)")
    parser.add_argument("--backend", choices=["fsspec", "obstore"], default="fsspec",
                        help="storage_options backend for s3:// (default: fsspec, i.e. s3fs)")
    parser.add_argument("--proxy-in-process", action="store_true",
                        help="run the latency proxy in this process (its CPU then counts as the client's)")
    parser.add_argument("--workers-context", choices=["fork", "forkserver", "spawn"], default=None,
                        help="multiprocessing context of the StreamLoader workers (default: the platform's)")
    parser.add_argument("--repeats", type=int, default=None, help="cold catalog builds (each from an empty cache)")
    args = parser.parse_args()
    layout, small_files, repeats = ((QUICK["layout"], QUICK["small_files"], QUICK["repeats"]) if args.quick
                                    else (LAYOUT, SMALL_FILES, REPEATS))
    out: dict = {"latency_ms": LATENCY * 1000, "server": args.server, "read_ahead": READ_AHEAD,
                 "layout": f"{len(layout)} files x {len(layout[0])} row groups x {layout[0][0]} rows",
                 "backend": args.backend, "proxy": "in process" if args.proxy_in_process else "child process",
                 "load_average_before": os.getloadavg()}
    repeats = args.repeats or repeats
    with tempfile.TemporaryDirectory() as tmp, SERVERS[args.server]() as s3:
        local = os.path.join(tmp, "corpus")
        if not args.catalog_only:
            write_corpus(local, layout)
            url = s3.upload(local, "bench", "corpus")
        small = os.path.join(tmp, "small")
        write_corpus(small, [[5]] * small_files)
        s3.upload(small, "bench", "small")
        proxied = (faulty_proxy(s3.endpoint_url, FaultConfig(latency=LATENCY)) if args.proxy_in_process
                   else proxy_process(s3.endpoint_url, LATENCY))
        with proxied as proxy:
            proxy_pid = getattr(proxy, "pid", None)
            options = dict(s3.storage_options)
            options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
            if args.backend != "fsspec":
                options["backend"] = args.backend
            if args.catalog_only:
                out.update(catalogs(options, proxy, proxy_pid, s3.pid, tmp, repeats))
                return finish(out, args)

            # Alternate local and S3 runs (best of `repeats` each): this machine is shared and noisy.
            catalog = Catalog.build(url, COLUMNS, options)
            runs: dict[str, list[dict]] = {"local": [], "s3": []}
            for _ in range(repeats):
                runs["local"].append(epoch_rate(local, {}, context=args.workers_context))
                proxy.reset_counts()
                result = epoch_rate(url, options, s3.pid, proxy_pid, args.workers_context)
                # The catalog is read in the main process; count only data/footer GETs on .parquet objects.
                result["gets"] = proxy.count("GET", ".parquet")
                result["bytes_fetched"] = proxy.bytes("GET", ".parquet")
                result["heads"] = proxy.count("HEAD")
                result["fetched_over_projected"] = result["bytes_fetched"] / result["projected_bytes"]
                result["gets_per_row_group"] = result["gets"] / catalog.num_row_groups
                runs["s3"].append(result)
            out["local"] = max(runs["local"], key=lambda r: r["rows_per_s"])
            out["s3"] = max(runs["s3"], key=lambda r: r["rows_per_s"])
            out["s3"]["vs_local"] = out["s3"]["rows_per_s"] / out["local"]["rows_per_s"]

            catalog = Catalog.build(url, COLUMNS, options)
            proxy.reset_counts()
            out["naive"] = naive(url, options, catalog)
            out["naive"]["bytes_fetched"] = proxy.bytes("GET", ".parquet")
            out["naive"]["gets"] = proxy.count("GET", ".parquet") + proxy.count("HEAD", ".parquet")
            out["naive"]["fetched_over_projected"] = out["naive"]["bytes_fetched"] / catalog.projected_bytes()

            out.update(catalogs(options, proxy, proxy_pid, s3.pid, tmp, repeats))
    finish(out, args)


def catalogs(options: dict, proxy, proxy_pid: int | None, server_pid: int | None, tmp: str, repeats: int) -> dict:
    """The catalog of the small files: cold (``repeats`` builds, each with an empty cache; the best kept), then warm."""
    out: dict = {}
    colds = []
    for k in range(repeats + 1):
        label = "catalog_2000_cold" if k < repeats else "catalog_2000_warm_cache"
        cache_dir = os.path.join(tmp, f"catalog-cache-{min(k, repeats - 1)}")
        proxy.reset_counts()
        before = (time.process_time(), cpu_seconds(server_pid), cpu_seconds(proxy_pid) if proxy_pid else 0.0)
        started = time.perf_counter()
        small_catalog = Catalog.build("s3://bench/small", COLUMNS, options, cache_dir=cache_dir)
        seconds = time.perf_counter() - started
        client = time.process_time() - before[0]
        result = {"seconds": seconds, "files": small_catalog.num_files, "requests": proxy.count(),
                  "client_cpu_ms_per_file": 1000 * client / small_catalog.num_files,
                  "cpu_seconds": {"client" if proxy_pid else "client_and_proxy": client,
                                  "s3_server": cpu_seconds(server_pid) - before[1],
                                  "proxy": (cpu_seconds(proxy_pid) - before[2]) if proxy_pid else 0.0}}
        if label == "catalog_2000_cold":
            colds.append(result)
        else:
            out[label] = result
    out["catalog_2000_cold"] = min(colds, key=lambda r: r["seconds"])
    out["catalog_2000_cold"]["all_seconds"] = [r["seconds"] for r in colds]
    return out


def finish(out: dict, args) -> None:
    out["load_average_after"] = os.getloadavg()
    print_table(out)
    Path("benchmarks/out").mkdir(parents=True, exist_ok=True)
    name = "remote" + ("-catalog" if args.catalog_only else "") + (f"-{args.backend}" if args.backend != "fsspec" else "")
    Path(f"benchmarks/out/{name}{'-quick' if args.quick else ''}.json").write_text(json.dumps(out, indent=2))


def print_table(out: dict) -> None:
    print(f"\nS3 server: {out['server']}; {out['latency_ms']:.0f} ms added latency per request (proxy in "
          f"{out['proxy']}); backend {out['backend']}; load average {out['load_average_before'][0]:.2f} -> "
          f"{out['load_average_after'][0]:.2f}")
    if "local" in out:
        print(f"{out['layout']}; columns {COLUMNS}; 2 workers; read_ahead={READ_AHEAD}")
        print(f"{'run':28} {'rows/s':>10} {'x local':>8} {'GETs/rg':>8} {'fetched/projected':>18} {'peak RSS/worker':>16}")
        for key in ("local", "s3"):
            r = out[key]
            print(f"{key:28} {r['rows_per_s']:>10.0f} {r.get('vs_local', 1.0):>8.2f} {r.get('gets_per_row_group', 0):>8.2f} "
                  f"{r.get('fetched_over_projected', 0):>18.3f} {r['peak_rss_mib_per_worker']:>13.0f} MiB")
        for key in ("local", "s3"):
            r, cpu = out[key], out[key]["cpu_seconds"]
            print(f"  {key}: {r['seconds']:.2f} s wall on 2 cores; CPU s: workers {cpu['workers']:.2f}, "
                  f"S3 server {cpu['s3_server']:.2f}, main process {cpu['main']:.2f}, proxy {cpu['proxy']:.2f}")
        n = out["naive"]
        print(f"{'naive pq.ParquetFile(fs.open)':28} {n['rows_per_s']:>10.0f} {'':>8} {'':>8} {n['fetched_over_projected']:>18.3f}")
    for key in ("catalog_2000_cold", "catalog_2000_warm_cache"):
        r = out[key]
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_seconds"].items())
        print(f"{key:28} {r['seconds']:>9.2f} s for {r['files']} files, {r['requests']} requests; "
              f"client CPU {r['client_cpu_ms_per_file']:.2f} ms per file; CPU s: {cpu}")
    if "all_seconds" in out["catalog_2000_cold"]:
        print(f"  cold builds: {', '.join(f'{s:.2f}' for s in out['catalog_2000_cold']['all_seconds'])} s")


if __name__ == "__main__":
    main()
