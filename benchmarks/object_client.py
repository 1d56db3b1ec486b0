"""Client CPU per ranged request: s3fs (aiobotocore) against obstore (Rust) on SeaweedFS.

Two workloads, each read by every client with the same number of requests in flight:

* ``footers``: the tail of each of 2,000 small Parquet files (what a cold catalog fetches: one
  ranged GET per file, the last 64 KiB or the whole file when smaller);
* ``chunks``: one coalesced range per row group (the projected columns ``id`` and ``input_ids``,
  adjacent in the file, a few MB each), what a worker fetches.

Clients: ``s3fs threads`` (blocking ``cat_file`` from a thread pool: the catalog's way),
``s3fs gather`` (one ``cat_ranges`` call on fsspec's event loop), ``obstore threads`` (blocking
``obstore.get_range`` from a thread pool) and ``obstore gather`` (``get_range_async`` gathered on
one asyncio loop, a semaphore bounding the requests in flight). Every client is built and warmed
before it is timed. Client CPU is ``time.process_time()`` of this process (every thread,
tokio's included); the 20 ms latency proxy runs in a child process so that its CPU and GIL are not
the client's. Each measurement is the median of ``--repeats`` runs, the clients interleaved.

    .venv/bin/python benchmarks/object_client.py            # full size; writes benchmarks/out/object_client.json
    .venv/bin/python benchmarks/object_client.py --quick    # 200 footers, fewer chunks, one repeat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_process import proxy_process  # noqa: E402
from streamshard.io.catalog import Catalog  # noqa: E402
from streamshard.io.footer import tail_range  # noqa: E402
from streamshard.io.storage import FileSystems  # noqa: E402
from streamshard.testing import local_seaweedfs, write_corpus  # noqa: E402

LATENCY = 0.020
IN_FLIGHT = 32
FULL = {"footers": 2000, "chunk_layout": [[100_000] * 4] * 8, "repeats": 3}
QUICK = {"footers": 200, "chunk_layout": [[100_000] * 2] * 2, "repeats": 1}
Request = tuple[str, int, int]  # (bucket/key, start, end)


def s3fs_client(options: dict[str, Any]) -> Any:
    """The s3fs filesystem streamshard itself would use (its retry and pool defaults)."""
    return FileSystems(options).resolve("s3://bench/x")[0]


def obstore_client(options: dict[str, Any], bucket: str) -> Any:
    """An obstore S3Store reaching the same endpoint with the same credentials."""
    from obstore.store import S3Store

    return S3Store(bucket, endpoint=options["client_kwargs"]["endpoint_url"], access_key_id=options["key"],
                   secret_access_key=options["secret"], region=options["client_kwargs"]["region_name"],
                   virtual_hosted_style_request=False, client_options={"allow_http": True},
                   retry_config={"max_retries": 0})


def run_s3fs_threads(fs: Any, requests: list[Request]) -> list[int]:
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(lambda r: len(fs.cat_file(r[0], start=r[1], end=r[2])), requests))


def run_s3fs_gather(fs: Any, requests: list[Request]) -> list[int]:
    out = fs.cat_ranges([r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests],
                        batch_size=IN_FLIGHT, on_error="raise")
    return [len(b) for b in out]


def run_obstore_threads(store: Any, requests: list[Request]) -> list[int]:
    import obstore

    def one(r: Request) -> int:
        return len(memoryview(obstore.get_range(store, r[0].split("/", 1)[1], start=r[1], end=r[2])))

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        return list(pool.map(one, requests))


def run_obstore_gather(store: Any, requests: list[Request]) -> list[int]:
    import obstore

    async def main() -> list[int]:
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def one(r: Request) -> int:
            async with slots:
                data = await obstore.get_range_async(store, r[0].split("/", 1)[1], start=r[1], end=r[2])
                return len(memoryview(data))

        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def process_cpu(pid: int | None) -> float:
    """User + system CPU seconds of another process (0.0 when there is none)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(run: Callable[[], list[int]], expected: list[int], server_pid: int | None,
            proxy_pid: int | None) -> dict[str, float]:
    """Wall and client CPU of one run, and the CPU the S3 server and the proxy spent meanwhile."""
    others = process_cpu(server_pid), process_cpu(proxy_pid)
    cpu, wall = time.process_time(), time.perf_counter()
    got = run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if got != expected:
        raise AssertionError("a client returned other byte counts than the ranges asked for")
    return {"wall_s": wall, "cpu_s": cpu, "server_cpu_s": process_cpu(server_pid) - others[0],
            "proxy_cpu_s": process_cpu(proxy_pid) - others[1]}


def workloads(s3: Any, tmp: str, sizes: dict[str, Any]) -> dict[str, list[Request]]:
    small = os.path.join(tmp, "small")
    write_corpus(small, [[5]] * sizes["footers"])
    s3.upload(small, "bench", "small")
    chunks = os.path.join(tmp, "chunks")
    write_corpus(chunks, sizes["chunk_layout"], tokens="random", max_tokens=32)
    s3.upload(chunks, "bench", "chunks")
    footers = []
    for name in sorted(os.listdir(small)):
        start, end = tail_range(os.path.getsize(os.path.join(small, name)), None)
        footers.append((f"bench/small/{name}", start, end))
    catalog = Catalog.build(chunks, ["id", "input_ids"])
    ranges = []
    for g in range(catalog.num_row_groups):
        name = os.path.basename(catalog.urls[int(catalog.rg_file[g])])
        span = catalog.rg_ranges[g]
        ranges.append((f"bench/chunks/{name}", int(span[:, 0].min()), int(span[:, 1].max())))
    return {"footers": footers, "chunks": ranges}


def bench(options: dict[str, Any], jobs: dict[str, list[Request]], repeats: int, server_pid: int | None,
          proxy: Any) -> dict[str, Any]:
    fs, store = s3fs_client(options), obstore_client(options, "bench")
    clients = {
        "s3fs threads": lambda reqs: run_s3fs_threads(fs, reqs),
        "s3fs gather": lambda reqs: run_s3fs_gather(fs, reqs),
        "obstore threads": lambda reqs: run_obstore_threads(store, reqs),
        "obstore gather": lambda reqs: run_obstore_gather(store, reqs),
    }
    out: dict[str, Any] = {}
    for job, requests in jobs.items():
        expected = [end - start for _, start, end in requests]
        for client in clients.values():  # warm: connections, credentials, event loops
            client(requests[:IN_FLIGHT])
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
        counts: dict[str, dict[str, int]] = {}
        for _ in range(repeats):
            for name, client in clients.items():
                if proxy is not None:
                    proxy.reset_counts()
                runs[name].append(measure(lambda: client(requests), expected, server_pid, proxy and proxy.pid))
                if proxy is not None:
                    counts[name] = {"requests": proxy.count("GET"), "bytes": proxy.bytes("GET")}
        out[job] = {}
        for name, results in runs.items():
            cpu = statistics.median(r["cpu_s"] for r in results)
            wall = statistics.median(r["wall_s"] for r in results)
            out[job][name] = {
                "requests": len(requests), "bytes": sum(expected), "wall_s": wall, "cpu_s": cpu,
                "server_cpu_s": statistics.median(r["server_cpu_s"] for r in results),
                "proxy_cpu_s": statistics.median(r["proxy_cpu_s"] for r in results),
                "cpu_ms_per_request": 1000 * cpu / len(requests),
                "cpu_ms_per_mib": 1000 * cpu / (sum(expected) / 2**20),
                "requests_per_s": len(requests) / wall,
                **({"proxy_counted": counts[name]} if name in counts else {}),
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small workloads, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="runs per client and setting (median kept)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or sizes["repeats"]
    out: dict[str, Any] = {"in_flight": IN_FLIGHT, "repeats": repeats, "latency_ms": LATENCY * 1000,
                           "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, local_seaweedfs() as s3:
        jobs = workloads(s3, tmp, sizes)
        out["direct"] = bench(s3.storage_options, jobs, repeats, s3.pid, None)
        with proxy_process(s3.endpoint_url, LATENCY) as proxy:
            options = dict(s3.storage_options)
            options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
            out["latency_20ms"] = bench(options, jobs, repeats, s3.pid, proxy)
    out["load_average_after"] = os.getloadavg()
    print_table(out)
    Path("benchmarks/out").mkdir(parents=True, exist_ok=True)
    Path(f"benchmarks/out/object_client{'-quick' if args.quick else ''}.json").write_text(json.dumps(out, indent=2))


def print_table(out: dict[str, Any]) -> None:
    print(f"\nSeaweedFS on 127.0.0.1; {out['in_flight']} requests in flight; median of {out['repeats']}; "
          f"load average {out['load_average_before'][0]:.2f} -> {out['load_average_after'][0]:.2f}")
    print(f"{'setting':13} {'workload':8} {'client':16} {'requests':>8} {'MiB':>8} {'wall s':>7} {'CPU s':>6} "
          f"{'CPU ms/req':>10} {'CPU ms/MiB':>10} {'req/s':>7} {'server CPU s':>12} {'proxy CPU s':>11}")
    for setting in ("direct", "latency_20ms"):
        for job, clients in out[setting].items():
            for name, r in clients.items():
                print(f"{setting:13} {job:8} {name:16} {r['requests']:>8} {r['bytes'] / 2**20:>8.1f} {r['wall_s']:>7.2f} "
                      f"{r['cpu_s']:>6.2f} {r['cpu_ms_per_request']:>10.3f} {r['cpu_ms_per_mib']:>10.2f} "
                      f"{r['requests_per_s']:>7.0f} {r['server_cpu_s']:>12.2f} {r['proxy_cpu_s']:>11.2f}")
    for setting in ("direct", "latency_20ms"):
        for job, clients in out[setting].items():
            ratio = clients["obstore threads"]["cpu_ms_per_request"] / clients["s3fs threads"]["cpu_ms_per_request"]
            best = min(c["cpu_ms_per_request"] for n, c in clients.items() if n.startswith("obstore")) / min(
                c["cpu_ms_per_request"] for n, c in clients.items() if n.startswith("s3fs"))
            print(f"{setting} {job}: obstore/s3fs client CPU per request: threads {ratio:.2f}, best of each {best:.2f}")


if __name__ == "__main__":
    main()
