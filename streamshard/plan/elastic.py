"""Pure resume arithmetic: what an interrupted epoch consumed, and the stream of what remains.

Progress is recorded per *rank*, as the number of batches a rank's DataLoader delivered. In
synchronous data-parallel training every rank consumed the same count k, and a DataLoader with
N workers hands out batches round-robin (worker ``j % N`` delivers the rank's batch ``j``), so
k alone says how many batches every global worker delivered. Each worker delivers its block in
order, so what it consumed is a prefix of its pieces and what remains is the rest; the rests of
all workers, in worker order, form the stream of the remaining epoch, which any topology can
plan again. Folding over a list of ``(world_size, num_workers, batches)`` segments handles any
number of resizes in one epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .epoch_plan import EpochPlan, Layout, PlanConfig, Pieces


@dataclass(frozen=True)
class Segment:
    """``batches`` batches per rank were consumed under ``world_size`` ranks x ``num_workers`` workers."""

    world_size: int
    num_workers: int
    batches: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_workers < 0 or self.batches < 0:
            raise ValueError(f"invalid progress segment {self}")

    @property
    def global_workers(self) -> int:
        return self.world_size * max(self.num_workers, 1)


def worker_batches_delivered(rank_batches: int, num_workers: int, worker_id: int) -> int:
    """Batches DataLoader worker ``worker_id`` delivered when its rank delivered ``rank_batches``."""
    n = max(num_workers, 1)
    return max(0, (rank_batches + n - 1 - worker_id) // n)


def rows_delivered(plan: EpochPlan, worker: int, batches: int) -> int:
    """Rows (not counting padding) in the first ``batches`` batches of global worker ``worker``."""
    work = plan.worker_plan(worker)
    if plan.config.batch_size is None:
        return int(work.pieces.rows[: min(batches, work.real_batches)].sum())
    return min(batches * plan.config.batch_size, work.rows)


def remaining_stream(plan: EpochPlan, segment: Segment) -> Pieces:
    """The stream of rows ``plan`` had not delivered after ``segment``, in global-worker order."""
    if segment.global_workers != plan.num_workers:
        raise ValueError(f"segment {segment} does not match a plan of {plan.num_workers} global workers")
    n = max(segment.num_workers, 1)
    if segment.batches > plan.steps * n:
        raise ValueError(
            f"a rank cannot have consumed {segment.batches} batches: an epoch has {plan.steps * n} per rank"
        )
    rests = []
    for worker in range(plan.num_workers):
        done = worker_batches_delivered(segment.batches, segment.num_workers, worker % n)
        kept = plan.worker_plan(worker).pieces  # what this topology delivers ("drop" cuts the end off)
        counts = plan.delivered_counts(kept, rows_delivered(plan, worker, done))
        # The rest of the whole block: rows this topology would have dropped at its end are not
        # lost in a resize; only the final topology's equal steps drop anything (and report it).
        block = plan.pieces(worker)
        taken = np.zeros(len(block), dtype=np.int64)
        taken[: len(counts)] = counts
        rest = Pieces(block.rg, block.lo + taken, block.hi)
        rests.append(rest.take(rest.rows > 0))
    return Pieces.concat(rests)


def resume_plan(
    layout: Layout, config: PlanConfig, epoch: int, history: Sequence[Segment], world_size: int, num_workers: int
) -> tuple[EpochPlan, int]:
    """The plan for the current topology after ``history``, and the batches per rank already consumed in it.

    Segments recorded under the current topology continue where they stopped (the returned count);
    a segment under another topology is folded into the remaining stream and planning restarts.
    """
    global_workers = world_size * max(num_workers, 1)
    stream: Pieces | None = None
    for i, segment in enumerate(history):
        plan = EpochPlan(layout, config, epoch, segment.global_workers, stream)
        last = i == len(history) - 1
        if last and (segment.world_size, segment.num_workers) == (world_size, num_workers):
            return plan, segment.batches
        stream = remaining_stream(plan, segment)
    return EpochPlan(layout, config, epoch, global_workers, stream), 0
