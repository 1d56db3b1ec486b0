"""Run a local server binary for the length of a block: free ports, readiness, a clean stop.

Shared by the embedded storage servers (moto, SeaweedFS, fake-gcs-server). The server's output
goes to a file (or nowhere), never to a pipe nobody drains: a full pipe would stall the server.
"""

from __future__ import annotations

import socket
import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

LOG_TAIL_BYTES = 4000  # how much of the server's log a startup error quotes


class ServerStartError(RuntimeError):
    """A local server exited or did not become ready; the message quotes the end of its log."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 (all held open until all are chosen)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@contextmanager
def server_process(
    name: str,
    argv: Sequence[str],
    ready: Callable[[], bool],
    timeout: float,
    *,
    log_path: str | Path | None = None,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    stop_timeout: float = 15.0,
) -> Iterator[subprocess.Popen]:
    """Start ``argv``, wait until ``ready()`` is true, yield the process; terminate and wait on exit.

    Output goes to ``log_path`` (or is discarded). A process that exits, or is not ready within
    ``timeout`` seconds, raises ``ServerStartError`` with the end of that log. On exit the process
    gets SIGTERM, then SIGKILL if it has not stopped after ``stop_timeout`` seconds.
    """
    with ExitStack() as stack:
        output = stack.enter_context(open(log_path, "wb")) if log_path else subprocess.DEVNULL
        server = subprocess.Popen(list(argv), stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  cwd=cwd, env=None if env is None else dict(env))
        try:
            _wait_until_ready(name, server, ready, timeout, log_path)
            yield server
        finally:
            stop(server, stop_timeout)


def stop(server: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL; always reaps the process."""
    if server.poll() is not None:
        return
    server.terminate()
    try:
        server.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _wait_until_ready(name: str, server: subprocess.Popen, ready: Callable[[], bool], timeout: float,
                      log_path: str | Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ServerStartError(f"{name} exited with code {server.returncode} before it was ready"
                                   f"{_log_tail(log_path)}")
        if ready():
            return
        time.sleep(0.05)
    raise ServerStartError(f"{name} was not ready within {timeout} s{_log_tail(log_path)}")


def _log_tail(log_path: str | Path | None) -> str:
    if not log_path:
        return ""
    try:
        text = Path(log_path).read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")
    except OSError:
        return ""
    return f"; the end of its log ({log_path}):\n{text}"
