"""The row-group reader's bookkeeping: parsed footers fetched once, a check run once per file,
open file handles (LRU), a file-like view of fetched byte ranges for pyarrow, and keeping only
the rows a read asks for (of a decoded table, or while a streamed group is decoded)."""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ReadError
from .retry import RetriesExhausted, is_transient

Range = tuple[int, int]


class _FooterCache:
    """Parsed footers by file (LRU), fetched once even when several threads want the same file.

    A file whose footer could not be fetched (permanent error, or retries exhausted) is
    remembered, so the other pieces of that file fail at once instead of retrying again.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._done: OrderedDict[int, pq.FileMetaData] = OrderedDict()
        self._pending: dict[int, Future[pq.FileMetaData]] = {}
        self._failed: dict[int, BaseException] = {}
        self._lock = threading.Lock()

    def get_or_claim(self, key: int) -> tuple[pq.FileMetaData | None, bool]:
        """``(metadata, False)`` if cached; ``(None, True)``: caller must fetch it; ``(None, False)``: wait."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                return self._done[key], False
            if key in self._pending:
                return None, False
            if key in self._failed:  # this file's footer failed for good: fail at once, not again
                raise self._failed[key]
            self._pending[key] = Future()
            return None, True

    def peek(self, key: int) -> pq.FileMetaData | None:
        """The cached footer, or None (claims nothing)."""
        with self._lock:
            return self._done.get(key)

    def wait(self, key: int) -> pq.FileMetaData | None:
        """The footer another thread is fetching; None if it was already evicted again."""
        with self._lock:
            if key in self._done:
                return self._done[key]
            future = self._pending.get(key)
        return None if future is None else future.result()

    def put(self, key: int, metadata: pq.FileMetaData) -> None:
        with self._lock:
            self._done[key] = metadata
            while len(self._done) > self.capacity:
                self._done.popitem(last=False)
            future = self._pending.pop(key)
        future.set_result(metadata)

    def fail(self, key: int, exc: BaseException) -> None:
        with self._lock:
            future = self._pending.pop(key, None)
            if isinstance(exc, (ReadError, RetriesExhausted)) or not is_transient(exc):
                self._failed[key] = exc
        if future is not None:
            future.set_exception(exc)

    def clear(self) -> None:
        with self._lock:
            self._done.clear()
            self._failed.clear()


class _Once:
    """Runs a check once per key however many threads ask at once; a failure is remembered and raised again."""

    def __init__(self) -> None:
        self._futures: dict[int, Future[None]] = {}
        self._lock = threading.Lock()

    def start(self, key: int, check: Callable[[], None], submit: Callable[[Callable[[], None]], Any]) -> None:
        """Start ``check`` for ``key`` through ``submit`` (a thread pool's), unless it was started already;
        ``run`` then waits for it and raises its failure."""
        with self._lock:
            if key in self._futures:
                return
            future = self._futures[key] = Future()

        def body() -> None:
            try:
                check()
            except BaseException as exc:  # noqa: BLE001 - raised again by every run() of this key
                future.set_exception(exc)
                return
            future.set_result(None)

        try:
            submit(body)
        except BaseException as exc:
            future.set_exception(exc)
            raise

    def run(self, key: int, check: Callable[[], None]) -> None:
        with self._lock:
            future = self._futures.get(key)
            owner = future is None
            if owner:
                future = self._futures[key] = Future()
        assert future is not None
        if not owner:
            future.result()
            return
        try:
            check()
        except BaseException as exc:
            future.set_exception(exc)
            raise
        future.set_result(None)

    def clear(self) -> None:
        with self._lock:
            self._futures.clear()


class _Handles:
    """Open handles of a synchronous filesystem, one per file (LRU), reads serialised per reader."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._open: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, key: int, fs: Any, path: str, size: int, ranges: list[Range],
             check: Callable[[], None] | None = None) -> list[Any]:
        """The bytes of ``ranges`` (or the exception of each failed one); ``check()`` runs on every open."""
        with self._lock:
            handle = self._open.get(key)
            if handle is None:
                # No fsspec read-ahead cache: exactly the bytes asked for are read.
                handle = fs.open(path, "rb", cache_type="none", size=size)
                if check is not None:
                    try:  # the file as opened must be the file cataloged (checked after opening: no gap)
                        check()
                    except BaseException:
                        handle.close()
                        raise
                self._open[key] = handle
                while len(self._open) > self.capacity:
                    self._open.popitem(last=False)[1].close()
            self._open.move_to_end(key)
            out: list[Any] = []
            for start, end in ranges:
                try:
                    handle.seek(start)
                    out.append(handle.read(end - start))
                except Exception as exc:  # noqa: BLE001 - reported per range, classified by the caller
                    out.append(exc)
            return out

    def close(self) -> None:
        with self._lock:
            for handle in self._open.values():
                handle.close()
            self._open.clear()


class _SparseFile:
    """A read-only file of ``size`` bytes of which only some ranges are held; pyarrow reads from it.

    A read outside the held ranges (an old writer's padding, a wrong range) is fetched on demand
    through ``miss``, so decoding stays correct; the reader counts such misses.
    """

    def __init__(self, size: int, parts: list[tuple[int, bytes]], miss: Callable[[int, int], bytes]) -> None:
        self.size, self._parts, self._miss = size, parts, miss
        self._starts = [start for start, _ in parts]
        self.pos = 0
        self.closed = False

    def read(self, n: int = -1) -> Any:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if n <= 0:
            return b""
        i = bisect.bisect_right(self._starts, self.pos) - 1
        start, end = self.pos, self.pos + n
        self.pos = end
        if i >= 0:
            part_start, data = self._parts[i]
            if end <= part_start + len(data):
                return memoryview(data)[start - part_start : end - part_start]
        return self._miss(start, end)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True



def check_decoded(table: pa.Table) -> None:
    """``ReadError`` naming the column unless every decoded value is well-formed: pyarrow does not check what
    a damaged page decodes to (string bytes that are not UTF-8, dictionary indices past the dictionary, list
    offsets out of range), and converting such values fails with a bare exception or reads out of bounds.
    A full check costs about 5% of decoding (most of it UTF-8; 19 ms for 100 MB of mixed columns)."""
    for name, column in zip(table.column_names, table.columns):
        try:
            column.validate(full=True)
        except (pa.ArrowInvalid, pa.ArrowIndexError) as exc:
            raise ReadError(f"column {name!r} decoded to invalid values ({exc}); the file is damaged") from None


def keep_rows(table: pa.Table, rows: np.ndarray, url: str, row_group: int) -> pa.Table:
    """Rows ``rows`` (sorted) of a decoded row group: a zero-copy slice when they are contiguous."""
    if len(rows) and not 0 <= rows[0] <= rows[-1] < table.num_rows:
        raise ReadError(f"{url}: row group {row_group} has {table.num_rows} rows, asked for rows "
                        f"{int(rows[0])}..{int(rows[-1])}; did the file change?")
    if len(rows) == table.num_rows:
        return table
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1:
        return table.slice(int(rows[0]), len(rows))
    return table.take(pa.array(rows))


def decode_rows(parquet: pq.ParquetFile, row_group: int, columns: list[str] | None, rows: np.ndarray | None,
                total: int, batch_rows: int, combine_bytes: int) -> tuple[list[pa.RecordBatch], int, int]:
    """Decode row group ``row_group`` in record batches of ``batch_rows``, keeping ``rows`` (sorted;
    None: all) and stopping after the last of them: (kept batches, rows decoded, largest batch).

    Rows picked out of record batches (scattered rows: a shuffled part) are gathered into batches of
    about ``combine_bytes``, so a part is a few chunks: taking a training batch's rows costs per
    chunk and column (one more copy of at most ``combine_bytes`` at a time)."""
    stop = total if rows is None else (int(rows[-1]) + 1 if len(rows) else 0)
    kept: list[pa.RecordBatch] = []
    picked: list[pa.RecordBatch] = []
    start = largest = picked_bytes = 0
    if not stop:
        return kept, 0, 0
    for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[row_group], columns=columns):
        end = start + batch.num_rows
        largest = max(largest, batch.num_rows)
        if rows is None:
            kept.append(batch)
        else:
            a, b = (int(x) for x in np.searchsorted(rows, [start, end]))
            if b - a == batch.num_rows:
                if picked:  # rows stay in file order
                    kept.append(_combine(picked))
                    picked, picked_bytes = [], 0
                kept.append(batch)
            elif b > a:  # a copy, so the rest of the record batch is freed
                picked.append(batch.take(pa.array(rows[a:b] - start)))
                picked_bytes += picked[-1].nbytes
                if picked_bytes >= combine_bytes:
                    kept.append(_combine(picked))
                    picked, picked_bytes = [], 0
        start = end
        if start >= stop:
            break
    if picked:
        kept.append(_combine(picked))
    return kept, start, largest


def _combine(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One record batch of ``batches`` (a copy)."""
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
