"""``StreamLoader``: iterate a dataset and keep its checkpoint, so no count comes from the user.

It iterates like ``DataLoader`` (and uses one for its worker processes) and counts the batches it
hands to the training loop. That count is the whole checkpoint:

* a stream (``ParquetStream``, ``BlendedStream``) batches itself (``DataLoader(ds, batch_size=None)``);
  ``state_dict()`` is the stream's rank state after those batches (with the worker count and the
  stream's own fingerprint), and it resumes on any world size and worker count. Batches arrive in
  round-robin order (batch ``j`` of a rank from worker ``j % num_workers``): that is what lets one
  number per rank say how far every worker got.
* a map-style dataset is sampled by an ``ElasticSampler`` in the main process
  (``DataLoader(ds, sampler=sampler, batch_size=B)``); ``state_dict()`` is the sampler's state
  after ``batches * B`` samples, and it resumes on any number of replicas.

Both go through one small adapter (``_Source``), so epochs, lengths, resume and
break-and-continue are the same code for both.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..errors import StateError
from .handoff import mapped_bytes, merged
from .loader_stats import LoopStats, WorkerTimes
from .prefetch import DevicePrefetcher
from ..plan.resume import Position
from ..streams.sampler import ElasticSampler
from ..streams.stream_base import unsized_message
from .thread_workers import round_robin
from ..integrations.lightning_read_ahead import batches_read_ahead
from ..plan.validate import check_bool, check_int


class StreamSource(Protocol):
    """What ``StreamLoader`` needs from a stream (``ParquetStream``, ``BlendedStream``, ``PackedStream``):
    ``stream_base.PlannedStream``'s pass arithmetic."""

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def origin(self) -> Position: ...

    def take_origin(self) -> Position: ...

    def pass_batches(self, origin: Position, num_workers: int) -> int: ...

    def batches_before(self, origin: Position) -> int: ...

    def position_after(self, origin: Position, consumed: int, num_workers: int) -> Position: ...

    def rank_state(self, position: Position) -> dict[str, Any]: ...

    def worker_passes(self, num_workers: int, origin: Position) -> list[Iterator[Any]]: ...

    def handing_over(self, origin: Position) -> AbstractContextManager[None]: ...


class _Source(Protocol):
    """What the loader drives: a stream, or a map-style dataset with its sampler.

    An *origin* is where a pass starts (opaque to the loader): ``origin()`` is the next pass's (a
    loaded state the source keeps pending, else the epoch's beginning); the loader remembers the
    running pass's origin and how many batches it handed out, and asks the source the rest.
    """

    threadable: bool

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def origin(self) -> Any: ...

    def take_origin(self) -> Any: ...

    def pass_batches(self, origin: Any, num_workers: int) -> int: ...

    def batches_before(self, origin: Any) -> int: ...

    def state_after(self, origin: Any, consumed: int, num_workers: int) -> dict[str, Any]: ...

    def continue_after(self, origin: Any, consumed: int, num_workers: int) -> Any: ...

    def data_loader(self, **kwargs: Any) -> DataLoader: ...


class _Stream:
    """A stream batches itself; the loader hands it the origin of every pass."""

    threadable = True  # its workers' passes can run as threads of the training process

    def __init__(self, stream: StreamSource) -> None:
        self.stream = stream

    @property
    def epoch(self) -> int:
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(state)

    def origin(self) -> Position:
        return self.stream.origin()

    def take_origin(self) -> Position:
        return self.stream.take_origin()

    def pass_batches(self, origin: Position, num_workers: int) -> int:
        return self.stream.pass_batches(origin, num_workers)

    def batches_before(self, origin: Position) -> int:
        return self.stream.batches_before(origin)

    def state_after(self, origin: Position, consumed: int, num_workers: int) -> dict[str, Any]:
        return self.stream.rank_state(self.stream.position_after(origin, consumed, num_workers))

    def continue_after(self, origin: Position, consumed: int, num_workers: int) -> Position:
        return self.stream.position_after(origin, consumed, num_workers)

    def data_loader(self, **kwargs: Any) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, **kwargs)  # type: ignore[arg-type]


class _Sampled:
    """A map-style dataset read in the order of an ``ElasticSampler``, ``batch_size`` samples a batch.

    The sampler lives in the main process and resumes a loaded state on its first ``__iter__``
    after the load, so the loader's batch count says exactly how many of its indices training
    consumed. An origin is ``(epoch, first sample, samples)`` of a pass.
    """

    threadable = False  # map-style batches are collated in worker processes

    def __init__(self, dataset: Any, sampler: ElasticSampler, batch_size: int, drop_last: bool,
                 collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def origin(self) -> tuple[int, int, int]:
        return self.sampler.epoch, self.sampler.resume_point, len(self.sampler)

    def take_origin(self) -> tuple[int, int, int]:
        return self.origin()  # the sampler uses its pending resume up on its first __iter__

    def pass_batches(self, origin: tuple[int, int, int], num_workers: int) -> int:
        samples = origin[2]
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def batches_before(self, origin: tuple[int, int, int]) -> int:
        return origin[1] // self.batch_size

    def state_after(self, origin: tuple[int, int, int], consumed: int, num_workers: int) -> dict[str, Any]:
        if consumed >= self.pass_batches(origin, num_workers):  # a drop_last pass ends before the sampler does
            return self.sampler.state_dict(consumed=origin[1] + origin[2])  # the next epoch's beginning
        return self.sampler.state_dict(consumed=origin[1] + min(consumed * self.batch_size, origin[2]))

    def continue_after(self, origin: tuple[int, int, int], consumed: int, num_workers: int) -> tuple[int, int, int]:
        self.sampler.load_state_dict(self.state_after(origin, consumed, num_workers))
        return self.origin()

    def data_loader(self, **kwargs: Any) -> DataLoader:
        return DataLoader(self.dataset, sampler=self.sampler, batch_size=self.batch_size, drop_last=self.drop_last,
                          collate_fn=self.collate_fn, **kwargs)


@dataclass
class _Pass:
    """The loader's running (or last) pass: where it started and how many batches it handed out."""

    epoch: int
    origin: Any
    consumed: int = 0
    restart: bool = False  # ``skip()`` or a new plan (set_weights) moved it on: a loop iterating it restarts
    superseded: bool = False  # a framework set its epoch while it ran: its loop goes on, a new one starts afresh


class _EpochSetter:
    """``loader.sampler``: what frameworks call ``set_epoch`` on before each epoch (Lightning's
    ``_set_sampler_epoch`` looks for ``dataloader.sampler.set_epoch``); it sets the loader's epoch."""

    def __init__(self, loader: "StreamLoader") -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch``, except while a pass of ``epoch`` runs: a framework that reads a
        batch before it says which epoch it starts (Lightning, when a loader has no length, reads one
        ahead in its setup and then calls this) means that pass. Its loop goes on; a new iteration
        starts the epoch from its beginning, as after ``set_epoch``."""
        loader = self._loader
        running = loader._pass
        if running is not None and running.epoch == epoch == loader.epoch and not running.restart:
            running.superseded = True
            return
        loader.set_epoch(epoch)


_PROCESS_PREFETCH = 4  # batches in flight per worker process by default: +8% over 2 at 256-row batches
_CHUNK_PREFETCH = 2  # messages in flight per worker process when each carries several batches (handoff.chunks)


def _worker_kind(workers: str, source: Any, dataset: Any, num_workers: int, context: Any,
                 init: Callable[[int], None] | None) -> str:
    """"threads" or "processes": ``workers="auto"`` takes threads for a stream without a Python
    ``transform`` (pyarrow decodes without the GIL; nothing crosses a process boundary) unless a
    ``multiprocessing_context`` or ``worker_init_fn`` asks for processes, or the stream ``holds_gil``
    (a ``PackedStream`` whose tokenizer is a Python callable)."""
    if workers not in ("auto", "threads", "processes"):
        raise ValueError(f"workers must be 'auto', 'threads' or 'processes', got {workers!r}")
    if num_workers == 0:
        return "none"  # the pass runs in the loop's own thread
    if workers == "threads" and not source.threadable:
        raise ValueError("workers='threads' runs streams (ParquetStream, BlendedStream, PackedStream); a map-style "
                         "dataset with a sampler is collated in worker processes: use workers='processes'")
    if workers != "auto":
        return workers
    plain = (getattr(dataset, "transform", None) is None and not getattr(dataset, "holds_gil", False)
             and context is None and init is None)
    return "threads" if source.threadable and plain else "processes"


def _pinned(batch: Any) -> Any:
    if not isinstance(batch, dict):
        return batch
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class StreamLoader:
    """Iterate ``dataset`` with ``num_workers`` workers (threads or processes) and keep the data checkpoint.

    * ``for batch in loader`` yields the rest of the current epoch; when an epoch is exhausted
      the loader moves the dataset to the next epoch itself (``set_epoch`` is still honoured:
      setting another epoch on the loader or the dataset starts that epoch from its beginning).
      Breaking out of the loop and iterating again continues where the loop stopped; a loaded
      state is resumed by the next pass only (docs/concepts.md, "Passes and epochs").
    * ``len(loader)``: this rank's epoch in batches as frameworks count it (torchdata's
      ``StatefulDataLoader``, Lightning): the batches a loaded state says were consumed before, plus
      the pass's; constant through the epoch (a stream that is not ``sized``, raw text counted
      beside training, has none: ``TypeError``). ``batches_left()``: what is still to come.
    * ``state_dict()``: a small JSON dict, the same on every rank of a synchronous job;
      ``load_state_dict(state)`` on any world size and worker count delivers the rest of the
      epoch exactly once, with equal steps on every rank (map-style: exactly once apart from the
      sampler's padding, which stays below one sample per replica).

    Args:
        dataset: a ``ParquetStream`` or ``BlendedStream``; or a map-style dataset together with
            ``sampler``.
        num_workers, pin_memory, prefetch_factor, persistent_workers, multiprocessing_context,
            timeout, worker_init_fn: as for ``torch.utils.data.DataLoader``; ``pin_memory=None``
            pins when a CUDA device is available; ``prefetch_factor=None`` keeps 4 messages in
            flight per worker process (small batches cross processes faster with more in flight;
            2 when a ``ParquetStream``'s small batches travel up to 16 a message, ~2 MiB, which
            ``prefetch_factor`` then counts) and up to 16 ready batches per thread worker (8 per
            unit; fewer once they pass 4 MiB each).
        sampler: an ``ElasticSampler`` over ``dataset`` (map-style datasets only). Change the
            topology by loading a state into a loader whose sampler has the new topology, not
            with ``sampler.resize``: the loader keeps the count.
        batch_size, collate_fn, drop_last: as for ``DataLoader`` (map-style only; ``batch_size``
            defaults to 1; ``drop_last`` drops a short last batch).
        device, prefetch_depth: hand out batches already on ``device`` (e.g. "cuda"): copies run
            ``prefetch_depth`` batches ahead, on CUDA through reusable pinned buffers and a side
            stream while the previous step computes (``DevicePrefetcher``). The checkpoint counts
            the batches handed out, not the ones copied ahead.
        workers: "threads", "processes" or "auto" (the default): threads for a stream without a
            ``transform``, ``worker_init_fn`` or ``multiprocessing_context``, processes otherwise
            (and for map-style datasets). Thread workers run every worker's pass in turn in one
            background thread of this process, each with its own read-ahead threads (pyarrow
            decodes without the GIL), and hand batches over without a copy as soon as each is
            ready (``loader/thread_workers.py``); choose processes for Python-heavy transforms, or where many
            workers' Python bookkeeping would contend for the GIL. Both deliver the same batches in
            the same order, so a checkpoint resumes under either.

    Worker processes hand batches over through recycled shared-memory slots (``loader/handoff.py``, the
    same in a plain ``DataLoader``): no fresh shared-memory segment per batch, and a batch the
    training loop still holds is never overwritten. Thread workers hand them over as they are.
    """

    def __init__(
        self,
        dataset: Any,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        *,
        sampler: ElasticSampler | None = None,
        batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        prefetch_depth: int = 2,
        workers: str = "auto",
        stall_s: float = 1.0,
    ) -> None:
        self.dataset = dataset
        self._source = _source(dataset, sampler, batch_size, collate_fn, drop_last)
        self.num_workers = check_int(num_workers, "num_workers", 0, 1024)
        self.workers = _worker_kind(workers, self._source, dataset, self.num_workers, multiprocessing_context,
                                    worker_init_fn)
        if persistent_workers and not self.num_workers:
            raise ValueError("persistent_workers=True needs num_workers > 0")
        self.device = None if device is None else torch.device(device)
        self.prefetch_depth = check_int(prefetch_depth, "prefetch_depth", 1)
        # With a device the prefetcher pins and copies itself; otherwise pin when CUDA is there.
        default_pin = torch.cuda.is_available() and self.device is None
        self.pin_memory = default_pin if pin_memory is None else bool(pin_memory)
        check_int(prefetch_factor, "prefetch_factor", 1, none_ok=True)
        if prefetch_factor is not None and not self.num_workers:
            raise ValueError("prefetch_factor needs num_workers > 0 (batches are read ahead by workers)")
        self._prefetch_given = prefetch_factor is not None
        if prefetch_factor is None and self.workers == "processes":
            prefetch_factor = _PROCESS_PREFETCH
        self._loader_args = dict(prefetch_factor=prefetch_factor, persistent_workers=bool(persistent_workers),
                                 multiprocessing_context=multiprocessing_context, timeout=timeout,
                                 worker_init_fn=worker_init_fn)
        self._epoch = self._source.epoch
        self._pass: _Pass | None = None  # the running (or last) pass of this epoch; None: the source's origin next
        self._loader: DataLoader | None = None
        self._loader_revision = -1  # the stream's plan revision its persistent workers were started with
        self._init_stats(stall_s)
        if isinstance(self._source, _Stream):  # the stream asks where the loader stands (BlendedStream.set_weights)
            self._source.stream._stand = weakref.WeakMethod(self._steering_position)

    @property
    def slot_bytes(self) -> int:
        """Shared memory of the worker processes' hand-off slots mapped in this process (all loaders'
        and plain DataLoaders' over streamshard streams); 0 while only thread workers ran."""
        return mapped_bytes()

    # -- epoch and length -----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def sampler(self) -> Any:
        """For a map-style dataset its ``ElasticSampler``; for a stream an object whose ``set_epoch``
        is the loader's (frameworks such as Lightning call ``loader.sampler.set_epoch(e)`` each epoch)."""
        return self._source.sampler if isinstance(self._source, _Sampled) else _EpochSetter(self)

    def set_epoch(self, epoch: int) -> None:
        """Start a full pass of ``epoch`` on the next iteration, unless a state for ``epoch`` was
        loaded and no pass has used it yet (then the next pass resumes it)."""
        epoch = check_int(epoch, "epoch", 0)
        self._pass = None  # a pass running now is superseded: its next batch raises
        self._epoch = epoch
        self._source.set_epoch(epoch)  # the source keeps a loaded state of this epoch that no pass used

    def __len__(self) -> int:
        """This rank's epoch in batches as a framework counts them, constant through the epoch: the
        batches a loaded state says were consumed before, plus those of the pass that resumes it
        (a fresh epoch: all of its batches). torchdata's ``StatefulDataLoader`` and Lightning's loops
        take ``len`` as the whole epoch and count a resumed epoch from their restored batch index.
        A stream that is not ``sized`` (raw text counted beside training) has none: ``TypeError``."""
        if isinstance(self._source, _Stream) and not getattr(self._source.stream, "sized", True):
            raise TypeError(unsized_message(self._source.stream))
        origin = self._next_origin(advance=False)
        return self._source.batches_before(origin) + self._source.pass_batches(origin, self.num_workers)

    def batches_left(self) -> int:
        """Batches this rank still yields in the current epoch: the rest of the running (or stopped)
        pass, else all the next pass yields (after ``load_state_dict``: the rest of the resumed epoch)."""
        origin = self._next_origin(advance=False)  # first: it follows an epoch set on the dataset
        consumed = self._pass.consumed if self._pass is not None else 0
        return self._source.pass_batches(origin, self.num_workers) - consumed

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """Where this rank is: the state after the batches this loader handed out (after the last
        batch of an epoch: the start of the next epoch). ``unconsumed``: the last batches handed out
        that training has not consumed yet (a framework that reads ahead: Lightning reads one batch
        ahead of training from a loader without a length; ``ElasticResume`` passes it), counted as
        not handed out: a resume delivers them again."""
        self._follow_dataset_epoch()
        unconsumed = check_int(unconsumed, "unconsumed", 0) or batches_read_ahead(self)
        if unconsumed:
            if self._pass is None or unconsumed > self._pass.consumed:
                raise ValueError(f"unconsumed={unconsumed}, but the running pass handed out "
                                 f"{0 if self._pass is None else self._pass.consumed} batches")
            return self._source.state_after(self._pass.origin, self._pass.consumed - unconsumed, self.num_workers)
        if self._pass is not None:
            return self._source.state_after(self._pass.origin, self._pass.consumed, self.num_workers)
        return self._source.state_after(self._source.origin(), 0, self.num_workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (saved by any ``StreamLoader`` of the same data and settings): the
        next pass resumes it, and no later one."""
        if isinstance(state, Mapping) and state.get("kind") == "worker":
            raise StateError("this is a per-worker state from torchdata's StatefulDataLoader; StreamLoader loads "
                             "the rank states it saves itself")
        self._source.load_state_dict(state)
        self._epoch, self._pass = self._source.epoch, None
        self._loader = None  # workers must start from the new position

    # -- steering -----------------------------------------------------------------------------
    def skip(self, num_batches: int) -> None:
        """Skip this rank's next ``num_batches`` batches without reading them: they count as consumed.

        For loss-spike recovery: resume the checkpoint before the spike, ``skip`` the batches that
        caused it, train on. Afterwards ``state_dict()`` is what an uninterrupted run has after
        iterating those batches, and the next batch is the one that run would give next, on any
        topology (after ``load_state_dict`` the skip counts from the resumed position). A skip past
        the end of the epoch goes on into the next epochs. Called inside a ``for batch in loader``
        loop, the loop goes on after the skipped batches (the workers restart there; a skip that
        reaches the end of the epoch ends the loop, like the epoch's end). Every rank of a
        synchronous job must skip the same number (their states stay equal).
        """
        left = check_int(num_batches, "num_batches", 0)
        while left > 0:
            current = self._standing_pass()
            room = self._source.pass_batches(current.origin, self.num_workers) - current.consumed
            if room <= 0:
                raise ValueError(f"cannot skip: epoch {current.epoch} has no batches for this rank")
            taken = min(left, room)
            current.consumed += taken
            current.restart = True
            left -= taken  # what is left goes on into the next epoch (``_standing_pass`` moves there)

    def _steering_position(self) -> Position:
        """Where this rank's next batch comes from, for a stream whose plan changes from there on
        (``BlendedStream.set_weights``); a loop running the pass re-plans after the batch it holds."""
        self._follow_dataset_epoch()
        last = self._pass
        if last is None:
            return self._source.origin()
        if last.consumed < self._source.pass_batches(last.origin, self.num_workers):
            last.restart = True
        return self._source.continue_after(last.origin, last.consumed, self.num_workers)

    def _standing_pass(self) -> _Pass:
        """The pass the next batch comes from, as a ``_Pass`` that ``skip`` may move on: the running
        or stopped pass if batches are left in it, else the next pass (a loaded state it uses up)."""
        self._follow_dataset_epoch()
        last = self._pass
        if last is not None and last.consumed < self._source.pass_batches(last.origin, self.num_workers):
            return last
        if last is not None:
            self.set_epoch(self._epoch + 1)  # the last pass ended (its loop just did not see the end)
        self._pass = _Pass(self._epoch, self._source.take_origin())
        return self._pass

    # -- what the data path costs -----------------------------------------------------------------
    def _init_stats(self, stall_s: float) -> None:
        if isinstance(stall_s, bool) or not isinstance(stall_s, (int, float)) or not stall_s >= 0:
            raise ValueError(f"stall_s must be a number of seconds >= 0, got {stall_s!r}")
        self._loop_stats = LoopStats(float(stall_s))
        self._worker_times = WorkerTimes(self.num_workers) if isinstance(self._source, _Stream) else None

    def stats(self) -> dict[str, Any]:
        """Where the data path's time went since this loader was made: a dict of plain numbers.

        Counted in the training loop's thread: ``wait_s`` (seconds the loop spent waiting inside
        ``next()`` for a batch, each pass's start-up included), ``batches`` and ``rows`` handed out
        (rows: entries of ``sample_id`` that are not padding; a ``PackedStream``'s are tokens),
        ``max_wait_s``, ``stalls`` (waits longer than ``stall_s``) with ``stall_wait_s`` and
        ``recent_stalls`` (the last 16: epoch, step of the epoch as ``len`` counts it, seconds).
        Counted by each worker (streams only; a map-style dataset's workers report nothing):
        ``workers``, one dict per worker (``rows``, ``batches``, ``busy_s``, ``wait_s``, ``read_s``,
        ``io_s``, ``decode_s``, ``prepare_s``, ``convert_s``, ``read_bytes``; see
        ``loader_stats.WorkerTimes``; read-ahead included), and ``bytes_read``, their sum of bytes
        fetched from storage. Cheap enough to leave on: a few counters per batch, no per-row work.
        """
        out = self._loop_stats.as_dict()
        workers = self._worker_times.rows() if self._worker_times is not None else []
        out["bytes_read"] = sum(w["read_bytes"] for w in workers)
        out["workers"] = workers
        return out

    def _step_waited_for(self) -> tuple[int, int]:
        """``(epoch, step)`` of the batch the loop is waiting for: the step as ``len`` counts the epoch."""
        current = self._pass
        if current is None:
            return self._epoch, 0
        return current.epoch, self._source.batches_before(current.origin) + current.consumed

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """The rest of the current pass (after a ``break``), else the next one. Nothing starts until
        the first batch is asked for, so a framework's ``iter()`` probe changes nothing. A ``skip()``
        inside the loop restarts the pass after the skipped batches, a new plan (``set_weights``)
        after the batch in hand."""
        while True:
            current = yield from self._one_pass()
            if not current.restart or self._pass is not current:
                return  # the pass ended, or a skip took it beyond its end (the next epoch)
            if current.consumed >= self._source.pass_batches(current.origin, self.num_workers):
                self.set_epoch(self._epoch + 1)  # skipped to the epoch's end: the loop ends like the epoch
                return

    def _one_pass(self) -> Iterator[Any]:
        """One pass of ``__iter__``; returns its ``_Pass``."""
        origin = self._next_origin(advance=True)
        in_process = self.workers in ("threads", "none") and isinstance(self._source, _Stream)
        # In this process a catalog may come from the last listing of its paths, confirmed before the
        # first batch leaves (``_confirmed``): its first reads and decoding overlap the listing.
        speculates = in_process and hasattr(self._source.stream, "confirm_catalog")
        if speculates:
            self._source.stream._speculate = True
        try:
            self._source.set_epoch(self._epoch)  # the catalog is read here once; workers inherit it
        finally:
            if speculates:
                self._source.stream._speculate = False
        current = self._pass = _Pass(self._epoch, origin)
        if self._worker_times is not None:  # the pass's workers report their timings into this loader's table
            self._source.stream._worker_times = self._worker_times
        if in_process:
            def start() -> Iterator[Any]:
                passes = self._source.stream.worker_passes(self.num_workers, origin)
                if self.workers == "none":
                    return passes[0]
                depth = self._loader_args["prefetch_factor"] or 2  # None: 2 units of ready batches per worker
                started = round_robin(passes, depth, self._loader_args["timeout"])
                if self.pin_memory and torch.cuda.is_available():
                    started = map(_pinned, started)
                return started

            batches: Iterator[Any] = _confirmed(start, self._source, self._epoch) if speculates else start()
        elif isinstance(self._source, _Stream):
            with self._source.stream.handing_over(origin):  # the workers' copies resume it; this process does not
                # worker processes hand batches over through slots, several a message, merged back in order
                batches = merged(iter(self._data_loader(origin)), self.num_workers)
        else:
            batches = iter(self._data_loader(origin))
        if self.device is not None:
            batches = iter(DevicePrefetcher(batches, self.device, self.prefetch_depth))
        batches = self._loop_stats.timed(iter(batches), self._step_waited_for)
        for batch in batches:
            if self._pass is not current or self._source.epoch != current.epoch:
                raise StateError(
                    f"set_epoch({self._source.epoch}) was called (or a state loaded) on the loader or its dataset while "
                    f"StreamLoader was delivering epoch {current.epoch}; call them between passes, not inside the loop")
            current.consumed += 1
            yield batch
            if current.restart:
                break
        else:
            if self._pass is current:  # the epoch is exhausted: the next pass starts the next one
                self.set_epoch(self._epoch + 1)
        _close(batches)
        return current

    def _next_origin(self, advance: bool) -> Any:
        """Where the next pass starts: the rest of the last pass if it stopped early (``break``), the
        next epoch if it ended, else a loaded state or the epoch's beginning. ``advance``: a pass
        really starts (it uses up a loaded state; it moves on from an ended epoch); without it, the
        origin ``len()`` counts from."""
        self._follow_dataset_epoch()
        last = self._pass
        if last is None or (advance and last.superseded):
            return self._source.take_origin() if advance else self._source.origin()
        if not advance:  # len(): the epoch of the running (or last) pass, counted from its beginning
            return last.origin
        if last.consumed < self._source.pass_batches(last.origin, self.num_workers):
            return self._source.continue_after(last.origin, last.consumed, self.num_workers)
        self.set_epoch(self._epoch + 1)  # the last pass ended (its loop just did not see the end)
        return self._source.take_origin()

    def _data_loader(self, origin: Any) -> DataLoader:
        # Persistent workers can run another pass unless it starts mid-epoch: a stream's workers take a
        # resumed origin only when they start (a map-style sampler resumes in this process, always fine).
        fresh = not isinstance(self._source, _Stream) or origin.fresh
        revision = self._source.stream._revision if isinstance(self._source, _Stream) else 0
        reusable = (self._loader is not None and self._loader_args["persistent_workers"] and fresh
                    and revision == self._loader_revision)
        if not reusable:
            args = dict(self._loader_args)
            if isinstance(self._source, _Stream) and not self._prefetch_given and self.num_workers:
                if self._source.stream._batches_a_message() > 1:  # several batches a message: fewer messages in flight
                    args["prefetch_factor"] = _CHUNK_PREFETCH
            self._loader = self._source.data_loader(num_workers=self.num_workers, pin_memory=self.pin_memory, **args)
            self._loader_revision = revision
        assert self._loader is not None
        return self._loader

    def _follow_dataset_epoch(self) -> None:
        """A ``set_epoch`` called on the dataset (or sampler) directly moves the loader to that epoch."""
        if self._source.epoch != self._epoch:
            self._epoch, self._pass = self._source.epoch, None

    def __repr__(self) -> str:
        consumed = self._pass.consumed if self._pass is not None else 0
        return (f"StreamLoader({type(self.dataset).__name__}, num_workers={self.num_workers}, epoch={self._epoch}, "
                f"consumed={consumed})")


def _confirmed(start: Callable[[], Iterator[Any]], source: Any, epoch: int) -> Iterator[Any]:
    """The pass's batches from ``start()``, the first held until the dataset confirms its catalog
    (``ParquetStream.confirm_catalog``): one built from this process's last listing of its paths, while
    that listing ran beside the first reads. If the files changed since, nothing was delivered: the pass
    starts again on a catalog of the files as they are now (a read that failed meanwhile, a rewritten
    file's refused GET, counts only if the catalog stands)."""
    batches = start()
    try:
        first, failure = next(batches, _END), None
    except Exception as exc:  # noqa: BLE001 - raised below unless the catalog was stale
        first, failure = _END, exc
    if not source.stream.confirm_catalog():
        _close(batches)  # the workers stop before the catalog they read through is replaced
        source.set_epoch(epoch)  # a catalog of the files as listed now
        batches = start()
        first, failure = next(batches, _END), None
    if failure is not None:
        raise failure
    if first is _END:
        return
    try:
        yield first
        yield from batches
    finally:
        _close(batches)


_END = object()


def _close(batches: Iterator[Any]) -> None:
    """Stop a pass's batches now (thread workers, device copies), not when they are collected."""
    close = getattr(batches, "close", None)
    if callable(close):
        close()


def _source(dataset: Any, sampler: Any, batch_size: Any, collate_fn: Any, drop_last: Any) -> _Source:
    """The adapter for ``dataset``; ValueError naming the argument that does not fit it."""
    is_stream = all(callable(getattr(dataset, name, None))
                    for name in ("take_origin", "pass_batches", "position_after", "worker_passes", "set_epoch"))
    if is_stream or isinstance(dataset, IterableDataset):
        for name, value, default in (("sampler", sampler, None), ("batch_size", batch_size, None),
                                     ("collate_fn", collate_fn, None), ("drop_last", drop_last, False)):
            if value is not default:
                raise ValueError(f"{name}= is for map-style datasets with an ElasticSampler; "
                                 f"{type(dataset).__name__} is a stream, which batches itself")
        if not is_stream:
            raise ValueError(f"StreamLoader needs a streamshard stream (ParquetStream, BlendedStream), got "
                             f"{type(dataset).__name__}, an IterableDataset without their pass arithmetic (stream_base.PlannedStream)")
        return _Stream(dataset)
    if not isinstance(sampler, ElasticSampler):
        raise ValueError(f"StreamLoader needs a streamshard stream (ParquetStream, BlendedStream), or a map-style "
                         f"dataset with sampler=ss.ElasticSampler(len(dataset), ...); got {type(dataset).__name__} "
                         f"with sampler={sampler!r:.80}")
    if not callable(getattr(dataset, "__getitem__", None)):
        raise ValueError(f"dataset must be a stream or a map-style dataset (with __getitem__), "
                         f"got {type(dataset).__name__}")
    if hasattr(dataset, "__len__") and len(dataset) != sampler.dataset_len:
        raise ValueError(f"sampler has dataset_len={sampler.dataset_len} but len(dataset)={len(dataset)}")
    if collate_fn is not None and not callable(collate_fn):
        raise ValueError(f"collate_fn must be callable or None, got {collate_fn!r:.80}")
    batch_size = 1 if batch_size is None else check_int(batch_size, "batch_size", 1)
    return _Sampled(dataset, sampler, batch_size, check_bool(drop_last, "drop_last"), collate_fn)
