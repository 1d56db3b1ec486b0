"""The catalog: which Parquet files a set of paths names, and what their footers say.

Files are listed through fsspec (sorted by URL, so every process agrees on the order) and
every footer is read before iteration, concurrently, with one ranged request per file for the
tail. The result is a compact table of row groups (numpy arrays), which is all planning needs,
plus the byte range of every projected column chunk, so a worker fetches exactly those bytes.

Each file's version (ETag on object stores, mtime on disk, as the listing reports it) is kept in
the catalog: readers refuse a file whose version changed since, and the catalog's digest (which
checkpoints carry) covers it. On S3 the footer itself is read with the listed ETag as ``If-Match``, so
a file rewritten between the listing and its footer read fails the build (``CatalogError`` naming it)
rather than pairing the new object's footer with the old size and version. Footer summaries can be cached on disk (``cache_dir``, opt-in),
keyed by each file's size and version. When torch.distributed is initialised, rank 0 lists, the
ranks split the footer reads and all-gather the summaries, so every rank gets the same catalog
(versions included) for 1/world of the requests.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import fsspec.asyn
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import collective
from ..format import int96
from .catalog_cache import CatalogCache, footer_from_dict, footer_to_dict
from ..format.catalog_records import FileEntry, FileFooter
from ..errors import CatalogError
from ..format.deletions import kept_rows
from .first_reads import FIRST_READS, paths_key
from .delta import DELTA_LOG, delta_root_in_listing, delta_root_of_glob
from ..format.listing_rules import listed_under_directory_is_data, matched_by_glob_is_data
from .partitions import drop_columns, full_schema
from .sources import Listing, list_sources, listing_from_json, listing_to_json
from ..plan.epoch_plan import Layout
from ..format.schema import column_order, parse_cast, unify
from ..plan.state import catalog_digest, identity_digest
from .footer import (SHARED_FOOTERS, FooterError, ParsedFooter, chunk_ranges, column_leaves, leaf_values,
                     missing_footer_range, parse_footer, tail_range)
from .retry import MIN_ATTEMPT_SECONDS, RetriesExhausted, RetryPolicy, call_within, call_within_async, describe
from .storage import (
    FileSystems,
    ObjectChanged,
    cat_file_if_match,
    cat_ranges_if_match,
    check_short_read,
    file_version,
    if_match_etag,
    is_async,
    object_exists,
    short_read_error,
    timeout_kw,
)

log = logging.getLogger("streamshard")

_GLOB_CHARS = ("*", "?", "[")


@dataclass(frozen=True, eq=False)
class Catalog:
    """The row groups of a set of Parquet files, in global sample-id order.

    Global sample ids: files sorted by URL, then row groups in file order, then rows.
    ``schema`` is the projected Arrow schema; a field is nullable when some file's statistics
    do not rule out nulls in it (so tensors get a validity mask for exactly those columns).
    ``rg_ranges[g, c]`` is the ``[start, end)`` byte range of projected column ``c`` in row
    group ``g``; ``footer_lengths`` lets a reader fetch a footer with one exact request.
    ``versions[f]`` is file ``f``'s version token as listed (``"ETag=..."``, ``"mtime=..."``, '' if
    the store has none; empty tuple: unknown); readers refuse a file whose version changed.
    """

    urls: tuple[str, ...]
    file_sizes: np.ndarray  # int64 per file
    rg_file: np.ndarray  # int64 per row group: index into urls
    rg_index: np.ndarray  # int64 per row group: row group number inside its file
    rg_rows: np.ndarray  # int64 per row group
    schema: pa.Schema
    footer_lengths: np.ndarray | None = None  # int64 per file
    rg_ranges: np.ndarray | None = None  # int64 (row groups, columns, 2)
    versions: tuple[str, ...] = ()  # per file, as listed
    rg_values: np.ndarray | None = None  # int64 (row groups, columns): non-null leaf values, -1 unknown
    partition_values: pa.Table | None = None  # one row per file: its partition keys (the schema's last columns)
    tables: tuple[str, ...] = ()  # "delta:<url>@<version>" of every table version read
    # Deletion vectors (format/deletions.py): file index -> sorted deleted row numbers; rg_rows then counts the kept
    # rows and rg_stored_rows (int64 per row group) what the files store. None when nothing is deleted.
    deleted_rows: Mapping[int, np.ndarray] | None = None
    rg_stored_rows: np.ndarray | None = None
    file_first_rg: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.versions and len(self.versions) != len(self.urls):
            raise ValueError(f"versions has {len(self.versions)} entries for {len(self.urls)} files")
        if self.partition_values is not None and self.partition_values.num_rows != len(self.urls):
            raise ValueError(f"partition_values has {self.partition_values.num_rows} rows for {len(self.urls)} files")
        starts = np.searchsorted(self.rg_file, np.arange(len(self.urls)), side="left").astype(np.int64)
        object.__setattr__(self, "file_first_rg", starts)

    @cached_property
    def layout(self) -> Layout:
        """The shape planning needs (rows and file of each row group), computed once."""
        return Layout(self.rg_rows, self.rg_file)

    @property
    def rg_first_id(self) -> np.ndarray:
        """Global sample id of each row group's first row."""
        return self.layout.rg_first_id

    @property
    def num_files(self) -> int:
        return len(self.urls)

    @property
    def num_row_groups(self) -> int:
        return len(self.rg_rows)

    @property
    def num_rows(self) -> int:
        return int(self.rg_rows.sum())

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    @property
    def partition_keys(self) -> list[str]:
        """Columns whose values come from the paths (Hive ``k=v``) or a table's log, not from the files."""
        return [] if self.partition_values is None else list(self.partition_values.column_names)

    @property
    def file_columns(self) -> list[str]:
        """Columns read from the files (``rg_ranges`` and ``rg_values`` are indexed by these)."""
        keys = set(self.partition_keys)
        return [name for name in self.schema.names if name not in keys]

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"Catalog({self.num_files} files, {self.num_row_groups} row groups, "
            f"{self.num_rows} rows, columns={self.columns})"
        )

    @cached_property
    def digest(self) -> str:
        """A short hash of the files, their sizes, versions and row-group layout (and the table versions
        read): what sample ids depend on."""
        return catalog_digest(self.urls, self.file_sizes, self.rg_file, self.rg_rows, self.versions, self.tables)

    @property
    def identity(self) -> str:
        """A short hash of the local files' inodes and ctimes ('' for other stores): a file replaced by
        a copy of the same size and mtime (``cp -p``) changes it, where ``digest`` cannot tell."""
        return identity_digest(self.versions)

    def place(self, rg: int) -> str:
        """Where global row group ``rg`` lives, for messages: ``"<url> row group <n>"``."""
        return f"{self.urls[int(self.rg_file[rg])]} row group {int(self.rg_index[rg])}"

    def projected_bytes(self) -> int:
        """Bytes of the projected column chunks of every row group (what one epoch fetches)."""
        if self.rg_ranges is None:
            raise ValueError("this catalog has no byte ranges")
        return int((self.rg_ranges[..., 1] - self.rg_ranges[..., 0]).sum())

    @classmethod
    def build(
        cls,
        paths: str | Sequence[str],
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        max_concurrency: int = 64,
        cache_dir: str | None = None,
        retry: RetryPolicy | None = None,
        distributed: bool = True,
        cast: Mapping[str, Any] | None = None,
        progress: Callable[[int], None] | None = None,
        group: Any = None,
        partitioning: str | None = "hive",
        speculate: bool = False,
    ) -> "Catalog":
        """List the files ``paths`` names and read every footer.

        ``paths``: files, directories, globs (any fsspec URL) and Delta tables (``ss.DeltaTable``, or a
        directory holding ``_delta_log/``: ``io/sources.py``). ``partitioning``: "hive" reads ``k=v``
        directory names below each directory or glob as columns (``io/partitions.py``); None reads none.
        ``max_concurrency``: footer requests in flight (at 20 ms per request, 64 builds a cold catalog
        of 2,000 files about 1.3x faster than 32: under 5 s with s3fs, ~2.5 s with the obstore backend).
        ``cache_dir``: keep footer summaries there and reuse those of unchanged files.
        ``retry``: how transient storage faults are retried (default ``RetryPolicy()``).
        ``distributed``: when torch.distributed is initialised, split the footer reads across
        ranks (every rank must call ``build`` with the same arguments); False reads all here.
        ``group``: the process group whose ranks split the reads (None: the default group; a
        data-parallel mesh's group when only those ranks build the catalog).
        ``cast``: ``{column: Arrow type or name}`` read as that type whatever each file says.
        ``progress``: called with 1 after each footer read here (a progress bar's ``update``).
        Physical differences between writers (``large_list`` vs ``list``, dictionary-encoded vs
        plain, list item names, nullability) never need a cast (``format/schema.py``).

        ``speculate``: where this process cataloged the same paths before and holds every footer of what
        it listed then (object storage, not split over ranks), return that catalog at once and list
        beside it; the caller must ask ``confirmed()`` before it delivers any row, and build again when
        it is False (``StreamLoader`` does: a fresh loader's first reads and decoding then overlap the
        listing).

        Raises ``CatalogError`` when a path matches nothing, a file is not Parquet, a projected
        column is missing, or two files disagree on a column's logical type (naming both files).
        """
        targets = parse_cast(cast)
        projection = list(columns) if columns is not None else None
        if projection is not None and len(set(projection)) != len(projection):
            raise ValueError(f"columns has duplicates: {projection}")
        filesystems = FileSystems(storage_options)
        policy = retry or RetryPolicy()
        early_key = None
        if _waits_on_an_event_loop(paths, filesystems):
            warm_arrow_while_waiting()
            # the first data reads of the last catalog over these paths travel while this one lists
            early_key = paths_key(paths, storage_options, projection, partitioning)
            FIRST_READS.start(early_key, filesystems)
        lister = lambda: list_sources(paths, filesystems, policy, partitioning)  # noqa: E731
        cache = CatalogCache(cache_dir, [str(p) for p in _as_list(paths)], projection) if cache_dir else None
        place = collective.process_group(group) if distributed else None
        if speculate and place is None:
            guessed = _from_last_listing(cls, early_key, lister, projection, targets)
            if guessed is not None:
                return guessed
        if place is None:
            listing, footers = _build_local(lister, projection, filesystems, policy, cache, max_concurrency, progress)
        else:
            listing, footers = _build_distributed(lister, projection, filesystems, policy, cache, max_concurrency,
                                                  *place, progress=progress, group=group)
        FIRST_READS.remember_listing(early_key, listing)
        return cls.from_footers(footers, targets, listing, projection)

    def confirmed(self) -> bool:
        """Whether this catalog describes the files as listed now: True for one built from a listing; for
        one built with ``speculate`` from this process's last listing of its paths, whether the listing
        made beside it found the same files, sizes, versions, partition keys and table versions (waits
        for it). False: files were added, removed or rewritten since (or the listing failed): build the
        catalog again, and deliver nothing read through this one."""
        pending = _UNCONFIRMED.get(self)
        if pending is None:
            return self not in _REFUSED
        listing, guessed, key = pending
        try:
            now = listing.result()
            same = _same_listing(now, guessed)
        except Exception:  # noqa: BLE001 - a build of its own reports the listing's error
            same = False
        _UNCONFIRMED.pop(self, None)
        if not same:
            _REFUSED.add(self)
            return False
        FIRST_READS.remember_listing(key, now)
        return True

    def refused(self) -> bool:
        """Whether ``confirmed()`` found this catalog stale (without waiting: False while it is not known)."""
        return self in _REFUSED

    @classmethod
    def from_footers(cls, footers: Sequence[FileFooter], cast: Mapping[str, pa.DataType] | None = None,
                     listing: Listing | None = None, columns: Sequence[str] | None = None) -> "Catalog":
        """Assemble a catalog from footers already read (in URL order), agreeing on one logical schema;
        ``listing``'s partition keys (one row per footer) become the schema's last columns (or take their
        place in ``columns``)."""
        if not footers:
            raise CatalogError("no files to catalog")
        keys = listing.partitions if listing is not None else None
        cast = dict(cast or {})
        if keys is not None:  # a key is the path's value, also where a file holds the column (polars writes both)
            footers = [drop_columns(f, set(keys.column_names)) for f in footers]
            keys = _cast_keys(keys, cast)
        nullable = set().union(*(f.maybe_null for f in footers))
        files_schema = unify([(f.url, f.schema) for f in footers], nullable, cast,
                             [int(f.row_group_rows.sum()) for f in footers])
        schema = files_schema
        counts = np.array([len(f.row_group_rows) for f in footers], dtype=np.int64)
        stored = [f.row_group_rows for f in footers]
        rows, deleted = kept_rows([f.url for f in footers], stored, listing.deleted if listing is not None else {})
        rg_rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        rg_file = np.repeat(np.arange(len(footers), dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        rg_index = np.arange(len(rg_rows), dtype=np.int64) - starts
        has_ranges = all(f.ranges is not None and f.footer_length > 0 for f in footers)
        ranges = None
        if has_ranges:
            width = len(files_schema)
            parts = [_in_catalog_order(f.ranges.reshape(len(f.row_group_rows), width, 2), f, files_schema)
                     for f in footers]
            ranges = np.concatenate(parts) if parts else np.zeros((0, width, 2), np.int64)
        values = None
        if all(f.values is not None for f in footers):
            values = np.concatenate([_in_catalog_order(f.values.reshape(len(f.row_group_rows), len(files_schema)), f,
                                                       files_schema) for f in footers]) \
                if footers else None
        schema = full_schema(files_schema, keys, columns)
        return cls(
            urls=tuple(f.url for f in footers),
            file_sizes=np.array([f.size for f in footers], dtype=np.int64),
            rg_file=rg_file,
            rg_index=rg_index,
            rg_rows=rg_rows,
            schema=schema,
            footer_lengths=np.array([f.footer_length for f in footers], dtype=np.int64) if has_ranges else None,
            rg_ranges=ranges,
            versions=tuple(f.version for f in footers),
            rg_values=values,
            partition_values=keys,
            tables=listing.tables if listing is not None else (),
            deleted_rows=deleted or None,
            rg_stored_rows=np.concatenate(stored).astype(np.int64) if deleted else None,
        )


# Catalogs built from this process's last listing (``speculate``), whose own listing runs beside them:
# catalog -> (that listing's future, the listing they were built from, the paths' key).
_UNCONFIRMED: "weakref.WeakKeyDictionary[Catalog, tuple[Future, Listing, str | None]]" = weakref.WeakKeyDictionary()
_REFUSED: "weakref.WeakSet[Catalog]" = weakref.WeakSet()  # those the listing beside them found stale


def _from_last_listing(cls: type[Catalog], key: str | None, lister: Callable[[], Listing],
                       columns: list[str] | None, cast: Mapping[str, Any]) -> Catalog | None:
    """The catalog of this process's last listing of the paths ``key`` names, if it holds every footer
    of it at the listed size and version, with ``lister`` started beside it in a thread (``confirmed``);
    else None."""
    last = FIRST_READS.listing(key)
    if last is None or not last.files:
        return None
    known = _footers_read_here(last.files, _file_projection(columns, last), None)
    if len(known) != len(last.files):
        return None
    try:
        catalog = cls.from_footers([known[f.url] for f in last.files], cast, last, columns)
    except Exception:  # noqa: BLE001 - a build of its own reports it
        return None
    listing: Future = Future()

    def run() -> None:
        try:
            listing.set_result(lister())
        except BaseException as exc:  # noqa: BLE001 - handed to confirmed()
            listing.set_exception(exc)

    threading.Thread(target=run, name="streamshard-listing", daemon=True).start()
    _UNCONFIRMED[catalog] = (listing, last, key)
    return catalog


def _same_listing(now: Listing, then: Listing) -> bool:
    """Whether two listings name the same files at the same sizes and versions, with the same partition
    keys, table versions and deleted rows."""
    if [(f.url, f.size, f.version) for f in now.files] != [(f.url, f.size, f.version) for f in then.files]:
        return False
    if now.tables != then.tables or (now.partitions is None) != (then.partitions is None):
        return False
    if now.partitions is not None and not now.partitions.equals(then.partitions):
        return False
    return now.deleted.keys() == then.deleted.keys() and all(
        np.array_equal(now.deleted[k], then.deleted[k]) for k in now.deleted)


def _waits_on_an_event_loop(paths: Any, filesystems: FileSystems) -> bool:
    """Whether the first path's filesystem is an async one (object storage: s3fs, obstore, gcsfs, http), whose
    listing and footer reads this thread waits for on an event loop, not a synchronous one it would be reading
    itself (local disk, a mount: there a second thread only contends for the GIL)."""
    first = next((p for p in _as_list(paths) if isinstance(p, str)), None)
    if first is None:
        return False
    try:
        return is_async(filesystems.resolve(first)[0])
    except Exception:  # noqa: BLE001 - the listing reports a URL or option it cannot resolve, as a CatalogError
        return False


_ARROW_WARMED = threading.Event()  # set once this process started pyarrow's first pa.array() (below)
_ARROW_WARM_UP: list[threading.Thread] = []  # the thread making it, while this process has one
_FORK_WAITS_FOR_WARM_UP_S = 10.0  # the most a fork waits for the warm-up (an import held by the forking thread)


def warm_arrow_while_waiting() -> None:
    """Make pyarrow's first ``pa.array()`` of this process in a background thread, once.

    pyarrow imports pandas (when installed) on its first ``pa.array()``: ~0.15-0.2 s of CPU that a
    restarted process pays before its first batch. A catalog over object storage spends its first round
    trips waiting on an event loop (listing, footers), so the import runs beside those waits instead of
    after them; ``ParquetStream.set_epoch`` starts it too (where the catalog did not), and no longer waits
    for it: thread workers send their first reads while it runs (measured: ``benchmarks/fresh_remote.py``).
    A fork waits for it to end (``os.register_at_fork``), so forked DataLoader workers inherit the import,
    never an import lock held by a thread the child does not have. Not started by a catalog over a
    synchronous filesystem: its footer reads run in this thread, which the import would slow (and
    mislead the footer probe)."""
    if _ARROW_WARMED.is_set():
        return
    _ARROW_WARMED.set()

    def first_array() -> None:
        try:
            pa.array(np.zeros(1, dtype=np.int64))
        except Exception:  # noqa: BLE001 - only a warm-up: the caller's own first pa.array() reports any error
            pass

    # Not a daemon: an interpreter that finalizes while the thread still imports pandas's extensions
    # aborts (SIGABRT), so a short program that exits right after its catalog waits for the import instead.
    thread = threading.Thread(target=first_array, name="streamshard-arrow-warm-up", daemon=False)
    _ARROW_WARM_UP[:] = [thread]
    thread.start()


def _finish_warm_up_before_fork() -> None:
    """Before a fork: wait for the warm-up's import to end (a child would inherit it half done, its module
    locks held by a thread it does not have)."""
    for thread in list(_ARROW_WARM_UP):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(_FORK_WAITS_FOR_WARM_UP_S)


def _forget_warm_up_in_child() -> None:
    _ARROW_WARM_UP.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_finish_warm_up_before_fork, after_in_child=_forget_warm_up_in_child)


def _as_list(paths: Any) -> list[Any]:
    return [paths] if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__") or not isinstance(
        paths, (list, tuple)) else list(paths)


def _cast_keys(keys: pa.Table, cast: dict[str, Any]) -> pa.Table:
    """Partition keys read as ``cast`` says (the entries are removed from ``cast``: the files do not have them)."""
    for name in keys.column_names:
        if name in cast:
            target = cast.pop(name)
            try:
                keys = keys.set_column(keys.column_names.index(name), name, keys.column(name).cast(target))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise CatalogError(f"cast: partition key {name!r} cannot be read as {target}: {exc}") from None
    return keys


def _file_projection(columns: list[str] | None, listing: Listing) -> list[str] | None:
    """The columns to find in the files: ``columns`` without the partition keys."""
    if columns is None or not listing.keys:
        return columns
    return [c for c in columns if c not in listing.keys]


def _in_catalog_order(per_column: np.ndarray, footer: FileFooter, schema: pa.Schema) -> np.ndarray:
    """A file's per-column arrays (``(row groups, columns, ...)``, in its own column order) in the catalog's order."""
    order = column_order(footer.schema.names, schema)
    return per_column if order is None else per_column[:, order]


def _build_local(
    lister: Callable[[], Listing],
    columns: list[str] | None,
    filesystems: FileSystems,
    policy: RetryPolicy,
    cache: CatalogCache | None,
    max_concurrency: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[Listing, list[FileFooter]]:
    listing = lister()
    files, columns = listing.files, _file_projection(columns, listing)
    cached = cache.load(files) if cache else {}
    missing = [f for f in files if f.url not in cached]
    read = dict(zip((f.url for f in missing), _read_footers(missing, columns, filesystems, policy, max_concurrency,
                                                                        progress)))
    footers = [read[f.url] if f.url in read else footer_from_dict(cached[f.url]) for f in files]
    if cache is not None and missing:
        cache.save([footer_to_dict(f) for f in footers])
    log.debug("catalog: %d files, %d footers read, %d from cache", len(files), len(missing), len(cached))
    return listing, footers


def _build_distributed(
    lister: Callable[[], Listing],
    columns: list[str] | None,
    filesystems: FileSystems,
    policy: RetryPolicy,
    cache: CatalogCache | None,
    max_concurrency: int,
    rank: int,
    world: int,
    progress: Callable[[int], None] | None = None,
    group: Any = None,
) -> tuple[Listing, list[FileFooter]]:
    """Rank 0 lists and consults the cache; ranks read interleaved shares of the rest; all-gather.

    Errors travel as messages through the same collectives, so every rank raises the same
    ``CatalogError`` instead of some ranks waiting forever on the others.
    """
    listing: dict[str, Any] = {}
    if rank == 0:
        listing = _guarded(lambda: _list_and_load(lister, cache))
    listing = collective.broadcast(listing, group)
    _raise_if_error([listing])
    listed = listing_from_json(listing["listing"])
    files, columns = listed.files, _file_projection(columns, listed)
    cached: dict[str, dict[str, Any]] = listing["cached"]
    missing = [f for f in files if f.url not in cached]
    mine = missing[rank::world]
    share = _guarded(lambda: {"footers": [footer_to_dict(f) for f in _read_footers(
        mine, columns, filesystems, policy, max_concurrency, progress)]})
    shares = collective.all_gather(share, group)
    _raise_if_error(shares)
    read = {d["url"]: d for s in shares for d in s["footers"]}
    dicts = [read.get(f.url) or cached[f.url] for f in files]
    if rank == 0 and cache is not None and missing:
        cache.save(dicts)
    log.debug("catalog rank %d/%d: read %d of %d footers", rank, world, len(mine), len(files))
    return listed, [footer_from_dict(d) for d in dicts]


def _list_and_load(lister: Callable[[], Listing], cache: CatalogCache | None) -> dict[str, Any]:
    listing = lister()
    cached = cache.load(listing.files) if cache else {}
    return {"listing": listing_to_json(listing), "cached": cached}


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except CatalogError as exc:
        return {"error": str(exc)}


def _raise_if_error(results: Sequence[dict[str, Any]]) -> None:
    for result in results:
        if "error" in result:
            raise CatalogError(result["error"])


def list_files(paths: str | Sequence[str], filesystems: FileSystems | None = None) -> list[tuple[str, int]]:
    """Expand files, directories and globs into sorted, de-duplicated ``(url, size)`` pairs."""
    return [(f.url, f.size) for f in list_entries(paths, filesystems)]


def list_entries(
    paths: str | Sequence[str], filesystems: FileSystems | None = None, retry: RetryPolicy | None = None
) -> list[FileEntry]:
    """Expand files, directories and globs into sorted, de-duplicated ``FileEntry``s.

    An existing file or directory is taken literally, even with glob characters in its name
    (``brack[1].parquet``); anything else is a glob. Directories are searched recursively; what is
    never data is skipped there and in what a glob's wildcards matched (``format/listing_rules.py``: names
    starting with ``.`` or ``_`` such as ``_SUCCESS``, ``.crc`` files and ``_metadata``, as Spark and Hive
    writers expect; zero-byte ``prefix/`` folder objects; ``<dir>_$folder$``). A file named explicitly is
    read. A directory holding a Delta table's ``_delta_log/``, or a glob below a table's root, is a
    ``DeltaTableFound`` (read as plain files, a table delivers the files its log removed). A path that
    matches nothing is an error saying why (the bucket or directory does not exist, access is denied,
    nothing in it matches), so a typo in one of several globs loses nothing silently.
    """
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [str(paths)]
    paths = [str(p) for p in paths]
    if not paths:
        raise CatalogError("paths is empty: give at least one file, directory or glob")
    filesystems = filesystems or FileSystems()
    policy = retry or RetryPolicy()
    found: dict[str, FileEntry] = {}
    seen: dict[tuple[Any, ...], str] = {}  # a file's identity -> the URL it was first listed under
    again: list[str] = []
    for path in paths:
        def attempt(left: float, path: str = path) -> dict[str, tuple[FileEntry, tuple[Any, ...] | None]]:
            return _expand(path, filesystems, time.monotonic() + left)

        try:
            matched = call_within(attempt, policy, f"listing {path}", filesystems.redact)
        except CatalogError as exc:  # its own type kept (DeltaTableFound: the caller may read the table instead)
            exc.args = (filesystems.redact(str(exc)),)
            raise exc from None
        except Exception as exc:  # noqa: BLE001 - any backend error becomes one clear message
            cause = exc.last if isinstance(exc, RetriesExhausted) else exc
            extra = f" ({exc.attempts} attempts in {exc.elapsed:.1f} s)" if isinstance(exc, RetriesExhausted) else ""
            raise CatalogError(filesystems.redact(f"listing {path!r} failed{extra}: {describe(cause)}")) from None
        for url, (entry, identity) in matched.items():
            first = seen.setdefault(identity, url) if identity is not None else url
            if first != url:
                again.append(f"{url} (= {first})")
            else:
                found[url] = entry
    if again:  # one file under two spellings (d and d/../d, d//x, a hard link) would be two sets of ids
        warnings.warn(filesystems.redact(
            f"paths name {len(again)} file(s) a second time under another spelling; each is read once: "
            f"{', '.join(again[:3])}"), stacklevel=3)
    return [found[url] for url in sorted(found)]


def _expand(path: str, filesystems: FileSystems, until: float) -> dict[str, tuple[FileEntry, tuple[Any, ...] | None]]:
    """The files ``path`` names, each storage call cut off at ``until``, with their identity where the
    store gives one (``_identity``); ``CatalogError`` if none, saying why."""
    fs, root = filesystems.resolve(path)

    def bound() -> dict[str, float]:
        return timeout_kw(fs, until - time.monotonic())

    # Filesystems are shared within a process; a catalog must see storage as it is now, not a
    # listing cached by an earlier build (files added or rewritten since).
    fs.invalidate_cache()
    info, listed = _info_and_listing(fs, root, until)
    try:
        if isinstance(info, BaseException):
            raise info
        entries = {root: info}  # an existing path is taken literally
    except FileNotFoundError as exc:
        if not any(ch in root for ch in _GLOB_CHARS):
            raise CatalogError(f"{path!r} does not exist{_missing(exc)}") from None
        entries = fs.glob(root, detail=True, **bound())
        if not entries:
            raise CatalogError(f"no files matched {path!r}{_why_no_match(fs, root, bound)}") from None
        entries = {name: info for name, info in entries.items()  # markers and hidden names a wildcard matched
                   if matched_by_glob_is_data(root, name, _size(info))}
        _refuse_glob_in_delta_table(fs, path, root, bound)
    out: dict[str, tuple[FileEntry, tuple[Any, ...] | None]] = {}
    for name, info in entries.items():
        if info.get("type") == "directory":
            found = listed if name == root and listed is not None else fs.find(name, detail=True, **bound())
            if isinstance(found, BaseException):
                raise found
            _refuse_delta_table(fs, name, found)
            for sub, subinfo in found.items():
                relative = sub[len(name.rstrip("/")) + 1 :]
                if listed_under_directory_is_data(relative, _size(subinfo)):
                    if subinfo.get("islink"):
                        subinfo = _followed(fs, sub, subinfo, bound)
                    url = fs.unstrip_protocol(sub)
                    out[url] = FileEntry(url, int(subinfo["size"]), file_version(subinfo)), _identity(subinfo)
        else:
            url = fs.unstrip_protocol(name)
            out[url] = FileEntry(url, int(info["size"]), file_version(info)), _identity(info)
    if not out:
        raise CatalogError(f"no files matched {path!r} (only empty directories or hidden/marker files)")
    return out


def _info_and_listing(fs: Any, root: str, until: float) -> tuple[Any, Any]:
    """``fs.info(root)`` (or the exception it raised) and, where ``root`` looks like a directory on an async
    store (an object store), its recursive listing from the same round of requests (or the exception);
    else None for the listing.

    On S3 ``info`` of a prefix is a HEAD and then a one-key listing, and the listing the catalog needs
    came a round trip after that. Here the HEAD alone (``storage.object_exists``; ``info`` where the store
    has none) and the listing go out at once: no object under the name and keys below it make a
    directory, in one round trip instead of three. Any other answer (an object, nothing, an error) is
    ``info``'s to give, as before. A name with a dot in its last part is taken for a file and listed
    only if it turns out to be a directory: a wrong guess costs one request.
    """
    def plain_info() -> Any:
        try:
            return fs.info(root, **timeout_kw(fs, until - time.monotonic()))
        except FileNotFoundError as exc:
            return exc

    looks_like_directory = root.endswith("/") or "." not in root.rstrip("/").rsplit("/", 1)[-1]
    if not (is_async(fs) and looks_like_directory and hasattr(fs, "_find") and getattr(fs, "loop", None)):
        return plain_info(), None

    async def head_or_info() -> Any:
        exists = await object_exists(fs, root)
        return await fs._info(root) if exists is None else exists

    async def both() -> list[Any]:
        return await asyncio.gather(head_or_info(), fs._find(root, detail=True), return_exceptions=True)

    exists, listed = fsspec.asyn.sync(fs.loop, both, timeout=max(until - time.monotonic(), 0.001))
    below = root.rstrip("/") + "/"
    if exists is False and isinstance(listed, dict) and listed and all(name.startswith(below) for name in listed):
        return {"name": root.rstrip("/"), "size": 0, "type": "directory"}, listed
    info = exists if isinstance(exists, dict) else plain_info()
    return info, listed if isinstance(info, dict) and info.get("type") == "directory" else None


def _refuse_delta_table(fs: Any, directory: str, found: dict[str, Any]) -> None:
    """``DeltaTableFound`` if the listing of ``directory`` holds a ``_delta_log/`` (its files are not all live)."""
    cut = len(directory.rstrip("/")) + 1
    if any(DELTA_LOG in sub for sub in found):
        error = delta_root_in_listing(fs.unstrip_protocol(directory).rstrip("/"), [sub[cut:] for sub in found])
        if error is not None:
            raise error


def _refuse_glob_in_delta_table(fs: Any, path: str, root: str, bound: Callable[[], dict[str, float]]) -> None:
    """``DeltaTableFound`` if a glob's fixed leading directory is a Delta table's root (one more request)."""
    cut = min(root.index(ch) for ch in _GLOB_CHARS if ch in root)
    base = root[:cut].rsplit("/", 1)[0] if "/" in root[:cut] else ""
    if base and fs.exists(f"{base}/{DELTA_LOG}", **bound()):
        raise delta_root_of_glob(path, fs.unstrip_protocol(base).rstrip("/"))


def _size(info: dict[str, Any]) -> int:
    size = info.get("size")
    return int(size) if isinstance(size, (int, float)) else -1


def _identity(info: dict[str, Any]) -> tuple[Any, ...] | None:
    """What makes two listed names one file, where the store says (an inode number, with the size and
    mtime that make a clash across devices implausible); None where it does not (object stores, whose
    keys are their identity)."""
    ino = info.get("ino")
    return None if ino in (None, 0) else (ino, info.get("size"), info.get("mtime"))


def _followed(fs: Any, path: str, link: dict[str, Any], bound: Callable[[], dict[str, float]]) -> dict[str, Any]:
    """What a symbolic link found in a directory points to: its size and version are the target's (a
    listing entry describes the link itself, and the reader checks the target: the Hugging Face hub cache's
    ``snapshots/<rev>/*.parquet -> ../../blobs/<hash>``); a dangling link, a loop or a link to a
    directory is a ``CatalogError`` saying so."""
    url, target = fs.unstrip_protocol(path), link.get("destination")
    try:
        info = fs.info(path, **bound())
    except FileNotFoundError:
        raise CatalogError(f"{url} is a symbolic link to {target!r}, which does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CatalogError(f"{url} is a symbolic link loop ({target!r})") from None
        raise
    if info.get("type") == "directory":
        raise CatalogError(f"{url} is a symbolic link to the directory {target!r}, which is not followed inside "
                           "a directory; give it as a path of its own")
    return info


def _why_no_match(fs: Any, root: str, bound: Callable[[], dict[str, float]]) -> str:
    """Why a glob matched nothing: the directory it searches does not exist (with the store's cause), or is there."""
    cut = min(root.index(ch) for ch in _GLOB_CHARS if ch in root)
    base = root[:cut].rsplit("/", 1)[0] if "/" in root[:cut] else ""
    if not base:
        return ""
    try:
        fs.info(base, **bound())
    except FileNotFoundError as exc:
        return f": {fs.unstrip_protocol(base)!r} does not exist{_missing(exc)}"
    return f" (nothing in {fs.unstrip_protocol(base)!r} matches)"


def _missing(exc: BaseException) -> str:
    """The store's cause of a missing path, led by NoSuchBucket when it is the bucket that is missing."""
    cause = describe(exc)
    if "NoSuchBucket" in cause or "bucket does not exist" in cause.lower():
        return f": its bucket does not exist (NoSuchBucket; {cause})"
    return f" ({cause})"


def _read_footers(
    files: Sequence[FileEntry],
    columns: list[str] | None,
    filesystems: FileSystems,
    policy: RetryPolicy,
    max_concurrency: int,
    progress: Callable[[int], None] | None = None,
) -> list[FileFooter]:
    """Every file's footer, ``max_concurrency`` at a time; the first failure (in URL order) is raised.

    A footer this process already read at the file's listed size and version (``SHARED_FOOTERS``:
    an earlier catalog, a reader) is parsed from there, without a request: a new dataset or loader
    over the same files in a running job lists them, and reads only the footers of files that
    changed. After a failure no further footer read starts (a hung store would otherwise cost a
    deadline per ``max_concurrency`` files); the reads in flight end within their own deadline.
    """
    known = _footers_read_here(files, columns, progress)
    if known:
        read = iter(_read_footers([f for f in files if f.url not in known], columns, filesystems, policy,
                                  max_concurrency, progress))
        return [known[f.url] if f.url in known else next(read) for f in files]
    if len(files) > 1 and max_concurrency > 1:
        loop = _shared_loop(files, filesystems)
        if loop is not None:
            return _read_footers_async(loop, files, columns, filesystems, policy, max_concurrency, progress)
    failed = threading.Event()

    def one(entry: FileEntry) -> FileFooter:
        if failed.is_set():
            raise _NotStarted()
        try:
            footer = read_footer(entry.url, entry.size, columns, filesystems, policy, entry.version)
        except BaseException:
            failed.set()
            raise
        if progress is not None:
            progress(1)
        return footer

    if len(files) <= 1 or max_concurrency <= 1:
        return [one(entry) for entry in files]
    # A synchronous store (a local disk, a mount) that answers from memory makes a footer read pure
    # Python: threads then only contend for the GIL (20,000 page-cached local footers: 4.1 s in one
    # thread, 8.2 s in 2, 10.8 s in 64). So the first few are read in this thread, timed, and the rest
    # go to threads only if those reads waited on I/O (a network mount, a cold disk) more than computed.
    before = _thread_clock()
    head = [one(entry) for entry in files[:_PROBE_FILES]]
    wall, cpu, queued = (end - start for end, start in zip(_thread_clock(), before))
    rest = files[len(head):]
    if not rest:
        return head
    # Waited on I/O: neither computing nor waiting for a CPU (a loaded machine is no network mount)
    if wall - cpu - queued < (_WAITED - 1) * cpu:
        return head + [one(entry) for entry in rest]
    return head + _read_in_threads(rest, one, failed, max_concurrency)


def _thread_clock() -> tuple[float, float, float]:
    """This thread's clocks in seconds: wall, on a CPU, and waiting in the run queue for one (Linux's
    ``/proc/thread-self/schedstat``; elsewhere the thread's CPU time and no queue). On a machine with
    more runnable threads than cores a computing thread's wall time grows by its queue time, which is
    not a wait on I/O: without it, a footer probe under load took page-cached files for a network mount."""
    wall = time.perf_counter()
    try:
        with open("/proc/thread-self/schedstat", "rb") as stat:
            on_cpu, queued = stat.read().split()[:2]
        return wall, int(on_cpu) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return wall, time.thread_time(), 0.0


def _footers_read_here(files: Sequence[FileEntry], columns: list[str] | None,
                       progress: Callable[[int], None] | None) -> dict[str, FileFooter]:
    """The footers of ``files`` that this process keeps at their listed size and version, parsed, by URL.

    Only a versioned file is ever kept (``SharedFooters``), so a rewritten object (another ETag) or
    local file (another mtime, inode or ctime) misses and its footer is read again."""
    out: dict[str, FileFooter] = {}
    for entry in files:
        tail = SHARED_FOOTERS.get(entry.url, entry.size, entry.version)
        if tail is None:
            continue
        try:
            metadata, footer_length, _ = parse_footer(tail, entry.size)
        except FooterError:  # not expected (the bytes parsed when kept): read the file's footer again
            continue
        out[entry.url] = _footer_from_metadata(entry.url, entry.size, metadata, footer_length, columns, entry.version)
        if progress is not None:
            progress(1)
    return out


_PROBE_FILES = 32  # footers read in the calling thread to tell a cached store from one that waits
_WAITED = 2.0  # wall over CPU time (queueing for a CPU aside) above which those reads waited on I/O: threads pay off


def _read_in_threads(files: Sequence[FileEntry], one: Callable[[FileEntry], FileFooter], failed: threading.Event,
                     max_concurrency: int) -> list[FileFooter]:
    """``one`` of every file in ``max_concurrency`` threads; the first failure in URL order is raised.

    Each thread takes the next file until none is left: one task per thread, not per file (100,000
    submitted futures cost more in lock contention than the footer reads themselves)."""
    results: list[Any] = [None] * len(files)
    errors: dict[int, BaseException] = {}
    next_index = itertools.count()

    def drain() -> None:
        for i in iter(lambda: next(next_index), None):
            if i >= len(files) or failed.is_set():
                return
            try:
                results[i] = one(files[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised below, the first in URL order
                errors[i] = exc

    threads = min(max_concurrency, len(files))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for done in [pool.submit(drain) for _ in range(threads)]:
            done.result()
    real = {i: e for i, e in errors.items() if not isinstance(e, _NotStarted)}
    if real:
        raise real[min(real)]
    return results


class _NotStarted(Exception):
    """A footer read skipped because another one had already failed."""


def _shared_loop(files: Sequence[FileEntry], filesystems: FileSystems) -> asyncio.AbstractEventLoop | None:
    """The event loop of the async filesystem(s) serving every file, if there is exactly one."""
    loops = set()
    for entry in files:
        fs = filesystems.resolve(entry.url)[0]
        loop = getattr(fs, "loop", None) if is_async(fs) else None
        if loop is None:
            return None
        loops.add(loop)
    return loops.pop() if len(loops) == 1 else None


def _read_footers_async(
    loop: asyncio.AbstractEventLoop,
    files: Sequence[FileEntry],
    columns: list[str] | None,
    filesystems: FileSystems,
    policy: RetryPolicy,
    max_concurrency: int,
    progress: Callable[[int], None] | None,
) -> list[FileFooter]:
    """``_read_footers`` on an async filesystem's loop: ``max_concurrency`` requests in flight, no thread each.

    A thread per request costs a GIL hand-off and a cross-thread wake-up per footer (about half the
    client CPU of a cold catalog on S3); here one thread waits and the loop runs every request.
    """

    async def all_footers() -> list[Any]:
        slots = asyncio.Semaphore(max_concurrency)
        failed = asyncio.Event()

        async def one(entry: FileEntry) -> FileFooter:
            async with slots:
                if failed.is_set():
                    raise _NotStarted()
                try:
                    footer = await _read_footer_async(entry, columns, filesystems, policy)
                except BaseException:
                    failed.set()
                    raise
            if progress is not None:
                progress(1)
            return footer

        return await asyncio.gather(*(one(entry) for entry in files), return_exceptions=True)

    results = fsspec.asyn.sync(loop, all_footers)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, _NotStarted)]
    if errors:
        raise errors[0]
    return results


async def _read_footer_async(
    entry: FileEntry, columns: list[str] | None, filesystems: FileSystems, policy: RetryPolicy
) -> FileFooter:
    """``read_footer`` as a coroutine on the filesystem's loop (the footer is parsed there too: ~0.1 ms)."""
    url, size = entry.url, entry.size
    fs, path = filesystems.resolve(url)
    etag = if_match_etag(fs, entry.version)  # the footer of the object as listed, or none

    async def fetch(start: int, end: int) -> bytes:
        async def attempt(left: float) -> bytes:
            until = time.monotonic() + left
            read = fs._cat_file(path, start=start, end=end) if etag is None else \
                cat_file_if_match(fs, path, start, end, etag)
            try:
                data = await asyncio.wait_for(read, left)
            except ObjectChanged:
                raise _changed(url, size, entry.version) from None
            if len(data) != end - start:
                try:
                    fs.invalidate_cache(path)
                    info = await asyncio.wait_for(fs._info(path), max(until - time.monotonic(), MIN_ATTEMPT_SECONDS))
                    now: int | None = int(info["size"])
                except FileNotFoundError:
                    now = None
                except Exception:  # noqa: BLE001 - cannot tell whether it changed; let the retry policy decide
                    now = size
                raise short_read_error(url, size, now, len(data), end - start, CatalogError)
            return data

        try:
            return await call_within_async(attempt, policy, f"{url} footer bytes {start}-{end}", filesystems.redact)
        except CatalogError:
            raise
        except Exception as exc:  # noqa: BLE001 - permanent or exhausted: name the file and cause
            raise _footer_failure(url, exc, filesystems) from None

    try:
        tail = await fetch(*tail_range(size, None))
        more = missing_footer_range(tail, size)
        if more is not None:
            tail = await fetch(*more)
        metadata, footer_length, exact = parse_footer(tail, size)
    except FooterError as exc:
        raise CatalogError(f"{url}: {exc}") from exc
    footer = _footer_from_metadata(url, size, metadata, footer_length, columns, entry.version)
    SHARED_FOOTERS.put(url, size, entry.version, exact)  # this process's readers need not fetch it again
    return footer


def _changed(url: str, size: int, version: str) -> CatalogError:
    """The error for a footer read the store refused because the object is no longer the one listed."""
    return CatalogError(f"{url}: the file changed while it was cataloged (listed: {size} bytes, {version}; the "
                        f"store refused to read its footer at that ETag); build the catalog again")


def _footer_failure(url: str, exc: Exception, filesystems: FileSystems) -> CatalogError:
    """The ``CatalogError`` for a footer read that failed for good (permanently or out of retries)."""
    cause = exc.last if isinstance(exc, RetriesExhausted) else exc
    extra = f" ({exc.attempts} attempts)" if isinstance(exc, RetriesExhausted) else ""
    return CatalogError(filesystems.redact(f"{url}: reading the footer failed{extra}: {describe(cause)}"))


def read_footer(
    url: str,
    size: int,
    columns: list[str] | None,
    filesystems: FileSystems,
    retry: RetryPolicy | None = None,
    version: str = "",
) -> FileFooter:
    """Read one file's footer with one ranged request for its tail (two if the footer is huge); on S3, of the
    object at ``version`` (its listed ETag: ``CatalogError`` if it changed since)."""
    metadata, footer_length, exact = _fetch_metadata(url, size, filesystems, retry or RetryPolicy(), version)
    footer = _footer_from_metadata(url, size, metadata, footer_length, columns, version)
    SHARED_FOOTERS.put(url, size, version, exact)  # this process's readers need not fetch it again
    return footer


def _footer_from_metadata(
    url: str, size: int, metadata: pq.FileMetaData, footer_length: int, columns: list[str] | None, version: str
) -> FileFooter:
    """What the catalog keeps of a parsed footer: row counts, projected schema, chunk ranges, null hints."""
    try:
        schema = int96.arrow_schema(metadata)  # INT96 at microseconds: Spark's dates stay right
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad schemas
        raise CatalogError(f"{url}: cannot convert the Parquet schema to Arrow: {exc}") from exc
    if columns is not None:
        missing = [c for c in columns if schema.get_field_index(c) < 0]
        if missing:
            in_path = [c for c in missing if f"/{c}=" in url]  # a Hive key read with partitioning=None
            hint = (f"; {in_path} {'is a partition key' if len(in_path) == 1 else 'are partition keys'} in the "
                    "file's path: pass partitioning='hive' to read it as a column") if in_path else ""
            raise CatalogError(f"{url}: column(s) {missing} not found; the file has columns {schema.names}{hint}")
        schema = pa.schema([schema.field(c) for c in columns])
    schema = _interned(schema)
    rows = np.array(
        [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)], dtype=np.int64
    )
    leaves = column_leaves(metadata, schema.names)
    ranges = chunk_ranges(metadata, schema.names, leaves)
    _check_footer_numbers(url, size, footer_length, rows, ranges, schema.names)
    _check_levels_cover_rows(url, metadata, rows, leaves)
    return FileFooter(
        url, size, rows, schema, _columns_maybe_null(metadata, schema),
        footer_length=footer_length, ranges=ranges, version=version,
        values=leaf_values(metadata, schema.names, leaves),
    )


_SCHEMAS: dict[pa.Schema, pa.Schema] = {}  # the distinct schemas of recent footers, each kept once
_SCHEMAS_KEPT = 256


def _interned(schema: pa.Schema) -> pa.Schema:
    """``schema``, or an equal one (metadata included: it is in the hash) read before: a catalog of many
    files by one writer holds one schema object, not one per file (100,000 of them: ~200 MB)."""
    kept = _SCHEMAS.setdefault(schema, schema)
    if kept is schema and len(_SCHEMAS) > _SCHEMAS_KEPT:
        _SCHEMAS.clear()
    return kept


def _check_footer_numbers(url: str, size: int, footer_length: int, rows: np.ndarray, ranges: np.ndarray,
                          names: list[str]) -> None:
    """Refuse a footer whose numbers cannot describe this file (a damaged or hostile one) before anything
    is planned from them: a negative row count, or a column chunk outside the file's data."""
    negative = np.flatnonzero(rows < 0)
    if negative.size:
        rg = int(negative[0])
        raise CatalogError(f"{url}: row group {rg} claims {int(rows[rg])} rows; the footer is damaged")
    data_end = size - footer_length - 8  # the footer, its length and the magic bytes follow the data
    outside = (ranges[..., 0] < 0) | (ranges[..., 1] < ranges[..., 0]) | (ranges[..., 1] > data_end)
    if outside.any():
        rg, column = (int(i) for i in np.argwhere(outside)[0])
        start, end = (int(v) for v in ranges[rg, column])
        raise CatalogError(f"{url}: row group {rg}, column {names[column]!r}: its chunk claims bytes [{start}, {end}) "
                           f"but the file's data ends at byte {data_end}; the footer is damaged")


def _check_levels_cover_rows(url: str, metadata: pq.FileMetaData, rows: np.ndarray, leaves: list[list[int]]
                             ) -> None:
    """Refuse a row group that claims more rows than a projected column chunk has values: every row
    has at least one (definition level) value in every leaf, a null and an empty list too. A row
    count is believed only with its chunks' counts behind it, so no plan sizes its arrays by a bare
    claim (a 13 KB file claiming 2**31-1 rows had the planner allocate gigabytes, where pyarrow reads
    the chunks' 200 rows)."""
    for rg in np.flatnonzero(rows > 0).tolist():
        group = metadata.row_group(rg)
        for leaf in (i for indices in leaves for i in indices):
            values = group.column(leaf).num_values
            if values < rows[rg]:
                raise CatalogError(f"{url}: row group {rg} claims {int(rows[rg])} rows but its column chunk "
                                   f"{group.column(leaf).path_in_schema!r} holds {values} values; the footer is "
                                   "damaged")


def _fetch_metadata(url: str, size: int, filesystems: FileSystems, policy: RetryPolicy,
                    version: str = "") -> ParsedFooter:
    fs, path = filesystems.resolve(url)
    etag = if_match_etag(fs, version)  # the footer of the object as listed, or none

    def fetch(start: int, end: int) -> bytes:
        def attempt(left: float) -> bytes:
            until = time.monotonic() + left
            if etag is None:
                data = fs.cat_file(path, start=start, end=end, **timeout_kw(fs, left))
            else:
                data = cat_ranges_if_match(fs, path, [start], [end], etag, left)[0]
                if isinstance(data, ObjectChanged):
                    raise _changed(url, size, version)
                if isinstance(data, BaseException):
                    raise data
            if len(data) != end - start:
                check_short_read(fs, path, url, size, len(data), end - start, CatalogError, until - time.monotonic())
            return data

        try:
            return call_within(attempt, policy, f"{url} footer bytes {start}-{end}", filesystems.redact)
        except CatalogError:
            raise
        except Exception as exc:  # noqa: BLE001 - permanent or exhausted: name the file and cause
            raise _footer_failure(url, exc, filesystems) from None

    try:
        start, end = tail_range(size, None)
        return parse_footer(fetch(start, end), size, fetch)
    except FooterError as exc:
        raise CatalogError(f"{url}: {exc}") from exc


def _columns_maybe_null(metadata: pq.FileMetaData, schema: pa.Schema) -> frozenset[str]:
    """Projected columns for which some row group's statistics do not rule out nulls."""
    wanted = {f.name for f in schema if f.nullable}
    if not wanted or metadata.num_row_groups == 0:
        return frozenset()
    leaves: dict[str, list[int]] = {}
    for i in range(metadata.num_columns):
        top = metadata.schema.column(i).path.split(".")[0]
        if top in wanted:
            leaves.setdefault(top, []).append(i)
    maybe: set[str] = set()
    for name, indices in leaves.items():
        for rg in range(metadata.num_row_groups):
            group = metadata.row_group(rg)
            if group.num_rows == 0:
                continue
            if any(_may_have_nulls(group.column(i).statistics) for i in indices):
                maybe.add(name)
                break
    return frozenset(maybe)


def _may_have_nulls(stats: pq.Statistics | None) -> bool:
    return stats is None or not stats.has_null_count or stats.null_count > 0
