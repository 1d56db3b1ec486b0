"""Reliability benchmark: replays the integrity faults of issue 11 against the code as it is, and
reports, for each case, what should happen, what did happen, and whether the two agree.

Every observation comes from running the case: local files are rewritten, truncated and corrupted
for real; object storage is moto's S3 server (and SeaweedFS for the fault epochs) on 127.0.0.1,
started and stopped here, behind ``streamshard.testing.FaultyProxy`` where faults or stalls are
injected. Prints a Markdown table (case | expected | observed | pass | seconds), writes JSON, and
exits 1 if any case fails.

    .venv/bin/python benchmarks/reliability.py            # every case (the hung read waits the default 60 s)
    .venv/bin/python benchmarks/reliability.py --quick    # a subset: small corpora, 10% faults on moto
    .venv/bin/python benchmarks/reliability.py --server moto   # fault epochs against moto instead of SeaweedFS

Not replayed: issue 11 item 4 (one huge row group's memory), which has its own benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import re
import resource
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamshard as ss  # noqa: E402
from streamshard.cache import ActivationCache  # noqa: E402
from streamshard.errors import StreamshardError  # noqa: E402
from streamshard.io.reader import RowGroupReader  # noqa: E402
from streamshard.io.retry import RetryPolicy  # noqa: E402
from streamshard.testing import FaultConfig, FaultyProxy, LocalS3, faulty_proxy, local_s3, local_seaweedfs  # noqa: E402
from streamshard.testing import write_corpus, write_fixed  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
TOKEN = "SeSsIoN-t0ken-rb-7c41d09e"  # moto accepts any session token; it must reach no log line
SHORT_DEADLINE = 2.0  # the retry deadline configured for the short hung-endpoint cases
DRAINED = 90.0  # a stalled request holds its connection this long: longer than any deadline here


# -- results ---------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """One row of the table, plus the numbers behind its observation (``details``, in the JSON only)."""

    case: str
    expected: str
    observed: str
    passed: bool
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


CaseResult = tuple[str, bool, dict[str, Any]]  # what a case returns: (observed, passed, details)


@dataclass
class Case:
    """A fault to replay: its name, what must happen, and the function that makes it happen and looks."""

    name: str
    expected: str
    run: Callable[[Bench], CaseResult]
    quick: bool = True  # part of --quick


# -- shared set-up ---------------------------------------------------------------------------------

class LogTail:
    """Every record of the ``streamshard`` logger, from this process and its forked DataLoader workers.

    A file handler opened before the workers fork is inherited by them, so their retry warnings land
    in the same file (appends of short lines). ``mark()``/``since(mark)`` cut out one case's lines.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handler = logging.FileHandler(path, mode="a", encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(message)s"))
        logging.getLogger("streamshard").addHandler(self.handler)

    def mark(self) -> int:
        self.handler.flush()
        return self.path.stat().st_size

    def since(self, mark: int) -> list[str]:
        self.handler.flush()
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(mark)
            return f.read().splitlines()

    def close(self) -> None:
        logging.getLogger("streamshard").removeHandler(self.handler)
        self.handler.close()


@dataclass
class Bench:
    """What the cases share: a scratch directory, the moto server, the log tail, the options."""

    root: Path
    s3: LocalS3
    log: LogTail
    quick: bool
    server: str
    _counter: Iterator[int] = field(default_factory=itertools.count)

    def scratch(self, name: str) -> Path:
        path = self.root / f"{next(self._counter):02d}-{name}"
        path.mkdir(parents=True)
        return path

    def bucket(self, name: str) -> str:
        return f"rb-{next(self._counter):02d}-{name}"

    def describe(self, exc: BaseException | None, limit: int = 200) -> str:
        """``first_line(exc)`` with this run's scratch directory written ``$TMP`` (the table stays readable)."""
        if exc is None:
            return "no error"
        text = first_line(exc).replace(f"file://{self.root}", "$TMP").replace(str(self.root), "$TMP")
        return text if len(text) <= limit else text[:limit] + "..."


def via(store: LocalS3, endpoint: str, **config: Any) -> dict[str, Any]:
    """``store``'s s3fs options with requests sent to ``endpoint`` (a proxy), botocore ``config`` merged in."""
    options = dict(store.storage_options)
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": endpoint}
    if config:
        options["config_kwargs"] = config
    return options


def ids_of(batches: list[dict[str, torch.Tensor]]) -> np.ndarray:
    return np.concatenate([b["sample_id"].numpy() for b in batches]) if batches else np.zeros(0, np.int64)


def mislabeled(batches: list[dict[str, torch.Tensor]]) -> int:
    """Real rows whose data (``id`` = the row's global index, as written) disagrees with their ``sample_id``."""
    wrong = 0
    for b in batches:
        real = b["sample_id"] >= 0
        wrong += int((b["id"][real] != b["sample_id"][real]).sum())
    return wrong


def coverage(ids: np.ndarray, total: int) -> tuple[int, int, int]:
    """(distinct real ids delivered, ids delivered more than once, ids of range(total) never delivered)."""
    real = ids[ids >= 0]
    unique, counts = np.unique(real, return_counts=True)
    return len(unique), int((counts > 1).sum()), int(total - np.isin(np.arange(total), unique).sum())


def first_line(exc: BaseException) -> str:
    """The error's type and the line of its message that carries the cause (DataLoader wraps worker errors)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    own = [ln for ln in lines if not ln.startswith(("Caught ", "Original Traceback", "File ", "Traceback"))]
    text = (own[-1] if own else (lines[0] if lines else ""))
    text = re.sub(rf"^([\w.]+\.)?{type(exc).__name__}: ", "", text)
    return f"{type(exc).__name__}: {text}"


def raised(fn: Callable[[], Any]) -> tuple[BaseException | None, Any]:
    """``(error, None)`` if ``fn()`` raised a streamshard error, else ``(None, result)``."""
    try:
        return None, fn()
    except StreamshardError as exc:
        return exc, None


def settle(err: BaseException | None) -> float:
    """Free what an error raised through DataLoader workers keeps alive (its traceback holds the iterator) and
    collect it now, returning the seconds that took: torch's worker shutdown then happens in the case that
    caused it, not in a later case or in a forked child that inherited the garbage."""
    started = time.perf_counter()
    if err is not None:
        err.__traceback__ = None
    gc.collect()
    return time.perf_counter() - started


# -- 1. one catalog per epoch ----------------------------------------------------------------------

def case_worker_without_catalog(bench: Bench) -> CaseResult:
    """Issue 22: a plain DataLoader whose parent never read the catalog (no set_epoch) must deliver every
    row once, its workers on one snapshot (the first builds and publishes it, the others load it)."""
    root = bench.scratch("no-parent-catalog")
    write_corpus(str(root), [[300, 300], [400]])
    ds = ss.ParquetStream(str(root), batch_size=64, rank=0, world_size=1)  # catalog never read here
    delivered: list[dict[str, torch.Tensor]] = []

    def iterate() -> None:
        delivered.extend(DataLoader(ds, batch_size=None, num_workers=2))

    err, _ = raised(iterate)
    ids = np.sort(np.concatenate([b["sample_id"].numpy() for b in delivered])) if delivered else np.zeros(0)
    real = ids[ids >= 0]
    ok = err is None and np.array_equal(real, np.arange(1000))
    observed = f"{bench.describe(err, 160) if err else 'no error'}; {len(real)} of 1000 rows, {len(np.unique(real))} distinct"
    return observed, ok, {"error": str(err) if err else None, "rows": int(len(real))}


def case_file_added_during_listing(bench: Bench) -> CaseResult:
    """The issue's race: nothing reads the catalog before iterating, and a file lands while StreamLoader builds
    it (after the listing, at the first footer read), before its workers start. The new file sorts first, so
    any worker that listed on its own would shift every id."""
    root = bench.scratch("file-lands")
    layout = [[2000, 2000], [3000], [1500, 1500]]
    write_corpus(str(root), layout)
    ds = ss.ParquetStream(str(root), batch_size=256, shuffle=True, seed=5, rank=0, world_size=1)
    landed: list[Path] = []

    def land(_: int) -> None:
        if not landed:
            landed.append(root / "part-00000-early.parquet")
            write_fixed(landed[0], 1_000_000, (4000,))  # sorts before part-00000.parquet

    ds.catalog_progress = land
    batches = list(ss.StreamLoader(ds, num_workers=2))
    total = sum(map(sum, layout))
    distinct, twice, never = coverage(ids_of(batches), total)
    wrong, extra = mislabeled(batches), int((ids_of(batches) >= total).sum())
    observed = (f"file landed: {bool(landed)}; snapshot {ds.catalog.num_files} files; {distinct:,} of {total:,} rows "
                f"once, {twice} twice, {never} never, {wrong} mislabeled, {extra} ids beyond the snapshot")
    ok = bool(landed) and (distinct, twice, never, wrong, extra) == (total, 0, 0, 0, 0)
    return observed, ok, {"rows": total}


def case_ranks_listing_apart(bench: Bench) -> CaseResult:
    """Explicit rank/world_size: each rank lists alone; what differs must be caught at the checkpoint."""
    root = bench.scratch("ranks-apart")
    write_corpus(str(root), [[500], [500]])
    rank0 = ss.StreamLoader(ss.ParquetStream(str(root), batch_size=100, rank=0, world_size=2), num_workers=0)
    next(iter(rank0))
    state = rank0.state_dict()
    write_corpus(str(root / "late"), [[300]])
    os.replace(root / "late" / "part-00000.parquet", root / "part-00002.parquet")
    (root / "late").rmdir()
    rank1 = ss.StreamLoader(ss.ParquetStream(str(root), batch_size=100, rank=1, world_size=2), num_workers=0)
    err, _ = raised(lambda: rank1.load_state_dict(state))
    ok = isinstance(err, ss.StateError) and "catalog" in str(err)
    return (bench.describe(err, 160) if err else "state accepted by a rank holding other files"), ok, {}


# -- 2. files are read at the cataloged version ----------------------------------------------------

def _read_until_error(ds: ss.ParquetStream) -> tuple[BaseException | None, list[dict[str, torch.Tensor]]]:
    batches: list[dict[str, torch.Tensor]] = []

    def iterate() -> None:
        for batch in ds:
            batches.append(batch)

    err, _ = raised(iterate)
    return err, batches


def _changed_verdict(bench: Bench, err: BaseException | None, batches: list, name: str) -> CaseResult:
    wrong = mislabeled(batches)
    ok = isinstance(err, ss.ReadError) and name in str(err) and "changed since it was cataloged" in str(err)
    observed = bench.describe(err, 150) + f"; {wrong} rows mislabeled before it"
    return observed, ok and wrong == 0, {"error": str(err) if err else None}


def case_local_file_replaced(bench: Bench) -> CaseResult:
    root = bench.scratch("replaced-local")
    write_fixed(root / "a.parquet", 0)
    write_fixed(root / "b.parquet", 100)
    ds = ss.ParquetStream(str(root), batch_size=50, rank=0, world_size=1)
    ds.set_epoch(0)
    before = os.stat(root / "b.parquet")
    write_fixed(root / "b.new", 10_000)
    os.replace(root / "b.new", root / "b.parquet")
    os.utime(root / "b.parquet", (before.st_atime + 5, before.st_mtime + 5))
    if os.path.getsize(root / "b.parquet") != before.st_size:
        return "the rewrite changed the size: case not set up", False, {}
    return _changed_verdict(bench, *_read_until_error(ds), "b.parquet")


def case_s3_object_replaced(bench: Bench) -> CaseResult:
    root = bench.scratch("replaced-s3")
    for i in range(3):
        write_fixed(root / f"part-{i}.parquet", 100 * i)
    url = bench.s3.upload(str(root), bench.bucket("replaced"), "c")
    ds = ss.ParquetStream(url, batch_size=50, rank=0, world_size=1, storage_options=bench.s3.storage_options)
    ds.set_epoch(0)
    write_fixed(root / "part-1.parquet", 10_000)
    bench.s3.filesystem().put_file(str(root / "part-1.parquet"), f"{url[5:]}/part-1.parquet")
    size = bench.s3.filesystem().size(f"{url[5:]}/part-1.parquet")
    if size != ds.catalog.file_sizes[1]:
        return "the rewrite changed the size: case not set up", False, {}
    return _changed_verdict(bench, *_read_until_error(ds), "part-1.parquet")


# -- 3. a damaged catalog cache is ignored and rebuilt ---------------------------------------------

def _entry(doc: dict[str, Any]) -> dict[str, Any]:
    return next(iter(doc["files"].values()))


def _edit(change: Callable[[dict[str, Any], dict[str, Any]], None]) -> Callable[[str], str]:
    def corrupt(text: str) -> str:
        doc = json.loads(text)
        change(doc, _entry(doc))
        return json.dumps(doc)
    return corrupt


CACHE_DAMAGE: dict[str, Callable[[str], str]] = {
    "bad JSON": lambda text: "{not json" + text[9:],
    "truncated": lambda text: text[: len(text) // 2],
    "a row count of the wrong type": _edit(lambda doc, e: e["rows"].__setitem__(0, str(e["rows"][0]))),
    "a negative row count": _edit(lambda doc, e: e["rows"].__setitem__(1, -5)),
    "a missing key": _edit(lambda doc, e: e.pop("ranges")),
}


def cache_case(damage: str) -> Callable[[Bench], CaseResult]:
    def run(bench: Bench) -> CaseResult:
        root = bench.scratch("catalog-cache")
        data, cache = root / "data", root / "cache"
        write_corpus(str(data), [[40, 40], [30], [25, 25, 25], [50]])
        fresh = ss.ParquetStream(str(data), batch_size=32, rank=0, world_size=1).catalog
        cached = ss.ParquetStream(str(data), batch_size=32, rank=0, world_size=1, catalog_cache=str(cache)).catalog
        assert cached.digest == fresh.digest  # the cache file now exists and is whole
        (path,) = cache.iterdir()
        path.write_text(CACHE_DAMAGE[damage](path.read_text(encoding="utf-8")), encoding="utf-8")
        mark = bench.log.mark()
        ds = ss.ParquetStream(str(data), batch_size=32, rank=0, world_size=1, catalog_cache=str(cache))
        err, batches = _read_until_error(ds)
        warned = [ln for ln in bench.log.since(mark) if "catalog cache" in ln and str(path) in ln]
        if err is not None:
            return bench.describe(err), False, {}
        same = ds.catalog.digest == fresh.digest and (ds.catalog.rg_rows == fresh.rg_rows).all()
        distinct, twice, never = coverage(ids_of(batches), fresh.num_rows)
        wrong = mislabeled(batches)
        observed = (f"{'warned' if warned else 'no warning'}; catalog {'=' if same else '!='} fresh; "
                    f"{distinct}/{fresh.num_rows} ids once, {twice} twice, {wrong} mislabeled")
        ok = bool(warned) and same and (distinct, twice, never, wrong) == (fresh.num_rows, 0, 0, 0)
        return observed, ok, {"warning": warned[0] if warned else None}
    return run


# -- 5. elastic resize with uneven="drop" ----------------------------------------------------------

DROP_LAYOUT = [[1700, 900], [2300], [120] * 9, [3100, 400], [60], [1500, 1500, 800], [2900], [700, 650]]
DROP_TOPOLOGIES = [(4, 2, 3), (2, 2, 4), (3, 1, None)]  # (ranks, workers, batches each rank takes; None: the rest)


def case_elastic_drop(bench: Bench) -> CaseResult:
    """Two resizes in one epoch; only the final topology's equal steps may drop rows, and it says how many."""
    root = bench.scratch("elastic-drop")
    write_corpus(str(root), DROP_LAYOUT)

    def make(rank: int, world: int) -> ss.ParquetStream:
        return ss.ParquetStream(str(root), batch_size=64, shuffle=True, seed=11, uneven="drop", rank=rank,
                                world_size=world)

    total = make(0, 1).catalog.num_rows
    state, delivered, final_steps = None, [], []
    mark = bench.log.mark()
    for world, workers, take in DROP_TOPOLOGIES:
        saved = None
        for rank in range(world):
            loader = ss.StreamLoader(make(rank, world), num_workers=workers)
            if state is not None:
                loader.load_state_dict(state)
            batches = list(itertools.islice(loader, take))
            delivered.append(ids_of(batches))
            if take is None:
                final_steps.append(len(batches))
            saved = loader.state_dict()  # the same on every rank of a synchronous job
        state = saved
    reports = [int(m.group(1)) for ln in bench.log.since(mark)
               if (m := re.search(r"uneven='drop' leaves out (\d+) of", ln))]
    reported = reports[-1] if reports else None
    distinct, twice, never = coverage(np.concatenate(delivered), total)
    world, workers, _ = DROP_TOPOLOGIES[-1]
    equal = len(set(final_steps)) == 1
    observed = (f"{distinct:,}/{total:,} once, {twice} twice, {never} not delivered; final topology reported "
                f"{reported if reported is not None else 'nothing'} dropped; final steps per rank {final_steps}")
    ok = twice == 0 and reported is not None and never == reported and equal
    details = {"rows": total, "not_delivered": never, "reported_dropped": reported, "reports": reports,
               "topologies": DROP_TOPOLOGIES, "final_steps": final_steps}
    return observed, ok, details


# -- 6. literal paths ------------------------------------------------------------------------------

def case_literal_path(bench: Bench) -> CaseResult:
    root = bench.scratch("literal")
    write_fixed(root / "brack[1].parquet", 0, (30,))
    write_fixed(root / "brack1.parquet", 100, (70,))  # what the name matches as a glob
    local = ss.ParquetStream(str(root / "brack[1].parquet"), rank=0, world_size=1).catalog
    url = bench.s3.upload(str(root), bench.bucket("literal"), "p")
    remote = ss.ParquetStream(f"{url}/brack[1].parquet", rank=0, world_size=1,
                              storage_options=bench.s3.storage_options).catalog
    globbed = ss.ParquetStream(str(root / "brack*.parquet"), rank=0, world_size=1).catalog
    names = [os.path.basename(u) for u in local.urls + remote.urls]
    observed = (f"local {names[:local.num_files]} {local.num_rows} rows; s3 {names[local.num_files:]} "
                f"{remote.num_rows} rows; brack*.parquet -> {globbed.num_files} files")
    ok = names == ["brack[1].parquet"] * 2 and local.num_rows == remote.num_rows == 30 and globbed.num_files == 2
    return observed, ok, {}


# -- 7. errors name their place --------------------------------------------------------------------

def _write_uint64(path: Path, groups: list[list[int]]) -> None:
    with pq.ParquetWriter(str(path), pa.schema([("v", pa.uint64())])) as writer:
        for values in groups:
            writer.write_table(pa.table({"v": pa.array(values, pa.uint64())}))


def conversion_case(num_workers: int) -> Callable[[Bench], CaseResult]:
    """A uint64 value past int64 in row group 1 of b.parquet, converted in the main process or in workers."""
    return lambda bench: _conversion_error(bench, num_workers)


def _conversion_error(bench: Bench, num_workers: int) -> CaseResult:
    root = bench.scratch("uint64")
    _write_uint64(root / "a.parquet", [list(range(20)), list(range(20))])
    _write_uint64(root / "b.parquet", [list(range(20)), [1] * 19 + [2**63]])  # row group 1 cannot be int64
    _write_uint64(root / "c.parquet", [list(range(20))])
    ds = ss.ParquetStream(str(root), batch_size=16, rank=0, world_size=1)
    err, _ = raised(lambda: list(ss.StreamLoader(ds, num_workers=num_workers)))
    text = str(err) if err else ""
    ok = isinstance(err, ss.ConversionError) and bool(re.search(r"column 'v'.*b\.parquet row group 1", text, re.DOTALL))
    return bench.describe(err, 170), ok, {"error": text[-400:], "loader_cleanup_seconds": settle(err)}


def case_missing_bucket(bench: Bench) -> CaseResult:
    url = "s3://rb-no-such-bucket/data/"
    err, _ = raised(lambda: ss.Catalog.build(url, storage_options=bench.s3.storage_options))
    text = str(err) if err else ""
    ok = isinstance(err, ss.CatalogError) and bool(re.search(r"NoSuchBucket|bucket does not exist", text))
    return bench.describe(err, 160), ok, {}


def case_truncated_after_catalog(bench: Bench) -> CaseResult:
    root = bench.scratch("truncated")
    write_fixed(root / "t.parquet", 0, (50, 50, 50))
    ds = ss.ParquetStream(str(root / "t.parquet"), batch_size=50, rank=0, world_size=1)
    ds.set_epoch(0)
    data = (root / "t.parquet").read_bytes()
    (root / "t.parquet").write_bytes(data[: len(data) // 2])
    err, batches = _read_until_error(ds)
    ok = isinstance(err, ss.ReadError) and bool(re.search(r"t\.parquet: reading row group \d", str(err)))
    return bench.describe(err, 160) + f"; {len(batches)} batches before it", ok, {}


def case_corrupt_page(bench: Bench) -> CaseResult:
    """A data page header of row group 1 overwritten with garbage (footer intact, so the catalog reads fine)."""
    root = bench.scratch("corrupt-page")
    write_fixed(root / "c.parquet", 0)
    chunk = pq.read_metadata(root / "c.parquet").row_group(1).column(0)
    raw = bytearray((root / "c.parquet").read_bytes())
    raw[chunk.data_page_offset: chunk.data_page_offset + 24] = b"\xff" * 24
    (root / "c.parquet").write_bytes(bytes(raw))
    err, batches = _read_until_error(ss.ParquetStream(str(root / "c.parquet"), batch_size=50, rank=0, world_size=1))
    ok = isinstance(err, ss.ReadError) and "c.parquet: reading row group 1 failed" in str(err)
    return bench.describe(err, 160) + f"; {len(batches)} batches before it", ok, {}


META_DAMAGE: dict[str, Callable[[dict[str, Any]], Any]] = {
    "bad JSON": lambda meta: "{garbage",
    "huge shape": lambda meta: {**meta, "shape": [10**12, 10**6]},
    "negative shape": lambda meta: {**meta, "shape": [-4]},
    "shape not a list": lambda meta: {**meta, "shape": "16"},
    "unknown dtype": lambda meta: {**meta, "dtype": "float99"},
}


def meta_case(damage: str) -> Callable[[Bench], CaseResult]:
    """A tampered activation-cache ``meta.json``: the entries are discarded with a warning, the cache serves."""
    def run(bench: Bench) -> CaseResult:
        root = bench.scratch("activation-meta")
        ids = torch.arange(10)
        rows = torch.arange(160, dtype=torch.float32).reshape(10, 16)
        with ActivationCache(root, key="k", host_bytes=0) as cache:
            cache.put(ids, rows)
        meta = json.loads((root / "meta.json").read_text())
        tampered = META_DAMAGE[damage](meta)
        (root / "meta.json").write_text(tampered if isinstance(tampered, str) else json.dumps(tampered))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                cache = ActivationCache(root, key="k", host_bytes=0)
                _, hit = cache.get(ids)
                cache.put(ids[:4], rows[:4] + 1)  # the cache must still take the real records
                again, hit_again = cache.get(ids[:4])
                cache.close()
            except Exception as exc:  # noqa: BLE001 - any exception here is the observation
                return f"{type(exc).__name__}: {str(exc)[:120]}", False, {}
        notes = [str(w.message) for w in caught]
        discarded = any("discarding cache entries" in n for n in notes)
        served = bool(hit_again.all()) and torch.equal(again, rows[:4] + 1)
        observed = (f"{'warned and discarded' if discarded else 'no discard warning'}; {int(hit.sum())} stale hits; "
                    f"new records {'served' if served else 'NOT served'}")
        return observed, discarded and not hit.any() and served, {"warnings": notes}
    return run


def _disk_full_child(directory: str, limit: int, result: Any) -> None:
    """In a child process: write records, then commit the index under a file-size limit the write exceeds."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = ActivationCache(directory, key="k", host_bytes=0)
        cache.put(torch.arange(1000), torch.ones(1000, 16))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        cache.close()  # commits index.npy through index.npy.tmp: refused by the kernel past `limit` bytes
    result.put([str(w.message) for w in caught])


def case_disk_full(bench: Bench) -> CaseResult:
    """A write the kernel refuses for room (RLIMIT_FSIZE -> EFBIG, no root needed; ENOSPC needs a full fs)."""
    root = bench.scratch("disk-full")
    ctx = multiprocessing.get_context("fork")  # the child touches no storage client: forking is safe and fast
    queue = ctx.Queue()
    child = ctx.Process(target=_disk_full_child, args=(str(root), 64, queue))
    child.start()
    notes = queue.get(timeout=120)
    child.join(30)
    left = sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp"))
    with ActivationCache(root, key="k", host_bytes=0) as cache:
        _, hit = cache.get(torch.arange(1000))
    warned = any("could not commit" in n or "disk full" in n for n in notes)
    observed = (f"{'warned' if warned else 'no warning'}; temp files left: {left or 'none'}; "
                f"{int(hit.sum())}/1000 records readable after reopening")
    return observed, warned and not left and bool(hit.all()), {"warnings": notes, "left": left}


# -- 8. secrets ------------------------------------------------------------------------------------

class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        self.lines.append((record.name, text + (record.exc_text or "")))


def case_secrets(bench: Bench) -> CaseResult:
    root = bench.scratch("secrets")
    write_corpus(str(root), [[20, 20], [30]])
    url = bench.s3.upload(str(root), bench.bucket("token"), "c")
    options = {**bench.s3.storage_options, "token": TOKEN}
    collect, botocore, rootlog = _Collect(), logging.getLogger("botocore"), logging.getLogger()
    level = botocore.level
    rootlog.addHandler(collect)
    botocore.setLevel(logging.DEBUG)
    try:
        batches = list(ss.ParquetStream(url, batch_size=16, rank=0, world_size=1, storage_options=options))
    finally:
        botocore.setLevel(level)
        rootlog.removeHandler(collect)
    rows = int((ids_of(batches) >= 0).sum())
    leaked = sum(TOKEN in text for _, text in collect.lines)
    boto = [text for name, text in collect.lines if name.startswith("botocore")]
    redacted = sum("***" in text for text in boto)
    observed = (f"{len(collect.lines):,} log lines ({len(boto):,} botocore, {redacted} with ***); "
                f"{leaked} contain the token; {rows} rows read")
    return observed, leaked == 0 and redacted > 0 and rows == 70, {"leaked": leaked, "lines": len(collect.lines)}


# -- 9. deadlines ----------------------------------------------------------------------------------

def _hung(store: LocalS3) -> FaultyProxy:
    """A proxy in front of ``store`` that can hold every request without an answer (``stall``)."""
    return FaultyProxy(store.endpoint_url, FaultConfig(stall_seconds=DRAINED, fault_methods=("GET", "HEAD")))


def _hang(proxy: FaultyProxy) -> None:
    proxy.config.faults, proxy.config.fault_rate = ("stall",), 1.0


def _deadline_verdict(bench: Bench, err: BaseException | None, elapsed: float, deadline: float,
                      pattern: str) -> CaseResult:
    bound = deadline * 1.1 + 2.0  # what "within the deadline" allows for scheduling on a shared 2-core machine
    ok = err is not None and bool(re.search(pattern, str(err))) and elapsed <= bound
    observed = f"{bench.describe(err, 130)}; after {elapsed:.1f} s (deadline {deadline:g} s)"
    return observed, ok, {"elapsed": round(elapsed, 2), "deadline": deadline, "bound": bound}


def case_hung_listing(bench: Bench) -> CaseResult:
    root = bench.scratch("hung-listing")
    write_corpus(str(root), [[20, 20]])
    url = bench.s3.upload(str(root), bench.bucket("hung"), "c")
    proxy = _hung(bench.s3)
    try:
        _hang(proxy)
        started = time.monotonic()
        err, _ = raised(lambda: ss.Catalog.build(url, storage_options=via(bench.s3, proxy.endpoint_url),
                                                 retry=RetryPolicy(deadline=SHORT_DEADLINE)))
        elapsed = time.monotonic() - started
    finally:
        proxy.stop()
    return _deadline_verdict(bench, err, elapsed, SHORT_DEADLINE, r"listing .* failed")


def hung_read_case(default_deadline: bool) -> Callable[[Bench], CaseResult]:
    """The catalog is read while the endpoint answers; then it stops answering and a row group is read."""
    def run(bench: Bench) -> CaseResult:
        root = bench.scratch("hung-read")
        write_corpus(str(root), [[20, 20]])
        url = bench.s3.upload(str(root), bench.bucket("hung"), "c")
        proxy = _hung(bench.s3)
        try:
            options = via(bench.s3, proxy.endpoint_url)
            if default_deadline:  # the public path: ParquetStream with the default RetryPolicy (60 s)
                ds = ss.ParquetStream(url, batch_size=16, rank=0, world_size=1, storage_options=options)
                ds.set_epoch(0)
                _hang(proxy)
                started = time.monotonic()
                err, _ = raised(lambda: list(ds))
                deadline = RetryPolicy().deadline
            else:
                catalog = ss.Catalog.build(url, storage_options=options)
                _hang(proxy)
                policy = RetryPolicy(deadline=SHORT_DEADLINE)
                started = time.monotonic()
                err, _ = raised(lambda: RowGroupReader.from_catalog(catalog, options, retry=policy).read(0, 1))
                deadline = policy.deadline
            elapsed = time.monotonic() - started
        finally:
            proxy.stop()
        return _deadline_verdict(bench, err, elapsed, deadline, r"part-00000\.parquet.*row group \d")
    return run


# -- injected S3 faults: an epoch identical to a fault-free one ------------------------------------

FAULT_LAYOUT = [[600] * 6] * 32  # 32 files x 6 row groups x 600 rows: ~300 requests an epoch
FAULT_LAYOUT_QUICK = [[1000] * 4] * 4
FAULT_REPEATS, FAULT_REPEATS_QUICK = 3, 1  # epochs of each kind (after one warm-up); times are medians
FAULT_KINDS = ("reset", "truncate", "stall")
STALL_SECONDS = 2.0  # a stalled request is answered by nothing for this long, then reset
READ_TIMEOUT = 1.0  # botocore's read timeout here: a stall is noticed after this


def _fault_epoch(url: str, options: dict[str, Any], log: LogTail) -> dict[str, Any]:
    """One epoch through StreamLoader (2 worker processes); its digest, ids, time and logged retries."""
    mark = log.mark()
    started = time.perf_counter()
    ds = ss.ParquetStream(url, columns=["id", "input_ids"], batch_size=256, shuffle=True, seed=3, rank=0,
                          world_size=1, storage_options=options, read_ahead=3)
    digest, ids = hashlib.sha256(), []
    for batch in ss.StreamLoader(ds, num_workers=2):
        for key in sorted(batch):
            digest.update(key.encode())
            digest.update(batch[key].numpy().tobytes())
        ids.append(batch["sample_id"].numpy().copy())
    seconds = time.perf_counter() - started
    retries = sum("retrying" in ln for ln in log.since(mark))
    return {"digest": digest.hexdigest(), "ids": np.concatenate(ids), "seconds": seconds, "retries": retries,
            "rows": ds.catalog.num_rows}


def _epochs(url: str, options: dict[str, Any], log: LogTail, proxy: FaultyProxy, repeats: int) -> dict[str, Any]:
    """``repeats`` epochs through ``proxy`` as it is configured: every one's result, and the proxy's counts."""
    proxy.reset_counts()
    runs = [_fault_epoch(url, options, log) for _ in range(repeats)]
    return {"runs": runs, "requests": proxy.count(), "injected": dict(proxy.faults_injected),
            "seconds": float(np.median([r["seconds"] for r in runs])), "retries": sum(r["retries"] for r in runs)}


@contextlib.contextmanager
def fault_store(bench: Bench) -> Iterator[LocalS3]:
    """The store the fault epochs read: SeaweedFS (real ranged GETs) unless --server moto."""
    if bench.server == "moto":
        yield bench.s3
    else:
        with local_seaweedfs() as store:
            yield store


def fault_case(rate: float) -> Callable[[Bench], CaseResult]:
    """Fault-free epochs, then epochs with ``rate`` of GETs/HEADs reset, truncated or stalled: all identical."""
    def run(bench: Bench) -> CaseResult:
        root = bench.scratch(f"faults-{int(rate * 100)}")
        write_corpus(str(root), FAULT_LAYOUT_QUICK if bench.quick else FAULT_LAYOUT, tokens="random")
        repeats = FAULT_REPEATS_QUICK if bench.quick else FAULT_REPEATS
        with fault_store(bench) as store:
            url = store.upload(str(root), bench.bucket("faults"), "c")
            config = {"read_timeout": READ_TIMEOUT, "connect_timeout": READ_TIMEOUT}
            faults = FaultConfig(seed=7, faults=FAULT_KINDS, fault_methods=("GET", "HEAD"), stall_seconds=STALL_SECONDS)
            with faulty_proxy(store.endpoint_url, faults) as proxy:  # both kinds of epoch take the same path
                options = via(store, proxy.endpoint_url, **config)
                _fault_epoch(url, options, bench.log)  # warm-up: one-time costs out of the clean time
                clean = _epochs(url, options, bench.log, proxy, repeats)
                proxy.config.fault_rate = rate
                faulty = _epochs(url, options, bench.log, proxy, repeats)
        reference = clean["runs"][0]
        same = sum(r["digest"] == reference["digest"] and np.array_equal(r["ids"], reference["ids"])
                   for r in clean["runs"][1:] + faulty["runs"])
        covered = [coverage(r["ids"], r["rows"]) for r in faulty["runs"]]
        exact = all((twice, never) == (0, 0) for _, twice, never in covered)
        injected, requests = faulty["injected"], faulty["requests"]
        slowdown = faulty["seconds"] / clean["seconds"]
        kinds = ", ".join(f"{injected.get(k, 0)} {k}" for k in FAULT_KINDS)
        observed = (f"{same} of {2 * repeats - 1} epochs identical to the first fault-free one, every id once: {exact}; "
                    f"{sum(injected.values())}/{requests} requests faulted ({kinds}); "
                    f"{requests - clean['requests']} requests more than fault-free, {faulty['retries']} of them "
                    f"streamshard retries (logged); median {faulty['seconds']:.1f} s vs {clean['seconds']:.1f} s "
                    f"= {slowdown:.2f}x")
        ok = same == 2 * repeats - 1 and exact and sum(injected.values()) > 0 and faulty["retries"] > 0
        details = {"rate": rate, "server": bench.server, "epochs": repeats, "rows": reference["rows"],
                   "injected": injected, "requests": requests, "clean_requests": clean["requests"],
                   "retries_logged": faulty["retries"], "clean_retries_logged": clean["retries"],
                   "seconds": [r["seconds"] for r in faulty["runs"]],
                   "clean_seconds": [r["seconds"] for r in clean["runs"]], "slowdown": slowdown}
        return observed, ok, details
    return run


# -- the table -------------------------------------------------------------------------------------

CHANGED = "ReadError naming the file, nothing mislabeled"
CACHE_OK = "warning, cache ignored and rebuilt, every id once"
META_OK = "warning, entries discarded, new records served"
CASES: list[Case] = [
    Case("1 DataLoader workers, parent never read the catalog", "every row once, one shared snapshot",
         case_worker_without_catalog),
    Case("1 file lands while StreamLoader x2 builds the catalog", "every snapshot row once, none of the new file",
         case_file_added_during_listing),
    Case("1 explicit ranks list apart, a file lands in between", "checkpoint refused: StateError naming catalog",
         case_ranks_listing_apart),
    Case("2 local file replaced, same size, new mtime", CHANGED, case_local_file_replaced),
    Case("2 S3 object replaced, same size, new ETag", CHANGED, case_s3_object_replaced),
    *(Case(f"3 catalog cache: {damage}", CACHE_OK, cache_case(damage),
           quick=damage in ("bad JSON", "a negative row count")) for damage in CACHE_DAMAGE),
    Case("5 elastic 4x2 -> 2x2 -> 3x1, uneven='drop'", "lost rows = what the final topology reports dropped",
         case_elastic_drop),
    Case("6 explicit path brack[1].parquet (local, S3)", "that one file, taken literally", case_literal_path),
    Case("7 uint64 overflow, StreamLoader in-process", "ConversionError naming column, file, row group",
         conversion_case(0), quick=False),
    Case("7 uint64 overflow, StreamLoader x2 workers", "ConversionError naming column, file, row group",
         conversion_case(2)),
    Case("7 missing S3 bucket", "CatalogError saying the bucket does not exist", case_missing_bucket),
    Case("7 file truncated after cataloging", "ReadError naming file and row group", case_truncated_after_catalog),
    Case("7 garbage page header in row group 1", "ReadError naming file and row group 1", case_corrupt_page),
    *(Case(f"7 activation cache meta.json: {damage}", META_OK, meta_case(damage)) for damage in META_DAMAGE),
    Case("7 disk full while committing the cache index (EFBIG)", "warning, no temp file left, records readable",
         case_disk_full),
    Case("8 botocore DEBUG logging with a session token", "token in 0 log lines (headers logged, redacted)",
         case_secrets),
    Case(f"9 hung endpoint: listing, deadline {SHORT_DEADLINE:g} s", "CatalogError within the deadline",
         case_hung_listing, quick=False),
    Case(f"9 hung endpoint: row group read, deadline {SHORT_DEADLINE:g} s", "ReadError within the deadline",
         hung_read_case(default_deadline=False)),
    Case("9 hung endpoint: ParquetStream read, default deadline 60 s", "ReadError within the deadline",
         hung_read_case(default_deadline=True), quick=False),
    Case("S3 faults 10% (reset/truncate/stall), StreamLoader x2", "every epoch identical to fault-free (ids, bytes)",
         fault_case(0.10)),
    Case("S3 faults 20% (reset/truncate/stall), StreamLoader x2", "every epoch identical to fault-free (ids, bytes)",
         fault_case(0.20), quick=False),
]


def run_case(case: Case, bench: Bench) -> Outcome:
    """Run one case; an exception nobody expected is a failure, with its text as the observation."""
    started = time.perf_counter()
    try:
        observed, passed, details = case.run(bench)
    except Exception as exc:  # noqa: BLE001 - the benchmark reports it instead of stopping
        observed, passed, details = f"unexpected {type(exc).__name__}: {str(exc)[:150]}", False, {}
    return Outcome(case.name, case.expected, observed, passed, round(time.perf_counter() - started, 2), details)


def table(outcomes: list[Outcome]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    rows = ["| case | expected | observed | pass | seconds |", "| --- | --- | --- | --- | ---: |"]
    for o in outcomes:
        rows.append(f"| {cell(o.case)} | {cell(o.expected)} | {cell(o.observed)} | {'PASS' if o.passed else 'FAIL'} "
                    f"| {o.seconds:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short deadlines, small corpora, a subset of cases")
    parser.add_argument("--server", choices=("seaweedfs", "moto"),
                        help="the S3 server behind the fault proxy for the fault epochs (default: seaweedfs; "
                             "moto with --quick, already running for the other cases)")
    parser.add_argument("--out", type=Path, help="JSON output (default benchmarks/out/reliability[-quick].json)")
    parser.add_argument("--only", help="run only cases whose name contains this text")
    args = parser.parse_args(argv)
    args.server = args.server or ("moto" if args.quick else "seaweedfs")
    cases = [c for c in CASES if (c.quick or not args.quick) and (args.only is None or args.only in c.name)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamshard-reliability-") as tmp, local_s3() as s3:
        log = LogTail(Path(tmp) / "streamshard.log")
        bench = Bench(Path(tmp), s3, log, args.quick, args.server)
        try:
            outcomes = []
            for case in cases:
                outcomes.append(run_case(case, bench))
                print(f"  {'PASS' if outcomes[-1].passed else 'FAIL'} {outcomes[-1].seconds:6.1f} s  {case.name}",
                      file=sys.stderr, flush=True)
        finally:
            log.close()
    total = time.perf_counter() - started
    print(table(outcomes))
    failed = [o.case for o in outcomes if not o.passed]
    print(f"\n{len(outcomes) - len(failed)} of {len(outcomes)} cases as expected; {total:.0f} s; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    out = args.out or OUT / ("reliability-quick.json" if args.quick else "reliability.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["benchmarks/reliability.py", *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "server": args.server, "seconds": round(total, 1), "load_average": os.getloadavg(),
        "failed": failed, "cases": [asdict(o) for o in outcomes],
    }, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
