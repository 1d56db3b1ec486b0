"""``BlendedStream``: several ``ParquetStream`` corpora mixed row by row, by weight.

The ``IterableDataset`` that reads the rows a :class:`~streamshard.blend_plan.BlendPlan` gives each
worker, with each corpus's own catalog and reader, and assembles them into batches. The plan
(epoch length, worker blocks, fair or shuffled order, corpus epochs) is described in
:mod:`streamshard.blend_plan`; ``BlendPlan`` and ``blend_length`` are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import IterableDataset

from .blend_plan import ORDERS, STOPS, BlendPlan, blend_length
from .blend_schedule import MAX_SAMPLES, blend_counts
from .batches import as_batch, concat, padding_like
from .dataset import ParquetStream
from .plan import EpochPlan
from .tensors import Batch
from .topology import Topology, current_worker, resolve_rank_world

__all__ = ["BlendPlan", "BlendedStream", "blend_length"]

CORPUS = "corpus"
# Slots of the shared progress tensor (shared memory reaches persistent DataLoader workers).
_EPOCH, _RESUME_EPOCH, _RESUME_BATCHES, _RESUME_WORKERS, _DELIVERED, _WORKERS_SEEN = range(6)


class _CorpusRows:
    """One corpus's rows for one worker, in order, handed out ``n`` at a time as Arrow tables."""

    def __init__(self, ds: ParquetStream, reads: list[tuple[int, int, int]]) -> None:
        self._ds, self._reads = ds, reads
        self._tables = self._iter_tables()
        self._pending: list[pa.Table] = []
        self._buffered = 0

    def take(self, n: int) -> pa.Table:
        while self._buffered < n:
            table = next(self._tables, None)
            if table is None:
                raise RuntimeError(f"corpus stream ran dry: {n} rows asked, {self._buffered} left (plan bug)")
            self._pending.append(table)
            self._buffered += table.num_rows
        merged = pa.concat_tables(self._pending) if len(self._pending) > 1 else self._pending[0]
        rest = merged.slice(n)
        self._pending, self._buffered = ([rest] if rest.num_rows else []), rest.num_rows
        return merged.slice(0, n)

    def close(self) -> None:
        self._tables.close()

    def _iter_tables(self) -> Iterator[pa.Table]:
        # A row's place in its row group's emitted order does not depend on where pieces are cut,
        # so reading from a resume point gives the rows the uninterrupted run would have given.
        layout = self._ds.catalog.layout
        for corpus_epoch, begin, end in self._reads:
            plan = EpochPlan(layout, self._ds.config, corpus_epoch, 1)
            yield from self._ds.iter_piece_tables(plan, plan.pieces_in(begin, end))


class BlendedStream(IterableDataset):
    """Mix ``ParquetStream`` corpora row by row: every batch holds ``batch_size`` rows drawn by weight.

    Each batch is the corpora's common keys plus ``sample_id`` (the row's id in its own corpus)
    and ``corpus`` (int64: the corpus's position in the insertion order of ``datasets``; see
    :attr:`names`). Over one blend epoch corpus ``k`` delivers exactly
    ``blend_counts(weights, N)[k]`` rows, each row exactly once per corpus epoch, and every
    global worker yields the same number of batches. Use ``DataLoader(ds, batch_size=None)``.

    From each corpus the blend uses its catalog (paths, columns, storage options), ``unit``,
    ``shuffle``, ``seed`` and ``read_ahead``; its ``batch_size``, ``uneven``, ``rank``,
    ``world_size`` and epoch are ignored, and a per-corpus ``transform`` is refused (a batch
    mixes corpora; pass ``transform`` here).

    Args:
        datasets: name -> ParquetStream; all must yield the same batch keys and column types.
        weights: name -> weight (same names); validated by ``blend_counts``.
        batch_size: rows per batch.
        seed: seeds the ``"shuffled"`` order (each corpus's own seed orders its rows).
        num_samples: samples per blend epoch; None derives it from ``stop``.
        stop: "all_exhausted" (every corpus at least once through) or "first_exhausted".
        order: "fair" (every prefix within 2 samples of each share) or "shuffled" (labels
            permuted within each worker's block; see :mod:`streamshard.blend_plan`).
        rank, world_size: default to torch.distributed, then RANK/WORLD_SIZE, then 0/1.
    """

    def __init__(self, datasets: Mapping[str, ParquetStream], weights: Mapping[str, float], batch_size: int,
                 seed: int = 0, num_samples: int | None = None, stop: str = "all_exhausted",
                 order: str = "fair", rank: int | None = None, world_size: int | None = None,
                 transform: Callable[[Batch], Any] | None = None) -> None:
        super().__init__()
        self.names, self.datasets = _check_datasets(datasets)
        self.weights = _check_weight_names(weights, self.names)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer))
                                        or not 0 <= num_samples <= MAX_SAMPLES):
            raise ValueError(f"num_samples must be None or an int in [0, {MAX_SAMPLES}], got {num_samples!r}")
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        self.batch_size, self.seed, self.stop, self.order = int(batch_size), int(seed), stop, order
        self.transform = transform
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self._num_samples = None if num_samples is None else int(num_samples)
        self._checked = False
        self._shared = torch.tensor([0, -1, 0, -1, 0, 0], dtype=torch.int64).share_memory_()

    # -- epoch, size, plan --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the blend epoch the next ``__iter__`` follows; each corpus's epochs derive from it.

        Also reads the corpora's footers and checks their schemas once, in the calling process,
        so DataLoader workers inherit the result. A pending resume for another epoch is dropped.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._shared[_EPOCH] = int(epoch)
        if int(self._shared[_RESUME_EPOCH]) != epoch:
            self._shared[_RESUME_EPOCH] = -1
        self._shared[_DELIVERED] = 0
        self.num_samples  # noqa: B018 - footers, schema check and epoch length, once

    @property
    def epoch(self) -> int:
        return int(self._shared[_EPOCH])

    @property
    def num_samples(self) -> int:
        """Samples per blend epoch (reads the footers on first use)."""
        self._check_schemas()
        if self._num_samples is None:
            self._num_samples = blend_length(self.weights, self.sizes, self.stop)
        return self._num_samples

    @property
    def sizes(self) -> np.ndarray:
        """Rows per corpus (int64, in :attr:`names` order)."""
        return np.asarray([ds.catalog.num_rows for ds in self.datasets], dtype=np.int64)

    def counts(self) -> dict[str, int]:
        """Samples each corpus delivers per blend epoch: ``blend_counts(weights, num_samples)``."""
        return dict(zip(self.names, blend_counts(self.weights, self.num_samples).tolist()))

    def plan(self, num_workers: int = 0, epoch: int | None = None) -> BlendPlan:
        """The pure plan of a blend epoch for this world size and ``num_workers`` DataLoader workers."""
        topology = Topology(0, self.world_size, 0, num_workers)
        return BlendPlan(self.weights, self.sizes, self.num_samples, self.batch_size, topology.num_global_workers,
                         self.epoch if epoch is None else epoch, self.seed, self.order)

    def steps_per_epoch(self, num_workers: int = 0) -> int:
        """Batches each rank gets from ``DataLoader(ds, batch_size=None, num_workers=...)``."""
        return self.plan(num_workers).steps * max(num_workers, 1)

    # -- resume -------------------------------------------------------------------------------
    def state_dict(self, consumed_batches: int | None = None, num_workers: int | None = None) -> dict[str, Any]:
        """Where this rank is: the epoch and the batches its DataLoader delivered this epoch (JSON-safe).

        Same calling convention as ``ParquetStream.state_dict``. Without DataLoader workers the
        count is kept here, so ``state_dict()`` is enough. With workers the main process cannot
        see what was consumed (workers read ahead): pass ``consumed_batches`` (this epoch's
        training steps of this rank) and, unless this object already iterated with them,
        ``num_workers``; omitting ``consumed_batches`` then raises ValueError.
        """
        seen = int(self._shared[_WORKERS_SEEN])
        if consumed_batches is None:
            if seen > 0:
                raise ValueError("consumed_batches is required when DataLoader workers iterate the blend: "
                                 "pass the number of batches this rank consumed this epoch")
            consumed_batches = int(self._shared[_DELIVERED])
        if (isinstance(consumed_batches, bool) or not isinstance(consumed_batches, (int, np.integer))
                or consumed_batches < 0):
            raise ValueError(f"consumed_batches must be an int >= 0, got {consumed_batches!r}")
        workers = seen if num_workers is None else num_workers
        if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        return {"kind": "blend", "epoch": self.epoch, "batches": int(consumed_batches), "num_workers": int(workers),
                "world_size": self.world_size, "num_samples": self.num_samples, "seed": self.seed,
                "order": self.order, "names": list(self.names)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` skips the batches already delivered,
        without reading them. World size, epoch length, seed and order must match the state's;
        the DataLoader's ``num_workers`` is checked when iteration starts."""
        keys = {"kind", "epoch", "batches", "num_workers", "world_size", "num_samples", "seed", "order", "names"}
        if not isinstance(state, Mapping) or state.get("kind") != "blend" or keys - set(state):
            raise ValueError(f"not a BlendedStream state (need keys {sorted(keys)}): {state!r:.200}")
        for key, mine in (("names", list(self.names)), ("world_size", self.world_size),
                          ("num_samples", self.num_samples), ("seed", self.seed), ("order", self.order)):
            if state[key] != mine:
                raise ValueError(f"state[{key!r}] is {state[key]!r} but this BlendedStream has {mine!r}; "
                                 "resuming across a different blend is not supported")
        self.set_epoch(int(state["epoch"]))
        self._shared[_RESUME_EPOCH] = int(state["epoch"])
        self._shared[_RESUME_BATCHES] = int(state["batches"])
        self._shared[_RESUME_WORKERS] = int(state["num_workers"])
        self._shared[_DELIVERED] = int(state["batches"])

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        worker_id, num_workers = current_worker()
        topology = Topology(self.rank, self.world_size, worker_id, num_workers)
        per_rank, epoch = topology.workers_per_rank, self.epoch
        delivered = int(self._shared[_RESUME_BATCHES]) if int(self._shared[_RESUME_EPOCH]) == epoch else 0
        if delivered and int(self._shared[_RESUME_WORKERS]) != num_workers:
            raise ValueError(f"the state was saved with num_workers={int(self._shared[_RESUME_WORKERS])} "
                             f"but this DataLoader has num_workers={num_workers}; they must match")
        self._shared[_WORKERS_SEEN] = num_workers
        if num_workers == 0:  # only the main process's own count can be trusted (workers read ahead)
            self._shared[_DELIVERED] = delivered
        # The DataLoader restarts its round robin at worker 0: rotate roles so the batch that comes
        # next is the one the uninterrupted run would have delivered next.
        role = (worker_id + delivered) % per_rank
        skip = max(0, -(-(delivered - role) // per_rank))
        plan = self.plan(num_workers, epoch)
        batches = self._worker_batches(plan, self.rank * per_rank + role, skip, count=num_workers == 0)
        if self.transform is None:
            return batches
        return (self.transform(batch) for batch in batches)

    def _worker_batches(self, plan: BlendPlan, worker: int, skip: int, count: bool) -> Iterator[Batch]:
        first, last, start = plan.corpus_ranges(worker, skip)
        sources = {k: _CorpusRows(self.datasets[k], plan.segments(k, int(start[k]), int(last[k])))
                   for k in np.flatnonzero(last > start).tolist()}
        try:
            batch: Batch | None = None
            for corpus, _ in plan.batches(worker, skip):
                batch = self._assemble(corpus, sources)
                yield from self._deliver(batch, count)
            padding = plan.steps - max(plan.real_batches(worker), skip)
            if padding > 0:
                template = batch if batch is not None else self._template(plan)
                for _ in range(padding):
                    yield from self._deliver(_blend_padding(template, self.batch_size, self.datasets[0].converter.ragged_keys), count)
        finally:
            for source in sources.values():
                source.close()

    def _deliver(self, batch: Batch, count: bool) -> Iterator[Batch]:
        if count:
            self._shared[_DELIVERED] += 1
        yield batch

    def _assemble(self, corpus: np.ndarray, sources: dict[int, _CorpusRows]) -> Batch:
        """One batch: each corpus's next rows, placed where the plan's labels put them.

        The parts are joined as Arrow (their types were checked equal) and converted once, so a
        blended batch costs one conversion like a plain ``ParquetStream`` batch."""
        present, sizes = np.unique(corpus, return_counts=True)
        parts = [sources[k].take(n) for k, n in zip(present.tolist(), sizes.tolist())]
        # Types were checked equal; nullability flags may still differ between corpora's files.
        parts = [p if p.schema.equals(parts[0].schema) else p.cast(parts[0].schema) for p in parts]
        # Parts are grouped by corpus, each in its own order; move every row to its labelled position.
        where = np.argsort(np.argsort(corpus, kind="stable"))
        table = pa.concat_tables(parts).take(pa.array(where)) if len(parts) > 1 else parts[0]
        batch = as_batch(table, self.datasets[0].converter)
        batch[CORPUS] = torch.from_numpy(corpus.astype(np.int64, copy=True))
        rows = len(corpus)
        if rows == self.batch_size:
            return batch
        return concat(batch, _blend_padding(batch, self.batch_size - rows, self.datasets[0].converter.ragged_keys))

    def _template(self, plan: BlendPlan) -> Batch:
        """A real-shaped batch for a worker with no rows (more workers than samples)."""
        k = int(np.flatnonzero(plan.counts)[0])
        table = _CorpusRows(self.datasets[k], [(0, 0, 1)]).take(1)
        return as_batch(table, self.datasets[k].converter)

    # -- checks -------------------------------------------------------------------------------
    def _check_schemas(self) -> None:
        """All corpora must give the same batch keys and column types; ValueError names both."""
        if self._checked:
            return
        for ds in self.datasets:
            if ds.transform is not None:
                raise ValueError("a corpus of a BlendedStream has its own transform; batches mix corpora, "
                                 "so pass transform= to BlendedStream instead")
        ref_name, ref = self.names[0], self.datasets[0]
        for name, ds in zip(self.names[1:], self.datasets[1:]):
            a, b = ref.catalog.schema, ds.catalog.schema
            for column in list(a.names) + [c for c in b.names if c not in a.names]:
                if column not in a.names or column not in b.names:
                    lacking = ref_name if column not in a.names else name
                    raise ValueError(f"corpora {ref_name!r} and {name!r} differ in column {column!r}: "
                                     f"corpus {lacking!r} does not have it")
                if a.field(column).type != b.field(column).type:
                    raise ValueError(f"corpora {ref_name!r} and {name!r} differ in column {column!r}: "
                                     f"{a.field(column).type} vs {b.field(column).type}")
            diff = sorted(set(ref.converter.keys) ^ set(ds.converter.keys))
            if diff:
                raise ValueError(f"corpora {ref_name!r} and {name!r} differ in batch key {diff[0]!r} "
                                 "(a column that may hold nulls in one corpus only gets a _mask key)")
        self._checked = True


def _check_datasets(datasets: Any) -> tuple[tuple[str, ...], list[ParquetStream]]:
    if not isinstance(datasets, Mapping) or not datasets:
        raise ValueError(f"datasets must be a non-empty mapping of name -> ParquetStream, got {datasets!r}")
    for name, ds in datasets.items():
        if not isinstance(name, str) or not isinstance(ds, ParquetStream):
            raise ValueError(f"datasets[{name!r}] must be a ParquetStream under a str name, got {type(ds).__name__}")
    return tuple(datasets), list(datasets.values())


def _check_weight_names(weights: Any, names: tuple[str, ...]) -> np.ndarray:
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of corpus name -> weight, got {type(weights).__name__}")
    missing, extra = [n for n in names if n not in weights], [n for n in weights if n not in names]
    if missing or extra:
        raise ValueError(f"weights must name the same corpora as datasets: missing {missing}, unknown {extra}")
    vector = [weights[n] for n in names]
    try:
        blend_counts(vector, 0)
    except ValueError as exc:
        raise ValueError(f"weights (in corpus order {list(names)}): {exc}") from None
    return np.asarray(vector, dtype=np.float64)


def _blend_padding(batch: Batch, rows: int, ragged: frozenset[str] = frozenset()) -> Batch:
    pad = padding_like(batch, rows, ragged)
    pad[CORPUS] = torch.full((rows,), -1, dtype=torch.int64)
    return pad
