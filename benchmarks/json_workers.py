"""Persistent spawned processes that take JSON tasks over a pipe (never pickles): the raw pyarrow
baselines of ``throughput.py`` and ``remote.py`` run in them, imports warm, one task each per epoch."""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Callable
from typing import Any


class JsonWorkers:
    """``processes`` spawned processes each running ``serve(conn)``, which answers every JSON task
    with one JSON reply and returns on an empty message."""

    def __init__(self, serve: Callable[[Any], None], processes: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child,), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def ask(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One task per process, all at once; their replies in the same order."""
        for pipe, task in zip(self.pipes, tasks):
            pipe.send_bytes(json.dumps(task).encode())
        return [json.loads(pipe.recv_bytes()) for pipe in self.pipes[:len(tasks)]]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send_bytes(b"")
        for proc in self.procs:
            proc.join(timeout=10)


def serve_json(conn: Any, handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A worker's loop: one task in, ``handle(task)`` out, until an empty message; one torch thread
    (the processes are the parallelism)."""
    import torch

    torch.set_num_threads(1)
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        conn.send_bytes(json.dumps(handle(json.loads(message))).encode())
