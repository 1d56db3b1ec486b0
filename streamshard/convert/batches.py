"""Batch assembly helpers: the ``sample_id`` column, padding rows, joining two batches."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from .tensors import Batch

SAMPLE_ID = "sample_id"
CORPUS = "corpus"  # blends: the corpus of each row; -1 on padding


def with_ids(batch: Batch, ids: np.ndarray) -> Batch:
    batch[SAMPLE_ID] = torch.from_numpy(np.array(ids, dtype=np.int64, copy=True))
    return batch


def padding_like(batch: Batch, rows: int, ragged: Collection[str] = ()) -> Batch:
    """``rows`` padding rows shaped like ``batch``: zeros, False, None, and -1 for sample_id and corpus.

    ``ragged`` keys (``BatchConverter.ragged_keys``) hold entries of all rows end to end: flat
    list values and their masks, and the lengths and masks of inner list levels. A padding row
    has length 0 at the outer level, so it adds no entry to any of them.
    """
    out: Batch = {}
    for key, value in batch.items():
        if key in ragged:
            out[key] = value.new_zeros((0,) + tuple(value.shape[1:]))
        elif isinstance(value, torch.Tensor):
            out[key] = value.new_zeros((rows,) + tuple(value.shape[1:]))
        else:
            out[key] = [None] * rows
    for key in (SAMPLE_ID, CORPUS):
        if key in batch:
            out[key] = torch.full((rows,), -1, dtype=torch.int64)
    return out


def concat(a: Batch, b: Batch) -> Batch:
    """The rows of ``a`` then ``b``: per-row entries and end-to-end (ragged) entries both concatenate;
    padded 2-D tensors (lists, their value masks) are first padded to the wider of the two."""
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

