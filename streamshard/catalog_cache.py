"""A catalog cache on disk: what each file's footer said, reused while the file is unchanged.

One JSON file per (paths, columns); inside, one entry per file holding its size and version
(S3 ``ETag``, else ``mtime``, as the listing reports them), its row counts, column-chunk byte
ranges and projected Arrow schema (Arrow IPC bytes, base64). An entry is reused only when the
listing shows the same size and version; a file without a version is always re-read. JSON and
Arrow IPC only: nothing here can execute code when loaded.

The cache is opt-in (``cache_dir``): streamshard writes nothing to disk unless asked.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from .catalog_records import FileEntry, FileFooter

log = logging.getLogger("streamshard")

FORMAT_VERSION = 1


def footer_to_dict(footer: FileFooter) -> dict[str, Any]:
    """A ``FileFooter`` as plain JSON-safe data (for the cache and for all-gathers)."""
    ranges = footer.ranges if footer.ranges is not None else np.zeros((0, 0, 2), np.int64)
    return {
        "url": footer.url,
        "size": int(footer.size),
        "version": footer.version,
        "footer_length": int(footer.footer_length),
        "rows": [int(r) for r in footer.row_group_rows],
        "ranges_shape": list(ranges.shape),
        "ranges": [int(x) for x in ranges.ravel()],
        "schema": base64.b64encode(footer.schema.serialize().to_pybytes()).decode("ascii"),
        "maybe_null": sorted(footer.maybe_null),
    }


def footer_from_dict(data: dict[str, Any]) -> FileFooter:
    """The ``FileFooter`` that ``footer_to_dict`` described."""
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["schema"])))
    ranges = np.array(data["ranges"], dtype=np.int64).reshape(data["ranges_shape"])
    return FileFooter(
        url=data["url"],
        size=int(data["size"]),
        row_group_rows=np.array(data["rows"], dtype=np.int64),
        schema=schema,
        maybe_null=frozenset(data["maybe_null"]),
        footer_length=int(data["footer_length"]),
        ranges=ranges,
        version=data["version"],
    )


class CatalogCache:
    """The cache file of one (paths, columns) inside ``cache_dir``."""

    def __init__(self, cache_dir: str, paths: Sequence[str], columns: Sequence[str] | None) -> None:
        key = json.dumps({"paths": sorted(paths), "columns": columns, "format": FORMAT_VERSION})
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        self.path = os.path.join(os.path.expanduser(cache_dir), f"catalog-{digest}.json")
        self.columns = list(columns) if columns is not None else None

    def load(self, files: Sequence[FileEntry]) -> dict[str, dict[str, Any]]:
        """The cached footer dicts of ``files`` that are still valid, by URL.

        A missing, unreadable or foreign cache file counts as empty (it is rebuilt, never trusted).
        """
        try:
            with open(self.path, encoding="utf-8") as f:
                stored = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("catalog cache %s is unreadable (%s); rebuilding it", self.path, exc)
            return {}
        if stored.get("format") != FORMAT_VERSION or stored.get("columns") != self.columns:
            return {}
        entries = stored.get("files", {})
        valid = {}
        for file in files:
            entry = entries.get(file.url)
            if entry and file.version and entry["version"] == file.version and entry["size"] == file.size:
                valid[file.url] = entry
        return valid

    def save(self, footers: Sequence[dict[str, Any]]) -> None:
        """Replace the cache file atomically (readers see the old or the new file, never half)."""
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        payload = {"format": FORMAT_VERSION, "columns": self.columns, "files": {f["url"]: f for f in footers}}
        fd, tmp = tempfile.mkstemp(prefix=".catalog-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(payload, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
