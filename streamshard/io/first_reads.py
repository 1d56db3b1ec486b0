"""A new catalog's first data reads sent beside its listing, in a process that read the same files before.

A fresh loader in a running job (a new ``ParquetStream`` and ``StreamLoader`` per epoch, or after an
evaluation) lists its files, one round trip, and only then plans and sends its first data GETs, another
round trip: on object storage at 20 ms per request that wait was a third of a small corpus's epoch
(``benchmarks/fresh_remote.py``). Most often the files, and the first bytes read of each, are those of
the loader before it. So this process remembers, per file, the first ranges its readers fetched
(``FirstReads.remember``, from ``io/fetch.py``) and, per set of paths, the files the last catalog
listed; a new catalog over the same paths sends those reads at once (``FirstReads.start``, from
``Catalog.build``) while its listing is in flight, and a reader whose fetch lies inside bytes fetched
so takes them (``FirstReads.take``) instead of asking again.

Never the wrong bytes: each early GET is conditioned on the ETag the previous listing saw (``If-Match``)
and its bytes are kept under the file's URL, size and that version; a reader takes them only for a file
its own catalog (the new listing) has at that same size and version. A file rewritten since either
refuses the GET (HTTP 412) or is cataloged at another ETag, and its early bytes are simply not used; a
file added or removed is the new listing's to report, as before. Only on stores that take ``If-Match``
(the S3 backends: ``storage.if_match_etag``); nothing on local disk.

Bounded: at most ``EARLY_BYTES`` sent per catalog, each held read dropped once a fetch took all of it,
when the next catalog over the same paths sends its own (early bytes serve the loaders of the catalog
that sent them, never later ones: this is no data cache), or ``KEEP_S`` seconds after it was sent; a read that failed or is not back within ``TAKE_WAIT_S`` is
not used (the reader fetches as before, with its retries and errors). A forked child forgets what its
parent holds. What is wasted when the next loader reads other bytes first (another shuffle, another
worker count, worker processes that read in children): at most ``EARLY_BYTES`` of GETs per catalog.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

from .storage import cat_file_if_match, if_match_etag, is_async

Range = tuple[int, int]
Key = tuple[str, int, str]  # url, size, version

EARLY_BYTES = 32 * 1024 * 1024  # bytes of early reads sent per catalog (in URL order; the rest are read as before)
KEEP_S = 30.0  # an early read no fetch took within this is dropped
TAKE_WAIT_S = 30.0  # the most a fetch waits for an early read still in flight before fetching itself
_MAX_FILES = 100_000  # files whose first reads are remembered (the oldest forgotten first)
_MAX_LISTINGS = 16  # sets of paths whose last listing is remembered


@dataclass
class _Early:
    """One file's early GETs (a span each), in flight or back."""

    spans: tuple[Range, ...]
    future: "Future[list[bytes]]"
    sent: float


def conditional(version: str | None) -> bool:
    """Whether a file of this cataloged version can have early reads: only an ETag conditions a GET
    (local files, whose version is their mtime, never do)."""
    return bool(version) and version.startswith("ETag=")


class FirstReads:
    """This process's memory of first reads and listings, and the early reads in flight (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: OrderedDict[Key, tuple[Range, ...]] = OrderedDict()
        self._listings: OrderedDict[str, tuple[Key, ...]] = OrderedDict()
        self._early: dict[Key, list[_Early]] = {}
        self.sent = 0  # early GETs sent by this process (for tests and stats)
        self.taken = 0  # fetches answered from them

    # -- what to send ----------------------------------------------------------------------------
    def remember(self, url: str, size: int, version: str, ranges: Sequence[Range]) -> None:
        """The ranges a reader fetched first of the file at ``size`` and ``version`` (its newest reader's)."""
        if not conditional(version):
            return
        key = (url, int(size), version)
        with self._lock:
            self._first[key] = tuple((int(s), int(e)) for s, e in ranges)
            self._first.move_to_end(key)
            while len(self._first) > _MAX_FILES:
                self._first.popitem(last=False)

    def remember_listing(self, paths_key: str | None, listing: Any) -> None:
        """What a catalog over ``paths_key`` listed (an ``io/sources.py`` ``Listing``)."""
        if paths_key is None:
            return
        with self._lock:
            self._listings[paths_key] = listing
            self._listings.move_to_end(paths_key)
            while len(self._listings) > _MAX_LISTINGS:
                self._listings.popitem(last=False)

    def listing(self, paths_key: str | None) -> Any:
        """The ``Listing`` the last catalog over ``paths_key`` in this process got, or None."""
        with self._lock:
            return self._listings.get(paths_key) if paths_key is not None else None

    # -- sending ----------------------------------------------------------------------------------
    def start(self, paths_key: str | None, filesystems: Any) -> int:
        """Send the remembered first reads of the files the last catalog over ``paths_key`` listed, at most
        ``EARLY_BYTES`` of them (URL order), each GET conditioned on the version listed then; returns how
        many files got early reads. Call it before listing: the reads travel while the listing does."""
        if paths_key is None:
            return 0
        with self._lock:
            self._sweep(time.monotonic())
            last = self._listings.get(paths_key)
            listed = [(f.url, int(f.size), f.version) for f in last.files] if last is not None else []
            for key in listed:  # bytes sent for an earlier catalog serve its loaders only: this one gets its own
                for early in list(self._early.get(key, ())):
                    early.future.cancel()
                    self._drop(key, early)
            wanted = [(key, self._first[key]) for key in listed if key in self._first]
        budget, started = EARLY_BYTES, 0
        for key, spans in wanted:
            size = sum(e - s for s, e in spans)
            if size > budget:
                break
            url, _, version = key
            try:
                fs, path = filesystems.resolve(url)
                etag = if_match_etag(fs, version) if is_async(fs) else None
                loop = getattr(fs, "loop", None)
                if etag is None or loop is None:
                    continue
                future = asyncio.run_coroutine_threadsafe(_get_all(fs, path, spans, etag), loop)
            except Exception:  # noqa: BLE001 - only an early start: the reader fetches as before
                continue
            budget -= size
            started += 1
            with self._lock:
                self._early.setdefault(key, []).append(_Early(spans, future, time.monotonic()))
                self.sent += len(spans)
        return started

    # -- taking -----------------------------------------------------------------------------------
    def take(self, url: str, size: int, version: str, ranges: Sequence[Range]) -> list[tuple[int, bytes]] | None:
        """``(start, bytes)`` of each of ``ranges`` from an early read of the file at ``size`` and ``version``
        that holds them all, or None (none does, it failed, or it is not back within ``TAKE_WAIT_S``:
        fetch them as usual)."""
        key = (url, int(size), version)
        with self._lock:
            if not self._early:
                return None
            self._sweep(time.monotonic())
            early = next((e for e in self._early.get(key, ()) if _inside(ranges, e.spans)), None)
            if early is None:
                return None
            if set(early.spans) <= set((int(s), int(e)) for s, e in ranges):  # this fetch takes all of it
                self._drop(key, early)
        try:
            got = early.future.result(TAKE_WAIT_S)
        except Exception:  # noqa: BLE001 - refused (the file changed), failed or late: the reader fetches itself
            with self._lock:
                self._drop(key, early)
            return None
        if any(len(data) != e - s for data, (s, e) in zip(got, early.spans)):
            with self._lock:
                self._drop(key, early)
            return None
        with self._lock:
            self.taken += 1
        return [(s, _slice(s, e, early.spans, got)) for s, e in ranges]

    def clear(self) -> None:
        """Forget everything (early reads in flight are cancelled)."""
        with self._lock:
            for reads in self._early.values():
                for early in reads:
                    early.future.cancel()
            self._early.clear()
            self._first.clear()
            self._listings.clear()

    def _after_fork(self) -> None:  # the parent's reads in flight belong to its event loop thread
        self._lock = threading.Lock()
        self._early = {}

    def _sweep(self, now: float) -> None:
        for key in [k for k, reads in self._early.items() if any(now - e.sent > KEEP_S for e in reads)]:
            for early in [e for e in self._early[key] if now - e.sent > KEEP_S]:
                early.future.cancel()
                self._drop(key, early)

    def _drop(self, key: Key, early: _Early) -> None:
        reads = self._early.get(key, [])
        if early in reads:
            reads.remove(early)
        if not reads:
            self._early.pop(key, None)


def paths_key(paths: Any, storage_options: dict[str, Any] | None, columns: Sequence[str] | None,
              partitioning: str | None) -> str | None:
    """What names one set of files to list (plain paths only; None for tables and other sources)."""
    listed = [paths] if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__") else paths
    if not isinstance(listed, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in listed):
        return None
    text = json.dumps([[str(p) for p in listed], storage_options or {}, list(columns or []), partitioning],
                      sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _inside(ranges: Sequence[Range], spans: Sequence[Range]) -> bool:
    return bool(ranges) and all(any(s <= start and end <= e for s, e in spans) for start, end in ranges)


def _slice(start: int, end: int, spans: Sequence[Range], got: Sequence[bytes]) -> bytes:
    for (s, e), data in zip(spans, got):
        if s <= start and end <= e:
            return bytes(memoryview(data)[start - s:end - s]) if (start, end) != (s, e) else data
    raise AssertionError("not inside")  # take() checked it is


async def _get_all(fs: Any, path: str, spans: Sequence[Range], etag: str) -> list[bytes]:
    return list(await asyncio.gather(*(cat_file_if_match(fs, path, s, e, etag) for s, e in spans)))


FIRST_READS = FirstReads()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=FIRST_READS._after_fork)
