"""A packed text epoch planned in stages, so a plan never needs the token counts of stages it has not reached.

Pure (numpy only; counting is a callable handed in). Packing raw text plans by tokens, and a text's
tokens are only known by tokenizing it (``io/text_counts.py``). Planning the whole epoch at once needs
the whole corpus counted before the first step. Here the epoch's unit order (fixed by seed and epoch,
from the catalog alone: ``plan.stream_order`` over the documents) is cut into *stages* of growing
size (``Stages.split``: the first small enough to count in seconds, each next one ``growth`` times
larger), and the epoch is planned stage after stage:

* plan ``j`` holds the tokens carried over from plan ``j - 1`` followed by stage ``j``'s tokens, cut
  down to a multiple of ``global workers x batch tokens``; each global worker gets an equal block of
  it, so every worker fills the same number of *full* batches (no padding), and the leftover tokens
  (fewer than one batch per worker) are carried into plan ``j + 1``;
* the last plan takes everything left and pads as a one-shot plan does (only each worker's last batch).

So the token stream is the same as one plan of the whole epoch would deliver (every token once, each
document's tokens in order, the same unit order), equal steps hold for every plan, and padding is
bounded as for one plan (under one batch per global worker per epoch), whatever the number of stages.
Plan ``j`` needs only the counts of stages ``0..j``: ``StageCounts`` asks for a stage's counts when a
plan first needs them. A warm start (all counts known) builds the very same plans, so it gives the
same batches as a cold one.

Resume: the rank-level history of an epoch (``elastic.Segment``: batches per rank under each
topology) is folded as in ``plan/elastic.py``: batches of a topology walk its plans; the tokens not yet
delivered of the plan it stopped in (in global-worker order) plus that plan's carry become the
*head* of the rest (``Rest``), followed by the stages not yet planned, whole; another topology plans
that rest the same way (head first, as a stage of its own). Resuming on the same topology continues
its plans with the batches skipped, so it gives the uninterrupted run's batches.

A stage plan's ``EpochPlan`` is built over a token layout in which uncounted row groups hold 0 tokens:
its specs' ``sample_id`` (token offsets in catalog order) are exact only once every stage is counted;
packing ignores them (documents' ids come from the source rows).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .batch_plan import BatchSpec, Read, Schedule, StreamSchedule
from .elastic import Segment, remaining_stream, worker_batches_delivered
from ..errors import StateError
from .epoch_plan import EpochPlan, Layout, PlanConfig, Pieces
from .resume import Planner, Position, Start
from .topology import Topology

UNKNOWN = -1
_KEY_STRIDE = 1 << 40  # read keys of plan j are its schedule's keys + j * stride (unique within a worker)


@dataclass(frozen=True)
class Stages:
    """An epoch's units (row groups, catalog indices) in stream order, cut into stages."""

    order: np.ndarray  # int64: units in the epoch's stream order
    bounds: np.ndarray  # int64: stage k holds order[bounds[k]:bounds[k + 1]]

    @classmethod
    def split(cls, order: np.ndarray, weights: np.ndarray, first: float, growth: float = 2.0) -> "Stages":
        """Stage ``k`` takes the next units until their ``weights`` (per unit, catalog order: what
        counting costs, e.g. the text column's bytes) reach ``first * growth**k``; at least one unit."""
        if not first > 0 or not growth >= 1:
            raise ValueError(f"stages need first > 0 and growth >= 1, got first={first!r}, growth={growth!r}")
        order = np.asarray(order, dtype=np.int64)
        cum = np.cumsum(np.asarray(weights, dtype=np.float64)[order])
        bounds, size, n = [0], float(first), len(order)
        while bounds[-1] < n:
            start = bounds[-1]
            before = float(cum[start - 1]) if start else 0.0
            end = int(np.searchsorted(cum, before + size, side="left")) + 1
            bounds.append(min(max(end, start + 1), n))
            size *= growth
        return cls(order, np.asarray(bounds, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def units(self, k: int) -> np.ndarray:
        return self.order[self.bounds[k]:self.bounds[k + 1]]


class StageCounts:
    """Tokens per unit (catalog order), filled in a stage at a time when a plan first needs it.

    ``count(units)`` returns the tokens of ``units`` (it may take long: it tokenizes); ``known``
    holds counts already at hand (a warm cache), ``UNKNOWN`` elsewhere. Thread-safe: a unit is
    counted once, and whoever needs it meanwhile waits. Shared by the epochs (their stages differ).
    Units being counted elsewhere (``claimed``: split over the ranks by a counting thread) are waited
    for, not counted again."""

    def __init__(self, rg_file: np.ndarray, count: Callable[[np.ndarray], np.ndarray],
                 known: np.ndarray | None = None) -> None:
        self.rg_file, self._count = rg_file, count
        self.tokens = np.full(len(rg_file), UNKNOWN, dtype=np.int64) if known is None else known.astype(np.int64)
        self._lock, self._pid = threading.Lock(), os.getpid()
        self._claims: list[tuple[np.ndarray, threading.Event]] = []

    @contextmanager
    def claimed(self, units: np.ndarray) -> Iterator[None]:
        """While inside, ``of`` waits for ``units`` (being counted elsewhere, then ``fill``-ed) instead
        of counting them itself; whoever claims must leave, however its count ends (a failed one:
        ``of`` then counts what is still missing)."""
        entry = (np.asarray(units, dtype=np.int64), threading.Event())
        self._claims.append(entry)
        try:
            yield
        finally:
            self._claims.remove(entry)
            entry[1].set()

    def _wait_for_claims(self, units: np.ndarray) -> None:
        if self._pid != os.getpid():  # a forked child: the claimer is a thread it lacks
            self._lock, self._pid, self._claims = threading.Lock(), os.getpid(), []
        for claim, done in list(self._claims):
            if np.isin(units, claim).any():
                done.wait()

    def counted(self, units: np.ndarray) -> bool:
        return bool((self.tokens[units] >= 0).all())

    def fill(self, units: np.ndarray, tokens: np.ndarray) -> None:
        """Counts obtained elsewhere (a count split over the ranks); units already counted keep theirs.
        Not behind the counting lock (a count of a later stage may be running): a unit's count is the
        same whoever writes it."""
        self.tokens[units] = np.where(self.tokens[units] >= 0, self.tokens[units], tokens)

    def of(self, units: np.ndarray) -> np.ndarray:
        """Tokens of ``units`` (counted now where not yet)."""
        have = self.tokens[units]
        if (have >= 0).all():  # counted: no wait behind a stage being counted
            return have
        self._wait_for_claims(units)
        with self._held():
            missing = units[self.tokens[units] < 0]
            if missing.size:
                got = np.asarray(self._count(missing), dtype=np.int64)
                if got.shape != missing.shape or (got < 0).any():
                    raise ValueError(f"counting gave {got!r} for {len(missing)} row groups")
                self.tokens[missing] = got
            return self.tokens[units].copy()

    def _held(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked child: the lock may have been held by a thread it lacks
            self._lock, self._pid = threading.Lock(), os.getpid()
        return self._lock

    def layout(self) -> Layout:
        """The token layout as far as counted (uncounted units: 0 tokens)."""
        return Layout(np.maximum(self.tokens, 0), self.rg_file)


class CountedStages:
    """A text corpus's epoch as the source of ``StagePlans``: stage ``k``'s stream is its units' tokens,
    counted when first asked for. (``plan/blend_stages.py`` is the other source: a packed blend's positions.)"""

    def __init__(self, stages: Stages, counts: StageCounts) -> None:
        self.stages, self.counts = stages, counts

    def __len__(self) -> int:
        return len(self.stages)

    def stream(self, k: int) -> Pieces:
        """Stage ``k``'s tokens, unit after unit (counted now where not yet)."""
        units = self.stages.units(k)
        tokens = self.counts.of(units)
        keep = tokens > 0
        return Pieces(units[keep], np.zeros(int(keep.sum()), dtype=np.int64), tokens[keep])

    def ready(self, k: int) -> bool:
        """Whether stage ``k``'s stream is at hand without counting."""
        return self.counts.counted(self.stages.units(k))

    def layout(self) -> Layout:
        return self.counts.layout()


@dataclass(frozen=True)
class Rest:
    """What an epoch has left: ``head`` (counted tokens, in order), then stages ``stage..`` whole."""

    head: Pieces = field(default_factory=Pieces.empty)
    stage: int = 0


def _split_rows(pieces: Pieces, n: int) -> tuple[Pieces, Pieces]:
    """``pieces`` cut after their first ``n`` rows: (first, rest), empty pieces left out."""
    ends = np.cumsum(pieces.rows)
    taken = np.clip(n - (ends - pieces.rows), 0, pieces.rows)
    first = Pieces(pieces.rg, pieces.lo, pieces.lo + taken)
    rest = Pieces(pieces.rg, pieces.lo + taken, pieces.hi)
    return first.take(first.rows > 0), rest.take(rest.rows > 0)


class StagePlans:
    """The plans of ``global_workers`` workers over ``rest`` of an epoch, built one at a time when asked.

    ``stages``: a text epoch's ``Stages`` with their ``counts``, or (``counts`` None) any staged source
    with ``len``, ``stream(k)`` (stage ``k``'s rows as ``Pieces``), ``ready(k)`` and ``layout()``,
    such as a packed blend's positions (``plan/blend_stages.py``)."""

    def __init__(self, stages: Stages | Any, counts: StageCounts | None, config: PlanConfig, epoch: int,
                 global_workers: int, rest: Rest | None = None) -> None:
        if config.batch_size is None or config.uneven != "pad" or config.shuffle_window != 1:
            raise ValueError("stage plans are for packed tokens: an int batch size, uneven='pad', no shuffle window")
        self.source = CountedStages(stages, counts) if counts is not None else stages
        self.config, self.epoch = config, epoch
        self.global_workers = global_workers
        self.rest = rest if rest is not None else Rest()
        has_head = len(self.rest.head) > 0
        # The stage each stream comes from (None: the head).
        self.sources: list[int | None] = ([None] if has_head else []) + list(range(self.rest.stage, len(self.source)))
        self.plans: list[EpochPlan] = []
        self.carries: list[Pieces] = [Pieces.empty()]  # carries[j]: tokens carried into plan j
        self.starts = [0]  # starts[j]: batches per worker before plan j
        self._lock = threading.Lock()

    def _stream(self, i: int) -> Pieces:
        k = self.sources[i]
        return self.rest.head if k is None else self.source.stream(k)

    def plan(self, j: int) -> EpochPlan | None:
        """Plan ``j`` (built now, with its stage counted, if not yet); None past the last."""
        with self._lock:
            while len(self.plans) <= j and len(self.plans) < len(self.sources):
                i = len(self.plans)
                stream = Pieces.concat([self.carries[i], self._stream(i)])
                total = int(stream.rows.sum())
                quantum = self.global_workers * int(self.config.batch_size or 1)
                planned = total if i == len(self.sources) - 1 else total // quantum * quantum
                mine, carry = _split_rows(stream, planned)
                plan = EpochPlan(self.source.layout(), self.config, self.epoch, self.global_workers, mine)
                self.plans.append(plan)
                self.carries.append(carry)
                self.starts.append(self.starts[-1] + plan.steps)
            return self.plans[j] if j < len(self.plans) else None

    def ready(self, j: int) -> bool:
        """Whether plan ``j`` can be built without counting (built, past the end, or its stage counted)."""
        if j < len(self.plans) or j >= len(self.sources):
            return True
        source = self.sources[j]
        return source is None or self.source.ready(source)

    @property
    def steps(self) -> int:
        """Batches per worker over all plans (counts every stage)."""
        self.plan(len(self.sources))
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int] | None:
        """(plan, batch inside it) of a worker's batch ``index``; None past the end. Counts only the
        stages up to that plan."""
        j = 0
        while True:
            plan = self.plan(j)
            if plan is None:
                return None
            if index < self.starts[j + 1]:
                return j, index - self.starts[j]
            j += 1

    def rest_after(self, segment: Segment) -> Rest:
        """What is left after ``segment`` (batches per rank of this topology, from the start of ``rest``)."""
        if segment.global_workers != self.global_workers:
            raise ValueError(f"segment {segment} does not match plans of {self.global_workers} global workers")
        n = max(segment.num_workers, 1)
        left, j = segment.batches, 0
        while True:
            if left == 0 and j < len(self.sources):  # at a plan boundary: the rest is lazily whole stages
                source = self.sources[j]
                return self.rest if source is None else Rest(self.carries[j], source)
            plan = self.plan(j)
            if plan is None:
                if left:
                    raise ValueError(f"a rank cannot have consumed {segment.batches} batches: the epoch has "
                                     f"{self.starts[-1] * n} per rank")
                return Rest(Pieces.empty(), len(self.source))
            here = plan.steps * n
            if left < here:
                head = remaining_stream(plan, Segment(segment.world_size, segment.num_workers, left))
                return Rest(Pieces.concat([head, self.carries[j + 1]]), self._next_stage(j))
            left -= here
            j += 1

    def _next_stage(self, j: int) -> int:
        """The first stage not in plans ``0..j``."""
        return self.sources[j + 1] if j + 1 < len(self.sources) else len(self.source)


def staged_resume(stages: Stages | Any, counts: StageCounts | None, config: PlanConfig, epoch: int, history: list[Segment],
                  world_size: int, num_workers: int) -> tuple[StagePlans, int]:
    """The plans of the current topology after ``history``, and the batches per rank already consumed
    in them (``elastic.resume_plan`` for stage plans)."""
    rest = Rest()
    for i, segment in enumerate(history):
        plans = StagePlans(stages, counts, config, epoch, segment.global_workers, rest)
        if i == len(history) - 1 and (segment.world_size, segment.num_workers) == (world_size, num_workers):
            return plans, segment.batches
        rest = plans.rest_after(segment)
    return StagePlans(stages, counts, config, epoch, world_size * max(num_workers, 1), rest), 0


class StagedSchedule(Schedule):
    """Global worker ``worker``'s batches over stage plans: plan 0's, then plan 1's, ... Its batches are
    built (and stages counted) only as they are reached; ``steps`` counts them all."""

    def __init__(self, plans: StagePlans, worker: int) -> None:
        self.plans, self.worker = plans, worker
        self._current: tuple[int, StreamSchedule] | None = None
        self._lock = threading.Lock()

    def _schedule(self, j: int) -> StreamSchedule:
        with self._lock:
            if self._current is None or self._current[0] != j:
                plan = self.plans.plan(j)
                assert plan is not None
                self._current = (j, StreamSchedule(plan, self.worker))
            return self._current[1]

    @property
    def steps(self) -> int:  # type: ignore[override]
        return self.plans.steps

    @property
    def real_batches(self) -> int:  # type: ignore[override]
        self.plans.plan(len(self.plans.sources))  # every plan built
        last = len(self.plans.plans) - 1
        if last < 0:
            return 0
        return self.plans.starts[last] + StreamSchedule(self.plans.plans[last], self.worker).real_batches

    def batch(self, index: int) -> BatchSpec:
        where = self.plans.locate(index) if index >= 0 else None
        if where is None:
            raise IndexError(f"batch {index} is outside [0, {self.plans.steps})")
        j, local = where
        spec = self._schedule(j).batch(local)
        base = j * _KEY_STRIDE
        return BatchSpec(index, {key + base: read for key, read in spec.reads.items()}, spec.read + base, spec.row,
                         spec.sample_id, spec.padding, tuple(key + base for key in spec.done), slot=spec.slot)

    def batches(self, start: int = 0) -> Iterator[BatchSpec]:
        index = start
        while self.plans.locate(index) is not None:
            yield self.batch(index)
            index += 1

    def upcoming_reads(self, start: int) -> Iterator[tuple[int, Read]]:
        """The reads from batch ``start`` on, plan after plan; it *pauses* (``next`` says there is none
        for now, and a later ``next`` goes on) where the next plan's stage is not counted yet, so
        read-ahead never waits for counting: the batches in hand go on while the count runs."""
        return _Upcoming(self, start)

    def shape_donor(self) -> BatchSpec | None:
        return None  # packed batches are assembled from their spec alone


class _Upcoming:
    """``StagedSchedule.upcoming_reads``: a pausable iterator (``delivery.deliver`` asks it with
    ``next(upcoming, None)`` before every batch, so a pause only holds read-ahead back until the count)."""

    def __init__(self, schedule: StagedSchedule, start: int) -> None:
        self.schedule, self.j, self.inner = schedule, -1, iter(())
        where = schedule.plans.locate(start)
        if where is not None:
            self.j, self.inner = where[0], schedule._schedule(where[0]).upcoming_reads(where[1])

    def __iter__(self) -> "_Upcoming":
        return self

    def __next__(self) -> tuple[int, Read]:
        if self.j < 0:
            raise StopIteration
        while True:
            item = next(self.inner, None)
            if item is not None:
                return item[0] + self.j * _KEY_STRIDE, item[1]
            plans = self.schedule.plans
            if not plans.ready(self.j + 1):
                raise StopIteration  # for now: the next stage is being counted
            plan = plans.plan(self.j + 1)
            if plan is None:
                self.j = -1
                raise StopIteration
            self.j += 1
            self.inner = StreamSchedule(plan, self.schedule.worker).upcoming_reads(0)


@dataclass(frozen=True)
class StagedPlanner:
    """``resume.Planner`` for stage plans: a worker's start, a rank's batches, a state's check.

    ``stages(epoch)`` gives an epoch's stages (fixed by seed and epoch, not by counts or topology): a
    text corpus's ``Stages`` over ``counts``, or, ``counts`` None, a staged source of its own (a packed
    blend's positions, ``plan/blend_stages.py``)."""

    stages: Callable[[int], Any]
    counts: StageCounts | None
    config: PlanConfig

    split = Planner.split
    begin = Planner.begin

    def _plans(self, epoch: int, history: list[Segment], world_size: int, num_workers: int) -> tuple[StagePlans, int]:
        return staged_resume(self.stages(epoch), self.counts, self.config, epoch, history, world_size, num_workers)

    def start(self, epoch: int, position: Position | None, rank: int, world_size: int, worker_id: int,
              num_workers: int) -> Start:
        """The schedule of DataLoader worker ``worker_id`` and where it begins (``Planner.start``)."""
        history, before, pinned = self.begin(position, rank, world_size, worker_id, num_workers)
        n = max(num_workers, 1)
        if pinned is not None:
            plans, _ = self._plans(epoch, history, world_size, num_workers)
            role, skip = pinned.role, pinned.batches
        else:
            full = history + ([Segment(world_size, num_workers, before)] if before else [])
            plans, before = self._plans(epoch, full, world_size, num_workers)
            role = (worker_id + before) % n  # a restarted loader's worker 0 takes over worker before % n's role
            skip = worker_batches_delivered(before, num_workers, role)
        worker = Topology(rank, world_size, role, num_workers).global_worker_id
        return Start(StagedSchedule(plans, worker), skip, role, history, worker_id)

    def has_batch(self, epoch: int, position: Position | None, world_size: int, num_workers: int,
                  consumed: int) -> bool | None:
        """Whether a rank has a batch left after ``consumed`` of a pass from ``position``; None when that
        needs a stage not counted yet (at a plan's end, with the next plan's stage still counting).
        Counts nothing: a checkpoint during a cold start does not wait for the count."""
        history, before = self.split(position, world_size, num_workers)
        full = history + ([Segment(world_size, num_workers, before)] if before else [])
        plans, before = self._plans(epoch, full, world_size, num_workers)
        index, j = (before + consumed) // max(num_workers, 1), 0  # equal steps: worker batch index
        while True:
            if not plans.ready(j):  # tokens carried into plan j: the last plan pads them, so a batch follows
                return True if j < len(plans.carries) and len(plans.carries[j]) else None
            if plans.plan(j) is None:
                return False
            if index < plans.starts[j + 1]:
                return True
            j += 1

    def rank_batches(self, epoch: int, position: Position | None, world_size: int, num_workers: int) -> int:
        """Batches a rank yields from ``position`` to the end of the epoch (counts every stage)."""
        history, before = self.split(position, world_size, num_workers)
        full = history + ([Segment(world_size, num_workers, before)] if before else [])
        plans, before = self._plans(epoch, full, world_size, num_workers)
        return plans.steps * max(num_workers, 1) - before

    def check(self, position: Position) -> None:
        """Refuse a position whose counts do not fit this dataset (``StateError`` naming the segment);
        counts the stages the position reaches."""
        stages, rest = self.stages(position.epoch), Rest()
        for i, segment in enumerate(position.history):
            plans = StagePlans(stages, self.counts, self.config, position.epoch, segment.global_workers, rest)
            try:
                rest = plans.rest_after(segment)
            except ValueError as exc:
                raise StateError(f"state['history'][{i}] says a rank consumed {segment.batches} batches under "
                                 f"{segment.world_size} ranks x {segment.num_workers} workers: {exc}") from None
        worker = position.worker
        if worker is not None:
            n = max(worker.num_workers, 1)
            if not (worker.rank < worker.world_size and worker.worker_id < n and worker.role < n):
                raise StateError(f"per-worker state has rank/worker/role outside its topology: {worker}")
