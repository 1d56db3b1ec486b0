"""Token packing, the pure part (numpy and Parquet metadata only; no I/O, no torch).

A packed epoch is planned like any stream (``plan/epoch_plan.py``), with *tokens* as its rows: a row group's
"rows" are its tokens (from the footer: the list column's leaf values minus its nulls), laid out
document after document in the row group's document order (the source's row permutation when
shuffling), each document's tokens in order. Blocks are balanced by tokens, so every global worker
fills the same number of ``[batch_size, seq_len]`` batches and only each worker's last batch pads;
resume and elastic resizing are the token-level versions of the row-level ones. A document cut by a
sequence, batch, worker or checkpoint boundary is continued, never lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .batch_plan import BatchSpec, StreamSchedule
from .blend_plan import BlendBatches, BlendMap, CorpusOrder
from ..errors import CatalogError

_EMPTY = np.zeros(0, dtype=np.int64)


def token_counts(catalog: Any, column: str) -> np.ndarray:
    """Tokens per row group of list column ``column``, from the catalog's footer summaries (the list's
    non-null leaf values: empty and null lists are nulls at the leaf level). A file whose writer kept
    no null count (or a column of several leaves) is refused by name."""
    if catalog.rg_values is None:
        raise CatalogError("this catalog holds no leaf value counts (an old catalog cache?); rebuild it")
    if getattr(catalog, "deleted_rows", None):
        raise CatalogError(f"{catalog.tables}: rows deleted by deletion vectors cannot be packed (token counts come "
                           "from the footers, which count them); rewrite the files (REORG TABLE ... APPLY (PURGE))")
    if column in getattr(catalog, "partition_keys", ()):
        raise CatalogError(f"column {column!r} is a partition key (its values are in the paths), not a list of tokens")
    counts = catalog.rg_values[:, catalog.file_columns.index(column)]
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


def pack(spec: BatchSpec, groups: dict[int, TokenGroup], first_ids: Sequence[np.ndarray], seq_len: int,
         batch_size: int, dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    """One ``[batch_size, seq_len]`` batch: the spec's tokens at their slots (in order when the spec
    gives none), padding tokens elsewhere. ``first_ids[source]`` maps a read's row group to the id
    of its first row.

    ``position_ids`` restart at every document and at every sequence start (a document continued
    from the previous sequence starts again at 0); ``sample_id`` is the source row of each token,
    -1 on padding; a spec with corpora (a packed blend) also gives ``corpus`` per token."""
    slots = batch_size * seq_len
    out = {name: np.zeros(slots, dtype=dtype) for name, dtype in dtypes.items()}
    sample_id = np.full(slots, -1, dtype=np.int64)
    within = np.zeros(slots, dtype=np.int64)
    for key, what in spec.reads.items():
        mask = spec.read == key
        at = spec.row[mask]
        group = groups[key]
        where = np.flatnonzero(mask) if spec.slot is None else spec.slot[mask]
        for name in out:
            out[name][where] = group.values[name][at]
        sample_id[where] = first_ids[what.source][what.rg] + group.row[at]
        within[where] = group.position[at]
    # A fragment starts at a sequence start or where the document changes; positions count from there.
    column = np.arange(slots, dtype=np.int64) % seq_len
    starts = (column == 0) | np.concatenate([[True], sample_id[1:] != sample_id[:-1]])
    base = np.maximum.accumulate(np.where(starts, np.arange(slots), 0))
    position = within - within[base]
    position[sample_id < 0] = 0
    shaped = {name: array.reshape(batch_size, seq_len) for name, array in out.items()}
    shaped["position_ids"] = position.reshape(batch_size, seq_len)
    shaped["sample_id"] = sample_id.reshape(batch_size, seq_len)
    if spec.corpus is not None:
        corpus = np.full(slots, -1, dtype=np.int64)
        corpus[spec.slot if spec.slot is not None else np.arange(spec.rows)] = spec.corpus
        shaped["corpus"] = corpus.reshape(batch_size, seq_len)
    return shaped


def segment_bounds(position_ids: np.ndarray) -> np.ndarray:
    """``cu_seqlens`` of a packed batch: the offsets, in the flattened batch, where a segment starts
    (every ``position_ids == 0``), followed by the total token count."""
    flat = np.asarray(position_ids).reshape(-1)
    return np.concatenate([np.flatnonzero(flat == 0), [flat.size]]).astype(np.int32)


class PackedBlendBatches(BlendBatches):
    """A worker's batches of a packed blend: each blend position is one *sequence* of its corpus.

    Corpus ``k``'s epoch is its token stream (``CorpusOrder`` over tokens: documents in the source's
    order) cut into ``ceil(T_k / seq_len)`` sequences, the last one short (padded in place); blend
    index ``j`` of blend epoch ``e`` is sequence ``J = e * c_k + j`` of the corpus's endless sequence
    of epochs. Positions are planned like rows (equal steps, exact and elastic resume), and a
    worker's sequences of one corpus rise, so each corpus is read in order."""

    def __init__(self, positions: StreamSchedule, blend: Any, corpora: list[CorpusOrder], seq_len: int) -> None:
        super().__init__(positions, blend, corpora)
        self.seq_len = seq_len
        self.slots = seq_len * int(positions.plan.config.batch_size or 1)
        self.tokens = np.array([c.size for c in corpora], dtype=np.int64)  # per corpus epoch

    def batch(self, index: int) -> BatchSpec:
        spec = self.positions.batch(index)
        if not spec.rows:
            return BatchSpec(index, {}, _EMPTY, _EMPTY, _EMPTY, self.slots, corpus=_EMPTY, slot=_EMPTY)
        corpus, sequence = self.blend.samples(spec.sample_id)  # plain or steered (set_weights)
        first, length = self.sequences(corpus, sequence)
        owner = np.repeat(np.arange(len(length), dtype=np.int64), length)
        offset = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
        reads, key, row, sample_id = self.place(corpus[owner], first[owner] + offset)
        return BatchSpec(index, reads, key, row, sample_id, self.slots - len(owner), corpus=corpus[owner],
                         slot=owner * self.seq_len + offset)

    def sequences(self, corpus: np.ndarray, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(first token, tokens)`` of each corpus sequence: its first token in the corpus's endless
        token stream (epoch after epoch) and its length (``seq_len``, less for an epoch's last one)."""
        tokens = self.tokens[corpus]
        epoch, s = np.divmod(sequence, -(-tokens // self.seq_len))
        return epoch * tokens + s * self.seq_len, np.minimum(self.seq_len, tokens - s * self.seq_len)

    def shape_donor(self) -> BatchSpec | None:
        return None  # packed batches are assembled from their spec alone, padding ones included
