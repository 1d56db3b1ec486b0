"""A blend of raw-text corpora with ``num_samples`` starts after every corpus's first stage is counted
(``plan/blend_stages.py`` inside ``PackedStream``): its first batches and a checkpoint need no later
stage, the rest is counted beside training, and still every token of the planned sequences once in
document order, equal steps per rank, exact resume and elastic resume 2x2 -> 3x1 through the stages, the
same batches warm as cold; ``set_weights`` is refused (it needs every corpus's count)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import streamshard as ss
from resume_harness import as_checkpoint, check_elastic_resume, check_loader_resume, same_batches
from streamshard.plan.packing_stages import StagePlans
from test_packed_text import BATCH, BOS, EOS, SEQ, WORDS, expected, tokens_by_document, word_level, write_texts
from test_packed_text_stages import GatedCounting, in_stream_order

FIRST = 4000  # compressed bytes of text in the blend's first stage (shared by the corpora by their positions)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    a = write_texts(root / "a", [[40, 35, 50, 45], [60, 30], [45, 55, 40], [50, 50, 35, 40], [45]], seed=11)
    b = write_texts(root / "b", [[30, 25, 40], [35, 45], [30, 20, 25]], seed=12)
    tok = word_level()
    sequences = [-(-sum(len(d) for d in expected(tok, t)) // SEQ) for t in (a, b)]
    return root, (a, b), sequences


def blend_pack(corpora, rank=0, world=1, tokenizer=None, cache=None, sized=None, num_samples=None):
    root, _, sequences = corpora
    sources = {name: ss.ParquetStream(str(root / name), shuffle=True, seed=seed, catalog_cache=cache)
               for name, seed in (("a", 3), ("b", 4))}
    # Weights by each corpus's sequences and num_samples their sum: one corpus epoch of each, every token once.
    blend = ss.BlendedStream(sources, {"a": float(sequences[0]), "b": float(sequences[1])}, batch_size=999, seed=5,
                             rank=rank, world_size=world, num_samples=num_samples or sum(sequences))
    return ss.PackedStream(blend, column="text", seq_len=SEQ, batch_size=BATCH, bos_id=BOS, eos_id=EOS,
                           tokenizer=tokenizer if tokenizer is not None else word_level(), first_stage_bytes=FIRST,
                           sized=sized)


def worker_starts(ps, world, workers):
    """Batches per worker before each stage plan of epoch 0 (every stage counted)."""
    planner = ps.planner
    plans = StagePlans(planner.stages(0), None, planner.config, 0, world * max(workers, 1))
    plans.steps
    return plans.starts


def first_stage_texts(corpora):
    """The texts of every corpus's first-stage row groups (their counts are not held by the gate)."""
    import pyarrow.parquet as pq

    probe = blend_pack(corpora)
    out = []
    for k, corpus in enumerate(probe._corpus_tokens()):
        catalog = probe.corpora[k].catalog
        for rg in corpus.stages.units(0).tolist():
            url, index = catalog.urls[int(catalog.rg_file[rg])], int(catalog.rg_index[rg])
            out.append(pq.ParquetFile(url.removeprefix("file://")).read_row_group(index, columns=["text"])
                       .column("text").to_pylist())
    return out


def check_every_token_once(corpora, per_rank, world, workers, vocab=None):
    """Every document of every corpus once, its tokens in order (``vocab``: word ids, else ``word_level``'s)."""
    _, texts, _ = corpora
    ordered = in_stream_order(per_rank, workers, worker_starts(blend_pack(corpora, 0, world), world, workers))
    tokens_of = tokens_by_document([ordered], 0, corpus_key=True)
    for c, corpus_texts in enumerate(texts):
        docs = expected(word_level(), corpus_texts) if vocab is None else [
            [] if t is None else [BOS] + [vocab[w] for w in t.split()] + [EOS] for t in corpus_texts]
        for s, want in enumerate(docs):
            assert tokens_of.get((c, s), []) == want, f"corpus {c} document {s}: lost, repeated or out of order"


def test_a_cold_blend_trains_on_its_first_stage_while_the_rest_is_counted(corpora):
    tok = GatedCounting(free=first_stage_texts(corpora))  # counting any later stage waits for the gate
    ps = blend_pack(corpora, tokenizer=tok)
    loader = ss.StreamLoader(ps, num_workers=2, workers="threads")  # one process: the gate holds every count
    loader.set_epoch(0)  # counts every corpus's first stage; the background thread goes on (and is held)
    stages = ps.planner.stages(0)
    assert len(stages) >= 3 and all(len(c.stages) >= 3 for c in ps._corpus_tokens())
    starts = worker_starts(blend_pack(corpora), 1, 2)  # (a separate stream: counting all of it)
    first_plan = starts[1] * 2
    assert first_plan >= 3, "the first stage must give batches"
    it = iter(loader)
    first = [next(it) for _ in range(first_plan - 2)]
    state = loader.state_dict()  # a checkpoint during the cold start does not wait for the count
    first += [next(it) for _ in range(2)]  # all of the first plan, without the later stages counted
    assert not tok.timed_out, "the first stage's batches (or a checkpoint) waited for a later stage's count"
    assert not all(c.counts.counted(c.stages.order) for c in ps._corpus_tokens())
    again = GatedCounting(free=first_stage_texts(corpora))  # a cold resume: loading counts only what it needs
    resumed = ss.StreamLoader(blend_pack(corpora, tokenizer=again), num_workers=2, workers="threads")
    resumed.load_state_dict(state)
    resumed_it = iter(resumed)
    resumed_head = [next(resumed_it) for _ in range(2)]
    assert not again.timed_out and not tok.timed_out, "a cold resume inside the first stage waited for later counts"
    assert same_batches(resumed_head, first[-2:])
    tok.opened.set()
    again.opened.set()
    rest = list(it)
    assert same_batches(list(resumed_it), rest)
    check_every_token_once(corpora, [first + rest], 1, 2, tok.vocab)


@pytest.mark.parametrize("world, workers", [(2, 2), (3, 1)])
def test_every_token_once_and_equal_steps_over_stages(corpora, world, workers):
    per_rank = [list(ss.StreamLoader(blend_pack(corpora, r, world), num_workers=workers)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1, "equal steps on every rank"
    assert len(worker_starts(blend_pack(corpora, 0, world), world, workers)) >= 4, "several stage plans"
    check_every_token_once(corpora, per_rank, world, workers)


def test_worker_processes_plan_and_count_the_same_batches(corpora):
    vocab = {w: i + 3 for i, w in enumerate(WORDS)}

    def words(batch):
        return [[vocab[w] for w in t.split()] for t in batch]

    in_processes = ss.StreamLoader(blend_pack(corpora, tokenizer=words), num_workers=2)
    assert in_processes.workers == "processes"
    in_threads = ss.StreamLoader(blend_pack(corpora, tokenizer=words), num_workers=2, workers="threads")
    assert same_batches(list(in_processes), list(in_threads))


def test_resume_mid_stage_and_across_a_stage_boundary(corpora):
    starts = worker_starts(blend_pack(corpora, 1, 2), 2, 2)
    bound = starts[1] * 2  # batches per rank at the first plan's end
    check_loader_resume(lambda: blend_pack(corpora, 1, 2, sized=True), 2, stops=[bound - 1, bound, bound + 1],
                        random_stops=1)


def test_elastic_resume_2x2_to_3x1_at_and_inside_a_stage(corpora):
    bound = worker_starts(blend_pack(corpora, 0, 2), 2, 2)[1] * 2
    for k in (bound, bound + 1):
        check_elastic_resume(lambda rank, world: blend_pack(corpora, rank, world, sized=True),
                             [(2, 2, k), (3, 1, None)])


def test_a_warm_start_gives_the_cold_batches_and_takes_the_cold_state(corpora, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    cold = ss.StreamLoader(blend_pack(corpora, cache=cache), num_workers=2)
    it = iter(cold)
    head = [next(it) for _ in range(3)]
    state = cold.state_dict()
    cold_batches = head + list(it)
    warm = blend_pack(corpora, cache=cache)
    assert all(c.counts.counted(c.stages.order) for c in warm._corpus_tokens()), "warm: all from the cache"
    with caplog.at_level("INFO", logger="streamshard"):
        warm_batches = list(ss.StreamLoader(warm, num_workers=2))
    assert "counting the tokens" not in caplog.text
    assert same_batches(warm_batches, cold_batches), "a warm start plans the same stages: the same batches"
    resumed = ss.StreamLoader(blend_pack(corpora, cache=cache), num_workers=2)
    resumed.load_state_dict(state)
    assert same_batches(list(resumed), cold_batches[3:])


def test_a_blend_past_a_corpus_epoch_and_into_the_next_blend_epoch(corpora):
    """num_samples past a corpus's epoch: its wrap needs its whole count, reached through the stages;
    blend epoch 1 starts deep into each corpus. Every position once, equal steps, the same as warm."""
    _, _, sequences = corpora
    n = 2 * sum(sequences) + 5  # each corpus twice over, and more
    for epoch in (0, 1):
        per_rank = []
        for r in range(2):
            loader = ss.StreamLoader(blend_pack(corpora, r, 2, num_samples=n), num_workers=2)
            loader.set_epoch(epoch)
            per_rank.append(list(loader))
        assert len({len(b) for b in per_rank}) == 1
        real = sum(int((b["sample_id"] >= 0).any(dim=1).sum()) for batches in per_rank for b in batches)
        assert real == n, "every position of the blend epoch once"
        counts = blend_pack(corpora, num_samples=n).counts()
        got = {0: 0, 1: 0}
        for batches in per_rank:
            for b in batches:
                firsts = b["corpus"][:, 0]
                for c in firsts[firsts >= 0].tolist():
                    got[c] += 1
        assert got == {0: counts["a"], 1: counts["b"]}


def test_set_weights_is_refused_by_name(corpora):
    ps = blend_pack(corpora)
    ps.set_epoch(0)
    with pytest.raises(TypeError, match="set_weights on a packed blend of text corpora with num_samples"):
        ps.set_weights({"a": 0.5, "b": 0.5})
    state = as_checkpoint(ss.StreamLoader(ps, num_workers=1).state_dict())
    state["weight_changes"] = [[0, [], [0.5, 0.5]]]
    with pytest.raises(ss.StateError, match="weight_changes"):
        ss.StreamLoader(blend_pack(corpora), num_workers=1).load_state_dict(state)


@pytest.mark.slow
def test_two_ranks_count_the_first_stages_together_and_deliver_every_token_once(tmp_path):
    """torchrun, 2 ranks, gloo, thread workers, 2 epochs: every corpus's first stage is counted over the
    ranks (each tokenizes a share), the later stages too, beside training (before: each rank counted all
    of them alone); equal steps; every token once per epoch."""
    from collections import Counter
    from pathlib import Path

    from launch import check, launch

    texts = [write_texts(tmp_path / "a", [[20, 7, 25, 10], [11, 30, 5], [30, 3, 9, 12]], seed=4),
             write_texts(tmp_path / "b", [[18, 22, 9], [15, 12, 20, 8]], seed=5)]  # first stages: 2 row groups each
    docs = [[[len(w) for w in t.split()] + [0] if t is not None else [] for t in corpus] for corpus in texts]
    sequences = [-(-sum(len(d) for d in corpus) // 16) for corpus in docs]
    check(launch(2, Path(__file__).parent / "frameworks" / "text_blend_job.py", "--a", str(tmp_path / "a"),
                 "--b", str(tmp_path / "b"), "--weights", *map(str, sequences), "--num-samples", str(sum(sequences)),
                 "--first-stage-bytes", "1200", "--report", str(tmp_path / "report"), "--epochs", "2"))
    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["stages"] >= 3
    present = sum(t is not None for corpus in texts for t in corpus)
    assert all(r["first_stage_texts"] for r in reports), "each rank counted a share of the first stages"
    assert sum(r["first_stage_texts"] for r in reports) < present / 2, "set_epoch counted only the first stages"
    assert sum(r["counted_texts"] for r in reports) == present, f"each text tokenized once to count: {reports}"
    later = [r["counted_texts"] - r["first_stage_texts"] for r in reports]
    assert all(0 < n < sum(later) for n in later), f"both ranks counted a share of the later stages: {later}"
    for epoch in range(2):
        assert len(reports[0]["epochs"][epoch]) == len(reports[1]["epochs"][epoch]), "equal steps"
        tokens_of: dict[tuple[int, int], Counter] = {}
        for r in reports:
            for batch in r["epochs"][epoch]:
                for c, s, t in batch:
                    tokens_of.setdefault((c, s), Counter())[t] += 1
        for c, corpus in enumerate(docs):
            for s, want in enumerate(corpus):
                assert tokens_of.get((c, s), Counter()) == Counter(want), f"epoch {epoch}, corpus {c}, document {s}"


@pytest.mark.parametrize("texts, weight_a", [([None, None], 0.5), ([], 0.0)])
def test_a_corpus_of_no_tokens_that_the_weights_give_positions_is_refused_by_name(corpora, tmp_path, texts, weight_a):
    """Null texts, or no rows at all (the only corpus with positions: before, an epoch of no batches)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(tmp_path / "empty" / "part.parquet"))
    root = corpora[0]
    sources = {"a": ss.ParquetStream(str(root / "a")), "nothing": ss.ParquetStream(str(tmp_path / "empty"))}
    blend = ss.BlendedStream(sources, {"a": weight_a, "nothing": 0.5}, batch_size=999, num_samples=20, rank=0,
                             world_size=1)
    ps = ss.PackedStream(blend, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=word_level(), eos_id=EOS)
    with pytest.raises(ValueError, match="corpus 'nothing' has no tokens but its weight gives it sequences"):
        list(ss.StreamLoader(ps, num_workers=0))
