"""``BlendedStream``: several ``ParquetStream`` corpora mixed row by row, by weight.

The pure plan (epoch length, position -> (corpus, index), corpus epochs) is in
:mod:`streamshard.plan.blend_plan`; positions are planned, resumed and resized like the rows of one
dataset (``streams/stream_base.py``), and each position is read from its corpus's files.
"""

from __future__ import annotations

import threading

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from ..plan.batch_plan import Read, StreamSchedule
from ..plan.blend_plan import STOPS, BlendBatches, BlendMap, CorpusOrder, blend_length, position_config, position_layout
from ..plan.blend_schedule import MAX_SAMPLES, ORDERS, blend_counts
from ..convert.batches import CORPUS
from .dataset import ParquetStream
from .delivery import deliver
from ..io.fetch import ReadStats
from ..loader.handoff import batches_per_message
from ..io.reader import RowGroupReader
from ..plan.resume import Planner, Start
from ..format.schema import read_as, same_logical_type
from ..plan.steering import SteerSpec, WeightSteering, check_weight_names
from .stream_base import PlannedStream
from ..convert.tensors import Batch
from ..plan.topology import mesh_rank_world, resolve_rank_world
from ..plan.validate import check_int

__all__ = ["BlendedStream", "blend_length", "CORPUS"]


class BlendedStream(WeightSteering, PlannedStream):
    """Mix ``ParquetStream`` corpora row by row: every batch holds ``batch_size`` rows drawn by weight.

    Each batch is the corpora's common keys plus ``sample_id`` (the row's id in its own corpus)
    and ``corpus`` (int64: the corpus's position in the insertion order of ``datasets``; see
    :attr:`names`); both are -1 on padding rows. Over one blend epoch corpus ``k`` delivers
    exactly ``blend_counts(weights, N)[k]`` rows, each row exactly once per corpus epoch, and
    every global worker yields the same number of batches. Iterate it with ``ss.StreamLoader``
    (checkpoints resume on any topology) or ``DataLoader(blend, batch_size=None)``.

    From each corpus the blend uses its catalog (paths, columns, storage options), ``unit``,
    ``shuffle``, ``seed`` and ``read_ahead``; its ``batch_size`` and ``uneven`` do not apply.
    A corpus built with an explicit ``rank``/``world_size`` lends it to the blend (all corpora and
    the blend must then agree); a per-corpus ``transform`` is refused (pass ``transform`` here).

    Args:
        datasets: name -> ParquetStream; all must yield the same batch keys and column types.
        weights: name -> weight (same names); validated by ``blend_counts``.
        batch_size: rows per batch.
        seed: seeds the ``"shuffled"`` order (each corpus's own seed orders its rows).
        num_samples: samples per blend epoch; None derives it from ``stop``.
        stop: "all_exhausted" (every corpus at least once through) or "first_exhausted".
        order: "fair" (every prefix within 2 samples of each share) or "shuffled" (corpus labels
            permuted within chunks of 65,536 positions; each corpus is still read in order).
        rank, world_size: default to the corpora's explicit topology, then torch.distributed,
            then RANK/WORLD_SIZE, then 0/1.
        mesh: instead of rank/world_size, the 1-D data-parallel torch ``DeviceMesh`` (``mesh["dp"]``).
            Build the corpora with the same ``mesh=`` too: each corpus splits its catalog's footer
            reads over its own group (without it, the default group: every rank must build it).
    """

    def __init__(self, datasets: Mapping[str, ParquetStream], weights: Mapping[str, float], batch_size: int,
                 seed: int = 0, num_samples: int | None = None, stop: str = "all_exhausted",
                 order: str = "fair", rank: int | None = None, world_size: int | None = None,
                 transform: Callable[[Batch], Any] | None = None, mesh: Any = None) -> None:
        super().__init__()
        if mesh is not None:
            rank, world_size = mesh_rank_world(mesh, rank, world_size)
        self.names, self.datasets = _check_datasets(datasets)
        self.weights = check_weight_names(weights, self.names)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        self.seed = check_int(seed, "seed", 0, 2**64 - 1)
        self._num_samples = check_int(num_samples, "num_samples", 0, MAX_SAMPLES, none_ok=True)
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        for name, ds in zip(self.names, self.datasets):
            if ds.transform is not None:
                raise ValueError(f"corpus {name!r} of a BlendedStream has its own transform; batches mix corpora, "
                                 "so pass transform= to BlendedStream instead")
        self.stop, self.order, self.transform = stop, order, transform
        self._use_topology(*_topology_args(self.datasets, rank, world_size))
        self._checked = False
        self._planner: Planner | None = None
        self._init_steering()

    # -- epoch, size ----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the blend epoch; also reads the corpora's footers and checks their schemas once,
        in the calling process, so DataLoader workers inherit the result."""
        super().set_epoch(epoch)
        self.num_samples  # noqa: B018 - footers, schema check and epoch length, once

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

    @property
    def shuffled(self) -> bool:
        return self.order == "shuffled" or any(ds.config.shuffle for ds in self.datasets)

    def counts(self) -> dict[str, int]:
        """Samples each corpus delivers per blend epoch under the weights it was built with:
        ``blend_counts(weights, num_samples)`` (``set_weights`` changes them from where it applies)."""
        return dict(zip(self.names, blend_counts(self.weights, self.num_samples).tolist()))

    # -- what decides the order ----------------------------------------------------------------
    @property
    def planner(self) -> Planner:
        if self._planner is None:
            self._planner = self._make_planner()
        return self._planner

    def _make_planner(self) -> Planner:
        counts = blend_counts(self.weights, self.num_samples)
        empty = np.flatnonzero((counts > 0) & (self.sizes == 0))
        if empty.size:
            raise ValueError(f"corpus {self.names[int(empty[0])]!r} has no rows but its weight gives it "
                             f"{int(counts[empty[0]])} of {self.num_samples} samples")
        return Planner(position_layout(self.num_samples), position_config(self.batch_size), None)

    def fingerprint(self) -> dict[str, Any]:
        corpora = [{"name": name, **{k: v for k, v in ds.fingerprint().items() if k not in ("batch_size", "uneven")}}
                   for name, ds in zip(self.names, self.datasets)]
        return {"corpora": corpora, "weights": self.weights.tolist(), "batch_size": self.batch_size,
                "seed": self.seed, "num_samples": self.num_samples, "stop": self.stop, "order": self.order}

    def _batches_a_message(self) -> int:
        """``PlannedStream._batches_a_message``: ``batch_size`` rows of the widest corpus's estimate."""
        return batches_per_message(max(ds._row_bytes() for ds in self.datasets) * self.batch_size)

    def _steer_spec(self) -> SteerSpec:
        return SteerSpec(self.names, self.weights, self.num_samples, self.order, self.seed, self.sizes)

    def blend_batches(self, start: Start) -> BlendBatches:
        """The pure blend schedule of a worker (``schedule()`` gives the positions it reads)."""
        assert isinstance(start.schedule, StreamSchedule)
        epoch = start.schedule.plan.epoch
        blend: Any = BlendMap(self.weights, self.num_samples, self.order, self.seed, epoch)
        if self._changes:
            blend = self._steered().epoch_map(epoch)
        corpora = [CorpusOrder(ds.layout, ds.config) for ds in self.datasets]
        return BlendBatches(start.schedule, blend, corpora)

    def _schedule_of(self, start: Start) -> BlendBatches:
        return self.blend_batches(start)

    def schedule(self, worker_id: int = 0, num_workers: int = 0) -> BlendBatches:
        """The exact batches DataLoader worker ``worker_id`` of this rank delivers in this pass, without
        reading anything: ``sample_ids()`` and each spec's ``corpus`` simulate it."""
        return self.blend_batches(self._start(self.origin(), worker_id, num_workers))

    # -- iteration ----------------------------------------------------------------------------
    def _deliver(self, start: Start) -> Iterator[Any]:
        readers: dict[int, RowGroupReader] = {}
        made = threading.Lock()
        converter = self.datasets[0].converter
        schema = self.datasets[0].catalog.schema

        def reader_of(source: int) -> RowGroupReader:
            with made:  # read-ahead threads and the consumer (weigh) ask at once: one reader per corpus
                if source not in readers:
                    ds = self.datasets[source]
                    readers[source] = RowGroupReader.from_catalog(ds.catalog, ds.storage_options)
                return readers[source]

        def read(what: Read) -> pa.Table:
            ds = self.datasets[what.source]
            # Logical types were checked equal; representation and nullability may still differ.
            return read_as(ds._read(reader_of(what.source), Read(0, what.rg)), schema, f"corpus {self.names[what.source]!r}")

        def weigh(what: Read) -> int:  # read-ahead's byte budget (``streams/delivery.py``)
            return self.datasets[what.source]._decoded_estimate(reader_of(what.source), Read(0, what.rg))

        def place(what: Read) -> str:
            return f"corpus {self.names[what.source]!r} {self.datasets[what.source].catalog.place(what.rg)}"

        stats = self._delivery_stats(ReadStats(), start.worker_id)
        read_ahead = max(ds.read_ahead for ds in self.datasets)
        batches = deliver(self.blend_batches(start), start.start, read, converter, read_ahead, stats,
                          describe=place, weigh=weigh)
        yield from self._each_delivered(batches, readers, stats, self.transform)

    # -- checks -------------------------------------------------------------------------------
    def _check_schemas(self) -> None:
        """All corpora must give the same batch keys and column types; ValueError names both."""
        if self._checked:
            return
        ref_name, ref = self.names[0], self.datasets[0]
        for name, ds in zip(self.names[1:], self.datasets[1:]):
            a, b = ref.catalog.schema, ds.catalog.schema
            for column in list(a.names) + [c for c in b.names if c not in a.names]:
                if column not in a.names or column not in b.names:
                    lacking = ref_name if column not in a.names else name
                    raise ValueError(f"corpora {ref_name!r} and {name!r} differ in column {column!r}: "
                                     f"corpus {lacking!r} does not have it")
                if not same_logical_type(a.field(column).type, b.field(column).type):
                    raise ValueError(f"corpora {ref_name!r} and {name!r} differ in column {column!r}: "
                                     f"{a.field(column).type} vs {b.field(column).type}")
            diff = sorted(set(ref.converter.keys) ^ set(ds.converter.keys))
            if diff:
                raise ValueError(f"corpora {ref_name!r} and {name!r} differ in batch key {diff[0]!r} "
                                 "(a column that may hold nulls in one corpus only gets a _mask key)")
        self._checked = True


def _topology_args(datasets: list[ParquetStream], rank: int | None,
                   world_size: int | None) -> tuple[int | None, int | None]:
    """The blend's (rank, world size) arguments: explicit, else the corpora's explicit one (None: the
    default, resolved on first use); disagreement raises."""
    given = {ds._rank_args for ds in datasets if ds.topology_given}
    if len(given) > 1:
        raise ValueError(f"the corpora of a BlendedStream were built for different ranks/world sizes: {sorted(given)}; "
                         "build them alike, or leave rank/world_size to the BlendedStream")
    if not given:
        return rank, world_size
    (part_rank, part_world), = given
    if (rank is not None or world_size is not None) and resolve_rank_world(rank, world_size) != (part_rank, part_world):
        raise ValueError(f"BlendedStream(rank={rank}, world_size={world_size}) disagrees with its corpora, built "
                         f"for rank {part_rank} of {part_world}")
    return part_rank, part_world


def _check_datasets(datasets: Any) -> tuple[tuple[str, ...], list[ParquetStream]]:
    if not isinstance(datasets, Mapping) or not datasets:
        raise ValueError(f"datasets must be a non-empty mapping of name -> ParquetStream, got {datasets!r}")
    for name, ds in datasets.items():
        if not isinstance(name, str) or not isinstance(ds, ParquetStream):
            raise ValueError(f"datasets[{name!r}] must be a ParquetStream under a str name, got {type(ds).__name__}")
    return tuple(datasets), list(datasets.values())
