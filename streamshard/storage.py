"""Filesystems for URLs: one fsspec instance per protocol, reused for every file it serves.

Resolving a filesystem can be costly (an S3 client, credentials, a session), so neither the
catalog nor a reader should do it per file, whatever fsspec's own instance cache is set to.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
from fsspec.core import split_protocol


class FileSystems:
    """Maps URLs to ``(filesystem, path)``, creating each protocol's filesystem once."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self._by_protocol: dict[str, fsspec.AbstractFileSystem] = {}
        self._lock = threading.Lock()

    def resolve(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        protocol = split_protocol(url)[0] or "file"
        with self._lock:
            fs = self._by_protocol.get(protocol)
            if fs is None:
                fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
                self._by_protocol[protocol] = fs
                return fs, path
        return fs, fs._strip_protocol(url)
