"""``streamshard plan``: rows, batches and padding of each global worker for one epoch and topology.

A pure preview: the catalog (footers only) and ``EpochPlan``, the same plan every
``ParquetStream`` worker computes, under both uneven policies so their cost can be compared.
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

import numpy as np

from ..io.catalog import Catalog
from ..plan.epoch_plan import UNEVEN_POLICIES, EpochPlan, PlanConfig
from .inspect import spread
from ..progress import progress_bar


def run_plan(args: argparse.Namespace, err: TextIO) -> dict[str, Any]:
    """Each global worker's rows, batches and padding for the epoch, under both uneven policies."""
    with progress_bar(err, total=None, unit="footers", desc="catalog", quiet=args.quiet) as footers:
        catalog = Catalog.build(args.urls, args.columns, args.storage_options, progress=footers.update,
                                partitioning=None if args.partitioning == "none" else args.partitioning)
    workers = args.world_size * max(args.num_workers, 1)
    plans = {
        policy: EpochPlan(
            catalog.layout,
            PlanConfig(unit=args.unit, shuffle=args.shuffle, seed=args.seed, batch_size=args.batch_size, uneven=policy),
            args.epoch,
            workers,
        )
        for policy in UNEVEN_POLICIES
    }
    per_policy = {policy: _worker_rows(plan, args.num_workers) for policy, plan in plans.items()}
    chosen = per_policy[args.uneven]
    rows = np.array([w["rows"] for w in chosen], dtype=np.int64)
    return {
        "rows": catalog.num_rows,
        "files": catalog.num_files,
        "row_groups": catalog.num_row_groups,
        "world_size": args.world_size,
        "num_workers": args.num_workers,
        "global_workers": workers,
        "unit": args.unit,
        "batch_size": args.batch_size,
        "shuffle": args.shuffle,
        "seed": args.seed,
        "epoch": args.epoch,
        "uneven": args.uneven,
        "steps_per_worker": plans[args.uneven].steps,
        "steps_per_rank": plans[args.uneven].steps * max(args.num_workers, 1),
        "workers": chosen,
        "balance": {
            "rows": spread(rows),
            "rows_max_over_mean": float(rows.max() / rows.mean()) if rows.sum() else 1.0,
        },
        "uneven_cost": {policy: _cost(plans[policy], per_policy[policy]) for policy in UNEVEN_POLICIES},
    }


def _worker_rows(plan: EpochPlan, num_workers: int) -> list[dict[str, int]]:
    begin, end = plan.block_bounds(np.arange(plan.num_workers))
    per_rank = max(num_workers, 1)
    out = []
    for g in range(plan.num_workers):
        work = plan.worker_plan(g)
        padding_batches = work.steps - work.real_batches
        out.append({
            "global_worker": g,
            "rank": g // per_rank,
            "worker": g % per_rank,
            "pieces": len(work.pieces),
            "rows": work.rows,
            "batches": work.steps,
            "real_batches": work.real_batches,
            "padding_batches": padding_batches,
            "padding_rows": _padding_rows(plan, work, padding_batches),
            "dropped_rows": int(end[g] - begin[g]) - work.rows,
        })
    return out


def _padding_rows(plan: EpochPlan, work: Any, padding_batches: int) -> int:
    """Padding rows ParquetStream yields: a topped-up last batch plus padding batches."""
    bs = plan.config.batch_size
    if bs is not None:
        return work.steps * bs - work.rows
    if padding_batches == 0:
        return 0
    # Padding batches copy the shape of the worker's last batch (or an even share if it has none).
    rows = int(work.pieces.rows[-1]) if len(work.pieces) else max(1, -(-plan.total_rows // plan.num_workers))
    return padding_batches * rows


def _cost(plan: EpochPlan, workers: list[dict[str, int]]) -> dict[str, int]:
    batches = sum(w["batches"] for w in workers)
    padding = sum(w["padding_batches"] for w in workers)
    return {
        "steps_per_worker": plan.steps,
        "batches": batches,
        "padding_batches": padding,
        "padding_rows": sum(w["padding_rows"] for w in workers),
        "dropped_rows": plan.dropped_rows(),
        "delivered_rows": sum(w["rows"] for w in workers),
    }


def render_plan(r: dict[str, Any], args: argparse.Namespace) -> str:
    """The ``plan`` report ``r`` as text for a terminal (``--json`` prints ``r`` itself)."""
    show = args.show
    bs = r["batch_size"] if r["batch_size"] is not None else "one per row-group slice"
    lines = [
        f"{r['rows']:,} rows in {r['files']} files / {r['row_groups']} row groups",
        f"{r['world_size']} rank(s) x {max(r['num_workers'], 1)} worker(s) = {r['global_workers']} global workers; "
        f"unit={r['unit']} batch_size={bs} shuffle={r['shuffle']} seed={r['seed']} epoch={r['epoch']} uneven={r['uneven']}",
        f"steps: {r['steps_per_worker']} per global worker, {r['steps_per_rank']} per rank (DataLoader batches)",
        "",
        f"{'worker':>8} {'rank':>5} {'w':>3} {'pieces':>7} {'rows':>10} {'batches':>8} {'padding':>8} {'pad rows':>9} {'dropped':>8}",
    ]
    workers = r["workers"]
    shown = workers if len(workers) <= show else workers[: show // 2] + [None] + workers[-(show - show // 2):]
    for w in shown:
        if w is None:
            lines.append(f"{'...':>8}  ({len(workers) - show} more)")
            continue
        lines.append(
            f"{w['global_worker']:>8} {w['rank']:>5} {w['worker']:>3} {w['pieces']:>7} {w['rows']:>10,} "
            f"{w['batches']:>8} {w['padding_batches']:>8} {w['padding_rows']:>9,} {w['dropped_rows']:>8,}"
        )
    rows = r["balance"]["rows"]
    lines += [
        "",
        f"rows per worker: min {rows['min']:,} / median {rows['median']:,.0f} / max {rows['max']:,}"
        f"  (max/mean {r['balance']['rows_max_over_mean']:.3f})",
        "what uneven costs this epoch:",
    ]
    for policy, c in r["uneven_cost"].items():
        mark = "*" if policy == r["uneven"] else " "
        share = c["padding_batches"] / c["batches"] if c["batches"] else 0.0
        lines.append(
            f" {mark} {policy:<4} {c['steps_per_worker']} steps/worker, {c['padding_batches']:,} padding batches "
            f"({share:.1%}), {c['padding_rows']:,} padding rows, {c['dropped_rows']:,} dropped rows"
        )
    return "\n".join(lines) + "\n"
