"""An embedded S3 endpoint (moto's server) on 127.0.0.1, for tests, the demo and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class LocalS3:
    """A running local S3 endpoint and the fsspec options that reach it."""

    endpoint_url: str
    pid: int | None = None  # the server process, so benchmarks can account for its CPU time

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-west-2"},
        }

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def upload(self, local_dir: str, bucket: str, prefix: str = "") -> str:
        """Create ``bucket`` and copy every file of ``local_dir`` under ``prefix``; return the URL."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        target = f"{bucket}/{prefix}".rstrip("/")
        for name in sorted(os.listdir(local_dir)):
            fs.put_file(os.path.join(local_dir, name), f"{target}/{name}")
        return f"s3://{target}"


@contextmanager
def local_s3(startup_timeout: float = 30.0) -> Iterator[LocalS3]:
    """Run moto's S3 server on 127.0.0.1 in a child process for the duration of the block.

    A separate process keeps the server from competing with the reader for the GIL, as a
    real endpoint would not; the process is stopped (and waited for) on exit.
    """
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_until_listening(port, server, startup_timeout)
        yield LocalS3(f"http://127.0.0.1:{port}", server.pid)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_listening(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"moto server exited with code {server.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"moto server did not listen on 127.0.0.1:{port} within {timeout} s")
