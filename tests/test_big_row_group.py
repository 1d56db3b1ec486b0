"""A row group split between workers: each worker decodes it in record batches and keeps only its
rows (never the whole group, never all of its compressed bytes), and every row is still
delivered exactly once, shuffled or not, resumed or not, on any topology.

The thresholds are lowered so a few thousand rows count as "huge": the same code path as a 1 GB
group (``benchmarks/big_row_group.py`` measures that one), at test speed."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    assert_equal_steps,
    assert_exactly_once,
    assert_rows_match_ids,
    run_epoch,
)
from hypothesis import given
from hypothesis import strategies as st
from resume_harness import check_elastic_resume, check_loader_resume
from strategies import PROPERTY, make_layout

import streamshard as ss
import streamshard.io.reader as reader_module
from streamshard.io.catalog import Catalog
from streamshard.plan.epoch_plan import EpochPlan, PlanConfig
from streamshard.io.reader import RowGroupReader

LAYOUT = [[3000], [40, 7], [2000, 1]]  # two "huge" groups (streamed), three small ones (read whole)
ROWS = sum(map(sum, LAYOUT))
BIG = 2000  # rows of the smaller huge group
VOCAB = 50_000


@pytest.fixture(autouse=True)
def small_thresholds(monkeypatch):
    """Stream groups above ~20 KB decoded, in record batches of ~4 KB, buffering ~2 KB compressed."""
    monkeypatch.setattr(reader_module, "STREAM_ABOVE_BYTES", 20_000)
    monkeypatch.setattr(reader_module, "STREAM_BATCH_BYTES", 4_000)
    monkeypatch.setattr(reader_module, "STREAM_BUFFER_BYTES", 2_048)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Rows like ``write_corpus`` (``id``, ``input_ids`` = id % vocab), in small data pages, uncompressed
    (so a column chunk is many times pyarrow's 16 KiB page-header read, the smallest fetch)."""
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(3)
    first = 0
    for f, groups in enumerate(LAYOUT):
        with pq.ParquetWriter(root / f"part-{f}.parquet", pa.schema([("id", pa.int64()),
                                                                   ("input_ids", pa.list_(pa.int32()))]),
                              data_page_size=1024, write_batch_size=64, compression="none",
                              use_dictionary=False) as writer:
            for rows in groups:
                ids = np.arange(first, first + rows, dtype=np.int64)
                lengths = rng.integers(4, 17, rows)
                offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
                tokens = np.repeat(ids % VOCAB, lengths).astype(np.int32)
                writer.write_table(pa.table({"id": ids, "input_ids": pa.ListArray.from_arrays(offsets, tokens)}),
                                   row_group_size=rows)
                first += rows
    return str(root)


def make(path, **kwargs):
    defaults = dict(batch_size=64, shuffle=True, seed=5)
    return lambda rank, world: ss.ParquetStream(path, rank=rank, world_size=world, **{**defaults, **kwargs})


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world_size, num_workers", [(2, 2), (3, 1), (1, 5)])
def test_a_row_group_split_over_workers_is_delivered_exactly_once(corpus, shuffle, world_size, num_workers):
    per_rank = run_epoch(make(corpus, shuffle=shuffle), world_size, num_workers, epoch=1)
    assert_exactly_once(per_rank, ROWS)
    assert_rows_match_ids(per_rank)
    assert_equal_steps(per_rank)


def _one_rank(corpus, rank, world, **kwargs):
    """One rank's batches (in this process) and its reader's counters."""
    ds = make(corpus, **kwargs)(rank, world)
    seen = []
    ds.stats_hook = seen.append
    batches = list(ds)
    return batches, seen[-1].reads


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_worker_holds_only_its_part_of_a_huge_row_group_plus_one_record_batch(corpus, shuffle):
    chunk = pq.read_metadata(f"{corpus}/part-2.parquet").row_group(0).column(1).total_compressed_size
    for rank in range(4):  # 4 ranks: every huge group is split
        batches, reads = _one_rank(corpus, rank, 4, shuffle=shuffle)
        ids = np.concatenate([b["sample_id"].numpy() for b in batches])
        delivered = int((ids >= 0).sum())
        assert reads.row_groups_streamed >= 1
        assert reads.rows_kept == delivered, "each read keeps exactly the rows this rank delivers"
        assert reads.largest_decode < BIG // 8, "decoded in record batches, never a whole huge group"
        assert reads.largest_fetch < chunk // 4, "compressed bytes fetched a little at a time"
        assert reads.misses == 0


def test_without_shuffle_a_worker_stops_decoding_after_its_last_row(corpus):
    _, reads = _one_rank(corpus, 0, 4, shuffle=False)  # rank 0: the first 1,262 rows of the 3,000-row group
    assert reads.rows_decoded < 3000 // 2


def test_below_the_threshold_a_row_group_is_read_whole(corpus, monkeypatch):
    monkeypatch.setattr(reader_module, "STREAM_ABOVE_BYTES", 10**9)
    _, reads = _one_rank(corpus, 0, 4, shuffle=True)
    assert reads.row_groups_streamed == 0 and reads.largest_decode >= BIG  # a whole huge group at once


@pytest.mark.parametrize("stream_above", [0, 10**9])
def test_reading_part_of_a_row_group_gives_exactly_those_rows_streamed_or_whole(corpus, monkeypatch, stream_above):
    monkeypatch.setattr(reader_module, "STREAM_ABOVE_BYTES", stream_above)
    catalog = Catalog.build(corpus)
    whole = pq.read_table(f"{corpus}/part-0.parquet")
    rng = np.random.default_rng(0)
    reader = RowGroupReader.from_catalog(catalog)
    for rows in (np.sort(rng.choice(3000, 700, replace=False)), np.arange(1500, 2100), np.arange(3000),
                 np.array([0, 2999]), np.zeros(0, dtype=np.int64)):
        got = reader.read(0, 0, rows)
        assert got.equals(whole.take(pa.array(rows, pa.int64())).select(got.column_names))
    assert reader.read(0, 0).num_rows == 3000
    with pytest.raises(ss.ReadError, match="row group 0 .*3000 rows"):
        reader.read(0, 0, np.array([5, 3000]))


def test_a_split_huge_row_group_resumes_exactly_and_elastically(corpus):
    check_loader_resume(lambda: make(corpus)(1, 2), 2, stops=[1, 9, 30], epoch=2)
    check_elastic_resume(make(corpus, batch_size=50), [(3, 2, 4), (2, 1, 7), (4, 1, None)])


@given(rows=st.integers(1, 5000), cuts=st.lists(st.integers(0, 5000), max_size=6), seed=st.integers(0, 2**64 - 1),
       epoch=st.integers(0, 3), shuffle=st.booleans())
@PROPERTY
def test_the_rows_of_the_parts_of_a_row_group_cover_it_once_wherever_it_is_cut(rows, cuts, seed, epoch, shuffle):
    plan = EpochPlan(make_layout([[7, rows]]), PlanConfig(shuffle=shuffle, seed=seed), epoch, 1)
    bounds = sorted({0, rows, *(c % (rows + 1) for c in cuts)})
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = plan.piece_rows(1, lo, hi)
        part = np.arange(rows) if part is None else part
        assert np.all(np.diff(part) > 0), "sorted, no repeats"
        # The same rows as the emitted positions, wherever the group was cut: cut-independent.
        np.testing.assert_array_equal(part, np.sort(plan.row_positions(1, lo, hi)))
        parts.append(part)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(rows))


def test_a_split_huge_row_group_on_s3_streams_the_same_rows_as_local_disk(corpus, s3):
    remote = s3.upload(corpus, "big-bucket", "big")
    for rank in range(2):
        local_batches, _ = _one_rank(corpus, rank, 2)
        ds = make(remote, storage_options=s3.storage_options)(rank, 2)
        seen = []
        ds.stats_hook = seen.append
        remote_batches = list(ds)
        assert seen[-1].reads.row_groups_streamed >= 1 and seen[-1].reads.misses == 0
        for a, b in zip(remote_batches, local_batches, strict=True):
            assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
