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
discards its entries. A directory belongs to one process at a time (an ``flock`` that forked children,
such as DataLoader workers, do not keep: ``close()`` frees it); ranks sharing a node use one
subdirectory each, e.g. ``f"{root}/rank{rank}"``.

Padding rows (``sample_id == -1``, any negative id) are never stored or looked up: always misses.

Limits, by design: keep-first never evicts, so a tier filled with ids this process stops seeing
(e.g. after an elastic resize) stays filled until :meth:`ActivationCache.clear`. With several ranks
and ``shuffle=True`` each rank reads a different share of the ids every epoch, so a per-rank cache
hits about ``1 - (1 - 1/world_size) ** epochs_seen`` of its lookups (given enough ``disk_bytes``),
not 100% from epoch 2 as with one rank or a fixed assignment.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
import torch

from ..plan.validate import check_int
from .directory import CacheFiles, DirectoryLock, RecordSpec, key_digest, open_disk, read_meta, wipe_files
from .disk import DiskTier
from .errors import CacheError, CacheWarning, RecordSpecError
from .host import HostTier

__all__ = ["ActivationCache", "CacheStats", "module_fingerprint"]

logger = logging.getLogger(__name__)

SampleIds = Union[torch.Tensor, np.ndarray, Sequence[int]]


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
        host_bytes = check_int(host_bytes, "host_bytes", low=0)
        disk_bytes = check_int(disk_bytes, "disk_bytes", low=0)
        if key is not None and not isinstance(key, (str, bytes)):
            raise TypeError(f"key must be str or bytes, got {type(key).__name__}")
        if directory is not None and key is None:
            raise ValueError("key is required with a directory (e.g. key=module_fingerprint(frozen_prefix))")
        self._key_digest = key_digest(key)
        self._host_budget, self._disk_budget = host_bytes, disk_bytes
        self._dir = Path(directory) if directory is not None else None
        self._pid = os.getpid()
        self._spec: RecordSpec | None = None
        self._host: HostTier | None = None
        self._files = CacheFiles()  # closed by close() or, at the latest, at interpreter exit
        self._finalizer = weakref.finalize(self, self._files.close)
        # The disk tier keeps the warner; it must not hold the cache, or the finalizer keeps it alive.
        self._warn = _WarnOnce()
        self._closed = False
        self.reset_stats()
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._files.lock = DirectoryLock(self._dir)
            spec = read_meta(self._dir, self._key_digest, self._warn)
            if spec is not None:
                self._attach(spec)

    # -- lifecycle -------------------------------------------------------------------------------
    def _attach(self, spec: RecordSpec) -> None:
        """Fix the record spec and create the tiers (writing meta.json for a new disk cache)."""
        if spec.nbytes == 0:
            raise RecordSpecError(f"records must hold at least one byte, got shape {spec.shape}")
        self._spec = spec
        self._host = HostTier(self._host_budget, spec.nbytes)
        if self._dir is None:
            return
        try:
            self._files.disk = open_disk(self._dir, self._key_digest, spec, self._disk_budget, self._warn)
        except OSError as exc:  # e.g. ENOSPC while creating files: recompute instead of crashing
            self._warn(f"disk tier disabled, cannot set up {self._dir} ({exc}); using host memory only")

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
            wipe_files(self._dir)
        self._spec = self._host = None

    @property
    def _disk(self) -> DiskTier | None:
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
        spec = RecordSpec(tuple(values.shape[1:]), values.dtype)
        if self._spec is None:
            try:
                RecordSpec.checked(spec.shape, spec.dtype)
            except ValueError as exc:
                raise ValueError(f"values: {exc}") from None
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


class _WarnOnce:
    """One event, one message: a ``CacheWarning`` once per distinct message (repeats go to the
    debug log only); holds no reference to any cache."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, message: str) -> None:
        if message in self._seen:
            logger.debug(message)
        else:
            self._seen.add(message)
            warnings.warn(message, CacheWarning, stacklevel=3)
