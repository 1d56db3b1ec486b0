"""StreamLoader's thread workers: every worker of a rank as a thread of this process.

pyarrow decodes and reads without the GIL, so for a stream without a Python ``transform`` a worker
needs no process of its own: a thread runs each worker's pass (its own schedule, reader and
read-ahead), and batches reach the training loop without crossing a process boundary, so nothing is
copied or sent. The order is the one DataLoader gives process workers, round robin over workers
(every worker yields the same number of batches), so a checkpoint does not depend on the kind of
worker. A worker's exception is raised in the training loop, with its own type.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

_POLL_S = 0.1  # how often a worker blocked on a full queue checks whether the pass was abandoned


def round_robin(passes: list[Iterator[Any]], depth: int, timeout: float = 0) -> Iterator[Any]:
    """Run each iterator of ``passes`` in its own thread, ``depth`` batches ahead, and yield their
    batches round robin (worker 0, 1, ..., 0, 1, ...; an exhausted worker is skipped). Leaving the
    loop early stops the threads; ``timeout`` > 0 bounds the wait for one batch, in seconds."""
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
        try:
            for batch in batches:
                if not put(q, ("batch", batch)):
                    return
            put(q, ("end", None))
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop as it is
            put(q, ("error", exc))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # a generator's finally (read-ahead pool, readers) runs in its own thread

    threads = [threading.Thread(target=work, args=(p, q), name=f"streamshard-worker-{w}", daemon=True)
               for w, (p, q) in enumerate(zip(passes, queues))]
    for thread in threads:
        thread.start()
    try:
        active = list(range(len(passes)))
        while active:
            for worker in list(active):
                try:
                    kind, value = queues[worker].get(timeout=timeout if timeout > 0 else None)
                except queue.Empty:
                    raise RuntimeError(f"StreamLoader timed out after {timeout} seconds waiting for worker "
                                       f"{worker}") from None
                if kind == "end":
                    active.remove(worker)
                elif kind == "error":
                    raise value
                else:
                    yield value
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
