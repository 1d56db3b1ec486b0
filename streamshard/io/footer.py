"""Parquet footers: reading one with a single ranged request, the byte ranges it describes, and
the footers this process already read (``SHARED_FOOTERS``).

The byte range of a column chunk is where pyarrow will read it: from its dictionary page (if
any, else its first data page) for ``total_compressed_size`` bytes. Ranges are kept per row
group and per *projected top-level column* (a struct or list column spans all its leaves), so
a reader can fetch exactly the chunks it decodes, before it even holds the footer.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Callable, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..format.ipc_schema import unsupported_fields
from ..format.parquet_thrift import PHYSICAL_TYPES, Chunk, FooterScan, key_value_metadata, scan_footer
from ..plan.sized_lru import SizedLRU

# Bytes of a file's tail fetched to find its footer when its length is not known yet (the catalog's
# first read; a reader without the catalog's layout). The footer of a narrow or medium schema fits, so
# one request usually gets all of it; a longer footer costs exactly one more request. 48 KiB more than a
# 16 KiB probe is well under a millisecond of transfer, against a round trip (5-30 ms on object stores)
# for every footer between 16 and 64 KiB; pyarrow's own reader probes 64 KiB too (PARQUET-978).
FOOTER_PROBE_BYTES = 64 * 1024
MAGIC = b"PAR1"


class FooterError(ValueError):
    """The bytes at the end of a file are not a readable Parquet footer (message says why)."""


def tail_range(size: int, footer_length: int | None) -> tuple[int, int]:
    """The ``[start, end)`` to fetch for a footer: exact when its length is known, else a probe."""
    if size < 12:
        raise FooterError(f"not a Parquet file ({size} bytes is too small)")
    want = footer_length + 8 if footer_length is not None else FOOTER_PROBE_BYTES
    return max(0, size - want), size


class ParsedFooter(NamedTuple):
    metadata: pq.FileMetaData
    length: int  # the footer's length as the file states it (without the 8-byte trailer)
    tail: bytes  # the file's last ``length + 8`` bytes: what ``SHARED_FOOTERS`` keeps


def parse_footer(tail: bytes, size: int, fetch_more: Callable[[int, int], bytes] | None = None) -> ParsedFooter:
    """``(metadata, footer_length, exact tail)`` from the last bytes of a file of ``size`` bytes.

    ``fetch_more(start, end)`` is called once when the footer is longer than ``tail``.
    """
    more = missing_footer_range(tail, size)
    if more is not None:
        if fetch_more is None:
            raise FooterError(f"footer length {footer_length_of(tail, size)} does not match the "
                              f"{len(tail) - 8} bytes cataloged")
        tail = fetch_more(*more)
    footer_length = footer_length_of(tail, size)
    exact = tail if len(tail) == footer_length + 8 else bytes(tail[-(footer_length + 8) :])
    scan = scan_footer(exact[:-8])
    if scan is not None and scan.encrypted is not None:  # before pyarrow: an encrypted chunk aborts the process
        raise FooterError(f"encrypted Parquet is not supported ({scan.encrypted})")
    try:
        metadata = pq.read_metadata(pa.BufferReader(exact))
    except pa.ArrowNotImplementedError as exc:  # a type pyarrow does not have (polars' Int128): not damage
        stored = key_value_metadata(exact[:-8]).get(b"ARROW:schema", b"")
        named = unsupported_fields(stored)
        which = f"column {', '.join(named)}: unsupported type" if named else "a column's type is unsupported"
        raise FooterError(f"{which}; pyarrow cannot read this file's schema ({exc}), so columns= cannot leave "
                          "the column out: the file must be written without it") from exc
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError/ArrowInvalid variants
        raise FooterError(f"corrupt Parquet footer: {exc}") from exc
    if scan is not None:
        _check_chunks_fit_schema(metadata, scan)
    return ParsedFooter(metadata, footer_length, exact)


def _check_chunks_fit_schema(metadata: pq.FileMetaData, scan: FooterScan) -> None:
    """``FooterError`` unless every row group has one chunk per schema column that fits the column (its
    physical type; level histograms of its levels; unencoded byte counts only for BYTE_ARRAY): pyarrow aborts
    the process (an uncaught C++ exception) when a chunk it is asked for does not fit."""
    schema = metadata.schema
    leaves = [schema.column(j) for j in range(metadata.num_columns)]
    for rg, chunks in enumerate(scan.chunks):
        if len(chunks) != len(leaves):
            raise FooterError(f"corrupt Parquet footer: row group {rg} has {len(chunks)} column chunks but the "
                              f"schema has {len(leaves)} columns")
        for chunk, leaf in zip(chunks, leaves):
            problem = _misfit(chunk, leaf)
            if problem:
                raise FooterError(f"corrupt Parquet footer: row group {rg}, column {leaf.path!r}: {problem}")


def _misfit(chunk: Chunk, leaf: pq.ColumnSchema) -> str:
    """How a column chunk contradicts its schema column ('' when it does not)."""
    physical = chunk.physical
    stated = PHYSICAL_TYPES[physical] if physical is not None and 0 <= physical < len(PHYSICAL_TYPES) \
        else f"type number {physical}"
    if stated != leaf.physical_type:
        return f"its chunk says {stated} but the schema says {leaf.physical_type}"
    for name, entries, level in (("repetition", chunk.repetition_histogram, leaf.max_repetition_level),
                                 ("definition", chunk.definition_histogram, leaf.max_definition_level)):
        if entries and entries != level + 1:
            return f"its {name} level histogram has {entries} entries for {level + 1} levels"
    if chunk.unencoded_bytes and leaf.physical_type != "BYTE_ARRAY":
        return f"its size statistics count unencoded BYTE_ARRAY bytes for a {leaf.physical_type} column"
    return ""


def footer_length_of(tail: bytes, size: int) -> int:
    """The footer length the last 8 bytes of a file of ``size`` bytes state; ``FooterError`` if not Parquet."""
    if len(tail) < 8 or tail[-4:] != MAGIC:
        if tail[-4:] == b"PARE":
            raise FooterError("encrypted Parquet is not supported (its footer is encrypted: PARE magic)")
        raise FooterError("not a readable Parquet file (no PAR1 magic at the end; truncated or another format?)")
    footer_length = int.from_bytes(tail[-8:-4], "little")
    if footer_length + 12 > size:
        raise FooterError(f"corrupt Parquet footer (length {footer_length} exceeds file size {size})")
    return footer_length


def missing_footer_range(tail: bytes, size: int) -> tuple[int, int] | None:
    """None when ``tail`` holds the whole footer, else the ``[start, end)`` to fetch instead."""
    footer_length = footer_length_of(tail, size)
    return (size - footer_length - 8, size) if footer_length + 8 > len(tail) else None


def column_leaves(metadata: pq.FileMetaData, names: Sequence[str]) -> list[list[int]]:
    """For each top-level column name, the indices of its Parquet leaf columns."""
    wanted = {name: i for i, name in enumerate(names)}
    leaves: list[list[int]] = [[] for _ in names]
    for j in range(metadata.num_columns):
        path = metadata.schema.column(j).path
        top = path.split(".")[0]
        if top not in wanted:  # a top-level name that itself contains dots
            top = next((n for n in wanted if path == n or path.startswith(n + ".")), None)
        if top is not None:
            leaves[wanted[top]].append(j)
    return leaves


def chunk_ranges(metadata: pq.FileMetaData, names: Sequence[str], leaves: list[list[int]] | None = None
                 ) -> np.ndarray:
    """int64 array ``(row_groups, len(names), 2)``: ``[start, end)`` of each projected column
    (``leaves``: ``column_leaves(metadata, names)``, when the caller has it).

    A column with several leaves (struct, map) spans from its first leaf chunk to the end of its
    last; the leaves of one column are written next to each other, so nothing else is inside.
    """
    leaves = column_leaves(metadata, names) if leaves is None else leaves
    out = np.zeros((metadata.num_row_groups, len(names), 2), dtype=np.int64)
    for rg in range(metadata.num_row_groups):
        group = metadata.row_group(rg)
        for c, indices in enumerate(leaves):
            starts, ends = [], []
            for j in indices:
                chunk = group.column(j)
                start = _chunk_start(chunk)
                starts.append(start)
                ends.append(start + chunk.total_compressed_size)
            if starts:
                out[rg, c] = (min(starts), max(ends))
    return out


def leaf_values(metadata: pq.FileMetaData, names: Sequence[str], leaves: list[list[int]] | None = None
                ) -> np.ndarray:
    """int64 array ``(row_groups, len(names))``: non-null leaf values of each single-leaf column chunk
    (for a list column, its elements: empty and null lists count as nulls at the leaf level), or -1
    where the column has several leaves or the writer kept no null count."""
    leaves = column_leaves(metadata, names) if leaves is None else leaves
    out = np.full((metadata.num_row_groups, len(names)), -1, dtype=np.int64)
    for rg in range(metadata.num_row_groups):
        group = metadata.row_group(rg)
        for c, indices in enumerate(leaves):
            if len(indices) != 1:
                continue
            chunk = group.column(indices[0])
            stats = chunk.statistics
            if stats is not None and stats.has_null_count:
                out[rg, c] = chunk.num_values - stats.null_count
    return out


def _chunk_start(chunk: pq.ColumnChunkMetaData) -> int:
    # As pyarrow computes it: the dictionary page when it precedes the first data page.
    start = chunk.data_page_offset
    dictionary = chunk.dictionary_page_offset
    if chunk.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
        start = dictionary
    return int(start)


# -- footers already read in this process ---------------------------------------------------------

SHARED_FOOTER_BYTES = 64 * 1024 * 1024  # serialized footers kept per process (parsed, they take ~8x more)


class SharedFooters:
    """The serialized footers this process read, by ``(url, size, version)``: LRU, bounded by bytes.

    The catalog fills it while it plans and every reader of the process (thread workers, passes,
    datasets over the same files) takes a file's footer from here instead of fetching it again;
    readers that want one at the same time fetch it once (``claim``/``settle``).
    A file is only ever found at the size and version it was stored under, so a rewritten file
    (another ETag, generation or mtime) misses; a file without a version token is never kept,
    since nothing could tell its rewrite apart. Bytes, not ``FileMetaData``: exact to bound, and a
    parse costs 0.01-0.3 ms against a request. A forked child keeps a copy (valid: plain bytes).
    """

    def __init__(self, budget: int = SHARED_FOOTER_BYTES) -> None:
        self._tails: SizedLRU[tuple[str, int, str], bytes] = SizedLRU(budget, len)
        self._pending: dict[tuple[str, int, str], Future[bytes | None]] = {}  # footers being fetched
        self._lock = threading.Lock()

    @property
    def budget(self) -> int:
        """Bytes of footers kept at most; 0 turns the sharing off."""
        return self._tails.max_size

    @budget.setter
    def budget(self, value: int) -> None:
        self._tails.max_size = value

    def get(self, url: str, size: int, version: str | None) -> bytes | None:
        """The file's last ``footer_length + 8`` bytes as stored at this size and version, or None."""
        if not version or not self.budget:
            return None
        with self._lock:
            return self._tails.get((url, int(size), version))

    def claim(self, url: str, size: int, version: str | None) -> tuple[bytes | None, Future[bytes | None] | None]:
        """``(tail, None)`` when kept; ``(None, future)`` while another thread fetches it (the future gives
        its tail, or None if that fetch failed); ``(None, None)``: the caller fetches it and then calls
        ``settle`` (always: others may be waiting)."""
        if not version or not self.budget:
            return None, None
        key = (url, int(size), version)
        with self._lock:
            tail = self._tails.get(key)
            if tail is not None:
                return tail, None
            pending = self._pending.get(key)
            if pending is not None:
                return None, pending
            self._pending[key] = Future()
            return None, None

    def settle(self, url: str, size: int, version: str | None, tail: bytes | None) -> None:
        """End a ``claim``: keep ``tail`` (None: the fetch failed) and wake the threads waiting for it."""
        if tail is not None:
            self.put(url, size, version, tail)
        with self._lock:
            pending = self._pending.pop((url, int(size), version or ""), None)
        if pending is not None:
            pending.set_result(tail)

    def put(self, url: str, size: int, version: str | None, tail: bytes) -> None:
        """Keep ``tail`` (a file's exact footer bytes, read at ``version``), evicting the oldest over budget."""
        if not version or len(tail) > self.budget:
            return
        with self._lock:
            self._tails.put((url, int(size), version), bytes(tail))

    def clear(self) -> None:
        with self._lock:
            self._tails.clear()

    def __len__(self) -> int:
        return len(self._tails)

    def _after_fork(self) -> None:
        # A lock held by another thread at the fork stays held in the child: start with a new one.
        self._lock = threading.Lock()
        self._pending = {}  # the threads fetching them are not in this process


SHARED_FOOTERS = SharedFooters()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SHARED_FOOTERS._after_fork)
