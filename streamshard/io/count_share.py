"""A raw-text pack's token counts, shared by the DataLoader worker processes of one pack.

Equal steps need every row group's token count, and only tokenizing a row group gives it. Under a
plain ``DataLoader(pack, num_workers=N)`` (or worker processes started before their parent counted a
stage) each worker would tokenize every row group for its count: N times the corpus's tokenizing on
one rank's cores. Instead the first worker that needs a count tokenizes under the share's lock and
writes the counts there (``.npy`` of int64 per row group, loaded without pickle); the others wait for
it and read them. A count is the same whoever makes it (the same bytes, the same tokenizer), so the
share changes who counts, never what is planned.

Under a process group the parent's counting thread splits the later stages over the ranks
(``streams/stage_counting.py``) while its workers may need the same stages. So the parent *claims*
the stages it is about to split (``claim``: a file naming its pid and the row groups), beats while
it counts (each round of the split touches the claim), and publishes its counts (``publish``: a file
of its own, written by that one thread) before it lets the claim go. A worker that lacks claimed row
groups waits for them (polling, without the lock) instead of tokenizing them too; it counts them
itself once the claim is gone, its claimant dead, or silent for ``CLAIM_STALE_S`` (longer than one
round of the split, whose collectives time out after 120 s): a wait is bounded, and a count is the
same whoever makes it.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Callable

import numpy as np

from .catalog_cache import write_atomically
from .process_share import ProcessShare
from .token_count_cache import UNKNOWN
from ..errors import CatalogError


CLAIM_STALE_S = 180.0  # a claim not touched for this long is its claimant's no more (a round's count + gather)
_POLL_S = 0.05  # how often a process waiting for a claimed count looks again


class CountShare(ProcessShare):
    """Where the worker processes of one pack find the token counts another of them (or their
    parent's counting thread) made."""

    prefix = "streamshard-counts-"

    def counts(self, name: str, rgs: np.ndarray, num_row_groups: int,
               count: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Tokens of row groups ``rgs`` of the corpus ``name``: as another process published them, and
        ``count(missing)`` for the rest, published for the others. Counting holds the lock: a process
        needing the same counts meanwhile waits for them instead of tokenizing them too. Row groups
        another process claimed (``claim``) are waited for, without the lock, while the claim lives."""
        rgs = np.asarray(rgs, dtype=np.int64)
        while True:
            with self.locked(f"{name}.lock") as directory:
                path = os.path.join(directory, f"{name}.npy")
                table = self.table(name, num_row_groups)
                missing = rgs[table[rgs] < 0]
                if not missing.size:
                    return table[rgs]
                claims = self._claims_covering(directory, name, missing)
                if not claims:
                    got = np.asarray(count(missing), dtype=np.int64)
                    if got.shape != missing.shape or (got < 0).any():
                        raise ValueError(f"counting gave {got!r} for {len(missing)} row groups")
                    table[missing] = got
                    write_atomically(path, lambda f: np.save(f, table, allow_pickle=False), ".counts-", "wb")
                    return table[rgs].copy()
                published = os.path.join(directory, f"{name}.parent.npy")
                seen = _stamp(published)
            # Without the lock, with os.stat only (a table may be megabytes): until the claimant publishes,
            # or a claim waited for is let go, its process dies or it falls silent.
            while _stamp(published) == seen and all(_live(claim, pid) for claim, pid in claims):
                time.sleep(_POLL_S)

    def table(self, name: str, num_row_groups: int) -> np.ndarray:
        """Every count of ``name`` the processes of this share published (``UNKNOWN`` elsewhere); read
        without the lock (files are replaced whole)."""
        table = np.full(num_row_groups, UNKNOWN, np.int64)
        for path in (os.path.join(self.directory, f"{name}.npy"), os.path.join(self.directory, f"{name}.parent.npy")):
            if os.path.exists(path):
                known = _load(path, num_row_groups)
                table = np.where(table >= 0, table, known)
        return table

    def claim(self, name: str, rgs: np.ndarray) -> "Claim":
        """Until ``Claim.release``, processes of this share that lack any of ``rgs`` wait for them (this
        process counts them: its counting thread's split over the ranks) instead of counting them, as
        long as ``Claim.beat`` is called at least every ``CLAIM_STALE_S`` (each round of the split);
        ``publish`` the counts before releasing. Raises ``OSError`` if the claim cannot be written."""
        path = os.path.join(self._make_directory(), f"{name}.claim.{secrets.token_hex(8)}.npz")
        units = np.asarray(rgs, dtype=np.int64)
        write_atomically(path, lambda f: np.savez(f, pid=np.array([os.getpid()], np.int64), units=units),
                         ".claim-", "wb")
        return Claim(path)

    def publish(self, name: str, tokens: np.ndarray) -> None:
        """This process's counts of ``name`` (``UNKNOWN`` where it has none), for the others to read.
        One writer only (the owner's counting thread): the file is replaced whole, without the lock."""
        path = os.path.join(self._make_directory(), f"{name}.parent.npy")
        table = np.asarray(tokens, dtype=np.int64)
        write_atomically(path, lambda f: np.save(f, table, allow_pickle=False), ".counts-", "wb")

    def _claims_covering(self, directory: str, name: str, missing: np.ndarray) -> list[tuple[str, int]]:
        """The live claims (path, claimant's pid) of other processes that hold some of ``missing``."""
        known: dict[str, tuple[int, np.ndarray]] = self.__dict__.setdefault("_claims_read", {})  # a claim never changes
        covering = []
        for entry in sorted(os.listdir(directory)):
            if not (entry.startswith(f"{name}.claim.") and entry.endswith(".npz")):
                continue
            path = os.path.join(directory, entry)
            if path not in known:
                claim = _load_claim(path)
                if claim is None:
                    continue  # let go meanwhile
                known[path] = claim
            pid, units = known[path]
            if pid != os.getpid() and _live(path, pid) and np.isin(missing, units).any():
                covering.append((path, pid))
        return covering


def _load_claim(path: str) -> tuple[int, np.ndarray] | None:
    """A claim's (pid, row groups); None where it is gone."""
    try:
        with np.load(path, allow_pickle=False) as claim:
            pid, units = claim["pid"], claim["units"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        raise CatalogError(f"token count claim {path} does not load ({type(exc).__name__}: {exc})") from exc
    if pid.dtype != np.int64 or pid.shape != (1,) or units.dtype != np.int64 or units.ndim != 1:
        raise CatalogError(f"token count claim {path} is damaged: pid {pid.dtype} {pid.shape}, units "
                           f"{units.dtype} {units.shape}")
    return int(pid[0]), units


def _live(path: str, pid: int) -> bool:
    """Whether a claim is still there, beaten within ``CLAIM_STALE_S``, by a living process."""
    try:
        beat = os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    return time.time() - beat <= CLAIM_STALE_S and _alive(pid)


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when a file is replaced (None: there is none)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _load(path: str, num_row_groups: int) -> np.ndarray:
    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CatalogError(f"token counts {path} do not load ({type(exc).__name__}: {exc})") from exc
    if table.dtype != np.int64 or table.shape != (num_row_groups,) or (table < UNKNOWN).any():
        raise CatalogError(f"token counts {path} are damaged: {table.dtype} {table.shape}, "
                           f"not int64 ({num_row_groups},) counts")
    return table


class Claim:
    """A claim of ``CountShare.claim``: its file, beaten and released by the claimant (never raising:
    a claim that cannot be beaten goes stale, and the waiters count themselves)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def beat(self) -> None:
        try:
            os.utime(self.path)
        except OSError:
            pass

    def release(self) -> None:
        try:
            os.remove(self.path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process under that pid: alive, though not ours (the beat decides)
    return True
