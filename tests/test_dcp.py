"""torchtitan-style checkpoints: ``StreamLoader`` in a ``torch.distributed.checkpoint`` (DCP) state dict,
under torchrun + gloo on CPU, saved on 2 processes and loaded on 3 or 1.

The loader itself is in the state dict (``{"model": ..., "data": loader}``). DCP flattens nested dicts
and lists of dicts into one entry per leaf and loads only the entries of the loading side's own (fresh)
state dict, so a loader state whose shape differs from a fresh loader's (a history of two topologies; a
state saved on an epoch's last batch) must still come back whole: a history segment is a list, one entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamshard.testing import write_corpus

from launch import assert_equal_steps, assert_ids_exactly_once, check, launch

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

JOB = Path(__file__).resolve().parent / "frameworks" / "dcp_job.py"
LAYOUT = [[200, 150, 260]] + [[3]] * 6 + [[]] + [[0, 5, 0]] + [[40, 1, 90]]
NUM_ROWS = sum(map(sum, LAYOUT))
MID = 7  # the first checkpoint: after this many steps of epoch 0 (of 24) on 2 processes
AGAIN = 4  # the 3-process resume checkpoints again after this many steps: a history of two topologies


def torchrun(nproc: int, *args: str) -> None:
    check(launch(nproc, JOB, *args, timeout=180))


def assert_exactly_once(batches_of_every_rank: list[list[list[int]]]) -> None:
    assert_ids_exactly_once(batches_of_every_rank, NUM_ROWS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs made once, when a test first needs them: ``runs(name)``. ``first``: 2 processes, epoch 0,
    checkpoints ``mid`` (after step MID) and ``edge`` (right after its last batch); ``mid-to-3`` also
    checkpoints ``again`` after AGAIN steps of its resumed pass."""
    root = tmp_path_factory.mktemp("dcp")
    write_corpus(str(root / "data"), LAYOUT)
    plans = {"first": (2, None), "mid-to-3": (3, "mid"), "mid-to-1": (1, "mid"), "again-to-1": (1, "again"),
             "edge-to-3": (3, "edge")}
    cache: dict = {}

    def get(name: str) -> list[list[dict]]:
        if name not in cache:
            nproc, resume = plans[name]
            out = root
            args = ["--data", str(root / "data"), "--report", str(out / name)]
            if resume is None:
                args += ["--save-after", str(MID), str(out / "mid"), "--save-at-epoch-end", str(out / "edge")]
            else:
                get("mid-to-3" if resume == "again" else "first")  # the run that writes the checkpoint
                args += ["--resume", str(out / resume), "--epochs", "2"]
                if name == "mid-to-3":
                    args += ["--save-after", str(AGAIN), str(out / "again")]
            torchrun(nproc, *args)
            cache[name] = [json.loads((out / name / f"rank{r}.json").read_text())["passes"] for r in range(nproc)]
        return cache[name]

    return get


def epoch_batches(run: list[list[dict]], epoch: int) -> list[list[list[int]]]:
    """Each rank's batches of ``epoch`` in a run (none if the run had no pass over it)."""
    return [p["batches"] for passes in run for p in passes if p["epoch"] == epoch]


@pytest.mark.parametrize("nproc", [3, 1])
def test_a_mid_epoch_checkpoint_resumes_on_another_world_size_exactly_once(runs, nproc):
    first, after = runs("first"), runs(f"mid-to-{nproc}")
    assert [[p["epoch"] for p in passes] for passes in after] == [[0, 1]] * nproc
    assert_equal_steps([passes[0] for passes in after])
    assert_exactly_once([b[:MID] for b in epoch_batches(first, 0)] + epoch_batches(after, 0))
    assert_exactly_once(epoch_batches(after, 1))
    assert [passes[0]["len"] for passes in after] == [MID + len(passes[0]["batches"]) for passes in after]


def test_a_checkpoint_after_two_topologies_resumes_exactly_once(runs):
    """2 processes -> 3 -> 1: the state's history has two entries where a fresh loader's has one."""
    first, middle, last = runs("first"), runs("mid-to-3"), runs("again-to-1")
    assert [[p["epoch"] for p in passes] for passes in last] == [[0, 1]]
    epoch0 = [b[:MID] for b in epoch_batches(first, 0)] + [b[:AGAIN] for b in epoch_batches(middle, 0)]
    assert_exactly_once(epoch0 + epoch_batches(last, 0))
    assert last[0][0]["len"] == MID + AGAIN + len(last[0][0]["batches"])


def test_a_checkpoint_after_the_last_batch_of_an_epoch_resumes_at_the_next_epoch(runs):
    after = runs("edge-to-3")
    assert [[p["epoch"] for p in passes] for passes in after] == [[1]] * 3  # nothing of epoch 0 again
    assert_equal_steps([passes[0] for passes in after])
    assert_exactly_once(epoch_batches(after, 1))
    # epoch 1's own order: what a 3-process run that got to epoch 1 another way delivers
    assert epoch_batches(after, 1) == epoch_batches(runs("mid-to-3"), 1)
