"""Reading row groups inside a worker: files opened lazily, a bounded read-ahead, clear errors.

Only the projected columns of the row groups a worker owns are decoded. Files are opened with
fsspec (any backend) without a read-ahead cache, and pyarrow's ``pre_buffer`` coalesces the
column-chunk reads of a row group into a few ranged requests.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import ReadError
from .storage import FileSystems

T = TypeVar("T")
R = TypeVar("R")


class RowGroupReader:
    """Reads ``(file, row group)`` of a fixed list of files, opening each file on first use.

    Safe to call from several threads: each thread keeps its own small cache of open files.
    """

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Sequence[int],
        columns: Sequence[str] | None,
        storage_options: dict[str, Any] | None = None,
        max_open_files: int = 4,
    ) -> None:
        self.urls, self.sizes = list(urls), [int(s) for s in sizes]
        self.columns = list(columns) if columns is not None else None
        self.filesystems = FileSystems(storage_options)
        self.max_open_files = max_open_files
        self.files_opened = 0  # how many opens this reader did (laziness is observable)
        self._local = threading.local()
        self._all_open: list[Any] = []
        self._lock = threading.Lock()

    def read(self, file_index: int, row_group: int) -> pa.Table:
        """The projected columns of one row group; ``ReadError`` names the URL and row group."""
        url = self.urls[file_index]
        try:
            return self._open(file_index).read_row_group(row_group, columns=self.columns)
        except ReadError:
            raise
        except Exception as exc:  # noqa: BLE001 - fsspec/pyarrow/botocore raise many types
            raise ReadError(f"{url}: reading row group {row_group} failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            for handle in self._all_open:
                handle.close()
            self._all_open.clear()
        self._local = threading.local()

    def _open(self, file_index: int) -> pq.ParquetFile:
        cache: OrderedDict[int, tuple[pq.ParquetFile, Any]] | None = getattr(self._local, "files", None)
        if cache is None:
            cache = self._local.files = OrderedDict()
        if file_index in cache:
            cache.move_to_end(file_index)
            return cache[file_index][0]
        fs, path = self.filesystems.resolve(self.urls[file_index])
        # No fsspec read-ahead cache: pyarrow asks for exactly the byte ranges it decodes.
        handle = fs.open(path, "rb", cache_type="none", size=self.sizes[file_index])
        with self._lock:
            self._all_open.append(handle)
            self.files_opened += 1
        cache[file_index] = (pq.ParquetFile(handle, pre_buffer=True), handle)
        while len(cache) > self.max_open_files:
            _, (_, evicted) = cache.popitem(last=False)
            with self._lock:
                self._all_open.remove(evicted)
            evicted.close()
        return cache[file_index][0]


def read_ahead(fn: Callable[[T], R], items: Iterable[T], depth: int) -> Iterator[R]:
    """Yield ``fn(item)`` for each item in order, computing up to ``depth`` items ahead.

    ``depth=0`` computes each item when it is asked for. Work runs on one background thread,
    so results keep their order and an exception surfaces exactly where its item would have.
    """
    if depth <= 0:
        for item in items:
            yield fn(item)
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamshard-read")
    pending: deque[Future[R]] = deque()
    iterator = iter(items)
    try:
        for item in iterator:
            pending.append(pool.submit(fn, item))
            if len(pending) > depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
