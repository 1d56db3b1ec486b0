"""The disk tier of the activation cache: checksummed fixed-size records in one append-only file.

Format, in the cache directory:
    ``slots.bin``  records ``[sample_id, checksum, payload]`` of ``8 * words`` bytes each, appended
                   with ``os.pwrite`` (never through the memory map, so a full disk is an ``OSError``
                   and a warning, not a ``SIGBUS``) and read through ``np.memmap``.
    ``index.npy``  slot -> sample_id (-1 for a dropped slot), committed by write, fsync and rename.
On open the committed index is extended by a header scan of the slots appended after it (recovery
after a crash). Every read checks the stored sample id and a checksum salted with the cache key and
record spec, so a torn or corrupted record is a miss, never garbage.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

from .index import GOLDEN, IdIndex

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_MIX = np.uint64(0xBF58476D1CE4E5B9)
_HEADER_WORDS = 2  # sample_id, checksum


def _column_constants(n: int) -> np.ndarray:
    return np.random.default_rng(0x5EED).integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class DiskTier:
    """Append-only slot file + committed index; see the module docstring for the format."""

    def __init__(
        self, directory: Path, record_bytes: int, budget_bytes: int, salt: np.uint64, warn: Callable[[str], None]
    ) -> None:
        self.record_bytes = record_bytes
        self.words = _HEADER_WORDS + -(-record_bytes // 8)
        self.slot_bytes = 8 * self.words
        self.capacity = budget_bytes // self.slot_bytes
        self._dir, self._salt, self._warn = directory, salt, warn
        self._consts = _column_constants(self.words - _HEADER_WORDS)
        self._fd = os.open(directory / "slots.bin", os.O_RDWR | os.O_CREAT, 0o644)
        self._map: np.ndarray | None = None
        self.index = IdIndex()
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
        return h * GOLDEN

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
            with contextlib.suppress(OSError):  # a disk-full write leaves nothing behind
                tmp.unlink(missing_ok=True)
            self._warn(f"could not commit cache index in {self._dir}: {exc}")

    def close(self) -> None:
        self.commit()
        self._map = None
        os.close(self._fd)
