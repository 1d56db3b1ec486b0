"""PackedStream: every token once, in document order, fixed [B, L] batches, equal steps, exact resume."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import streamshard as ss
from resume_harness import check_elastic_resume, check_loader_resume, check_stateful_resume

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
    with pytest.raises(ValueError, match="ParquetStream or a BlendedStream; got list"):
        ss.PackedStream([ss.ParquetStream(path)])
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


# -- packing a blend: sequences of one corpus each, blended by weight -----------------------------------------


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-blend")
    docs_a = write_documents(root / "a", [[120, 40, 3], [1], [200]], seed=1)
    docs_b = write_documents(root / "b", [[17, 60, 90], [5], [33]], seed=2, max_len=120)
    return str(root / "a"), docs_a, str(root / "b"), docs_b


def packed_blend(corpora, rank=0, world=1, weights=None, order="fair", **kwargs):
    a, _, b, _ = corpora
    sources = {"a": ss.ParquetStream(a, shuffle=True, seed=3), "b": ss.ParquetStream(b, shuffle=True, seed=4)}
    blend = ss.BlendedStream(sources, weights or {"a": 0.5, "b": 0.5}, batch_size=999, order=order, seed=5,
                             rank=rank, world_size=world, **kwargs)
    return ss.PackedStream(blend, column="input_ids", seq_len=SEQ, batch_size=BATCH, columns=["labels"])


def sequences_per_corpus(docs):
    return -(-sum(len(d) for d in docs) // SEQ)


@pytest.mark.parametrize("order", ["fair", "shuffled"])
@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2)])
def test_a_packed_blend_delivers_each_corpus_epoch_once_in_sequences_of_one_corpus(two_corpora, order, world, workers):
    """Weights in proportion to the corpora's sequences: one blend epoch is one epoch of each corpus,
    so every token of both arrives exactly once, each document's tokens in order."""
    _, docs_a, _, docs_b = two_corpora
    weights = {"a": float(sequences_per_corpus(docs_a)), "b": float(sequences_per_corpus(docs_b))}
    streams = [packed_blend(two_corpora, r, world, weights, order) for r in range(world)]
    assert streams[0].counts() == {"a": sequences_per_corpus(docs_a), "b": sequences_per_corpus(docs_b)}
    per_rank = [list(ss.StreamLoader(ps, num_workers=workers)) for ps in streams]
    assert len({len(b) for b in per_rank}) == 1, "equal steps on every rank"
    n = max(workers, 1)
    tokens_of = defaultdict(list)
    sequences = defaultdict(int)
    for b in (b for batches in per_rank for w in range(n) for b in batches[w::n]):
        corpus, sid, ids = b["corpus"], b["sample_id"], b["input_ids"]
        assert corpus.shape == sid.shape == ids.shape == (BATCH, SEQ)
        assert torch.equal(corpus < 0, sid < 0), "corpus is -1 exactly on padding tokens"
        assert torch.equal(b["labels"][sid >= 0], ids[sid >= 0] + 1)
        for row in range(BATCH):
            real = corpus[row][corpus[row] >= 0]
            if len(real):
                assert corpus[row, 0] >= 0 and torch.all(real == real[0]), "a sequence holds one corpus, from slot 0"
                sequences[int(real[0])] += 1
            for c, s, t in zip(corpus[row].tolist(), sid[row].tolist(), ids[row].tolist()):
                if s >= 0:
                    tokens_of[(c, s)].append(t)
    assert dict(sequences) == {0: sequences_per_corpus(docs_a), 1: sequences_per_corpus(docs_b)}
    for c, docs in enumerate([docs_a, docs_b]):
        for s, doc in enumerate(docs):
            assert tokens_of.get((c, s), []) == doc, f"corpus {c} document {s}: tokens lost, repeated or out of order"


def test_a_packed_blend_keeps_exact_counts_when_a_corpus_cycles(two_corpora):
    """Equal weights: the smaller corpus cycles through fresh epochs; per-corpus sequence counts are
    exact, padding is only each corpus epoch's last sequence plus each worker's last batch."""
    _, docs_a, _, docs_b = two_corpora
    ps = packed_blend(two_corpora)
    counts = ps.counts()
    assert abs(counts["a"] - counts["b"]) <= 1
    assert counts["a"] >= sequences_per_corpus(docs_a) and counts["b"] >= sequences_per_corpus(docs_b)
    assert min(sequences_per_corpus(docs_a), sequences_per_corpus(docs_b)) < min(counts.values()), "one corpus cycles"
    assert ps.num_sequences == sum(counts.values())
    batches = list(ss.StreamLoader(ps, num_workers=2))
    seen = defaultdict(int)
    for b in batches:
        for row in b["corpus"][:, 0].tolist():
            if row >= 0:
                seen[row] += 1
    assert dict(seen) == {0: counts["a"], 1: counts["b"]}
    corpus_epochs = sum(-(-counts[k] // sequences_per_corpus(d)) for k, d in (("a", docs_a), ("b", docs_b)))
    padding = sum(int((b["sample_id"] < 0).sum()) for b in batches)
    assert padding < (corpus_epochs + 2) * SEQ * BATCH
    for k, docs in enumerate((docs_a, docs_b)):  # whole corpus epochs deliver each token once per epoch
        per_epoch = sequences_per_corpus(docs)
        whole, rest = divmod(counts["ab"[k]], per_epoch)
        delivered = sum(int((b["corpus"] == k).sum()) for b in batches)
        assert delivered == whole * sum(len(d) for d in docs) + rest * SEQ


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_resumes_a_packed_blend_exactly(two_corpora, num_workers):
    check_loader_resume(lambda: packed_blend(two_corpora, 1, 2, order="shuffled"), num_workers, stops=[1, 3], epoch=1)


def test_statefuldataloader_resumes_a_packed_blend(two_corpora):
    check_stateful_resume(lambda: packed_blend(two_corpora, 0, 2), 2, stops=[1, 4], epoch=2)


@pytest.mark.parametrize("phases", [[(2, 2, 2), (3, 1, None)], [(1, 0, 3), (4, 2, 1), (2, 0, None)]])
def test_a_packed_blend_resumes_elastically(two_corpora, phases):
    check_elastic_resume(lambda rank, world: packed_blend(two_corpora, rank, world), phases)


def test_packed_blend_misuse_is_refused_by_name(two_corpora, tmp_path):
    a, _, b, _ = two_corpora
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
                             "labels": pa.array([[1, 2], [3]], pa.list_(pa.int32()))}), str(tmp_path / "narrow.parquet"))
    mixed = ss.BlendedStream({"a": ss.ParquetStream(a), "n": ss.ParquetStream(str(tmp_path / "narrow.parquet"))},
                             {"a": 0.5, "n": 0.5}, batch_size=4)
    with pytest.raises(ValueError, match="corpora 'a' and 'n' give the packed columns different dtypes"):
        ss.PackedStream(mixed, seq_len=SEQ, batch_size=BATCH).set_epoch(0)
    (tmp_path / "bare").mkdir()
    pq.write_table(pa.table({"input_ids": pa.array([[7]], pa.list_(pa.int64()))}), str(tmp_path / "bare" / "b.parquet"))
    pq.write_table(pa.table({"input_ids": pa.array([[], []], pa.list_(pa.int64())),
                             "labels": pa.array([[], []], pa.list_(pa.int64()))}), str(tmp_path / "empty.parquet"))
    hollow = ss.BlendedStream({"a": ss.ParquetStream(a), "e": ss.ParquetStream(str(tmp_path / "empty.parquet"))},
                              {"a": 0.5, "e": 0.5}, batch_size=4, num_samples=10)
    with pytest.raises(ValueError, match="corpus 'e' has no tokens in column 'input_ids'"):
        ss.PackedStream(hollow, seq_len=SEQ, batch_size=BATCH).num_sequences  # noqa: B018
    with pytest.raises(ValueError, match="column 'labels' is not in corpus 'n'"):
        ss.PackedStream(ss.BlendedStream({"a": ss.ParquetStream(a), "n": ss.ParquetStream(str(tmp_path / "bare"))},
                                         {"a": 0.5, "n": 0.5}, batch_size=4), columns=["labels"]).set_epoch(0)
    with pytest.raises(TypeError, match="counts\\(\\) is for a packed BlendedStream"):
        ss.PackedStream(ss.ParquetStream(a), seq_len=SEQ).counts()
    state = ss.StreamLoader(packed_blend(two_corpora)).state_dict()
    with pytest.raises(ss.StateError, match="weights"):
        ss.StreamLoader(packed_blend(two_corpora, weights={"a": 0.9, "b": 0.1})).load_state_dict(state)
