"""How well each shuffle mixes a corpus sorted by topic, measured on the planner (no I/O).

Two corpora of 32 files x 8 row groups, each file one topic (as data written partitioned by source
often is): *uniform* row groups of 1,000 rows, and *skewed* ones of 3..4,096 rows (uniformly drawn,
seed 1), like real exports. For batches of 256 rows delivered by every global worker of
2 ranks x 2 workers, we report
  * the mean share of a batch taken by its most common file (1.0 = every batch from one file),
  * the fraction of batches drawn from a single file,
  * distinct row groups per batch,
  * the most decoded row groups a worker held at once for the mixing (one shuffle window; read-ahead
    adds its own ``read_ahead``), and the most rows, as a multiple of ``shuffle_window`` average row
    groups ("rows held"; a window grows past ``shuffle_window`` pieces when one would dominate it),
  * the row groups read per row group of the corpus (1.0 = no extra bytes),
against a full shuffle (a numpy permutation of every row id, cut the same way), the ceiling no
streaming loader reaches without random access to the whole corpus.

    .venv/bin/python benchmarks/shuffle_quality.py
"""

from __future__ import annotations

import json
import os

import numpy as np

from streamshard.plan.batch_plan import StreamSchedule
from streamshard.plan.epoch_plan import EpochPlan, Layout, PlanConfig

FILES, GROUPS, ROWS, BATCH, RANKS, WORKERS = 32, 8, 1_000, 256, 2, 2
GLOBAL = RANKS * WORKERS


def metrics(batches: list[np.ndarray], file_of_row: np.ndarray, rg_of_row: np.ndarray) -> dict[str, float]:
    top_share, single, distinct = [], 0, []
    for ids in batches:
        counts = np.bincount(file_of_row[ids], minlength=FILES)
        top_share.append(counts.max() / len(ids))
        single += int(np.count_nonzero(counts) == 1)
        distinct.append(len(np.unique(rg_of_row[ids])))
    return {"top_file_share": float(np.mean(top_share)), "single_file_batches": single / len(batches),
            "row_groups_per_batch": float(np.mean(distinct))}


def evaluate(rows: np.ndarray) -> list[dict]:
    """Every case on the corpus of ``rows`` per row group (32 files x 8 row groups, one topic per file)."""
    layout = Layout(rows.astype(np.int64), np.repeat(np.arange(FILES), GROUPS).astype(np.int64))
    rg_of_row = np.repeat(np.arange(FILES * GROUPS), rows)
    file_of_row = rg_of_row // GROUPS
    cases = [("no shuffle", dict(shuffle=False))]
    cases += [(f"unit=file, shuffle_window={w}", dict(shuffle=True, unit="file", shuffle_window=w)) for w in (1, 8)]
    cases += [(f"unit=row_group, shuffle_window={w}", dict(shuffle=True, shuffle_window=w)) for w in (1, 2, 4, 8, 16, 32)]
    results = []
    for name, kwargs in cases:
        plan = EpochPlan(layout, PlanConfig(seed=0, batch_size=BATCH, **kwargs), 0, GLOBAL)
        batches, reads, held, held_rows = [], 0, 0, 0
        for worker in range(GLOBAL):
            schedule = StreamSchedule(plan, worker)
            for spec in schedule.batches():
                if spec.rows == BATCH:  # full batches only: a worker's short last one says nothing
                    batches.append(spec.sample_id)
            reads += len(schedule.pieces)
            held = max(held, int(np.diff(schedule.window_first).max(initial=0)))
            held_rows = max(held_rows, int(np.diff(schedule.window_start).max(initial=0)))
        window = kwargs.get("shuffle_window", 1)
        results.append({"case": name, **metrics(batches, file_of_row, rg_of_row),
                        "row_groups_held": held,  # the most pieces of row groups one window held
                        "rows_held_vs_window_of_mean_groups": held_rows / (window * rows.mean()),
                        "reads_per_row_group": reads / (FILES * GROUPS)})
    perm = np.random.default_rng(0).permutation(len(rg_of_row))
    full = [perm[i : i + BATCH] for i in range(0, len(perm) - BATCH + 1, BATCH)]
    results.append({"case": "full shuffle (numpy, random access)", **metrics(full, file_of_row, rg_of_row),
                    "row_groups_held": FILES * GROUPS, "rows_held_vs_window_of_mean_groups": None,
                    "reads_per_row_group": None})
    return results


def report(title: str, results: list[dict]) -> None:
    reference = results[-1]["top_file_share"]
    print(f"{title}: {FILES} files x {GROUPS} row groups, one topic per file; batch {BATCH}, "
          f"{RANKS} ranks x {WORKERS} workers")
    print(f"{'case':38} {'top-file share':>14} {'vs full':>8} {'1-file batches':>15} {'rgs/batch':>10} "
          f"{'rgs held':>9} {'rows held':>10} {'reads/rg':>9}")
    for r in results:
        r["vs_full_shuffle"] = r["top_file_share"] / reference
        reads = "-" if r["reads_per_row_group"] is None else f"{r['reads_per_row_group']:.2f}"
        held = r["rows_held_vs_window_of_mean_groups"]
        held = "-" if held is None else f"{held:.2f}"
        print(f"{r['case']:38} {r['top_file_share']:14.3f} {r['vs_full_shuffle']:7.1f}x "
              f"{r['single_file_batches']:15.1%} {r['row_groups_per_batch']:10.1f} {r['row_groups_held']:9} "
              f"{held:>10} {reads:>9}")


def main() -> None:
    corpora = {
        f"uniform ({ROWS:,} rows per row group)": np.full(FILES * GROUPS, ROWS, dtype=np.int64),
        "skewed (3..4,096 rows per row group)": np.random.default_rng(1).integers(3, 4097, FILES * GROUPS),
    }
    out = {}
    for title, rows in corpora.items():
        out[title] = evaluate(rows)
        report(title, out[title])
        print()
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "shuffle_quality.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
