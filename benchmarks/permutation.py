"""Throughput and shuffle quality of streamshard.plan.permutation against numpy.random.permutation.

Run from the repository root:

    .venv/bin/python benchmarks/permutation.py

Prints two tables, writes ``benchmarks/out/permutation.json`` and the markdown section
``benchmarks/out/permutation.md`` (recorded in ``benchmarks/RESULTS.md``). Single-threaded numpy throughout, so this is one core.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import streamshard.plan.permutation as perm_module  # noqa: E402
from streamshard.plan.permutation import Permutation  # noqa: E402

LOOKUPS = 10**7
SIZES = [10**6, 10**9, 2**32 + 1, 10**12]
NUMPY_SIZES = [10**6, 10**8]  # numpy.random.permutation materialises 8 bytes per element
QUALITY_N = 10**6
COMMAND = ".venv/bin/python benchmarks/permutation.py"


def best_of(fn: Callable[[], object], repeats: int = 3) -> tuple[float, float]:
    """Fastest (CPU seconds, wall seconds) of ``repeats`` calls.

    CPU time of this single-threaded process is the "one core" cost even when other jobs share
    the machine; wall time is reported beside it so contention is visible, not hidden.
    """
    cpu, wall = [], []
    for _ in range(repeats):
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    return min(cpu), min(wall)


# -- throughput ------------------------------------------------------------------------------


def throughput_rows() -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for n in SIZES:
        p = Permutation(n, 1)
        ids = rng.integers(0, n, size=LOOKUPS, dtype=np.int64)
        forward, forward_wall = best_of(lambda: p[ids])
        backward, _ = best_of(lambda: p.inverse(ids))
        scalars = [int(i) for i in ids[:20_000]]
        scalar, _ = best_of(lambda: [p[i] for i in scalars], repeats=2)
        rows.append({
            "method": "streamshard.Permutation", "n": n, "domain_ratio": n / 2 ** p_domain_bits(n),
            "forward_M_per_s": LOOKUPS / forward / 1e6,
            "forward_wall_M_per_s": LOOKUPS / forward_wall / 1e6,
            "inverse_M_per_s": LOOKUPS / backward / 1e6,
            "scalar_us": scalar / len(scalars) * 1e6, "memory_bytes": "O(1)",
        })
    dense_n = 10**6
    p = Permutation(dense_n, 1)
    ids = np.arange(dense_n, dtype=np.int64)
    dense, dense_wall = best_of(lambda: p[ids])
    rows.append({
        "method": "streamshard.Permutation, p[arange(n)]", "n": dense_n,
        "domain_ratio": dense_n / 2 ** p_domain_bits(dense_n),
        "forward_M_per_s": dense_n / dense / 1e6, "forward_wall_M_per_s": dense_n / dense_wall / 1e6,
        "inverse_M_per_s": None, "scalar_us": None, "memory_bytes": "O(1)",
    })
    for n in NUMPY_SIZES:
        elapsed, elapsed_wall = best_of(lambda: np.random.default_rng(1).permutation(n), repeats=2)
        rows.append({
            "method": "numpy Generator.permutation (whole array)", "n": n, "domain_ratio": None,
            "forward_M_per_s": n / elapsed / 1e6, "forward_wall_M_per_s": n / elapsed_wall / 1e6,
            "inverse_M_per_s": None, "scalar_us": None, "memory_bytes": 8 * n,
        })
    return rows


def p_domain_bits(n: int) -> int:
    return max(2, (n - 1).bit_length())


# -- quality ---------------------------------------------------------------------------------


def chi_square_z(counts: np.ndarray, sampled_fraction: float = 0.0) -> float:
    """Pearson chi-square against equal cells as a standard normal z (Wilson-Hilferty).

    ``sampled_fraction``: share of the population the counts were drawn from without
    replacement; it shrinks the variance by (1 - fraction), so the statistic is scaled back.
    """
    counts = np.asarray(counts, dtype=np.float64)
    expected = counts.sum() / counts.size
    stat = float(((counts - expected) ** 2 / expected).sum()) / (1 - sampled_fraction)
    df = counts.size - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def single_shuffle_stats(image: np.ndarray, buckets: int = 100, head: int = 100_000) -> dict:
    """Statistics of one permutation of range(n) given as its image array."""
    n = image.size
    ids = np.arange(n, dtype=np.float64)
    landing = np.bincount(image[:head] * buckets // n, minlength=buckets)
    first, second = image[:head:2] * 16 // n, image[1:head:2] * 16 // n
    pairs = np.bincount(first * 16 + second, minlength=256)
    return {
        "spearman_rho": float(np.corrcoef(ids, image.astype(np.float64))[0, 1]),
        "adjacent_kept_fraction": float(np.mean(np.abs(np.diff(image)) == 1)),
        "fixed_points": int(np.sum(image == np.arange(n))),
        "landing_chi2_z": chi_square_z(landing, sampled_fraction=head / n),
        "neighbour_pair_chi2_z": chi_square_z(pairs),
    }


def mean_over_seeds(make_image: Callable[[int], np.ndarray], seeds: int = 10) -> dict:
    """Mean and standard deviation of :func:`single_shuffle_stats` over ``seeds`` permutations."""
    runs = [single_shuffle_stats(make_image(seed)) for seed in range(seeds)]
    summary = {}
    for key in runs[0]:
        values = np.array([run[key] for run in runs], dtype=np.float64)
        summary[key] = float(values.mean())
        summary[key + "_sd"] = float(values.std())
    return summary


def across_seeds_stats(make: Callable[[int, int], Callable[[int], int]], seeds: int) -> dict:
    """Statistics over many seeds: XOR of images of structured input pairs, and tiny-n orders.

    ``make(n, seed)`` returns a function index -> image. Inputs 0 and 64 of n = 2**12 differ only
    in the high half of a Feistel block, where too few rounds leave a differential bias.
    """
    n = 2**12
    xor_high, xor_low, first = [], [], []
    for seed in range(seeds):
        f = make(n, seed)
        xor_high.append(f(0) ^ f(64))
        xor_low.append(f(3) ^ f(4))
        first.append(f(0))
    tiny = {}
    for seed in range(seeds):
        f = make(5, seed)
        order = tuple(f(i) for i in range(5))
        tiny[order] = tiny.get(order, 0) + 1
    tiny_counts = np.array([tiny.get(o, 0) for o in itertools.permutations(range(5))])
    return {
        # XOR of two distinct images is never 0, so cell 0 of the top-8-bit histogram is 1/16
        # short; it is dropped and the remaining 255 cells are exactly equally likely.
        "xor_high_half_chi2_z": chi_square_z(np.bincount(np.array(xor_high) >> 4, minlength=256)[1:]),
        "xor_low_half_chi2_z": chi_square_z(np.bincount(np.array(xor_low) >> 4, minlength=256)[1:]),
        "first_element_chi2_z": chi_square_z(np.bincount(np.array(first) >> 6, minlength=64)),
        "n5_orders_seen": int(np.count_nonzero(tiny_counts)),
        "n5_orders_chi2_z": chi_square_z(tiny_counts),
    }


def streamshard_maker(n: int, seed: int) -> Callable[[int], int]:
    return Permutation(n, seed).__getitem__


def numpy_maker(n: int, seed: int) -> Callable[[int], int]:
    image = np.random.default_rng(seed).permutation(n)
    return lambda i: int(image[i])


def four_round_maker(n: int, seed: int) -> Callable[[int], int]:
    """The same network with only 4 rounds everywhere: shows why 6 are used."""
    saved = perm_module.MIN_ROUNDS, perm_module._ROUND_BUDGET
    perm_module.MIN_ROUNDS, perm_module._ROUND_BUDGET = 4, 0
    try:
        return Permutation(n, seed).__getitem__
    finally:
        perm_module.MIN_ROUNDS, perm_module._ROUND_BUDGET = saved


def quality_rows(seeds: int = 8000) -> list[dict]:
    ids = np.arange(QUALITY_N, dtype=np.int64)
    ours = mean_over_seeds(lambda seed: Permutation(QUALITY_N, seed)[ids])
    theirs = mean_over_seeds(lambda seed: np.random.default_rng(seed).permutation(QUALITY_N))
    return [
        {"method": "streamshard.Permutation", **ours, **across_seeds_stats(streamshard_maker, seeds)},
        {"method": "numpy Generator.permutation", **theirs, **across_seeds_stats(numpy_maker, seeds)},
        {"method": "same Feistel, 4 rounds (ablation)", **across_seeds_stats(four_round_maker, seeds)},
    ]


# -- reporting -------------------------------------------------------------------------------


def fmt(value: object, spec: str) -> str:
    return "-" if value is None or isinstance(value, str) and value == "" else format(value, spec)


def throughput_table(rows: list[dict]) -> list[str]:
    lines = ["| method | n | n / 2^k | forward M idx/s (CPU) | forward M idx/s (wall) |"
             " inverse M idx/s (CPU) | scalar us/call | memory |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        memory = r["memory_bytes"] if isinstance(r["memory_bytes"], str) else f"{r['memory_bytes'] / 2**20:,.0f} MiB"
        lines.append(
            f"| {r['method']} | {r['n']:,} | {fmt(r['domain_ratio'], '.3f')} | {r['forward_M_per_s']:.1f} | "
            f"{r['forward_wall_M_per_s']:.1f} | {fmt(r['inverse_M_per_s'], '.1f')} | "
            f"{fmt(r['scalar_us'], '.1f')} | {memory} |"
        )
    return lines


QUALITY_COLUMNS = [
    ("spearman_rho", "Spearman rho(i, p[i])", "+.5f"),
    ("adjacent_kept_fraction", "neighbours kept adjacent (expect 2e-06)", ".2e"),
    ("fixed_points", "fixed points (expect 1)", ".1f"),
    ("landing_chi2_z", "landing chi2 z", "+.2f"),
    ("neighbour_pair_chi2_z", "(p[2i], p[2i+1]) chi2 z", "+.2f"),
    ("xor_high_half_chi2_z", "XOR p[0]^p[64] over seeds z", "+.2f"),
    ("xor_low_half_chi2_z", "XOR p[3]^p[4] over seeds z", "+.2f"),
    ("first_element_chi2_z", "p[0] over seeds z", "+.2f"),
    ("n5_orders_chi2_z", "n=5: 120 orders over seeds z", "+.2f"),
]


def quality_table(rows: list[dict]) -> list[str]:
    lines = ["| statistic | " + " | ".join(r["method"] for r in rows) + " |",
             "| --- |" + " ---: |" * len(rows)]
    for key, label, spec in QUALITY_COLUMNS:
        cells = [fmt(r.get(key), spec) + (f" ± {fmt(r[key + '_sd'], spec.lstrip('+'))}"
                                          if key + "_sd" in r else "") for r in rows]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(throughput: list[dict], quality: list[dict], path: Path) -> None:
    text = [
        "## Permutation (`streamshard/plan/permutation.py`)",
        "",
        f"Command: `{COMMAND}` (one core, numpy {np.__version__}, Python {platform.python_version()},"
        f" {platform.machine()}; a 2-core machine shared with other jobs, so rates are best of 3"
        " by CPU time, with wall time beside them).",
        "",
        f"Throughput: {LOOKUPS:,} random int64 indices per call (n / 2^k is the share of the"
        " Feistel domain inside range(n); the rest is cycle-walked); `p[arange(n)]` is the"
        " planner's dense call. numpy materialises the whole permutation, so its rate is"
        " n / time and it only runs where 8n bytes fit.",
        "",
        *throughput_table(throughput),
        "",
        f"Quality: single-permutation statistics on n = {QUALITY_N:,}, mean ± sd over seeds 0..9"
        " (landing: where indices 0..99,999 fall in 100 equal buckets; pairs: 16x16 buckets of"
        " (p[2i], p[2i+1]) for i < 50,000), and across-seed statistics from 8,000 seeds (n = 4,096"
        " and n = 5; the XOR rows bucket the top 8 bits of p[a] ^ p[b]). z is a chi-square turned"
        " into a standard normal: |z| < 3 is consistent with a uniform random permutation.",
        "",
        *quality_table(quality),
        "",
        "Reading the numbers:",
        "",
        "- Rates are CPU time of one single-threaded process; wall-clock rates are lower only"
        " because other jobs shared the 2 cores during the run.",
        "- n = 2**32 + 1 is the worst case for a power-of-two Feistel domain: just under half of"
        " 2**33 lies in range(n), so an index needs two passes on average and the rate halves."
        " Sizes whose domain is mostly in range (10**6, 10**9, 10**12) run at the full rate.",
        "- Scalar access is pure Python integer arithmetic (a few microseconds, O(1) expected);"
        " it is tested to equal the vectorised result.",
        "- The ablation column is the same network with 4 rounds: its XOR of two inputs that"
        " differ in the high half is biased, and tiny ranges are far from uniform over seeds."
        " 6 rounds (more for domains under 2**10) remove both at this sample size.",
        "- A Feistel network with at least 2-bit halves only produces even permutations of its"
        " 2**k domain, so when n is a power of two (>= 16) only half of all orders are reachable;"
        " no statistic here (or any a training run depends on) can see that.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(text))


def main() -> None:
    throughput = throughput_rows()
    print("\n".join(throughput_table(throughput)), flush=True)
    quality = quality_rows()
    print()
    print("\n".join(quality_table(quality)))
    out = ROOT / "benchmarks" / "out" / "permutation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": COMMAND, "throughput": throughput, "quality": quality}, indent=2))
    write_markdown(throughput, quality, ROOT / "benchmarks" / "out" / "permutation.md")
    print(f"\nwrote {out.relative_to(ROOT)} and benchmarks/out/permutation.md (the section recorded in benchmarks/RESULTS.md)")


if __name__ == "__main__":
    main()
