"""tree_cpu_seconds: the CPU of worker processes that are still alive counts (getrusage's
RUSAGE_CHILDREN sees children only once they have exited and been reaped)."""

from __future__ import annotations

import multiprocessing as mp
import time

from streamshard.io.cpu_usage import tree_cpu_seconds


def _burn_then_wait(seconds: float, done) -> None:
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
    done.wait(30)


def test_counts_a_live_child_process_and_a_reaped_one_once():
    ctx = mp.get_context("fork")
    done = ctx.Event()
    before = tree_cpu_seconds()
    child = ctx.Process(target=_burn_then_wait, args=(0.3, done))
    child.start()
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds() - before < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = tree_cpu_seconds() - before
        assert child.is_alive() and alive >= 0.3  # the child's CPU, seen while it runs
    finally:
        done.set()
        child.join(10)
    reaped = tree_cpu_seconds() - before
    assert 0.3 <= reaped < alive + 0.3  # counted once after the child is reaped, not twice
