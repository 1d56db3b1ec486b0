"""A raw-text pack under a plain ``DataLoader(pack, num_workers=N)``: its worker processes tokenize each row
group once between them for its count (``io/count_share.py``), not once each, and deliver what a prepared
pack delivers."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import threading
import time
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.io.count_share import CountShare
from streamshard.io.process_share import ProcessShare
from resume_harness import same_batches
from test_packed_text import BATCH, SEQ, WORDS, write_texts

WORKERS = 3
VOCAB = {w: i + 3 for i, w in enumerate(WORDS)}


class LoggedTokenizer:
    """A plain callable tokenizer that notes in a file how many texts each process tokenized."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __call__(self, batch: list[str]) -> list[list[int]]:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {len(batch)}\n")
        return [[VOCAB[w] for w in t.split()] for t in batch]

    def tokenized(self) -> Counter:
        per_process: Counter = Counter()
        if os.path.exists(self.log):
            for line in open(self.log):
                pid, n = line.split()
                per_process[pid] += int(n)
        return per_process


def make_pack(tmp_path, kind: str, tok: LoggedTokenizer) -> ss.PackedStream:
    def source(name: str, seed: int) -> ss.ParquetStream:
        return ss.ParquetStream(str(tmp_path / name), shuffle=True, seed=seed, rank=0, world_size=1)

    if kind == "one corpus":
        src: ss.ParquetStream | ss.BlendedStream = source("a", 3)
    else:
        names = ("web/en", "../b")  # corpus names are not file names
        src = ss.BlendedStream({names[0]: source("a", 3), names[1]: source("b", 4)}, {n: 0.5 for n in names},
                               batch_size=999, seed=5, rank=0, world_size=1)
    return ss.PackedStream(src, column="text", seq_len=SEQ, batch_size=BATCH, tokenizer=tok, bos_id=1, eos_id=2)


@pytest.mark.parametrize("kind", ["one corpus", "a blend"])
def test_worker_processes_count_each_row_group_once_between_them(tmp_path, kind):
    texts = [t for t in write_texts(tmp_path / "a", [[60] * 6, [45] * 5], seed=1) if t is not None]
    if kind == "a blend":
        texts += [t for t in write_texts(tmp_path / "b", [[50] * 4, [30] * 3], seed=2) if t is not None]
    tok = LoggedTokenizer(str(tmp_path / "calls"))
    plain = list(DataLoader(make_pack(tmp_path, kind, tok), batch_size=None, num_workers=WORKERS))
    per_process = tok.tokenized()
    assert len(set(per_process) - {str(os.getpid())}) == WORKERS  # (the parent counts if its len() comes first)

    prepared_tok = LoggedTokenizer(str(tmp_path / "prepared-calls"))
    prepared = make_pack(tmp_path, kind, prepared_tok)
    prepared.set_epoch(0)
    if kind == "one corpus":
        prepared.epoch_length(num_workers=WORKERS)  # every stage counted before the workers start
    counted_here = prepared_tok.tokenized()[str(os.getpid())]
    assert counted_here == len(texts)
    assert same_batches(plain, list(DataLoader(prepared, batch_size=None, num_workers=WORKERS)))
    delivering = sum(prepared_tok.tokenized().values()) - counted_here  # what the prepared pack's workers tokenized
    # The plain pack's workers tokenized that and the counts once between them; counting in every worker
    # would have taken WORKERS times the texts on top.
    assert sum(per_process.values()) - delivering == len(texts), (per_process, delivering)


class Owner:
    """Something for a share's directory to live as long as."""


def _run_then_sleep(running) -> None:
    running.set()
    time.sleep(60)


def test_a_process_forked_while_a_thread_holds_a_share_lock_does_not_keep_it():
    """A pack's counting thread holds the count lock while the loader forks its workers: the children
    must not keep the lock alive after the thread lets it go (everyone else would wait forever)."""
    owner = Owner()
    share = ProcessShare.owned_by(owner)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with share.locked("counts.lock"):
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(60)
    fork = mp.get_context("fork")
    running = fork.Event()
    child = fork.Process(target=_run_then_sleep, args=(running,), daemon=True)
    child.start()
    assert running.wait(60)  # the child runs its code (its fork hooks ran before)
    release.set()
    holder.join(60)
    try:
        fd = os.open(os.path.join(share.directory, "counts.lock"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: the child still held it
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.join()


@pytest.mark.parametrize("damage", ["not npy", "other shape", "float"])
def test_damaged_shared_counts_are_refused_by_name_never_used(damage):
    owner = Owner()
    share = CountShare.owned_by(owner)
    share.counts("source", np.arange(2), 4, lambda missing: missing + 10)  # publishes counts of 4 row groups
    path = os.path.join(share.directory, "source.npy")
    if damage == "not npy":
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY torn")
    else:
        np.save(path, np.zeros(5, np.int64) if damage == "other shape" else np.zeros(4), allow_pickle=False)
    with pytest.raises(ss.CatalogError, match="source.npy"):
        share.counts("source", np.arange(4), 4, lambda missing: pytest.fail("counted over damaged counts"))


def _claim_then(share: CountShare, ready, go, then: str) -> None:
    """A forked claimant (as a rank's counting thread in the workers' parent): claims row groups 0-3,
    then publishes their counts and lets go when told (``then="publish"``), beats never and stays
    (``"silent"``), or dies holding the claim (``"die"``)."""
    claim = share.claim("source", np.arange(4))
    ready.set()
    if then == "die":
        os._exit(0)
    go.wait(60)
    if then == "publish":
        share.publish("source", np.array([10, 11, 12, 13, -1, -1], np.int64))
        claim.release()
    time.sleep(60)


@pytest.mark.parametrize("then", ["publish", "silent", "die"])
def test_claimed_counts_are_waited_for_while_the_claimant_lives_and_beats(then, monkeypatch):
    """A worker lacking row groups its parent's counting thread claimed waits for the parent's counts
    instead of tokenizing them too (before: it counted them at once); it counts them itself when the
    claimant dies or falls silent (no beat for ``CLAIM_STALE_S``), so the wait is bounded."""
    from streamshard.io import count_share

    monkeypatch.setattr(count_share, "CLAIM_STALE_S", 1.5)
    owner = Owner()
    share = CountShare.owned_by(owner)
    fork = mp.get_context("fork")
    ready, go = fork.Event(), fork.Event()
    child = fork.Process(target=_claim_then, args=(share, ready, go, then), daemon=True)
    child.start()
    try:
        assert ready.wait(60)
        if then == "die":
            child.join(60)
        counted: list[list[int]] = []

        def count(missing: np.ndarray) -> np.ndarray:
            counted.append(missing.tolist())
            return missing + 100

        threading.Timer(0.5, go.set).start()
        started = time.monotonic()
        got = share.counts("source", np.array([1, 2, 5]), 6, count)
        waited = time.monotonic() - started
        if then == "publish":
            assert got.tolist() == [11, 12, 105] and counted == [[5]], "the claimed ones came from the claimant"
            assert waited >= 0.4, "returned before the claimant published"
        elif then == "silent":
            assert got.tolist() == [101, 102, 105] and counted == [[1, 2, 5]]
            assert 1.0 <= waited < 30, f"a silent claimant is waited for until its claim is stale: {waited:.1f} s"
        else:
            assert got.tolist() == [101, 102, 105] and counted == [[1, 2, 5]] and waited < 1.0, "dead: no wait"
        assert share.counts("source", np.array([1, 5]), 6, lambda m: pytest.fail("counted twice")).tolist() == \
            [11 if then == "publish" else 101, 105]
    finally:
        child.kill()
        child.join()


def test_a_damaged_claim_is_refused_by_name_never_waited_for_nor_ignored():
    owner = Owner()
    share = CountShare.owned_by(owner)
    share.counts("source", np.arange(1), 4, lambda missing: missing + 10)  # makes the share's directory
    with open(os.path.join(share.directory, "source.claim.0123.npz"), "wb") as f:
        f.write(b"PK torn")
    with pytest.raises(ss.CatalogError, match=r"source\.claim\.0123\.npz"):
        share.counts("source", np.arange(4), 4, lambda missing: pytest.fail("counted past a damaged claim"))
