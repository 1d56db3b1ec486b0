"""Where a worker starts: a loaded position + the current topology -> its schedule and first batch.

Pure (no I/O, no torch). A position is what a state records: the batches per rank consumed this
epoch under each topology (``history``), and, for a per-worker state (torchdata's
``StatefulDataLoader`` saves one per worker), that worker's own count. The stream mode folds
every earlier topology into the remaining stream (``plan/elastic.py``) and plans it for the current
one; ``partitions=`` continues at the same global step on any compatible topology.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .batch_plan import Schedule, StreamSchedule
from .canonical import CanonicalPlan
from .elastic import Segment, remaining_stream, resume_plan, worker_batches_delivered
from ..errors import StateError
from .epoch_plan import EpochPlan, Layout, PlanConfig
from .topology import Topology


@dataclass(frozen=True)
class WorkerPosition:
    """A per-worker state: worker ``worker_id`` of rank ``rank`` played ``role`` and delivered ``batches``."""

    world_size: int
    num_workers: int
    rank: int
    worker_id: int
    role: int
    batches: int


@dataclass(frozen=True)
class Position:
    """How far an epoch got: rank-level history, or (``worker``) one worker's progress."""

    epoch: int
    history: list[Segment] = field(default_factory=list)  # rank states: the current topology's segment last
    worker: WorkerPosition | None = None  # worker states: history holds the completed segments only

    @property
    def fresh(self) -> bool:
        """The epoch's beginning: nothing consumed yet, by any topology or worker."""
        return not self.history and self.worker is None


@dataclass(frozen=True)
class Start:
    """A worker's schedule and the number of its batches already delivered."""

    schedule: Schedule
    start: int
    role: int
    history: list[Segment]  # segments completed under earlier topologies
    worker_id: int = 0  # the DataLoader (or thread) worker of this rank that runs it


def check_pinned(pinned: WorkerPosition, rank: int, world_size: int, worker_id: int, num_workers: int) -> None:
    """A per-worker state resumes only the worker that saved it, on its topology (``StateError`` otherwise)."""
    if (pinned.world_size, pinned.num_workers, pinned.rank) != (world_size, num_workers, rank):
        raise StateError(
            "a per-worker state (torchdata's StatefulDataLoader) resumes only on the topology that saved it: "
            f"saved on rank {pinned.rank} of {pinned.world_size} with num_workers={pinned.num_workers}, loaded on "
            f"rank {rank} of {world_size} with num_workers={num_workers}; use ss.StreamLoader to resume elsewhere"
        )
    if pinned.worker_id != worker_id:
        raise StateError(f"the state of worker {pinned.worker_id} was loaded into worker {worker_id}")


@dataclass(frozen=True)
class Planner:
    """Everything that decides an epoch's order, for one dataset."""

    layout: Layout
    config: PlanConfig
    partitions: int | None

    def split(self, position: Position | None, world_size: int, num_workers: int) -> tuple[list[Segment], int]:
        """(segments completed under other topologies, batches per rank consumed under this one)."""
        if position is None:
            return [], 0
        history = list(position.history)
        if position.worker is not None:
            return history, 0
        last = history[-1] if history else None
        if last is not None and (last.world_size, last.num_workers) == (world_size, num_workers):
            return history[:-1], last.batches
        return history, 0

    def begin(self, position: Position | None, rank: int, world_size: int, worker_id: int, num_workers: int
              ) -> tuple[list[Segment], int, WorkerPosition | None]:
        """``split``, and the per-worker state ``position`` holds, checked against this worker
        (``check_pinned``): what every planner's ``start`` begins with."""
        history, before = self.split(position, world_size, num_workers)
        pinned = position.worker if position is not None else None
        if pinned is not None:
            check_pinned(pinned, rank, world_size, worker_id, num_workers)
        return history, before, pinned

    def start(self, epoch: int, position: Position | None, rank: int, world_size: int, worker_id: int,
              num_workers: int) -> Start:
        """The schedule of DataLoader worker ``worker_id`` and where it begins."""
        history, before, pinned = self.begin(position, rank, world_size, worker_id, num_workers)
        n = max(num_workers, 1)
        if pinned is not None:
            role, skip = pinned.role, pinned.batches
        if self.partitions is not None:
            plan = CanonicalPlan(self.layout, self.config, epoch, self.partitions, world_size, num_workers)
            if pinned is None:
                if any(max(s.num_workers, 1) != n for s in history):
                    raise StateError(
                        f"partitions= needs the same number of DataLoader workers on resume ({n} now, "
                        f"{[s.num_workers for s in history]} before); use partitions=None for elastic resume "
                        "across worker counts"
                    )
                before += sum(s.batches for s in history)  # global steps: the same count on every topology
                role = (worker_id + before) % n
                skip = worker_batches_delivered(before, num_workers, role)
            return Start(plan.schedule(plan.owned(rank, role)), skip, role, history, worker_id)
        if pinned is None:
            epoch_plan, before = self._stream_plan(epoch, history, before, world_size, num_workers)
            # A restarted loader starts its round robin at worker 0, where the uninterrupted run would
            # continue at worker `before % n`: worker w takes over the role of that one.
            role = (worker_id + before) % n
            skip = worker_batches_delivered(before, num_workers, role)
        else:
            epoch_plan, _ = resume_plan(self.layout, self.config, epoch, history, world_size, num_workers)
        worker = Topology(rank, world_size, role, num_workers).global_worker_id
        return Start(StreamSchedule(epoch_plan, worker), skip, role, history, worker_id)

    def rank_batches(self, epoch: int, position: Position | None, world_size: int, num_workers: int) -> int:
        """Batches a rank yields from ``position`` to the end of the epoch (all ranks alike)."""
        history, before = self.split(position, world_size, num_workers)
        n = max(num_workers, 1)
        if self.partitions is not None:
            plan = CanonicalPlan(self.layout, self.config, epoch, self.partitions, world_size, num_workers)
            return max(plan.steps * n - before - sum(s.batches for s in history), 0)
        epoch_plan, before = self._stream_plan(epoch, history, before, world_size, num_workers)
        return epoch_plan.steps * n - before

    def _stream_plan(self, epoch: int, history: list[Segment], before: int, world_size: int,
                     num_workers: int) -> tuple[EpochPlan, int]:
        """The plan of the current topology after ``history``, and the batches per rank it already delivered."""
        full = history + ([Segment(world_size, num_workers, before)] if before else [])
        return resume_plan(self.layout, self.config, epoch, full, world_size, num_workers)

    def check(self, position: Position) -> None:
        """Refuse a position whose counts do not fit this dataset (``StateError`` naming the segment)."""
        stream = None
        segments = position.history
        for i, segment in enumerate(segments):
            if self.partitions is not None:
                plan = CanonicalPlan(self.layout, self.config, position.epoch, self.partitions,
                                     segment.world_size, segment.num_workers)
                limit = plan.steps * max(segment.num_workers, 1)
            else:
                epoch_plan = EpochPlan(self.layout, self.config, position.epoch, segment.global_workers, stream)
                limit = epoch_plan.steps * max(segment.num_workers, 1)
            if segment.batches > limit:
                raise StateError(
                    f"state['history'][{i}] says a rank consumed {segment.batches} batches under "
                    f"{segment.world_size} ranks x {segment.num_workers} workers, but that epoch has {limit} per rank"
                )
            if self.partitions is None and i < len(segments) - 1:
                stream = remaining_stream(epoch_plan, segment)
        worker = position.worker
        if worker is not None:
            n = max(worker.num_workers, 1)
            if not (worker.rank < worker.world_size and worker.worker_id < n and worker.role < n):
                raise StateError(f"per-worker state has rank/worker/role outside its topology: {worker}")
