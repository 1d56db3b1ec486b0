"""``PackedStream``: documents of a tokenized corpus laid end to end into fixed ``[batch, seq_len]`` batches.

The plan is the stream plan with tokens as rows (``packing_plan.py``): blocks balanced by tokens, so
padding is only each worker's last batch; every token exactly once per epoch; the checkpoint contract
of every stream (``stream_base.py``), so ``StreamLoader`` resumes it on any topology.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from .batch_plan import BatchSpec, Read
from .dataset import ParquetStream
from .delivery import DeliveryStats, deliver
from .errors import ConversionError, ReadError
from .packing_plan import TokenGroup, pack, segment_bounds, token_counts, token_group
from .plan import EpochPlan, Layout, PlanConfig
from .reader import RowGroupReader
from .resume import Planner, Start
from .stream_base import PlannedStream
from .tensors import Batch
from .validate import check_int



class PackedStream(PlannedStream):
    """Pack the documents of ``source`` (a tokenized ``ParquetStream``) into fixed-length sequences.

    Each batch holds ``batch_size`` sequences of ``seq_len`` tokens::

        batch["input_ids"]     # [B, L], the column's dtype: documents laid end to end
        batch["position_ids"]  # int64 [B, L]: position inside the document's fragment in this sequence
        batch["sample_id"]     # int64 [B, L]: the source row of each token; -1 = padding token

    A document longer than what is left of a sequence continues in the next sequence (the next
    batch, or another worker's first one); its positions restart at 0 there, and ``sample_id``
    says it is the same document. ``cu_seqlens(batch["position_ids"])`` gives the segment offsets
    for varlen attention. Every token of every document is delivered exactly once per epoch over
    all ranks and workers; work is balanced by tokens, so only each worker's last batch pads.

    From ``source`` the pack uses its catalog (paths, storage options), ``unit``, ``shuffle``,
    ``seed`` (documents are shuffled within each row group and row groups or files in the stream,
    as for the source), ``read_ahead`` and its rank/world size; its ``batch_size``,
    ``shuffle_window``, ``uneven`` and ``transform`` do not apply, and columns other than the
    packed ones are not read.

    Args:
        source: the ``ParquetStream`` to pack (a ``BlendedStream`` is not supported yet).
        column: the list-of-integers column holding the tokens.
        seq_len, batch_size: the shape of a batch.
        columns: more list columns to pack alongside, row by row of the same length as ``column``
            (labels, loss masks); a row whose lengths differ is an error naming file and row group.
        transform: called on each batch inside the worker.
    """

    def __init__(self, source: ParquetStream, column: str = "input_ids", seq_len: int = 2048, batch_size: int = 8,
                 columns: Sequence[str] = (), transform: Callable[[Batch], Any] | None = None) -> None:
        super().__init__()
        if not isinstance(source, ParquetStream):
            raise ValueError(f"PackedStream packs a ParquetStream; got {type(source).__name__} "
                             "(packing a BlendedStream is not supported yet)")
        if not isinstance(column, str) or isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"column must be a column name and columns a list of names, got {column!r}, {columns!r}")
        if column in columns or len(set(columns)) != len(columns):
            raise ValueError(f"columns {list(columns)} repeat a column or the token column {column!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        self.source, self.column, self.columns = source, column, [column, *columns]
        self.seq_len = check_int(seq_len, "seq_len", 1)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        self.transform = transform
        self.rank, self.world_size = source.rank, source.world_size
        self._tokens: np.ndarray | None = None  # per row group of the catalog, from the footers
        self._dtypes: dict[str, np.dtype] | None = None

    # -- what decides the order ----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; also reads the footers once here, so DataLoader workers inherit the counts."""
        super().set_epoch(epoch)
        self.tokens  # noqa: B018

    @property
    def tokens(self) -> np.ndarray:
        """Tokens of each row group of the source's catalog (int64), read from the footers once."""
        if self._tokens is None:
            catalog = self.source.catalog
            self._dtypes = self._check_columns(catalog.schema)
            self._tokens = token_counts(catalog, self.column)
        return self._tokens

    @property
    def shuffled(self) -> bool:
        return self.source.config.shuffle

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def planner(self) -> Planner:
        config = self.source.config
        tokens = PlanConfig(unit=config.unit, shuffle=config.shuffle, seed=config.seed,
                            batch_size=self.batch_size * self.seq_len, uneven="pad", shuffle_rows=False)
        return Planner(Layout(self.tokens, self.source.catalog.rg_file), tokens, None)

    def fingerprint(self) -> dict[str, Any]:
        source = {k: v for k, v in self.source.fingerprint().items()
                  if k not in ("batch_size", "shuffle_window", "uneven", "columns")}
        return {**source, "packed_columns": self.columns, "seq_len": self.seq_len, "batch_size": self.batch_size,
                "tokens": self.num_tokens}

    # -- iteration ----------------------------------------------------------------------------
    def _deliver(self, start: Start) -> Iterator[Any]:
        catalog = self.source.catalog
        self.tokens  # noqa: B018 - counted in the main process when set_epoch was called there
        assert self._dtypes is not None
        reader = RowGroupReader.from_catalog(catalog, self.source.storage_options, columns=self.columns)
        documents = EpochPlan(catalog.layout, self.source.config, self.epoch, 1)  # the source's row order
        first_id = catalog.layout.rg_first_id
        dtypes = self._dtypes
        stats = DeliveryStats(reader.stats) if self.source.stats_hook is not None else None

        def read(what: Read) -> TokenGroup:
            return self._token_group(reader, what.rg, documents)

        def assemble(spec: BatchSpec, groups: dict[int, TokenGroup]) -> Batch:
            arrays = pack(spec, groups, first_id, self.seq_len, self.batch_size, dtypes)
            return {name: torch.from_numpy(array) for name, array in arrays.items()}

        try:
            for batch in deliver(start.schedule, start.start, read, None, self.source.read_ahead, stats, assemble):
                yield batch if self.transform is None else self.transform(batch)
        finally:
            reader.close()

    def _token_group(self, reader: RowGroupReader, rg: int, documents: EpochPlan) -> TokenGroup:
        catalog = self.source.catalog
        file_index, index = int(catalog.rg_file[rg]), int(catalog.rg_index[rg])
        where = f"{catalog.urls[file_index]}: row group {index}"
        table = reader.read(file_index, index)
        lists = {name: table.column(name).combine_chunks() for name in self.columns}
        lengths = pc.fill_null(pc.list_value_length(lists[self.column]), 0).to_numpy().astype(np.int64)
        values = {}
        for name, array in lists.items():
            mine = pc.fill_null(pc.list_value_length(array), 0).to_numpy().astype(np.int64)
            if not np.array_equal(mine, lengths):
                row = int(np.flatnonzero(mine != lengths)[0])
                raise ConversionError(f"{where}: column {name!r} has {mine[row]} values in row {row} but "
                                      f"{self.column!r} has {lengths[row]}; packed columns must match row by row")
            flat = array.flatten()
            if flat.null_count:
                raise ConversionError(f"{where}: column {name!r} has null values inside its lists; packing needs numbers")
            values[name] = flat.to_numpy(zero_copy_only=False)
        if len(lengths) != catalog.rg_rows[rg] or int(lengths.sum()) != int(self.tokens[rg]):
            raise ReadError(f"{where}: {len(lengths)} rows and {int(lengths.sum())} tokens, but the footer said "
                            f"{int(catalog.rg_rows[rg])} rows and {int(self.tokens[rg])} tokens; did the file change?")
        starts = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], out=starts[1:])
        order = documents.rows_at(np.full(len(lengths), rg, dtype=np.int64), np.arange(len(lengths), dtype=np.int64))
        return token_group(lengths, starts, values, order)

    def _check_columns(self, schema: pa.Schema) -> dict[str, np.dtype]:
        """Every packed column must be a list of numbers; their dtypes, for padding batches."""
        dtypes = {}
        for name in self.columns:
            if name not in schema.names:
                raise ValueError(f"column {name!r} is not in the source's columns {schema.names}")
            t = schema.field(name).type
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
                    pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type) or pa.types.is_boolean(t.value_type)):
                raise ValueError(f"column {name!r} is {t}; PackedStream packs lists of numbers (other columns are "
                                 "not read: leave them out of columns=)")
            dtype = np.dtype(t.value_type.to_pandas_dtype())
            dtypes[name] = np.dtype(np.int64) if dtype.kind == "u" and dtype != np.uint8 else dtype  # torch lacks most uints
        return dtypes


def cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment start offsets of a packed batch, flattened, plus the total: ``cu_seqlens`` for varlen
    attention kernels (int32). A segment starts wherever ``position_ids == 0`` (each document, each
    continuation at a sequence start, each padding token)."""
    bounds = segment_bounds(position_ids.detach().cpu().numpy())
    return torch.from_numpy(bounds).to(position_ids.device)
