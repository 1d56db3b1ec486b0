"""``ParquetStream``: an ``IterableDataset`` that gives every row to exactly one global worker.

A thin adapter: the pure planner (``plan/epoch_plan.py``, ``plan/batch_plan.py``, ``plan/resume.py``) decides every
batch; ``streams/delivery.py`` reads and converts it. Each DataLoader worker computes its own schedule
from the same inputs (catalog, seed, epoch, topology), so workers and ranks agree without talking
to each other. Nothing is opened in ``__init__``: the footers are read on first use of the
catalog, the data files in ``__iter__``.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from ..plan.batch_plan import Read, StreamSchedule
from ..plan.canonical import CanonicalPlan
from ..io import collective
from ..io.catalog import Catalog, warm_arrow_while_waiting
from ..io.catalog_share import CatalogShare
from ..io.delta import DeltaTable
from .delivery import DeliveryStats, deliver
from ..errors import CatalogError, ReadError
from ..format.deletions import stored_rows
from ..io.partitions import check_partitioning, with_partition_columns
from ..plan.epoch_plan import ORDER_VERSION, EpochPlan, Layout, PlanConfig
from ..io.reader import RowGroupReader, StreamedPart
from ..loader.handoff import batches_per_message
from ..plan.resume import Planner, Start
from ..format.schema import parse_cast, read_as
from .planning_room import check_planning_room
from .stream_base import PlannedStream
from ..convert.tensors import Batch, BatchConverter, check_conversion_options
from ..plan.topology import Topology, current_worker, mesh_rank_world
from ..plan.validate import check_int

log = logging.getLogger("streamshard")

DEFAULT_BATCH_SIZE = 256
DEFAULT_SHUFFLE_WINDOW = 16  # row groups mixed per batch by default (benchmarks/shuffle_quality.py)
PADDING_WARNING = 0.10  # row-group-sized batches: warn when padding exceeds this share of the steps
_DECODED_PER_STORED = 4  # a batch's bytes in memory per stored (compressed, all columns) byte, a generous guess


class ParquetStream(PlannedStream):
    """Stream Parquet files (any fsspec URL, directory or glob) as batches of tensors.

    Every batch is a ``dict[str, torch.Tensor]`` (strings stay Python lists) with an int64
    ``sample_id``: the row's global index in catalog order, or -1 for a padding row. Iterate it
    with ``ss.StreamLoader(ds, num_workers=N)``, which also keeps the checkpoint, or with
    ``DataLoader(ds, batch_size=None, num_workers=N)``; with ``uneven="pad"`` every global worker
    (``rank * num_workers + worker_id``) yields the same number of batches, so DDP never waits on
    a rank that ran dry.

    Args:
        paths: a file, directory or glob, or a list of them; any fsspec URL. A Delta Lake table:
            ``ss.DeltaTable(path, version=...)``, or its root directory for the latest version (needs
            the ``delta`` extra; a table is never read as plain files).
        columns: columns to read (None: all). Missing columns are an error at catalog time.
            Partition keys (see ``partitioning``) are columns too.
        batch_size: rows per batch (default 256): every batch holds exactly that many rows, a
            worker's short last one topped up with padding rows (or dropped with "drop"), so
            padding is at most about one batch per global worker per epoch. None asks for one
            batch per row-group slice instead (sizes follow the row groups; a warning says when
            that pads more than 10% of an epoch's steps).
        unit: what is shuffled and kept together: "row_group" or "file". Work is always
            balanced by rows; a unit may be split between two neighbouring workers.
        shuffle, seed: permute units and rows within each piece, deterministically per
            (seed, epoch).
        uneven: "pad" (padding batches, sample_id -1) or "drop" (every worker truncated to the
            smallest count; ``epoch_summary`` reports the dropped rows and a warning is logged).
        rank, world_size: the data-parallel rank and size. Default: torch.distributed, then
            RANK/WORLD_SIZE, then 0/1; a process that is one of several but has no RANK yet (Lightning's
            DDP processes before init_process_group) resolves it on first use, or raises
            ``TopologyError``, never reading as rank 0.
        mesh: instead of rank/world_size, the 1-D data-parallel torch ``DeviceMesh`` (``mesh["dp"]``):
            under tensor/pipeline parallelism the ranks of one model-parallel group get the same
            batches and only the data-parallel ranks split the data.
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        transform: called on each batch inside the worker (padding batches included).
        read_ahead: row groups read in the background ahead of the one being consumed. The row
            groups one batch needs together (a shuffle window's) are read concurrently (up to 32),
            whatever ``read_ahead`` is. Nothing is read ahead while the groups held and read ahead
            would decode to more than 256 MiB (estimated from footers, or 4x compressed bytes before a
            footer is at hand; ``streams/delivery.py``
            ``READ_AHEAD_BYTES``), so several huge row groups are not held at once. On object storage,
            more small groups are read ahead than ``read_ahead``, up to 8 MiB of compressed bytes ahead
            (``READ_AHEAD_FETCH_BYTES``: enough to cover a round trip), and a file's small groups
            started together come in one GET.
        shuffle_window: with shuffle, interleave the rows of this many consecutive pieces (row
            groups) of a worker at random: no extra I/O, and a worker holds that many decoded row
            groups at once (plus ``read_ahead``); a window takes more pieces when one would dominate
            its rows, up to 3x as many and 1.5x the rows of that many average row groups. Default:
            16 with ``shuffle=True`` (a batch then draws from ~16 files), 1 without; 1 keeps one row
            group at a time.
        partitions: canonical partitions for a topology-independent order (see ``plan/canonical.py``).
        catalog_cache: a directory where the catalog is cached (JSON). None: no cache.
        lists: "padded" (list columns as 2-D tensors + lengths) or "flat" (1-D values + lengths).
        cast: ``{column: Arrow type or name}`` to read a column as one type when files really
            disagree (int32 in some, int64 in others). Files from different writers that differ
            only physically (``large_list`` vs ``list``, dictionary-encoded vs plain, nullability)
            stream together without it.
        decimals: "float64" (the nearest double) or "scaled_int64" (exact ``value * 10**scale``).
        partitioning: "hive" (default): ``k=v`` directories below a directory or glob given become
            columns of every batch, typed as ``pyarrow.dataset``'s hive partitioning infers them
            (int32 or string; null for ``__HIVE_DEFAULT_PARTITION__``); None: directory names are
            ignored. A Delta table's partition columns come from its log either way.
        inner_nulls: "error" (a null element inside a list is an error naming file and column) or
            "mask" (nulls read as 0, with ``<name>_values_mask`` for every list column whose
            elements the schema lets be null: writers such as pyarrow do by default, so "mask"
            adds a bool per list value to every batch).
    """

    # Set by StreamLoader with thread workers around set_epoch: the catalog may then come from this
    # process's last listing of the paths, confirmed before any row leaves (confirm_catalog).
    _speculate: bool = False

    def __init__(
        self,
        paths: str | Sequence[str],
        columns: Sequence[str] | None = None,
        batch_size: int | None = DEFAULT_BATCH_SIZE,
        unit: str = "row_group",
        shuffle: bool = False,
        seed: int = 0,
        uneven: str = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: dict[str, Any] | None = None,
        transform: Callable[[Batch], Any] | None = None,
        read_ahead: int = 2,
        shuffle_window: int | None = None,
        partitions: int | None = None,
        catalog_cache: str | None = None,
        lists: str = "padded",
        cast: Mapping[str, Any] | None = None,
        decimals: str = "float64",
        inner_nulls: str = "error",
        mesh: Any = None,
        partitioning: str | None = "hive",
    ) -> None:
        def usable(p: Any) -> bool:
            return (isinstance(p, str) and bool(p)) or isinstance(p, DeltaTable)

        if isinstance(paths, (list, tuple)) and paths and all(usable(p) for p in paths):
            self.paths: list[str | DeltaTable] = list(paths)
        elif usable(paths):
            self.paths = [paths]  # type: ignore[list-item]
        else:
            raise ValueError(f"paths must be a non-empty str, ss.DeltaTable or list of them, got {paths!r}")
        self.partitioning = check_partitioning(partitioning)
        if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
            raise ValueError(f"columns must be a list of column names or None, got {columns!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        check_conversion_options(lists, decimals, inner_nulls)  # early: the converter is built later
        self.decimals, self.inner_nulls = decimals, inner_nulls
        self.read_ahead = check_int(read_ahead, "read_ahead", 0, 64)
        self.partitions = check_int(partitions, "partitions", 1, none_ok=True)
        if shuffle_window is None:
            shuffle_window = DEFAULT_SHUFFLE_WINDOW if shuffle and partitions is None else 1
        if partitions is not None and (batch_size is None or shuffle_window != 1):
            raise ValueError("partitions= needs an int batch_size and shuffle_window=1")
        self.columns = list(columns) if columns is not None else None
        self.config = PlanConfig(unit=unit, shuffle=bool(shuffle), seed=seed, batch_size=batch_size, uneven=uneven,
                                 shuffle_window=shuffle_window)
        group = None
        if mesh is not None:
            rank, world_size = mesh_rank_world(mesh, rank, world_size)
            group = mesh.get_group()  # the catalog's footer reads are split over the data-parallel ranks
        super().__init__(rank, world_size)
        self._catalog_group = group
        self.storage_options = dict(storage_options or {})
        self.transform = transform
        self.catalog_cache = catalog_cache
        self.lists = lists
        self.cast = {name: str(t) for name, t in parse_cast(cast).items()}  # JSON-safe: it goes into states
        self.stats_hook: Callable[[DeliveryStats], None] | None = None
        self.catalog_progress: Callable[[int], None] | None = None  # called with 1 per footer read (a bar's update)
        self._warned: set[str] = set()
        self._catalog: Catalog | None = None
        self._converter: BatchConverter | None = None  # derived from the catalog; not pickled
        self._catalog_share = CatalogShare.owned_by(self)  # a token only: nothing is created here

    # -- epoch and catalog --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose (seed, epoch) order the next ``__iter__`` follows.

        Called in the main process before iterating, it also reads the footers the first time,
        so DataLoader workers inherit the catalog instead of each reading every footer again.
        """
        super().set_epoch(epoch)
        if self._catalog is not None and self._catalog.refused():  # stale (confirm_catalog): list again
            self._catalog = self._converter = None
        self.converter  # noqa: B018 - builds the catalog and checks the column types once
        # pyarrow imports pandas (when installed) on its first pa.array() in a process, ~0.2-0.5 s: made
        # here in the background (thread workers send their first reads meanwhile); a fork waits for it,
        # so forked DataLoader workers inherit the import instead of each paying it (io/catalog.py).
        warm_arrow_while_waiting()
        self._warn_about_traps()

    @property
    def catalog(self) -> Catalog:
        """The files and row groups, read from the footers on first access (then kept).

        One snapshot per dataset, for its life. DataLoader workers use the one their parent took
        (inherited or pickled). Whose parent took none, the first to need it builds and publishes it,
        and the other workers, later workers and this process load that one (``io/catalog_share.py``):
        two workers listing while a file lands would deliver rows twice or never.
        """
        if self._catalog is None:
            build = lambda distributed, speculate=False: Catalog.build(  # noqa: E731
                self.paths, self.columns, self.storage_options, cache_dir=self.catalog_cache, cast=self.cast,
                progress=self.catalog_progress, distributed=distributed and self._splits_catalog(),
                group=self._catalog_group, partitioning=self.partitioning, speculate=speculate)
            share = self._catalog_share
            if current_worker()[1] > 0:
                catalog = share.get(lambda: build(False))  # a worker cannot join collectives
            elif self._splits_catalog() and collective.process_group(self._catalog_group) is not None:
                built = build(True)  # every rank joins the split reads, whenever its workers started
                # theirs if they published first, else ours for them
                catalog = share.get(lambda: built) if share.may_have_workers() else built
            elif share.may_have_workers():
                catalog = share.get(lambda: build(False))
            else:  # StreamLoader's thread workers confirm a catalog of the last listing before any row leaves
                catalog = build(False, self._speculate)
            self._converter = self._make_converter(catalog)
            self._catalog = catalog
        return self._catalog

    def confirm_catalog(self) -> bool:
        """Whether the catalog stands (``Catalog.confirmed``; waits for its listing). False: it was built from
        this process's last listing of the paths while the listing ran (what ``StreamLoader`` asks for with
        thread workers), and the files changed since: deliver nothing read through it; the next
        ``set_epoch`` builds the catalog anew."""
        return self._catalog is None or self._catalog.confirmed()

    def _splits_catalog(self) -> bool:
        """Whether the ranks that build this catalog are a process group's, so they can split the reads:
        the data-parallel mesh's group, or the default group when the rank is its own (explicit ranks of
        another numbering, as under tensor parallelism, may not all build it: each reads all)."""
        if self._catalog_group is not None or not self.topology_given:
            return True
        return collective.process_group() in (None, self.topology)

    @property
    def converter(self) -> BatchConverter:
        """How this dataset's columns become tensors (checked against the schema on first use)."""
        if self._converter is None:
            self._converter = self._make_converter(self.catalog)
        return self._converter

    def _make_converter(self, catalog: Catalog) -> BatchConverter:
        return BatchConverter(catalog.schema, source=catalog.urls[0], lists=self.lists, decimals=self.decimals,
                              inner_nulls=self.inner_nulls)

    @property
    def layout(self) -> Layout:
        return self.catalog.layout

    @property
    def planner(self) -> Planner:
        return Planner(self.layout, self.config, self.partitions)

    def __getstate__(self) -> dict[str, Any]:
        # Spawned DataLoader workers receive a pickled copy: plain data only, no closures or handles.
        return {**super().__getstate__(), "_converter": None, "_catalog_group": None}

    def epoch_plan(self, num_workers: int = 0, epoch: int | None = None) -> EpochPlan:
        """The plan of a whole epoch for this dataset's world size and ``num_workers`` DataLoader workers."""
        topology = Topology(0, self.world_size, 0, num_workers)
        return EpochPlan(self.layout, self.config, self.epoch if epoch is None else epoch, topology.num_global_workers)

    def canonical_plan(self, num_workers: int = 0, epoch: int | None = None) -> CanonicalPlan:
        """The canonical-order plan of an epoch (only with ``partitions=``)."""
        if self.partitions is None:
            raise ValueError("canonical_plan needs partitions=")
        epoch = self.epoch if epoch is None else epoch
        return CanonicalPlan(self.layout, self.config, epoch, self.partitions, self.world_size, num_workers)

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

    def _batches_a_message(self) -> int:
        """Batches a ``StreamLoader`` worker process sends in one message (``handoff.batches_per_message``
        of ``batch_size`` rows at ``_row_bytes()``: the same in every worker, known before any is read);
        one for a row group a batch."""
        if self.config.batch_size is None:
            return 1
        return batches_per_message(self._row_bytes() * self.config.batch_size)

    def _row_bytes(self) -> float:
        """A row's bytes in a batch, estimated generously from the catalog: ``_DECODED_PER_STORED`` times
        its files' stored bytes (all columns) a row."""
        catalog = self.catalog
        return _DECODED_PER_STORED * float(np.sum(catalog.file_sizes)) / max(int(np.sum(catalog.rg_rows)), 1)

    @property
    def shuffled(self) -> bool:
        return self.config.shuffle

    # -- checkpoint state ---------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """Everything that decides which rows an epoch delivers in which order (reads the footers)."""
        catalog = self.catalog
        # With partitions= the order depends on the global batch, so the per-rank size may change with the world.
        batch = ("batch_size", self.config.batch_size) if self.partitions is None else (
            "global_batch_size", self.config.batch_size * self.world_size)
        tables = {"tables": list(catalog.tables)} if catalog.tables else {}  # first: its mismatch names the version
        return {
            **tables, "catalog": catalog.digest, "file_identity": catalog.identity, "files": catalog.num_files,
            "rows": catalog.num_rows,
            "columns": self.columns, batch[0]: batch[1], "unit": self.config.unit,
            "shuffle": self.config.shuffle, "seed": self.config.seed, "shuffle_window": self.config.shuffle_window,
            "uneven": self.config.uneven, "partitions": self.partitions, "cast": self.cast,
            "order": ORDER_VERSION,  # a checkpoint of an older planner would resume other rows
        }

    # -- iteration ----------------------------------------------------------------------------
    def _before_pass(self, start: Start, worker_id: int, num_workers: int) -> None:
        if worker_id == 0:
            self._warn_about_traps(num_workers)
            self._warn_about_padding(num_workers)
        if isinstance(start.schedule, StreamSchedule):
            check_planning_room(start.schedule, self.catalog.place, self.catalog.rg_rows)
        if isinstance(start.schedule, StreamSchedule) and start.schedule.worker == 0:
            plan = start.schedule.plan
            if self.config.uneven == "drop" and plan.dropped_rows():
                log.warning("uneven='drop' leaves out %d of %d rows in epoch %d", plan.dropped_rows(), plan.total_rows,
                            plan.epoch)

    def _deliver(self, start: Start) -> Iterator[Any]:
        reader = RowGroupReader.from_catalog(self.catalog, self.storage_options)
        stats = self._delivery_stats(reader.stats, start.worker_id)
        try:
            read = lambda what: self._read_part(reader, what)  # noqa: E731
            place = lambda what: self.catalog.place(what.rg)  # noqa: E731 - for conversion errors
            weigh = lambda what: self._decoded_estimate(reader, what)  # noqa: E731 - read-ahead's byte budget
            fetched = lambda what: reader.fetch_bytes(  # noqa: E731 - more small reads in flight on object storage
                int(self.catalog.rg_file[what.rg]), int(self.catalog.rg_index[what.rg]))
            for batch in deliver(start.schedule, start.start, read, self.converter, self.read_ahead, stats,
                                 describe=place, weigh=weigh, fetched=fetched if self.read_ahead else None,
                                 together=lambda whats: reader.read_together(
                                     [(int(self.catalog.rg_file[w.rg]), int(self.catalog.rg_index[w.rg])) for w in whats])):
                self._report_stats(stats)
                yield batch if self.transform is None else self.transform(batch)
        finally:
            reader.close()

    def _decoded_estimate(self, reader: RowGroupReader, what: Read) -> int:
        """Estimated decoded bytes of ``what``: its group's, times the share of its rows it reads."""
        catalog = self.catalog
        whole = reader.decoded_estimate(int(catalog.rg_file[what.rg]), int(catalog.rg_index[what.rg]))
        rows = int(catalog.rg_rows[what.rg])
        return whole if what.rows is None or not rows else whole * len(what.rows) // rows

    def _read(self, reader: RowGroupReader, what: Read) -> pa.Table:
        got = self._read_part(reader, what)
        return got if isinstance(got, pa.Table) else got.table()

    def _read_part(self, reader: RowGroupReader, what: Read) -> pa.Table | StreamedPart:
        """``_read``, except that a streamed row group comes as a ``StreamedPart`` decoded as it is
        iterated (delivery converts it piece by piece: the part is never held in Arrow whole)."""
        catalog = self.catalog
        file_index, index = int(catalog.rg_file[what.rg]), int(catalog.rg_index[what.rg])
        got = reader.read_part(file_index, index, stored_rows(catalog, what.rg, what.rows))  # deleted rows left out
        rows = got.num_rows if isinstance(got, pa.Table) else got.rows
        if what.rows is None and rows != catalog.rg_rows[what.rg]:
            raise ReadError(
                f"{catalog.urls[file_index]}: row group {index} has {rows} rows but its footer said "
                f"{int(catalog.rg_rows[what.rg])}; did the file change?"
            )

        schemas: dict[tuple[str, ...], pa.Schema] = {}

        def finish(table: pa.Table) -> pa.Table:
            schema = catalog.schema
            if isinstance(got, StreamedPart) and got.passes > 1:  # a pass over some columns: those, and the keys
                schema = schemas.get(tuple(table.column_names)) or schemas.setdefault(
                    tuple(table.column_names), _pass_schema(schema, table.column_names, catalog.partition_values))
            if catalog.partition_values is not None:
                table = with_partition_columns(table, catalog.partition_values, file_index, schema)
            return read_as(table, schema, f"{catalog.urls[file_index]}: row group {index}")
        return finish(got) if isinstance(got, pa.Table) else got.map(finish)

    # -- warnings -----------------------------------------------------------------------------
    def _warn_about_traps(self, num_workers: int | None = None) -> None:
        """Warn (once each) about set-ups that work here but fail or waste time elsewhere."""
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

    def _warn_about_padding(self, num_workers: int) -> None:
        """Row-group-sized batches can pad a lot on uneven layouts: say so, with the fix."""
        if self.config.batch_size is not None or self.partitions is not None or "padding" in self._warned:
            return
        summary = self.epoch_summary(num_workers)
        steps = summary["steps_per_worker"] * summary["global_workers"]
        if steps and summary["padding_batches"] / steps > PADDING_WARNING:
            self._warn_once(
                "padding",
                f"batch_size=None: {summary['padding_batches']} of {steps} steps this epoch are padding "
                f"({summary['padding_batches'] / steps:.0%}) because row groups differ in size; an int batch_size "
                "pads at most one batch per worker",
            )

    def _warn_once(self, key: str, message: str) -> None:
        """One event, one message: a Python warning (the channel for set-up problems), once per dataset."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)


def _pass_schema(schema: pa.Schema, names: list[str], partition_values: pa.Table | None) -> pa.Schema:
    """``schema``'s fields of a streamed part's pass over the columns ``names`` (``io/reader.py``'s
    ``StreamedPart``), with the partition keys (each pass gets them; only the first converts them)."""
    wanted = set(names) | set(() if partition_values is None else partition_values.column_names)
    return pa.schema([field for field in schema if field.name in wanted], metadata=schema.metadata)
