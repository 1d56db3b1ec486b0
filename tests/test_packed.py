"""PackedStream: every token once, in document order, fixed [B, L] batches, equal steps, exact resume."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamshard as ss
from resume_harness import check_elastic_resume, check_loader_resume

SEQ, BATCH = 64, 4


def write_documents(directory, files, seed=0, max_len=300):
    """Files of tokenized documents whose token values are their global token index (checkable)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(exist_ok=True)
    docs, token = [], 0
    for f, groups in enumerate(files):
        tables = []
        for rows in groups:
            lengths = np.minimum(rng.zipf(1.5, rows), max_len).astype(np.int64)  # skewed, like real documents
            lengths[rng.random(rows) < 0.05] = 0  # some empty documents
            ids = [list(range(token + int(s), token + int(s) + int(n))) for s, n in zip(np.cumsum(lengths) - lengths, lengths)]
            token += int(lengths.sum())
            docs.extend(ids)
            tables.append(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())),
                                    "labels": pa.array([[t + 1 for t in d] for d in ids], pa.list_(pa.int64())),
                                    "score": pa.array(rng.random(rows), pa.float32())}))
        writer = pq.ParquetWriter(str(directory / f"part-{f:03d}.parquet"), tables[0].schema)
        for table in tables:
            writer.write_table(table, row_group_size=max(len(table), 1))
        writer.close()
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    docs = write_documents(root, [[120, 40, 3], [1], [200], [17, 60, 90], [5]])
    return str(root), docs


def packed(path, rank=0, world=1, **kwargs):
    source = ss.ParquetStream(path, shuffle=True, seed=3, rank=rank, world_size=world)
    return ss.PackedStream(source, column="input_ids", seq_len=SEQ, batch_size=BATCH, **kwargs)


def epoch_batches(path, world, workers, **kwargs):
    return [list(ss.StreamLoader(packed(path, r, world, **kwargs), num_workers=workers)) for r in range(world)]


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1)])
def test_every_token_once_in_document_order_with_equal_steps(corpus, world, workers):
    path, docs = corpus
    per_rank = epoch_batches(path, world, workers, columns=["labels"])
    assert len({len(b) for b in per_rank}) == 1, "equal steps on every rank"
    tokens_of = defaultdict(list)
    n = max(workers, 1)
    # Stream order: global worker g = rank * n + w delivers the g-th block; worker w's batches are w::n.
    in_stream_order = [b for batches in per_rank for w in range(n) for b in batches[w::n]]
    for b in in_stream_order:
        assert b["input_ids"].shape == b["labels"].shape == b["sample_id"].shape == (BATCH, SEQ)
        ids, sid = b["input_ids"].reshape(-1), b["sample_id"].reshape(-1)
        assert torch.all(ids[sid < 0] == 0)
        assert torch.equal(b["labels"].reshape(-1)[sid >= 0], ids[sid >= 0] + 1)
        for s, t in zip(sid[sid >= 0].tolist(), ids[sid >= 0].tolist()):
            tokens_of[s].append(t)
    for s, doc in enumerate(docs):
        assert tokens_of.get(s, []) == doc, f"document {s}: tokens lost, repeated or out of order"


def test_padding_is_only_each_workers_last_batch(corpus):
    path, docs = corpus
    per_rank = epoch_batches(path, 2, 2)
    total = sum(len(d) for d in docs)
    slots = sum(b["sample_id"].numel() for batches in per_rank for b in batches)
    assert slots - total < 2 * 2 * BATCH * SEQ, "more than one batch of padding per global worker"
    for batches in per_rank:
        for worker in range(2):
            mine = batches[worker::2]  # the loader's round robin
            assert all(bool((b["sample_id"] >= 0).all()) for b in mine[:-1]), "padding before a worker's last batch"


def test_positions_restart_at_each_document_and_each_sequence(corpus):
    path, _ = corpus
    for b in epoch_batches(path, 1, 0)[0]:
        sid, pos = b["sample_id"], b["position_ids"]
        assert torch.all(pos[:, 0] == 0)
        same = sid[:, 1:] == sid[:, :-1]
        assert torch.all(pos[:, 1:][same & (sid[:, 1:] >= 0)] == pos[:, :-1][same & (sid[:, 1:] >= 0)] + 1)
        assert torch.all(pos[:, 1:][~same] == 0)
        bounds = ss.cu_seqlens(pos)
        assert bounds[0] == 0 and bounds[-1] == pos.numel() and torch.all(bounds[1:] > bounds[:-1])
        assert len(bounds) - 1 == int((pos == 0).sum())


def test_token_counts_come_from_the_footers_exactly(corpus):
    path, docs = corpus
    ds = packed(path)
    assert ds.num_tokens == sum(len(d) for d in docs)
    assert ds.steps_per_epoch(0) == -(-ds.num_tokens // (BATCH * SEQ))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_resumes_a_pack_exactly(corpus, num_workers):
    path, _ = corpus
    check_loader_resume(lambda: packed(path, 1, 2), num_workers, stops=[1, 3, 10_000], epoch=1)


@pytest.mark.parametrize("phases", [[(2, 2, 2), (3, 1, None)], [(1, 0, 5), (4, 2, 1), (2, 0, None)]])
def test_a_pack_resumes_elastically_and_a_document_cut_at_the_checkpoint_is_neither_lost_nor_repeated(corpus, phases):
    path, _ = corpus
    check_elastic_resume(lambda rank, world: packed(path, rank, world), phases)


def test_misuse_is_refused_by_name(corpus, tmp_path):
    path, _ = corpus
    with pytest.raises(ValueError, match="'score' is float"):
        packed(path, columns=["score"]).set_epoch(0)
    with pytest.raises(ValueError, match="'nope' is not in"):
        packed(path, columns=["nope"]).set_epoch(0)
    with pytest.raises(ValueError, match="BlendedStream"):
        ss.PackedStream(ss.BlendedStream({"a": ss.ParquetStream(path)}, {"a": 1.0}, batch_size=4))
    with pytest.raises(ValueError, match="seq_len"):
        ss.PackedStream(ss.ParquetStream(path), seq_len=0)
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2], [3]], "labels": [[1], [3]]}), str(bad / "x.parquet"))
    with pytest.raises(ss.ConversionError, match=r"x\.parquet: row group 0: column 'labels' has 1 values in row 0"):
        list(ss.PackedStream(ss.ParquetStream(str(bad)), seq_len=4, batch_size=1, columns=["labels"]))
    state = ss.StreamLoader(packed(path)).state_dict()
    with pytest.raises(ss.StateError, match="seq_len="):
        ss.StreamLoader(ss.PackedStream(ss.ParquetStream(path, shuffle=True, seed=3), seq_len=SEQ * 2,
                                        batch_size=BATCH)).load_state_dict(state)


def test_a_file_without_null_counts_is_refused_by_name_and_counts_come_from_the_catalog(tmp_path):
    """Token counts are the catalog's footer summaries (no second footer read); without statistics
    they cannot be counted, and the file and row group are named."""
    pq.write_table(pa.table({"input_ids": [[1, 2], [], None, [3]]}), str(tmp_path / "plain.parquet"))
    pq.write_table(pa.table({"input_ids": [[4, 5, 6]]}), str(tmp_path / "zz-bare.parquet"), write_statistics=False)
    ds = ss.PackedStream(ss.ParquetStream(str(tmp_path / "plain.parquet")), seq_len=4, batch_size=1)
    assert ds.num_tokens == 3 and ds.source.catalog.rg_values is not None
    with pytest.raises(ss.CatalogError, match=r"zz-bare\.parquet: row group 0 of column 'input_ids' has no null count"):
        ss.PackedStream(ss.ParquetStream(str(tmp_path)), seq_len=4, batch_size=1).set_epoch(0)
