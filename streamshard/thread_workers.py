"""StreamLoader's thread workers: every worker of a rank as a thread of this process.

pyarrow decodes and reads without the GIL, so for a stream without a Python ``transform`` a worker
needs no process of its own: a thread runs each worker's pass (its own schedule, reader and
read-ahead), and batches reach the training loop without crossing a process boundary, so nothing is
copied or sent. The order is the one DataLoader gives process workers, round robin over workers
(every worker yields the same number of batches), so a checkpoint does not depend on the kind of
worker. A worker's exception is raised in the training loop, with its own type.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections import deque
from typing import Any, Iterator

_POLL_S = 0.1  # how often a worker blocked on a full queue checks whether the pass was abandoned
_CHUNK_BATCHES, _CHUNK_BYTES = 8, 4 << 20  # batches a worker hands over at once, at most
_EXIT_JOIN_S = 10.0  # how long interpreter exit waits for running passes to stop

# Passes still running, stopped at interpreter exit: a thread left in pyarrow or numpy when the
# interpreter finalizes is killed as it retakes the GIL, and the C++ frames it unwinds abort the
# process ("terminate called without an active exception"), e.g. after a loop left mid-epoch.
_running: set[tuple[threading.Event, tuple[threading.Thread, ...]]] = set()
_running_lock = threading.Lock()


def _stop_running_passes() -> None:
    with _running_lock:
        passes = list(_running)
    for stop, _ in passes:
        stop.set()
    deadline = time.monotonic() + _EXIT_JOIN_S
    for _, threads in passes:
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


# Before the interpreter joins its threads and abandons daemon ones (what concurrent.futures uses).
getattr(threading, "_register_atexit", atexit.register)(_stop_running_passes)


def _nbytes(batch: Any) -> int:
    if isinstance(batch, dict):
        return sum(v.nbytes for v in batch.values() if hasattr(v, "nbytes"))
    return 0


def round_robin(passes: list[Iterator[Any]], depth: int, timeout: float = 0) -> Iterator[Any]:
    """Run each iterator of ``passes`` in its own thread, ``depth`` hand-offs ahead, and yield their
    batches round robin (worker 0, 1, ..., 0, 1, ...; an exhausted worker is skipped). A hand-off
    carries up to 8 batches or 4 MiB (fewer when the loop is waiting for that worker): each one
    wakes a thread, which costs more than a small batch. Leaving the loop early stops the threads;
    ``timeout`` > 0 bounds the wait for one hand-off, in seconds."""
    queues: list[queue.Queue] = [queue.Queue(maxsize=depth) for _ in passes]
    stop = threading.Event()

    def put(q: queue.Queue, item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def work(batches: Iterator[Any], q: queue.Queue) -> None:
        chunk: list[Any] = []
        size = 0
        try:
            for batch in batches:
                chunk.append(batch)
                size += _nbytes(batch)
                # A handful of batches per hand-off (each one wakes the loop's thread), but at once
                # when the loop is waiting for this worker.
                if len(chunk) >= _CHUNK_BATCHES or size >= _CHUNK_BYTES or q.empty():
                    if not put(q, ("batches", chunk)):
                        return
                    chunk, size = [], 0
            if chunk and not put(q, ("batches", chunk)):
                return
            put(q, ("end", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop as it is
            if chunk and not put(q, ("batches", chunk)):  # the batches before the failure arrive first
                return
            put(q, ("error", exc))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # a generator's finally (read-ahead pool, readers) runs in its own thread

    threads = [threading.Thread(target=work, args=(p, q), name=f"streamshard-worker-{w}", daemon=True)
               for w, (p, q) in enumerate(zip(passes, queues))]
    running = (stop, tuple(threads))
    with _running_lock:
        _running.add(running)
    for thread in threads:
        thread.start()
    try:
        active = list(range(len(passes)))
        received: list[deque[Any]] = [deque() for _ in passes]
        while active:
            for worker in list(active):
                if not received[worker]:
                    try:
                        kind, value = queues[worker].get(timeout=timeout if timeout > 0 else None)
                    except queue.Empty:
                        raise RuntimeError(f"StreamLoader timed out after {timeout} seconds waiting for worker "
                                           f"{worker}") from None
                    if kind == "end":
                        active.remove(worker)
                        continue
                    if kind == "error":
                        raise value
                    received[worker].extend(value)
                yield received[worker].popleft()
    finally:
        stop.set()
        for q in queues:  # unblock workers waiting to put
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for thread in threads:
            thread.join(timeout=30)
        with _running_lock:
            _running.discard(running)
