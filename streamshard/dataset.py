"""``ParquetStream``: an ``IterableDataset`` that gives every row to exactly one global worker.

Each DataLoader worker computes its own plan from the same inputs (catalog, seed, epoch,
topology), so workers and ranks agree without talking to each other. Nothing is opened in
``__init__``: the footers are read on first use of the catalog, the data files in ``__iter__``.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset

from .batches import SAMPLE_ID, as_batch, clone, concat, padding_like, rebatch, with_ids
from .canonical import CanonicalPlan
from .catalog import Catalog
from .errors import ReadError
from .elastic import STATE_VERSION, Segment, resume_plan, worker_batches_delivered
from .plan import EpochPlan, Layout, PlanConfig, Pieces, interleave_index, skip_rows
from .reader import RowGroupReader, read_ahead
from .tensors import LIST_FORMATS, Batch, BatchConverter
from .topology import Topology, distributed_rank_world, current_worker, resolve_rank_world

log = logging.getLogger("streamshard")


class ParquetStream(IterableDataset):
    """Stream Parquet files (any fsspec URL, directory or glob) as batches of tensors.

    Every batch is a ``dict[str, torch.Tensor]`` (strings stay Python lists) with an int64
    ``sample_id``: the row's global index in catalog order, or -1 for a padding row. Use it as
    ``DataLoader(ds, batch_size=None, num_workers=N)``; with ``uneven="pad"`` every global
    worker (``rank * num_workers + worker_id``) yields the same number of batches, so DDP
    never waits on a rank that ran dry.

    Args:
        paths: a file, directory or glob, or a list of them; any fsspec URL.
        columns: columns to read (None: all). Missing columns are an error at catalog time.
        batch_size: None for one batch per row-group slice; an int for exactly that many rows
            per batch (a short last batch is padded with padding rows, or dropped with "drop").
        unit: what is shuffled and kept together: "row_group" or "file". Work is always
            balanced by rows; a unit may be split between two neighbouring workers.
        shuffle, seed: permute units and rows within each piece, deterministically per
            (seed, epoch); call ``set_epoch`` every epoch.
        uneven: "pad" (padding batches, sample_id -1) or "drop" (every worker truncated to the
            smallest count; ``epoch_summary`` reports the dropped rows and a warning is logged).
        rank, world_size: default to torch.distributed, then RANK/WORLD_SIZE, then 0/1.
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        transform: called on each batch inside the worker (padding batches included).
        read_ahead: row-group slices read in the background ahead of the one being consumed.
        shuffle_window: with shuffle, interleave the rows of this many consecutive pieces of a
            worker at random (no extra I/O; a worker then holds that many row groups at once).
        partitions: canonical partitions for a topology-independent order (see ``canonical.py``):
            the rows of each global step are the same for every world size W with
            W * num_workers dividing ``partitions``, given the same global batch
            (``batch_size * W``) and ``num_workers``. Needs an int ``batch_size``.
        catalog_cache: a directory where the catalog is cached (JSON); files whose size and
            ETag/mtime are unchanged are not read again. None: no cache.
        lists: "padded" (variable-length list columns as 2-D tensors + lengths) or "flat"
            (1-D values of all rows + lengths; ``ss.pad_lists`` pads them later, e.g. on the
            GPU: fewer bytes between DataLoader workers and the main process).
    """

    def __init__(
        self,
        paths: str | Sequence[str],
        columns: Sequence[str] | None = None,
        batch_size: int | None = None,
        unit: str = "row_group",
        shuffle: bool = False,
        seed: int = 0,
        uneven: str = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        transform: Callable[[Batch], Any] | None = None,
        read_ahead: int = 2,
        shuffle_window: int = 1,
        partitions: int | None = None,
        catalog_cache: str | None = None,
        lists: str = "padded",
    ) -> None:
        super().__init__()
        if isinstance(paths, (list, tuple)):
            if not paths or not all(isinstance(p, str) for p in paths):
                raise ValueError(f"paths must be a non-empty str or list of str, got {paths!r}")
            self.paths: list[str] = list(paths)
        elif isinstance(paths, str) and paths:
            self.paths = [paths]
        else:
            raise ValueError(f"paths must be a non-empty str or list of str, got {paths!r}")
        if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
            raise ValueError(f"columns must be a list of column names or None, got {columns!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        if not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
        self.columns = list(columns) if columns is not None else None
        self.config = PlanConfig(
            unit=unit, shuffle=bool(shuffle), seed=seed, batch_size=batch_size, uneven=uneven, shuffle_window=shuffle_window
        )
        if partitions is not None and (isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1):
            raise ValueError(f"partitions must be a positive int or None, got {partitions!r}")
        if partitions is not None and (batch_size is None or shuffle_window != 1):
            raise ValueError("partitions= needs an int batch_size and shuffle_window=1")
        self.partitions = partitions
        self._topology_given = rank is not None and world_size is not None
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self._warned: set[str] = set()
        self.storage_options = dict(storage_options or {})
        self.transform = transform
        self.read_ahead = read_ahead
        self.catalog_cache = catalog_cache
        if lists not in LIST_FORMATS:
            raise ValueError(f"lists must be one of {LIST_FORMATS}, got {lists!r}")
        self.lists = lists
        self._catalog: Catalog | None = None
        self._converter: BatchConverter | None = None  # derived from the catalog; not pickled
        # Shared memory, so set_epoch reaches persistent DataLoader workers too.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._resume: dict[str, Any] | None = None  # a loaded state, applied to iterations of its epoch
        self._progress: dict[str, Any] | None = None  # what this object's current iteration delivered

    # -- epoch and catalog --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose (seed, epoch) order the next ``__iter__`` follows.

        Called in the main process before iterating, it also reads the footers the first time,
        so DataLoader workers inherit the catalog instead of each reading every footer again.
        """
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch.fill_(int(epoch))
        self.converter  # noqa: B018 - builds the catalog and checks the column types once
        # pyarrow imports pandas (when installed) on its first pa.array() in a process, ~0.2-0.5 s;
        # paying it here once lets forked DataLoader workers inherit the import instead of each paying it.
        pa.array(np.zeros(1, dtype=np.int64))
        self._warn_about_traps()

    def _warn_about_traps(self, num_workers: int | None = None) -> None:
        """Warn (once each) about set-ups that work here but fail or waste time elsewhere."""
        if not self._topology_given:
            dist_rank, dist_world = distributed_rank_world()
            if dist_world is not None and (dist_rank, dist_world) != (self.rank, self.world_size):
                self._warn_once(
                    "topology",
                    f"ParquetStream was built as rank {self.rank} of {self.world_size}, but torch.distributed "
                    f"now says rank {dist_rank} of {dist_world}: build the dataset after init_process_group, "
                    "or pass rank= and world_size=",
                )
        if self.transform is not None and "transform" not in self._warned:
            try:
                pickle.dumps(self.transform)
            except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing here
                self._warn_once(
                    "transform",
                    f"transform {self.transform!r} cannot be pickled ({exc}); DataLoader workers started with "
                    "'spawn' or 'forkserver' (macOS, Windows, Python 3.14+) will fail: define it at module level",
                )
        if num_workers is not None and self._catalog is not None and self.partitions is None:
            units = int(np.count_nonzero(self.catalog.rg_rows)) if self.config.unit == "row_group" else int(
                np.count_nonzero(np.bincount(self.catalog.rg_file, weights=self.catalog.rg_rows))
            )
            workers = self.world_size * max(num_workers, 1)
            if 0 < units < workers:
                self._warn_once(
                    "units",
                    f"{workers} global workers share {units} non-empty {self.config.unit.replace('_', ' ')}s: "
                    "units are split between workers, and each split one is decoded by every worker that "
                    "shares it; write smaller row groups or use fewer workers",
                )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)
            log.warning(message)

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    @property
    def catalog(self) -> Catalog:
        """The files and row groups, read from the footers on first access (then kept)."""
        if self._catalog is None:
            catalog = Catalog.build(self.paths, self.columns, self.storage_options, cache_dir=self.catalog_cache)
            self._converter = BatchConverter(catalog.schema, source=catalog.urls[0], lists=self.lists)
            self._catalog = catalog
        return self._catalog

    @property
    def converter(self) -> BatchConverter:
        """How this dataset's columns become tensors (checked against the schema on first use)."""
        if self._converter is None:
            self._converter = BatchConverter(self.catalog.schema, source=self.catalog.urls[0], lists=self.lists)
        return self._converter

    def __getstate__(self) -> dict[str, Any]:
        # Spawned DataLoader workers receive a pickled copy: plain data only, no closures or handles.
        return {**self.__dict__, "_converter": None}

    @property
    def layout(self) -> Layout:
        return self.catalog.layout

    def epoch_plan(self, num_workers: int = 0, epoch: int | None = None) -> EpochPlan:
        """The plan of a whole epoch for this dataset's world size and ``num_workers`` DataLoader workers."""
        topology = Topology(0, self.world_size, 0, num_workers)
        return EpochPlan(self.layout, self.config, self.epoch if epoch is None else epoch, topology.num_global_workers)

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self, consumed_batches: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """A small JSON-serialisable state to resume this epoch from.

        * ``state_dict()`` is this object's own progress. Inside a DataLoader worker (as
          torchdata's ``StatefulDataLoader`` calls it) that is the worker's progress; with
          ``num_workers=0`` it is the rank's. It resumes on the same topology.
        * ``state_dict(consumed_batches=k, num_workers=N)``, called anywhere, describes a rank
          whose ``DataLoader(num_workers=N)`` delivered ``k`` batches since this epoch's iteration
          began (after the last ``load_state_dict``). The same state serves every rank, and it
          resumes on any world size and worker count (elastic), each remaining row exactly once.
        """
        epoch = self.epoch
        if consumed_batches is None:
            progress = self._progress if self._progress and self._progress["epoch"] == epoch else None
            if progress is None:
                return self._rank_state(0, 0) if self._resume is None else dict(self._resume)
            if progress["num_workers"] == 0:
                return self._rank_state(progress["delivered"] - progress["skip"], 0)
            return {
                **self._state_header(progress["history"]),
                "kind": "worker",
                "world_size": self.world_size,
                "num_workers": progress["num_workers"],
                "rank": self.rank,
                "worker_id": progress["worker_id"],
                "role": progress["role"],
                "batches": progress["delivered"],
            }
        if isinstance(consumed_batches, bool) or not isinstance(consumed_batches, (int, np.integer)) or consumed_batches < 0:
            raise ValueError(f"consumed_batches must be an int >= 0, got {consumed_batches!r}")
        return self._rank_state(int(consumed_batches), int(num_workers or 0))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a ``state_dict``: the next iteration of its epoch continues where it stopped."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a streamshard state (version {STATE_VERSION} expected): {state!r:.200}")
        if state["seed"] != self.config.seed or state["shuffle"] != self.config.shuffle:
            raise ValueError(
                f"state was saved with seed={state['seed']}, shuffle={state['shuffle']}; this dataset has "
                f"seed={self.config.seed}, shuffle={self.config.shuffle}, so the order would differ"
            )
        if state.get("partitions") != self.partitions:
            raise ValueError(f"state was saved with partitions={state.get('partitions')}, this dataset has {self.partitions}")
        if state["rows"] != self.catalog.num_rows or state["files"] != self.catalog.num_files:
            raise ValueError(
                f"state was saved for {state['files']} files / {state['rows']} rows; these paths have "
                f"{self.catalog.num_files} files / {self.catalog.num_rows} rows"
            )
        self._resume = dict(state)
        self._progress = None
        self._epoch.fill_(int(state["epoch"]))

    @property
    def _active_resume(self) -> dict[str, Any] | None:
        """The loaded state, if it belongs to the current epoch (a state applies to its epoch only)."""
        return self._resume if self._resume and self._resume["epoch"] == self.epoch else None

    def _state_header(self, history: list[Segment]) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
            "rows": self.catalog.num_rows,
            "files": self.catalog.num_files,
            "history": [segment.to_json() for segment in history],
            "partitions": self.partitions,
        }

    def _rank_state(self, consumed: int, num_workers: int) -> dict[str, Any]:
        history, before = self._resumed_history(num_workers)
        segment = Segment(self.world_size, num_workers, before + consumed)
        return {**self._state_header(history + [segment]), "kind": "rank"}

    def _resumed_history(self, num_workers: int) -> tuple[list[Segment], int]:
        """Segments completed before this topology, and batches per rank already consumed in it."""
        state = self._active_resume
        if state is None:
            return [], 0
        history = [Segment.from_json(s) for s in state["history"]]
        if state["kind"] == "worker":
            return history, 0
        last = history[-1] if history else None
        if last is not None and (last.world_size, last.num_workers) == (self.world_size, num_workers):
            return history[:-1], last.batches
        return history, 0

    def _resolve(self, worker_id: int, num_workers: int) -> tuple[EpochPlan, list[Segment], int, int, int]:
        """(plan, completed history, role, batches this role already delivered, rank batches before)."""
        history, before = self._resumed_history(num_workers)
        state = self._active_resume
        if state is not None and state["kind"] == "worker":
            if (state["world_size"], state["num_workers"], state["rank"]) != (self.world_size, num_workers, self.rank):
                raise ValueError(
                    "a per-worker state resumes only on the topology that saved it "
                    f"(world_size={state['world_size']}, num_workers={state['num_workers']}); for elastic "
                    "resizing save state_dict(consumed_batches=..., num_workers=...) instead"
                )
            plan, _ = resume_plan(self.layout, self.config, self.epoch, history, self.world_size, num_workers)
            if state["worker_id"] != worker_id:
                raise ValueError(f"state of worker {state['worker_id']} loaded into worker {worker_id}")
            return plan, history, int(state["role"]), int(state["batches"]), 0
        full = history + ([Segment(self.world_size, num_workers, before)] if before else [])
        plan, before = resume_plan(self.layout, self.config, self.epoch, full, self.world_size, num_workers)
        # A restarted DataLoader starts its round-robin at worker 0, where the uninterrupted run
        # would continue at worker `before % n`: worker w takes over the role of that one.
        n = max(num_workers, 1)
        role = (worker_id + before) % n
        return plan, history, role, worker_batches_delivered(before, num_workers, role), before

    def epoch_summary(self, num_workers: int = 0, epoch: int | None = None) -> dict[str, Any]:
        """Steps, rows, padding and dropped rows of an epoch (what ``uneven`` costs)."""
        plan = self.epoch_plan(num_workers, epoch)
        real = np.minimum(plan.batches_per_worker(), plan.steps)
        return {
            "epoch": plan.epoch,
            "global_workers": plan.num_workers,
            "rows": plan.total_rows,
            "steps_per_worker": plan.steps,
            "padding_batches": int((plan.steps - real).sum()),
            "dropped_rows": plan.dropped_rows(),
        }

    def steps_per_epoch(self, num_workers: int = 0, epoch: int | None = None) -> int:
        """Batches each rank gets from ``DataLoader(ds, batch_size=None, num_workers=...)``."""
        return self.epoch_plan(num_workers, epoch).steps * max(num_workers, 1)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        worker_id, num_workers = current_worker()
        if worker_id == 0:
            self._warn_about_traps(num_workers)
        if self.partitions is not None:
            batches = self._iter_canonical(worker_id, num_workers)
        else:
            batches = self._iter_stream(worker_id, num_workers)
        return batches if self.transform is None else (self.transform(batch) for batch in batches)

    def _start_progress(self, history: list[Segment], num_workers: int, worker_id: int, role: int, skip: int) -> dict[str, Any]:
        """Record what this iteration delivers, for ``state_dict()`` (per worker)."""
        self._progress = {
            "epoch": self.epoch, "history": history, "num_workers": num_workers, "worker_id": worker_id,
            "role": role, "skip": skip, "delivered": skip,
        }
        return self._progress

    def _iter_stream(self, worker_id: int, num_workers: int) -> Iterator[Batch]:
        plan, history, role, skip, _ = self._resolve(worker_id, num_workers)
        worker = Topology(self.rank, self.world_size, role, num_workers).global_worker_id
        if worker == 0 and self.config.uneven == "drop" and plan.dropped_rows():
            log.warning("uneven='drop' leaves out %d of %d rows in epoch %d", plan.dropped_rows(), plan.total_rows, plan.epoch)
        progress = self._start_progress(history, num_workers, worker_id, role, skip)
        work = plan.worker_plan(worker)
        real, bs = work.real_batches, self.config.batch_size
        first = _first_to_read(skip, real, work.steps)
        skipped_rows = int(work.pieces.rows[:first].sum()) if bs is None else first * bs
        reader = self._reader()
        try:
            tables = self._delivered_tables(plan, work.pieces, skipped_rows, reader)
            real_batches = rebatch(tables, bs, real - first, self.converter)
            yield from self._deliver(real_batches, first, skip, real, work.steps, plan, reader, progress)
        finally:
            reader.close()

    def _deliver(
        self, real_batches: Iterator[Batch], first: int, skip: int, real: int, steps: int,
        plan: EpochPlan, reader: RowGroupReader, progress: dict[str, Any],
    ) -> Iterator[Batch]:
        """Yield real batches ``first..real-1`` from number ``skip`` on, then padding up to ``steps``.

        Padding copies the shape of the worker's last real batch, so a resume past it reads that
        one again (without yielding it); a worker with no rows copies a row group of the dataset.
        """
        last: Batch | None = None
        for index, last in enumerate(real_batches, start=first):
            if index >= skip:
                progress["delivered"] += 1
                yield last
        padding = steps - max(real, skip)
        if padding > 0:
            template = last if last is not None else self._template_batch(reader, plan)
            pad = padding_like(template, len(template[SAMPLE_ID]), self.converter.ragged_keys)
            for _ in range(padding):
                progress["delivered"] += 1
                yield clone(pad)

    # -- canonical (topology-independent) order -------------------------------------------------
    def canonical_plan(self, num_workers: int = 0, epoch: int | None = None) -> CanonicalPlan:
        """The canonical-order plan of an epoch (only with ``partitions=``)."""
        if self.partitions is None:
            raise ValueError("canonical_plan needs partitions=")
        epoch = self.epoch if epoch is None else epoch
        return CanonicalPlan(self.layout, self.config, epoch, self.partitions, self.world_size, num_workers)

    def _iter_canonical(self, worker_id: int, num_workers: int) -> Iterator[Batch]:
        plan = self.canonical_plan(num_workers)
        state = self._active_resume
        history = [Segment.from_json(s) for s in state["history"]] if state else []
        if state is not None and state["kind"] == "worker":
            role, skip = int(state["role"]), int(state["batches"])
            if (state["world_size"], state["num_workers"], state["worker_id"]) != (self.world_size, num_workers, worker_id):
                raise ValueError("a per-worker state resumes only on the topology that saved it")
        else:
            if any(max(s.num_workers, 1) != plan.n for s in history):
                raise ValueError(
                    f"canonical order needs the same number of DataLoader workers on resume ({plan.n} now, "
                    f"{[s.num_workers for s in history]} before); use partitions=None for elastic resume across worker counts"
                )
            before = sum(s.batches for s in history)  # global steps: the same count on every topology
            role = (worker_id + before) % plan.n
            skip = worker_batches_delivered(before, num_workers, role)
            history = history[:-1] if history and (history[-1].world_size, history[-1].num_workers) == (self.world_size, num_workers) else history
        progress = self._start_progress(history, num_workers, worker_id, role, skip)
        return self._canonical_batches(plan, plan.owned(self.rank, role), skip, progress)

    def _canonical_batches(self, plan: CanonicalPlan, owned: np.ndarray, skip: int, progress: dict[str, Any]) -> Iterator[Batch]:
        bs = self.config.batch_size
        assert bs is not None  # checked at construction
        real = min(int((-(-plan.rows[owned] // plan.micro)).max(initial=0)), plan.steps)
        first = _first_to_read(skip, real, plan.steps)
        reader = self._reader()
        cache: OrderedDict[int, pa.Table] = OrderedDict()  # decoded row groups, one per owned partition

        def build(i: int) -> Batch:
            pieces = plan.batch_pieces(owned, i)
            tables = [self._read_piece(reader, plan.stream, rg, lo, hi, cache, len(owned) + 2)
                      for rg, lo, hi in zip(pieces.rg.tolist(), pieces.lo.tolist(), pieces.hi.tolist())]
            table = pa.concat_tables(tables)
            batch = as_batch(table, self.converter)
            if table.num_rows < bs:  # owned partitions ran short: top up to exactly batch_size rows
                batch = concat(batch, padding_like(batch, bs - table.num_rows, self.converter.ragged_keys))
            return batch

        try:
            real_batches = read_ahead(build, range(first, real), self.read_ahead)  # one thread: `cache` is not shared
            yield from self._deliver(real_batches, first, skip, real, plan.steps, plan.stream, reader, progress)
        finally:
            reader.close()

    def _reader(self) -> RowGroupReader:
        catalog = self.catalog
        return RowGroupReader.from_catalog(catalog, self.storage_options)

    def iter_piece_tables(
        self, plan: EpochPlan, pieces: Pieces, reader: RowGroupReader | None = None
    ) -> Iterator[pa.Table]:
        """Arrow tables of ``pieces`` (rows in the plan's order) with a ``sample_id`` column, read ahead."""
        own = reader is None
        reader = reader or self._reader()
        try:
            spans = zip(pieces.rg.tolist(), pieces.lo.tolist(), pieces.hi.tolist())
            # _read_piece is thread-safe, so the read-ahead window is also the number of reads in flight.
            read = lambda span: self._read_piece(reader, plan, *span)  # noqa: E731
            yield from read_ahead(read, spans, self.read_ahead, workers=max(self.read_ahead, 1))
        finally:
            if own:
                reader.close()

    def _delivered_tables(self, plan: EpochPlan, pieces: Pieces, skip: int, reader: RowGroupReader) -> Iterator[pa.Table]:
        """A worker's rows in delivery order from delivered row ``skip`` on, one table per piece size."""
        if plan.config.shuffle_window == 1:
            yield from self.iter_piece_tables(plan, skip_rows(pieces, skip), reader)
            return
        windows = [pieces.take(w) for w in plan.windows(pieces)]
        ends = np.cumsum([int(w.rows.sum()) for w in windows])
        first = int(np.searchsorted(ends, skip, side="right"))
        start = int(ends[first - 1]) if first else 0
        tables = self.iter_piece_tables(plan, Pieces.concat(windows[first:]), reader)
        for window in windows[first:]:
            labels = plan.window_labels(window)
            merged = pa.concat_tables(list(itertools.islice(tables, len(window))))
            merged = merged.take(pa.array(interleave_index(labels)))
            bounds = np.concatenate([[0], np.cumsum(window.rows)])
            head = max(skip - start, 0)
            for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                lo = max(lo, head)
                if hi > lo:
                    yield merged.slice(lo, hi - lo)
            start += len(labels)

    def _read_piece(
        self, reader: RowGroupReader, plan: EpochPlan, rg: int, lo: int, hi: int,
        cache: OrderedDict[int, pa.Table] | None = None, capacity: int = 0,
    ) -> pa.Table:
        catalog = self.catalog
        table = cache.get(rg) if cache is not None else None
        if table is None:
            table = reader.read(int(catalog.rg_file[rg]), int(catalog.rg_index[rg]))
            if cache is not None:
                cache[rg] = table
                while len(cache) > capacity:
                    cache.popitem(last=False)
        elif cache is not None:
            cache.move_to_end(rg)
        if table.num_rows != catalog.rg_rows[rg]:
            raise ReadError(
                f"{catalog.urls[int(catalog.rg_file[rg])]}: row group {int(catalog.rg_index[rg])} has "
                f"{table.num_rows} rows but its footer said {int(catalog.rg_rows[rg])}; did the file change?"
            )
        rows = plan.row_positions(rg, lo, hi)
        table = table.take(pa.array(rows)) if plan.config.shuffle else table.slice(lo, hi - lo)
        return table.append_column(SAMPLE_ID, pa.array(rows + catalog.rg_first_id[rg]))

    def _template_batch(self, reader: RowGroupReader, plan: EpochPlan) -> Batch:
        """A batch of real shape for a worker with no rows of its own (more workers than rows)."""
        catalog, converter = self.catalog, self.converter
        nonempty = np.flatnonzero(catalog.rg_rows)
        rows = self.config.batch_size or max(1, -(-plan.total_rows // plan.num_workers))
        if len(nonempty) == 0:  # an empty dataset has no shapes to copy; a 0-row batch keeps the keys
            table = pa.Table.from_batches([], schema=catalog.schema)
            return with_ids(converter(table), np.zeros(0, dtype=np.int64))
        rg = int(nonempty[0])
        table = reader.read(int(catalog.rg_file[rg]), int(catalog.rg_index[rg])).slice(0, rows)
        batch = with_ids(converter(table), np.full(table.num_rows, -1, dtype=np.int64))
        if table.num_rows < rows:
            batch = concat(batch, padding_like(batch, rows - table.num_rows, self.converter.ragged_keys))
        return batch


def _first_to_read(skip: int, real: int, steps: int) -> int:
    """The first real batch a worker must build when resuming after ``skip`` batches.

    Normally ``skip`` itself; past the real batches, the last real one (padding copies its shape).
    """
    return real - 1 if skip >= real > 0 and steps > real else min(skip, real)
