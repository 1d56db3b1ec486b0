"""A raw-text pack's token counts, shared by the DataLoader worker processes of one pack.

Equal steps need every row group's token count, and only tokenizing a row group gives it. Under a
plain ``DataLoader(pack, num_workers=N)`` (or worker processes started before their parent counted a
stage) each worker would tokenize every row group for its count: N times the corpus's tokenizing on
one rank's cores. Instead the first worker that needs a count tokenizes under the share's lock and
writes the counts there (``.npy`` of int64 per row group, loaded without pickle); the others wait for
it and read them. A count is the same whoever makes it (the same bytes, the same tokenizer), so the
share changes who counts, never what is planned.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .catalog_cache import write_atomically
from .process_share import ProcessShare
from .token_count_cache import UNKNOWN
from ..errors import CatalogError


class CountShare(ProcessShare):
    """Where the worker processes of one pack find the token counts another of them made."""

    prefix = "streamshard-counts-"

    def counts(self, name: str, rgs: np.ndarray, num_row_groups: int,
               count: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Tokens of row groups ``rgs`` of the corpus ``name``: as another process published them, and
        ``count(missing)`` for the rest, published for the others. Counting holds the lock: a process
        needing the same counts meanwhile waits for them instead of tokenizing them too."""
        rgs = np.asarray(rgs, dtype=np.int64)
        with self.locked(f"{name}.lock") as directory:
            path = os.path.join(directory, f"{name}.npy")
            table = _load(path, num_row_groups) if os.path.exists(path) else np.full(num_row_groups, UNKNOWN, np.int64)
            missing = rgs[table[rgs] < 0]
            if missing.size:
                got = np.asarray(count(missing), dtype=np.int64)
                if got.shape != missing.shape or (got < 0).any():
                    raise ValueError(f"counting gave {got!r} for {len(missing)} row groups")
                table[missing] = got
                write_atomically(path, lambda f: np.save(f, table, allow_pickle=False), ".counts-", "wb")
            return table[rgs].copy()


def _load(path: str, num_row_groups: int) -> np.ndarray:
    try:
        table = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CatalogError(f"token counts {path} do not load ({type(exc).__name__}: {exc})") from exc
    if table.dtype != np.int64 or table.shape != (num_row_groups,) or (table < UNKNOWN).any():
        raise CatalogError(f"token counts {path} are damaged: {table.dtype} {table.shape}, "
                           f"not int64 ({num_row_groups},) counts")
    return table
