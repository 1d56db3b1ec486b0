"""Assembling batches: Arrow tables with a ``sample_id`` column -> dicts of tensors, padding rows."""

from __future__ import annotations

from typing import Collection, Iterator

import numpy as np
import pyarrow as pa
import torch

from .tensors import Batch, BatchConverter

SAMPLE_ID = "sample_id"


def rebatch(tables: Iterator[pa.Table], batch_size: int | None, count: int, convert: BatchConverter) -> Iterator[Batch]:
    """Convert piece tables into ``count`` real batches (exactly ``batch_size`` rows each)."""
    if batch_size is None:
        for table, _ in zip(tables, range(count)):
            yield as_batch(table, convert)
        return
    pending: pa.Table | None = None
    emitted = 0
    for table in tables:
        pending = table if pending is None else pa.concat_tables([pending, table])
        while pending.num_rows >= batch_size and emitted < count:
            yield as_batch(pending.slice(0, batch_size), convert)
            pending = pending.slice(batch_size)
            emitted += 1
    if emitted < count and pending is not None and pending.num_rows:
        batch = as_batch(pending, convert)  # the short last batch, topped up with padding rows
        yield concat(batch, padding_like(batch, batch_size - pending.num_rows, convert.ragged_keys))


def as_batch(table: pa.Table, convert: BatchConverter) -> Batch:
    ids = table.column(SAMPLE_ID).to_numpy()
    return with_ids(convert(table.drop_columns([SAMPLE_ID])), ids)


def with_ids(batch: Batch, ids: np.ndarray) -> Batch:
    batch[SAMPLE_ID] = torch.from_numpy(np.array(ids, dtype=np.int64, copy=True))
    return batch


def padding_like(batch: Batch, rows: int, ragged: Collection[str] = ()) -> Batch:
    """``rows`` padding rows shaped like ``batch``: zeros, False, None, and sample_id -1.

    ``ragged`` keys hold all rows' values end to end; padding rows (length 0) add none.
    """
    out: Batch = {}
    for key, value in batch.items():
        if key in ragged:
            out[key] = value.new_zeros((0,) + tuple(value.shape[1:]))
        elif isinstance(value, torch.Tensor):
            out[key] = value.new_zeros((rows,) + tuple(value.shape[1:]))
        else:
            out[key] = [None] * rows
    out[SAMPLE_ID] = torch.full((rows,), -1, dtype=torch.int64)
    return out


def concat(a: Batch, b: Batch) -> Batch:
    out: Batch = {}
    for key, value in a.items():
        other = b[key]
        if isinstance(value, torch.Tensor):
            if value.dim() == 2 and value.shape[1] != other.shape[1]:
                width = max(value.shape[1], other.shape[1])
                value = torch.nn.functional.pad(value, (0, width - value.shape[1]))
                other = torch.nn.functional.pad(other, (0, width - other.shape[1]))
            out[key] = torch.cat([value, other])
        else:
            out[key] = list(value) + list(other)
    return out


def clone(batch: Batch) -> Batch:
    return {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in batch.items()}
