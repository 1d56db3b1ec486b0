"""PackedStream(tokenizer=...): raw text tokenized in the pipeline, every token once, exact and elastic resume.

The tokenizers are built here (a WordLevel and a BPE trained with the ``tokenizers`` library on the test
corpus, and plain Python callables): no hub download."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

import streamshard as ss
from resume_harness import check_elastic_resume, check_loader_resume, check_stateful_resume

SEQ, BATCH = 32, 4
BOS, EOS = 1, 2
WORDS = [f"w{i}" for i in range(40)] + ["the", "a", "of", "token", "pack"]


def write_texts(directory, files, seed=0):
    """Parquet files of texts (some null, some empty); returns every row's text in sample-id order."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for f, groups in enumerate(files):
        writer = None
        for rows in groups:
            chunk = []
            for _ in range(rows):
                n = int(min(rng.zipf(1.6), 120))
                chunk.append(None if rng.random() < 0.05 else "" if rng.random() < 0.05 else
                             " ".join(rng.choice(WORDS, n)))
            texts.extend(chunk)
            table = pa.table({"text": pa.array(chunk, pa.string()), "n": pa.array(np.arange(rows), pa.int64())})
            writer = writer or pq.ParquetWriter(str(directory / f"part-{f:03d}.parquet"), table.schema)
            writer.write_table(table, row_group_size=max(rows, 1))
        writer.close()
    return texts


def word_level() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]", "[EOS]"]))
    # A post-processor that would add BOS/EOS: PackedStream must not let it add anything silently.
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 1), ("[EOS]", 2)])
    return tok


def bpe(texts) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([t for t in texts if t], trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "[BOS]", "[EOS]"]))
    return tok


def expected(tok, texts, bos=BOS, eos=EOS):
    ids = [[] if t is None else [e.ids for e in tok.encode_batch([t], add_special_tokens=False)][0] for t in texts]
    return [[] if t is None else ([bos] if bos is not None else []) + d + ([eos] if eos is not None else [])
            for t, d in zip(texts, ids)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    texts = write_texts(root / "c", [[40, 13, 3], [1], [60], [17, 25, 9], [5]])
    return str(root / "c"), texts


def text_pack(path, rank=0, world=1, tokenizer=None, cache=None, **kwargs):
    source = ss.ParquetStream(path, shuffle=True, seed=3, rank=rank, world_size=world, catalog_cache=cache)
    kwargs.setdefault("bos_id", BOS)
    kwargs.setdefault("eos_id", EOS)
    return ss.PackedStream(source, column="text", seq_len=SEQ, batch_size=BATCH,
                           tokenizer=tokenizer if tokenizer is not None else word_level(), **kwargs)


def tokens_by_document(per_rank, workers, corpus_key=False):
    n = max(workers, 1)
    tokens_of = defaultdict(list)
    for b in (b for batches in per_rank for w in range(n) for b in batches[w::n]):
        assert b["input_ids"].shape == b["sample_id"].shape == b["position_ids"].shape == (BATCH, SEQ)
        assert b["input_ids"].dtype == torch.int64
        sid, ids = b["sample_id"].reshape(-1), b["input_ids"].reshape(-1)
        corpus = b["corpus"].reshape(-1) if corpus_key else torch.zeros_like(sid)
        for c, s, t in zip(corpus.tolist(), sid.tolist(), ids.tolist()):
            if s >= 0:
                tokens_of[(c, s) if corpus_key else s].append(t)
    return tokens_of


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1)])
def test_every_token_of_every_text_once_in_document_order_with_bos_eos_and_equal_steps(corpus, world, workers):
    path, texts = corpus
    per_rank = [list(ss.StreamLoader(text_pack(path, r, world), num_workers=workers)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1, "equal steps on every rank"
    tokens_of = tokens_by_document(per_rank, workers)
    docs = expected(word_level(), texts)
    for s, doc in enumerate(docs):
        assert tokens_of.get(s, []) == doc, f"document {s}: tokens lost, repeated or out of order"
    for b in per_rank[0]:
        sid, pos = b["sample_id"], b["position_ids"]
        assert torch.all(pos[:, 0] == 0)
        same = (sid[:, 1:] == sid[:, :-1]) & (sid[:, 1:] >= 0)
        assert torch.all(pos[:, 1:][same] == pos[:, :-1][same] + 1)
        assert torch.all(pos[:, 1:][~same] == 0), "positions restart at every document"


def test_a_plain_callable_tokenizer_runs_in_worker_processes_and_packs_the_same(corpus):
    path, texts = corpus
    vocab = {w: i + 3 for i, w in enumerate(WORDS)}

    def split_words(batch):
        return [[vocab[w] for w in t.split()] for t in batch]

    ps = text_pack(path, tokenizer=split_words, eos_id=None)
    loader = ss.StreamLoader(ps, num_workers=2)
    assert ps.holds_gil and loader.workers == "processes", "a GIL-holding tokenizer tokenizes beside the loop"
    tokens_of = tokens_by_document([list(loader)], 2)
    for s, t in enumerate(texts):
        want = [] if t is None else [BOS] + [vocab[w] for w in t.split()]
        assert tokens_of.get(s, []) == want
    assert not text_pack(path).holds_gil and ss.StreamLoader(text_pack(path), num_workers=2).workers == "threads"


def test_padding_is_under_one_percent_on_a_corpus_of_many_batches(tmp_path):
    texts = write_texts(tmp_path / "big", [[1500, 1500], [2000]], seed=7)
    tok = bpe(texts)
    per_rank = [list(ss.StreamLoader(text_pack(str(tmp_path / "big"), r, 2, tokenizer=tok), num_workers=2))
                for r in range(2)]
    real = sum(len(d) for d in expected(tok, texts))
    slots = sum(b["sample_id"].numel() for batches in per_rank for b in batches)
    delivered = sum(int((b["sample_id"] >= 0).sum()) for batches in per_rank for b in batches)
    assert delivered == real
    assert (slots - real) / slots <= 0.01, f"padding {(slots - real) / slots:.2%}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_loader_resumes_a_text_pack_exactly(corpus, num_workers):
    path, _ = corpus
    check_loader_resume(lambda: text_pack(path, 1, 2, sized=True), num_workers, stops=[1, 3, 10_000], epoch=1)


def test_statefuldataloader_resumes_a_text_pack(corpus):
    path, _ = corpus
    check_stateful_resume(lambda: text_pack(path, 0, 2, sized=True), 2, stops=[1, 4], epoch=1)


def test_a_text_pack_resumes_elastically_2x2_to_3x1(corpus):
    path, _ = corpus
    check_elastic_resume(lambda rank, world: text_pack(path, rank, world, sized=True), [(2, 2, 2), (3, 1, None)])


def test_a_blend_of_text_corpora_delivers_each_corpus_epoch_once(tmp_path):
    texts_a = write_texts(tmp_path / "a", [[30, 10], [20]], seed=1)
    texts_b = write_texts(tmp_path / "b", [[15], [25, 5]], seed=2)
    tok = word_level()
    seqs = [-(-sum(len(d) for d in expected(tok, t)) // SEQ) for t in (texts_a, texts_b)]

    def make(rank, world):
        sources = {"a": ss.ParquetStream(str(tmp_path / "a"), shuffle=True, seed=3),
                   "b": ss.ParquetStream(str(tmp_path / "b"), shuffle=True, seed=4)}
        blend = ss.BlendedStream(sources, {"a": float(seqs[0]), "b": float(seqs[1])}, batch_size=999, seed=5,
                                 rank=rank, world_size=world)
        return ss.PackedStream(blend, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=tok,
                               bos_id=BOS, eos_id=EOS)

    assert make(0, 1).counts() == {"a": seqs[0], "b": seqs[1]}
    per_rank = [list(ss.StreamLoader(make(r, 2), num_workers=2)) for r in range(2)]
    tokens_of = tokens_by_document(per_rank, 2, corpus_key=True)
    for c, texts in enumerate((texts_a, texts_b)):
        for s, doc in enumerate(expected(tok, texts)):
            assert tokens_of.get((c, s), []) == doc, f"corpus {c} document {s}"
    check_elastic_resume(make, [(2, 2, 1), (3, 1, None)])


class Counting:
    """A callable tokenizer that counts the texts it is given (to see whether counting ran)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += len(batch)
        return [[len(w) for w in t.split()] for t in batch]


def test_counts_are_cached_per_file_version_and_tokenizer_and_a_warm_start_tokenizes_nothing(corpus, tmp_path, caplog):
    path, texts = corpus
    cache = str(tmp_path / "cache")
    cold = Counting()
    first = text_pack(path, tokenizer=cold, tokenizer_name="lengths-v1", cache=cache)
    with caplog.at_level("INFO", logger="streamshard"):
        first.set_epoch(0)
    assert cold.calls == sum(t is not None for t in texts), "cold: every text tokenized once to count"
    assert "counting the tokens of 9 row groups of column 'text'" in caplog.text and "counted " in caplog.text
    assert len(glob.glob(os.path.join(cache, "tokens-*.json"))) == 1
    warm = Counting()
    again = text_pack(path, tokenizer=warm, tokenizer_name="lengths-v1", cache=cache)
    caplog.clear()
    with caplog.at_level("INFO", logger="streamshard"):
        again.set_epoch(0)
    assert warm.calls == 0 and again.num_tokens == first.num_tokens, "warm: no text tokenized before training"
    assert "counting the tokens" not in caplog.text
    other = Counting()
    text_pack(path, tokenizer=other, tokenizer_name="lengths-v2", cache=cache).set_epoch(0)
    assert other.calls == cold.calls, "another tokenizer name is another cache"
    unnamed = Counting()
    text_pack(path, tokenizer=unnamed, cache=cache).set_epoch(0)
    assert unnamed.calls == cold.calls, "an unnamed callable is never served from the cache"
    hf = text_pack(path, cache=cache)
    hf.set_epoch(0)
    changed = word_level()
    changed.add_tokens(["newword"])  # another vocabulary: another identity
    assert text_pack(path, tokenizer=changed, cache=cache).num_tokens == hf.num_tokens
    assert len(glob.glob(os.path.join(cache, "tokens-*.json"))) == 4


def test_a_changed_file_is_counted_again(tmp_path):
    write_texts(tmp_path / "c", [[10], [12]], seed=1)
    cache = str(tmp_path / "cache")
    text_pack(str(tmp_path / "c"), tokenizer=Counting(), tokenizer_name="v1", cache=cache).set_epoch(0)
    pq.write_table(pa.table({"text": ["a b c", "d"], "n": [0, 1]}), str(tmp_path / "c" / "part-001.parquet"))
    os.utime(tmp_path / "c" / "part-001.parquet", (1, 1))  # a new version even on a coarse clock
    again = Counting()
    ps = text_pack(str(tmp_path / "c"), tokenizer=again, tokenizer_name="v1", cache=cache)
    ps.set_epoch(0)
    assert again.calls == 2, "only the changed file's texts are tokenized again"
    assert sum(int((b["sample_id"] >= 0).sum()) for b in ps) == ps.num_tokens


def test_a_damaged_or_lying_cache_is_never_trusted(corpus, tmp_path, caplog):
    path, _ = corpus
    cache = str(tmp_path / "cache")
    text_pack(path, tokenizer=Counting(), tokenizer_name="v1", cache=cache).set_epoch(0)
    (cache_file,) = glob.glob(os.path.join(cache, "tokens-*.json"))
    stored = json.load(open(cache_file))
    url = sorted(stored["files"])[0]
    stored["files"][url]["counts"][0] += 5  # a torn/edited file: the digest no longer matches
    json.dump(stored, open(cache_file, "w"))
    recount = Counting()
    with pytest.warns(UserWarning, match="does not match its digest"):
        text_pack(path, tokenizer=recount, tokenizer_name="v1", cache=cache).set_epoch(0)
    assert recount.calls > 0
    # A well-digested entry that does not fit the file (a count missing) is dropped alone and counted again.
    stored = json.load(open(cache_file))
    stored["files"][url]["counts"].pop()
    stored["digest"] = hashlib.sha256(json.dumps(stored["files"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    json.dump(stored, open(cache_file, "w"))
    partly = Counting()
    with caplog.at_level("WARNING", logger="streamshard"):
        text_pack(path, tokenizer=partly, tokenizer_name="v1", cache=cache).set_epoch(0)
    assert "ignoring 1 damaged entry" in caplog.text and "one count for each of the file's 3 row groups" in caplog.text
    first_file = pq.read_table(url.removeprefix("file://"), columns=["text"]).column("text").to_pylist()
    assert partly.calls == sum(t is not None for t in first_file) > 0, "only that file's texts are counted again"
    # A count that is well formed and digested but wrong (another tokenizer under the same name) is
    # caught when its row group is read: an error naming the file and row group, never a silent loss.
    text_pack(path, tokenizer=Counting(), tokenizer_name="v1", cache=cache).set_epoch(0)
    liar = lambda batch: [[7] * (len(t.split()) + 1) for t in batch]  # noqa: E731
    with pytest.raises(ss.ReadError, match=r"part-000\.parquet: row group \d+: \d+ rows tokenized to \d+ tokens"):
        list(text_pack(path, tokenizer=liar, tokenizer_name="v1", cache=cache))


def test_a_transformers_style_fast_tokenizer_uses_its_backend_without_special_tokens(corpus):
    path, texts = corpus

    class FastTokenizer:  # what transformers' PreTrainedTokenizerFast exposes: the backend Tokenizer
        def __init__(self, backend):
            self.backend_tokenizer = backend

    ps = text_pack(path, tokenizer=FastTokenizer(word_level()), bos_id=None, eos_id=None)
    tokens_of = tokens_by_document([list(ps)], 0)
    docs = expected(word_level(), texts, bos=None, eos=None)
    assert all(tokens_of.get(s, []) == d for s, d in enumerate(docs))
    assert BOS not in [t for d in tokens_of.values() for t in d], "the post-processor's [BOS] is not added silently"


def test_text_misuse_is_refused_by_name(corpus, tmp_path):
    path, _ = corpus
    with pytest.raises(ValueError, match="column 'n' is int64; with tokenizer="):
        ss.PackedStream(ss.ParquetStream(path), column="n", tokenizer=word_level()).set_epoch(0)
    with pytest.raises(ValueError, match="'nope' is not in"):
        ss.PackedStream(ss.ParquetStream(path), column="nope", tokenizer=word_level()).set_epoch(0)
    with pytest.raises(ValueError, match="packs alone"):
        ss.PackedStream(ss.ParquetStream(path), column="text", tokenizer=word_level(), columns=["n"])
    with pytest.raises(ValueError, match="bos_id, eos_id and tokenizer_name are for a text column"):
        ss.PackedStream(ss.ParquetStream(path), column="text", bos_id=1)
    with pytest.raises(ValueError, match="tokenizer must be"):
        ss.PackedStream(ss.ParquetStream(path), column="text", tokenizer=42)
    with pytest.raises(ValueError, match="eos_id must be a token id"):
        ss.PackedStream(ss.ParquetStream(path), column="text", tokenizer=word_level(), eos_id=-1)
    with pytest.raises(ss.ConversionError, match=r"part-00\d\.parquet: row group \d+: the tokenizer returned list of 1 items"):
        text_pack(path, tokenizer=lambda batch: [[1]]).set_epoch(0)
    with pytest.raises(ss.ConversionError, match=r"part-00\d\.parquet: row group \d+: the tokenizer returned a negative"):
        text_pack(path, tokenizer=lambda batch: [[-3] for _ in batch]).set_epoch(0)
    state = ss.StreamLoader(text_pack(path)).state_dict()
    with pytest.raises(ss.StateError, match="tokenizer"):
        ss.StreamLoader(text_pack(path, tokenizer=bpe(["w1 w2 w3 the a of"] * 5))).load_state_dict(state)


@pytest.mark.slow
def test_two_ranks_split_the_counting_pass_and_deliver_every_token_once(tmp_path):
    """torchrun, 2 ranks, gloo: each rank tokenizes about half the texts to count, both get every count."""
    from launch import check, launch

    texts = write_texts(tmp_path / "data", [[20, 7], [11], [30, 3, 9]], seed=4)
    check(launch(2, Path(__file__).parent / "frameworks" / "text_count_job.py", "--data", str(tmp_path / "data"),
                 "--report", str(tmp_path / "report")))
    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in range(2)]
    present = sum(t is not None for t in texts)
    assert reports[0]["counts"] == reports[1]["counts"]
    assert sum(r["counted_texts"] for r in reports) == present, "each text tokenized once over the ranks to count"
    assert all(0 < r["counted_texts"] < present for r in reports), "both ranks counted a share"
    assert len(reports[0]["batches"]) == len(reports[1]["batches"]), "equal steps"
    tokens_of = defaultdict(list)
    for r in reports:
        for batch in r["batches"]:
            for s, t in batch:
                tokens_of[s].append(t)
    for s, t in enumerate(texts):
        assert tokens_of.get(s, []) == ([] if t is None else [len(w) for w in t.split()] + [0])
