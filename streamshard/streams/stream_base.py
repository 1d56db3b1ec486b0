"""``PlannedStream``: what every stream here shares (``ParquetStream``, ``BlendedStream``).

One checkpoint contract and one iteration protocol, written once. A subclass says what decides its
order (``planner``, ``fingerprint``) and how to turn a worker's schedule into batches
(``_deliver``); this class handles epochs, lengths, progress and states:

* the pass/epoch model (docs/concepts.md, "Passes and epochs"): a loaded state is *pending* until the first pass
  after the load uses it, and no later pass; ``set_epoch(e)`` starts a full pass of ``e`` unless a
  state for ``e`` is pending; a state saved after an epoch's last batch is the start of the next epoch.
* ``state_dict()`` / ``load_state_dict(state)``: in a process that iterates the stream itself, the
  rank's position; inside a DataLoader worker (torchdata's ``StatefulDataLoader``), the worker's.
* ``origin()``, ``pass_batches``, ``batches_before``, ``position_after``, ``rank_state``: a pass's
  arithmetic for ``StreamLoader``, which keeps the count of what it handed out; its rank states
  resume on any world size and worker count.
* ``len()``: the rank's epoch as a framework counts it (batches before the pass + the pass's).

The rank and world size are resolved when first needed (``plan/topology.py``), so a stream built before
``init_process_group`` takes the process group's rank, never a guess.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from torch.utils.data import IterableDataset, get_worker_info

from ..plan.batch_plan import Schedule
from .delivery import DeliveryStats
from ..plan.elastic import Segment
from ..errors import StateError
from ..io.fetch import ReadStats
from ..loader.handoff import WorkerSlots, chunks
from ..loader.loader_stats import sum_reads
from ..integrations.accelerate import check_pass_context
from ..plan.resume import Planner, Position, Start, WorkerPosition
from ..loader.shared_cell import EpochCell
from ..plan.state import STATE_VERSION, check_fingerprint, history_json, int_field, parse_history, require
from ..plan.topology import current_worker, distributed_rank_world, known_rank_world, resolve_rank_world
from ..plan.validate import check_int

_RANK_KEYS = ("version", "kind", "epoch", "fingerprint", "history")
_WORKER_KEYS = _RANK_KEYS + ("world_size", "num_workers", "rank", "worker_id", "role", "batches")


class PlannedStream(IterableDataset):
    """Base of the streams: epoch, passes, length, progress and checkpoint state, the same for all."""

    def __init__(self, rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__()
        self._cell = EpochCell()  # shared memory: set_epoch and load bookkeeping reach DataLoader workers
        self._use_topology(rank, world_size)
        self._pending: Position | None = None  # a loaded state no pass has used yet
        self._pending_here = False  # loaded inside this DataLoader worker (StatefulDataLoader): not shared
        self._loads = 0  # the cell's load count when this copy's state was loaded
        self._progress: dict[str, Any] | None = None  # what this process's current pass delivered
        self._slots: WorkerSlots | None = None  # this worker process's hand-off slots (loader/handoff.py)
        self._per_message = 0  # StreamLoader's worker processes: batches a message (0: one, as in a plain DataLoader)
        self._repeat_warned = False
        self._worker_times: Callable[[DeliveryStats], None] | None = None  # StreamLoader.stats()'s table (loader/loader_stats.py)
        self._stand: Callable[[], Any] | None = None  # weak: the StreamLoader iterating it says where it stands
        self._revision = 0  # bumped when the plan changes (BlendedStream.set_weights): persistent workers restart

    # -- what a subclass provides ---------------------------------------------------------------
    @property
    def planner(self) -> Planner:  # pragma: no cover - interface
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:  # pragma: no cover - interface
        """Everything that decides which rows an epoch delivers in which order."""
        raise NotImplementedError

    def _deliver(self, start: Start) -> Iterator[Any]:  # pragma: no cover - interface
        """Batches of ``start.schedule`` from batch ``start.start`` on (read and converted)."""
        raise NotImplementedError

    def _before_pass(self, start: Start, worker_id: int, num_workers: int) -> None:
        """A hook at the start of every pass (warnings)."""

    # -- where a worker's time goes (``stats_hook``, ``StreamLoader.stats()``) ------------------------
    def _delivery_stats(self, reads: ReadStats, worker_id: int) -> DeliveryStats | None:
        """A worker's timings for this pass, kept only if someone reads them."""
        if self._worker_times is None and getattr(self, "stats_hook", None) is None:
            return None
        return DeliveryStats(reads, worker_id)

    def _report_stats(self, stats: DeliveryStats | None) -> None:
        """After each batch a worker makes: its cumulative timings to the loader's table and ``stats_hook``."""
        if stats is None:
            return
        if self._worker_times is not None:
            self._worker_times(stats)
        hook = getattr(self, "stats_hook", None)
        if hook is not None:
            hook(stats)

    def _each_delivered(self, batches: Iterator[Any], readers: dict[int, Any], stats: DeliveryStats | None,
                        transform: Callable[[Any], Any] | None) -> Iterator[Any]:
        """The batches of a stream reading several corpora (one reader each, ``BlendedStream``, ``PackedStream``):
        after each, the readers' counters summed into ``stats`` and reported; ``transform`` applied; the
        readers closed when the pass ends, however it ends."""
        try:
            for batch in batches:
                if stats is not None:
                    sum_reads(readers.values(), into=stats.reads)
                    self._report_stats(stats)
                yield batch if transform is None else transform(batch)
        finally:
            for reader in readers.values():
                reader.close()

    # -- rank -----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The data-parallel rank (resolved on first use: ``topology.resolve_rank_world``)."""
        return self.topology[0]

    @property
    def world_size(self) -> int:
        return self.topology[1]

    @property
    def topology(self) -> tuple[int, int]:
        """``(rank, world_size)`` of the data-parallel job: the explicit arguments, else resolved now
        (torch.distributed once it is initialised, then RANK/WORLD_SIZE), so a stream built before
        ``init_process_group`` follows the process group; ``TopologyError`` while it cannot be known."""
        if self._topology is not None:
            return self._topology
        return resolve_rank_world(*self._rank_args)

    def _use_topology(self, rank: int | None, world_size: int | None) -> None:
        """Take the rank and world size from these arguments (None: resolved when used)."""
        self._rank_args = (rank, world_size)
        known_rank_world(rank, world_size)  # bad values fail here, at construction
        self._topology: tuple[int, int] | None = (rank, world_size) if self.topology_given else None

    @property
    def topology_given(self) -> bool:
        """Whether rank and world size were both given (explicitly or by a mesh), not resolved."""
        return None not in self._rank_args

    # -- epoch and length -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start a full pass of ``epoch`` next time, unless a state for ``epoch`` was loaded and no
        pass has used it yet (then the next pass resumes it)."""
        epoch = check_int(epoch, "epoch", 0)
        check_pass_context(self)  # Accelerate's wrappers call set_epoch on every rank before their first batch
        pending = self._pending
        if pending is not None and (pending.epoch != epoch or (not self._pending_here and self._cell.claimed)):
            self._pending = None
        self._progress = None
        self._cell.epoch = epoch
        self._cell.last_pass = -1  # an epoch chosen on purpose: its next pass is not an accidental repeat

    @property
    def epoch(self) -> int:
        return self._cell.epoch

    def origin(self) -> Position:
        """Where the next pass over the current epoch starts: a pending loaded state, else the beginning."""
        pending = self._pending
        return pending if pending is not None and pending.epoch == self.epoch else Position(self.epoch)

    def take_origin(self) -> Position:
        """``origin()``, used up: a pass in this process starts from it (``StreamLoader``)."""
        return self._take_pending(0, 0)

    def steps_per_epoch(self, num_workers: int = 0) -> int:
        """Batches this rank's next pass over the current epoch yields with ``num_workers`` workers
        (after ``load_state_dict``: the rest of the resumed epoch)."""
        return self.pass_batches(self.origin(), num_workers)

    def epoch_length(self, num_workers: int = 0) -> int:
        """This rank's epoch in batches as a framework counts them: the batches a loaded state says
        were consumed before (under any earlier topologies) plus those the next pass yields."""
        origin = self.origin()
        return self.batches_before(origin) + self.pass_batches(origin, num_workers)

    @property
    def sized(self) -> bool:
        """Whether ``len()`` is defined (a raw-text ``PackedStream`` has none unless asked: its length
        needs the whole token count)."""
        return True

    def __len__(self) -> int:
        """``epoch_length`` for the worker count it is iterated with (a DataLoader's ``len``).

        Known inside a DataLoader worker, or once a pass has started; otherwise a ``TypeError``
        says how to ask (never a guess: the count depends on ``num_workers``). A stream that is not
        ``sized`` raises ``TypeError`` always (frameworks then run the epoch to its end).
        """
        if not self.sized:
            raise TypeError(unsized_message(self))
        worker_id, num_workers = current_worker()
        if num_workers == 0:
            num_workers = self._cell.workers
        if num_workers < 0:
            raise TypeError(
                f"len({type(self).__name__}) depends on the DataLoader's num_workers, which it has not seen yet: "
                "use len(ss.StreamLoader(ds, num_workers=N)) or ds.epoch_length(num_workers=N)"
            )
        return self.epoch_length(num_workers)

    def schedule(self, worker_id: int = 0, num_workers: int = 0) -> Schedule:
        """The exact batches DataLoader worker ``worker_id`` of this rank delivers in the next pass,
        without reading anything (``schedule(...).sample_ids()`` simulates it)."""
        return self._start(self.origin(), worker_id, num_workers).schedule

    # -- provenance: which rows a step held, without reading ---------------------------------------
    def step_sample_ids(self, step: int, num_workers: int = 0, epoch: int | None = None) -> list[dict[str, Any]]:
        """The rows every rank trained on at one step, computed from the plan alone (no file is opened).

        Element ``r`` is rank ``r``'s batch at that step: ``{"sample_id": int64 ids of its real rows
        in batch order}`` (padding left out), plus ``"corpus"`` for a blend. ``num_workers`` is the run's
        loader worker count. (Not for a ``PackedStream``: a token's document needs the data.)

        * ``epoch=None``: ``step`` counts batches per rank from the start of epoch 0, epochs back to
          back on this stream's topology (a run that was never resized).
        * ``epoch=e``: ``step`` is the batch of epoch ``e`` as ``len(loader)`` counts it (Lightning's
          ``batch_idx``, ``StreamLoader.stats()``'s stall steps). When a state of epoch ``e`` is loaded
          and not yet used, its history says which topologies ran the steps before it: those steps
          are answered for the ranks of their own topology.
        """
        step = check_int(step, "step", 0)
        num_workers = check_int(num_workers, "num_workers", 0)
        if epoch is None:
            epoch, step = self._epoch_of_step(step, num_workers)
            origin = Position(epoch)
        else:
            epoch = check_int(epoch, "epoch", 0)
            pending = self.origin()
            origin = pending if pending.epoch == epoch and pending.worker is None else Position(epoch)
        before = 0
        for i, segment in enumerate(origin.history):  # steps of earlier topologies
            if step < before + segment.batches:
                return self._step_rows(Position(epoch, origin.history[:i]), segment.world_size, segment.num_workers,
                                       step - before)
            before += segment.batches
        rest = self.pass_batches(origin, num_workers)
        if step - before >= rest:
            raise ValueError(f"step {step} is past the end of epoch {epoch}, which has {before + rest} steps per rank")
        return self._step_rows(origin, self.world_size, num_workers, step - before)

    def _epoch_of_step(self, step: int, num_workers: int) -> tuple[int, int]:
        """``(epoch, step of that epoch)`` of a step counted from the start of epoch 0."""
        epoch = 0
        while True:
            length = self.pass_batches(Position(epoch), num_workers)
            if length == 0:
                raise ValueError(f"epoch {epoch} has no batches: step {step} is never reached")
            if step < length:
                return epoch, step
            step -= length
            epoch += 1

    def _step_rows(self, origin: Position, world_size: int, num_workers: int, t: int) -> list[dict[str, Any]]:
        """Each rank's batch ``t`` of a pass from ``origin`` on ``world_size`` ranks x ``num_workers``:
        round robin, so worker ``t % n`` gives it (``StreamLoader``'s order, and a ``DataLoader``'s)."""
        n = max(num_workers, 1)
        rows = []
        for rank in range(world_size):
            start = self.planner.start(origin.epoch, origin, rank, world_size, t % n, num_workers)
            spec = self._schedule_of(start).batch(start.start + t // n)
            row = {"sample_id": spec.sample_id}
            if spec.corpus is not None:
                row["corpus"] = spec.corpus
            rows.append(row)
        return rows

    def _schedule_of(self, start: Start) -> Schedule:
        """A worker's batches from its ``Start`` (a blend or a pack wraps the planned positions)."""
        return start.schedule

    # -- a pass's arithmetic (StreamLoader keeps the count) ---------------------------------------
    def pass_batches(self, origin: Position, num_workers: int) -> int:
        """Batches this rank yields in a pass from ``origin`` to the end of its epoch."""
        return self.planner.rank_batches(origin.epoch, origin, self.world_size, num_workers)

    @staticmethod
    def batches_before(origin: Position) -> int:
        """Batches per rank consumed of the epoch before ``origin`` (every earlier topology's count):
        what a framework's restored batch index says."""
        return sum(segment.batches for segment in origin.history)

    def position_after(self, origin: Position, consumed: int, num_workers: int) -> Position:
        """The rank's position after ``consumed`` batches of a pass from ``origin``; the whole pass
        consumed is the start of the next epoch (a state saved on an epoch's last batch)."""
        if consumed >= self.pass_batches(origin, num_workers):
            return Position(origin.epoch + 1)
        history, before = self.planner.split(origin, self.world_size, num_workers)
        return Position(origin.epoch, history + [Segment(self.world_size, num_workers, before + consumed)])

    def rank_state(self, position: Position) -> dict[str, Any]:
        """The checkpoint of a rank position (what ``load_state_dict`` takes back)."""
        return self._state_of(position)

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this object is in the epoch, as a small JSON-serialisable dict.

        Inside a DataLoader worker (torchdata's ``StatefulDataLoader`` calls it there) it is that
        worker's progress; in a process that iterates the stream itself, the rank's (after the
        epoch's last batch: the start of the next epoch). In the main process while DataLoader
        workers iterate it cannot know what the training loop consumed, and raises: use
        ``ss.StreamLoader``, which keeps that count.
        """
        progress = self._progress if self._progress and self._progress["epoch"] == self.epoch else None
        worker_id, num_workers = current_worker()
        if progress is None and num_workers == 0 and self._cell.workers > 0:
            raise StateError(
                f"{type(self).__name__}.state_dict() in the main process cannot see what DataLoader workers delivered "
                "or what training consumed; iterate with ss.StreamLoader(ds, num_workers=...) and save "
                "loader.state_dict()"
            )
        if progress is None:
            return self._state_of(self.origin())
        if progress["num_workers"] == 0:
            return self._state_of(self.position_after(progress["origin"], progress["delivered"] - progress["skip"], 0))
        worker = WorkerPosition(self.world_size, progress["num_workers"], self.rank, progress["worker_id"],
                                progress["role"], progress["delivered"])
        return self._state_of(Position(self.epoch, progress["history"], worker))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a state: the first pass after the load continues where it stopped.

        A rank state (``StreamLoader``) resumes on any world size and worker count; a per-worker
        state (``StatefulDataLoader``) on the topology that saved it. A state that does not fit
        (other files, seed, batch size, ...) or is malformed raises ``StateError`` naming the field.
        """
        position = self._parse_state(state)
        _, num_workers = current_worker()
        self._pending, self._progress, self._pending_here = position, None, num_workers > 0
        if num_workers == 0:  # the main process: its DataLoader workers learn of the load through the cell
            self._loads = self._cell.record_load()
        self._cell.epoch = position.epoch
        self._cell.last_pass = -1

    def _parse_state(self, state: Mapping[str, Any]) -> Position:
        what = type(self).__name__
        kind = state.get("kind") if isinstance(state, Mapping) else None
        require(state, ("rank", "worker"), _WORKER_KEYS if kind == "worker" else _RANK_KEYS, what)
        check_fingerprint(state["fingerprint"], self.fingerprint(), what)
        epoch = int_field(state, "epoch", 0)
        if kind == "worker":
            history = parse_history(state["history"]) if state["history"] else []
            world = int_field(state, "world_size", 1)
            workers = int_field(state, "num_workers", 1)
            worker = WorkerPosition(world, workers, int_field(state, "rank", 0, world - 1),
                                    int_field(state, "worker_id", 0, workers - 1),
                                    int_field(state, "role", 0, workers - 1), int_field(state, "batches", 0))
            position = Position(epoch, history, worker)
        else:
            position = Position(epoch, parse_history(state["history"]))
        self.planner.check(position)
        if position.worker is None and position.history and self._ended(position):
            return Position(epoch + 1)  # a state saved on an epoch's last batch by an older version
        return position

    def _ended(self, position: Position) -> bool:
        """Whether a rank position is the end of its epoch."""
        last = position.history[-1]
        return self.planner.rank_batches(position.epoch, position, last.world_size, last.num_workers) == 0

    def _state_of(self, position: Position) -> dict[str, Any]:
        state: dict[str, Any] = {
            "version": STATE_VERSION, "kind": "rank" if position.worker is None else "worker",
            "epoch": position.epoch, "fingerprint": self.fingerprint(), "history": history_json(position.history),
        }
        if position.worker is not None:
            w = position.worker
            state.update(world_size=w.world_size, num_workers=w.num_workers, rank=w.rank, worker_id=w.worker_id,
                         role=w.role, batches=w.batches)
        return state

    def _start(self, origin: Position, worker_id: int, num_workers: int) -> Start:
        return self.planner.start(self.epoch, origin, self.rank, self.world_size, worker_id, num_workers)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """A pass over the current epoch, set up at its first batch (a framework's ``iter()`` probe
        that never asks for a batch changes nothing)."""
        check_pass_context(self)
        worker_id, num_workers = current_worker()
        if worker_id == 0:
            self._cell.workers = num_workers
        origin = self._take_pending(worker_id, num_workers)
        start = self._start(origin, worker_id, num_workers)
        if worker_id == 0:
            self._notice_repeated_epoch(origin)
        self._before_pass(start, worker_id, num_workers)
        progress = self._progress = {
            "epoch": self.epoch, "origin": origin, "history": start.history, "num_workers": num_workers,
            "worker_id": worker_id, "role": start.role, "skip": start.start, "delivered": start.start,
        }
        hand_off = self._hand_off(num_workers)
        if getattr(self, "_per_message", 0) and num_workers > 0:  # StreamLoader merges the chunks back in order
            yield from chunks(worker_id, self._counted(start, progress), self._slots, self._per_message,
                              convert=getattr(self, "transform", None) is not None)
            return
        for batch in self._counted(start, progress):
            yield batch if hand_off is None else hand_off(batch)

    def _counted(self, start: Start, progress: dict[str, Any]) -> Iterator[Any]:
        for batch in self._deliver(start):
            progress["delivered"] += 1
            yield batch

    def _take_pending(self, worker_id: int, num_workers: int) -> Position:
        """The origin of a pass starting now; a pending loaded state is used up by it.

        In a DataLoader worker the dataset is a copy of the main process's, taken when the workers
        started, so a state loaded in the main process is still pending in the copies of every later
        pass: the cell records the pass that used it (``EpochCell.claim``)."""
        pending, self._pending = self._pending, None
        if num_workers > 0 and not self._pending_here:
            if self._cell.loads != self._loads:
                raise StateError(
                    f"a state was loaded into the {type(self).__name__} after these DataLoader workers started "
                    "(persistent workers keep the dataset they started with); make a new DataLoader after "
                    "load_state_dict, or iterate with ss.StreamLoader")
            info = get_worker_info()
            if pending is not None and not self._cell.claim(worker_id, info.seed - worker_id if info else 0):
                pending = None
        if pending is None or pending.epoch != self.epoch:
            return Position(self.epoch)
        return pending

    @contextmanager
    def handing_over(self, origin: Position) -> Iterator[None]:
        """While DataLoader workers start (``StreamLoader``'s worker processes), their copies of this
        stream carry ``origin`` as the state their first pass uses (this process keeps none), and send
        their batches ``_batches_a_message()`` at a time, which ``StreamLoader`` puts back in order
        (``handoff.merged``)."""
        if not origin.fresh:
            self._pending, self._pending_here = origin, False
            self._loads = self._cell.record_load()
        self._per_message = self._batches_a_message()
        try:
            yield
        finally:
            self._pending, self._per_message = None, 0

    def _batches_a_message(self) -> int:
        """Batches a worker process sends ``StreamLoader`` in one message (``loader/handoff.py``'s
        chunks): the same number in every worker, decided before they start. One here; a stream that
        can tell its batches are small sends more."""
        return 1

    def worker_passes(self, num_workers: int, origin: Position) -> list[Iterator[Any]]:
        """This rank's pass from ``origin`` as ``num_workers`` workers in this process (``StreamLoader``'s
        thread workers): worker ``w``'s batches, exactly what DataLoader worker ``w`` would deliver
        (``num_workers=0``: the one pass of the main process)."""
        check_pass_context(self)
        n = check_int(num_workers, "num_workers", 0)
        self._cell.workers = n
        starts = [self._start(origin, worker, n) for worker in range(max(n, 1))]
        self._notice_repeated_epoch(origin)
        for worker, start in enumerate(starts):
            self._before_pass(start, worker, n)
        return [self._deliver(start) for start in starts]

    def _notice_repeated_epoch(self, origin: Position) -> None:
        """A second full pass over one shuffled epoch, with no set_epoch between, repeats its order
        exactly: say so, once."""
        epoch = self.epoch
        if origin.fresh and self._cell.last_pass == epoch and self.shuffled and not self._repeat_warned:
            self._repeat_warned = True
            warnings.warn(
                f"{type(self).__name__}: another pass over epoch {epoch} without set_epoch() delivers the same order "
                "as the last one; call set_epoch(epoch) every epoch, or iterate with ss.StreamLoader, which moves to "
                "the next epoch by itself", stacklevel=4)
        if origin.fresh:
            self._cell.last_pass = epoch

    @property
    def shuffled(self) -> bool:
        """Whether the order depends on the epoch (a repeated epoch is then worth a warning)."""
        return True

    def _hand_off(self, num_workers: int) -> Callable[[Any], Any] | None:
        """How a DataLoader worker process passes its batches on: through this process's recycled
        shared-memory slots (``loader/handoff.py``; kept across passes of persistent workers), whether a
        ``StreamLoader`` or a plain ``DataLoader`` runs it; in the main process, as they are."""
        if num_workers == 0:
            return None
        if self._slots is None or self._slots.pid != os.getpid():
            self._slots = WorkerSlots()
        return self._slots.wrap

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_slots": None, "_stand": None}  # a worker's slots stay in that worker
        if self._topology is None and distributed_rank_world()[1] is not None:
            # A spawned DataLoader worker has no process group, and its environment may not name the rank
            # (Lightning): it gets this process's. Without a group the copy resolves its own (ddp_spawn's
            # launcher pickles the module before its children know their ranks).
            state["_topology"] = self.topology
        return state


def unsized_message(stream: Any) -> str:
    """What ``len()`` of a stream without a length says (a ``TypeError``: frameworks take it as no length)."""
    return (f"this {type(stream).__name__} has no len(): its length needs the whole token count of the text, "
            "counted beside training (a framework without a length runs the epoch to its end); "
            "stream.epoch_length(num_workers=N) waits for the count and gives the exact number, and "
            "PackedStream(..., sized=True) makes len() wait for it")
