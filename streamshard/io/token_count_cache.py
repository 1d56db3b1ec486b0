"""Token counts per row group of a text column, cached on disk per file version and tokenizer.

Packing raw text plans by tokens (``plan/packing_plan.py``), and a footer does not say how many tokens a
text column holds: they are counted by tokenizing once (``io/text_counts.py``). This file keeps those
counts so the next run starts at once. One JSON file per (tokenizer identity, column) inside the
catalog cache directory (``ParquetStream(catalog_cache=...)``), holding per file URL its size,
version and one count per row group; any dataset reading those files with that tokenizer reuses it.

Never trusted: the file carries a SHA-256 of its entries (a torn or edited file is ignored whole, with
a warning), each entry is used only while the listing shows the same size and non-empty version and
only if it has one non-negative integer per row group the catalog gives the file; and a count that
passes all that but is wrong (a tokenizer changed under the same name) is caught when the row group
is read (``PackedStream`` raises a ``ReadError`` naming file, row group and this file). JSON only:
loading runs no code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from typing import Any

import numpy as np

from .catalog_cache import write_json_atomically
from .process_share import file_locked
from .storage import redact_url

log = logging.getLogger("streamshard")

FORMAT = "streamshard.token_counts/1"
UNKNOWN = -1


class TokenCountCache:
    """The count file of one (tokenizer identity, column) inside ``cache_dir``."""

    def __init__(self, cache_dir: str, identity: str, column: str) -> None:
        self.key = {"tokenizer": identity, "column": column}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:24]
        self.path = os.path.join(os.path.expanduser(cache_dir), f"tokens-{digest}.json")

    def load(self, catalog: Any) -> np.ndarray:
        """Counts per row group of ``catalog`` (int64), ``UNKNOWN`` where the cache has no valid entry."""
        counts = np.full(catalog.num_row_groups, UNKNOWN, dtype=np.int64)
        files = self._read_files()
        rejected = []
        for f, url in enumerate(catalog.urls):
            url = redact_url(url)  # as written down (no presigned URL's credentials on disk)
            entry = files.get(url)
            version = catalog.versions[f] if catalog.versions else ""
            if entry is None or not version:
                continue
            first, end = int(catalog.file_first_rg[f]), _file_end(catalog, f)
            problem = _check(entry, int(catalog.file_sizes[f]), version, end - first)
            if problem is None:
                counts[first:end] = entry["counts"]  # UNKNOWN where that row group was not counted yet
            elif problem:  # '' = the file changed since it was counted: expected, no warning
                rejected.append(f"{url}: {problem}")
        if rejected:
            log.warning("token count cache %s: ignoring %d damaged entr%s (those row groups are counted again): %s",
                        self.path, len(rejected), "y" if len(rejected) == 1 else "ies", "; ".join(rejected[:3]))
        return counts

    def save(self, catalog: Any, counts: np.ndarray) -> None:
        """Merge ``catalog``'s counts (files with a version only; ``UNKNOWN`` where a row group is not
        counted yet: an epoch counted in stages saves a file's row groups as their stages are
        counted) into the file, atomically, under the file's lock (ranks saving at once keep each
        other's counts); a cache that cannot be written is a warning, never a failure (training does
        not need it)."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with file_locked(f"{self.path}.lock"):
                self._merge(catalog, counts)
        except OSError as exc:
            warnings.warn(f"token count cache {self.path} cannot be written ({type(exc).__name__}: {exc}); "
                          "the tokens will be counted again next time", stacklevel=2)

    def _merge(self, catalog: Any, counts: np.ndarray) -> None:
        files = self._read_files()
        for f, url in enumerate(catalog.urls):
            version = catalog.versions[f] if catalog.versions else ""
            mine = counts[int(catalog.file_first_rg[f]):_file_end(catalog, f)]
            if not version or not (mine >= 0).any():
                continue
            size, key = int(catalog.file_sizes[f]), redact_url(url)
            old = files.get(key)
            if _check(old, size, version, len(mine)) is None:  # the same file's earlier counts: keep them
                mine = np.where(mine >= 0, mine, np.asarray(old["counts"], dtype=np.int64))
            files[key] = {"size": size, "version": version, "counts": [int(c) for c in mine]}
        payload = {"format": FORMAT, "key": self.key, "files": files, "digest": _digest(files)}
        write_json_atomically(self.path, payload, ".tokens-")

    def _read_files(self) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as f:
                stored = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("token count cache %s is unreadable (%s); counting again", self.path, exc)
            return {}
        if not isinstance(stored, dict) or stored.get("format") != FORMAT or stored.get("key") != self.key:
            log.warning("token count cache %s is not a token count file of this tokenizer; counting again", self.path)
            return {}
        files = stored.get("files")
        if not isinstance(files, dict) or stored.get("digest") != _digest(files):
            warnings.warn(f"token count cache {self.path} does not match its digest (torn or edited); "
                          "ignoring it and counting again", stacklevel=3)
            return {}
        return files


def _file_end(catalog: Any, f: int) -> int:
    return int(catalog.file_first_rg[f + 1]) if f + 1 < catalog.num_files else catalog.num_row_groups


def _digest(files: Any) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check(entry: Any, size: int, version: str, row_groups: int) -> str | None:
    """None if ``entry`` holds current counts of a file of ``row_groups`` row groups; '' if stale; else why not."""
    if not isinstance(entry, dict) or set(entry) != {"size", "version", "counts"}:
        return "not an entry with keys counts, size, version"
    if entry["size"] != size or entry["version"] != version:
        return ""
    counts = entry["counts"]
    if not isinstance(counts, list) or len(counts) != row_groups:
        return f"it does not hold one count for each of the file's {row_groups} row groups"
    if not all(isinstance(c, int) and not isinstance(c, bool) and UNKNOWN <= c < 1 << 48 for c in counts):
        return "its counts are not token counts (ints >= 0, or -1: not counted yet)"
    return None
