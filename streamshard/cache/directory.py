"""Identity and ownership of an activation cache directory: ``meta.json``, the lock, the open files.

``meta.json`` records the format, a digest of the caller's key and the record spec; a directory
written under another key or format is wiped on open rather than trusted. A directory belongs to one
process at a time through an ``flock`` on ``.lock`` (:class:`DirectoryLock`), which forked children
never keep.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch

from .disk import DiskTier
from .errors import CacheLockedError

__all__ = ["CacheFiles", "DirectoryLock", "RecordSpec", "key_digest", "open_disk", "read_meta", "wipe_files"]

_FORMAT = "streamshard.activation_cache/1"
_MAX_RECORD_BYTES = 1 << 30  # per sample; a meta.json claiming more is damaged, not a plan


@dataclass(frozen=True)
class RecordSpec:
    """Per-sample record shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize  # exact: a damaged shape must not overflow

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_json(cls, meta: dict) -> "RecordSpec":
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {meta['dtype']!r}")
        shape = meta["shape"]
        if not isinstance(shape, list):
            raise ValueError(f"shape must be a list of positive ints, got {shape!r}")
        return cls.checked(shape, dtype)

    @classmethod
    def checked(cls, shape: Sequence[object], dtype: torch.dtype) -> "RecordSpec":
        """A spec whose dims are positive ints and whose record fits the per-record limit, else ValueError."""
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise ValueError(f"a record's shape must be positive ints, got {list(shape)!r}")
        spec = cls(tuple(int(d) for d in shape), dtype)  # type: ignore[arg-type]
        if spec.nbytes > _MAX_RECORD_BYTES:
            raise ValueError(f"a record of shape {spec.shape} {dtype} takes {spec.nbytes:,} bytes, over the "
                             f"{_MAX_RECORD_BYTES:,} a cache record may hold")
        return spec


class CacheFiles:
    """The disk tier and the directory lock: released once, and only by the process that opened them."""

    def __init__(self) -> None:
        self.disk: DiskTier | None = None
        self.lock: DirectoryLock | None = None
        self.pid = os.getpid()

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child must not commit or unlock the parent's files
            return
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class DirectoryLock:
    """An exclusive ``flock`` on ``directory/.lock`` that belongs to the process that took it.

    An flock belongs to the open file description, and a forked child shares it: a DataLoader worker
    forked while a cache is open (say, ``persistent_workers=True``) would keep the directory locked
    after the parent's ``close()``. So every forked child closes its copy of the fd right after the
    fork (``os.register_at_fork``), and the fd is close-on-exec, so programs started later never get it.
    Raises :class:`CacheLockedError` if another process or another open file (a second cache object
    in this process) holds the lock.
    """

    _held: ClassVar[set["DirectoryLock"]] = set()  # the locks this process took and has not released

    def __init__(self, directory: Path) -> None:
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CacheLockedError(
                f"cache directory {directory} is already open in another process or cache object; "
                "give each rank its own subdirectory, e.g. f'{root}/rank{rank}'"
            ) from None
        self.fd: int | None = fd
        self.pid = os.getpid()
        DirectoryLock._held.add(self)

    def release(self) -> None:
        """Unlock the directory. Idempotent; does nothing in a process other than the one that locked."""
        if self.fd is None or os.getpid() != self.pid:
            return
        DirectoryLock._held.discard(self)
        fd, self.fd = self.fd, None
        os.close(fd)  # the last fd on the open file description: the flock goes with it

    @classmethod
    def _drop_inherited(cls) -> None:
        """In a freshly forked child: close the fds of the parent's locks (the parent keeps its lock)."""
        for lock in cls._held:
            fd, lock.fd = lock.fd, None
            try:
                os.close(fd)
            except OSError:  # already closed by whatever forked us (e.g. a close-all-fds daemoniser)
                pass
        cls._held.clear()


os.register_at_fork(after_in_child=DirectoryLock._drop_inherited)


def key_digest(key: str | bytes | None) -> str:
    """Hex SHA-256 of the format and the caller's key: what ``meta.json`` and every checksum carry."""
    raw_key = key.encode() if isinstance(key, str) else (key or b"")
    return hashlib.sha256(_FORMAT.encode() + b"\0" + raw_key).hexdigest()


def read_meta(directory: Path, digest: str, warn: Callable[[str], None]) -> RecordSpec | None:
    """The record spec stored under this key, or None (wiping entries written under another key)."""
    path = directory / "meta.json"
    if not path.exists():
        wipe_files(directory)  # no identity: whatever is left cannot be trusted
        return None
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") == _FORMAT and meta.get("key_sha256") == digest:
            return RecordSpec.from_json(meta)
        reason = "written under a different key"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        reason = f"unreadable metadata ({exc})"
    warn(f"discarding cache entries in {directory}: {reason}")
    wipe_files(directory)
    return None


def wipe_files(directory: Path) -> None:
    """Delete the cache's data and metadata files (not the lock)."""
    for name in ("index.npy", "index.npy.tmp", "slots.bin", "meta.json"):
        (directory / name).unlink(missing_ok=True)


def open_disk(
    directory: Path, digest: str, spec: RecordSpec, budget_bytes: int, warn: Callable[[str], None]
) -> DiskTier:
    """Write ``meta.json`` if new and open the disk tier, its checksums salted with key and spec."""
    _write_meta(directory, digest, spec)
    salt_src = hashlib.sha256(f"{digest}:{json.dumps(spec.to_json())}".encode()).digest()
    salt = np.frombuffer(salt_src[:8], np.uint64)[0] | np.uint64(1)  # never 0: zeroed slots must fail
    return DiskTier(directory, spec.nbytes, budget_bytes, salt, warn)


def _write_meta(directory: Path, digest: str, spec: RecordSpec) -> None:
    meta_path = directory / "meta.json"
    if not meta_path.exists():
        meta = {"format": _FORMAT, "key_sha256": digest, **spec.to_json()}
        tmp = directory / "meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, meta_path)
