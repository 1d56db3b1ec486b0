"""How well DevicePrefetcher hides load time behind compute, on CPU.

Each step loads a batch (L ms) and computes on it (C ms). Without prefetching a step costs
L + C; a perfect pipeline costs max(L, C). Work is simulated two ways:

* ``sleep``: both stages sleep (I/O-bound loading, e.g. object storage; no CPU contention);
* ``torch``: both stages run a fixed, pre-calibrated number of single-threaded matmuls
  (the GIL is released inside the op), so they compete for the machine's cores.

A ``bursty`` source (every 4th load takes 4L, the others none; same mean) shows what
``depth`` buys. Prints a table and writes ``benchmarks/out/prefetch.json``.

    .venv/bin/python benchmarks/prefetch.py [--steps 40] [--repeats 3]

L and C in the table are measured in the serial baseline (each stage alone), so the ratios
hold even when the calibration of the busy work drifts on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from streamshard.loader.prefetch import DevicePrefetcher  # noqa: E402

PAIRS_MS = [(10, 10), (20, 5), (5, 20), (10, 2), (2, 10)]
OUT = Path(__file__).resolve().parent / "out" / "prefetch.json"


def _matmul_unit() -> Callable[[], None]:
    a, b = torch.randn(256, 256), torch.randn(256, 256)  # ~1 ms: the GIL is mostly released
    return lambda: torch.mm(a, b)


def _ms_per_unit(unit: Callable[[], None], reps: int = 400) -> float:
    unit()
    start = time.perf_counter()
    for _ in range(reps):
        unit()
    return (time.perf_counter() - start) * 1000 / reps


def make_work(kind: str) -> Callable[[float], None]:
    """Return work(ms): sleep, or a fixed count of matmuls calibrated to take ``ms`` alone."""
    if kind == "sleep":
        return lambda ms: time.sleep(ms / 1000)
    unit = _matmul_unit()
    per_unit = _ms_per_unit(unit)

    def work(ms: float) -> None:
        for _ in range(round(ms / per_unit)):
            unit()

    return work


class Timed:
    """Wraps work(ms) and accumulates the wall time it actually took."""

    def __init__(self, work: Callable[[float], None]) -> None:
        self.work, self.total_ms = work, 0.0

    def __call__(self, ms: float) -> None:
        start = time.perf_counter()
        self.work(ms)
        self.total_ms += (time.perf_counter() - start) * 1000


def parallel_ceiling(ms: float = 20.0, repeats: int = 5) -> float:
    """Wall time of two threads each doing ``ms`` of matmuls, over doing both serially.

    0.5 means two free cores; about 1.0 means the machine has no spare core, so no pipeline
    can overlap CPU-bound load and compute here.
    """
    work = make_work("torch")

    def one_thread() -> None:
        torch.set_num_threads(1)
        work(ms)

    ratios = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_thread(), one_thread()
        serial = time.perf_counter() - start
        threads = [threading.Thread(target=one_thread) for _ in range(2)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ratios.append((time.perf_counter() - start) / serial)
    return sorted(ratios)[len(ratios) // 2]


def source(steps: int, load_ms: list[float], work: Callable[[float], None]) -> Iterator[dict]:
    batch = {"x": torch.zeros(16), "tags": ["t"]}
    for step in range(steps):
        work(load_ms[step % len(load_ms)])
        yield batch


def run(steps: int, load_ms: list[float], compute_ms: float, work, depth: int | None) -> dict:
    """Per-step wall time and per-step time spent in each stage; ``depth=None``: no prefetch."""
    load, compute = Timed(work), Timed(work)
    batches = source(steps, load_ms, load)
    iterable = batches if depth is None else DevicePrefetcher(batches, "cpu", depth=depth)
    start = time.perf_counter()
    for _ in iterable:
        compute(compute_ms)
    wall = (time.perf_counter() - start) * 1000
    return {
        "step": wall / steps, "load": load.total_ms / steps, "compute": compute.total_ms / steps
    }


def measure(steps, load_ms, compute_ms, work, depth, repeats) -> dict:
    """Median over ``repeats`` of (baseline, prefetch) pairs run back to back (noisy machine)."""
    pairs = [
        (run(steps, load_ms, compute_ms, work, None), run(steps, load_ms, compute_ms, work, depth))
        for _ in range(repeats)
    ]
    pairs.sort(key=lambda pair: pair[1]["step"] / pair[0]["step"])
    return {"baseline": pairs[len(pairs) // 2][0], "prefetch": pairs[len(pairs) // 2][1]}


def bench_pairs(steps: int, kind: str, repeats: int) -> list[dict]:
    work = make_work(kind)
    return [_row(kind, f"{load}/{compute}", depth=2,
                 **measure(steps, [load], compute, work, 2, repeats))
            for load, compute in PAIRS_MS]


def bench_bursty(steps: int, repeats: int) -> list[dict]:
    work = make_work("sleep")
    return [_row("sleep", "0,0,0,40/10", depth=depth,
                 **measure(steps, [40.0, 0.0, 0.0, 0.0], 10.0, work, depth, repeats))
            for depth in (1, 2, 4)]


def _row(kind: str, nominal: str, depth: int, baseline: dict, prefetch: dict) -> dict:
    # L and C as measured in the serial baseline: each stage alone, nothing to overlap with
    load, compute = baseline["load"], baseline["compute"]
    step = prefetch["step"]
    return {
        "work": kind, "nominal_L/C_ms": nominal, "depth": depth,
        "L_ms": round(load, 2), "C_ms": round(compute, 2),
        "baseline_ms": round(baseline["step"], 2), "prefetch_ms": round(step, 2),
        "max_ms": round(max(load, compute), 2), "sum_ms": round(load + compute, 2),
        "prefetch_over_max": round(step / max(load, compute), 3),
        "prefetch_over_sum": round(step / (load + compute), 3),
        "speedup": round(baseline["step"] / step, 2),
    }


def print_table(rows: list[dict]) -> None:
    head = ("work", "nominal L/C", "depth", "L", "C", "no-prefetch", "prefetch", "max(L,C)",
            "L+C", "pf/max", "pf/(L+C)", "speedup")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = (r["work"], r["nominal_L/C_ms"], r["depth"], r["L_ms"], r["C_ms"],
                 r["baseline_ms"], r["prefetch_ms"], r["max_ms"], r["sum_ms"],
                 r["prefetch_over_max"], r["prefetch_over_sum"], f'{r["speedup"]}x')
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    args = parser.parse_args()
    load_before = os.getloadavg()  # other users of the machine, before we add our own load
    torch.set_num_threads(1)  # one core per stage: contention is then the machine's, not ours
    ceiling = parallel_ceiling()
    rows = (
        bench_pairs(args.steps, "sleep", args.repeats)
        + bench_pairs(args.steps, "torch", args.repeats)
        + bench_bursty(args.steps, args.repeats)
    )
    print_table(rows)
    print(f"two-thread matmul, concurrent/serial wall time: {ceiling:.2f} (0.5 = two free cores)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {"steps": args.steps, "repeats": args.repeats, "times": "ms per step",
            "cpus": os.cpu_count(), "load_avg_before": load_before,
            "two_thread_concurrent_over_serial": round(ceiling, 3), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine()}
    OUT.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
