"""Lightning over a cold raw-text corpus (``tests/frameworks/lightning_text_job.py``): DDP on CPU, 2 devices.

A raw-text ``PackedStream`` has no ``len()`` unless ``sized=True`` (its length needs the whole token
count), so ``Trainer.fit`` trains each epoch until the loader ends and its first step comes after
the first counted stage: the job's tokenizer holds every count of a later stage until the first
training step happened, so a job that waits for the whole count first fails. With the package's
``StreamLoader`` and its idiom ``DataLoader(ps, batch_size=None, num_workers=2)``: every token of every
document once per epoch, equal steps on both ranks; a preempted ``StreamLoader`` run resumed from its
step checkpoint trains exactly the uninterrupted run's remaining steps (Lightning reads one batch ahead
of training from a loader without a length; the loader's own state in the checkpoint, with no
callback, counts that batch as not handed out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from launch import stacks_then_kill
from test_packed_text import write_texts

pytestmark = pytest.mark.slow  # Lightning's DDP processes

JOB = Path(__file__).resolve().parent / "frameworks" / "lightning_text_job.py"
PREEMPTED, EOS = 75, 0  # the job's (not imported: it imports Lightning)


def token(word: str) -> int:
    """The job's tokenizer's id of a word."""
    return sum(word.encode()) % 997 + 1


PREEMPT_AT = 12  # mid epoch 0 (about 20 steps), past the first stage's plan
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_text")
    texts = write_texts(root / "c", [[12, 10], [14, 9, 11], [10], [13, 12], [9, 10, 8], [12]], seed=4)
    return str(root / "c"), texts


def expected_tokens(texts) -> Counter:
    return Counter((s, t) for s, text in enumerate(texts) if text is not None
                   for t in [token(w) for w in text.split()] + [EOS])


def run_job(path: str, out: Path, *args: str, expect: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    gate = [] if "--no-gate" in args else ["--gate", str(out / "gate")]
    command = [sys.executable, str(JOB), "--data", path, *gate, "--record", str(out / "record"),
               "--ckpt-dir", str(out.parent / "ckpt"), *[a for a in args if a != "--no-gate"]]
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=out,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Lightning job hung:\n{stacks_then_kill(proc)[-30000:]}")
    assert proc.returncode == expect, output[-4000:]
    record = out / "record"
    steps = {r: [json.loads(line) for line in (record / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    starts = {r: json.loads((record / f"start{r}.json").read_text()) for r in (0, 1)}
    return {"steps": steps, "starts": starts, "output": output}


def epoch_tokens(*runs: dict, epoch: int) -> Counter:
    return Counter((s, t) for run in runs for steps in run["steps"].values() for e in steps if e["epoch"] == epoch
                   for s, t in e["tokens"])


def assert_each_epoch_once(texts, *runs: dict) -> None:
    want = expected_tokens(texts)
    for epoch in (0, 1):
        got = epoch_tokens(*runs, epoch=epoch)
        assert got == want, (f"epoch {epoch}: {sum((got - want).values())} tokens extra, "
                             f"{sum((want - got).values())} missing")


def steps_of(run: dict, rank: int) -> list[tuple[int, int]]:
    return [(e["step"], e["epoch"]) for e in run["steps"][rank]]


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory) -> dict:
    """``DataLoader(ps, batch_size=None, num_workers=2)``, one epoch: the steps every run is held to
    (a plain ``DataLoader`` delivers the ``StreamLoader``'s batches; Lightning never sets its epoch)."""
    return run_job(corpus[0], tmp_path_factory.mktemp("plain") / "job", "--loader", "dataloader", "--epochs", "1")


@pytest.fixture(scope="module")
def preempted(corpus, tmp_path_factory) -> tuple[dict, Path]:
    """``StreamLoader``, killed at the start of step ``PREEMPT_AT`` (its checkpoint written)."""
    out = tmp_path_factory.mktemp("preempted")
    return run_job(corpus[0], out / "job", "--preempt-at", str(PREEMPT_AT), expect=PREEMPTED), out


def test_a_cold_text_fit_with_a_plain_dataloader_starts_and_trains_every_token_once(corpus, plain):
    assert epoch_tokens(plain, epoch=0) == expected_tokens(corpus[1])
    counts = {r: len(steps) for r, steps in plain["steps"].items()}
    assert counts[0] == counts[1] > PREEMPT_AT, f"equal steps per rank: {counts}"
    assert plain["starts"][0]["num_training_batches"] == float("inf")  # no length: until the loader ends


def test_a_cold_text_fit_with_a_stream_loader_starts_and_resumes_exactly(corpus, plain, preempted):
    first, out = preempted
    assert first["starts"][0]["num_training_batches"] == float("inf")
    for rank in (0, 1):
        assert [e["tokens"] for e in first["steps"][rank]] == [e["tokens"] for e in plain["steps"][rank]][:PREEMPT_AT]
    checkpoint = out / "ckpt" / f"epoch=0-step={PREEMPT_AT}.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    # A cold resume counts the stages up to its position before its first step: no gate here.
    resumed = run_job(corpus[0], out / "resumed", "--resume", str(checkpoint), "--no-gate")
    assert_each_epoch_once(corpus[1], first, resumed)
    for rank in (0, 1):  # the same topology: exactly the uninterrupted steps
        assert [e["tokens"] for e in resumed["steps"][rank] if e["epoch"] == 0] == \
            [e["tokens"] for e in plain["steps"][rank]][PREEMPT_AT:]
    counts = {r: sum(e["epoch"] == 1 for e in steps) for r, steps in resumed["steps"].items()}
    assert counts[0] == counts[1] == len(plain["steps"][0]), f"equal steps in epoch 1: {counts}"
