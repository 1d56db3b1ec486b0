"""A catalog cache on disk: what each file's footer said, reused while the file is unchanged.

One JSON file per (paths, columns); inside, one entry per file holding its size and version
(S3 ``ETag``, else ``mtime``, as the listing reports them), its row counts, column-chunk byte
ranges and projected Arrow schema (an index into the file's list of distinct schemas, each Arrow IPC
bytes in base64: a lake's files share a few). An entry is reused only when the
listing shows the same size and version; a file without a version is always re-read. JSON and
Arrow IPC only: nothing here can execute code when loaded.

The file is never trusted: every field of an entry is checked on load (types, signs, lengths that
must agree, byte ranges inside the file, the schema against the projection); an entry that fails
is dropped with a warning and that file's footer read again, so a damaged cache costs requests,
never a crash or wrong sample ids.

The cache is opt-in (``cache_dir``): streamshard writes nothing to disk unless asked. It holds no
credentials: URLs are written with theirs replaced by ``***`` (``storage.redact_url``: a presigned
URL's signature and token, a ``user:password@``), and entries are matched by that form.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import tempfile
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from ..format.catalog_records import FileEntry, FileFooter
from .storage import redact_url

log = logging.getLogger("streamshard")

FORMAT_VERSION = 4  # 2: leaf value counts per column chunk; 3: INT96 columns as timestamp[us]; 4: each distinct
# schema written once


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
        "schema": encode_schema(footer.schema),
        "maybe_null": sorted(footer.maybe_null),
        "values": [] if footer.values is None else [int(x) for x in footer.values.ravel()],
    }


def footer_from_dict(data: dict[str, Any]) -> FileFooter:
    """The ``FileFooter`` that ``footer_to_dict`` described (trusted input: see ``check_entry``)."""
    schema = decode_schema(data["schema"])
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
        values=np.array(data["values"], dtype=np.int64).reshape(len(data["rows"]), -1) if data["values"] else None,
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

        A missing, unreadable or foreign cache file counts as empty; an entry that fails
        ``check_entry`` is dropped with a warning (its footer is read again).
        """
        try:
            with open(self.path, encoding="utf-8") as f:
                stored = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            log.warning("catalog cache %s is unreadable (%s); rebuilding it", self.path, exc)
            return {}
        if not isinstance(stored, dict) or not isinstance(stored.get("files"), dict):
            log.warning("catalog cache %s is not a catalog cache (no 'files' mapping); rebuilding it", self.path)
            return {}
        if stored.get("format") != FORMAT_VERSION or stored.get("columns") != self.columns:
            return {}  # another format or projection: not ours to use
        entries, schemas = stored["files"], stored.get("schemas")
        if not isinstance(schemas, list) or not all(isinstance(x, str) for x in schemas):
            log.warning("catalog cache %s has no list of schemas; rebuilding it", self.path)
            return {}
        valid, rejected = {}, []
        for file in files:
            written = redact_url(file.url)
            entry = entries.get(written)
            if entry is None or not file.version:
                continue
            index = entry.get("schema") if isinstance(entry, dict) else None
            if _is_int(index) and 0 <= index < len(schemas):
                entry = {**entry, "schema": schemas[index]}
            problem = check_entry(entry, file, self.columns, written)
            if problem is None:
                valid[file.url] = {**entry, "url": file.url}
            elif problem:  # '' = a stale entry (the file changed): expected, not worth a warning
                rejected.append(f"{written}: {problem}")
        if rejected:
            log.warning("catalog cache %s: ignoring %d damaged entr%s (their footers are read again): %s",
                        self.path, len(rejected), "y" if len(rejected) == 1 else "ies", "; ".join(rejected[:3]))
        return valid

    def save(self, footers: Sequence[dict[str, Any]]) -> None:
        """Replace the cache file atomically (readers see the old or the new file, never half).

        The catalog does not need its cache: one that cannot be written (a read-only or full
        filesystem, a path through a file) is a warning naming it, and the build goes on.
        """
        schemas: dict[str, int] = {}  # a lake's files share a few schemas: each is written once, entries index it
        written = [{**f, "url": redact_url(f["url"]), "schema": schemas.setdefault(f["schema"], len(schemas))}
                   for f in footers]
        payload = {"format": FORMAT_VERSION, "columns": self.columns, "schemas": list(schemas),
                   "files": {f["url"]: f for f in written}}
        try:
            write_json_atomically(self.path, payload, ".catalog-")
        except OSError as exc:
            warnings.warn(f"catalog cache {self.path} cannot be written ({type(exc).__name__}: {exc}); the catalog "
                          "was built without it and its footers will be read again next time", stacklevel=2)


_MAX_ROWS = 1 << 48  # far above any real row group; keeps sums of row counts inside int64
_KEYS = {"url", "size", "version", "footer_length", "rows", "ranges_shape", "ranges", "schema", "maybe_null",
         "values"}


def check_entry(entry: Any, file: FileEntry, columns: Sequence[str] | None, url: str) -> str | None:
    """None if ``entry`` is a well-formed, current footer dict of ``file``, written under ``url`` (its
    URL as written down); '' if it is stale; else what is wrong."""
    if not isinstance(entry, dict) or set(entry) != _KEYS:
        return f"not an entry with keys {sorted(_KEYS)}"
    if entry["url"] != url or not isinstance(entry["version"], str):
        return "its url or version is malformed"
    if not _is_int(entry["size"]) or entry["size"] < 0:
        return f"size {entry['size']!r:.40} is not a byte count"
    if entry["size"] != file.size or entry["version"] != file.version:
        return ""
    rows, shape, ranges = entry["rows"], entry["ranges_shape"], entry["ranges"]
    if not isinstance(rows, list) or not all(_is_int(r) and 0 <= r < _MAX_ROWS for r in rows):
        return "rows is not a list of row counts >= 0"
    if not _is_int(entry["footer_length"]) or not 0 < entry["footer_length"] <= file.size - 12:
        return f"footer_length {entry['footer_length']!r:.40} does not fit a file of {file.size} bytes"
    try:
        schema = decode_schema(entry["schema"])
    except Exception as exc:  # noqa: BLE001 - binascii, ArrowInvalid, TypeError: all mean a bad entry
        return f"schema does not decode ({type(exc).__name__})"
    if columns is not None and schema.names != list(columns):
        return f"schema has columns {schema.names}, not the projection {list(columns)}"
    if not isinstance(shape, list) or shape != [len(rows), len(schema), 2]:
        return f"ranges_shape {shape!r:.60} is not [row groups, columns, 2] = [{len(rows)}, {len(schema)}, 2]"
    if not isinstance(ranges, list) or len(ranges) != 2 * len(rows) * len(schema):
        return "ranges does not have the length ranges_shape says"
    if not all(_is_int(x) and 0 <= x <= file.size for x in ranges):
        return f"ranges holds something other than offsets into the file's {file.size} bytes"
    spans = np.array(ranges, dtype=np.int64).reshape(-1, 2)
    if (spans[:, 1] < spans[:, 0]).any():
        return "a byte range ends before it starts"
    maybe_null = entry["maybe_null"]
    if not isinstance(maybe_null, list) or not all(isinstance(m, str) and m in schema.names for m in maybe_null):
        return "maybe_null is not a list of the schema's column names"
    values = entry["values"]
    if not isinstance(values, list) or len(values) not in (0, len(rows) * len(schema)) or not all(
            _is_int(v) and v >= -1 for v in values):
        return "values is not a list of leaf counts (>= -1), one per row group and column"
    return None


def write_json_atomically(path: str, payload: Any, prefix: str) -> None:
    """Replace ``path`` with ``payload`` as JSON, atomically (``write_atomically``)."""
    write_atomically(path, lambda f: json.dump(payload, f, separators=(",", ":")), prefix)


def write_atomically(path: str, write: Callable[[Any], Any], prefix: str, mode: str = "w") -> None:
    """Replace ``path`` with what ``write(f)`` writes: readers see the old file or the new one, never half
    (a temporary file beside it, renamed over it; removed if anything fails). ``mode``: ``"w"`` (UTF-8
    text) or ``"wb"``."""
    directory = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


@functools.lru_cache(maxsize=256)
def encode_schema(schema: pa.Schema) -> str:
    """``schema`` as base64 Arrow IPC, encoded once per distinct one (files by one writer share it)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")


@functools.lru_cache(maxsize=256)
def decode_schema(encoded: str) -> pa.Schema:
    """The Arrow schema of a footer dict's ``schema`` (base64 Arrow IPC), decoded once per distinct one."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(encoded, validate=True)))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
