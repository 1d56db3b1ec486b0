"""A fresh StreamLoader per epoch over S3 (20 ms per request) vs the same loader on local disk, catalog
included: what a job that restarts pays on a small corpus (issue 25, item 3).

Each measured epoch runs in a *new process* (a restarted job: no footers, listings or S3 clients
left from before): its clock starts at ``ParquetStream(...)`` (imports done, nothing listed or
read), so it covers the listing, the footers, the plan and every batch of
``StreamLoader(ds, num_workers=2)``, each row checked once. The same process then runs
``--same-process`` more epochs, each with a new ``ParquetStream`` and ``StreamLoader`` (a fresh
loader in a running job). Configurations, interleaved round by round (best of ``--repeats``):

* ``local``: the files on local disk;
* ``s3``: the same files on SeaweedFS behind the 20 ms latency proxy (in its own process), s3fs;
* ``s3 cached``: the same with ``catalog_cache=`` a directory the previous run of this
  configuration filled (a restarted job that keeps its cache; the first, filling run is not kept);
* ``s3 client started``: as ``s3``, with the S3 client started before the clock (its imports and
  botocore's models loaded, one request made to another key): the restart's cost without the
  client's own start-up;
* ``obstore`` variants with ``--backends fsspec,obstore``.

Prints a table (rows/s, x local, first batch, requests by kind as the proxy saw them) and writes
``benchmarks/out/fresh_remote.json``.

    .venv/bin/python benchmarks/fresh_remote.py                 # 4 files x 4 row groups x 20,000 rows
    .venv/bin/python benchmarks/fresh_remote.py --repeats 5 --backends fsspec,obstore
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

LATENCY = 0.020
COLUMNS = ["id", "input_ids"]
LAYOUT = [[20_000] * 4] * 4  # the small corpus: 4 files x 4 row groups x 20,000 short rows
REPEATS = 3
SAME_PROCESS = 2


# -- the child: one restarted job ------------------------------------------------------------------


def child(task: dict[str, Any]) -> None:
    """Run the epochs of ``task`` (a restart, then ``same_process`` fresh loaders), one JSON line each; before
    the first and before the rest, wait for a line on stdin (the parent zeroes, then reads the proxy's counters)."""
    import streamshard as ss  # noqa: F401 - imports before the clock: a restarted job has them too
    from streamshard.streams.dataset import ParquetStream
    from streamshard.loader.stream_loader import StreamLoader

    if task.get("client_started"):  # the S3 client's start-up (imports, botocore's models) paid before the clock
        from streamshard.io.storage import FileSystems

        fs, root = FileSystems(task["options"]).resolve(task["paths"])
        fs.exists(root.split("/", 1)[0] + "/no-such-key")

    def epoch() -> dict[str, Any]:
        started = time.perf_counter()
        ds = ParquetStream(task["paths"], columns=COLUMNS, rank=0, world_size=1,
                           storage_options=task["options"], catalog_cache=task["cache"])
        loader = StreamLoader(ds, num_workers=2)
        rows = id_sum = 0
        first = None
        for batch in loader:
            if first is None:
                first = time.perf_counter() - started
            ids = batch["sample_id"]
            real = ids >= 0
            rows += int(real.sum())
            id_sum += int(ids[real].sum())
        seconds = time.perf_counter() - started
        total = ds.catalog.num_rows
        if rows != total or id_sum != total * (total - 1) // 2:
            raise RuntimeError(f"the epoch delivered {rows} rows (id sum {id_sum}); expected each of {total} once")
        return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "first_batch_s": first}

    print(json.dumps("ready"), flush=True)  # the parent zeroes the proxy's counters, then says go
    sys.stdin.readline()
    print(json.dumps(epoch()), flush=True)
    sys.stdin.readline()
    print(json.dumps([epoch() for _ in range(task["same_process"])]), flush=True)


# -- the parent ------------------------------------------------------------------------------------


def run_child(task: dict[str, Any], proxy) -> dict[str, Any]:
    """One restarted job in a new process; its restart epoch, the proxy's requests during it, and its
    fresh loaders in the same process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    process = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(task)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    try:
        if json.loads(process.stdout.readline() or "null") != "ready":
            raise RuntimeError(f"the child of {task['name']} failed (see its stderr)")
        if proxy is not None:
            proxy.reset_counts()
        process.stdin.write("\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the child of {task['name']} failed (see its stderr)")
        restart = json.loads(line)
        if proxy is not None:
            restart["requests"] = request_kinds(proxy)
        process.stdin.write("\n")
        process.stdin.flush()
        same = json.loads(process.stdout.readline())
    finally:
        process.stdin.close()
        process.wait(60)
    return {"restart": restart, "same_process": same}


def request_kinds(proxy) -> dict[str, int]:
    """The proxy's requests by kind: listings (GET of a bucket with a query), HEADs, object GETs."""
    counts = proxy.request_counts()
    kinds = {"list": 0, "head": 0, "get": 0, "other": 0}
    for method, path, n in counts:
        if method == "HEAD":
            kinds["head"] += n
        elif method == "GET" and ".parquet" in path.split("?", 1)[0]:
            kinds["get"] += n
        elif method == "GET":
            kinds["list"] += n
        else:
            kinds["other"] += n
    kinds["total"] = sum(kinds.values())
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=REPEATS, help="restarted jobs per configuration (best kept)")
    parser.add_argument("--same-process", type=int, default=SAME_PROCESS,
                        help="fresh loaders per restarted job after its first epoch (best kept)")
    parser.add_argument("--backends", default="fsspec", help="comma-separated: fsspec (s3fs, the default), obstore")
    parser.add_argument("--out", default="benchmarks/out/fresh_remote.json")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    from proxy_process import proxy_process
    from streamshard.testing import local_seaweedfs, write_corpus

    backends = [b for b in args.backends.split(",") if b]
    out: dict[str, Any] = {"latency_ms": LATENCY * 1000, "server": "seaweedfs", "columns": COLUMNS,
                           "layout": f"{len(LAYOUT)} files x {len(LAYOUT[0])} row groups x {LAYOUT[0][0]} rows",
                           "loader": "StreamLoader(ParquetStream(...), num_workers=2), new per epoch",
                           "repeats": args.repeats, "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, local_seaweedfs() as s3:
        local = os.path.join(tmp, "corpus")
        write_corpus(local, LAYOUT)
        url = s3.upload(local, "bench", "corpus")
        with proxy_process(s3.endpoint_url, LATENCY) as proxy:
            base = dict(s3.storage_options)
            base["client_kwargs"] = {**base["client_kwargs"], "endpoint_url": proxy.endpoint_url}
            configs: list[dict[str, Any]] = [{"name": "local", "paths": local, "options": {}, "cache": None}]
            for backend in backends:
                options = base if backend == "fsspec" else {**base, "backend": backend}
                label = "s3" if backend == "fsspec" else f"s3 {backend}"
                configs.append({"name": label, "paths": url, "options": options, "cache": None})
                configs.append({"name": f"{label} cached", "paths": url, "options": options,
                                "cache": os.path.join(tmp, f"cache-{backend}")})
                configs.append({"name": f"{label} client started", "paths": url, "options": options, "cache": None,
                                "client_started": True})
            runs: dict[str, list[dict[str, Any]]] = {}
            for config in configs:  # warm-up (server, page cache); fills the cached configurations' caches
                run_child({**config, "same_process": 0}, proxy if config["paths"] == url else None)
            for _ in range(args.repeats):
                for config in configs:
                    result = run_child({**config, "same_process": args.same_process},
                                       proxy if config["paths"] == url else None)
                    result["load_average"] = os.getloadavg()[0]
                    runs.setdefault(config["name"], []).append(result)
    out["runs"] = summarize(runs)
    out["load_average_after"] = os.getloadavg()
    print_table(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: the best restart epoch and the best same-process epoch, with every value kept."""
    out: dict[str, Any] = {}
    for name, results in runs.items():
        restarts = [r["restart"] for r in results]
        same = [e for r in results for e in r["same_process"]]
        out[name] = {"restart": max(restarts, key=lambda r: r["rows_per_s"]),
                     "restart_all_rows_per_s": [r["rows_per_s"] for r in restarts],
                     "same_process": max(same, key=lambda r: r["rows_per_s"]) if same else None,
                     "same_process_all_rows_per_s": [r["rows_per_s"] for r in same],
                     "load_averages": [r["load_average"] for r in results]}
    local = out["local"]
    for r in out.values():
        r["restart"]["x_local"] = r["restart"]["rows_per_s"] / local["restart"]["rows_per_s"]
        if r["same_process"] is not None and local["same_process"] is not None:
            r["same_process"]["x_local"] = r["same_process"]["rows_per_s"] / local["same_process"]["rows_per_s"]
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"\nS3 server: {out['server']}, {out['latency_ms']:.0f} ms per request (proxy in its own process); "
          f"{out['layout']}; columns {out['columns']}; {out['loader']}; best of {out['repeats']}; "
          f"load {out['load_average_before'][0]:.2f} -> {out['load_average_after'][0]:.2f}")
    print(f"{'configuration':26} {'restart rows/s':>14} {'x local':>8} {'first batch':>12} {'requests list/head/get':>23} "
          f"{'same-process rows/s':>20} {'x local':>8} {'first batch':>12}")
    for name, r in out["runs"].items():
        rs, sp = r["restart"], r["same_process"] or {}
        req = rs.get("requests")
        kinds = f"{req['list']}/{req['head']}/{req['get']}" if req else "-"
        print(f"{name:26} {rs['rows_per_s']:>14,.0f} {rs['x_local']:>8.2f} {1000 * rs['first_batch_s']:>9.0f} ms "
              f"{kinds:>23} {sp.get('rows_per_s', 0):>20,.0f} {sp.get('x_local', 0):>8.2f} "
              f"{1000 * sp.get('first_batch_s', 0):>9.0f} ms")
    for name, r in out["runs"].items():
        print(f"  {name}: restart rows/s {', '.join(f'{x:,.0f}' for x in r['restart_all_rows_per_s'])}; same process "
              f"{', '.join(f'{x:,.0f}' for x in r['same_process_all_rows_per_s'])}")


if __name__ == "__main__":
    main()
