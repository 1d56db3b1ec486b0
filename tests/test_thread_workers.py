"""StreamLoader's thread workers: the same batches, in the same order, as worker processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

import streamshard as ss
from streamshard.testing import write_corpus

from resume_harness import as_checkpoint, same_batches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    write_corpus(str(root), [[200, 30, 170], [90] * 4, [500], [7, 1]])
    return str(root)


def stream(path, **kwargs):
    return ss.ParquetStream(path, batch_size=64, shuffle=True, seed=2, rank=1, world_size=2, **kwargs)


def copies(batches):
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_thread_workers_deliver_what_process_workers_deliver_in_the_same_order(corpus, num_workers):
    threads = ss.StreamLoader(stream(corpus), num_workers=num_workers, workers="threads")
    processes = ss.StreamLoader(stream(corpus), num_workers=num_workers, workers="processes")
    assert threads.workers == "threads" and processes.workers == "processes"
    for epoch in range(2):
        threads.set_epoch(epoch)
        processes.set_epoch(epoch)
        got, expected = copies(threads), copies(processes)
        assert len(got) == len(expected) == threads.dataset.steps_per_epoch(num_workers)
        assert same_batches(got, expected), f"epoch {epoch}: thread workers differ from process workers"


def test_a_checkpoint_from_thread_workers_resumes_under_process_workers(corpus):
    full = copies(ss.StreamLoader(stream(corpus), num_workers=2, workers="processes"))
    first = ss.StreamLoader(stream(corpus), num_workers=2, workers="threads")
    iterator = iter(first)
    head = copies([next(iterator) for _ in range(3)])
    del iterator
    resumed = ss.StreamLoader(stream(corpus), num_workers=2, workers="processes")
    resumed.load_state_dict(as_checkpoint(first.state_dict()))
    assert same_batches(head + copies(resumed), full)


def test_auto_takes_threads_for_plain_streams_and_processes_otherwise(corpus):
    assert ss.StreamLoader(stream(corpus), num_workers=2).workers == "threads"
    assert ss.StreamLoader(stream(corpus, transform=lambda b: b), num_workers=2).workers == "processes"
    assert ss.StreamLoader(stream(corpus), num_workers=2, worker_init_fn=lambda w: None).workers == "processes"
    assert ss.StreamLoader(stream(corpus), num_workers=0).workers == "none"
    with pytest.raises(ValueError, match="workers must be"):
        ss.StreamLoader(stream(corpus), num_workers=2, workers="fibers")


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_a_prefetch_factor_that_is_not_a_positive_int_is_refused_for_threads_too(corpus, bad):
    """Thread workers size their queues with it: a negative one would make them unbounded."""
    with pytest.raises((ValueError, TypeError), match="prefetch_factor"):
        ss.StreamLoader(stream(corpus), num_workers=2, workers="threads", prefetch_factor=bad)
    with pytest.raises(ValueError, match="prefetch_factor needs num_workers"):
        ss.StreamLoader(stream(corpus), num_workers=0, prefetch_factor=4)


def test_a_worker_error_reaches_the_loop_with_its_type_and_leaving_early_stops_the_threads(corpus, tmp_path):
    before = threading.active_count()
    loader = ss.StreamLoader(stream(corpus), num_workers=3, workers="threads")
    iterator = iter(loader)
    next(iterator)
    del iterator  # an abandoned pass
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, "worker threads outlived the abandoned pass"

    write_corpus(str(tmp_path), [[50, 50]])
    bad = stream(str(tmp_path))
    bad.set_epoch(0)
    victim = sorted(tmp_path.glob("*.parquet"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[:4] + b"\0" * (len(data) - 8) + data[-4:])  # same size, pages destroyed
    import os
    os.utime(victim, ns=(1, 1))  # and an old mtime: the version check sees a change
    with pytest.raises(ss.ReadError, match=victim.name):
        list(ss.StreamLoader(bad, num_workers=2, workers="threads"))


def test_round_robin_keeps_the_order_and_delivers_every_batch_before_a_workers_error():
    """Workers hand batches over a few at a time; the loop still sees worker 0, 1, 2, 0, 1, 2, ...,
    and a worker that fails after producing some batches gets them delivered before its error."""
    from streamshard.loader.thread_workers import round_robin

    def worker(w, n, fail_after=None):
        for i in range(n):
            if fail_after is not None and i == fail_after:
                raise KeyError(f"worker {w} broke")
            yield {"w": w, "i": i, "x": torch.zeros(3)}

    got = [(b["w"], b["i"]) for b in round_robin([worker(w, 50) for w in range(3)], depth=2)]
    assert got == [(w, i) for i in range(50) for w in range(3)]

    got = []
    with pytest.raises(KeyError, match="worker 1 broke"):
        for b in round_robin([worker(0, 50), worker(1, 50, fail_after=37), worker(2, 50)], depth=2):
            got.append((b["w"], b["i"]))
    assert got == [(w, i) for i in range(37) for w in range(3)] + [(0, 37)]


def test_leaving_the_loop_mid_epoch_and_exiting_stops_the_worker_threads_first(corpus):
    """A script that stops reading mid-epoch and exits must not leave worker threads inside pyarrow
    or numpy while the interpreter finalizes (they abort the process when killed there): by the time
    atexit handlers run, no streamshard thread is alive, and the exit code is 0."""
    script = (
        "import atexit, threading, streamshard as ss\n"
        f"ds = ss.ParquetStream({str(corpus)!r}, batch_size=16, shuffle=True, rank=0, world_size=1)\n"
        "it = iter(ss.StreamLoader(ds, num_workers=2, workers='threads'))\n"
        "[next(it) for _ in range(3)]\n"
        "atexit.register(lambda: print('alive at exit:', sorted(t.name for t in threading.enumerate()\n"
        "                                                      if t.name.startswith('streamshard-'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "alive at exit: []" in done.stdout, done.stdout


def test_a_worker_that_hands_over_nothing_within_timeout_is_an_error_naming_the_timeout():
    import time as _time

    from streamshard.loader.thread_workers import round_robin

    def stuck():
        yield {"x": torch.zeros(1)}
        _time.sleep(5)
        yield {"x": torch.zeros(1)}

    got = []
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        for batch in round_robin([stuck(), stuck()], depth=2, timeout=0.5):
            got.append(batch)
    assert len(got) == 2  # the batches before the stall arrived


def test_a_ready_batch_reaches_the_loop_while_its_worker_waits_for_the_next_read():
    """A batch is never held back in the worker while it blocks on a slow read (a store that stalls
    must not stall batches already made)."""
    import threading as _threading

    from streamshard.loader.thread_workers import round_robin

    released = _threading.Event()

    def slow_store():
        yield {"i": 0}
        yield {"i": 1}
        released.wait(10)  # the next read hangs until the loop has both batches
        yield {"i": 2}

    got = []
    for batch in round_robin([slow_store()], depth=2, timeout=3):
        got.append(batch["i"])
        if batch["i"] == 1:
            released.set()
    assert got == [0, 1, 2]


def test_the_workers_start_together_so_their_first_reads_overlap():
    """A worker's first batch waits for its first reads: the workers start at once, not each after
    the one before has delivered (on object storage, a round trip per worker), and the order and a
    first-batch error or an empty worker are what they were."""
    from streamshard.loader.thread_workers import round_robin

    began, first_done = {}, {}

    def worker(w, n, fail_first=False):
        began[w] = time.monotonic()
        time.sleep(0.3)  # its first reads
        first_done[w] = time.monotonic()
        if fail_first:
            raise KeyError(f"worker {w} broke")
        for i in range(n):
            yield {"w": w, "i": i}

    got = [(b["w"], b["i"]) for b in round_robin([worker(w, 4) for w in range(3)], depth=2)]
    assert got == [(w, i) for i in range(4) for w in range(3)]
    assert max(began.values()) < min(first_done.values()), "a worker started only after another's first batch"

    got = []
    with pytest.raises(KeyError, match="worker 1 broke"):
        for b in round_robin([worker(0, 3), worker(1, 3, fail_first=True), worker(2, 3)], depth=2):
            got.append((b["w"], b["i"]))
    assert got == [(0, 0)]
    got = [(b["w"], b["i"]) for b in round_robin([worker(0, 2), worker(1, 0), worker(2, 3)], depth=2)]
    assert got == [(0, 0), (2, 0), (0, 1), (2, 1), (2, 2)]
