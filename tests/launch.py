"""Run a job script the way its users do (under torchrun, gloo on CPU, or as one process), for the
framework tests; and the checks they share on what each rank reported."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nproc: int | None, script: Path, *args: str, timeout: float = 240,
           env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int | None, str]:
    """Run ``script`` under torchrun with ``nproc`` processes, or as one plain process (None).

    Returns the exit status (None: killed after ``timeout`` seconds, with every process it started)
    and the output's tail."""
    if nproc is None:
        command = [sys.executable, str(script), *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *args]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                           env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=timeout)
        return job.returncode, out[-6000:]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGUSR1)  # job scripts that registered faulthandler on it print their stacks
        time.sleep(3)
        os.killpg(job.pid, signal.SIGTERM)  # torchrun passes it on to the ranks (if SIGUSR1 left it alive)
        try:
            out, _ = job.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            out, _ = job.communicate()
        return None, f"killed after {timeout} s:\n{out[-30000:]}"


def stacks_then_kill(proc: subprocess.Popen) -> str:
    """End a hung job started with ``start_new_session=True`` (its ranks and their DataLoader workers in
    its process group): ``SIGUSR1`` first, so every process whose script registered ``faulthandler`` on
    it (``faulthandler.register(signal.SIGUSR1, all_threads=True)``; forked workers inherit it) prints every thread's stack into the output, then ``SIGKILL``. Returns
    the whole output."""
    os.killpg(proc.pid, signal.SIGUSR1)
    try:
        out, _ = proc.communicate(timeout=5)  # a process without the handler ends on SIGUSR1 itself
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rest of the group (orphaned workers)
    except ProcessLookupError:
        pass
    return out


def check(done: tuple[int | None, str]) -> None:
    assert done[0] == 0, done[1]


def assert_ids_exactly_once(batches_of_every_rank: list[list[list[int]]], num_rows: int) -> None:
    """Every rank's reported batches (lists of real sample ids) hold each of ``num_rows`` rows once."""
    ids = np.array([i for batches in batches_of_every_rank for batch in batches for i in batch], dtype=np.int64)
    unique = len(np.unique(ids))
    assert len(ids) == unique == num_rows, f"{num_rows - unique} rows never delivered, {len(ids) - unique} twice"


def assert_equal_steps(passes: list[dict]) -> None:
    steps = [len(p["batches"]) for p in passes]
    assert len(set(steps)) == 1, f"ranks took different step counts: {steps}"
