"""An embedded S3 endpoint (moto's server) on 127.0.0.1, for fault-injection tests.

moto materialises a whole object on every ranged GET, so it is no yardstick for speed: the demo
and the benchmarks use a real object store (``streamshard.testing.seaweedfs``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

from .object_store import LocalObjectStore
from .server_process import accepts_connections, free_ports, server_process


@dataclass
class LocalS3(LocalObjectStore):
    """A running local S3 endpoint and the fsspec (s3fs) options that reach it."""

    key: str = "testing"
    secret: str = "testing"
    region: str = "us-west-2"

    protocol: ClassVar[str] = "s3"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }


@contextmanager
def local_s3(startup_timeout: float = 30.0) -> Iterator[LocalS3]:
    """Run moto's S3 server on 127.0.0.1 in a child process for the duration of the block.

    A separate process keeps the server from competing with the reader for the GIL, as a
    real endpoint would not; the process is stopped (and waited for) on exit.
    """
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with server_process("moto server", argv, lambda: accepts_connections(port), startup_timeout,
                        stop_timeout=10) as server:
        yield LocalS3(f"http://127.0.0.1:{port}", server.pid)
