"""How well each shuffle mixes a corpus sorted by topic, measured on the planner (no I/O).

The corpus: 64 files x 8 row groups x 2,000 rows, sorted so each run of 32 row groups is one of
16 topics (as data written partitioned by source often is). For batches of 256 rows delivered by
one global worker (of 8), we report
  * distinct row groups per batch (more = more mixing),
  * total-variation distance between a batch's topic histogram and the corpus's (0 = a perfect
    mix, 1 = a batch from one topic only), mean over batches,
against a full shuffle (numpy permutation of every row id), the ceiling no streaming loader reaches
without random access to the whole corpus.

    .venv/bin/python benchmarks/shuffle_quality.py
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from streamshard.batch_plan import StreamSchedule
from streamshard.plan import EpochPlan, Layout, PlanConfig

FILES, GROUPS, ROWS, TOPICS, BATCH, WORKERS = 64, 8, 2_000, 16, 256, 8


def metrics(ids: np.ndarray, rg_of_row: np.ndarray, topic_of_rg: np.ndarray) -> tuple[float, float]:
    usable = len(ids) // BATCH * BATCH
    batches = ids[:usable].reshape(-1, BATCH)
    rgs = rg_of_row[batches]
    distinct = np.mean([len(np.unique(row)) for row in rgs])
    topics = topic_of_rg[rgs]
    hist = np.stack([np.bincount(t, minlength=TOPICS) for t in topics]) / BATCH
    tv = 0.5 * np.abs(hist - 1.0 / TOPICS).sum(axis=1).mean()
    return float(distinct), float(tv)


def main() -> None:
    layout = Layout(np.full(FILES * GROUPS, ROWS, dtype=np.int64), np.repeat(np.arange(FILES), GROUPS).astype(np.int64))
    rg_of_row = np.repeat(np.arange(FILES * GROUPS), ROWS)
    topic_of_rg = np.arange(FILES * GROUPS) * TOPICS // (FILES * GROUPS)
    cases = [
        ("no shuffle", dict(shuffle=False)),
        ("unit=file, rows shuffled", dict(shuffle=True, unit="file")),
        ("unit=file, shuffle_window=4", dict(shuffle=True, unit="file", shuffle_window=4)),
        ("unit=row_group, rows shuffled", dict(shuffle=True)),
        ("unit=row_group, shuffle_window=2", dict(shuffle=True, shuffle_window=2)),
        ("unit=row_group, shuffle_window=4", dict(shuffle=True, shuffle_window=4)),
        ("unit=row_group, shuffle_window=8", dict(shuffle=True, shuffle_window=8)),
        ("unit=row_group, shuffle_window=16", dict(shuffle=True, shuffle_window=16)),
    ]
    results = []
    for name, kwargs in cases:
        plan = EpochPlan(layout, PlanConfig(seed=0, **kwargs), 0, WORKERS)
        start = time.perf_counter()
        ids = StreamSchedule(plan, 0).sample_ids()
        elapsed = time.perf_counter() - start
        distinct, tv = metrics(ids, rg_of_row, topic_of_rg)
        results.append({"case": name, "distinct_row_groups_per_batch": distinct, "topic_tv_distance": tv, "plan_seconds": elapsed})
    full = np.random.default_rng(0).permutation(len(rg_of_row))[: len(rg_of_row) // WORKERS]
    distinct, tv = metrics(full, rg_of_row, topic_of_rg)
    results.append({"case": "full shuffle (numpy, random access)", "distinct_row_groups_per_batch": distinct, "topic_tv_distance": tv, "plan_seconds": None})

    print(f"{'case':40} {'row groups/batch':>17} {'topic TV':>9}")
    for r in results:
        print(f"{r['case']:40} {r['distinct_row_groups_per_batch']:17.1f} {r['topic_tv_distance']:9.3f}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "shuffle_quality.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
