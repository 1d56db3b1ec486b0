"""Lightning, driven the way its users drive it (``tests/frameworks/lightning_job.py``): DDP on CPU, a
``StreamLoader`` from ``train_dataloader()``, ``ModelCheckpoint``s, preemption and ``fit(ckpt_path=...)``.

Every data epoch is trained exactly once across a preempted run and its resumption, on the same, fewer
or more devices; an epoch-edge checkpoint continues the epoch sequence; validation is complete after
Lightning's sanity check; a dataset made in a ``LightningDataModule.__init__`` gets its rank; and
streamshard raises no warning along the way.

The job includes ``ElasticResume`` (``streamshard/integrations/lightning.py``): without it Lightning
2.6 cuts the resumed epoch short on more devices and every later epoch short on fewer (its docstring
says why). One uninterrupted run is the reference for most checks (its records and its checkpoints);
each other run is one resumption. Every run starts Lightning's DDP processes (several seconds each).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import streamshard as ss
from launch import stacks_then_kill
from streamshard.testing import write_corpus

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

JOB = Path(__file__).resolve().parent / "frameworks" / "lightning_job.py"
PREEMPTED = 75  # frameworks/preemption.py's PREEMPTED
LAYOUT = [[100, 60], [37], [], [90, 90, 3], [20]]  # uneven row groups, an empty file
ROWS = sum(sum(f) for f in LAYOUT)
BATCH, EPOCHS, EVERY = 12, 2, 6  # 18 steps an epoch on 2 devices x 2 workers: a step checkpoint every 6
PREEMPT_AT = 6  # a third into epoch 0: on 3 devices restored index + rest (6 + 8) > a 3-device epoch (12)
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Run:
    """One job: its exit status, output and each rank's records (JSON lines by kind)."""

    returncode: int
    output: str
    ranks: dict[int, list[dict]]
    others: list[dict]  # records of processes that never learnt their rank
    ckpt_dir: Path

    def entries(self, kind: str, rank: int | None = None) -> list[dict]:
        ranks = [rank] if rank is not None else sorted(self.ranks)
        return [e for r in ranks for e in self.ranks[r] if e["kind"] == kind]

    def trained(self, epoch: int) -> dict[int, list[list[int]]]:
        """rank -> the real sample ids of each of its steps in ``epoch``."""
        return {r: [e["ids"] for e in self.entries("train", r) if e["epoch"] == epoch] for r in self.ranks}

    def steps(self, rank: int) -> list[tuple[int, int, list[int]]]:
        """(global step, epoch, ids) of every training step of ``rank``."""
        return [(e["step"], e["epoch"], e["ids"]) for e in self.entries("train", rank)]

    def before(self, step: int) -> "Run":
        """This run as if it had stopped before global step ``step``."""
        kept = {r: [e for e in es if e["kind"] != "train" or e["step"] < step] for r, es in self.ranks.items()}
        return Run(self.returncode, self.output, kept, self.others, self.ckpt_dir)

    def streamshard_warnings(self) -> list[str]:
        everything = [e for r in self.ranks for e in self.ranks[r]] + self.others
        return [f"{e['category']}: {e['message']} (raised in {e['raised_in']})" for e in everything
                if e["kind"] == "warning" and e["streamshard"]]


def run_job(corpus: str, out: Path, devices: int, *args: str, expect: int = 0) -> Run:
    ckpt_dir = out / "ckpt"
    command = [sys.executable, str(JOB), "--data", corpus, "--devices", str(devices), "--epochs", str(EPOCHS),
               "--batch-size", str(BATCH), "--every-n-steps", str(EVERY), "--ckpt-dir", str(ckpt_dir),
               "--record", str(out / "record"), *args]
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=out, start_new_session=True)  # Lightning's DDP children join its group
    try:
        output, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Lightning job hung (DDP ranks disagreeing?):\n{stacks_then_kill(proc)[-30000:]}")
    ranks: dict[int, list[dict]] = {}
    others: list[dict] = []
    for path in sorted((out / "record").glob("*.jsonl")) if (out / "record").exists() else []:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if path.name.startswith("rank"):
            ranks[int(path.stem[4:])] = lines
        else:
            others.extend(lines)
    run = Run(proc.returncode, output, ranks, others, ckpt_dir)
    assert expect is None or run.returncode == expect, output[-4000:]
    return run


def epoch_ids(*runs: Run, epoch: int) -> np.ndarray:
    """Every real sample id trained in ``epoch`` over ``runs``, sorted (duplicates kept)."""
    ids = [i for run in runs for steps in run.trained(epoch).values() for step in steps for i in step]
    return np.sort(np.array(ids, dtype=np.int64))


def assert_each_epoch_once(*runs: Run) -> None:
    for epoch in range(EPOCHS):
        ids = epoch_ids(*runs, epoch=epoch)
        missing = np.setdiff1d(np.arange(ROWS), ids)
        repeated = np.unique(ids[1:][ids[1:] == ids[:-1]])
        assert not len(missing) and not len(repeated), (
            f"epoch {epoch}: {len(ids)} rows trained for {ROWS}; {len(missing)} never trained "
            f"{missing[:10].tolist()}..., {len(repeated)} trained twice {repeated[:10].tolist()}...")


def assert_equal_steps(run: Run) -> None:
    for epoch in range(EPOCHS):
        counts = {rank: len(steps) for rank, steps in run.trained(epoch).items()}
        assert len(set(counts.values())) <= 1, f"epoch {epoch}: steps per rank {counts}"


def assert_validations_complete(run: Run) -> None:
    """Every validation but the sanity check saw every row once, and one ran after each epoch trained."""
    validations: dict[int, list[int]] = {}
    for entry in run.entries("val"):
        if not entry["sanity"]:
            validations.setdefault(entry["run"], []).extend(entry["ids"])
    assert len(validations) == len({e["epoch"] for e in run.entries("train")})
    for index, ids in validations.items():
        ids = np.sort(np.array(ids, dtype=np.int64))
        assert np.array_equal(ids, np.arange(ROWS)), (
            f"validation {index}: {len(ids)} rows for {ROWS}, {len(np.setdiff1d(np.arange(ROWS), ids))} missing")


def assert_finished(run: Run) -> None:
    ends = run.entries("end")
    assert ends and {e["epoch"] for e in ends} == {EPOCHS}, f"training ended at {ends}, not after {EPOCHS} epochs"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lightning_corpus")
    write_corpus(str(root), LAYOUT)
    return str(root)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Run:
    """Two devices, never interrupted: the order every resumption is held to, and its checkpoints."""
    return run_job(corpus, tmp_path_factory.mktemp("reference") / "job", 2)


@pytest.fixture(scope="module")
def preempted(corpus, tmp_path_factory) -> Run:
    """Two devices, killed once the checkpoint of step ``PREEMPT_AT`` (mid epoch 0) is written."""
    return run_job(corpus, tmp_path_factory.mktemp("preempted") / "job", 2, "--preempt-at", str(PREEMPT_AT),
                   expect=PREEMPTED)


def resume(corpus: str, out: Path, devices: int, checkpoint: Path) -> Run:
    assert checkpoint.exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    return run_job(corpus, out / "job", devices, "--resume", str(checkpoint))


def test_the_corpus_gives_the_steps_the_matrix_is_built_on(corpus):
    stream = ss.ParquetStream(corpus, batch_size=BATCH, shuffle=True, rank=0, world_size=2)
    steps = stream.steps_per_epoch(num_workers=2)
    assert steps == 18 and steps % EVERY == 0 and PREEMPT_AT % EVERY == 0 and PREEMPT_AT < steps


def test_an_uninterrupted_fit_trains_each_epoch_once_with_equal_steps_and_a_new_order(reference):
    assert_each_epoch_once(reference)
    assert_equal_steps(reference)
    assert_finished(reference)
    assert [len(s) for s in reference.trained(0).values()] == [18, 18]
    assert reference.trained(0)[0] != reference.trained(1)[0]  # each epoch its own shuffle


def test_every_validation_after_the_sanity_check_sees_every_row_once(reference):
    sanity = [e for e in reference.entries("val") if e["sanity"]]
    assert len(sanity) == 2 * 2  # Lightning's sanity check takes 2 batches a rank and abandons the pass
    assert_validations_complete(reference)


def test_a_fit_raises_no_streamshard_warning(reference, preempted):
    assert reference.streamshard_warnings() == []
    assert preempted.streamshard_warnings() == []


def test_a_preempted_run_trained_exactly_the_uninterrupted_steps_before_the_kill(reference, preempted):
    for rank in (0, 1):
        assert preempted.steps(rank) == [s for s in reference.steps(rank) if s[0] < PREEMPT_AT]
    assert {e["step"] for e in preempted.entries("preempted")} == {PREEMPT_AT}


@pytest.mark.parametrize("devices", [2, 1, 3])
def test_a_mid_epoch_resume_trains_each_epoch_once_on_any_number_of_devices(corpus, reference, preempted, devices,
                                                                             tmp_path):
    resumed = resume(corpus, tmp_path, devices, preempted.ckpt_dir / "steps" / f"epoch=0-step={PREEMPT_AT}.ckpt")
    assert_each_epoch_once(preempted, resumed)
    assert_equal_steps(resumed)
    assert_finished(resumed)
    assert_validations_complete(resumed)
    assert resumed.streamshard_warnings() == []
    if devices == 2:  # the same topology: the uninterrupted run's order, step by step
        for rank in (0, 1):
            assert resumed.steps(rank) == [s for s in reference.steps(rank) if s[0] >= PREEMPT_AT]


def test_without_elastic_resume_lightning_cuts_a_resume_onto_more_devices_short(corpus, preempted, tmp_path):
    """Why ``ElasticResume`` ships: Lightning 2.6 caps the resumed epoch at the length it read before the load
    (2 -> 3 devices at step 6 of 18: 6 of the 8 steps left run, 40 of 400 rows never train). If this starts
    to pass through, Lightning changed and the callback may no longer be needed."""
    checkpoint = preempted.ckpt_dir / "steps" / f"epoch=0-step={PREEMPT_AT}.ckpt"
    plain = run_job(corpus, tmp_path / "job", 3, "--resume", str(checkpoint), "--plain")
    trained = epoch_ids(preempted, plain, epoch=0)
    assert len(np.unique(trained)) == len(trained), "nothing repeated"
    assert ROWS - len(trained) == 40, f"{ROWS - len(trained)} rows of epoch 0 never trained (the docstring: 40)"


@pytest.mark.parametrize("kind, devices", [("steps", 2), ("epochs", 2), ("steps", 1)])
def test_a_resume_at_the_end_of_an_epoch_continues_with_the_next_epoch_and_its_order(corpus, reference, kind, devices,
                                                                                     tmp_path):
    """``steps``: saved on the epoch's last batch, before the loader saw its end; ``epochs``: at epoch end."""
    resumed = resume(corpus, tmp_path, devices, reference.ckpt_dir / kind / "epoch=0-step=18.ckpt")
    assert resumed.trained(0) == {rank: [] for rank in range(devices)}  # nothing of epoch 0 again
    assert_each_epoch_once(reference.before(18), resumed)
    assert_equal_steps(resumed)
    assert_finished(resumed)
    assert_validations_complete(resumed)
    assert resumed.streamshard_warnings() == []
    if devices == 2:  # epoch 1 in its own order, the uninterrupted run's
        for rank in (0, 1):
            assert resumed.steps(rank) == [s for s in reference.steps(rank) if s[0] >= 18]


def test_a_dataset_made_in_a_datamodule_init_gets_its_rank_or_fails_before_any_batch(corpus, tmp_path):
    run = run_job(corpus, tmp_path / "job", 2, "--datamodule", expect=None)
    if run.returncode == 0:
        assert_each_epoch_once(run)
        assert_equal_steps(run)
        assert_finished(run)
        assert_validations_complete(run)
        assert run.streamshard_warnings() == []
    else:
        assert run.entries("train") == [], "rows were trained before the rank error"
        assert re.search(r"\w+Error: .*\b(RANK|WORLD_SIZE)\b", run.output), run.output[-4000:]


@pytest.mark.parametrize("devices", [2, 3])
def test_a_resume_in_the_last_epoch_trains_the_rest_of_it_once(corpus, reference, devices, tmp_path):
    """The issue's last case: preempted a third into the last epoch (step 24 = epoch 1, batch 6)."""
    resumed = resume(corpus, tmp_path, devices, reference.ckpt_dir / "steps" / "epoch=1-step=24.ckpt")
    assert resumed.trained(0) == {rank: [] for rank in range(devices)}  # epoch 0 was done
    assert_each_epoch_once(reference.before(24), resumed)
    assert_equal_steps(resumed)
    assert_finished(resumed)
    if devices == 2:
        for rank in (0, 1):
            assert resumed.steps(rank) == [s for s in reference.steps(rank) if s[0] >= 24]
