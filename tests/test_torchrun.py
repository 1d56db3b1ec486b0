"""A real multi-process run: torchrun, two ranks, gloo on CPU, a tiny DDP model over a skewed corpus."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamshard.testing import write_corpus
from strategies import SKEWED_LAYOUT

pytestmark = pytest.mark.slow  # subprocesses: run by make test, skippable with -m "not slow"

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, *args: str) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(EXAMPLE), *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def read_reports(directory: Path, world: int) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_ranks_train_an_epoch_with_equal_steps_and_see_every_row_once(tmp_path):
    write_corpus(str(tmp_path / "data"), SKEWED_LAYOUT)
    num_rows = sum(sum(f) for f in SKEWED_LAYOUT)
    torchrun(2, "--data", str(tmp_path / "data"), "--epochs", "2", "--batch-size", "50",
             "--num-workers", "2", "--report", str(tmp_path / "report"))
    reports = read_reports(tmp_path / "report", 2)
    for epoch in range(2):
        runs = [r["epochs"][epoch] for r in reports]
        assert runs[0]["steps"] == runs[1]["steps"] > 0
        ids = np.sort(np.concatenate([np.array(run["sample_ids"], dtype=np.int64) for run in runs]))
        np.testing.assert_array_equal(ids, np.arange(num_rows))
    first, second = (reports[0]["epochs"][e]["sample_ids"] for e in range(2))
    assert first != second  # each epoch is shuffled anew, also in persistent workers


def test_checkpoint_exit_and_resume_on_a_different_number_of_ranks(tmp_path):
    write_corpus(str(tmp_path / "data"), SKEWED_LAYOUT)
    num_rows = sum(sum(f) for f in SKEWED_LAYOUT)
    common = ["--data", str(tmp_path / "data"), "--epochs", "1", "--batch-size", "40"]
    torchrun(2, *common, "--num-workers", "2", "--stop-after", "7",
             "--save-state", str(tmp_path / "ckpt.json"), "--report", str(tmp_path / "before"))
    torchrun(3, *common, "--num-workers", "1", "--resume", str(tmp_path / "ckpt.json"),
             "--report", str(tmp_path / "after"))

    before = [r["epochs"][0] for r in read_reports(tmp_path / "before", 2)]
    after = [r["epochs"][0] for r in read_reports(tmp_path / "after", 3)]
    assert all(run["steps"] == 7 for run in before)
    assert len({run["steps"] for run in after}) == 1  # equal steps on the new topology
    ids = np.sort(np.concatenate([np.array(run["sample_ids"], dtype=np.int64) for run in before + after]))
    np.testing.assert_array_equal(ids, np.arange(num_rows))
