"""Accelerate (1.x) under torchrun + gloo on CPU, used the way its users write a job.

* ``accelerator.prepare(ss.StreamLoader(...))`` + ``register_for_checkpointing`` + ``save_state`` /
  ``load_state``: a mid-epoch state resumed on 2, 1 and 3 processes, and a state saved right after the
  last batch of an epoch, deliver every data epoch exactly once, with equal steps on every rank.
* A plain ``DataLoader`` of a stream handed to ``prepare``: every configuration of Accelerate's table
  fails before its first batch with an error that says what to do, or trains its epoch exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamshard.testing import write_corpus

from launch import assert_equal_steps, assert_ids_exactly_once, check, launch

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

JOBS = Path(__file__).resolve().parent / "frameworks"
LAYOUT = [[200, 150, 260]] + [[3]] * 6 + [[]] + [[0, 5, 0]] + [[40, 1, 90]]  # one big file, tiny ones, an empty one
NUM_ROWS = sum(map(sum, LAYOUT))
MID = 7  # the mid-epoch checkpoint: after this many steps of epoch 0 (of 24) on 2 processes


def reports(directory: Path) -> list[dict]:
    count = len(list(directory.glob("rank*.json")))
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(count)]


def assert_exactly_once(batches_of_every_rank: list[list[list[int]]]) -> None:
    assert_ids_exactly_once(batches_of_every_rank, NUM_ROWS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The corpus, the first run (2 processes, epoch 0 with a checkpoint after step MID and one right after
    its last batch) and the resumed runs, each made once, when a test first needs it."""
    root = tmp_path_factory.mktemp("accelerate")
    write_corpus(str(root / "data"), LAYOUT)
    cache: dict = {}

    def get(name: str, nproc: int = 2, resume: str | None = None) -> list[dict]:
        if name not in cache:
            args = ["--data", str(root / "data"), "--report", str(root / name)]
            if resume is None:
                args += ["--save-after", str(MID), str(root / "mid"), "--save-at-epoch-end", str(root / "edge")]
            else:
                args += ["--resume", str(root / resume), "--epochs", "2"]
            check(launch(nproc, JOBS / "accelerate_job.py", *args))
            cache[name] = reports(root / name)
            assert len(cache[name]) == nproc
        return cache[name]

    get.root = root
    return get


def test_prepare_stream_loader_trains_the_epoch_exactly_once(runs):
    first = runs("first")
    passes = [r["passes"][0] for r in first]
    assert all(len(r["passes"]) == 1 and p["epoch"] == 0 and p["epoch_after"] == 1 for r, p in zip(first, passes))
    assert_equal_steps(passes)
    assert all(p["len"] == len(p["batches"]) for p in passes)
    assert_exactly_once([p["batches"] for p in passes])


@pytest.mark.parametrize("nproc", [2, 1, 3])
def test_mid_epoch_save_state_resumes_on_any_number_of_processes_exactly_once(runs, nproc):
    before = [r["passes"][0]["batches"][:MID] for r in runs("first")]
    after = runs(f"mid-to-{nproc}", nproc, resume="mid")
    assert [[p["epoch"] for p in r["passes"]] for r in after] == [[0, 1]] * nproc
    rest, second = ([r["passes"][e] for r in after] for e in (0, 1))
    assert_equal_steps(rest)
    assert_equal_steps(second)
    assert_exactly_once(before + [p["batches"] for p in rest])  # epoch 0 across the two runs
    assert_exactly_once([p["batches"] for p in second])
    # len(loader): the epoch as a framework counts it, the steps before the checkpoint included
    assert [p["len"] for p in rest] == [MID + len(p["batches"]) for p in rest]
    assert [p["len"] for p in second] == [len(p["batches"]) for p in second]
    if nproc == 2:  # the same topology: exactly the batches the uninterrupted run gave after step MID
        assert [p["batches"] for p in rest] == [r["passes"][0]["batches"][MID:] for r in runs("first")]


def test_state_saved_after_the_last_batch_of_an_epoch_resumes_at_the_next_epoch(runs):
    runs("first")  # writes the checkpoint
    after = runs("edge-to-3", 3, resume="edge")
    assert [[p["epoch"] for p in r["passes"]] for r in after] == [[1]] * 3  # nothing of epoch 0 again
    passes = [r["passes"][0] for r in after]
    assert_equal_steps(passes)
    assert_exactly_once([p["batches"] for p in passes])
    assert [p["len"] for p in passes] == [len(p["batches"]) for p in passes]
    # epoch 1's own order: what a 3-process run that got to epoch 1 another way delivers
    assert [p["batches"] for p in passes] == [r["passes"][1]["batches"] for r in runs("mid-to-3", 3, resume="mid")]


# -- a plain DataLoader of a stream handed to prepare() ------------------------------------------------

TWO_PROCESSES = ["no-dispatch", "no-dispatch-flat-lists", "no-dispatch-workers-spawn", "stateful-dataloader",
                 "no-device-placement", "default", "default-fixed-width", "default-flat-lists",
                 "default-workers-fork", "default-workers-spawn"]
ONE_PROCESS_REFUSED = ["default", "default-flat-lists"]
ONE_PROCESS_EXACT = ["no-dispatch", "no-dispatch-flat-lists"]


@pytest.fixture(scope="module")
def plain(runs):
    """Every configuration's outcome per rank: two processes (one torchrun) and one process."""
    root = runs.root
    results = {}
    for name, nproc, configs in (("plain-2", 2, ["split-batches"] + TWO_PROCESSES),
                                 ("plain-1", None, ONE_PROCESS_REFUSED + ONE_PROCESS_EXACT)):
        # a rank stuck in a collective is killed after the timeout: the lines written so far still tell
        _, log = launch(nproc, JOBS / "accelerate_plain.py", "--data", str(root / "data"), "--report", str(root / name),
                        *configs, timeout=120)
        lines = {}
        for path in sorted((root / name).glob("rank*.jsonl")):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                lines.setdefault(entry["config"], []).append(entry)
        results[name] = (lines, log)
    return results


def assert_refused_before_the_first_batch(entries: list[dict], processes: int, log: str) -> None:
    assert len(entries) == processes, f"not every rank finished this configuration (a hang?):\n{log}"
    for entry in entries:
        assert entry["batches"] == [] and entry["stage"] == "iterate", entry
        assert entry.get("error") == "TopologyError", entry
        assert "ss.StreamLoader(ds" in entry["message"] and "register_for_checkpointing" in entry["message"]


@pytest.mark.parametrize("config", TWO_PROCESSES)
def test_plain_dataloader_prepared_on_two_processes_is_refused_before_the_first_batch(plain, config):
    lines, log = plain["plain-2"]
    assert_refused_before_the_first_batch(lines.get(config, []), 2, log)


def test_split_batches_with_a_stream_fails_in_prepare(plain):
    """Accelerate refuses it itself (a stream's DataLoader has batch_size=None), before any batch."""
    lines, log = plain["plain-2"]
    entries = lines.get("split-batches", [])
    assert len(entries) == 2, log
    assert all(e["stage"] == "prepare" and e["error"] == "ValueError" and "batch_size" in e["message"]
               for e in entries), entries


@pytest.mark.parametrize("config", ONE_PROCESS_REFUSED)
def test_dispatching_on_one_process_is_refused(plain, config):
    """The dispatcher slices every tensor by the first one's length: flat list values would be cut."""
    lines, log = plain["plain-1"]
    assert_refused_before_the_first_batch(lines.get(config, []), 1, log)


@pytest.mark.parametrize("config", ONE_PROCESS_EXACT)
def test_dispatch_batches_false_on_one_process_trains_every_row_once(plain, config):
    lines, log = plain["plain-1"]
    (entry,) = lines.get(config, [None])
    assert entry is not None and entry["stage"] == "done", (entry, log)
    assert entry["rows_match"]
    assert_exactly_once([entry["batches"]])
