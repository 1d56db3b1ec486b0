"""StreamLoader's thread workers: the workers of a rank as threads of this process.

pyarrow reads and decodes without the GIL, so for a stream without a Python ``transform`` a worker
needs no process of its own: each worker's pass (its own schedule, reader and read-ahead threads,
where the decoding happens) runs in this process, and batches reach the training loop without
crossing a process boundary, so nothing is copied or sent.

One producer thread advances every worker's pass in turn. What a pass does between reads (its
schedule, gathering rows into tensors) is Python and numpy that mostly holds the GIL, so threads
doing it take turns: on 2 cores one producer was as fast as a thread per worker (interleaved A/B,
2 workers: 353k vs 359k rows/s unshuffled, 183k vs 182k shuffled), with fewer threads. The
decoding, the bulk of the work, stays parallel: ``read_ahead`` reads in flight per worker. The
passes start together (each worker's first batch in a thread of its own), so their first reads
overlap. A batch is handed over as soon as it is ready; the loop's thread is woken only when it waits.

The order is the one DataLoader gives process workers, round robin over workers (every worker
yields the same number of batches), so a checkpoint does not depend on the kind of worker. A
worker's exception is raised in the training loop, with its own type, after the batches before it.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from typing import Any, Iterator

_POLL_S = 0.1  # how often a worker blocked on a full queue checks whether the pass was abandoned
_CHUNK_BATCHES, _CHUNK_BYTES = 8, 4 << 20  # ready batches (and their bytes) per worker and depth unit, at most
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


def _first_batches(passes: list[Iterator[Any]]) -> list[tuple[str, Any]]:
    """Each pass's first batch (``("batch", b)``, ``("end", None)`` or ``("error", exc)``), made at once.

    A pass starts reading only when first advanced, and its first batch waits for those reads: in
    turn, every worker after the first would wait for its own (a round trip each on object storage)
    while the others' reads sat finished. So the passes start together, each in a thread of its own."""
    firsts: list[tuple[str, Any]] = [("end", None)] * len(passes)

    def first(i: int) -> None:
        try:
            firsts[i] = ("batch", next(passes[i]))
        except StopIteration:
            firsts[i] = ("end", None)
        except BaseException as exc:  # noqa: BLE001 - raised in its turn, with its own type
            firsts[i] = ("error", exc)

    threads = [threading.Thread(target=first, args=(i,), name=f"streamshard-start-{i}", daemon=True)
               for i in range(1, len(passes))]
    for thread in threads:
        thread.start()
    if passes:
        first(0)
    for thread in threads:
        thread.join()
    return firsts


def round_robin(passes: list[Iterator[Any]], depth: int, timeout: float = 0) -> Iterator[Any]:
    """Run the iterators of ``passes`` in one background thread, in turn, and yield their batches
    round robin (worker 0, 1, ..., 0, 1, ...; an exhausted worker is skipped). Up to 8 ``depth``
    batches per worker wait ready (``depth`` per worker once they hold 4 MiB each). The thread wakes
    the loop only when it waits, and a batch is never held back while the thread works on the
    next one. Leaving the loop early stops the thread; ``timeout`` > 0 bounds the wait for a
    batch, in seconds."""
    lock = threading.Lock()
    has_batches, has_room = threading.Condition(lock), threading.Condition(lock)
    ready: deque[Any] = deque()
    held = [0]  # bytes of the ready batches
    outcome: list[tuple[str, Any]] = []  # ("end", None) or ("error", exception), once the thread stops
    stop = threading.Event()
    workers = max(1, len(passes))
    most, most_bytes = _CHUNK_BATCHES * depth * workers, _CHUNK_BYTES * depth * workers

    def full() -> bool:
        return len(ready) >= most or (len(ready) >= depth * workers and held[0] >= most_bytes)

    def in_turn() -> Iterator[Any]:
        active = list(passes)
        for batches, (kind, value) in zip(passes, _first_batches(passes)):
            if kind == "end":
                active.remove(batches)
            elif kind == "error":
                raise value
            else:
                yield value
        while active:
            for batches in list(active):
                try:
                    batch = next(batches)
                except StopIteration:
                    active.remove(batches)
                    continue
                yield batch

    def work() -> None:
        try:
            for batch in in_turn():
                size = _nbytes(batch)
                with lock:
                    while full() and not stop.is_set():
                        has_room.wait(_POLL_S)
                    if stop.is_set():
                        return
                    ready.append((batch, size))
                    held[0] += size
                    has_batches.notify()
            result: tuple[str, Any] = ("end", None)
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop as it is
            result = ("error", exc)
        finally:
            for batches in passes:  # a generator's finally (read-ahead pool, readers) runs here
                close = getattr(batches, "close", None)
                if close is not None:
                    close()
        with lock:
            outcome.append(result)
            has_batches.notify()

    thread = threading.Thread(target=work, name="streamshard-workers", daemon=True)
    running = (stop, (thread,))
    with _running_lock:
        _running.add(running)
    thread.start()
    try:
        while True:
            with lock:
                while not ready and not outcome:
                    if not has_batches.wait(timeout if timeout > 0 else None) and not ready and not outcome:
                        raise RuntimeError(f"StreamLoader timed out after {timeout} seconds waiting for its workers")
                taken = list(ready)  # everything ready: one wake-up for several small batches
                ready.clear()
                held[0] = 0
                has_room.notify()
                if not taken:
                    kind, value = outcome[0]
                    if kind == "error":
                        raise value
                    return
            for batch, _ in taken:
                yield batch
    finally:
        stop.set()
        thread.join(timeout=30)
        with _running_lock:
            _running.discard(running)
