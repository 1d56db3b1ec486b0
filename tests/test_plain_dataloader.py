"""A plain ``DataLoader(ds, batch_size=None, num_workers=N)`` that nobody prepared (no ``set_epoch``, no
``ds.catalog`` in the parent): its workers still agree on one catalog snapshot (``catalog_share.py``)."""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
from torch.utils.data import DataLoader, get_worker_info

import streamshard as ss
from streamshard.io.catalog_share import SNAPSHOT, CatalogShare, catalog_from_json, catalog_to_json, load, save
from streamshard.testing import write_corpus
from helpers import assert_exactly_once, assert_rows_match_ids
from launch import assert_equal_steps, assert_ids_exactly_once, launch
from resume_harness import same_batches

SMALL_ROWS = 229  # conftest's small_corpus
slow = pytest.mark.slow  # spawned and forkserver workers start a Python each


@pytest.mark.parametrize("persistent", [False, True], ids=["per-pass-workers", "persistent"])
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=slow), pytest.param("forkserver", marks=slow)])
def test_every_row_once_per_epoch_under_every_start_method(small_corpus, method, persistent):
    """Two epochs; per-pass workers of the second load the first's snapshot, persistent ones keep theirs."""
    ds = ss.ParquetStream(small_corpus, batch_size=16, shuffle=True, seed=3, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=method,
                        persistent_workers=persistent)
    for epoch in range(2):
        if persistent and epoch:
            ds.set_epoch(epoch)  # the parent now needs the catalog: it loads the workers' snapshot
        batches = list(loader)
        assert_exactly_once([batches], SMALL_ROWS)
        assert_rows_match_ids([batches])  # data matches ids; padding rows are -1
    directory = ds._catalog_share.directory
    assert ds.catalog.digest == load(os.path.join(directory, SNAPSHOT)).digest
    del ds, loader
    gc.collect()
    assert not os.path.exists(directory)


def test_over_s3(s3, tmp_path):
    write_corpus(str(tmp_path), [[50, 30], [7], [64, 64, 1]])
    url = s3.upload(str(tmp_path), "plain-loader-bucket", "c")
    ds = ss.ParquetStream(url, batch_size=16, rank=0, world_size=1, storage_options=s3.storage_options)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert_exactly_once([batches], 216)
    assert_rows_match_ids([batches])


class LandAFile:
    """A ``catalog_progress`` hook: marks each process that reads footers (builds a catalog), and the first
    footer read anywhere lands a new file that sorts first (it would shift every sample id)."""

    def __init__(self, root: str, scratch: str) -> None:
        self.root, self.scratch = root, scratch

    def __call__(self, _: int) -> None:
        open(os.path.join(self.scratch, f"built-by-{os.getpid()}"), "a").close()
        try:
            os.close(os.open(os.path.join(self.scratch, "landed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        (staged,) = write_corpus(os.path.join(self.scratch, "new"), [[40]], seed=9)
        os.replace(staged, os.path.join(self.root, "part-00000-early.parquet"))


def test_a_file_landing_while_workers_start_gives_one_snapshot(tmp_path):
    root, scratch = tmp_path / "corpus", tmp_path / "scratch"
    write_corpus(str(root), [[50, 30], [7], [64, 64, 1]])
    scratch.mkdir()
    ds = ss.ParquetStream(str(root), batch_size=16, rank=0, world_size=1)
    ds.catalog_progress = LandAFile(str(root), str(scratch))
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert (scratch / "landed").exists() and ss.Catalog.build(str(root)).num_files == 4
    assert len(list(scratch.glob("built-by-*"))) == 1, "one worker built the catalog; the other loaded it"
    assert_exactly_once([batches], 216)
    assert_rows_match_ids([batches])
    assert ds.catalog.num_files == 3  # the parent loads the workers' snapshot too, not a new listing


class ListsLate(ss.ParquetStream):
    """A stream whose DataLoader workers reach the catalog late, after starting their pass."""

    @property
    def catalog(self) -> ss.Catalog:
        if self._catalog is None and get_worker_info() is not None:
            time.sleep(1.0)
        return super().catalog


def test_a_parent_asked_for_len_while_its_workers_start_lists_once_for_all(tmp_path):
    """``list(loader)`` asks for ``len()`` right after ``iter()``: once the workers have started their pass,
    the parent answers from the catalog. Reaching it before the workers, it lists and publishes for them."""
    root, scratch = tmp_path / "corpus", tmp_path / "scratch"
    write_corpus(str(root), [[50, 30], [7], [64, 64, 1]])
    scratch.mkdir()
    ds = ListsLate(str(root), batch_size=16, rank=0, world_size=1)
    ds.catalog_progress = LandAFile(str(root), str(scratch))
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    batches = iter(loader)
    deadline = time.monotonic() + 60
    while ds._cell.workers <= 0:  # the workers' copies are in their pass, before their catalog
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.01)
    assert len(loader) > 0
    batches = list(batches)
    assert len(list(scratch.glob("built-by-*"))) == 1, "the parent listed; its workers loaded its snapshot"
    assert_exactly_once([batches], 216)
    assert_rows_match_ids([batches])
    assert ds.catalog.num_files == 3


class Owner:
    """Something for a share's directory to live as long as."""


def test_a_builder_killed_while_holding_the_lock_does_not_wedge_the_others(small_corpus):
    owner = Owner()
    share = CatalogShare.owned_by(owner)
    fork = mp.get_context("fork")
    building, digests = fork.Event(), fork.Queue()

    def build_forever() -> None:
        share.get(lambda: (building.set(), time.sleep(600)))

    def wait_then_build() -> None:
        digests.put(share.get(lambda: ss.Catalog.build(small_corpus)).digest)

    holder = fork.Process(target=build_forever, daemon=True)
    holder.start()
    assert building.wait(60)
    waiter = fork.Process(target=wait_then_build, daemon=True)
    waiter.start()
    with pytest.raises(queue.Empty):
        digests.get(timeout=1)  # it waits for the holder's build
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    digest = digests.get(timeout=60)  # the kernel dropped the dead holder's lock: the waiter built
    waiter.join(60)
    assert waiter.exitcode == 0
    assert share.get(lambda: pytest.fail("the waiter's snapshot was not published")).digest == digest
    directory = share.directory
    del owner
    gc.collect()
    assert not os.path.exists(directory)


def test_constructing_creates_no_file_and_collecting_the_dataset_removes_the_shared_one(small_corpus, tmp_path,
                                                                                          monkeypatch):
    gc.collect()  # earlier tests' datasets must not resolve their directories under the patched temp dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # forked workers inherit it
    ds = ss.ParquetStream(small_corpus, rank=0, world_size=1)
    assert os.listdir(tmp_path) == []
    list(DataLoader(ds, batch_size=None, num_workers=2))
    assert os.listdir(tmp_path) == [os.path.basename(ds._catalog_share.directory)]
    del ds
    gc.collect()
    assert os.listdir(tmp_path) == []


@slow
def test_no_directory_is_left_when_the_process_exits(small_corpus):
    script = textwrap.dedent(f"""
        import os
        import streamshard as ss
        from torch.utils.data import DataLoader
        ds = ss.ParquetStream({small_corpus!r}, rank=0, world_size=1)
        list(DataLoader(ds, batch_size=None, num_workers=1))
        child = os.fork()
        if child == 0:
            raise SystemExit(0)  # a forked child that exits normally inherited the finalizer: it must not run it
        os.waitpid(child, 0)
        print(ds._catalog_share.directory, os.path.isdir(ds._catalog_share.directory))
    """)  # ds is still alive when the interpreter exits
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    directory, existed = done.stdout.split()
    assert existed == "True" and not os.path.exists(directory)


# -- the snapshot file ------------------------------------------------------------------------------
def test_a_snapshot_round_trips_exactly(skewed_corpus):
    built = ss.Catalog.build(skewed_corpus, columns=["id", "input_ids"])
    for catalog in (built, dataclasses.replace(built, footer_lengths=None, rg_ranges=None, rg_values=None)):
        again = catalog_from_json(json.loads(json.dumps(catalog_to_json(catalog))))
        assert again.urls == catalog.urls and again.versions == catalog.versions and again.digest == catalog.digest
        assert again.schema.equals(catalog.schema, check_metadata=True)
        for name in ("file_sizes", "rg_file", "rg_index", "rg_rows", "footer_lengths", "rg_ranges", "rg_values"):
            mine, theirs = getattr(again, name), getattr(catalog, name)
            assert (mine is None and theirs is None) or (mine.dtype == np.int64 and np.array_equal(mine, theirs))


@pytest.mark.parametrize("damage", ["other rows, same digest", "truncated"])
def test_a_damaged_snapshot_is_refused_by_name(small_corpus, tmp_path, damage):
    catalog, path = ss.Catalog.build(small_corpus), tmp_path / SNAPSHOT
    save(catalog, str(path))
    data = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:100])
    else:
        data["rg_rows"] = catalog_to_json(dataclasses.replace(catalog, rg_rows=catalog.rg_rows + 1))["rg_rows"]
        path.write_text(json.dumps(data))
    with pytest.raises(ss.CatalogError, match=f"{path}.*(digest|does not load)"):
        load(str(path))


@pytest.mark.parametrize("packed", [False, True], ids=["blend", "packed-blend"])
def test_blended_and_packed_streams_need_no_preparation_either(tmp_path, packed):
    for seed, (name, layout) in enumerate({"a": [[30, 20], [9]], "b": [[17], [], [25, 8]]}.items()):
        write_corpus(str(tmp_path / name), layout, seed=seed)

    def make() -> ss.BlendedStream | ss.PackedStream:
        corpora = {n: ss.ParquetStream(str(tmp_path / n), shuffle=True, seed=i) for i, n in enumerate("ab")}
        blend = ss.BlendedStream(corpora, {"a": 0.6, "b": 0.4}, batch_size=8, rank=0, world_size=1)
        return ss.PackedStream(blend, column="input_ids", seq_len=32, batch_size=4) if packed else blend

    plain = list(DataLoader(make(), batch_size=None, num_workers=2))
    prepared = make()
    prepared.set_epoch(0)
    assert plain and same_batches(plain, list(DataLoader(prepared, batch_size=None, num_workers=2)))


RANKS_ASK_LEN_APART = """
import json, os, sys, time
import torch.distributed as dist
from torch.utils.data import DataLoader, get_worker_info
import streamshard as ss
from streamshard.io.catalog_share import SNAPSHOT

dist.init_process_group("gloo")
rank = dist.get_rank()


class ListsLate(ss.ParquetStream):
    @property
    def catalog(self):
        if self._catalog is None and get_worker_info() is not None and rank == 1:
            time.sleep(1.0)  # rank 1's workers reach the catalog after their parent asked for len()
        return super().catalog


ds = ListsLate(sys.argv[1], batch_size=16)
loader = DataLoader(ds, batch_size=None, num_workers=2)
batches = iter(loader)
while ds._cell.workers <= 0:
    time.sleep(0.01)
if rank == 0:  # rank 0's workers have published their snapshot before its parent asks
    while not os.path.exists(os.path.join(ds._catalog_share.directory, SNAPSHOT)):
        time.sleep(0.01)
steps = len(loader)
ids = [b["sample_id"][b["sample_id"] >= 0].tolist() for b in batches]
print("REPORT", json.dumps({"rank": rank, "steps": steps, "batches": ids}), flush=True)
dist.destroy_process_group()
"""


@slow
def test_ranks_whose_parents_need_the_catalog_at_different_moments_neither_hang_nor_disagree(tmp_path):
    """Under a process group, one rank's parent may find its workers' snapshot published when it asks for
    ``len()`` and another's not: both must still join the footer reads split over the ranks (a rank that
    skipped them left the other waiting in the collective)."""
    write_corpus(str(tmp_path / "c"), [[50, 30], [7], [64, 64, 1]])
    script = tmp_path / "job.py"
    script.write_text(RANKS_ASK_LEN_APART)
    code, out = launch(2, script, str(tmp_path / "c"), timeout=90)
    assert code == 0, out
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in out.splitlines() if "REPORT " in line]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert_equal_steps(reports)
    assert all(r["steps"] == len(r["batches"]) for r in reports), "len() is the steps each rank takes"
    assert_ids_exactly_once([r["batches"] for r in reports], 216)
