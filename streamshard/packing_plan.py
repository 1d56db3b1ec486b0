"""Token packing, the pure part (numpy and Parquet metadata only; no I/O, no torch).

A packed epoch is planned like any stream (``plan.py``), with *tokens* as its rows: a row group's
"rows" are its tokens (from the footer: the list column's leaf values minus its nulls), laid out
document after document in the row group's document order (the source's row permutation when
shuffling), each document's tokens in order. Blocks are balanced by tokens, so every global worker
fills the same number of ``[batch_size, seq_len]`` batches and only each worker's last batch pads;
resume and elastic resizing are the token-level versions of the row-level ones. A document cut by a
sequence, batch, worker or checkpoint boundary is continued, never lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .batch_plan import BatchSpec
from .errors import CatalogError


def token_counts(catalog: Any, column: str) -> np.ndarray:
    """Tokens per row group of list column ``column``, from the catalog's footer summaries (the list's
    non-null leaf values: empty and null lists are nulls at the leaf level). A file whose writer kept
    no null count (or a column of several leaves) is refused by name."""
    if catalog.rg_values is None:
        raise CatalogError("this catalog holds no leaf value counts (an old catalog cache?); rebuild it")
    counts = catalog.rg_values[:, catalog.columns.index(column)]
    unknown = np.flatnonzero(counts < 0)
    if unknown.size:
        rg = int(unknown[0])
        raise CatalogError(
            f"{catalog.urls[int(catalog.rg_file[rg])]}: row group {int(catalog.rg_index[rg])} of column {column!r} "
            "has no null count in its statistics (or several leaves), so its tokens cannot be counted from the "
            "footer; rewrite the file with statistics")
    return counts.astype(np.int64)


@dataclass(frozen=True)
class TokenGroup:
    """One decoded row group as a token stream: documents in their order, tokens in order."""

    values: dict[str, np.ndarray]  # per packed column: every token, in stream order
    row: np.ndarray  # int64 per token: the document's row number in the row group (file order)
    position: np.ndarray  # int64 per token: its position inside its document


def token_group(lengths: np.ndarray, starts: np.ndarray, values: dict[str, np.ndarray], order: np.ndarray) -> TokenGroup:
    """Lay out documents ``order`` (row numbers) end to end; ``starts``/``lengths`` locate each row's
    tokens inside the flat ``values`` arrays (file order)."""
    doc_lengths = lengths[order]
    total = int(doc_lengths.sum())
    doc_begin = np.zeros(len(order), dtype=np.int64)
    if len(order) > 1:
        np.cumsum(doc_lengths[:-1], out=doc_begin[1:])
    position = np.arange(total, dtype=np.int64) - np.repeat(doc_begin, doc_lengths)
    source = np.repeat(starts[order], doc_lengths) + position
    return TokenGroup({name: array[source] for name, array in values.items()},
                      np.repeat(order, doc_lengths), position)


def pack(spec: BatchSpec, groups: dict[int, TokenGroup], first_id: np.ndarray, seq_len: int, batch_size: int,
         dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    """One ``[batch_size, seq_len]`` batch: the spec's tokens in order, then padding tokens.

    ``position_ids`` restart at every document and at every sequence start (a document continued
    from the previous sequence starts again at 0); ``sample_id`` is the source row of each token,
    -1 on padding."""
    slots = batch_size * seq_len
    out = {name: np.zeros(slots, dtype=dtype) for name, dtype in dtypes.items()}
    sample_id = np.full(slots, -1, dtype=np.int64)
    within = np.zeros(slots, dtype=np.int64)
    n = spec.rows
    for key, what in spec.reads.items():
        mask = spec.read == key
        at = spec.row[mask]
        group = groups[key]
        where = np.flatnonzero(mask)
        for name in out:
            out[name][where] = group.values[name][at]
        sample_id[where] = first_id[what.rg] + group.row[at]
        within[where] = group.position[at]
    # A fragment starts at a sequence start or where the document changes; positions count from there.
    column = np.arange(slots, dtype=np.int64) % seq_len
    starts = (column == 0) | np.concatenate([[True], sample_id[1:] != sample_id[:-1]])
    base = np.maximum.accumulate(np.where(starts, np.arange(slots), 0))
    position = within - within[base]
    position[n:] = 0
    shaped = {name: array.reshape(batch_size, seq_len) for name, array in out.items()}
    shaped["position_ids"] = position.reshape(batch_size, seq_len)
    shaped["sample_id"] = sample_id.reshape(batch_size, seq_len)
    return shaped


def segment_bounds(position_ids: np.ndarray) -> np.ndarray:
    """``cu_seqlens`` of a packed batch: the offsets, in the flattened batch, where a segment starts
    (every ``position_ids == 0``), followed by the total token count."""
    flat = np.asarray(position_ids).reshape(-1)
    return np.concatenate([np.flatnonzero(flat == 0), [flat.size]]).astype(np.int32)
