"""What ``paths`` names, as the catalog needs it: files (URL order), their partition keys, and table versions.

``paths`` holds files, directories and globs (listed by ``catalog.list_entries``) and Delta Lake
tables (``delta.DeltaTable``, or a directory holding ``_delta_log/``, read as its latest version when
``deltalake`` is installed). Every file gets the partition key values of its source: Hive-style
``k=v`` directories under a directory or glob (``io/partitions.py``), a Delta table's values from its
log. The result is JSON-safe through ``listing_to_json`` so rank 0 can list for every rank.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from ..format.catalog_records import FileEntry
from .delta import DeltaTable, DeltaTableFound, deltalake_installed, table_files
from ..errors import CatalogError
from ..format.listing_rules import GLOB_CHARS
from .partitions import combine, hive_pairs, hive_table
from .retry import RetryPolicy
from .storage import FileSystems

Source = str | DeltaTable


@dataclass(frozen=True)
class Listing:
    """Files in URL order, their partition key values (one row per file; None: no keys) and the tag of
    every table version read (``delta:<url>@<version>``)."""

    files: list[FileEntry]
    partitions: pa.Table | None = None
    tables: tuple[str, ...] = ()
    deleted: dict[str, np.ndarray] = field(default_factory=dict)  # url -> row numbers a deletion vector deletes

    @property
    def keys(self) -> list[str]:
        return [] if self.partitions is None else list(self.partitions.column_names)


def normalize_paths(paths: Any) -> list[Source]:
    """``paths`` as a list of str / ``DeltaTable`` (a single one, a path-like, or a sequence of them)."""
    if isinstance(paths, (str, bytes, DeltaTable)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    return [p if isinstance(p, DeltaTable) else str(p) for p in paths]


def list_sources(paths: Any, filesystems: FileSystems, retry: RetryPolicy | None = None,
                 partitioning: str | None = "hive") -> Listing:
    """Every file ``paths`` names, with partition keys (``partitioning="hive"``: read ``k=v`` directories;
    None: none from directory names; a Delta table's keys always come through) and table versions."""
    from .catalog import list_entries  # catalog imports this module

    sources = normalize_paths(paths)
    if not sources:
        raise CatalogError("paths is empty: give at least one file, directory, glob or table")
    tables = [s for s in sources if isinstance(s, DeltaTable)]
    plain = [s for s in sources if isinstance(s, str)]
    files: list[FileEntry] = []
    while plain:
        try:
            files = list_entries(plain, filesystems, retry)
            break
        except DeltaTableFound as found:
            given = _given_path(plain, found.root, filesystems) if found.given else None
            if given is None or not deltalake_installed():
                raise
            plain.remove(given)  # the table's own root: read as its latest version
            tables.append(DeltaTable(given))
    parts: list[tuple[list[FileEntry], pa.Table | None, str]] = []
    if files:
        keys = hive_table([f.url for f in files], _relative_pairs(files, plain, filesystems)) \
            if partitioning == "hive" else None
        parts.append((files, keys, f"{files[0].url}"))
    tags, deleted = [], {}
    for table in tables:
        found = table_files(table, filesystems)
        parts.append((found.entries, found.partitions, str(table)))
        tags.append(found.tag)
        deleted.update(found.deleted)
    return _merged(parts, tuple(tags), deleted)


def _merged(parts: list[tuple[list[FileEntry], pa.Table | None, str]], tags: tuple[str, ...],
            deleted: dict[str, np.ndarray]) -> Listing:
    """One listing in URL order; a file named by two sources is read once (the first source's)."""
    keys = combine([([f.url for f in entries], table, what) for entries, table, what in parts])
    rows: dict[str, tuple[FileEntry, int]] = {}
    offset = 0
    for entries, _, _ in parts:
        for i, entry in enumerate(entries):
            rows.setdefault(entry.url, (entry, offset + i))
        offset += len(entries)
    order = sorted(rows)
    files = [rows[url][0] for url in order]
    if keys is not None:
        keys = keys.take(pa.array([rows[url][1] for url in order], pa.int64()))
    if not files:
        raise CatalogError(f"no files to catalog: the table(s) {list(tags)} hold no data files")
    return Listing(files, keys, tags, deleted)


def _given_path(plain: Sequence[str], root: str, filesystems: FileSystems) -> str | None:
    for path in plain:
        fs, resolved = filesystems.resolve(path)
        if fs.unstrip_protocol(resolved).rstrip("/") == root.rstrip("/"):
            return path
    return None


def _relative_pairs(files: Sequence[FileEntry], plain: Sequence[str],
                    filesystems: FileSystems) -> list[list[tuple[str, str | None]]]:
    """Each file's ``k=v`` directories below the deepest directory or glob base of ``plain`` holding it."""
    bases = sorted({_base_url(path, filesystems) for path in plain}, key=len, reverse=True)
    out = []
    for entry in files:
        base = next((b for b in bases if entry.url.startswith(b + "/")), None)
        out.append(hive_pairs(entry.url[len(base) + 1:]) if base is not None else [])
    return out


def _base_url(path: str, filesystems: FileSystems) -> str:
    """The directory a path's keys are read below: the path itself, or a glob's fixed leading directories."""
    fs, root = filesystems.resolve(path)
    if any(ch in root for ch in GLOB_CHARS):
        cut = min(root.index(ch) for ch in GLOB_CHARS if ch in root)
        root = root[:cut].rsplit("/", 1)[0] if "/" in root[:cut] else ""
    return fs.unstrip_protocol(root).rstrip("/")


def listing_to_json(listing: Listing) -> dict[str, Any]:
    keys = None
    if listing.partitions is not None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, listing.partitions.schema) as writer:
            writer.write_table(listing.partitions)
        keys = base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")
    return {"files": [[f.url, f.size, f.version] for f in listing.files], "partitions": keys,
            "tables": list(listing.tables),
            "deleted": {url: rows.astype("<i8").tobytes().hex() for url, rows in listing.deleted.items()}}


def listing_from_json(data: dict[str, Any]) -> Listing:
    keys = None
    if data.get("partitions") is not None:
        keys = pa.ipc.open_stream(pa.py_buffer(base64.b64decode(data["partitions"], validate=True))).read_all()
    deleted = {url: np.frombuffer(bytes.fromhex(text), dtype="<i8").astype(np.int64)
               for url, text in (data.get("deleted") or {}).items()}
    return Listing([FileEntry(*f) for f in data["files"]], keys, tuple(data.get("tables") or ()), deleted)
