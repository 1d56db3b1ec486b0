"""Reading row groups inside a worker: exact byte ranges, decoded by pyarrow, only the rows asked for.

For one row group the reader asks ``fetch.FileFetcher`` for only the column chunks of the projected
columns, as byte ranges (adjacent ones coalesced when the gap is small), plus the file's footer the
first time this process meets the file; the fetcher reads each file at its cataloged version, shares
footers across the readers of the process and retries transient faults (see ``io/fetch.py``). pyarrow
then decodes from those bytes alone (the footer is passed as ``metadata``, so nothing else is read).

A row group estimated to decode to more than ``STREAM_ABOVE_BYTES`` (``format/decoded_size.py``) is
*streamed* instead: pyarrow decodes it in record batches of about ``STREAM_BATCH_BYTES`` from a
file view that fetches byte ranges as the decoder asks (about ``STREAM_BUFFER_BYTES`` of compressed
bytes buffered over all columns), and only the rows asked for (``rows=``) are kept. ``read_part``
returns such a group as a ``StreamedPart`` whose record batches are decoded as it is iterated:
delivery converts each one as it comes and lets it go (``convert/part_convert.py``), so a worker that owns
part of a huge row group holds its part once plus one record batch, not the whole group, its
compressed bytes, or its part in Arrow as well. pyarrow holds the page it is in for every column it
decodes, so a wide group is decoded in passes over subsets of its columns (``column_passes``), one
subset's pages held at a time. ``read`` joins the same pieces into a table. Small groups (the common
case) keep the one-round whole-group read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import merge_offset_ranges

from ..format import int96
from ..format.decoded_size import row_group_decoded_bytes
from ..errors import ReadError
from .fetch import FileFetcher, ReadStats
from .footer import chunk_ranges
from .reader_parts import DecodeCounts, _SparseFile, check_decoded, decode_rows, join_pieces, keep_rows
from .retry import RetriesExhausted, RetryPolicy, describe
from .storage import FileSystems, is_async

log = logging.getLogger("streamshard")

Range = tuple[int, int]

DEFAULT_MAX_GAP = 16 * 1024  # bytes of unneeded data worth fetching to save one request
# A row group decoding to more than this is streamed (record batches, ranges fetched on demand):
# above it the whole-group read's peak (compressed chunks + decoded table, ~3x the table) matters
# more than its one round trip; below it, streaming gains nothing.
STREAM_ABOVE_BYTES = 64 * 1024 * 1024
# Decoded bytes per record batch of a streamed row group. Decoding one holds about 2.5x this in Arrow (the
# values, the list levels, the page being decoded): 4 MiB keeps a worker's Arrow at ~23 MiB (16 MiB: ~57
# MiB, which pyarrow's allocator then keeps), and decodes as fast.
STREAM_BATCH_BYTES = 4 * 1024 * 1024
# ... but at least 1/128 of it per projected leaf column (32 KiB): decoding costs per column and record
# batch, so many narrow columns want longer batches (512 int32 columns: 0.71-0.78 CPU-s a 300 MiB group in
# 4 MiB batches, 0.46-0.5 in 16 MiB ones; their pages, one held per column while decoding, outweigh it).
_LEAVES_PER_BATCH = 128
# A streamed group decodes its columns on Arrow's threads only from this many projected leaf columns: with
# fewer there is little to share, and each thread's allocator heap keeps its own pages (a list column and
# an id: peak +23 MiB with threads, and no faster).
_THREADS_FROM_LEAVES = 4
_COMBINE_BYTES = 64 * 1024 * 1024  # scattered rows of a streamed part kept as a table: joined into pieces of at least this
STREAM_BUFFER_BYTES = 16 * 1024 * 1024  # compressed bytes buffered over all columns while streaming
# Pages held at once while a streamed group decodes: pyarrow's decoder holds the page it is in for every
# column it decodes (one page can be a whole column chunk: a 150,000-row int32 column chunk is one 188 KB
# page, so 512 of them held ~100 MiB, a third of the group). A wider group is decoded in passes over
# subsets of its columns within this (``column_passes``); each column is still decoded once.
STREAM_PASS_PAGE_BYTES = 16 * 1024 * 1024
_PAGE_BYTES = 1024 * 1024  # a page's usual size at most (pyarrow's and parquet-mr's default data page size)
_PART_CHUNKS = 8  # a streamed part is gathered into about this many chunks (a take costs per chunk)
# A group this many times smaller (compressed) than STREAM_ABOVE_BYTES is read whole without first
# fetching its footer to estimate its decoded size (keeps footer and data in one round).
_SURELY_SMALL_RATIO = 32
# Decoded bytes per compressed byte, to weigh a group for read-ahead before its footer is at hand (a guess on
# the generous side: snappy/zstd token and numeric columns decode to 2-4x).
_DECODED_PER_COMPRESSED = 4
# Row groups of one file announced together (``RowGroupReader.read_together``) are fetched in one GET of at
# most this many compressed bytes (one round trip and one request for several small groups).
TOGETHER_BYTES = 8 * 1024 * 1024


class _Together:
    """One GET of several row groups' ranges of a file: made by the first of their reads, shared by the rest
    (each holds the bytes until its read is decoded)."""

    def __init__(self, ranges: list[Range]) -> None:
        self.ranges = ranges
        self._lock = threading.Lock()
        self._got: Any = None
        self._error: BaseException | None = None

    def fetch(self, get: Callable[[], Any]) -> Any:
        with self._lock:  # the others wait for the first one's GET
            if self._got is None and self._error is None:
                try:
                    self._got = get()
                except BaseException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
            return self._got


Piece = tuple[pa.Table, "np.ndarray | None"]


class StreamedPart:
    """A read of a streamed row group whose rows are decoded as it is iterated, a record batch at a
    time, so a consumer that converts each piece and lets it go holds the part in its own form plus
    one record batch, never the part in Arrow too. Iterate it once; an error while decoding is a
    ``ReadError`` naming the file and row group.

    Iterating gives its *passes*: a wide group (its columns' pages, one held per column while
    decoding, above ``STREAM_PASS_PAGE_BYTES``) is decoded in several passes over subsets of its
    columns, each over every row of the part, so only one subset's pages are held at a time. A pass
    gives ``(table, picks)``: a decoded record batch of the pass's columns (as a table) and the
    positions of the part's rows in it (None: every row of it), in order. ``rows``: how many rows
    the part holds (known before decoding).
    """

    def __init__(self, rows: int, decode: Callable[[Sequence[str] | None, bool], Iterator[Piece]],
                 column_sets: Sequence[Sequence[str] | None], combine_bytes: int,
                 change: Callable[[pa.Table], pa.Table] | None = None) -> None:
        self.rows = rows
        self._decode = decode  # (columns of a pass (None: all), the read's last pass) -> its pieces
        self._column_sets = list(column_sets)
        self._combine_bytes = combine_bytes
        self._change = change

    @property
    def passes(self) -> int:
        """How many passes over its columns the part is decoded in."""
        return len(self._column_sets)

    def __iter__(self) -> Iterator[Iterator[Piece]]:
        last = len(self._column_sets) - 1
        for i, columns in enumerate(self._column_sets):
            yield self._changed(self._decode(columns, i == last))

    def map(self, change: Callable[[pa.Table], pa.Table]) -> "StreamedPart":
        """The same part with ``change`` applied to each piece's table as it comes (in a pass over
        some of the columns, a table of those columns)."""
        before = self._change
        composed = change if before is None else (lambda table: change(before(table)))
        return StreamedPart(self.rows, self._decode, self._column_sets, self._combine_bytes, composed)

    def table(self) -> pa.Table:
        """All its rows as one table (decoded in one pass over all columns): whole record batches as
        they are, scattered rows copied out and joined into a few chunks (``reader_parts.join_pieces``)."""
        return join_pieces(self._changed(self._decode(None, True)), self._combine_bytes)

    def _changed(self, pieces: Iterator[Piece]) -> Iterator[Piece]:
        if self._change is None:
            yield from pieces
            return
        for table, picks in pieces:
            out, table = self._change(table), None
            yield out, picks
            out = None  # noqa: F841 - the consumer's piece is not held here while the next decodes


def column_passes(metadata: pq.FileMetaData, row_group: int, columns: Sequence[str],
                  budget: int) -> list[list[str]]:
    """``columns`` (top-level, in order) grouped into passes whose column chunks' pages held at once
    (``min(chunk, _PAGE_BYTES)`` each: a decoder holds one page per leaf column) stay within ``budget``;
    a column's leaves stay together, and a column above ``budget`` alone is a pass."""
    group = metadata.row_group(row_group)
    held: dict[str, int] = {}
    for c in range(group.num_columns):
        chunk = group.column(c)
        top = chunk.path_in_schema.split(".")[0]
        held[top] = held.get(top, 0) + min(chunk.total_uncompressed_size, _PAGE_BYTES)
    passes: list[list[str]] = []
    total = budget + 1
    for name in columns:
        size = held.get(name, 0)
        if passes and total + size <= budget:
            passes[-1].append(name)
            total += size
        else:
            passes.append([name])
            total = size
    return passes


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
        schema: the catalog's Arrow schema; its timestamp unit of an INT96 column is the unit the column is
            decoded at (``format/int96.py``; None: microseconds).
        verify_checksums: check the CRC of every page that has one (writers add them on request: pyarrow's
            ``write_page_checksum``, Spark's ``parquet.page.write-checksum.enabled``); a mismatch is a
            ``ReadError`` naming the file and row group. Pages without one are read as they are.

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
        schema: pa.Schema | None = None,
        verify_checksums: bool = True,
    ) -> None:
        self.urls, self.sizes = list(urls), [int(s) for s in sizes]
        self.columns = list(columns) if columns is not None else None
        self.filesystems = FileSystems(storage_options)
        self.retry = retry or RetryPolicy()
        self.max_gap = max_gap
        layout = (footer_lengths, rg_ranges, file_first_rg)
        if any(x is None for x in layout) and any(x is not None for x in layout):
            raise ValueError("footer_lengths, rg_ranges and file_first_rg go together")
        self._rg_ranges = rg_ranges
        self._file_first_rg = None if file_first_rg is None else np.asarray(file_first_rg, dtype=np.int64)
        self.stats = ReadStats()
        self._files = FileFetcher(self.urls, self.sizes, self.filesystems, self.retry, self.stats,
                                  footer_lengths=footer_lengths, versions=versions, max_open_files=max_open_files,
                                  max_cached_footers=max_cached_footers)
        self.schema = schema
        self.verify_checksums = verify_checksums
        self.files_opened = 0  # distinct files this reader touched (laziness is observable)
        self._touched: set[int] = set()
        self._lock = threading.Lock()
        self._estimates: dict[tuple[int, int], int] = {}  # decoded_estimate's, per (file, row group)
        self._together: dict[tuple[int, int], _Together] = {}  # groups announced to be fetched in one GET

    @classmethod
    def from_catalog(cls, catalog: Any, storage_options: dict[str, Any] | None = None,
                     columns: Sequence[str] | None = None, **kwargs: Any) -> "RowGroupReader":
        """A reader of ``catalog``'s file columns (or those of the subset ``columns``: partition keys are not
        read from files, ``partitions.with_partition_columns`` adds them) that uses its byte
        ranges (no footer round trip) and refuses files whose version changed since
        (``versions=None`` turns that check off)."""
        kwargs.setdefault("versions", getattr(catalog, "versions", None) or None)
        in_files = list(getattr(catalog, "file_columns", catalog.columns))  # partition keys are not in the files
        keys = set(getattr(catalog, "partition_keys", ()))
        columns = [c for c in (in_files if columns is None else columns) if c not in keys]
        layout: dict[str, Any] = {}
        if getattr(catalog, "rg_ranges", None) is not None:
            index = [in_files.index(c) for c in columns]
            layout = dict(
                footer_lengths=catalog.footer_lengths,
                rg_ranges=catalog.rg_ranges[:, index, :],
                file_first_rg=catalog.file_first_rg,
            )
        kwargs.setdefault("schema", getattr(catalog, "schema", None))
        return cls(catalog.urls, catalog.file_sizes, columns, storage_options, **layout, **kwargs)

    # -- public --------------------------------------------------------------------------------
    def read(self, file_index: int, row_group: int, rows: np.ndarray | None = None) -> pa.Table:
        """The projected columns of one row group; ``ReadError`` names the URL, row group and cause.

        ``rows``: sorted row numbers (file order) to keep; the table then holds exactly those rows,
        in that order. None: every row. A group larger than ``STREAM_ABOVE_BYTES`` decoded is
        streamed, so asking for part of it holds only that part (and one record batch).
        """
        got = self.read_part(file_index, row_group, rows)
        return got if isinstance(got, pa.Table) else got.table()

    def read_part(self, file_index: int, row_group: int,
                  rows: np.ndarray | None = None) -> "pa.Table | StreamedPart":
        """``read``, except that a streamed group (decoded size above ``STREAM_ABOVE_BYTES``) comes
        as a ``StreamedPart``: its rows decoded as the part is iterated, a record batch at a time, so
        a consumer that converts each piece and lets it go never holds the part in Arrow whole."""
        started = time.perf_counter()
        rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        try:
            metadata = self._footer_unless_small(file_index, row_group)
            estimate = -1 if metadata is None else row_group_decoded_bytes(metadata, row_group, self.columns)
            if estimate > STREAM_ABOVE_BYTES:
                return self._read_streaming(file_index, row_group, metadata, rows, estimate, started)
            table = self._read_whole(file_index, row_group, rows)
            check_decoded(table)
        except Exception as exc:  # noqa: BLE001 - fsspec/pyarrow/botocore raise many types
            raise self._error(file_index, row_group, exc) from None
        self._count_read(table.num_rows, time.perf_counter() - started)
        return table

    def decoded_estimate(self, file_index: int, row_group: int) -> int:
        """Estimated Arrow bytes of the group's projected columns (``format/decoded_size.py``), for
        read-ahead's byte budget (``streams/delivery.py``); 0 when its compressed bytes already show it
        small (nothing fetched). Otherwise from its file's footer when this process holds it; a footer it
        lacks (a restart over object storage with a catalog cache) is not fetched here, on the consumer's
        thread, one round trip at a time: the group is weighed at ``_DECODED_PER_COMPRESSED`` times its
        compressed bytes until its read brings the footer. Remembered per group once from a footer."""
        key = (file_index, row_group)
        known = self._estimates.get(key)
        if known is None and self._rg_ranges is not None and not self._files.has_footer(file_index):
            compressed = sum(e - s for s, e in self._ranges(file_index, row_group, None, merge=False))
            return 0 if compressed * _SURELY_SMALL_RATIO <= STREAM_ABOVE_BYTES else compressed * _DECODED_PER_COMPRESSED
        if known is None:
            try:
                metadata = self._footer_unless_small(file_index, row_group)
            except Exception as exc:  # noqa: BLE001 - fsspec/pyarrow/botocore raise many types
                raise self._error(file_index, row_group, exc) from None
            known = 0 if metadata is None else row_group_decoded_bytes(metadata, row_group, self.columns)
            self._estimates[key] = known
        return known

    def read_together(self, groups: Sequence[tuple[int, int]]) -> list[int]:
        """Announce reads of ``(file, row group)`` about to run at once: small groups of one file on object
        storage are then fetched in one ranged GET (their projected chunks, with gaps up to ``max_gap``,
        at most ``TOGETHER_BYTES``), by the first of their reads to start; the others decode from those
        bytes. The GET carries the cataloged version like any other (``io/fetch.py``). Groups that are
        large, local, not cataloged with their ranges, or alone in their file are read as before.

        Returns the order to start the reads in (positions in ``groups``): the first of each file's first,
        so that each GET goes out on its own thread at once, the rest (which wait for those GETs) after."""
        order = list(range(len(groups)))
        if self._rg_ranges is None:
            return order
        by_file: dict[int, list[int]] = {}
        for file_index, row_group in groups:
            by_file.setdefault(int(file_index), []).append(int(row_group))
        for file_index, row_groups in by_file.items():
            if len(row_groups) < 2 or not is_async(self.filesystems.resolve(self.urls[file_index])[0]):
                continue
            run: list[int] = []
            size = 0
            for row_group in sorted(set(row_groups)):
                spans = self._ranges(file_index, row_group, None, merge=False)
                compressed = sum(e - s for s, e in spans)
                if compressed * _SURELY_SMALL_RATIO > STREAM_ABOVE_BYTES:  # may be streamed: its own reads
                    continue
                if run and size + compressed > TOGETHER_BYTES:
                    self._announce(file_index, run)
                    run, size = [], 0
                run.append(row_group)
                size += compressed
            self._announce(file_index, run)
        seen: set[int] = set()
        leaders = [i for i, (file_index, _) in enumerate(groups) if not (file_index in seen or seen.add(file_index))]
        first = set(leaders)
        return leaders + [i for i in order if i not in first]

    def _announce(self, file_index: int, row_groups: list[int]) -> None:
        if len(row_groups) < 2:
            return
        spans = sorted(span for g in row_groups for span in self._ranges(file_index, g, None, merge=False))
        _, starts, ends = merge_offset_ranges([""] * len(spans), [s for s, _ in spans], [e for _, e in spans],
                                              max_gap=self.max_gap)
        together = _Together(list(zip(starts, ends)))
        with self._lock:
            for row_group in row_groups:
                self._together.setdefault((file_index, row_group), together)

    def fetch_bytes(self, file_index: int, row_group: int) -> int | None:
        """Compressed bytes a read of the group fetches when its file is on object storage (an async
        filesystem: each read a round trip), from the catalog's ranges or a footer at hand; None on a
        local filesystem, or when neither is at hand (nothing is fetched to tell). Read-ahead keeps more
        reads of small groups in flight on object storage by it (``streams/delivery.py``)."""
        fs, _ = self.filesystems.resolve(self.urls[file_index])
        if not is_async(fs):
            return None
        cached = self._files.cached_footer(file_index)
        if self._rg_ranges is None and cached is None:
            return None
        return sum(e - s for s, e in self._ranges(file_index, row_group, cached, merge=False))

    def _count_read(self, rows: int, seconds: float) -> None:
        with self._lock:
            self.stats.row_groups_read += 1
            self.stats.rows_kept += rows
            self.stats.read_seconds += seconds

    def _read_whole(self, file_index: int, row_group: int, rows: np.ndarray | None) -> pa.Table:
        """Fetch the group's projected chunks in one round, decode them at once, keep ``rows``."""
        self._touch(file_index)
        with self._lock:
            together = self._together.pop((file_index, row_group), None)
        if together is not None:  # announced with other groups of its file: one GET for them all
            metadata, parts = together.fetch(lambda: self._files.footer_and_ranges(file_index, lambda _: together.ranges))
        else:
            metadata, parts = self._files.footer_and_ranges(file_index,
                                                            lambda footer: self._ranges(file_index, row_group, footer))
        source = _SparseFile(self.sizes[file_index], sorted(parts), lambda s, e: self._miss(file_index, s, e))
        parquet = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=metadata, pre_buffer=False,
                                 coerce_int96_timestamp_unit=int96.read_unit(metadata, self.schema),
                                 page_checksum_verification=self.verify_checksums)
        table = parquet.read_row_group(row_group, columns=self.columns)
        with self._lock:
            self.stats.rows_decoded += table.num_rows
            self.stats.largest_decode = max(self.stats.largest_decode, table.num_rows)
        return table if rows is None else keep_rows(table, rows, self.urls[file_index], row_group)

    def _read_streaming(self, file_index: int, row_group: int, metadata: pq.FileMetaData,
                        rows: np.ndarray | None, estimate: int, started: float) -> StreamedPart:
        """The group decoded in record batches from ranges fetched on demand, keeping only ``rows``,
        as the returned part is iterated (nothing is fetched before); a wide group in several passes
        over subsets of its columns (``column_passes``)."""
        self._touch(file_index)
        group = metadata.row_group(row_group)
        total = group.num_rows
        if rows is not None and len(rows) and not 0 <= rows[0] <= rows[-1] < total:
            raise ReadError(f"{self.urls[file_index]}: row group {row_group} has {total} rows, "
                            f"asked for rows {int(rows[0])}..{int(rows[-1])}; did the file change?")
        unit = int96.read_unit(metadata, self.schema)
        names = list(self.columns) if self.columns is not None else list(metadata.schema.to_arrow_schema().names)
        expected = total if rows is None else len(rows)
        part = estimate * expected // max(total, 1)
        combine = max(_COMBINE_BYTES, part // _PART_CHUNKS)  # for ``StreamedPart.table``
        counts = DecodeCounts()
        url = self.urls[file_index]
        spent = [time.perf_counter() - started]  # seconds of the read so far, over its passes

        def pieces(columns: Sequence[str] | None, last: bool) -> Iterator[Piece]:
            columns = names if columns is None else list(columns)
            began = time.perf_counter()
            try:
                wanted = set(columns)
                leaves = sum(1 for c in range(group.num_columns) if group.column(c).path_in_schema.split(".")[0] in wanted)
                share = row_group_decoded_bytes(metadata, row_group, columns) if columns != names else estimate
                batch_bytes = STREAM_BATCH_BYTES * max(1, leaves / _LEAVES_PER_BATCH)
                batch_rows = int(np.clip(batch_bytes * total / max(share, 1), 1, 65536))
                buffer = int(np.clip(STREAM_BUFFER_BYTES // max(leaves, 1), min(64 * 1024, STREAM_BUFFER_BYTES),
                                     4 * 1024 * 1024))
                source = _SparseFile(self.sizes[file_index], [], lambda s, e: self._files.fetch_range(file_index, s, e))
                parquet = pq.ParquetFile(pa.PythonFile(source, mode="r"), metadata=metadata, pre_buffer=False,
                                         buffer_size=buffer, coerce_int96_timestamp_unit=unit,
                                         page_checksum_verification=self.verify_checksums)
                kept = 0
                for batch, picks in decode_rows(parquet, row_group, columns, rows, total, batch_rows, counts,
                                                threads=leaves >= _THREADS_FROM_LEAVES):
                    table = pa.Table.from_batches([batch])
                    check_decoded(table)
                    kept += table.num_rows if picks is None else len(picks)
                    spent[0] += time.perf_counter() - began
                    yield table, picks
                    began, batch, table = time.perf_counter(), None, None  # let the consumer's piece go
                if kept != expected:
                    raise ReadError(f"{url}: row group {row_group} decoded {counts.decoded} of the "
                                    f"{total} rows its footer lists; did the file change?")
                if not kept:  # an empty part is one empty table (its schema)
                    schema = parquet.schema_arrow
                    yield pa.Table.from_batches([], schema=pa.schema([schema.field(c) for c in columns],
                                                                     metadata=schema.metadata)), None
            except Exception as exc:  # noqa: BLE001 - fsspec/pyarrow/botocore raise many types
                raise self._error(file_index, row_group, exc) from None
            spent[0] += time.perf_counter() - began
            if not last:
                # Freed but kept by Arrow's allocator (in the heaps of the threads that decoded): hand it back
                # before the next pass, or each pass's pages come on top (512 columns in 6 passes: peak -40 MiB).
                pa.default_memory_pool().release_unused()
                return
            with self._lock:
                self.stats.row_groups_streamed += 1
                self.stats.rows_decoded += counts.decoded
                self.stats.largest_decode = max(self.stats.largest_decode, counts.largest)
            self._count_read(kept, spent[0])
            # What decoding took from Arrow's allocator is free now but kept by it (mimalloc, jemalloc):
            # hand it back, so the part's converted form and the batches gathered from it do not come on top.
            pa.default_memory_pool().release_unused()

        return StreamedPart(expected, pieces, column_passes(metadata, row_group, names, STREAM_PASS_PAGE_BYTES), combine)

    def _footer_unless_small(self, file_index: int, row_group: int) -> pq.FileMetaData | None:
        """The file's footer, or None when the group's compressed bytes (the catalog's ranges, or a
        cached footer) already show it is small: then nothing is estimated, and the footer comes
        with the data in one round."""
        cached = self._files.cached_footer(file_index)
        if self._rg_ranges is not None or cached is not None:
            compressed = sum(e - s for s, e in self._ranges(file_index, row_group, cached, merge=False))
            if compressed * _SURELY_SMALL_RATIO <= STREAM_ABOVE_BYTES:
                return None
        if cached is not None:
            return cached
        self._touch(file_index)
        return self._files.footer(file_index)

    def close(self) -> None:
        """Close open handles, forget cached footers and version checks (the reader can still be used after)."""
        with self._lock:
            self._together.clear()
        self._files.close()

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

    def _miss(self, file_index: int, start: int, end: int) -> bytes:
        log.debug("%s: pyarrow read %d-%d outside the planned ranges", self.urls[file_index], start, end)
        with self._lock:
            self.stats.misses += 1
        return self._files.fetch_range(file_index, start, end)

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
            note = "" if isinstance(exc, RetriesExhausted) else self._files.change_note(file_index)
        return ReadError(self.filesystems.redact(f"{url}: reading row group {row_group} failed: {cause}{note}"))
