"""Reading row groups inside a worker: exact byte ranges, bounded read-ahead, retries, clear errors.

For one row group the reader fetches only the column chunks of the projected columns, as byte
ranges (adjacent ones coalesced when the gap is small), plus the file's footer the first time
this process meets the file: footers are shared by every reader of the process (passes, thread
workers), keyed by the cataloged URL, size and version (``footer.SHARED_FOOTERS``), and the catalog
leaves there the ones it read. With the catalog's ranges a footer still to fetch comes with the data,
in one concurrent round. pyarrow then decodes from those bytes alone (the footer is passed as
``metadata``, so nothing else is read). No whole-file downloads, no fsspec read-ahead buffers.

Files are read at the version the catalog recorded (given ``versions``): on S3 (s3fs or obstore)
every GET carries the cataloged ETag as ``If-Match``, so the store itself refuses a changed object
(no request of its own, and no gap between a check and a read); a synchronous backend's file is
checked (size and mtime, one ``info``/stat) each time a handle is opened; on another async backend
(gcsfs, http) one ``info`` per file per reader runs alongside the file's first fetch (in the same
round trip), and none of its bytes are used before it confirmed the version. A changed file is a
``ReadError`` naming both versions, never other rows under the old sample ids.

A row group estimated to decode to more than ``STREAM_ABOVE_BYTES`` (``decoded_size.py``) is
*streamed* instead: pyarrow decodes it in record batches of about ``STREAM_BATCH_BYTES`` from a
file view that fetches byte ranges as the decoder asks (about ``STREAM_BUFFER_BYTES`` of compressed
bytes buffered over all columns), and only the rows asked for (``rows=``) are kept. So a worker
that owns part of a huge row group holds its part plus one record batch, not the whole group and
its compressed bytes. Small groups (the common case) keep the one-round whole-group read.

Backends: an async fsspec filesystem (s3fs, gcsfs, http) gets all ranges of a row group in
flight at once through ``fs.cat_ranges``; a synchronous one (local disk) is read through one
open handle per file. Every request is retried on transient faults (``streamshard.retry``), and
on async backends the retry deadline also cuts off a request in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import merge_offset_ranges

from .decoded_size import row_group_decoded_bytes
from .errors import ReadError
from .footer import SHARED_FOOTERS, FooterError, chunk_ranges, parse_footer, tail_range
from .reader_parts import (
    _FooterCache,
    _Handles,
    _Once,
    _SparseFile,
    decode_rows,
    keep_rows,
)
from .retry import RetriesExhausted, RetryPolicy, TransientError, call_within, describe
from .storage import (
    FileSystems,
    ObjectChanged,
    cat_ranges_if_match,
    check_short_read,
    file_change,
    if_match_etag,
    is_async,
    timeout_kw,
)

log = logging.getLogger("streamshard")

Range = tuple[int, int]

DEFAULT_MAX_GAP = 16 * 1024  # bytes of unneeded data worth fetching to save one request
# Without the catalog's footer length, a small probe of the tail: narrow schemas fit, and a
# wide footer costs one more request rather than every worker fetching data it will not use.
FOOTER_PROBE_BYTES = 16 * 1024
# A row group decoding to more than this is streamed (record batches, ranges fetched on demand):
# above it the whole-group read's peak (compressed chunks + decoded table, ~3x the table) matters
# more than its one round trip; below it, streaming gains nothing.
STREAM_ABOVE_BYTES = 64 * 1024 * 1024
STREAM_BATCH_BYTES = 16 * 1024 * 1024  # decoded bytes per record batch of a streamed row group
STREAM_BUFFER_BYTES = 16 * 1024 * 1024  # compressed bytes buffered over all columns while streaming
_PART_CHUNKS = 8  # a streamed part is gathered into about this many chunks (a take costs per chunk)
# A group this many times smaller (compressed) than STREAM_ABOVE_BYTES is read whole without first
# fetching its footer to estimate its decoded size (keeps footer and data in one round).
_SURELY_SMALL_RATIO = 32
_VERIFY_THREADS = 4  # version checks (one HEAD per file) in flight at once per reader
_NOTE_SECONDS = 10.0  # at most this long asking the store, after a failure, whether the file changed


@dataclass
class ReadStats:
    """What a reader fetched: requests, bytes, footers; ``misses`` should stay 0."""

    requests: int = 0
    bytes_fetched: int = 0
    footers_fetched: int = 0
    footers_shared: int = 0  # footers taken from this process's earlier reads (``footer.SHARED_FOOTERS``)
    row_groups_read: int = 0
    misses: int = 0  # reads pyarrow made outside the planned ranges (fetched on demand)
    read_seconds: float = 0.0  # wall time inside read() (fetch + decode), summed over threads
    fetch_seconds: float = 0.0  # the part of it spent fetching byte ranges (retries included)
    row_groups_streamed: int = 0  # of row_groups_read, those decoded in record batches
    rows_decoded: int = 0  # rows pyarrow decoded (a streamed group stops after the last row asked for)
    rows_kept: int = 0  # rows returned (fewer than decoded when a read asks for part of a group)
    largest_decode: int = 0  # most rows decoded at once (a whole group, or one record batch)
    largest_fetch: int = 0  # bytes of the largest single range fetched


class RowGroupReader:
    """Reads ``(file, row group)`` of a fixed list of files, fetching only what it decodes.

    Args:
        urls, sizes: the files (as cataloged) and their sizes in bytes.
        columns: top-level columns to decode (None: all).
        storage_options: fsspec options (credentials, endpoint); secrets never reach messages.
        max_open_files: open handles kept for synchronous filesystems.
        footer_lengths, rg_ranges, file_first_rg: the catalog's byte layout (see
            ``from_catalog``); without it each file's footer is fetched before its data.
        retry: per-request retry policy. max_gap: coalesce ranges closer than this.
        max_cached_footers: parsed footers kept (a footer is fetched again after eviction).
        versions: each file's version as cataloged (``Catalog.versions``); given, a file whose
            size or version differs now is refused (``ReadError``). None: not checked.

    Thread-safe: several row groups may be read at once (that is how read-ahead overlaps I/O).
    """

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Sequence[int],
        columns: Sequence[str] | None,
        storage_options: dict[str, Any] | None = None,
        max_open_files: int = 4,
        *,
        footer_lengths: Sequence[int] | None = None,
        rg_ranges: np.ndarray | None = None,
        file_first_rg: Sequence[int] | None = None,
        retry: RetryPolicy | None = None,
        max_gap: int = DEFAULT_MAX_GAP,
        max_cached_footers: int = 64,
        versions: Sequence[str] | None = None,
    ) -> None:
        self.urls, self.sizes = list(urls), [int(s) for s in sizes]
        self.columns = list(columns) if columns is not None else None
        self.filesystems = FileSystems(storage_options)
        self.retry = retry or RetryPolicy()
        self.max_gap = max_gap
        layout = (footer_lengths, rg_ranges, file_first_rg)
        if any(x is None for x in layout) and any(x is not None for x in layout):
            raise ValueError("footer_lengths, rg_ranges and file_first_rg go together")
        self._footer_lengths = None if footer_lengths is None else [int(x) for x in footer_lengths]
        self._rg_ranges = rg_ranges
        self._file_first_rg = None if file_first_rg is None else np.asarray(file_first_rg, dtype=np.int64)
        if versions is not None and len(versions) != len(self.urls):
            raise ValueError(f"versions has {len(versions)} entries for {len(self.urls)} files")
        self._versions = None if versions is None else [str(v) for v in versions]
        self._checked = _Once()  # async backends: files whose version this reader confirmed
        self.stats = ReadStats()
        self.files_opened = 0  # distinct files this reader touched (laziness is observable)
        self._touched: set[int] = set()
        self._footers = _FooterCache(max_cached_footers)
        self._handles = _Handles(max_open_files)
        self._verify_pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_catalog(cls, catalog: Any, storage_options: dict[str, Any] | None = None,
                     columns: Sequence[str] | None = None, **kwargs: Any) -> "RowGroupReader":
        """A reader of ``catalog``'s files and columns (or the subset ``columns``) that uses its byte
        ranges (no footer round trip) and refuses files whose version changed since
        (``versions=None`` turns that check off)."""
        kwargs.setdefault("versions", getattr(catalog, "versions", None) or None)
        columns = list(catalog.columns if columns is None else columns)
        layout: dict[str, Any] = {}
        if getattr(catalog, "rg_ranges", None) is not None:
            index = [catalog.columns.index(c) for c in columns]
            layout = dict(
                footer_lengths=catalog.footer_lengths,
                rg_ranges=catalog.rg_ranges[:, index, :],
                file_first_rg=catalog.file_first_rg,
            )
        return cls(catalog.urls, catalog.file_sizes, columns, storage_options, **layout, **kwargs)

    # -- public --------------------------------------------------------------------------------
    def read(self, file_index: int, row_group: int, rows: np.ndarray | None = None) -> pa.Table:
        """The projected columns of one row group; ``ReadError`` names the URL, row group and cause.

        ``rows``: sorted row numbers (file order) to keep; the table then holds exactly those rows,
        in that order. None: every row. A group larger than ``STREAM_ABOVE_BYTES`` decoded is
        streamed, so asking for part of it holds only that part.
        """
        started = time.perf_counter()
        rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        try:
            metadata = self._footer_unless_small(file_index, row_group)
            estimate = -1 if metadata is None else row_group_decoded_bytes(metadata, row_group, self.columns)
            if estimate > STREAM_ABOVE_BYTES:
                table = self._read_streaming(file_index, row_group, metadata, rows, estimate)
            else:
                table = self._read_whole(file_index, row_group, rows)
        except Exception as exc:  # noqa: BLE001 - fsspec/pyarrow/botocore raise many types
            raise self._error(file_index, row_group, exc) from None
        with self._lock:
            self.stats.row_groups_read += 1
            self.stats.rows_kept += table.num_rows
            self.stats.read_seconds += time.perf_counter() - started
        return table

    def _read_whole(self, file_index: int, row_group: int, rows: np.ndarray | None) -> pa.Table:
        """Fetch the group's projected chunks in one round, decode them at once, keep ``rows``."""
        metadata, parts = self._fetch_row_group(file_index, row_group)
        source = _SparseFile(self.sizes[file_index], sorted(parts), lambda s, e: self._miss(file_index, s, e))
        parquet = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=metadata, pre_buffer=False)
        table = parquet.read_row_group(row_group, columns=self.columns)
        with self._lock:
            self.stats.rows_decoded += table.num_rows
            self.stats.largest_decode = max(self.stats.largest_decode, table.num_rows)
        return table if rows is None else keep_rows(table, rows, self.urls[file_index], row_group)

    def _read_streaming(self, file_index: int, row_group: int, metadata: pq.FileMetaData,
                        rows: np.ndarray | None, estimate: int) -> pa.Table:
        """Decode the group in record batches from ranges fetched on demand, keeping only ``rows``."""
        self._touch(file_index)
        group = metadata.row_group(row_group)
        total = group.num_rows
        if rows is not None and len(rows) and not 0 <= rows[0] <= rows[-1] < total:
            raise ReadError(f"{self.urls[file_index]}: row group {row_group} has {total} rows, "
                            f"asked for rows {int(rows[0])}..{int(rows[-1])}; did the file change?")
        batch_rows = int(np.clip(STREAM_BATCH_BYTES * total // max(estimate, 1), 1, 65536))
        wanted = None if self.columns is None else set(self.columns)
        leaves = sum(1 for c in range(group.num_columns)
                     if wanted is None or group.column(c).path_in_schema.split(".")[0] in wanted)
        buffer = int(np.clip(STREAM_BUFFER_BYTES // max(leaves, 1), min(64 * 1024, STREAM_BUFFER_BYTES), 4 * 1024 * 1024))
        source = _SparseFile(self.sizes[file_index], [], lambda s, e: self._fetch(file_index, [(s, e)])[0][1])
        parquet = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=metadata, pre_buffer=False,
                                 buffer_size=buffer)
        part = estimate if rows is None else estimate * len(rows) // max(total, 1)
        combine = max(4 * STREAM_BATCH_BYTES, part // _PART_CHUNKS)
        kept, decoded, largest = decode_rows(parquet, row_group, self.columns, rows, total, batch_rows, combine)
        with self._lock:
            self.stats.row_groups_streamed += 1
            self.stats.rows_decoded += decoded
            self.stats.largest_decode = max(self.stats.largest_decode, largest)
        schema = parquet.schema_arrow
        if self.columns is not None:
            schema = pa.schema([schema.field(c) for c in self.columns], metadata=schema.metadata)
        table = pa.Table.from_batches(kept, schema=kept[0].schema if kept else schema)
        if table.num_rows != (total if rows is None else len(rows)):
            raise ReadError(f"{self.urls[file_index]}: row group {row_group} decoded {decoded} of the "
                            f"{total} rows its footer lists; did the file change?")
        return table

    def _footer_unless_small(self, file_index: int, row_group: int) -> pq.FileMetaData | None:
        """The file's footer, or None when the group's compressed bytes (the catalog's ranges, or a
        cached footer) already show it is small: then nothing is estimated, and the footer comes
        with the data in one round."""
        cached = self._footers.peek(file_index)
        if self._rg_ranges is not None or cached is not None:
            compressed = sum(e - s for s, e in self._ranges(file_index, row_group, cached, merge=False))
            if compressed * _SURELY_SMALL_RATIO <= STREAM_ABOVE_BYTES:
                return None
        if cached is not None:
            return cached
        self._touch(file_index)
        metadata, owner = self._footers.get_or_claim(file_index)
        if metadata is not None:
            return metadata
        if not owner:
            return self._footers.wait(file_index) or self._fetch_footer(file_index)
        try:
            metadata = self._fetch_footer(file_index)
        except BaseException as exc:
            self._footers.fail(file_index, exc)
            raise
        self._footers.put(file_index, metadata)
        return metadata

    def close(self) -> None:
        """Close open handles, forget cached footers and version checks (the reader can still be used after)."""
        self._handles.close()
        with self._lock:
            pool, self._verify_pool = self._verify_pool, None
        if pool is not None:  # waits for a check in flight (its waiters must get an answer)
            pool.shutdown(wait=True)
        self._footers.clear()
        self._checked.clear()

    # -- fetching ------------------------------------------------------------------------------
    def _fetch_row_group(self, file_index: int, row_group: int) -> tuple[pq.FileMetaData, list[tuple[int, bytes]]]:
        """The file's footer and the bytes of the row group's projected chunks, as few rounds as possible."""
        self._touch(file_index)
        metadata, owner = self._footers.get_or_claim(file_index)
        if not owner:
            if metadata is None and self._rg_ranges is None:
                metadata = self._footers.wait(file_index) or self._fetch_footer(file_index)
            parts = self._fetch(file_index, self._ranges(file_index, row_group, metadata))
            if metadata is None:
                metadata = self._footers.wait(file_index) or self._fetch_footer(file_index)
            return metadata, parts
        try:
            metadata, parts = self._footer_and_chunks(file_index, row_group)
        except BaseException as exc:
            self._footers.fail(file_index, exc)
            raise
        self._footers.put(file_index, metadata)
        return metadata, parts

    def _footer_and_chunks(self, file_index: int, row_group: int) -> tuple[pq.FileMetaData, list[tuple[int, bytes]]]:
        """The footer (as this process read it already, or from the reader fetching it now, or fetched here
        with the data in one round) and the group's chunks."""
        known = self._footer_lengths[file_index] if self._footer_lengths is not None else None
        tail, pending = self._claim_footer(file_index)
        if tail is None and pending is not None and self._rg_ranges is not None:  # data now, the footer after
            parts = self._fetch(file_index, self._ranges(file_index, row_group, None))
            tail = pending.result()
            return (self._shared(file_index, tail) if tail is not None else self._fetch_footer(file_index)), parts
        if tail is None and pending is not None:
            tail = pending.result()
            metadata = self._shared(file_index, tail) if tail is not None else self._fetch_footer(file_index)
            return metadata, self._fetch(file_index, self._ranges(file_index, row_group, metadata))
        if tail is not None:
            metadata = self._shared(file_index, tail)
            return metadata, self._fetch(file_index, self._ranges(file_index, row_group, metadata))
        exact = None
        try:
            if known is not None:  # footer and data in one concurrent round
                wanted = self._ranges(file_index, row_group, None)
                fetched = self._fetch(file_index, [tail_range(self.sizes[file_index], known)] + wanted)
                metadata, exact = self._parse_footer(file_index, fetched[0][1], known)
                parts = fetched[1:]
            else:
                metadata, exact = self._fetch_own_footer(file_index)
                parts = self._fetch(file_index, self._ranges(file_index, row_group, metadata))
        finally:
            self._settle_footer(file_index, exact)
        return metadata, parts

    def _fetch_footer(self, file_index: int) -> pq.FileMetaData:
        """The file's footer alone: kept by this process, fetched by another reader now, or fetched here."""
        tail, pending = self._claim_footer(file_index)
        if pending is not None:
            tail = pending.result()
            if tail is None:  # that fetch failed: try once more here (its error, if permanent, again)
                return self._fetch_own_footer(file_index)[0]
        if tail is not None:
            return self._shared(file_index, tail)
        exact = None
        try:
            metadata, exact = self._fetch_own_footer(file_index)
        finally:
            self._settle_footer(file_index, exact)
        return metadata

    def _fetch_own_footer(self, file_index: int) -> tuple[pq.FileMetaData, bytes]:
        known = self._footer_lengths[file_index] if self._footer_lengths is not None else None
        size = self.sizes[file_index]
        start, end = tail_range(size, known) if known is not None else (max(0, size - FOOTER_PROBE_BYTES), size)
        tail = self._fetch(file_index, [(start, end)])[0][1]
        return self._parse_footer(file_index, tail, known)

    def _ranges(self, file_index: int, row_group: int, metadata: pq.FileMetaData | None,
                merge: bool = True) -> list[Range]:
        """``[start, end)`` ranges of the projected chunks of one row group (coalesced unless ``merge=False``)."""
        if self._rg_ranges is not None:
            first = int(self._file_first_rg[file_index])
            stop = int(self._file_first_rg[file_index + 1]) if file_index + 1 < len(self.urls) else len(self._rg_ranges)
            if not 0 <= row_group < stop - first:
                raise ReadError(f"{self.urls[file_index]}: row group {row_group} does not exist "
                                f"(the catalog has {stop - first})")
            spans = self._rg_ranges[first + row_group]
        else:
            assert metadata is not None
            if not 0 <= row_group < metadata.num_row_groups:
                raise ReadError(f"{self.urls[file_index]}: row group {row_group} does not exist "
                                f"(the file has {metadata.num_row_groups})")
            names = self.columns if self.columns is not None else metadata.schema.to_arrow_schema().names
            spans = chunk_ranges(metadata, names)[row_group]
        spans = [(int(s), int(e)) for s, e in spans if e > s]
        if not spans or not merge:
            return spans
        n = len(spans)
        _, starts, ends = merge_offset_ranges([""] * n, [s for s, _ in spans], [e for _, e in spans], max_gap=self.max_gap)
        return list(zip(starts, ends))

    def _parse_footer(self, file_index: int, tail: bytes, known: int | None,
                      shared: bool = False) -> tuple[pq.FileMetaData, bytes]:
        """The footer in ``tail`` (a cataloged ``known`` length must match) and its exact bytes."""
        url, size = self.urls[file_index], self.sizes[file_index]
        try:
            metadata, length, exact = parse_footer(tail, size, None if known is not None else self._fetcher(file_index))
        except FooterError as exc:
            raise ReadError(f"{url}: {exc}; did the file change since it was cataloged?") from None
        if known is not None and length != known:
            raise ReadError(f"{url}: footer is {length} bytes but was cataloged as {known}; did the file change?")
        with self._lock:
            if shared:
                self.stats.footers_shared += 1
            else:
                self.stats.footers_fetched += 1
        return metadata, exact

    # Footers are shared by the readers of this process (``SHARED_FOOTERS``), keyed by the cataloged URL,
    # size and version; a reader that was given no versions neither takes nor leaves any. Only bytes
    # ``_fetch`` returned are left there, and it returns none before the file's version was confirmed.
    def _shared_key(self, file_index: int) -> tuple[str, int, str | None]:
        return self.urls[file_index], self.sizes[file_index], None if self._versions is None else self._versions[file_index]

    def _claim_footer(self, file_index: int) -> tuple[bytes | None, Any]:
        return SHARED_FOOTERS.claim(*self._shared_key(file_index))

    def _settle_footer(self, file_index: int, exact: bytes | None) -> None:
        SHARED_FOOTERS.settle(*self._shared_key(file_index), exact)

    def _shared(self, file_index: int, tail: bytes) -> pq.FileMetaData:
        known = self._footer_lengths[file_index] if self._footer_lengths is not None else len(tail) - 8
        return self._parse_footer(file_index, tail, known, shared=True)[0]

    def _fetcher(self, file_index: int) -> Callable[[int, int], bytes]:
        return lambda start, end: self._fetch(file_index, [(start, end)])[0][1]

    def _miss(self, file_index: int, start: int, end: int) -> bytes:
        log.debug("%s: pyarrow read %d-%d outside the planned ranges", self.urls[file_index], start, end)
        with self._lock:
            self.stats.misses += 1
        return self._fetch(file_index, [(start, end)])[0][1]

    def _fetch(self, file_index: int, ranges: list[Range]) -> list[tuple[int, bytes]]:
        """``(start, bytes)`` of each range (in the order asked), each request retried on its own."""
        if not ranges:
            return []
        started = time.perf_counter()
        try:
            return self._fetch_ranges(file_index, ranges)
        finally:
            with self._lock:
                self.stats.fetch_seconds += time.perf_counter() - started

    def _fetch_ranges(self, file_index: int, ranges: list[Range]) -> list[tuple[int, bytes]]:
        url, size = self.urls[file_index], self.sizes[file_index]
        fs, path = self.filesystems.resolve(url)
        got: dict[int, bytes] = {}

        etag = if_match_etag(fs, self._versions[file_index]) if self._versions is not None and is_async(fs) else None

        def attempt(left: float) -> None:
            until = time.monotonic() + left
            todo = [i for i in range(len(ranges)) if i not in got]
            if etag is not None:  # the version check rides on every GET
                results = cat_ranges_if_match(fs, path, [ranges[i][0] for i in todo], [ranges[i][1] for i in todo],
                                              etag, left)
            elif is_async(fs):
                results = fs.cat_ranges([path] * len(todo), [ranges[i][0] for i in todo],
                                        [ranges[i][1] for i in todo], on_error="return", **timeout_kw(fs, left))
            else:
                check = None if self._versions is None else lambda: self._check_unchanged(file_index, until)
                results = self._handles.read(file_index, fs, path, size, [ranges[i] for i in todo], check)
            self._count(todo, ranges, results)
            failure: BaseException | None = None
            for i, result in zip(todo, results):
                start, end = ranges[i]
                if isinstance(result, ObjectChanged):
                    failure = self._changed(file_index, until)
                elif isinstance(result, BaseException):
                    failure = result if failure is None or isinstance(failure, TransientError) else failure
                elif len(result) != end - start:
                    try:
                        check_short_read(fs, path, url, size, len(result), end - start, ReadError,
                                         until - time.monotonic())
                    except TransientError as exc:
                        failure = failure or exc
                else:
                    got[i] = result
            if failure is not None:
                raise failure

        verify = self._versions is not None and is_async(fs) and etag is None
        if verify:  # the file's one version check runs alongside its first fetch, not a round after it
            self._checked.start(file_index, lambda: self._verify(file_index), self._verifier().submit)
        call_within(attempt, self.retry, f"{url} ranges {ranges}", self.filesystems.redact)
        if verify:  # before any of the file's bytes are used
            self._checked.run(file_index, lambda: self._verify(file_index))
        return [(ranges[i][0], got[i]) for i in range(len(ranges))]

    def _verifier(self) -> ThreadPoolExecutor:
        """Threads for the version checks (a HEAD each) that overlap the files' first fetches."""
        with self._lock:
            if self._verify_pool is None:
                self._verify_pool = ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="streamshard-verify")
            return self._verify_pool

    def _verify(self, file_index: int) -> None:
        """``ReadError`` unless the file still has the size and version the catalog recorded."""
        url = self.urls[file_index]

        def attempt(left: float) -> None:
            self._check_unchanged(file_index, time.monotonic() + left)

        try:
            call_within(attempt, self.retry, f"{url} info", self.filesystems.redact)
        except ReadError:
            raise
        except Exception as exc:  # noqa: BLE001 - cannot confirm the version: the file's bytes are not used
            cause = exc if isinstance(exc, RetriesExhausted) else describe(exc)
            raise ReadError(self.filesystems.redact(f"{url}: checking the file's version failed: {cause}")) from None

    def _changed(self, file_index: int, until: float) -> ReadError:
        """The error for a GET the store refused because the file is no longer at the cataloged ETag: what
        it is now, when one ``info`` can still tell (within ``until``)."""
        try:
            self._check_unchanged(file_index, max(until, time.monotonic() + 1.0))
        except ReadError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - the refused GET already says it changed
            log.debug("%s: after a refused If-Match, info failed: %s", self.urls[file_index], describe(exc))
        version = self._versions[file_index] if self._versions is not None else ""
        return ReadError(f"{self.urls[file_index]}: the file changed since it was cataloged (cataloged: "
                         f"{self.sizes[file_index]} bytes, {version}; the store refused a GET at that ETag)")

    def _check_unchanged(self, file_index: int, until: float) -> None:
        """One ``info`` of the file (cut off at ``until``); ``ReadError`` naming both versions if it changed."""
        url = self.urls[file_index]
        fs, path = self.filesystems.resolve(url)
        fs.invalidate_cache(path)  # a listing cache would answer with what the catalog saw
        try:
            info = fs.info(path, **timeout_kw(fs, until - time.monotonic()))
        except FileNotFoundError:
            raise ReadError(f"{url}: the file no longer exists (it was cataloged with {self.sizes[file_index]} bytes)") from None
        versions = self._versions or [""] * len(self.urls)
        change = file_change(info, self.sizes[file_index], versions[file_index])
        if change is not None:
            raise ReadError(f"{url}: {change}")

    def _count(self, todo: list[int], ranges: list[Range], results: list[Any]) -> None:
        sizes = [len(r) for r in results if isinstance(r, (bytes, bytearray))]
        with self._lock:
            self.stats.requests += len(todo)
            self.stats.bytes_fetched += sum(sizes)
            self.stats.largest_fetch = max([self.stats.largest_fetch, *sizes])

    def _touch(self, file_index: int) -> None:
        with self._lock:
            if file_index not in self._touched:
                self._touched.add(file_index)
                self.files_opened += 1

    def _error(self, file_index: int, row_group: int, exc: BaseException) -> ReadError:
        url = self.urls[file_index]
        if isinstance(exc, ReadError):  # already says what is wrong with the file: add the row group
            text = str(exc)
            cause, note = (text[len(url) + 2 :] if text.startswith(f"{url}: ") else text), ""
        else:
            cause = str(exc) if isinstance(exc, RetriesExhausted) else describe(exc)
            # Retries exhausted: the store is unreachable or failing; asking it more would only add time.
            note = "" if isinstance(exc, RetriesExhausted) else self._change_note(file_index)
        return ReadError(self.filesystems.redact(f"{url}: reading row group {row_group} failed: {cause}{note}"))

    def _change_note(self, file_index: int) -> str:
        """After a permanent failure: whether the file changed or vanished since it was cataloged."""
        fs, path = self.filesystems.resolve(self.urls[file_index])
        try:
            fs.invalidate_cache(path)
            info = fs.info(path, **timeout_kw(fs, min(self.retry.deadline, _NOTE_SECONDS)))
        except FileNotFoundError:
            return " (the file no longer exists)"
        except Exception:  # noqa: BLE001 - no better explanation available; keep the original cause
            return ""
        versions = self._versions or [""] * len(self.urls)
        change = file_change(info, self.sizes[file_index], versions[file_index])
        return f" ({change})" if change else ""

