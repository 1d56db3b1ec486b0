"""Benchmark the blend schedule against Megatron-LM's greedy blend builder.

Run: ``.venv/bin/python benchmarks/blend.py`` from the repository root (~25 s; ``--quick``: a
2 * 10**7 export and a 2 * 10**4 greedy reference, ~5 s). Prints a table and writes
``benchmarks/out/blend.json`` (``blend-quick.json``). Sizes: a 2 * 10**9-sample schedule over
1,000 corpora (uniform random weights, seed 0); export of its first 2 * 10**8 positions; a
2 * 10**12-sample schedule for random access; the greedy reference at a size it can finish,
extrapolated linearly.

Export times are also given per 2 * 10**8 positions (scaled linearly from ``--export``), as wall
time and as user and system CPU time: system time is the kernel handing out the output's fresh
pages, which varies with the machine's memory state, not with the algorithm. One thread: the
export uses none, and BLAS/OpenMP pools are pinned to one thread before numpy loads.
"""

from __future__ import annotations

import argparse
import json
import os

for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_pool, "1")  # one core: numpy's own loops are single-threaded anyway
import platform
import resource
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamshard.plan.blend_schedule import BlendSchedule  # noqa: E402

K = 1000
N = 2 * 10**9
HUGE = 2 * 10**12


def best_of(fn, repeats: int = 3) -> float:
    """Fastest of ``repeats`` runs (the machine is shared; the minimum is the least disturbed)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def greedy(weights: np.ndarray, n: int) -> np.ndarray:
    """Megatron's greedy builder, numpy-vectorised over corpora: argmax of w_k * (i + 1) - count_k."""
    w = weights / weights.sum()
    taken = np.zeros(len(w))
    out = np.empty(n, np.int16)
    err = np.empty_like(w)
    for i in range(n):
        np.multiply(w, i + 1, out=err)
        err -= taken
        k = err.argmax()
        out[i] = k
        taken[k] += 1
    return out


def max_prefix_error(corpus: np.ndarray, counts: np.ndarray) -> float:
    """Largest |taken_k(m) - m * count_k / n| over all prefixes m and corpora k."""
    n = len(corpus)
    order = np.argsort(corpus, kind="stable")
    sorted_corpus = corpus[order].astype(np.int64)
    rank = np.arange(n) - np.searchsorted(sorted_corpus, sorted_corpus)
    c = counts[sorted_corpus].astype(np.float64)
    before = np.abs(rank - order * c / n)
    after = np.abs(rank + 1 - (order + 1) * c / n)
    return float(max(before.max(), after.max()))


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_times() -> tuple[float, float]:
    """User and system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def tree_depths(sched: BlendSchedule) -> np.ndarray:
    """Depth of each corpus with a positive count in the schedule's Huffman tree."""
    parent = sched._tree.parent
    depths = []
    for leaf in np.flatnonzero(sched.counts).tolist():
        depth = 0
        while parent[leaf] >= 0:
            leaf, depth = parent[leaf], depth + 1
        depths.append(depth)
    return np.asarray(depths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--export", type=int, default=2 * 10**8, help="positions to export")
    parser.add_argument("--greedy", type=int, default=200_000, help="greedy reference size")
    parser.add_argument("--quick", action="store_true", help="--export 2e7 --greedy 2e4")
    args = parser.parse_args()
    if args.quick:
        args.export, args.greedy = 2 * 10**7, 20_000
    weights = np.random.default_rng(0).random(K)
    rng = np.random.default_rng(1)
    rows: list[tuple[str, float, str]] = [("load average (1 min) at the start", os.getloadavg()[0], "runnable")]

    construct = best_of(lambda: BlendSchedule(weights, N))
    sched = BlendSchedule(weights, N)
    depths = tree_depths(sched)
    rows.append(("construct 2e9 x 1000 corpora", construct, "s"))
    mean_depth = float(np.average(depths, weights=sched.counts[sched.counts > 0]))
    rows.append(("  tree depth (count-weighted mean)", mean_depth, "levels"))
    rows.append(("  tree depth (max)", float(depths.max()), "levels"))
    rows.append(("construct 2e12 x 1000 corpora", best_of(lambda: BlendSchedule(weights, HUGE)), "s"))
    rows.append(("first 1e6 positions (2e9)", best_of(lambda: sched.lookup(np.arange(10**6))), "s"))
    random_pos = rng.integers(0, N, 10**6)
    rows.append(("1e6 random positions (2e9)", best_of(lambda: sched.lookup(random_pos)), "s"))
    huge = BlendSchedule(weights, HUGE)
    huge_pos = rng.integers(0, HUGE, 10**6)
    rows.append(("1e6 random positions (2e12)", best_of(lambda: huge.lookup(huge_pos)), "s"))
    shuffled = BlendSchedule(weights, N, seed=1, order="shuffled")
    rows.append(("1e6 random positions (2e9, shuffled)", best_of(lambda: shuffled.lookup(random_pos)), "s"))

    # Two timed runs: the first pays for the kernel (here a fresh VM) handing the process ~2 GB of
    # new pages; the second reuses freed pages and shows the algorithm's own cost. Memory is traced
    # in a third, untimed run: tracemalloc taxes every Python allocation and would skew the timing.
    per = 2 * 10**8 / args.export
    for run in ("cold", "warm", "traced"):
        rss_before = rss_mb()
        if run == "traced":
            tracemalloc.start()
        (user, system), start = cpu_times(), time.perf_counter()
        corpus, index = sched.export_megatron(args.export)
        export_s = time.perf_counter() - start
        user, system = (after - before for after, before in zip(cpu_times(), (user, system)))
        output_mb = (corpus.nbytes + index.nbytes) / 2**20
        if run == "traced":
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            rows.append(("  export output arrays", output_mb, "MiB"))
            rows.append(("  export peak traced memory beyond output", peak / 2**20 - output_mb, "MiB"))
        else:
            rows.append((f"export {args.export:.0e} positions (fair, {run}) wall", export_s, "s"))
            rows.append((f"  export CPU time, user+sys ({run})", user + system, "s"))
            rows.append((f"  per 2e8 positions ({run}): wall", export_s * per, "s"))
            rows.append((f"  per 2e8 positions ({run}): user CPU", user * per, "s"))
            rows.append((f"  per 2e8 positions ({run}): system CPU (page faults)", system * per, "s"))
        if run == "cold":
            rows.append(("  process max RSS growth during export", rss_mb() - rss_before, "MiB"))
        assert np.array_equal(np.bincount(corpus, minlength=K), sched.prefix_counts(args.export))
        del corpus, index

    greedy_s = best_of(lambda: greedy(weights, args.greedy), repeats=1)
    rows.append((f"greedy reference {args.greedy:.0e} x 1000 (numpy)", greedy_s, "s"))
    rows.append(("greedy 2e9 x 1000 (EXTRAPOLATED, linear)", greedy_s * N / args.greedy, "s"))
    small = BlendSchedule(weights, args.greedy)
    fair_corpus, _ = small.export_megatron()
    greedy_corpus = greedy(weights, args.greedy)
    greedy_counts = np.bincount(greedy_corpus, minlength=K)
    fair_error = max_prefix_error(fair_corpus, small.counts)
    greedy_error = max_prefix_error(greedy_corpus, greedy_counts)
    rows.append((f"max prefix error, fair ({args.greedy:.0e})", fair_error, "samples"))
    rows.append((f"max prefix error, greedy ({args.greedy:.0e})", greedy_error, "samples"))

    rows.append(("threads in this process at the end", threading.active_count(), "threads"))
    rows.append(("load average (1 min) at the end", os.getloadavg()[0], "runnable"))
    width = max(len(name) for name, _, _ in rows)
    print(f"{'measure':<{width}}  {'value':>12}  unit")
    for name, value, unit in rows:
        print(f"{name:<{width}}  {value:>12.4g}  {unit}")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    record = {
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpus": 2},
        "args": vars(args),
        "rows": [{"measure": name, "value": value, "unit": unit} for name, value, unit in rows],
    }
    (out / ("blend-quick.json" if args.quick else "blend.json")).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
