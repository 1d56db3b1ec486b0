"""A cold text epoch starts after its first stage is counted (``packing_stages.py`` inside ``PackedStream``):
the first batches and a checkpoint need no later stage, the rest is counted beside training, and still
every token once in document order, equal steps, exact resume mid-stage and across a stage boundary,
elastic resume 2x2 -> 3x1, and a warm start (counts cached) gives the very same batches."""

from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import streamshard as ss
from resume_harness import check_elastic_resume, check_loader_resume, same_batches
from streamshard.plan.packing_stages import StagePlans
from test_packed_text import BATCH, BOS, EOS, SEQ, WORDS, expected, tokens_by_document, word_level, write_texts

FIRST = 3000  # compressed bytes of text in the first stage: a few row groups of this corpus


@pytest.fixture(scope="module")
def staged_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("staged")
    texts = write_texts(root / "c", [[40, 35, 50, 45], [60, 30], [45, 55, 40], [50, 50, 35, 40], [45]], seed=11)
    return str(root / "c"), texts


def staged_pack(path, rank=0, world=1, tokenizer=None, cache=None, sized=None):
    source = ss.ParquetStream(path, shuffle=True, seed=3, rank=rank, world_size=world, catalog_cache=cache)
    return ss.PackedStream(source, column="text", seq_len=SEQ, batch_size=BATCH, bos_id=BOS, eos_id=EOS,
                           tokenizer=tokenizer if tokenizer is not None else word_level(), first_stage_bytes=FIRST,
                           sized=sized)


def plan_bounds(ps, world, workers):
    """Batches per rank at the end of each stage plan of epoch 0 (every stage counted)."""
    planner = ps.planner
    plans = StagePlans(planner.stages(0), planner.counts, planner.config, 0, world * max(workers, 1))
    plans.steps
    return [s * max(workers, 1) for s in plans.starts]


def in_stream_order(per_rank, workers, starts):
    """Batches of every rank (as delivered: round robin over its workers) in the epoch's stream order:
    plan by plan, global worker by global worker (``starts``: batches per worker before each plan)."""
    n = max(workers, 1)
    ordered = []
    for j in range(len(starts) - 1):
        for batches in per_rank:
            for w in range(n):
                ordered += batches[w::n][starts[j]:starts[j + 1]]
    return ordered


def worker_starts(ps, world, workers):
    return [b // max(workers, 1) for b in plan_bounds(ps, world, workers)]


class GatedCounting:
    """A callable tokenizer (word ids) whose counting calls (on the counting threads; reading is never
    held) for row groups other than ``free`` (texts per row group) wait until ``opened`` is set: what a
    slow count of the later stages looks like."""

    def __init__(self, free=()):
        self.vocab = {w: i + 3 for i, w in enumerate(WORDS)}
        self.free = {tuple(t for t in texts if t is not None) for texts in free}
        self.gated, self.opened, self.timed_out = bool(self.free), threading.Event(), False

    def __call__(self, batch):
        held = self.gated and tuple(batch) not in self.free
        if held and threading.current_thread().name.startswith("streamshard-count"):
            if not self.opened.wait(20):
                self.timed_out = True
        return [[self.vocab[w] for w in t.split()] for t in batch]


def first_stage_texts(path):
    """The texts of each row group of epoch 0's first stage."""
    probe = staged_pack(path)
    catalog = probe.source.catalog
    out = []
    for rg in probe.planner.stages(0).units(0).tolist():
        url, index = catalog.urls[int(catalog.rg_file[rg])], int(catalog.rg_index[rg])
        out.append(pq.ParquetFile(url.removeprefix("file://")).read_row_group(index, columns=["text"])
                   .column("text").to_pylist())
    return out


def test_a_cold_start_trains_on_the_first_stage_while_the_rest_is_counted(staged_corpus):
    path, texts = staged_corpus
    tok = GatedCounting(free=first_stage_texts(path))  # counting any later stage waits for the gate
    ps = staged_pack(path, tokenizer=tok)
    loader = ss.StreamLoader(ps, num_workers=2, workers="threads")  # one process: the gate holds every count
    loader.set_epoch(0)  # counts the first stage, then the background thread goes on (and is held)
    stages = ps.planner.stages(0)
    assert len(stages) >= 3 and ps.planner.counts.counted(stages.units(0))
    bounds = plan_bounds(staged_pack(path), 1, 2)  # (a separate stream: counting all of it)
    assert bounds[1] >= 2, "the first stage must give batches"
    it = iter(loader)
    first = [next(it) for _ in range(bounds[1] - 2)]
    state = loader.state_dict()  # a checkpoint during the cold start does not wait for the count
    first += [next(it) for _ in range(2)]  # all of the first plan, without the later stages counted
    end_state = loader.state_dict()  # nor at the first plan's end
    assert not tok.timed_out, "the first stage's batches (or a checkpoint) waited for a later stage's count"
    assert not ps.planner.counts.counted(stages.order)
    again = GatedCounting(free=first_stage_texts(path))  # a cold resume: loading counts only what it needs
    resumed = ss.StreamLoader(staged_pack(path, tokenizer=again), num_workers=2, workers="threads")
    resumed.load_state_dict(state)
    resumed_it = iter(resumed)
    resumed_head = [next(resumed_it) for _ in range(2)]
    assert not again.timed_out and not tok.timed_out, "a cold resume inside the first stage waited for later counts"
    assert same_batches(resumed_head, first[-2:])
    tok.opened.set()
    again.opened.set()
    rest = list(it)
    assert same_batches(list(resumed_it), rest)
    assert not tok.timed_out
    tokens_of = tokens_by_document([in_stream_order([first + rest], 2, worker_starts(staged_pack(path), 1, 2))], 0)
    vocab = tok.vocab
    for s, t in enumerate(texts):
        want = [] if t is None else [BOS] + [vocab[w] for w in t.split()] + [EOS]
        assert tokens_of.get(s, []) == want, f"document {s}"
    from_end = ss.StreamLoader(staged_pack(path, tokenizer=GatedCounting()), num_workers=2, workers="threads")
    from_end.load_state_dict(end_state)
    assert same_batches(list(from_end), rest)


def test_worker_processes_count_the_stages_they_reach_themselves(staged_corpus):
    path, _ = staged_corpus
    vocab = {w: i + 3 for i, w in enumerate(WORDS)}

    def words(batch):
        return [[vocab[w] for w in t.split()] for t in batch]

    in_processes = ss.StreamLoader(staged_pack(path, tokenizer=words), num_workers=2)
    assert in_processes.workers == "processes"
    in_threads = ss.StreamLoader(staged_pack(path, tokenizer=words), num_workers=2, workers="threads")
    assert same_batches(list(in_processes), list(in_threads))


@pytest.mark.parametrize("world, workers", [(2, 2), (3, 1)])
def test_every_token_once_and_equal_steps_over_stages(staged_corpus, world, workers):
    path, texts = staged_corpus
    per_rank = [list(ss.StreamLoader(staged_pack(path, r, world), num_workers=workers)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1, "equal steps on every rank"
    assert len(plan_bounds(staged_pack(path, 0, world), world, workers)) >= 4, "several stage plans"
    tokens_of = tokens_by_document([in_stream_order(per_rank, workers, worker_starts(staged_pack(path, 0, world),
                                                                                      world, workers))], 0)
    for s, doc in enumerate(expected(word_level(), texts)):
        assert tokens_of.get(s, []) == doc, f"document {s}: tokens lost, repeated or out of order"
    slots = sum(b["sample_id"].numel() for batches in per_rank for b in batches)
    real = sum(len(d) for d in expected(word_level(), texts))
    assert slots - real < world * max(workers, 1) * SEQ * BATCH, "padding of one plan: under a batch per worker"


def test_resume_mid_stage_and_across_a_stage_boundary(staged_corpus):
    path, _ = staged_corpus
    bounds = plan_bounds(staged_pack(path, 1, 2), 2, 2)
    stops = [bounds[1] - 1, bounds[1], bounds[1] + 1, (bounds[1] + bounds[2]) // 2]
    check_loader_resume(lambda: staged_pack(path, 1, 2, sized=True), 2, stops=stops, random_stops=1)


def test_elastic_resume_2x2_to_3x1_at_and_inside_a_stage(staged_corpus):
    path, _ = staged_corpus
    bounds = plan_bounds(staged_pack(path, 0, 2), 2, 2)
    for k in (bounds[1], bounds[1] + 1):
        check_elastic_resume(lambda rank, world: staged_pack(path, rank, world, sized=True), [(2, 2, k), (3, 1, None)])


def test_a_warm_start_gives_the_cold_batches_and_takes_the_cold_state(staged_corpus, tmp_path, caplog):
    path, _ = staged_corpus
    cache = str(tmp_path / "cache")
    cold = ss.StreamLoader(staged_pack(path, cache=cache), num_workers=2)
    it = iter(cold)
    head = [next(it) for _ in range(3)]
    state = cold.state_dict()
    cold_batches = head + list(it)
    warm = staged_pack(path, cache=cache)
    assert warm.planner.counts.counted(np.arange(warm.source.catalog.num_row_groups)), "warm: all from the cache"
    with caplog.at_level("INFO", logger="streamshard"):
        warm_batches = list(ss.StreamLoader(warm, num_workers=2))
    assert "counting the tokens" not in caplog.text
    assert same_batches(warm_batches, cold_batches), "a warm start plans the same stages: the same batches"
    resumed = ss.StreamLoader(staged_pack(path, cache=cache), num_workers=2)
    resumed.load_state_dict(state)
    assert same_batches(list(resumed), cold_batches[3:])
    other = ss.StreamLoader(ss.PackedStream(warm.source, column="text", seq_len=SEQ, batch_size=BATCH, bos_id=BOS,
                                            eos_id=EOS, tokenizer=word_level(), first_stage_bytes=FIRST * 2))
    with pytest.raises(ss.StateError, match="first_stage_bytes"):
        other.load_state_dict(state)


def test_the_count_cache_keeps_a_files_row_groups_as_their_stages_are_counted(staged_corpus, tmp_path):
    from streamshard.io.token_count_cache import UNKNOWN, TokenCountCache

    path, _ = staged_corpus
    catalog = staged_pack(path).source.catalog
    cache = TokenCountCache(str(tmp_path), "some-tokenizer", "text")
    n = catalog.num_row_groups
    truth = np.arange(n, dtype=np.int64) * 7 + 1
    first = np.full(n, UNKNOWN, dtype=np.int64)
    first[::3] = truth[::3]  # one stage: every third row group, cutting across the files
    cache.save(catalog, first)
    assert np.array_equal(cache.load(catalog), first), "a file's counted row groups are kept, the others unknown"
    second = np.full(n, UNKNOWN, dtype=np.int64)
    second[1::3] = truth[1::3]
    cache.save(catalog, second)  # the next stage: merged with the first
    merged = cache.load(catalog)
    assert np.array_equal(merged[::3], truth[::3]) and np.array_equal(merged[1::3], truth[1::3])
    assert (merged[2::3] == UNKNOWN).all()


def _save_one_by_one(cache_dir: str, path: str, me: int, every: int, start) -> None:
    """A rank's saves of its own row groups, one more each time (as its counting thread saves stages)."""
    from streamshard.io.token_count_cache import UNKNOWN, TokenCountCache

    catalog = staged_pack(path).source.catalog
    cache = TokenCountCache(cache_dir, "some-tokenizer", "text")
    counts = np.full(catalog.num_row_groups, UNKNOWN, dtype=np.int64)
    start.wait()
    for rg in range(me, catalog.num_row_groups, every):
        counts[rg] = rg * 7 + 1
        cache.save(catalog, counts)


def test_ranks_saving_counts_at_once_keep_each_others(staged_corpus, tmp_path):
    """Under a mesh every data-parallel group's first rank saves the counts its group split: each save
    merges into the file under its lock, so none loses what another saved meanwhile."""
    import multiprocessing

    from streamshard.io.token_count_cache import TokenCountCache

    path, _ = staged_corpus
    catalog = staged_pack(path).source.catalog
    context = multiprocessing.get_context("fork")
    start = context.Event()
    savers = [context.Process(target=_save_one_by_one, args=(str(tmp_path), path, me, 4, start)) for me in range(4)]
    for saver in savers:
        saver.start()
    start.set()
    for saver in savers:
        saver.join(60)
        assert saver.exitcode == 0
    got = TokenCountCache(str(tmp_path), "some-tokenizer", "text").load(catalog)
    lost = np.flatnonzero(got != np.arange(catalog.num_row_groups) * 7 + 1)
    assert not lost.size, f"row groups {lost.tolist()} lost by saves at once"


@pytest.mark.slow
def test_two_ranks_over_stages_and_epochs(tmp_path):
    """torchrun, 2 ranks, gloo, several stages: each epoch's first stage is counted over the ranks (both
    join, whatever their background threads counted), the rest beside training; every token once."""
    from collections import Counter
    from pathlib import Path

    from launch import check, launch

    texts = write_texts(tmp_path / "data", [[20, 7, 25], [11, 30], [30, 3, 9], [18, 22]], seed=4)
    check(launch(2, Path(__file__).parent / "frameworks" / "text_count_job.py", "--data", str(tmp_path / "data"),
                 "--report", str(tmp_path / "report"), "--first-stage-bytes", "200", "--epochs", "2"))
    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["counts"] == reports[1]["counts"] and reports[0]["stages"] >= 3
    for epoch in range(2):
        assert len(reports[0]["epochs"][epoch]) == len(reports[1]["epochs"][epoch]), "equal steps"
        tokens_of: dict[int, Counter] = {}
        for r in reports:
            for batch in r["epochs"][epoch]:
                for s, t in batch:
                    tokens_of.setdefault(s, Counter())[t] += 1
        for s, t in enumerate(texts):
            want = Counter([] if t is None else [len(w) for w in t.split()] + [0])
            assert tokens_of.get(s, Counter()) == want, f"epoch {epoch}, document {s}"


def test_first_stage_bytes_where_nothing_is_counted_in_stages_is_an_error(staged_corpus, tmp_path):
    """Before: ignored without a word for a token column or a blend (which counts everything first)."""
    path, _ = staged_corpus
    text = ss.ParquetStream(path, rank=0, world_size=1)
    blend = ss.BlendedStream({"a": text, "b": ss.ParquetStream(path, rank=0, world_size=1)}, {"a": 1.0, "b": 1.0},
                             batch_size=999, rank=0, world_size=1)
    with pytest.raises(ValueError, match="first_stage_bytes.*blend"):
        ss.PackedStream(blend, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=word_level(), bos_id=BOS,
                        eos_id=EOS, first_stage_bytes=FIRST)
    with pytest.raises(ValueError, match="first_stage_bytes.*token column"):
        ss.PackedStream(text, column="text", seq_len=SEQ, batch_size=BATCH, first_stage_bytes=FIRST)


def test_a_text_stream_has_no_len_so_frameworks_need_no_count_and_sized_true_waits_for_the_exact_one(
        staged_corpus, tmp_path):
    """``len()`` is how Lightning and ``DataLoader`` ask for the epoch before the first step: a raw-text
    stream answers ``TypeError`` (no length; counting nothing, warm or cold, so every rank answers
    alike); ``epoch_length`` and ``sized=True`` wait for the whole count and give the exact number."""
    path, _ = staged_corpus
    tok = GatedCounting(free=first_stage_texts(path))  # a count of a later stage waits (and records it)
    ps = staged_pack(path, tokenizer=tok)
    loader = ss.StreamLoader(ps, num_workers=2, workers="threads")
    plain = torch.utils.data.DataLoader(ps, batch_size=None, num_workers=0)
    for sized_thing in (ps, loader, plain):
        with pytest.raises(TypeError, match=r"epoch_length\(num_workers=N\).*sized=True"):
            len(sized_thing)
    loader.set_epoch(0)
    with pytest.raises(TypeError):
        len(loader)
    assert not ps.planner.counts.counted(ps.planner.stages(0).order) and not tok.timed_out, "len() counted"
    tok.opened.set()
    delivered = list(loader)
    assert ps.epoch_length(num_workers=2) == len(delivered), "epoch_length waits for the count: exact"
    cache = str(tmp_path / "cache")
    list(ss.StreamLoader(staged_pack(path, cache=cache), num_workers=2))
    with pytest.raises(TypeError):  # warm: still none (the answer never depends on what a cache holds)
        len(ss.StreamLoader(staged_pack(path, cache=cache), num_workers=2))
    sized = ss.StreamLoader(staged_pack(path, sized=True), num_workers=2)
    assert len(sized) == len(delivered) == len(list(sized))
    with pytest.raises(ValueError, match="sized must be True, False or None"):
        ss.PackedStream(ss.ParquetStream(path), column="text", tokenizer=word_level(), sized="yes")
    with pytest.raises(ValueError, match="sized=False is for a raw-text corpus"):
        ss.PackedStream(ss.BlendedStream({"a": ss.ParquetStream(path), "b": ss.ParquetStream(path)}, {"a": 1.0, "b": 1.0}, 4),
                        column="text", tokenizer=word_level(), sized=False)


def test_a_framework_that_reads_ahead_saves_the_state_of_what_it_trained(staged_corpus):
    """Lightning reads one batch ahead of training from a loader without a length, then sets the epoch it
    already started: the pass goes on, and ``state_dict(unconsumed=1)`` is the state before that batch."""
    path, _ = staged_corpus
    reference = list(ss.StreamLoader(staged_pack(path), num_workers=2, workers="threads"))
    loader = ss.StreamLoader(staged_pack(path), num_workers=2, workers="threads")
    it = iter(loader)
    got = [next(it)]  # the framework's read-ahead, before it says which epoch it starts
    loader.sampler.set_epoch(0)  # the epoch already running: its loop goes on
    got += [next(it) for _ in range(4)]
    trained = loader.state_dict(unconsumed=1)  # 5 handed out, 4 trained
    with pytest.raises(ValueError, match="unconsumed=6"):
        loader.state_dict(unconsumed=6)
    got += list(it)
    assert same_batches(got, reference)
    resumed = ss.StreamLoader(staged_pack(path), num_workers=2, workers="threads")
    resumed.load_state_dict(trained)
    assert same_batches(list(resumed), reference[4:])
    again = list(loader)  # the next epoch, then a framework's set_epoch of a finished pass's epoch restarts it
    loader.sampler.set_epoch(1)
    assert same_batches(list(loader), again)


def _split_job(tmp_path, *args, timeout=120, processes=2):
    from pathlib import Path

    from launch import launch

    texts = write_texts(tmp_path / "data", [[9, 14, 6, 11], [12, 8, 10], [7, 13, 9], [10, 6, 12]], seed=8)
    done = launch(processes, Path(__file__).parent / "frameworks" / "text_stages_split_job.py", "--data",
                  str(tmp_path / "data"), "--report", str(tmp_path / "report"), "--first-stage-bytes", "150", *args,
                  timeout=timeout)
    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text())
               if (tmp_path / "report" / f"rank{r}.json").exists() else None for r in range(processes)]
    return texts, done, reports


def _unsplit_batches(path, rank, workers=0):
    """A rank's batches of the same pack without a process group (every stage counted alone)."""
    source = ss.ParquetStream(path, shuffle=True, seed=1, rank=rank, world_size=2)
    ps = ss.PackedStream(source, column="text", seq_len=16, batch_size=2, eos_id=0, first_stage_bytes=150,
                         tokenizer=lambda batch: [[len(w) for w in t.split()] for t in batch])
    out = []
    for batch in ss.StreamLoader(ps, num_workers=workers, workers="threads"):
        sid, ids = batch["sample_id"].reshape(-1), batch["input_ids"].reshape(-1)
        out.append([[s, t] for s, t in zip(sid.tolist(), ids.tolist()) if s >= 0])
    return out


@pytest.mark.slow
def test_two_ranks_split_the_later_stages_each_counting_a_share(tmp_path):
    """torchrun, 2 ranks, gloo: the later stages are counted over the ranks (before: every rank counted
    all of them itself, so the texts tokenized to count summed to far more than the corpus); every token
    once, equal steps, and each rank's batches are those of the same pack counted without the split."""
    from launch import check

    texts, done, reports = _split_job(tmp_path, "--wait-for-counts")
    check(done)
    present = sum(t is not None for t in texts)
    assert reports[0]["stages"] >= 4, "several later stages"
    assert reports[0]["counts"] == reports[1]["counts"] and min(reports[0]["counts"]) >= 0
    later = [r["counted_texts"] - r["first_stage_texts"] for r in reports]
    assert sum(r["counted_texts"] for r in reports) == present, f"each text tokenized once to count: {reports}"
    assert all(0 < n < sum(later) for n in later), f"both ranks counted a share of the later stages: {later}"
    assert len(reports[0]["batches"]) == len(reports[1]["batches"]), "equal steps"
    for r, report in enumerate(reports):
        assert report["batches"] == _unsplit_batches(str(tmp_path / "data"), r), f"rank {r}: other batches"
    tokens_of: dict[int, list[int]] = {}
    for report in reports:
        for batch in report["batches"]:
            for s, t in batch:
                tokens_of.setdefault(s, []).append(t)
    for s, t in enumerate(texts):
        assert sorted(tokens_of.get(s, [])) == sorted([] if t is None else [len(w) for w in t.split()] + [0])


@pytest.mark.slow
def test_a_rank_that_stops_early_hangs_neither_the_other_nor_its_own_exit(tmp_path):
    """Rank 1 breaks out after a few batches, destroys its process group and exits while the later stages
    are still being counted (slowly): rank 0 counts the rest alone and ends its epoch with the batches of
    an unsplit count; both exit cleanly (gloo aborts a process that exits inside a collective). Rank 1
    counted a share of the later stages before it left (before: rank 0 counted all of them itself)."""
    from launch import check

    texts, done, reports = _split_job(tmp_path, "--stop-after", "2", "--slow", "0.15", timeout=90)
    check(done)  # a hang is a kill after 90 s, an abort at exit a signal: both fail here
    present = sum(t is not None for t in texts)
    assert reports[0]["batches"] == _unsplit_batches(str(tmp_path / "data"), 0)
    assert 0 < len(reports[1]["batches"]) < len(reports[0]["batches"]), "rank 1 stopped early"
    alone = present - reports[1]["first_stage_texts"]  # what rank 0 tokenizes to count without the split
    assert reports[0]["counted_texts"] < alone, f"rank 1 never helped with the later stages: {reports}"


@pytest.mark.slow
def test_each_data_parallel_group_of_a_mesh_splits_the_later_stages_over_its_own_ranks(tmp_path):
    """torchrun, 4 ranks as a ("dp", "tp") = (2, 2) mesh, ``ParquetStream(mesh=mesh["dp"])``: each
    data-parallel group ({0, 2} and {1, 3}, the same data) splits the later stages over its two ranks
    (before: every rank counted them all itself, so a group's ranks tokenized far more than the corpus);
    each rank's batches are those of the same pack counted without a process group, and all exit."""
    from launch import check

    texts, done, reports = _split_job(tmp_path, "--wait-for-counts", "--mesh", processes=4, timeout=150)
    check(done)  # a hang is a kill, an abort at exit a signal: both fail here
    present = sum(t is not None for t in texts)
    assert [r["dp"] for r in reports] == [0, 0, 1, 1]
    assert reports[0]["stages"] >= 4, "several later stages"
    assert all(r["counts"] == reports[0]["counts"] for r in reports) and min(reports[0]["counts"]) >= 0
    for group in ((0, 2), (1, 3)):  # global ranks of a data-parallel group (its tp index)
        mine = [reports[r] for r in group]
        later = [r["counted_texts"] - r["first_stage_texts"] for r in mine]
        assert sum(r["counted_texts"] for r in mine) == present, f"group {group}: {[r['counted_texts'] for r in mine]} texts tokenized to count {present}"
        assert all(0 < n < sum(later) for n in later), f"group {group}: both ranks counted a share: {later}"
        assert len(mine[0]["batches"]) == len(mine[1]["batches"]), "equal steps"
    unsplit = [_unsplit_batches(str(tmp_path / "data"), dp) for dp in range(2)]
    for r, report in enumerate(reports):
        assert report["batches"] == unsplit[report["dp"]], f"rank {r}: other batches than an unsplit count's"


def _counted_by_every_process(tmp_path, reports) -> list[int]:
    """Texts each rank tokenized to count: its process and its DataLoader workers (their log lines)."""
    per_rank = []
    for r, report in enumerate(reports):
        lines = (tmp_path / "report" / f"counted-rank{r}.log").read_text().split("\n")
        per_rank.append(sum(int(line.split()[1]) for line in lines if line))
        assert per_rank[-1] >= report["counted_texts"]  # the parent's, and its workers'
    return per_rank


@pytest.mark.slow
def test_a_ranks_worker_processes_use_its_split_of_the_later_stages_instead_of_counting_them_too(tmp_path):
    """torchrun, 2 ranks x 2 DataLoader worker processes (a callable tokenizer): the workers, started while
    their parent's thread splits the later stages over the ranks, wait for its counts instead of
    counting those stages again between them (before: each rank's workers tokenized every later stage
    they reached on top of their parent's share); the batches are an unsplit count's."""
    from launch import check

    texts, done, reports = _split_job(tmp_path, "--workers", "2", "--slow", "0.05")
    check(done)
    present = sum(t is not None for t in texts)
    per_rank = _counted_by_every_process(tmp_path, reports)
    assert reports[0]["stages"] >= 4, "several later stages"
    assert sum(per_rank) == present, f"each text tokenized once to count, workers included: {per_rank} of {present}"
    later = [r["counted_texts"] - r["first_stage_texts"] for r in reports]
    assert all(n > 0 for n in later), f"both ranks' threads counted a share of the later stages: {later}"
    for r, report in enumerate(reports):
        assert report["batches"] == _unsplit_batches(str(tmp_path / "data"), r, workers=2), f"rank {r}"


@pytest.mark.slow
def test_worker_processes_waiting_for_a_split_that_ends_early_count_themselves_and_nothing_hangs(tmp_path):
    """2 ranks x 2 worker processes; rank 1 stops early and exits while the later stages are split
    (slowly): rank 0's thread counts the rest alone and lets its claim go, so rank 0's workers, which
    were waiting for it, get every stage (from it or counting once between them) and deliver the
    batches of an unsplit count; both exit cleanly."""
    from launch import check

    texts, done, reports = _split_job(tmp_path, "--workers", "2", "--stop-after", "2", "--slow", "0.15", timeout=90)
    check(done)  # a hang is a kill after 90 s, an abort at exit a signal: both fail here
    assert 0 < len(reports[1]["batches"]) < len(reports[0]["batches"]), "rank 1 stopped early"
    per_rank = _counted_by_every_process(tmp_path, reports)
    assert sum(per_rank) == sum(t is not None for t in texts), f"a text tokenized twice to count: {per_rank}"
    got = reports[0]["batches"]
    assert sorted(map(str, got)) == sorted(map(str, _unsplit_batches(str(tmp_path / "data"), 0, workers=2)))
