"""A/B of what ``StreamLoader.stats()`` costs: this checkout against another one (``--src``), same corpus.

``stats()`` is always on: the loop's thread times every ``next()`` and counts rows; each worker
writes its timings into a shared-memory row after every batch. The cost is per batch, so this
measures small batches (64 rows of a few short columns) where it weighs most. Each round runs, in
a fresh process per checkout and configuration (alternating the checkouts): ``StreamLoader`` with
2 thread workers, with 2 worker processes (persistent) and with no workers; one warm-up epoch,
then rows/s over three epochs. Prints a table of medians and the new/old ratio, and writes
``benchmarks/out/stats_overhead.json``. First, in this process, the per-batch cost itself: the loop's
timing and row count (``LoopStats.timed`` over ready 64-row batches, less the bare loop) and a
worker's report (``WorkerTimes``), each the median of 5 runs of 200,000 batches; ``--micro-only``
stops there (a loaded machine drowns the end-to-end A/B in noise; these bound its cost). The corpus (``write_corpus``, ~1 M rows) is written once
under ``benchmarks/out/stats_corpus/``.

    git worktree add /tmp/old <commit> && .venv/bin/python benchmarks/stats_overhead.py --src /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "out" / "stats_corpus"
LAYOUT = [[20_000] * 6 for _ in range(8)]  # 8 files x 6 row groups x 20,000 rows

CHILD = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
import streamshard as ss
ds = ss.ParquetStream(sys.argv[2], columns=["id", "score"], batch_size=64, rank=0, world_size=1)
ds.set_epoch(0)
workers = int(sys.argv[4])
kwargs = {"workers": sys.argv[3], "persistent_workers": sys.argv[3] == "processes"} if workers else {}
loader = ss.StreamLoader(ds, num_workers=workers, **kwargs)
for _ in loader:
    pass
start, rows = time.perf_counter(), 0
for _ in range(3):
    for batch in loader:
        rows += len(batch["sample_id"])
print(rows / (time.perf_counter() - start))
'''

CONFIGS = (("threads", 2, "2 thread workers, 64-row batches"), ("processes", 2, "2 worker processes, 64-row batches"),
           ("none", 0, "no workers, 64-row batches"))


def per_batch_costs(batches: int = 200_000, runs: int = 5) -> dict[str, float]:
    """Microseconds per batch of what stats() adds: the loop's side and a worker's side."""
    import time

    import torch

    sys.path.insert(0, str(ROOT))
    from streamshard.streams.delivery import DeliveryStats
    from streamshard.io.fetch import ReadStats
    from streamshard.loader.loader_stats import LoopStats, WorkerTimes

    batch = {"sample_id": torch.arange(64), "id": torch.arange(64)}

    def ready():
        for _ in range(batches):
            yield batch

    loop, hook = [], []
    for _ in range(runs):
        began = time.perf_counter()
        for _ in ready():
            pass
        bare = time.perf_counter() - began
        stats = LoopStats(1.0)
        began = time.perf_counter()
        for _ in stats.timed(ready(), lambda: (0, 0)):
            pass
        loop.append((time.perf_counter() - began - bare) / batches * 1e6)
        table, delivery = WorkerTimes(2), DeliveryStats(ReadStats(), 1)
        began = time.perf_counter()
        for _ in range(batches):
            delivery.batches += 1
            table(delivery)
        hook.append((time.perf_counter() - began) / batches * 1e6)
    return {"loop_us_per_batch": statistics.median(loop), "worker_us_per_batch": statistics.median(hook)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="the other checkout (the 'old' side); needed unless --micro-only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-only", action="store_true", help="only the per-batch costs")
    args = parser.parse_args()
    costs = per_batch_costs()
    print(f"per batch: the loop's timing and row count {costs['loop_us_per_batch']:.2f} us, "
          f"a worker's report {costs['worker_us_per_batch']:.2f} us (median of 5 x 200,000 batches)")
    os.makedirs(ROOT / "benchmarks" / "out", exist_ok=True)
    if args.micro_only:
        with open(ROOT / "benchmarks" / "out" / "stats_overhead_micro.json", "w") as f:
            json.dump({"load": os.getloadavg()[0], "costs": costs}, f, indent=2)
        return
    if not args.src:
        parser.error("--src is needed for the A/B (or pass --micro-only)")
    if not CORPUS.is_dir():
        sys.path.insert(0, str(ROOT))
        from streamshard.testing import write_corpus

        write_corpus(str(CORPUS), LAYOUT)
    sides = {"old": str(Path(args.src).resolve()), "new": str(ROOT)}
    results: dict[str, list[float]] = {}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for kind, workers, _label in CONFIGS:
            for side, src in sides.items():
                out = subprocess.run([sys.executable, "-c", CHILD, src, str(CORPUS), kind, str(workers)],
                                     capture_output=True, text=True, check=True)
                results.setdefault(f"{kind} {side}", []).append(float(out.stdout.strip().splitlines()[-1]))
    load.append(os.getloadavg()[0])
    print(f"rows/s (padding included), median of {args.rounds} rounds; load average {load[0]:.1f} -> {load[1]:.1f}")
    print(f"{'configuration':40} {'old':>10} {'new':>10} {'new/old':>8}")
    table = {}
    for kind, _workers, label in CONFIGS:
        old, new = (statistics.median(results[f"{kind} {s}"]) for s in ("old", "new"))
        table[label] = {"old": old, "new": new, "ratio": new / old, "runs": {s: results[f"{kind} {s}"] for s in sides}}
        print(f"{label:40} {old:10,.0f} {new:10,.0f} {new / old:8.2f}")
    with open(ROOT / "benchmarks" / "out" / "stats_overhead.json", "w") as f:
        json.dump({"src": sides["old"], "load": load, "costs": costs, "results": table}, f, indent=2)


if __name__ == "__main__":
    main()
