"""The catalog: which Parquet files a set of paths names, and what their footers say.

Files are listed through fsspec (sorted by URL, so every process agrees on the order) and
every footer is read before iteration, concurrently, with one ranged request per file for the
tail. The result is a compact table of row groups (numpy arrays), which is all planning needs.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import CatalogError
from .storage import FileSystems

log = logging.getLogger("streamshard")

_GLOB_CHARS = ("*", "?", "[")
_FOOTER_PROBE_BYTES = 64 * 1024
_MAGIC = b"PAR1"


@dataclass(frozen=True)
class FileFooter:
    """What one file's footer contributes to the catalog."""

    url: str
    size: int
    row_group_rows: np.ndarray  # int64, one entry per row group
    schema: pa.Schema  # projected arrow schema, in projection order
    maybe_null: frozenset[str]  # projected columns whose statistics do not rule out nulls


@dataclass(frozen=True, eq=False)
class Catalog:
    """The row groups of a set of Parquet files, in global sample-id order.

    Global sample ids: files sorted by URL, then row groups in file order, then rows.
    ``schema`` is the projected Arrow schema; a field is nullable when some file's statistics
    do not rule out nulls in it (so tensors get a validity mask for exactly those columns).
    """

    urls: tuple[str, ...]
    file_sizes: np.ndarray  # int64 per file
    rg_file: np.ndarray  # int64 per row group: index into urls
    rg_index: np.ndarray  # int64 per row group: row group number inside its file
    rg_rows: np.ndarray  # int64 per row group
    schema: pa.Schema
    rg_first_id: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        first = np.zeros(len(self.rg_rows), dtype=np.int64)
        if len(self.rg_rows) > 1:
            np.cumsum(self.rg_rows[:-1], out=first[1:])
        object.__setattr__(self, "rg_first_id", first)

    @property
    def num_files(self) -> int:
        return len(self.urls)

    @property
    def num_row_groups(self) -> int:
        return len(self.rg_rows)

    @property
    def num_rows(self) -> int:
        return int(self.rg_rows.sum())

    @property
    def columns(self) -> list[str]:
        return list(self.schema.names)

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"Catalog({self.num_files} files, {self.num_row_groups} row groups, "
            f"{self.num_rows} rows, columns={self.columns})"
        )

    @classmethod
    def build(
        cls,
        paths: str | Sequence[str],
        columns: Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        max_concurrency: int = 32,
    ) -> "Catalog":
        """List the files ``paths`` names and read every footer.

        Raises ``CatalogError`` when a path matches nothing, a file is not Parquet, a projected
        column is missing, or two files disagree on a column's type (naming both files).
        """
        projection = list(columns) if columns is not None else None
        if projection is not None and len(set(projection)) != len(projection):
            raise ValueError(f"columns has duplicates: {projection}")
        filesystems = FileSystems(storage_options)
        files = list_files(paths, filesystems)
        footers = _read_footers(files, projection, filesystems, max_concurrency)
        return cls.from_footers(footers)

    @classmethod
    def from_footers(cls, footers: Sequence[FileFooter]) -> "Catalog":
        """Assemble a catalog from footers already read (in URL order), checking schema agreement."""
        if not footers:
            raise CatalogError("no files to catalog")
        schema = _agree_on_schema(footers)
        counts = np.array([len(f.row_group_rows) for f in footers], dtype=np.int64)
        rows = [f.row_group_rows for f in footers]
        rg_rows = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        rg_file = np.repeat(np.arange(len(footers), dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        rg_index = np.arange(len(rg_rows), dtype=np.int64) - starts
        return cls(
            urls=tuple(f.url for f in footers),
            file_sizes=np.array([f.size for f in footers], dtype=np.int64),
            rg_file=rg_file,
            rg_index=rg_index,
            rg_rows=rg_rows,
            schema=schema,
        )


def list_files(paths: str | Sequence[str], filesystems: FileSystems | None = None) -> list[tuple[str, int]]:
    """Expand files, directories and globs into sorted, de-duplicated ``(url, size)`` pairs.

    Directories are searched recursively; names starting with ``.`` or ``_`` (``_SUCCESS``,
    ``.crc`` files, ``_metadata``) are skipped there, as Spark and Hive writers expect.
    A path that matches nothing is an error, so a typo in one of several globs loses nothing silently.
    """
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [str(paths)]
    paths = [str(p) for p in paths]
    if not paths:
        raise CatalogError("paths is empty: give at least one file, directory or glob")
    filesystems = filesystems or FileSystems()
    found: dict[str, int] = {}
    for path in paths:
        matched = _expand(path, filesystems)
        if not matched:
            raise CatalogError(f"no files matched {path!r}")
        found.update(matched)
    return sorted(found.items())


def _expand(path: str, filesystems: FileSystems) -> dict[str, int]:
    fs, root = filesystems.resolve(path)
    if any(ch in root for ch in _GLOB_CHARS):
        entries = fs.glob(root, detail=True)
    elif fs.isdir(root):
        entries = {root: {"type": "directory"}}
    elif fs.exists(root):
        entries = {root: fs.info(root)}
    else:
        return {}
    out: dict[str, int] = {}
    for name, info in entries.items():
        if info.get("type") == "directory":
            for sub, subinfo in fs.find(name, detail=True).items():
                relative = sub[len(name.rstrip("/")) + 1 :]
                if not any(part.startswith((".", "_")) for part in relative.split("/")):
                    out[fs.unstrip_protocol(sub)] = int(subinfo["size"])
        else:
            out[fs.unstrip_protocol(name)] = int(info["size"])
    return out


def _read_footers(
    files: list[tuple[str, int]],
    columns: list[str] | None,
    filesystems: FileSystems,
    max_concurrency: int,
) -> list[FileFooter]:
    def one(item: tuple[str, int]) -> FileFooter:
        url, size = item
        return read_footer(url, size, columns, filesystems)

    if len(files) == 1 or max_concurrency <= 1:
        return [one(item) for item in files]
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(files))) as pool:
        return list(pool.map(one, files))


def read_footer(url: str, size: int, columns: list[str] | None, filesystems: FileSystems) -> FileFooter:
    """Read one file's footer with one ranged request for its tail (two if the footer is huge)."""
    metadata = _fetch_metadata(url, size, filesystems)
    try:
        schema = metadata.schema.to_arrow_schema()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for bad schemas
        raise CatalogError(f"{url}: cannot convert the Parquet schema to Arrow: {exc}") from exc
    if columns is not None:
        missing = [c for c in columns if schema.get_field_index(c) < 0]
        if missing:
            raise CatalogError(
                f"{url}: column(s) {missing} not found; the file has columns {schema.names}"
            )
        schema = pa.schema([schema.field(c) for c in columns])
    rows = np.array(
        [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)], dtype=np.int64
    )
    return FileFooter(url, size, rows, schema, _columns_maybe_null(metadata, schema))


def _fetch_metadata(url: str, size: int, filesystems: FileSystems) -> pq.FileMetaData:
    if size < 12:
        raise CatalogError(f"{url}: not a Parquet file ({size} bytes is too small)")
    fs, path = filesystems.resolve(url)
    probe = min(size, _FOOTER_PROBE_BYTES)
    tail = fs.cat_file(path, start=size - probe, end=size)
    if len(tail) != probe:
        raise CatalogError(f"{url}: file is shorter than its listed size {size}; did it change?")
    if tail[-4:] != _MAGIC:
        kind = "encrypted Parquet is not supported" if tail[-4:] == b"PARE" else "no PAR1 magic at the end"
        raise CatalogError(f"{url}: not a readable Parquet file ({kind}; truncated or another format?)")
    footer_len = int.from_bytes(tail[-8:-4], "little")
    if footer_len + 12 > size:
        raise CatalogError(f"{url}: corrupt Parquet footer (length {footer_len} exceeds file size {size})")
    if footer_len + 8 > probe:
        tail = fs.cat_file(path, start=size - footer_len - 8, end=size)
    try:
        return pq.read_metadata(pa.BufferReader(tail[-(footer_len + 8) :]))
    except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError/ArrowInvalid variants
        raise CatalogError(f"{url}: corrupt Parquet footer: {exc}") from exc


def _columns_maybe_null(metadata: pq.FileMetaData, schema: pa.Schema) -> frozenset[str]:
    """Projected columns for which some row group's statistics do not rule out nulls."""
    wanted = {f.name for f in schema if f.nullable}
    if not wanted or metadata.num_row_groups == 0:
        return frozenset()
    leaves: dict[str, list[int]] = {}
    for i in range(metadata.num_columns):
        top = metadata.schema.column(i).path.split(".")[0]
        if top in wanted:
            leaves.setdefault(top, []).append(i)
    maybe: set[str] = set()
    for name, indices in leaves.items():
        for rg in range(metadata.num_row_groups):
            group = metadata.row_group(rg)
            if group.num_rows == 0:
                continue
            if any(_may_have_nulls(group.column(i).statistics) for i in indices):
                maybe.add(name)
                break
    return frozenset(maybe)


def _may_have_nulls(stats: pq.Statistics | None) -> bool:
    return stats is None or not stats.has_null_count or stats.null_count > 0


def _agree_on_schema(footers: Sequence[FileFooter]) -> pa.Schema:
    """One schema for all files, or a CatalogError naming two files that disagree."""
    first = footers[0]
    nullable = set().union(*(f.maybe_null for f in footers))
    for other in footers[1:]:
        if other.schema.names != first.schema.names:
            raise CatalogError(
                f"schemas disagree: {first.url} has columns {first.schema.names} but "
                f"{other.url} has {other.schema.names}"
            )
        for a, b in zip(first.schema, other.schema):
            if not a.type.equals(b.type):
                raise CatalogError(
                    f"schemas disagree on column {a.name!r}: {a.type} in {first.url} but "
                    f"{b.type} in {other.url}"
                )
    return pa.schema([f.with_nullable(f.name in nullable) for f in first.schema])
