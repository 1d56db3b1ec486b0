"""The latency proxy (``streamshard.testing.FaultyProxy``) in a process of its own, for benchmarks.

In the benchmark's own process the proxy's Python threads would compete with the client for the
GIL and add their CPU to the client's ``process_time``: a real store's latency costs the client
neither. Here it runs in a child process; its counters are read over the child's stdin/stdout.

    with proxy_process(upstream, latency=0.020) as proxy:
        proxy.endpoint_url, proxy.count("GET", ".parquet"), proxy.bytes("GET"), proxy.reset_counts()
"""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

# The child: start the proxy, print its endpoint, then answer one JSON command per line.
_CHILD = """
import json, sys
from streamshard.testing import FaultConfig, faulty_proxy
with faulty_proxy(sys.argv[1], FaultConfig(latency=float(sys.argv[2]))) as proxy:
    print(json.dumps(proxy.endpoint_url), flush=True)
    for line in sys.stdin:
        command, args = json.loads(line)
        print(json.dumps(getattr(proxy, command)(*args)), flush=True)
"""


class ProxyProcess:
    """Handle on a ``FaultyProxy`` running in a child process (the same counting methods)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self._process = process
        self.pid = process.pid
        self.endpoint_url: str = self._read()

    def _read(self) -> Any:
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError("the latency proxy process exited")
        return json.loads(line)

    def _ask(self, command: str, *args: Any) -> Any:
        self._process.stdin.write(json.dumps([command, list(args)]) + "\n")
        self._process.stdin.flush()
        return self._read()

    def count(self, method: str | None = None, path: str | None = None) -> int:
        return self._ask("count", method, path)

    def bytes(self, method: str | None = None, path: str | None = None) -> int:
        return self._ask("bytes", method, path)

    def reset_counts(self) -> None:
        self._ask("reset_counts")

    def request_counts(self) -> list[tuple[str, str, int]]:
        return [tuple(x) for x in self._ask("request_counts")]


@contextmanager
def proxy_process(upstream: str, latency: float) -> Iterator[ProxyProcess]:
    """A latency proxy in front of ``upstream`` in a child process on 127.0.0.1, stopped on exit."""
    root = str(Path(__file__).resolve().parents[1])
    process = subprocess.Popen([sys.executable, "-c", _CHILD, upstream, str(latency)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=root, env=_env(root))
    try:
        yield ProxyProcess(process)
    finally:
        process.stdin.close()  # the child's loop ends, the proxy stops
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _env(root: str) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env
