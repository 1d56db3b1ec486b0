"""An embedded S3 endpoint (moto's server) on 127.0.0.1, for tests, the demo and benchmarks."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class LocalS3:
    """A running local S3 endpoint and the fsspec options that reach it."""

    endpoint_url: str

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            "skip_instance_cache": True,
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
def local_s3() -> Iterator[LocalS3]:
    """Run moto's S3 server on 127.0.0.1 (a free port) for the duration of the block."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server._server.server_address  # moto exposes no public accessor for the bound port
        yield LocalS3(f"http://{host}:{port}")
    finally:
        server.stop()
