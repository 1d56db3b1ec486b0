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
* ``s3 profile``: as ``s3``, with the credentials and region in a ``~/.aws``-style profile (files named
  by ``AWS_SHARED_CREDENTIALS_FILE``/``AWS_CONFIG_FILE``, ``storage_options={"profile": ...}``) instead
  of the options: what botocore's credential chain costs a restart;
* one set per ``--backends`` entry: ``default`` (no ``backend`` option: whatever the checked-out code
  picks), ``fsspec`` (s3fs), ``obstore``.

Prints a table (rows/s, x local, first batch, requests by kind as the proxy saw them) and writes
``benchmarks/out/fresh_remote.json``.

    .venv/bin/python benchmarks/fresh_remote.py                 # 4 files x 4 row groups x 20,000 rows
    .venv/bin/python benchmarks/fresh_remote.py --repeats 5 --backends default,fsspec,obstore
    .venv/bin/python benchmarks/fresh_remote.py --src <other checkout>   # the same, on other code
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if "--child" not in sys.argv:  # a child imports the streamshard of its task's checkout (PYTHONPATH)
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
    import streamshard as ss  # imports before the clock: a restarted job has them too

    if not ss.__file__.startswith(task["src"]):
        raise RuntimeError(f"imported {ss.__file__}, not the streamshard of {task['src']}")
    from streamshard.streams.dataset import ParquetStream
    from streamshard.loader.stream_loader import StreamLoader
    from streamshard.io.storage import FileSystems

    if task.get("client_started"):  # the S3 client's start-up (imports, botocore's models) paid before the clock
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
        client = type(FileSystems(task["options"]).resolve(task["paths"])[0]).__name__
        if rows != total or id_sum != total * (total - 1) // 2:
            raise RuntimeError(f"the epoch delivered {rows} rows (id sum {id_sum}); expected each of {total} once")
        return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "first_batch_s": first, "client": client}

    print(json.dumps("ready"), flush=True)  # the parent zeroes the proxy's counters, then says go
    sys.stdin.readline()
    print(json.dumps(epoch()), flush=True)
    sys.stdin.readline()
    print(json.dumps([epoch() for _ in range(task["same_process"])]), flush=True)


# -- the parent ------------------------------------------------------------------------------------


def run_child(task: dict[str, Any], proxy) -> dict[str, Any]:
    """One restarted job in a new process; its restart epoch, the proxy's requests during it, and its
    fresh loaders in the same process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(task.get("env") or {})
    env["PYTHONPATH"] = task["src"] + os.pathsep + env.get("PYTHONPATH", "")
    process = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(task)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=task["src"], env=env)
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
    parser.add_argument("--backends", default="default",
                        help="comma-separated: default (no backend option), fsspec (s3fs), obstore")
    parser.add_argument("--src", action="append", default=[],
                        help="LABEL=CHECKOUT whose streamshard the children import (repeat it: before/after, "
                             "interleaved in one run; default: this checkout)")
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
            profile = write_profile(tmp, s3)
            configs: list[dict[str, Any]] = [{"name": "local", "paths": local, "options": {}, "cache": None}]
            for backend in backends:
                options = base if backend == "default" else {**base, "backend": backend}
                label = "s3" if backend == "default" else f"s3 {backend}"
                configs.append({"name": label, "paths": url, "options": options, "cache": None})
                if backend != "default":
                    continue
                configs.append({"name": f"{label} cached", "paths": url, "options": options,
                                "cache": os.path.join(tmp, f"cache-{backend}")})
                configs.append({"name": f"{label} client started", "paths": url, "options": options, "cache": None,
                                "client_started": True})
                configs.append({"name": f"{label} profile", "paths": url, "cache": None, "env": profile,
                                "options": {"profile": "bench",
                                            "client_kwargs": {"endpoint_url": proxy.endpoint_url}}})
            sources = [tuple(x.split("=", 1)) for x in args.src] or [("", str(ROOT))]
            configs = [{**c, "src": os.path.abspath(path), "name": f"{label} {c['name']}".strip(), "label": label}
                       for c in configs for label, path in sources]
            if any(c["label"] and c["cache"] for c in configs):  # each checkout fills its own catalog cache
                configs = [{**c, "cache": c["cache"] and f"{c['cache']}-{c['label']}"} for c in configs]
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


def write_profile(tmp: str, s3) -> dict[str, str]:
    """A ``bench`` profile holding the server's keys and region, and the environment that points botocore at it."""
    credentials, config = os.path.join(tmp, "aws-credentials"), os.path.join(tmp, "aws-config")
    Path(credentials).write_text(f"[bench]\naws_access_key_id = {s3.key}\naws_secret_access_key = {s3.secret}\n")
    Path(config).write_text(f"[profile bench]\nregion = {s3.region}\n")
    return {"AWS_SHARED_CREDENTIALS_FILE": credentials, "AWS_CONFIG_FILE": config, "AWS_EC2_METADATA_DISABLED": "true"}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: the best restart epoch and the best same-process epoch, with every value kept."""
    out: dict[str, Any] = {}
    for name, results in runs.items():
        restarts = [r["restart"] for r in results]
        same = [e for r in results for e in r["same_process"]]
        out[name] = {"restart": max(restarts, key=lambda r: r["rows_per_s"]),
                     "restart_median_rows_per_s": statistics.median(r["rows_per_s"] for r in restarts),
                     "same_process_median_rows_per_s": statistics.median(e["rows_per_s"] for e in same) if same else None,
                     "restart_median_first_batch_s": statistics.median(r["first_batch_s"] for r in restarts),
                     "restart_all_rows_per_s": [r["rows_per_s"] for r in restarts],
                     "same_process": max(same, key=lambda r: r["rows_per_s"]) if same else None,
                     "same_process_all_rows_per_s": [r["rows_per_s"] for r in same],
                     "load_averages": [r["load_average"] for r in results]}
    for name, r in out.items():
        label = name.split(" ", 1)[0] if name.split(" ", 1)[0] not in ("local", "s3") else ""
        local = out[f"{label} local".strip()]
        r["restart_median_x_local"] = r["restart_median_rows_per_s"] / local["restart_median_rows_per_s"]
        if r["same_process_median_rows_per_s"] and local["same_process_median_rows_per_s"]:
            r["same_process_median_x_local"] = r["same_process_median_rows_per_s"] / local["same_process_median_rows_per_s"]
        r["restart"]["x_local"] = r["restart"]["rows_per_s"] / local["restart"]["rows_per_s"]
        if r["same_process"] is not None and local["same_process"] is not None:
            r["same_process"]["x_local"] = r["same_process"]["rows_per_s"] / local["same_process"]["rows_per_s"]
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"\nS3 server: {out['server']}, {out['latency_ms']:.0f} ms per request (proxy in its own process); "
          f"{out['layout']}; columns {out['columns']}; {out['loader']}; {out['repeats']} restarts each; "
          f"load {out['load_average_before'][0]:.2f} -> {out['load_average_after'][0]:.2f}")
    print(f"{'configuration':26} {'client':>18} {'restart x local':>16} {'first batch':>12} {'requests list/head/get':>23} "
          f"{'same-process x local':>21} {'first batch':>12}")
    for name, r in out["runs"].items():
        rs, sp = r["restart"], r["same_process"] or {}
        req = rs.get("requests")
        kinds = f"{req['list']}/{req['head']}/{req['get']}" if req else "-"
        print(f"{name:26} {rs.get('client', '?'):>18} {r['restart_median_x_local']:>6.2f} ({rs['x_local']:.2f}) "
              f"{1000 * r['restart_median_first_batch_s']:>9.0f} ms {kinds:>23} "
              f"{r.get('same_process_median_x_local', 0):>11.2f} ({sp.get('x_local', 0):.2f}) "
              f"{1000 * sp.get('first_batch_s', 0):>9.0f} ms")
    print("x local: median (best) of rows/s over the local run's; first batch: restart median, same-process best")
    for name, r in out["runs"].items():
        print(f"  {name}: restart rows/s {', '.join(f'{x:,.0f}' for x in r['restart_all_rows_per_s'])}; same process "
              f"{', '.join(f'{x:,.0f}' for x in r['same_process_all_rows_per_s'])}")


if __name__ == "__main__":
    main()
