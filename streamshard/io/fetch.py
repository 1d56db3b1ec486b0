"""Fetching the bytes of cataloged files: byte ranges and footers, each at the file's cataloged version.

``FileFetcher`` is the row-group reader's I/O: it fetches the byte ranges it is asked for, and a file's
footer the first time this process meets the file. Footers are shared by every reader of the process
(passes, thread workers), keyed by the cataloged URL, size and version (``footer.SHARED_FOOTERS``), and
the catalog leaves there the ones it read. With the catalog's ranges a footer still to fetch comes with
the data, in one concurrent round. No whole-file downloads, no fsspec read-ahead buffers.

Files are read at the version the catalog recorded (given ``versions``): on S3 (s3fs or obstore)
every GET carries the cataloged ETag as ``If-Match``, so the store itself refuses a changed object
(no request of its own, and no gap between a check and a read); a synchronous backend's file is
checked (size and mtime, one ``info``/stat) each time a handle is opened; on another async backend
(gcsfs, http) one ``info`` per file per reader runs alongside the file's first fetch (in the same
round trip), and none of its bytes are used before it confirmed the version. A changed file is a
``ReadError`` naming both versions, never other rows under the old sample ids.

Backends: an async fsspec filesystem (s3fs, gcsfs, http) gets all ranges of a round in flight at
once through ``fs.cat_ranges``; a synchronous one (local disk) is read through one open handle per
file. Every request is retried on transient faults (``streamshard.io.retry``), and on async backends
the retry deadline also cuts off a request in flight.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import pyarrow.parquet as pq

from ..errors import ReadError
from ..plan.sized_lru import SizedLRU
from .first_reads import FIRST_READS, conditional
from .footer import FOOTER_PROBE_BYTES, SHARED_FOOTER_BYTES, SHARED_FOOTERS, FooterError, ParsedFooter, parse_footer, tail_range
from .reader_parts import _FooterCache, _Handles, _Once
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

_VERIFY_THREADS = 4  # version checks (one HEAD per file) in flight at once per reader
_NOTE_SECONDS = 10.0  # at most this long asking the store, after a failure, whether the file changed


class _ParsedFooters:
    """Footers this process parsed, by ``(file size, exact tail bytes)``: a footer's parse (a walk of its
    thrift, every chunk checked against the schema, then pyarrow's own parse; ~1 ms for 8 row groups of
    4 columns) is a pure function of those two, so a reader of a later pass, or another thread worker,
    that gets the same bytes (``SHARED_FOOTERS`` hands out the very same object, whose hash Python keeps)
    takes the parse instead of walking the footer again. Bounded by an estimate of the parsed size
    (``_PARSED_PER_BYTE`` x the bytes); ``FileMetaData`` is read-only here, so sharing it is safe."""

    def __init__(self, budget: int) -> None:
        self._parsed: SizedLRU[tuple[int, bytes], ParsedFooter] = SizedLRU(
            budget, lambda parsed: (_PARSED_PER_BYTE + 1) * len(parsed.tail))
        self._lock = threading.Lock()

    def parse(self, tail: bytes, size: int) -> ParsedFooter:
        """``parse_footer(tail, size)`` for a tail that is the exact footer (``FooterError`` as it raises)."""
        key = (int(size), bytes(tail))
        with self._lock:
            parsed = self._parsed.get(key)
        if parsed is None:
            parsed = parse_footer(key[1], size)
            with self._lock:
                self._parsed.put(key, parsed)
        return parsed

    def clear(self) -> None:
        with self._lock:
            self._parsed.clear()

    def _after_fork(self) -> None:
        # A lock held by another thread at the fork stays held in the child: start with a new one.
        self._lock = threading.Lock()


_PARSED_PER_BYTE = 8  # a parsed footer (FileMetaData) takes about this many times its serialized bytes
PARSED_FOOTERS = _ParsedFooters(SHARED_FOOTER_BYTES)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PARSED_FOOTERS._after_fork)


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



class FileFetcher:
    """Byte ranges and footers of a fixed list of files, each read at the size and version cataloged.

    Args:
        urls, sizes: the files (as cataloged) and their sizes in bytes.
        filesystems, retry: where the files are, and the per-request retry policy.
        stats: counts requests, bytes and footers (the reader's ``ReadStats``; this object updates
            only its fetch fields).
        footer_lengths: each file's footer length as cataloged; None: a footer is found with a probe
            of the file's tail, and a row group's ranges are known only from its footer.
        versions: each file's version as cataloged; given, a file whose size or version differs now
            is refused (``ReadError``). None: not checked (and no footer is shared).
        max_open_files: open handles kept for synchronous filesystems.
        max_cached_footers: parsed footers kept (a footer is fetched again after eviction).

    Thread-safe.
    """

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Sequence[int],
        filesystems: FileSystems,
        retry: RetryPolicy,
        stats: ReadStats,
        *,
        footer_lengths: Sequence[int] | None = None,
        versions: Sequence[str] | None = None,
        max_open_files: int = 4,
        max_cached_footers: int = 64,
    ) -> None:
        self.urls, self.sizes = list(urls), [int(s) for s in sizes]
        if versions is not None and len(versions) != len(self.urls):
            raise ValueError(f"versions has {len(versions)} entries for {len(self.urls)} files")
        self.filesystems, self.retry, self.stats = filesystems, retry, stats
        self._footer_lengths = None if footer_lengths is None else [int(x) for x in footer_lengths]
        self._versions = None if versions is None else [str(v) for v in versions]
        self._checked = _Once()  # async backends: files whose version this reader confirmed
        self._footers = _FooterCache(max_cached_footers)
        self._handles = _Handles(max_open_files)
        self._verify_pool: ThreadPoolExecutor | None = None
        self._fetched: set[int] = set()  # files this reader fetched from (its first fetch of each is remembered)
        self._lock = threading.Lock()

    @property
    def ranges_known(self) -> bool:
        """Whether a row group's ranges are known without its file's footer (the catalog's layout was given)."""
        return self._footer_lengths is not None

    # -- for the reader ------------------------------------------------------------------------
    def fetch_range(self, file_index: int, start: int, end: int) -> bytes:
        """The bytes ``[start, end)`` of a file."""
        return self.fetch(file_index, [(start, end)])[0][1]

    def cached_footer(self, file_index: int) -> pq.FileMetaData | None:
        """The file's footer if this reader holds it parsed, else None (fetches nothing)."""
        return self._footers.peek(file_index)

    def has_footer(self, file_index: int) -> bool:
        """Whether the file's footer is at hand without a request: held by this reader, or by this process's
        earlier readers (``SHARED_FOOTERS``)."""
        if self._footers.peek(file_index) is not None:
            return True
        return self._versions is not None and SHARED_FOOTERS.get(*self._shared_key(file_index)) is not None

    def footer(self, file_index: int) -> pq.FileMetaData:
        """The file's footer: held by this reader, being fetched by another thread, or fetched now."""
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

    def footer_and_ranges(self, file_index: int, wanted: Callable[[pq.FileMetaData | None], list[Range]]
                          ) -> tuple[pq.FileMetaData, list[tuple[int, bytes]]]:
        """The file's footer and ``(start, bytes)`` of the ranges ``wanted(footer)`` names, in as few rounds
        as possible. ``wanted(None)`` is asked only when ``ranges_known``."""
        metadata, owner = self._footers.get_or_claim(file_index)
        if not owner:
            if metadata is None and not self.ranges_known:
                metadata = self._footers.wait(file_index) or self._fetch_footer(file_index)
            parts = self.fetch(file_index, wanted(metadata))
            if metadata is None:
                metadata = self._footers.wait(file_index) or self._fetch_footer(file_index)
            return metadata, parts
        try:
            metadata, parts = self._footer_and_chunks(file_index, wanted)
        except BaseException as exc:
            self._footers.fail(file_index, exc)
            raise
        self._footers.put(file_index, metadata)
        return metadata, parts

    def close(self) -> None:
        """Close open handles, forget parsed footers and version checks (the fetcher can still be used after)."""
        self._handles.close()
        with self._lock:
            pool, self._verify_pool = self._verify_pool, None
        if pool is not None:  # waits for a check in flight (its waiters must get an answer)
            pool.shutdown(wait=True)
        self._footers.clear()
        self._checked.clear()

    def change_note(self, file_index: int) -> str:
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

    # -- footers -------------------------------------------------------------------------------
    def _footer_and_chunks(self, file_index: int, wanted: Callable[[pq.FileMetaData | None], list[Range]]
                           ) -> tuple[pq.FileMetaData, list[tuple[int, bytes]]]:
        """The footer (as this process read it already, or from the reader fetching it now, or fetched here
        with the data in one round) and the wanted ranges."""
        known = self._footer_lengths[file_index] if self._footer_lengths is not None else None
        tail, pending = self._claim_footer(file_index)
        if tail is None and pending is not None and known is not None:  # data now, the footer after
            parts = self.fetch(file_index, wanted(None))
            tail = pending.result()
            return (self._shared(file_index, tail) if tail is not None else self._fetch_footer(file_index)), parts
        if tail is None and pending is not None:
            tail = pending.result()
            metadata = self._shared(file_index, tail) if tail is not None else self._fetch_footer(file_index)
            return metadata, self.fetch(file_index, wanted(metadata))
        if tail is not None:
            metadata = self._shared(file_index, tail)
            return metadata, self.fetch(file_index, wanted(metadata))
        exact = None
        try:
            if known is not None:  # footer and data in one concurrent round
                data = wanted(None)
                fetched = self.fetch(file_index, [tail_range(self.sizes[file_index], known)] + data)
                metadata, exact = self._parse_footer(file_index, fetched[0][1], known)
                parts = fetched[1:]
            else:
                metadata, exact = self._fetch_own_footer(file_index)
                parts = self.fetch(file_index, wanted(metadata))
        finally:
            self._settle_footer(file_index, exact)
        return metadata, parts

    def _fetch_footer(self, file_index: int) -> pq.FileMetaData:
        """The file's footer alone: kept by this process, fetched by another reader now, or fetched here."""
        tail, pending = self._claim_footer(file_index)
        if pending is not None:
            tail = pending.result()
            if tail is None:  # that fetch failed: try once more here (its error, if permanent, again)
                metadata, exact = self._fetch_own_footer(file_index)
                SHARED_FOOTERS.put(*self._shared_key(file_index), exact)  # later readers need not fetch it
                return metadata
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
        tail = self.fetch(file_index, [(start, end)])[0][1]
        return self._parse_footer(file_index, tail, known)

    def _parse_footer(self, file_index: int, tail: bytes, known: int | None,
                      shared: bool = False) -> tuple[pq.FileMetaData, bytes]:
        """The footer in ``tail`` (a cataloged ``known`` length must match) and its exact bytes."""
        url, size = self.urls[file_index], self.sizes[file_index]
        try:
            if known is not None and len(tail) == known + 8:  # the exact footer: parsed once per process
                metadata, length, exact = PARSED_FOOTERS.parse(tail, size)
            else:
                metadata, length, exact = parse_footer(tail, size, None if known is not None else partial(self.fetch_range, file_index))
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
    # ``fetch`` returned are left there, and it returns none before the file's version was confirmed.
    def _shared_key(self, file_index: int) -> tuple[str, int, str | None]:
        return self.urls[file_index], self.sizes[file_index], None if self._versions is None else self._versions[file_index]

    def _claim_footer(self, file_index: int) -> tuple[bytes | None, Any]:
        return SHARED_FOOTERS.claim(*self._shared_key(file_index))

    def _settle_footer(self, file_index: int, exact: bytes | None) -> None:
        SHARED_FOOTERS.settle(*self._shared_key(file_index), exact)

    def _shared(self, file_index: int, tail: bytes) -> pq.FileMetaData:
        known = self._footer_lengths[file_index] if self._footer_lengths is not None else len(tail) - 8
        return self._parse_footer(file_index, tail, known, shared=True)[0]

    # -- byte ranges ---------------------------------------------------------------------------
    def fetch(self, file_index: int, ranges: list[Range]) -> list[tuple[int, bytes]]:
        """``(start, bytes)`` of each range (in the order asked), each request retried on its own."""
        if not ranges:
            return []
        self._check_inside(file_index, ranges)
        started = time.perf_counter()
        try:
            early = self._early(file_index, ranges)
            return early if early is not None else self._fetch_ranges(file_index, ranges)
        finally:
            with self._lock:
                self.stats.fetch_seconds += time.perf_counter() - started

    def _early(self, file_index: int, ranges: list[Range]) -> list[tuple[int, bytes]] | None:
        """The ranges from an early read a new catalog sent beside its listing (``io/first_reads.py``), or
        None; the first fetch of each file by this reader is remembered for the next catalog's. Only for
        files with a cataloged version: the early bytes are those of exactly that version."""
        if self._versions is None or not conditional(self._versions[file_index]):
            return None  # local files (and stores without ETags) never have early reads: no lock taken per fetch
        url, size, version = self.urls[file_index], self.sizes[file_index], self._versions[file_index]
        with self._lock:
            first = file_index not in self._fetched
            self._fetched.add(file_index)
        if first:
            FIRST_READS.remember(url, size, version, ranges)
        got = FIRST_READS.take(url, size, version, ranges)
        if got is not None:
            self._count(list(range(len(got))), ranges, [data for _, data in got])
        return got

    def _check_inside(self, file_index: int, ranges: list[Range]) -> None:
        """``ReadError`` at once for a range outside the file as cataloged: metadata that points past the end
        describes a damaged file, and asking the store again cannot give bytes that are not there (such a
        read used to come back short and be retried as a truncated response)."""
        size = self.sizes[file_index]
        for start, end in ranges:
            if start < 0 or end > size or end < start:
                raise ReadError(f"{self.urls[file_index]}: its metadata points at bytes [{start}, {end}) but the "
                                f"file has {size}; the file is damaged")

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
