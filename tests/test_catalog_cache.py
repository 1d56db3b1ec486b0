"""Catalog cache (reused while files are unchanged, rebuilt when one changes) and the distributed build."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import fsspec
import numpy as np
import pytest
import torch.multiprocessing as mp
from helpers import LocalUnderProtocol

from streamshard.io.catalog_cache import FORMAT_VERSION
from streamshard.io.catalog import Catalog
from streamshard.errors import CatalogError
from streamshard.io.footer import SHARED_FOOTERS
from streamshard.testing import faulty_proxy, write_corpus

LAYOUT = [[40, 40], [30], [25, 25], [50], [10], [5, 5, 5], [7], [9]]


class FooterCountingFileSystem(LocalUnderProtocol):
    """Local files under ``fcount://``, counting ranged reads (footer reads) per file."""

    protocol = "fcount"
    reads: Counter = Counter()
    _lock = threading.Lock()

    def cat_file(self, path, start=None, end=None, **kwargs):
        with FooterCountingFileSystem._lock:
            FooterCountingFileSystem.reads[self._strip_protocol(path)] += 1
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture(autouse=True)
def no_footers_kept_in_process():
    """Each build here stands for a new process (what a cache is for): none finds footers an earlier build
    of this process kept (``SHARED_FOOTERS``, tested in test_shared_footers.py), so what is not read comes
    from the cache."""
    budget, SHARED_FOOTERS.budget = SHARED_FOOTERS.budget, 0
    SHARED_FOOTERS.clear()
    try:
        yield
    finally:
        SHARED_FOOTERS.budget = budget


@pytest.fixture
def counted(tmp_path):
    fsspec.register_implementation("fcount", FooterCountingFileSystem, clobber=True)
    write_corpus(str(tmp_path / "data"), LAYOUT)
    FooterCountingFileSystem.reads.clear()
    return f"fcount://{tmp_path / 'data'}", str(tmp_path / "cache")


def same_catalog(a: Catalog, b: Catalog) -> bool:
    return (a.urls == b.urls and a.schema.equals(b.schema) and all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("file_sizes", "rg_file", "rg_index", "rg_rows", "footer_lengths", "rg_ranges", "rg_values")))


def test_cache_is_reused_when_nothing_changed(counted):
    url, cache_dir = counted
    first = Catalog.build(url, ["id", "input_ids"], cache_dir=cache_dir)
    assert sum(FooterCountingFileSystem.reads.values()) == len(LAYOUT)
    FooterCountingFileSystem.reads.clear()
    second = Catalog.build(url, ["id", "input_ids"], cache_dir=cache_dir)
    assert not FooterCountingFileSystem.reads, "an unchanged corpus must not read any footer"
    assert same_catalog(first, second)
    (cache_file,) = os.listdir(cache_dir)
    with open(os.path.join(cache_dir, cache_file)) as f:
        stored = json.load(f)
    assert stored["format"] == FORMAT_VERSION  # plain JSON, nothing executable
    # one writer, one schema: written once and indexed (a 100,000-file cache held 100,000 copies of it)
    assert len(stored["schemas"]) == 1 and {e["schema"] for e in stored["files"].values()} == {0}


def test_cache_rereads_only_the_file_that_changed(counted, tmp_path):
    url, cache_dir = counted
    Catalog.build(url, ["id"], cache_dir=cache_dir)
    changed = tmp_path / "data" / "part-00003.parquet"
    write_corpus(str(tmp_path / "new"), [[11, 12, 13]])
    os.replace(tmp_path / "new" / "part-00000.parquet", changed)
    FooterCountingFileSystem.reads.clear()
    rebuilt = Catalog.build(url, ["id"], cache_dir=cache_dir)
    assert set(FooterCountingFileSystem.reads) == {str(changed)}
    assert same_catalog(rebuilt, Catalog.build(url, ["id"]))
    assert rebuilt.rg_rows[rebuilt.rg_file == 3].tolist() == [11, 12, 13]


def test_same_size_rewrite_is_detected_by_mtime(counted, tmp_path):
    url, cache_dir = counted
    Catalog.build(url, ["id"], cache_dir=cache_dir)
    target = tmp_path / "data" / "part-00001.parquet"
    stat = target.stat()
    os.utime(target, (stat.st_atime, stat.st_mtime + 10))
    FooterCountingFileSystem.reads.clear()
    Catalog.build(url, ["id"], cache_dir=cache_dir)
    assert set(FooterCountingFileSystem.reads) == {str(target)}


def test_a_projection_has_its_own_cache_and_a_corrupt_cache_is_rebuilt(counted):
    url, cache_dir = counted
    Catalog.build(url, ["id"], cache_dir=cache_dir)
    Catalog.build(url, ["label"], cache_dir=cache_dir)
    assert len(os.listdir(cache_dir)) == 2
    for name in os.listdir(cache_dir):
        with open(os.path.join(cache_dir, name), "w") as f:
            f.write("{not json")
    FooterCountingFileSystem.reads.clear()
    catalog = Catalog.build(url, ["id"], cache_dir=cache_dir)
    assert sum(FooterCountingFileSystem.reads.values()) == len(LAYOUT) and catalog.num_files == len(LAYOUT)


def test_s3_cache_is_invalidated_by_the_etag(s3, tmp_path):
    write_corpus(str(tmp_path / "a"), [[20], [30], [40]])
    url = s3.upload(str(tmp_path / "a"), "cache-bucket", "c")
    cache_dir = str(tmp_path / "cache")
    with faulty_proxy(s3.endpoint_url) as proxy:
        options = dict(s3.storage_options)
        options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
        Catalog.build(url, ["id"], options, cache_dir=cache_dir)
        proxy.reset_counts()
        Catalog.build(url, ["id"], options, cache_dir=cache_dir)
        assert proxy.count("GET", ".parquet") == 0  # listing only
        write_corpus(str(tmp_path / "b"), [[20], [30], [40]], seed=9)  # same sizes? maybe; the ETag differs
        s3.filesystem().put_file(str(tmp_path / "b" / "part-00001.parquet"), f"{url[5:]}/part-00001.parquet")
        proxy.reset_counts()
        Catalog.build(url, ["id"], options, cache_dir=cache_dir)
        assert proxy.count("GET", ".parquet") == 1 and proxy.count("GET", "part-00001") == 1


# -- a damaged cache is never trusted ------------------------------------------------------------

def _entry(doc, name="part-00000.parquet"):
    return next(entry for url, entry in doc["files"].items() if url.endswith(name))


def _edit(change):
    """A corruption of the parsed cache: ``change(doc, entry)`` edits it in place or returns a replacement."""
    def corrupt(text: str) -> bytes:
        doc = json.loads(text)
        out = change(doc, _entry(doc))
        return json.dumps(doc if out is None else out).encode()
    return corrupt


def _other_schema(doc, entry):
    import base64
    import pyarrow as pa
    entry["schema"] = base64.b64encode(pa.schema([("label", pa.int64())]).serialize().to_pybytes()).decode()


CORRUPTIONS = {
    "not UTF-8": lambda text: b"\xff\xfe\x00" + text.encode()[3:],
    "truncated JSON": lambda text: text[: len(text) // 2].encode(),
    "top level is a list": _edit(lambda doc, entry: [doc]),
    "files is a list": _edit(lambda doc, entry: {**doc, "files": list(doc["files"].values())}),
    "an entry is a string": _edit(lambda doc, entry: doc["files"].update({entry["url"]: "part-00000"})),
    "a key is missing": _edit(lambda doc, entry: entry.pop("rows")),
    "an unknown key": _edit(lambda doc, entry: entry.update(extra=1)),
    "a row count is a string": _edit(lambda doc, entry: entry["rows"].__setitem__(0, str(entry["rows"][0]))),
    "a negative row count": _edit(lambda doc, entry: entry["rows"].__setitem__(1, -5)),
    "a row count beyond int64": _edit(lambda doc, entry: entry["rows"].__setitem__(0, 10**30)),
    "size is a string": _edit(lambda doc, entry: entry.update(size=str(entry["size"]))),
    "version is a number": _edit(lambda doc, entry: entry.update(version=7)),
    "url disagrees with its key": _edit(lambda doc, entry: entry.update(url="s3://elsewhere/x.parquet")),
    "footer_length beyond the file": _edit(lambda doc, entry: entry.update(footer_length=10**9)),
    "rows and ranges_shape disagree": _edit(lambda doc, entry: entry["rows"].append(5)),
    "ranges shorter than their shape": _edit(lambda doc, entry: entry["ranges"].pop()),
    "a range past the end of the file": _edit(lambda doc, entry: entry["ranges"].__setitem__(1, entry["size"] + 99)),
    "a range that ends before it starts": _edit(lambda doc, entry: entry["ranges"].__setitem__(1, 0)),
    "schema is not base64": _edit(lambda doc, entry: entry.update(schema="!!not base64!!")),
    "schema is base64 of garbage": _edit(lambda doc, entry: entry.update(schema="Z2FyYmFnZQ==")),
    "schema of other columns": _edit(_other_schema),
    "maybe_null names no column": _edit(lambda doc, entry: entry.update(maybe_null=["nope"])),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_cache_is_ignored_with_a_warning_and_gives_the_fresh_catalog(counted, corruption, caplog):
    url, cache_dir = counted
    fresh = Catalog.build(url, ["id", "input_ids"])
    Catalog.build(url, ["id", "input_ids"], cache_dir=cache_dir)
    (name,) = os.listdir(cache_dir)
    path = os.path.join(cache_dir, name)
    with open(path, encoding="utf-8") as f:
        damaged = CORRUPTIONS[corruption](f.read())
    with open(path, "wb") as f:
        f.write(damaged)
    FooterCountingFileSystem.reads.clear()
    with caplog.at_level(logging.WARNING, logger="streamshard"):
        rebuilt = Catalog.build(url, ["id", "input_ids"], cache_dir=cache_dir)
    assert same_catalog(rebuilt, fresh) and rebuilt.versions == fresh.versions
    assert FooterCountingFileSystem.reads, "the damaged part must be read again from the footers"
    assert any("catalog cache" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    FooterCountingFileSystem.reads.clear()
    assert same_catalog(Catalog.build(url, ["id", "input_ids"], cache_dir=cache_dir), fresh)
    assert not FooterCountingFileSystem.reads  # the rewritten cache is whole again


# -- distributed build: two real gloo processes -------------------------------------------------

def _rank_main(rank: int, world: int, init_file: str, url: str, bad_url: str, out_dir: str) -> None:
    import torch.distributed as dist

    fsspec.register_implementation("fcount", FooterCountingFileSystem, clobber=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        FooterCountingFileSystem.reads.clear()
        catalog = Catalog.build(url, ["id", "input_ids"])
        reads = sum(FooterCountingFileSystem.reads.values())
        try:
            Catalog.build(bad_url)
            error = ""
        except CatalogError as exc:
            error = str(exc)
        result = {
            "reads": reads,
            "urls": list(catalog.urls),
            "rows": catalog.rg_rows.tolist(),
            "ranges": catalog.rg_ranges.tolist(),
            "footers": catalog.footer_lengths.tolist(),
            "schema": str(catalog.schema),
            "error": error,
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_distributed_build_splits_footer_reads_and_ranks_agree(tmp_path):
    write_corpus(str(tmp_path / "data"), LAYOUT)
    bad = tmp_path / "bad"
    write_corpus(str(bad), [[5], [5]])
    (bad / "part-00001.parquet").write_bytes(b"not parquet at all, sorry")
    out = tmp_path / "out"
    out.mkdir()
    url = f"fcount://{tmp_path / 'data'}"
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), url, str(bad), str(out)), nprocs=2, join=True)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    a, b = results
    for key in ("urls", "rows", "ranges", "footers", "schema"):
        assert a[key] == b[key], key
    assert a["reads"] + b["reads"] == len(LAYOUT)
    assert {a["reads"], b["reads"]} == {len(LAYOUT) // 2}
    local = Catalog.build(url, ["id", "input_ids"], distributed=False)
    assert a["rows"] == local.rg_rows.tolist() and a["ranges"] == local.rg_ranges.tolist()
    assert "part-00001.parquet" in a["error"] and a["error"] == b["error"]  # both ranks raise, none hangs


def test_a_cache_that_cannot_be_written_is_a_warning_and_the_catalog_is_built(tmp_path):
    # issue 23 item 5: a read-only or full filesystem, here a cache path through a regular file
    write_corpus(str(tmp_path / "data"), LAYOUT)
    (tmp_path / "a-file").write_text("not a directory")
    blocked = str(tmp_path / "a-file" / "cache")
    with pytest.warns(UserWarning, match=r"catalog cache .*a-file/cache.* cannot be written \(NotADirectoryError"):
        catalog = Catalog.build(str(tmp_path / "data"), cache_dir=blocked)
    assert same_catalog(catalog, Catalog.build(str(tmp_path / "data")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "data"]  # no temp file left anywhere


class ThreadRecordingFileSystem(LocalUnderProtocol):
    """Local files under ``fthreads://`` whose ranged reads wait ``delay`` seconds, recording their threads."""

    protocol = "fthreads"
    delay = 0.0
    threads: set = set()

    def cat_file(self, path, start=None, end=None, **kwargs):
        ThreadRecordingFileSystem.threads.add(threading.get_ident())
        if ThreadRecordingFileSystem.delay:
            time.sleep(ThreadRecordingFileSystem.delay)
        return super().cat_file(path, start=start, end=end, **kwargs)


def test_a_cached_store_is_read_in_one_thread_on_a_loaded_machine_too(tmp_path):
    """More runnable threads than cores stretch a computing thread's wall time by its wait for a CPU,
    which is no wait on I/O. Before: 80 page-cached footers went to threads on a loaded machine (the
    suite's flake, and the opposite of what the probe is for)."""
    fsspec.register_implementation("fthreads", ThreadRecordingFileSystem, clobber=True)
    write_corpus(str(tmp_path / "data"), [[3]] * 80)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * (os.cpu_count() or 1))]
    ThreadRecordingFileSystem.delay, ThreadRecordingFileSystem.threads = 0.0, set()
    try:
        time.sleep(0.3)  # the busy processes running
        catalog = Catalog.build(f"fthreads://{tmp_path / 'data'}", max_concurrency=8, distributed=False)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert catalog.num_rows == 3 * 80
    assert ThreadRecordingFileSystem.threads == {threading.get_ident()}


@pytest.mark.parametrize("delay, files, threaded", [(0.0, 80, False), (0.01, 80, True), (0.01, 20, False)])
def test_footers_are_read_in_threads_only_when_the_store_makes_reads_wait(tmp_path, delay, files, threaded):
    """Footers a store answers from memory are read in the calling thread (threads only contend for the
    GIL: 20,000 cached local footers took 10.8 s in 64 threads, 4.1 s in one); a store whose reads wait
    (a network mount) gets the threads."""
    fsspec.register_implementation("fthreads", ThreadRecordingFileSystem, clobber=True)
    write_corpus(str(tmp_path / "data"), [[3]] * files)  # 20: all read before threads would start
    ThreadRecordingFileSystem.delay, ThreadRecordingFileSystem.threads = delay, set()
    try:
        catalog = Catalog.build(f"fthreads://{tmp_path / 'data'}", max_concurrency=8, distributed=False)
    finally:
        ThreadRecordingFileSystem.delay = 0.0
    assert catalog.num_rows == 3 * files
    used = ThreadRecordingFileSystem.threads
    assert (len(used) > 1) == threaded and (threading.get_ident() in used), used
