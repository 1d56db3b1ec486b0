"""``PlannedStream``: what every stream here shares (``ParquetStream``, ``BlendedStream``).

One checkpoint contract and one iteration protocol, written once. A subclass says what decides its
order (``planner``, ``fingerprint``) and how to turn a worker's schedule into batches
(``_deliver``); this class handles epochs, lengths, progress and states:

* ``state_dict()`` / ``load_state_dict(state)``: in a process that iterates the stream itself, the
  rank's position; inside a DataLoader worker (torchdata's ``StatefulDataLoader``), the worker's.
* ``loader_state(consumed, num_workers)``: the rank's position after ``consumed`` batches of a
  pass, for ``StreamLoader``; it resumes on any world size and worker count.
* ``steps_per_epoch(num_workers)`` and ``len()``: what the next pass yields, resumes included.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterator, Mapping

from torch.utils.data import IterableDataset

from .batch_plan import Schedule
from .elastic import Segment
from .errors import StateError
from .handoff import WorkerSlots
from .resume import Planner, Position, Start, WorkerPosition
from .shared_cell import EpochCell
from .state import STATE_VERSION, check_fingerprint, history_json, int_field, parse_history, require
from .topology import current_worker
from .validate import check_int

_RANK_KEYS = ("version", "kind", "epoch", "fingerprint", "history")
_WORKER_KEYS = _RANK_KEYS + ("world_size", "num_workers", "rank", "worker_id", "role", "batches")


class PlannedStream(IterableDataset):
    """Base of the streams: epoch, length, progress and checkpoint state, the same for all."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        super().__init__()
        self._cell = EpochCell()  # shared memory: set_epoch reaches persistent DataLoader workers
        self._position: Position | None = None  # a loaded state; applies to passes over its epoch
        self._progress: dict[str, Any] | None = None  # what this process's current pass delivered
        self._slots: WorkerSlots | None = None  # this worker process's hand-off slots (handoff.py)
        self._repeat_warned = False

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

    # -- epoch and length -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next pass follows (a loaded state applies to its own epoch)."""
        self._cell.epoch = check_int(epoch, "epoch", 0)

    @property
    def epoch(self) -> int:
        return self._cell.epoch

    def steps_per_epoch(self, num_workers: int = 0) -> int:
        """Batches this rank's next pass over the current epoch yields with ``num_workers`` workers
        (after ``load_state_dict``: the rest of the resumed epoch)."""
        return self.planner.rank_batches(self.epoch, self._active_position, self.world_size, num_workers)

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch, for the worker count it is iterated with.

        Known inside a DataLoader worker, or once a pass has started; otherwise a ``TypeError``
        says how to ask (never a guess: the count depends on ``num_workers``).
        """
        worker_id, num_workers = current_worker()
        if num_workers == 0:
            num_workers = self._cell.workers
        if num_workers < 0:
            raise TypeError(
                f"len({type(self).__name__}) depends on the DataLoader's num_workers, which it has not seen yet: "
                "use len(ss.StreamLoader(ds, num_workers=N)) or ds.steps_per_epoch(num_workers=N)"
            )
        return self.steps_per_epoch(num_workers)

    def schedule(self, worker_id: int = 0, num_workers: int = 0) -> Schedule:
        """The exact batches DataLoader worker ``worker_id`` of this rank delivers in this pass,
        without reading anything (``schedule(...).sample_ids()`` simulates it)."""
        return self._start(worker_id, num_workers).schedule

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this object's pass is in the epoch, as a small JSON-serialisable dict.

        Inside a DataLoader worker (torchdata's ``StatefulDataLoader`` calls it there) it is that
        worker's progress; in a process that iterates the stream itself, the rank's. In the main
        process while DataLoader workers iterate it cannot know what the training loop consumed,
        and raises: use ``ss.StreamLoader``, which keeps that count.
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
            if self._active_position is not None and self._active_position.worker is not None:
                return self._state_of(self._active_position)
            return self.loader_state(0, num_workers)
        if progress["num_workers"] == 0:
            return self.loader_state(progress["delivered"] - progress["skip"], 0)
        worker = WorkerPosition(self.world_size, progress["num_workers"], self.rank, progress["worker_id"],
                                progress["role"], progress["delivered"])
        return self._state_of(Position(self.epoch, progress["history"], worker))

    def loader_state(self, consumed_batches: int, num_workers: int) -> dict[str, Any]:
        """The rank state after ``consumed_batches`` batches of the current pass with ``num_workers``
        workers (``StreamLoader`` keeps that count; the same state serves every rank)."""
        history, before = self.planner.split(self._active_position, self.world_size, num_workers)
        segment = Segment(self.world_size, num_workers, before + consumed_batches)
        return self._state_of(Position(self.epoch, history + [segment]))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a state: the next pass over its epoch continues where it stopped.

        A rank state (``StreamLoader``) resumes on any world size and worker count; a per-worker
        state (``StatefulDataLoader``) on the topology that saved it. A state that does not fit
        (other files, seed, batch size, ...) or is malformed raises ``StateError`` naming the field.
        """
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
        self._position, self._progress = position, None
        self._cell.epoch = epoch

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

    @property
    def _active_position(self) -> Position | None:
        """The loaded position, if it belongs to the current epoch."""
        return self._position if self._position is not None and self._position.epoch == self.epoch else None

    def _start(self, worker_id: int, num_workers: int) -> Start:
        return self.planner.start(self.epoch, self._active_position, self.rank, self.world_size, worker_id, num_workers)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        worker_id, num_workers = current_worker()
        if worker_id == 0:
            self._cell.workers = num_workers
        start = self._start(worker_id, num_workers)
        if worker_id == 0:
            self._notice_repeated_epoch()
        self._before_pass(start, worker_id, num_workers)
        progress = self._progress = {
            "epoch": self.epoch, "history": start.history, "num_workers": num_workers, "worker_id": worker_id,
            "role": start.role, "skip": start.start, "delivered": start.start,
        }
        return self._counted(start, progress, self._hand_off(num_workers))

    def worker_passes(self, num_workers: int) -> list[Iterator[Any]]:
        """This rank's pass as ``num_workers`` workers in this process (``StreamLoader``'s thread
        workers): worker ``w``'s batches, exactly what DataLoader worker ``w`` would deliver."""
        n = check_int(num_workers, "num_workers", 1)
        self._cell.workers = n
        starts = [self._start(worker, n) for worker in range(n)]
        self._notice_repeated_epoch()
        for worker, start in enumerate(starts):
            self._before_pass(start, worker, n)
        return [self._deliver(start) for start in starts]

    def _counted(self, start: Start, progress: dict[str, Any], hand_off: Callable[[Any], Any] | None) -> Iterator[Any]:
        for batch in self._deliver(start):
            progress["delivered"] += 1
            yield batch if hand_off is None else hand_off(batch)

    def _notice_repeated_epoch(self) -> None:
        """A second full pass over one shuffled epoch repeats its order exactly: say so, once."""
        epoch = self.epoch
        fresh = self._active_position is None
        if fresh and self._cell.last_pass == epoch and self.shuffled and not self._repeat_warned:
            self._repeat_warned = True
            warnings.warn(
                f"{type(self).__name__}: another pass over epoch {epoch} without set_epoch() delivers the same order "
                "as the last one; call set_epoch(epoch) every epoch, or iterate with ss.StreamLoader, which moves to "
                "the next epoch by itself", stacklevel=4)
        if fresh:
            self._cell.last_pass = epoch

    @property
    def shuffled(self) -> bool:
        """Whether the order depends on the epoch (a repeated epoch is then worth a warning)."""
        return True

    def _hand_off(self, num_workers: int) -> Callable[[Any], Any] | None:
        """How a DataLoader worker process passes its batches on: through this process's recycled
        shared-memory slots (``handoff.py``; kept across passes of persistent workers), whether a
        ``StreamLoader`` or a plain ``DataLoader`` runs it; in the main process, as they are."""
        if num_workers == 0:
            return None
        if self._slots is None or self._slots.pid != os.getpid():
            self._slots = WorkerSlots()
        return self._slots.wrap

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_slots": None}  # a worker's slots stay in that worker
