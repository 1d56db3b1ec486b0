"""A real multi-process run: torchrun, two ranks, gloo on CPU, a tiny DDP model over a skewed corpus."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from streamshard.testing import write_corpus
from conftest import SKEWED_LAYOUT

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_train_an_epoch_with_equal_steps_and_see_every_row_once(tmp_path):
    write_corpus(str(tmp_path / "data"), SKEWED_LAYOUT)
    num_rows = sum(sum(f) for f in SKEWED_LAYOUT)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        str(EXAMPLE), "--data", str(tmp_path / "data"), "--epochs", "2", "--batch-size", "50",
        "--num-workers", "2", "--report", str(tmp_path / "report"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    reports = [json.loads((tmp_path / "report" / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        runs = [r["epochs"][epoch] for r in reports]
        assert runs[0]["steps"] == runs[1]["steps"] > 0
        ids = np.sort(np.concatenate([np.array(run["sample_ids"], dtype=np.int64) for run in runs]))
        np.testing.assert_array_equal(ids, np.arange(num_rows))
    first, second = (reports[0]["epochs"][e]["sample_ids"] for e in range(2))
    assert first != second  # each epoch is shuffled anew, also in persistent workers
