"""ActivationCache: outputs of a frozen model prefix, kept by ``sample_id`` in host memory and on disk.

When the first layers of a model are frozen their output for a sample never changes, so it can be
computed once and read back from the second epoch on. Records are fixed-size (shape and dtype are
fixed by the first ``put``) and immutable: a sample id is written once and never overwritten.

Tiers
    host   a byte-bounded in-memory array. Policy: *keep-first* (no replacement once full). A training
           epoch is a scan over the same ids; on a cyclic scan larger than the capacity LRU evicts
           every entry just before it is needed again (0% hits), while keep-first serves the same
           ``capacity / working_set`` fraction every epoch that MRU eviction or Belady would, with no
           bookkeeping or copying per access. Disk hits are promoted while there is room.
    disk   optional, in ``directory``: a slot file of fixed-size records ``[sample_id, checksum,
           payload]`` appended with ``os.pwrite`` and read through ``np.memmap``, plus ``index.npy``
           (slot -> sample_id) committed by write-then-rename. Same keep-first policy, bounded by
           ``disk_bytes``. Every read verifies the record's sample id and checksum (which also mixes in
           the key and record spec), so a torn or corrupted record is a miss, never garbage. Writes
           never go through the memory map: a full disk raises ``ENOSPC`` from ``pwrite`` (a warning;
           the cache keeps serving and recomputing) instead of a ``SIGBUS``.

Identity: ``key`` (a caller fingerprint, e.g. :func:`module_fingerprint` of the frozen prefix) is
hashed into ``meta.json`` and every record's checksum. Opening a directory written under another key
discards its entries. A directory belongs to one process at a time (an ``flock``); ranks sharing a
node use one subdirectory each, e.g. ``f"{root}/rank{rank}"``.

Padding rows (``sample_id == -1``, any negative id) are never stored or looked up: always misses.

Limits, by design: keep-first never evicts, so a tier filled with ids this process stops seeing
(e.g. after an elastic resize) stays filled until :meth:`ActivationCache.clear`. With several ranks
and ``shuffle=True`` each rank reads a different share of the ids every epoch, so a per-rank cache
hits about ``1 - (1 - 1/world_size) ** epochs_seen`` of its lookups (given enough ``disk_bytes``),
not 100% from epoch 2 as with one rank or a fixed assignment.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
import torch

from .errors import StreamshardError

__all__ = [
    "ActivationCache",
    "CacheError",
    "CacheLockedError",
    "CacheStats",
    "CacheWarning",
    "RecordSpecError",
    "module_fingerprint",
]

logger = logging.getLogger(__name__)

SampleIds = Union[torch.Tensor, np.ndarray, Sequence[int]]
_FORMAT = "streamshard.activation_cache/1"
_EMPTY, _TOMB = -1, -2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_HEADER_WORDS = 2  # sample_id, checksum


class CacheError(StreamshardError, RuntimeError):
    """The cache cannot do what was asked (closed, used after fork, bad ``fn`` output)."""


class CacheLockedError(CacheError):
    """Another process (or another cache object) already has this cache directory open."""


class RecordSpecError(CacheError, ValueError):
    """A tensor's per-sample shape or dtype differs from the records already in the cache."""


class CacheWarning(UserWarning):
    """The disk tier degraded (full, write error, corrupt record); values are recomputed instead."""


@dataclass(frozen=True)
class CacheStats:
    """Counters since open (or :meth:`ActivationCache.reset_stats`) and current sizes.

    ``misses`` counts real samples not found; padding rows are counted in ``padding`` only.
    """

    host_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    padding: int = 0
    corrupt: int = 0
    host_records: int = 0
    host_bytes: int = 0
    disk_records: int = 0
    disk_bytes: int = 0

    @property
    def hits(self) -> int:
        return self.host_hits + self.disk_hits

    @property
    def hit_rate(self) -> float:
        """Hits over real (non-padding) lookups; 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def module_fingerprint(module: torch.nn.Module, extra: str | bytes = b"") -> str:
    """SHA-256 of a module's structure (``repr``) and every parameter and buffer, plus ``extra``.

    Use it as the cache ``key`` of a frozen prefix: changing a weight, a layer or ``extra`` (say, the
    number of frozen layers or a preprocessing version) changes the key. Custom ``forward`` code is not
    covered; put a version string for it in ``extra``.
    """
    h = hashlib.sha256(repr(module).encode())
    h.update(extra.encode() if isinstance(extra, str) else bytes(extra))
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(tensor.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class _Spec:
    """Per-sample record shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_json(cls, meta: dict) -> "_Spec":
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {meta['dtype']!r}")
        return cls(tuple(int(d) for d in meta["shape"]), dtype)


class _IdIndex:
    """Open-addressing (linear probing) map from ids >= 0 to int64 slots, vectorised over a batch."""

    def __init__(self) -> None:
        self._alloc(10)
        self.size = 0

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._keys = np.full(1 << bits, _EMPTY, np.int64)
        self._vals = np.zeros(1 << bits, np.int64)
        self._used = 0  # live keys + tombstones

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return ((ids.astype(np.uint64) * _GOLDEN) >> np.uint64(64 - self._bits)).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """Table position of each id, -1 if absent."""
        out = np.full(ids.size, -1, np.int64)
        idx, pos, mask = np.arange(ids.size), self._home(ids), (1 << self._bits) - 1
        while idx.size:
            k = self._keys[pos]
            found = k == ids[idx]
            out[idx[found]] = pos[found]
            go = ~found & (k != _EMPTY)
            idx, pos = idx[go], (pos[go] + 1) & mask
        return out

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 if absent."""
        pos = self._find(ids)
        return np.where(pos >= 0, self._vals[np.maximum(pos, 0)], -1)

    def insert(self, ids: np.ndarray, vals: np.ndarray) -> None:
        """Add ids, which must be unique and absent."""
        if 2 * (self._used + ids.size) > (1 << self._bits):
            live = self._keys >= 0
            keys, old = self._keys[live], self._vals[live]
            self._alloc(max(self._bits, int(4 * (keys.size + ids.size)).bit_length()))
            self._place(keys, old)
        self._place(ids, vals)
        self.size += ids.size

    def _place(self, ids: np.ndarray, vals: np.ndarray) -> None:
        idx, pos, mask = np.arange(ids.size), self._home(ids), (1 << self._bits) - 1
        while idx.size:
            k = self._keys[pos]
            cand = np.flatnonzero(k < 0)  # empty or tombstone
            _, first = np.unique(pos[cand], return_index=True)  # one winner per free position
            win = cand[first]
            self._used += int(np.count_nonzero(k[win] == _EMPTY))
            self._keys[pos[win]], self._vals[pos[win]] = ids[idx[win]], vals[idx[win]]
            rest = np.ones(idx.size, bool)
            rest[win] = False
            idx, pos = idx[rest], (pos[rest] + 1) & mask

    def remove(self, ids: np.ndarray) -> None:
        pos = np.unique(self._find(ids))
        pos = pos[pos >= 0]
        self._keys[pos] = _TOMB
        self.size -= pos.size


class _HostTier:
    """In-memory records, keep-first once ``capacity`` is reached; storage grows by doubling."""

    def __init__(self, budget_bytes: int, record_bytes: int) -> None:
        self.capacity = budget_bytes // record_bytes
        self.record_bytes = record_bytes
        self.index = _IdIndex()
        self._store = np.empty((0, record_bytes), np.uint8)

    def read(self, slots: np.ndarray) -> np.ndarray:
        return self._store[slots]

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store rows of unique ids not yet present, while there is room."""
        n = self.index.size
        fresh = np.flatnonzero(self.index.get(ids) < 0)[: self.capacity - n]
        if fresh.size == 0:
            return
        end = n + fresh.size
        if end > self._store.shape[0]:
            rows_alloc = min(self.capacity, max(end, 2 * self._store.shape[0], 1024))
            grown = np.empty((rows_alloc, self.record_bytes), np.uint8)
            grown[:n] = self._store[:n]
            self._store = grown
        self._store[n:end] = rows[fresh]
        self.index.insert(ids[fresh], np.arange(n, end, dtype=np.int64))


def _column_constants(n: int) -> np.ndarray:
    return np.random.default_rng(0x5EED).integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class _DiskTier:
    """Append-only slot file + committed index; see the module docstring for the format."""

    def __init__(
        self, directory: Path, spec: _Spec, budget_bytes: int, salt: np.uint64, warn: Callable[[str], None]
    ) -> None:
        self.record_bytes = spec.nbytes
        self.words = _HEADER_WORDS + -(-spec.nbytes // 8)
        self.slot_bytes = 8 * self.words
        self.capacity = budget_bytes // self.slot_bytes
        self._dir, self._salt, self._warn = directory, salt, warn
        self._consts = _column_constants(self.words - _HEADER_WORDS)
        self._fd = os.open(directory / "slots.bin", os.O_RDWR | os.O_CREAT, 0o644)
        self._map: np.ndarray | None = None
        self.index = _IdIndex()
        self.next_slot = os.fstat(self._fd).st_size // self.slot_bytes
        self.slot_ids = self._load_slot_ids(self.next_slot)
        self.writable = True
        self._uncommitted = 0

    def _load_slot_ids(self, file_slots: int) -> np.ndarray:
        """slot -> sample id from index.npy, plus a header scan of slots appended after its commit."""
        committed = np.empty(0, np.int64)
        path = self._dir / "index.npy"
        if path.exists():
            try:
                committed = np.load(path, allow_pickle=False)
                if committed.dtype != np.int64 or committed.ndim != 1:
                    raise ValueError(f"expected 1-D int64, got {committed.dtype} {committed.shape}")
            except (OSError, ValueError) as exc:
                self._warn(f"ignoring unreadable cache index {path}: {exc}; rescanning record headers")
                committed = np.empty(0, np.int64)
        committed = committed[:file_slots]
        tail = committed[:0]
        if file_slots > committed.size:
            tail = self._mapped(file_slots)[committed.size : file_slots, 0].view(np.int64)
        sids = np.concatenate([committed, tail])
        _, first = np.unique(sids, return_index=True)
        keep = np.zeros(sids.size, bool)
        keep[first] = True
        sids = np.where(keep & (sids >= 0), sids, -1)
        live = np.flatnonzero(sids >= 0)
        self.index.insert(sids[live], live)
        return sids

    def _mapped(self, slots_needed: int) -> np.ndarray:
        """The slot file as a (slots, words) uint64 memmap covering at least ``slots_needed``."""
        if self._map is None or self._map.shape[0] < slots_needed:
            n = os.fstat(self._fd).st_size // self.slot_bytes
            self._map = np.memmap(self._dir / "slots.bin", np.uint64, "r", shape=(n, self.words))
        return self._map

    def _checksum(self, words: np.ndarray) -> np.ndarray:
        """Per-record 64-bit hash of (sample id, payload, salt); any single changed word changes it.

        The payload part is a weighted sum mod 2**64 with odd weights (one einsum pass, several
        times faster than elementwise mixing); odd weights make every one-word change visible.
        """
        h = np.einsum("ij,j->i", words[:, _HEADER_WORDS:], self._consts)
        h ^= words[:, 0] * _MIX ^ self._salt
        h ^= h >> np.uint64(31)
        return h * _GOLDEN

    def read(self, slots: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Payload rows of ``slots`` and a mask of the rows that verified as ``ids``."""
        order = np.argsort(slots, kind="stable")  # read in file order
        words = np.empty((slots.size, self.words), np.uint64)
        words[order] = self._mapped(int(slots.max()) + 1)[slots[order]]
        ok = (words[:, 0].view(np.int64) == ids) & (words[:, 1] == self._checksum(words))
        if not ok.all():
            bad = ids[~ok]
            self._warn(f"{bad.size} corrupt disk record(s) (e.g. sample_id {bad[0]}) dropped; recomputing")
            self.index.remove(bad)
            self.slot_ids[slots[~ok]] = -1
            self._uncommitted += 1
        payload = words[:, _HEADER_WORDS:].view(np.uint8)[:, : self.record_bytes]
        return payload, ok

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Append rows of unique ids not yet on disk, within the budget; degrade on OSError."""
        if not self.writable:
            return
        fresh = np.flatnonzero(self.index.get(ids) < 0)
        room = max(self.capacity - self.next_slot, 0)
        if fresh.size > room:
            self.writable = False
            self._warn(f"disk tier full ({self.capacity} records in {self._dir}); further misses are recomputed")
            fresh = fresh[:room]
        if fresh.size == 0:
            return
        buf = np.zeros((fresh.size, self.slot_bytes), np.uint8)
        buf[:, 8 * _HEADER_WORDS : 8 * _HEADER_WORDS + self.record_bytes] = rows[fresh]
        words = buf.view(np.uint64)
        words[:, 0] = ids[fresh].view(np.uint64)
        words[:, 1] = self._checksum(words)
        if not self._write(buf, self.next_slot * self.slot_bytes):
            return
        slots = np.arange(self.next_slot, self.next_slot + fresh.size, dtype=np.int64)
        self.index.insert(ids[fresh], slots)
        end = self.next_slot + fresh.size
        if end > self.slot_ids.size:  # grow by doubling: O(1) amortised per record
            grown = np.full(max(end, 2 * self.slot_ids.size), -1, np.int64)
            grown[: self.slot_ids.size] = self.slot_ids
            self.slot_ids = grown
        self.slot_ids[self.next_slot : end] = ids[fresh]
        self.next_slot = end
        self._uncommitted += fresh.size
        if self._uncommitted >= max(4096, self.next_slot // 4):  # amortised O(1) per record
            self.commit()

    def _write(self, buf: np.ndarray, offset: int) -> bool:
        view = memoryview(buf).cast("B")
        try:
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            self.writable = False
            kind = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "write error"
            self._warn(f"{kind} writing {self._dir / 'slots.bin'} ({exc}); disk tier is now read-only")
            try:  # drop the partial record; if this fails too, its checksum still rejects it on read
                os.ftruncate(self._fd, self.next_slot * self.slot_bytes)
            except OSError as trunc_exc:
                logger.debug("could not truncate partial cache record: %s", trunc_exc)
            return False
        return True

    def commit(self) -> None:
        """Write index.npy atomically (temp file + fsync + rename); failure only costs a rescan later."""
        if not self._uncommitted:
            return
        tmp = self._dir / "index.npy.tmp"
        try:
            with open(tmp, "wb") as f:
                np.save(f, self.slot_ids[: self.next_slot], allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._dir / "index.npy")
            self._uncommitted = 0
        except OSError as exc:
            self._warn(f"could not commit cache index in {self._dir}: {exc}")

    def close(self) -> None:
        self.commit()
        self._map = None
        os.close(self._fd)


class _Files:
    """The disk tier and the directory lock: released once, and only by the process that opened them."""

    def __init__(self) -> None:
        self.disk: _DiskTier | None = None
        self.lock_fd: int | None = None
        self.pid = os.getpid()

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child must not commit or unlock the parent's files
            return
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None


def _as_ids(sample_ids: SampleIds) -> np.ndarray:
    if isinstance(sample_ids, torch.Tensor):
        sample_ids = sample_ids.detach().cpu().numpy()
    ids = np.asarray(sample_ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"sample_ids must be a 1-D integer sequence, got dtype {ids.dtype} shape {ids.shape}")
    return ids.astype(np.int64, copy=False)


class ActivationCache:
    """Fixed-size per-sample tensors by ``sample_id``: a host-memory tier and an optional disk tier.

    ``directory=None`` keeps only the host tier. ``host_bytes`` and ``disk_bytes`` bound the record
    payload stored in each tier. ``key`` identifies what the records are outputs of (use
    :func:`module_fingerprint`); it is required with a directory, because a stale disk cache would
    silently feed old activations to training. Not thread-safe; use it from the training process only.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        host_bytes: int = 1 << 30,
        disk_bytes: int = 16 << 30,
        key: str | bytes | None = None,
    ) -> None:
        for name, value in (("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if key is not None and not isinstance(key, (str, bytes)):
            raise TypeError(f"key must be str or bytes, got {type(key).__name__}")
        if directory is not None and key is None:
            raise ValueError("key is required with a directory (e.g. key=module_fingerprint(frozen_prefix))")
        raw_key = key.encode() if isinstance(key, str) else (key or b"")
        self._key_digest = hashlib.sha256(_FORMAT.encode() + b"\0" + raw_key).hexdigest()
        self._host_budget, self._disk_budget = host_bytes, disk_bytes
        self._dir = Path(directory) if directory is not None else None
        self._pid = os.getpid()
        self._spec: _Spec | None = None
        self._host: _HostTier | None = None
        self._files = _Files()  # closed by close() or, at the latest, at interpreter exit
        self._finalizer = weakref.finalize(self, self._files.close)
        self._warned: set[str] = set()
        self._closed = False
        self.reset_stats()
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._files.lock_fd = self._lock(self._dir)
            spec = self._read_meta()
            if spec is not None:
                self._attach(spec)

    # -- lifecycle -------------------------------------------------------------------------------
    @staticmethod
    def _lock(directory: Path) -> int:
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CacheLockedError(
                f"cache directory {directory} is already open in another process or cache object; "
                "give each rank its own subdirectory, e.g. f'{root}/rank{rank}'"
            ) from None
        return fd

    def _read_meta(self) -> _Spec | None:
        """The record spec stored under this key, or None (wiping entries written under another key)."""
        path = self._dir / "meta.json"
        if not path.exists():
            self._wipe_files()  # no identity: whatever is left cannot be trusted
            return None
        try:
            meta = json.loads(path.read_text())
            if meta.get("format") == _FORMAT and meta.get("key_sha256") == self._key_digest:
                return _Spec.from_json(meta)
            reason = "written under a different key"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            reason = f"unreadable metadata ({exc})"
        self._warn(f"discarding cache entries in {self._dir}: {reason}")
        self._wipe_files()
        return None

    def _wipe_files(self) -> None:
        for name in ("index.npy", "index.npy.tmp", "slots.bin", "meta.json"):
            (self._dir / name).unlink(missing_ok=True)

    def _attach(self, spec: _Spec) -> None:
        """Fix the record spec and create the tiers (writing meta.json for a new disk cache)."""
        if spec.nbytes == 0:
            raise RecordSpecError(f"records must hold at least one byte, got shape {spec.shape}")
        self._spec = spec
        self._host = _HostTier(self._host_budget, spec.nbytes)
        if self._dir is None:
            return
        try:
            self._write_meta(spec)
            salt_src = hashlib.sha256(f"{self._key_digest}:{json.dumps(spec.to_json())}".encode()).digest()
            salt = np.frombuffer(salt_src[:8], np.uint64)[0] | np.uint64(1)  # never 0: zeroed slots must fail
            self._files.disk = _DiskTier(self._dir, spec, self._disk_budget, salt, self._warn)
        except OSError as exc:  # e.g. ENOSPC while creating files: recompute instead of crashing
            self._warn(f"disk tier disabled, cannot set up {self._dir} ({exc}); using host memory only")

    def _write_meta(self, spec: _Spec) -> None:
        meta_path = self._dir / "meta.json"
        if not meta_path.exists():
            meta = {"format": _FORMAT, "key_sha256": self._key_digest, **spec.to_json()}
            tmp = self._dir / "meta.json.tmp"
            tmp.write_text(json.dumps(meta))
            os.replace(tmp, meta_path)

    def flush(self) -> None:
        """Commit the disk index so a restart finds new records without rescanning headers."""
        self._check_usable()
        if self._disk is not None:
            self._disk.commit()

    def close(self) -> None:
        """Commit the index and release the files and the directory lock. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        self._finalizer()
        self._host = None

    def __enter__(self) -> "ActivationCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        raise TypeError("ActivationCache holds open files and a lock; create one per process instead")

    def clear(self) -> None:
        """Drop every entry in both tiers (and the disk files); the next put fixes a new record spec."""
        self._check_usable()
        if self._disk is not None:
            self._disk.close()
            self._files.disk = None
        if self._dir is not None:
            self._wipe_files()
        self._spec = self._host = None

    @property
    def _disk(self) -> _DiskTier | None:
        return self._files.disk

    # -- queries ---------------------------------------------------------------------------------
    @property
    def record_shape(self) -> tuple[int, ...] | None:
        """Per-sample shape fixed by the first put (or the directory's metadata); None before."""
        return self._spec.shape if self._spec else None

    @property
    def record_dtype(self) -> torch.dtype | None:
        return self._spec.dtype if self._spec else None

    @property
    def stats(self) -> CacheStats:
        """A snapshot of hit/miss counters and per-tier sizes."""
        host_n = self._host.index.size if self._host else 0
        disk_n = self._disk.index.size if self._disk else 0
        record = self._spec.nbytes if self._spec else 0
        slot = self._disk.slot_bytes if self._disk else 0
        return CacheStats(**self._counts, host_records=host_n, host_bytes=host_n * record,
                          disk_records=disk_n, disk_bytes=(self._disk.next_slot if self._disk else 0) * slot)

    def reset_stats(self) -> None:
        """Zero the hit/miss counters (sizes are unaffected); handy per epoch."""
        self._counts = {"host_hits": 0, "disk_hits": 0, "misses": 0, "padding": 0, "corrupt": 0}

    def get(
        self, sample_ids: SampleIds, *, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Look up a batch: ``(values, hit_mask)``.

        ``values`` is ``[n, *record_shape]`` on ``device`` (default CPU) with cached rows where
        ``hit_mask`` is True and zeros elsewhere; it is None while no record spec is known (nothing
        was ever put). Padding ids (-1) are always misses.
        """
        self._check_usable()
        ids = _as_ids(sample_ids)
        rows, hit = self._lookup(ids)
        hit_t = torch.from_numpy(hit)
        if rows is None:
            return None, hit_t
        return self._to_tensor(rows).to(device or "cpu"), hit_t

    def put(self, sample_ids: SampleIds, values: torch.Tensor) -> None:
        """Store ``values[i]`` for ``sample_ids[i]``. Padding ids and ids already cached are skipped.

        The first put fixes the record shape (``values.shape[1:]``) and dtype; a later mismatch raises
        :class:`RecordSpecError`. Values are detached and copied to host memory.
        """
        self._check_usable()
        ids = _as_ids(sample_ids)
        if not isinstance(values, torch.Tensor) or values.ndim < 1 or values.shape[0] != ids.size:
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values must be a tensor with one row per sample id ({ids.size}), got {shape}")
        spec = _Spec(tuple(values.shape[1:]), values.dtype)
        if self._spec is None:
            self._attach(spec)
        elif spec != self._spec:
            raise RecordSpecError(
                f"values have per-sample shape {spec.shape} dtype {spec.dtype}, but the cache holds "
                f"{self._spec.shape} {self._spec.dtype}; change the key or call clear()"
            )
        _, first = np.unique(ids, return_index=True)
        keep = first[ids[first] >= 0]
        if keep.size == 0:
            return
        # Gather in numpy: byte views are free, and numpy's gather avoids torch's thread pool.
        flat = values.detach().cpu().contiguous().reshape(ids.size, -1).view(torch.uint8).numpy()
        rows = flat[keep]
        self._host.add(ids[keep], rows)
        if self._disk is not None:
            self._disk.add(ids[keep], rows)

    def get_or_compute(
        self,
        sample_ids: SampleIds,
        fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The full batch ``[n, *record_shape]`` on ``device`` (default CPU), in ``sample_ids`` order.

        ``fn(miss_positions)`` is called once, only if something missed, with the int64 CPU positions
        (into this batch) of the misses, padding included; it must return their rows, e.g.
        ``lambda idx: prefix(x[idx])``. Its output is cached (except padding) and merged with the hits.
        """
        values, hit = self.get(sample_ids, device=device)
        miss = torch.from_numpy(np.flatnonzero(~hit.numpy()))
        if miss.numel() == 0:
            return values
        computed = fn(miss)
        if not isinstance(computed, torch.Tensor) or computed.ndim < 1 or computed.shape[0] != miss.numel():
            got = tuple(computed.shape) if isinstance(computed, torch.Tensor) else type(computed).__name__
            raise CacheError(f"fn must return one row per miss position ({miss.numel()}), got {got}")
        computed = computed.detach()
        self.put(_as_ids(sample_ids)[miss.numpy()], computed)
        if values is None:
            return computed.to(device or "cpu")
        values[miss.to(values.device)] = computed.to(values.device)
        return values

    # -- internals -------------------------------------------------------------------------------
    def _lookup(self, ids: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        hit = np.zeros(ids.size, bool)
        valid = np.flatnonzero(ids >= 0)
        self._counts["padding"] += ids.size - valid.size
        if self._spec is None:
            self._counts["misses"] += valid.size
            return None, hit
        rows = np.zeros((ids.size, self._spec.nbytes), np.uint8)
        slots = self._host.index.get(ids[valid])
        found = slots >= 0
        rows[valid[found]] = self._host.read(slots[found])
        hit[valid[found]] = True
        rest = valid[~found]
        if self._disk is not None and rest.size:
            slots = self._disk.index.get(ids[rest])
            on_disk = slots >= 0
            if on_disk.any():
                where = rest[on_disk]
                payload, ok = self._disk.read(slots[on_disk], ids[where])
                if not ok.all():
                    self._counts["corrupt"] += int(np.count_nonzero(~ok))
                    where, payload = where[ok], payload[ok]
                rows[where], hit[where] = payload, True
                self._counts["disk_hits"] += where.size
                self._promote(ids[where], payload)
        self._counts["host_hits"] += int(np.count_nonzero(found))
        self._counts["misses"] += valid.size - int(np.count_nonzero(hit))
        return rows, hit

    def _promote(self, ids: np.ndarray, payload: np.ndarray) -> None:
        """Copy disk hits into the host tier while it has room (keep-first, like every insert)."""
        if self._host.index.size < self._host.capacity:
            _, first = np.unique(ids, return_index=True)
            self._host.add(ids[first], payload[first])

    def _to_tensor(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows).view(self._spec.dtype).reshape(rows.shape[0], *self._spec.shape)

    def _check_usable(self) -> None:
        if self._closed:
            raise CacheError("ActivationCache is closed")
        if os.getpid() != self._pid:
            raise CacheError("ActivationCache was created in another process (fork); open one per process")

    def _warn(self, message: str) -> None:
        """Warn once per distinct message, and always log."""
        logger.warning(message)
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, CacheWarning, stacklevel=3)
