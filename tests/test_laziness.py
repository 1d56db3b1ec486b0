"""Laziness: constructing opens nothing; a worker opens only the files it reads."""

from __future__ import annotations

import threading
from collections import Counter

import fsspec
import numpy as np
import pytest
from helpers import LocalUnderProtocol

import streamshard as ss
from streamshard.testing import write_corpus


class CountingFileSystem(LocalUnderProtocol):
    """The local filesystem under its own protocol, counting every data access per file."""

    protocol = "counting"
    opens: Counter = Counter()
    reads: Counter = Counter()

    def _open(self, path, mode="rb", **kwargs):
        if not getattr(_inside, "cat", False):  # the local cat_file opens internally; count ours only
            CountingFileSystem.opens[path] += 1
        return super()._open(path, mode, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        CountingFileSystem.reads[self._strip_protocol(path)] += 1
        _inside.cat = True
        try:
            return super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            _inside.cat = False


_inside = threading.local()


@pytest.fixture
def counting(tmp_path):
    fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
    write_corpus(str(tmp_path), [[40, 40], [30], [25, 25], [50], [10]])
    CountingFileSystem.opens.clear()
    CountingFileSystem.reads.clear()
    return f"counting://{tmp_path}"


def test_constructing_a_dataset_opens_and_reads_no_file(counting):
    ss.ParquetStream(counting, columns=["id"], shuffle=True, batch_size=8, rank=0, world_size=4)
    assert not CountingFileSystem.opens and not CountingFileSystem.reads


def test_catalog_reads_only_footers_and_opens_nothing(counting):
    ds = ss.ParquetStream(counting, rank=0, world_size=1)
    assert ds.catalog.num_files == 5
    assert not CountingFileSystem.opens
    assert sorted(CountingFileSystem.reads.values()) == [1] * 5  # one ranged read per footer


@pytest.mark.parametrize("world_size", [3, 5])
def test_each_rank_opens_only_the_files_its_pieces_touch(counting, world_size):
    for rank in range(world_size):
        ds = ss.ParquetStream(counting, shuffle=True, seed=1, rank=rank, world_size=world_size)
        ds.set_epoch(0)
        CountingFileSystem.opens.clear()
        list(ds)
        work = ds.epoch_plan().worker_plan(rank)
        expected = {ds.catalog.urls[f] for f in np.unique(ds.catalog.rg_file[work.pieces.rg])}
        opened = {f"counting://{p}" for p in CountingFileSystem.opens}
        assert opened == expected
        assert all(n == 1 for n in CountingFileSystem.opens.values())
