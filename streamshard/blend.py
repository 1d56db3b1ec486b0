"""``BlendedStream``: several ``ParquetStream`` corpora mixed row by row, by weight.

The pure plan (epoch length, position -> (corpus, index), corpus epochs) is in
:mod:`streamshard.blend_plan`; positions are planned, resumed and resized like the rows of one
dataset (``stream_base.py``), and each position is read from its corpus's files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from .batch_plan import Read, StreamSchedule
from .blend_plan import STOPS, BlendBatches, BlendMap, CorpusOrder, blend_length, position_config, position_layout
from .blend_schedule import MAX_SAMPLES, ORDERS, blend_counts
from .blend_steer import Steering, WeightChange, remaining_ranges
from .batches import CORPUS
from .dataset import ParquetStream
from .delivery import deliver
from .fetch import ReadStats
from .loader_stats import sum_reads
from .reader import RowGroupReader
from .errors import StateError
from .resume import Planner, Position, Start
from .state import history_json, int_field, parse_history
from .schema import read_as, same_logical_type
from .stream_base import PlannedStream
from .tensors import Batch
from .topology import mesh_rank_world, resolve_rank_world
from .validate import check_int

__all__ = ["BlendedStream", "blend_length", "CORPUS"]

MAX_CHANGES = 64  # weight changes a state may record (each ~100 bytes of JSON)


class BlendedStream(PlannedStream):
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
        self.weights = _check_weight_names(weights, self.names)
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
        self._changes: list[WeightChange] = []  # set_weights, in order (blend_steer.py)
        self._steering: Steering | None = None

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

    # -- steering: new weights from where the next pass starts ------------------------------------
    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Blend by ``weights`` (name -> weight, every corpus named; 0 drops a corpus, a corpus at 0
        may rise) from where the next pass starts: after ``load_state_dict``, between epochs, or
        where the ``StreamLoader`` iterating this blend stands (inside its loop: after the batch just
        handed out; the workers re-plan). The rest of that epoch and the epochs after follow them.

        The epoch keeps its length (``num_samples``); every corpus still delivers each of its rows
        once per corpus epoch (samples a lowered corpus no longer draws stay for later; see
        ``blend_steer.py``). The change is recorded in the state, so a blend built with the original
        weights resumes the steered run exactly, on any topology. Changing weights of positions
        already delivered is refused (``StateError``, field ``weights``).
        """
        vector = _check_weight_names(weights, self.names)
        position = self._steering_position()
        change = WeightChange(position.epoch, tuple(position.history), tuple(vector.tolist()))
        changes = list(self._changes)
        if changes and self._same_position(changes[-1], change):
            changes[-1] = change  # twice at one position: the last call wins
        else:
            if changes and not self._not_before(changes[-1], change):
                last = changes[-1]
                raise StateError(
                    f"weights: set_weights at epoch {change.epoch} (history {history_json(list(change.history))}) would "
                    f"change positions already delivered under the weights set at epoch {last.epoch} (history "
                    f"{history_json(list(last.history))}); weights change only from where the run stands")
            changes.append(change)
        self._use_changes(changes)
        self._revision += 1  # persistent DataLoader workers hold the old plan

    @property
    def weight_changes(self) -> list[dict[str, Any]]:
        """The weight changes recorded so far (as in the state): epoch, history, weights."""
        return _changes_json(self._changes)

    def _steering_position(self) -> Position:
        """Where the next pass starts: the StreamLoader's standing position, else ``origin()``."""
        stand = self._stand() if self._stand is not None else None
        if stand is not None:
            return stand()
        position = self.origin()
        if position.worker is not None:
            raise StateError("weights: set_weights after loading a per-worker state (StatefulDataLoader) is not "
                             "supported; iterate with ss.StreamLoader")
        if position.fresh and self._cell.last_pass == self.epoch:
            raise StateError(
                f"weights: a pass over epoch {self.epoch} has started, so its start is in the past; call set_weights "
                "after set_epoch(next epoch) or load_state_dict, or on a blend iterated by ss.StreamLoader (it knows "
                "where it stands)")
        return position

    def _steered(self) -> Steering:
        if self._steering is None:
            self._steering = Steering(self.weights, self._changes, self.num_samples, self.order, self.seed,
                                      self.planner.layout, self.planner.config, self.sizes)
        return self._steering

    def _use_changes(self, changes: list[WeightChange]) -> None:
        steering = Steering(self.weights, changes, self.num_samples, self.order, self.seed, self.planner.layout,
                            self.planner.config, self.sizes)
        for change in changes:
            steering.epoch_map(change.epoch)  # weights that give an empty corpus samples fail here
        self._changes, self._steering = changes, steering

    def _remaining(self, change: WeightChange) -> np.ndarray:
        return remaining_ranges(self.num_samples, self.planner.config, change.epoch, change.history, self.planner.layout)

    def _same_position(self, a: WeightChange, b: WeightChange) -> bool:
        return a.epoch == b.epoch and np.array_equal(self._remaining(a), self._remaining(b))

    def _not_before(self, a: WeightChange, b: WeightChange) -> bool:
        """Whether position ``b`` is at or after ``a``: a later epoch, or everything ``a`` consumed consumed."""
        if a.epoch != b.epoch:
            return b.epoch > a.epoch
        outer, inner = self._remaining(a), self._remaining(b)
        for lo, hi in inner.tolist():
            r = int(np.searchsorted(outer[:, 0], lo, side="right")) - 1
            if r < 0 or hi > outer[r, 1]:
                return False
        return True

    # -- state: the changes travel with it --------------------------------------------------------
    def _state_of(self, position: Position) -> dict[str, Any]:
        return {**super()._state_of(position), "weight_changes": _changes_json(self._changes)}

    def _parse_state(self, state: Mapping[str, Any]) -> Position:
        position = super()._parse_state(state)
        self._loaded_changes = self._parse_changes(state.get("weight_changes", []))
        return position

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """As ``PlannedStream.load_state_dict``; the weight changes the state records replace this blend's."""
        super().load_state_dict(state)
        self._use_changes(self._loaded_changes)
        self._revision += 1

    def _parse_changes(self, raw: Any) -> list[WeightChange]:
        if not isinstance(raw, list) or len(raw) > MAX_CHANGES:
            raise StateError(f"state['weight_changes'] must be a list of at most {MAX_CHANGES} changes, got {raw!r:.80}")
        changes: list[WeightChange] = []
        for i, item in enumerate(raw):
            where = f"state['weight_changes'][{i}]"
            if not isinstance(item, list) or len(item) != 3:
                raise StateError(f"{where} must be [epoch, history, weights], got {item!r:.80}")
            try:
                epoch = int_field({"epoch": item[0]}, "epoch", 0)
                history = parse_history(item[1])
                vector = _check_weight_names(dict(zip(self.names, item[2])) if isinstance(item[2], list) and
                                             len(item[2]) == len(self.names) else None, self.names)
                self.planner.check(Position(epoch, history))
            except (StateError, ValueError) as exc:
                raise StateError(f"{where}: {exc}") from None
            change = WeightChange(epoch, tuple(history), tuple(vector.tolist()))
            if changes and (self._same_position(changes[-1], change) or not self._not_before(changes[-1], change)):
                raise StateError(f"{where} is not after the change before it")
            changes.append(change)
        try:
            Steering(self.weights, changes, self.num_samples, self.order, self.seed, self.planner.layout,
                     self.planner.config, self.sizes).epoch_map(changes[-1].epoch if changes else 0)
        except ValueError as exc:
            raise StateError(f"state['weight_changes']: {exc}") from None
        return changes

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_steering": None}

    # -- iteration ----------------------------------------------------------------------------
    def _deliver(self, start: Start) -> Iterator[Any]:
        readers: dict[int, RowGroupReader] = {}
        converter = self.datasets[0].converter
        schema = self.datasets[0].catalog.schema

        def read(what: Read) -> pa.Table:
            ds = self.datasets[what.source]
            if what.source not in readers:
                readers[what.source] = RowGroupReader.from_catalog(ds.catalog, ds.storage_options)
            # Logical types were checked equal; representation and nullability may still differ.
            return read_as(ds._read(readers[what.source], Read(0, what.rg)), schema, f"corpus {self.names[what.source]!r}")

        def place(what: Read) -> str:
            return f"corpus {self.names[what.source]!r} {self.datasets[what.source].catalog.place(what.rg)}"

        stats = self._delivery_stats(ReadStats(), start.worker_id)
        try:
            read_ahead = max(ds.read_ahead for ds in self.datasets)
            for batch in deliver(self.blend_batches(start), start.start, read, converter, read_ahead, stats,
                                 describe=place):
                if stats is not None:
                    sum_reads(readers.values(), into=stats.reads)
                    self._report_stats(stats)
                yield batch if self.transform is None else self.transform(batch)
        finally:
            for reader in readers.values():
                reader.close()

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


def _changes_json(changes: list[WeightChange]) -> list[list[Any]]:
    """Changes as ``[epoch, history, weights]`` lists (one entry each for DCP, like ``history``)."""
    return [[c.epoch, history_json(list(c.history)), list(c.weights)] for c in changes]


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
