"""Write synthetic Parquet corpora of a given layout (files x row groups x rows)."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("score", pa.float32()),
        ("label", pa.int64()),
    ]
)


def write_corpus(
    directory: str,
    layout: Sequence[Sequence[int]],
    min_tokens: int = 4,
    max_tokens: int = 16,
    seed: int = 0,
    tokens: str = "id",
    vocab: int = 50_000,
) -> list[str]:
    """Write one file per entry of ``layout``, with row groups of the given row counts.

    Column ``id`` holds the row's global index in sorted-path order (what ``sample_id`` must
    be), so a reader's output can be checked row by row. ``tokens="id"`` fills each row's
    ``input_ids`` with ``id % vocab`` (checkable); ``tokens="random"`` draws them uniformly
    (compresses like real token data, for benchmarks). Returns the file paths, sorted.
    """
    if tokens not in ("id", "random"):
        raise ValueError(f"tokens must be 'id' or 'random', got {tokens!r}")
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths, next_id = [], 0
    for f, row_groups in enumerate(layout):
        path = os.path.join(directory, f"part-{f:05d}.parquet")
        with pq.ParquetWriter(path, SCHEMA) as writer:
            for rows in row_groups:
                table = _rows(rng, next_id, int(rows), min_tokens, max_tokens, tokens == "random", vocab)
                writer.write_table(table, row_group_size=max(int(rows), 1))
                next_id += int(rows)
        paths.append(path)
    return sorted(paths)


def _rows(rng: np.random.Generator, first: int, n: int, lo: int, hi: int, random: bool, vocab: int) -> pa.Table:
    ids = np.arange(first, first + n, dtype=np.int64)
    lengths = rng.integers(lo, hi + 1, size=n)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    if random:
        tokens = rng.integers(0, vocab, size=int(offsets[-1]), dtype=np.int32)
    else:
        tokens = (np.repeat(ids, lengths) % vocab).astype(np.int32)  # token values derive from the id
    return pa.table(
        {
            "id": ids,
            "input_ids": pa.ListArray.from_arrays(offsets, tokens),
            "score": (ids % 1000).astype(np.float32) / 1000,
            "label": ids % 7,
        },
        schema=SCHEMA,
    )


def write_fixed(path: str | os.PathLike, first_id: int, rows_per_group: Sequence[int] = (50, 50)) -> None:
    """A file whose size does not depend on its values (one plain int64 ``id`` column, no compression,
    no statistics), so a rewrite with other ids has the same size: only the file's version can tell
    the two apart (the replaced-file fault of tests and the reliability benchmark)."""
    ids = np.arange(first_id, first_id + sum(rows_per_group), dtype=np.int64)
    with pq.ParquetWriter(str(path), pa.schema([("id", pa.int64())]), compression="none", use_dictionary=False,
                          write_statistics=False) as writer:
        start = 0
        for rows in rows_per_group:
            writer.write_table(pa.table({"id": ids[start:start + rows]}))
            start += rows
