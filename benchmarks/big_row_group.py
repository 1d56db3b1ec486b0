"""Peak memory of DataLoader workers that split one ~1 GB+ row group between them.

Writes one Parquet file holding ONE row group of ``--rows`` rows x 512 int32 values (1M rows:
2.05 GB decoded), in two shapes: a ``list<int32>`` column (what users have) and 512 int32
columns ("wide"). Values are small (0..999), so they are dictionary-encoded: the footer's
encoded size is ~3x below the decoded size, as in issue 11. Then, for each shape, with and
without shuffle, through ``ss.StreamLoader(ds, num_workers=2)`` and through a plain
``DataLoader(ds, batch_size=None, num_workers=2)``, it reads the epoch and records each
worker's peak RSS (``VmHWM`` from ``/proc/self/status``, read inside the worker by a
``transform`` after every batch), wall time, and whether every row came exactly once. With
``--loaders process`` there are no workers: one process reads the second of two shares (rank 1 of 2,
which decodes the whole group) and reports its CPU seconds (Arrow's threads included): speed compared
where the wall times of worker processes on a shared machine are noise. ``--groups N`` writes N such
files (one group each) and ``--read-ahead`` sets ``read_ahead``: what a worker holds when its next
reads are parts of other huge groups.

Each configuration runs in a fresh process, so ``--src`` can point at another checkout (a git
worktree of an older commit) to measure "before" with the same script:

    .venv/bin/python benchmarks/big_row_group.py [--rows 1000000] [--src /tmp/old] [--quick]

The file lives in a temporary directory and is deleted at the end. Writes
``benchmarks/out/big_row_group.json`` (``big_row_group-<label>.json`` with ``--label``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WIDTH = 512
MIB = 1024 * 1024


def write_file(path: str, rows: int, shape: str) -> dict[str, Any]:
    """One row group of ``rows`` rows x ``WIDTH`` small int32 values; returns sizes from the footer."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    ids = pa.array(np.arange(rows, dtype=np.int64))
    if shape == "list":
        values = pa.array(rng.integers(0, 1000, rows * WIDTH, dtype=np.int32))
        offsets = pa.array(np.arange(0, rows * WIDTH + 1, WIDTH, dtype=np.int32))
        table = pa.table({"id": ids, "x": pa.ListArray.from_arrays(offsets, values)})
    else:
        table = pa.table({"id": ids, **{f"c{i}": pa.array(rng.integers(0, 1000, rows, dtype=np.int32))
                                         for i in range(WIDTH)}})
    pq.write_table(table, path, row_group_size=rows)
    del table
    # What a reader holds once decoded (Arrow adds validity bitmaps the written table did not have).
    decoded = sum(b.nbytes for b in pq.ParquetFile(path).iter_batches(batch_size=65_536))
    meta = pq.read_metadata(path)
    group = meta.row_group(0)
    assert meta.num_row_groups == 1
    try:  # what `streamshard inspect` reports for it (this checkout's estimator)
        from streamshard.format.decoded_size import decoded_bytes
        estimate = int(decoded_bytes(meta)[0])
    except ImportError:
        estimate = None
    return {"rows": rows, "decoded_bytes": decoded, "encoded_bytes": group.total_byte_size,
            "inspect_estimate_bytes": estimate,
            "compressed_bytes": sum(group.column(c).total_compressed_size for c in range(group.num_columns)),
            "file_bytes": os.path.getsize(path)}


# -- one configuration, in its own process -----------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


_BASELINE_KIB = [0]  # this worker's RSS when it started, before it read anything


def note_baseline(worker_id: int) -> None:
    """``worker_init_fn``: the worker's RSS before its pass (the baseline its peak is measured above)."""
    _BASELINE_KIB[0] = _status_kib("VmRSS")


def record_peak(batch: dict[str, Any]) -> dict[str, Any]:
    """A ``transform`` run in the worker: attach its pid, peak RSS so far and baseline to the batch."""
    import torch

    batch["_pid"] = torch.tensor([os.getpid()])
    batch["_hwm_kib"] = torch.tensor([_status_kib("VmHWM")])
    batch["_base_kib"] = torch.tensor([_BASELINE_KIB[0]])
    return batch


def run_child(config: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from torch.utils.data import DataLoader

    import streamshard as ss

    in_process = config["loader"] == "process"  # no workers: this process reads the second of two shares
    ds = ss.ParquetStream(config["path"], batch_size=config["batch_size"], shuffle=config["shuffle"], seed=1,
                          read_ahead=config["read_ahead"],
                          transform=record_peak, **({"rank": 1, "world_size": 2} if in_process else {}))
    ds.set_epoch(0)  # the parent takes the catalog; workers use its snapshot
    workers = config["workers"]
    if in_process:
        note_baseline(0)
        loader = ds
    else:
        loader = ss.StreamLoader(ds, num_workers=workers, worker_init_fn=note_baseline) \
            if config["loader"] == "StreamLoader" else DataLoader(ds, batch_size=None, num_workers=workers,
                                                                   worker_init_fn=note_baseline)
    parent_rss = _status_kib("VmRSS")
    cpu = time.process_time()
    seen = np.zeros(config["rows"], dtype=np.int64)
    peaks: dict[int, int] = {}
    bases: dict[int, int] = {}
    started = time.perf_counter()
    for batch in loader:
        ids = batch["sample_id"].numpy()
        np.add.at(seen, ids[ids >= 0], 1)
        pid, hwm = int(batch["_pid"][0]), int(batch["_hwm_kib"][0])
        peaks[pid] = max(peaks.get(pid, 0), hwm)
        bases[pid] = int(batch["_base_kib"][0])
        del batch
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    return {
        "cpu_s": round(cpu, 3) if in_process else None,  # the process's CPU (Arrow's threads too)
        "streamshard": os.path.dirname(os.path.dirname(ss.__file__)),
        "wall_s": wall,
        "worker_peak_mib": sorted(round(v / 1024) for v in peaks.values()),
        # Each worker's peak above its RSS when it started (issue 25 item 4: <= 0.8x the group's decoded size)
        "worker_above_baseline_mib": sorted(round((peaks[p] - bases[p]) / 1024) for p in peaks),
        "parent_rss_at_start_mib": round(parent_rss / 1024),
        "parent_peak_mib": round(_status_kib("VmHWM") / 1024),
        # One process reads one share: each of its rows once (rows_delivered: how many), the rest never.
        "exactly_once": bool(np.all(seen <= 1) if in_process else np.all(seen == 1)),
        "rows_delivered": int(seen.sum()),
    }


# -- the driver -----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the one row group (x 512 int32)")
    parser.add_argument("--src", default="", help="import streamshard from this checkout (e.g. a worktree of an old commit)")
    parser.add_argument("--label", default="", help="suffix of the JSON file written (e.g. 'before')")
    parser.add_argument("--shapes", default="list,wide")
    parser.add_argument("--loaders", default="StreamLoader,DataLoader",
                        help="also 'process': no workers, this process reads the second of two shares (CPU seconds)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--groups", type=int, default=1, help="files of one such row group each (x the group: one)")
    parser.add_argument("--read-ahead", type=int, default=2, help="ParquetStream(read_ahead=)")
    parser.add_argument("--quick", action="store_true", help="100k rows (205 MB decoded), list shape only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if args.quick:
        args.rows, args.shapes = 100_000, "list"
    load_start = os.getloadavg()
    results, files = [], {}
    print(f"{args.groups} x one row group of {args.rows:,} rows x {WIDTH} int32, 2 workers, read_ahead "
          f"{args.read_ahead}; src {args.src or ROOT}; "
          f"load average {load_start}", flush=True)
    header = f"{'shape':<6}{'loader':<14}{'shuffle':<9}{'worker peak RSS (MiB)':>60}{'parent':>9}{'wall s':>9}  exactly once"
    lines = [header]
    print(header, flush=True)
    with tempfile.TemporaryDirectory(prefix="big_row_group-") as tmp:
        for shape in args.shapes.split(","):
            path = os.path.join(tmp, shape)  # a directory of --groups files, each one such row group
            os.makedirs(path)
            files[shape] = write_file(os.path.join(path, "part-0.parquet"), args.rows, shape)
            for g in range(1, args.groups):
                shutil.copyfile(os.path.join(path, "part-0.parquet"), os.path.join(path, f"part-{g}.parquet"))
            for loader in args.loaders.split(","):
                for shuffle in (False, True):
                    config = {"path": path, "rows": args.rows * args.groups, "shuffle": shuffle, "loader": loader,
                              "workers": 2, "read_ahead": args.read_ahead,
                              "batch_size": args.batch_size, "src": args.src}
                    # PYTHONPATH, not sys.path: processes the loader starts import the same checkout.
                    # Without --src, this checkout (not whichever streamshard the interpreter would import).
                    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.src or str(ROOT),
                                                                                     os.environ.get("PYTHONPATH")]))}
                    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(config)],
                                          capture_output=True, text=True, env=env)
                    if done.returncode != 0:
                        result = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                                  f"exit {done.returncode}"}
                        line = f"{shape:<6}{loader:<14}{str(shuffle):<9}  FAILED: {result['error']}"
                    else:
                        result = json.loads(done.stdout.strip().splitlines()[-1])
                        peaks = " + ".join(str(p) for p in result["worker_peak_mib"])
                        above = result["worker_above_baseline_mib"]
                        decoded_mib = files[shape]["decoded_bytes"] / MIB
                        result["worker_above_baseline_x_decoded"] = [round(a / decoded_mib, 2) for a in above]
                        peaks += f" (above start: {' + '.join(str(a) for a in above)}, " \
                                 f"{'/'.join(str(x) for x in result['worker_above_baseline_x_decoded'])}x the group)"
                        cpu = "" if result["cpu_s"] is None else f"  (CPU {result['cpu_s']:.2f} s, {result['rows_delivered']:,} rows)"
                        line = (f"{shape:<6}{loader:<14}{str(shuffle):<9}{peaks:>60}{result['parent_peak_mib']:>9}"
                                f"{result['wall_s']:>9.1f}  {result['exactly_once']}{cpu}")
                    results.append({"shape": shape, "loader": loader, "shuffle": shuffle, **result})
                    lines.append(line)
                    print(line, flush=True)
            shutil.rmtree(path)
    for shape, sizes in files.items():
        estimate = sizes["inspect_estimate_bytes"]
        note = (f"{shape}: decoded {sizes['decoded_bytes'] / MIB:,.0f} MiB, footer encoded {sizes['encoded_bytes'] / MIB:,.0f}"
                f" MiB, inspect estimate {'-' if estimate is None else f'{estimate / MIB:,.0f}'} MiB, "
                f"compressed {sizes['compressed_bytes'] / MIB:,.0f} MiB")
        lines.append(note)
        print(note)
    load_end = os.getloadavg()
    import pyarrow
    record = {
        "command": " ".join(["benchmarks/big_row_group.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "pyarrow": pyarrow.__version__},
        "src_commit": _commit(args.src or str(ROOT)),
        "loadavg_start": load_start, "loadavg_end": load_end,
        "files": files, "results": results, "table": lines,
    }
    out = HERE / "out" / (f"big_row_group-{args.label}.json" if args.label else
                          "big_row_group-quick.json" if args.quick else "big_row_group.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}; load average {load_start} -> {load_end}")


def _commit(path: str) -> str:
    done = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


if __name__ == "__main__":
    main()
