"""How long one global worker takes to plan its epoch, and how much memory that needs, at scale.

Every global worker computes its own slices from the same inputs, so what matters is the cost
for ONE worker: ``EpochPlan(Layout(rg_rows, rg_file), PlanConfig(...), epoch, num_workers=G)``,
then ``.worker_plan(g)`` and ``.steps``. Layouts have 10 row groups per file with row counts
varied 100..10,000 (seeded); the grid covers 10**5 and 10**6 row groups, G = 8,000 and 80,000
(1,000 or 10,000 ranks x 8 DataLoader workers), units "row_group" and "file", shuffle on/off,
and batch_size 1024 or None (one batch per row-group slice).

Time is the median of ``--repeats`` runs (after one warm-up), measured without tracemalloc;
peak memory is a separate tracemalloc run (numpy reports its allocations to tracemalloc) and
excludes the layout arrays, which the catalog holds anyway.

    .venv/bin/python benchmarks/plan_scale.py [--repeats 5] [--quick]

Writes ``benchmarks/out/plan_scale.json`` (``plan_scale-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamshard.plan.epoch_plan import EpochPlan, Layout, PlanConfig, stream_order  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "plan_scale.json"
RG_PER_FILE = 10
TARGET_SECONDS = 1.0


def make_layout(row_groups: int, seed: int = 0) -> Layout:
    """``row_groups // 10`` files of 10 row groups, 100..10,000 rows each."""
    rng = np.random.default_rng(seed)
    rg_rows = rng.integers(100, 10_001, size=row_groups).astype(np.int64)
    rg_file = np.arange(row_groups, dtype=np.int64) // RG_PER_FILE
    return Layout(rg_rows, rg_file)


def plan_one_worker(layout: Layout, config: PlanConfig, workers: int, worker: int, epoch: int = 3) -> tuple[int, int]:
    """What a worker does at the start of an epoch: build the plan, its slices and the step count."""
    plan = EpochPlan(layout, config, epoch, workers)
    work = plan.worker_plan(worker)
    return plan.steps, len(work.pieces)


def time_case(layout: Layout, config: PlanConfig, workers: int, repeats: int) -> dict[str, Any]:
    worker = workers // 2 + 1  # a worker in the middle (its block is not aligned with anything)
    plan_one_worker(layout, config, workers, worker)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        steps, pieces = plan_one_worker(layout, config, workers, worker)
        seconds.append(time.perf_counter() - start)
    tracemalloc.start()
    plan_one_worker(layout, config, workers, worker)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "seconds": statistics.median(seconds),
        "seconds_all": seconds,
        "peak_bytes": peak,
        "steps": steps,
        "pieces": pieces,
    }


def order_ablation(layout: Layout, repeats: int) -> dict[str, float]:
    """Where a shuffled-file plan spends its time: ``stream_order`` alone, and its final sort.

    ``stream_order`` for unit="file" sorts row groups by (file rank, in-file tiebreak) with
    ``np.lexsort``; a single int64 key ``file_rank * n + tiebreak`` sorts to the same order
    (both keys are distinct permutations) and is timed next to it on the same inputs.
    """
    n, files = len(layout.rg_rows), layout.num_files
    rng = np.random.default_rng(1)
    file_rank, tiebreak = rng.permutation(files)[layout.rg_file], rng.permutation(n)
    cases = {
        "stream_order(unit=row_group, shuffle)": lambda: stream_order(layout, PlanConfig(shuffle=True), 3),
        "stream_order(unit=file, shuffle)": lambda: stream_order(layout, PlanConfig(unit="file", shuffle=True), 3),
        "np.lexsort((tiebreak, file_rank))": lambda: np.lexsort((tiebreak, file_rank)),
        "np.argsort(file_rank * n + tiebreak)": lambda: np.argsort(file_rank * n + tiebreak),
    }
    if not np.array_equal(cases["np.lexsort((tiebreak, file_rank))"](), cases["np.argsort(file_rank * n + tiebreak)"]()):
        raise AssertionError("composite-key argsort and lexsort disagree")
    out = {}
    for name, fn in cases.items():
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        out[name] = statistics.median(seconds)
        print(f"  {name:42s} {out[name] * 1000:8.1f} ms (n={n:,})", flush=True)
    return out


def fmt_mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="only 10**5 row groups")
    args = parser.parse_args()
    load_start = os.getloadavg()
    sizes = [10**5] if args.quick else [10**5, 10**6]
    layouts = {n: make_layout(n) for n in sizes}
    rows: list[dict[str, Any]] = []
    grid = itertools.product(sizes, (8_000, 80_000), ("row_group", "file"), (True, False), (1024, None))
    for n, workers, unit, shuffle, batch_size in grid:
        config = PlanConfig(unit=unit, shuffle=shuffle, seed=1234, batch_size=batch_size)
        result = time_case(layouts[n], config, workers, args.repeats)
        row = {"row_groups": n, "workers": workers, "unit": unit, "shuffle": shuffle, "batch_size": batch_size, **result}
        row["peak_bytes_per_row_group"] = result["peak_bytes"] / n
        rows.append(row)
        print(
            f"rg={n:>9,} G={workers:>6,} unit={unit:9s} shuffle={shuffle!s:5s} bs={batch_size!s:4s} "
            f"{result['seconds'] * 1000:8.1f} ms  peak {fmt_mib(result['peak_bytes']):>7s} MiB "
            f"({row['peak_bytes_per_row_group']:.0f} B/rg)  steps={result['steps']} pieces={result['pieces']}",
            flush=True,
        )
    lines = table(rows)
    print("\n".join(lines))
    print("where unit='file' shuffling spends its time:")
    ablation = order_ablation(layouts[max(sizes)], args.repeats)
    worst = max(r["seconds"] for r in rows)
    record = {
        "command": "benchmarks/plan_scale.py" + (" --quick" if args.quick else ""),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "repeats": args.repeats,
        "target_seconds": TARGET_SECONDS,
        "worst_seconds": worst,
        "meets_target": worst < TARGET_SECONDS,
        "rows": rows,
        "table": lines,
        "order_ablation_seconds": ablation,
    }
    out = OUT.with_name("plan_scale-quick.json") if args.quick else OUT  # never replaces a full run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"worst case {worst * 1000:.0f} ms (target < {TARGET_SECONDS * 1000:.0f} ms); wrote {out}")


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| row groups | global workers | unit | shuffle | batch_size | time ms (median) | peak MiB | peak B / row group | steps | pieces |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['row_groups']:,} | {r['workers']:,} | {r['unit']} | {'on' if r['shuffle'] else 'off'} | {r['batch_size']} | "
            f"{r['seconds'] * 1000:.1f} | {fmt_mib(r['peak_bytes'])} | {r['peak_bytes_per_row_group']:.0f} | {r['steps']} | {r['pieces']} |"
        )
    return lines


if __name__ == "__main__":
    main()
