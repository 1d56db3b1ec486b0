"""Filesystems for URLs: one fsspec instance per protocol, reused for every file it serves.

Resolving a filesystem can be costly (an S3 client, credentials, a session), so neither the
catalog nor a reader should do it per file, whatever fsspec's own instance cache is set to.

Retries are ours (``streamshard.retry``): where a backend has its own retry layer and lets us
configure it, we turn it down to one attempt (unless the caller set it), so the bounds on
attempts and time that the caller chose are the bounds that hold.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from typing import Any, Iterable

import fsspec
from fsspec.core import split_protocol

# Per-protocol defaults that make the backend's own retries a single attempt and its waits
# bounded. Caller's storage_options win, key by key (dicts merge one level deep).
_BACKEND_DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {
        "config_kwargs": {
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # botocore's
            "connect_timeout": 10,
            "read_timeout": 30,
            "max_pool_connections": 64,  # enough for the catalog's concurrent footer reads
        },
    },
}
_BACKEND_DEFAULTS["s3a"] = _BACKEND_DEFAULTS["s3"]
# Instance attributes set the same way (s3fs reads its own retry count from ``self.retries``).
_BACKEND_ATTRIBUTES: dict[str, dict[str, Any]] = {"s3": {"retries": 1}, "s3a": {"retries": 1}}

# storage_options keys whose string values are secrets (matched as substrings, lower case).
_SECRET_KEY_PARTS = ("secret", "token", "password", "passwd", "credential", "key", "session", "auth", "sas")


class FileSystems:
    """Maps URLs to ``(filesystem, path)``, creating each protocol's filesystem once."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self._secrets = sorted(set(_secret_values(self.storage_options)), key=len, reverse=True)
        self._by_protocol: dict[str, fsspec.AbstractFileSystem] = {}
        self._lock = threading.Lock()

    def resolve(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        protocol = split_protocol(url)[0] or "file"
        with self._lock:
            fs = self._by_protocol.get(protocol)
            if fs is None:
                fs = self._by_protocol[protocol] = _shared_filesystem(protocol, url, self.storage_options)
        return fs, fs._strip_protocol(url)

    def redact(self, text: str) -> str:
        """``text`` with every secret of the storage options replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


# Filesystems shared by every FileSystems of this process with the same protocol and options:
# readers are made per epoch and per worker, and a new S3 client plus its first request took
# 75-310 ms here (a request on a warm client: ~5 ms). Keyed by
# process id too, because an async client must not be used across a fork.
_SHARED: dict[tuple[int, str, str], Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared_filesystem(protocol: str, url: str, storage_options: dict[str, Any]) -> Any:
    key = (os.getpid(), protocol, json.dumps(storage_options, sort_keys=True, default=repr))
    with _SHARED_LOCK:
        fs = _SHARED.get(key)
        if fs is None:
            fs = _SHARED[key] = _new_filesystem(protocol, url, storage_options)[0]
        return fs


def _new_filesystem(protocol: str, url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    options = with_backend_defaults(protocol, storage_options)
    attributes = {k: v for k, v in _BACKEND_ATTRIBUTES.get(protocol, {}).items() if k not in storage_options}
    if attributes:
        options = {**options, "skip_instance_cache": True}  # a private instance: ours to configure
    fs, path = fsspec.core.url_to_fs(url, **options)
    for name, value in attributes.items():
        setattr(fs, name, value)
    return fs, path


def with_backend_defaults(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` completed with the backend defaults above (the caller's values win)."""
    defaults = _BACKEND_DEFAULTS.get(protocol)
    if not defaults:
        return dict(storage_options)
    merged = copy.deepcopy(defaults)
    for key, value in storage_options.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def is_async(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` serves many ranged requests concurrently (``cat_ranges`` gathers them)."""
    return bool(getattr(fs, "async_impl", False))


def _secret_values(options: Any, secret_key: bool = False) -> Iterable[str]:
    """String values stored under secret-looking keys, however deeply nested."""
    if isinstance(options, dict):
        for key, value in options.items():
            is_secret = secret_key or any(part in str(key).lower() for part in _SECRET_KEY_PARTS)
            yield from _secret_values(value, is_secret)
    elif isinstance(options, (list, tuple)):
        for value in options:
            yield from _secret_values(value, secret_key)
    elif secret_key and isinstance(options, str) and len(options) >= 4:
        yield options


def check_short_read(
    fs: fsspec.AbstractFileSystem, path: str, url: str, size: int, got: int, want: int, error: type[Exception]
) -> None:
    """Called when a ranged read returned ``got`` of ``want`` bytes; always raises.

    A file whose size differs from the cataloged ``size`` changed under us: ``error`` (permanent,
    naming the URL). Otherwise the body was cut short in transit: ``TransientError`` (retried).
    """
    from .retry import TransientError

    try:
        fs.invalidate_cache(path)  # a listing cache would otherwise answer with the old size
        now = int(fs.info(path)["size"])
    except FileNotFoundError:
        raise error(f"{url}: file no longer exists (it was cataloged with {size} bytes)") from None
    except Exception:  # noqa: BLE001 - cannot tell whether it changed; let the retry policy decide
        now = size
    if now != size:
        raise error(f"{url}: file is {now} bytes now but was cataloged with {size}; did it change?")
    raise TransientError(f"{url}: got {got} of {want} bytes (truncated response)")
