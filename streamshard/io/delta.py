"""Delta Lake tables as a source: the live data files of one table version, read through ``deltalake``.

A Delta table's directory holds every file any version ever wrote; which ones make up a version is
known only from its ``_delta_log/``. Listed as plain Parquet, a table after an overwrite or a
delete streams files the log removed (1,300 rows where the table has 300). So a directory holding
``_delta_log/`` is never read as plain files (``DeltaTableFound``): with the ``delta`` extra
installed the table's own path reads its latest version, ``DeltaTable(path, version=...)`` (or
``timestamp=``) pins one; without it the error says to install it.

What a version contributes to the catalog: each add action's file (URL, size; Delta files are
immutable, so the size is their version check), its partition values (typed as the table's schema
says) and the tag ``delta:<table URL>@<version>``, which the catalog digest and a checkpoint's
fingerprint carry (a checkpoint of version 3 does not load against version 4). Deletion vectors
are honoured: the rows they delete are left out of the catalog (``deleted``: each file's deleted
row numbers, which ``Catalog.from_footers`` turns into row counts and ``format/deletions.py`` into the rows a
reader keeps). Column mapping and reader features this module does not know are refused by name.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping
from urllib.parse import unquote

import numpy as np
import pyarrow as pa

from ..format.catalog_records import FileEntry
from ..errors import CatalogError

__all__ = ["DeltaTable", "DeltaTableFound", "TableFiles"]

DELTA_LOG = "_delta_log"
INSTALL = "pip install 'streamshard[delta]' (the deltalake package)"
# Reader features that do not change which rows or columns the data files hold.
_HARMLESS_FEATURES = frozenset({"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck", "variantType",
                                "variantType-preview", "typeWidening", "typeWidening-preview", "checkpointProtection",
                                "deletionVectors"})  # honoured: the rows they delete are left out


@dataclass(frozen=True)
class DeltaTable:
    """A Delta Lake table as a ``paths`` entry: ``ss.ParquetStream(ss.DeltaTable("s3://b/t", version=3))``.

    Args:
        path: the table's root (any URL deltalake reads: local, ``s3://``, ``gs://``, ``az://``).
        version: the table version to read (None: the latest when the catalog is built).
        timestamp: instead of ``version``, the version current at this time (a ``datetime``, UTC when
            naive, or an ISO 8601 string).
        storage_options: deltalake's own options (``AWS_ENDPOINT_URL``, ...) for reading the log. None:
            derived from the stream's fsspec ``storage_options`` where the mapping is known (s3fs's
            ``key``/``secret``/``token``/``endpoint_url``/``region_name``); the data files are always
            read through fsspec with the stream's ``storage_options``.

    The version read is fixed when the catalog is built (one snapshot per dataset) and recorded in
    its digest, so a checkpoint refuses to resume against another version.
    """

    path: str
    version: int | None = None
    timestamp: datetime | str | None = None
    storage_options: Mapping[str, str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"DeltaTable path must be a non-empty str, got {self.path!r}")
        if self.version is not None and (isinstance(self.version, bool) or not isinstance(self.version, int)
                                         or self.version < 0):
            raise ValueError(f"DeltaTable version must be an int >= 0 or None, got {self.version!r}")
        if self.timestamp is not None and not isinstance(self.timestamp, (datetime, str)):
            raise ValueError(f"DeltaTable timestamp must be a datetime or ISO 8601 str, got {self.timestamp!r}")
        if self.version is not None and self.timestamp is not None:
            raise ValueError("DeltaTable takes version= or timestamp=, not both")

    def __str__(self) -> str:
        at = f"@{self.version}" if self.version is not None else f"@{self.timestamp}" if self.timestamp else ""
        return f"{self.path}{at}"


class DeltaTableFound(CatalogError):
    """A directory or glob that would read a Delta Lake table's files as plain Parquet.

    ``root`` is the table's URL; ``given`` whether the path given was the table's root itself (then,
    with ``deltalake`` installed, the catalog reads that path as the table's latest version)."""

    def __init__(self, message: str, root: str = "", given: bool = False) -> None:
        super().__init__(message)
        self.root, self.given = root, given


def delta_root_in_listing(directory_url: str, relatives: list[str]) -> DeltaTableFound | None:
    """The error for a directory whose recursive listing (paths relative to it) holds a ``_delta_log``."""
    logs = sorted({r.split("/" + DELTA_LOG + "/")[0] if not r.startswith(DELTA_LOG + "/") else ""
                   for r in relatives if r.startswith(DELTA_LOG + "/") or ("/" + DELTA_LOG + "/") in r})
    if not logs:
        return None
    inner = logs[0]
    if inner == "":
        return DeltaTableFound(
            f"{directory_url} is a Delta Lake table (it holds {DELTA_LOG}/): its live files are known only from "
            f"its log, and read as plain Parquet it would stream files the log removed. Read it as a table: "
            f"{'install the delta extra, ' + INSTALL + ', then ' if not deltalake_installed() else ''}pass the "
            f"path alone or ss.DeltaTable(path, version=...)", directory_url, True)
    root = f"{directory_url.rstrip('/')}/{inner}"
    return DeltaTableFound(
        f"{directory_url} holds the Delta Lake table {root} (it has {DELTA_LOG}/): read as plain Parquet it would "
        f"stream files the log removed; give the table as a path of its own or ss.DeltaTable({root!r})"
        + ("" if deltalake_installed() else f" ({INSTALL})"), root, False)


def delta_root_of_glob(glob_url: str, base_url: str) -> DeltaTableFound:
    return DeltaTableFound(
        f"{glob_url} matches files of the Delta Lake table {base_url} (it has {DELTA_LOG}/): read as plain "
        f"Parquet they include files the log removed; give the table path itself or ss.DeltaTable({base_url!r})"
        + ("" if deltalake_installed() else f" ({INSTALL})"), base_url, False)


def deltalake_installed() -> bool:
    try:
        import deltalake  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class TableFiles:
    """The live files of one table version: entries (URL order not guaranteed), their partition values
    (one row per entry, typed; None for an unpartitioned table), the version's tag and, per file URL with
    a deletion vector, the sorted row numbers (in the file) it deletes."""

    entries: list[FileEntry]
    partitions: pa.Table | None
    tag: str
    deleted: dict[str, np.ndarray] = field(default_factory=dict)


def table_files(table: DeltaTable, filesystems: Any) -> TableFiles:
    """Load ``table`` at its version through ``deltalake`` and list its live files (``CatalogError`` naming
    the table when it cannot be loaded, or uses deletion vectors, column mapping or an unknown reader feature)."""
    try:
        import deltalake
    except ImportError:
        raise CatalogError(f"{table.path} is a Delta Lake table; reading it needs the delta extra: {INSTALL}") from None
    options = dict(table.storage_options) if table.storage_options is not None else \
        delta_storage_options(table.path, filesystems.storage_options)
    where = f"Delta table {table}"
    try:
        loaded = deltalake.DeltaTable(_delta_uri(table.path), version=table.version, storage_options=options or None)
        if table.timestamp is not None:
            loaded.load_as_version(table.timestamp)
    except Exception as exc:  # noqa: BLE001 - deltalake raises its own types (TableNotFoundError, OSError, ...)
        raise CatalogError(filesystems.redact(f"{where}: cannot load it: {type(exc).__name__}: {exc}")) from None
    version = loaded.version()
    where = f"Delta table {table.path} version {version}"
    _check_readable(loaded, where)
    deleted = _deleted_rows(loaded) if "deletionVectors" in set(loaded.protocol().reader_features or ()) else {}
    actions = pa.table(loaded.get_add_actions(flatten=True))
    fs, root = filesystems.resolve(table.path)
    root_url = fs.unstrip_protocol(root).rstrip("/")
    entries = []
    for relative, size in zip(actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist()):
        url = _file_url(fs, root_url, relative)
        entries.append(FileEntry(url, int(size), ""))  # Delta files are immutable: the size is their check
    by_path = {unquote(e.url): e.url for e in entries}
    unknown = [u for u in deleted if unquote(u) not in by_path]
    if unknown:
        raise CatalogError(f"{where}: a deletion vector names {unknown[0]}, which is not one of its live files")
    deleted = {by_path[unquote(u)]: rows for u, rows in deleted.items()}
    keys = list(loaded.metadata().partition_columns)
    partitions = None
    if keys:
        missing = [k for k in keys if f"partition.{k}" not in actions.column_names]
        if missing:
            raise CatalogError(f"{where}: deltalake gave no values for partition column(s) {missing}")
        partitions = pa.table({k: actions.column(f"partition.{k}") for k in keys})
    return TableFiles(entries, partitions, f"delta:{root_url}@{version}", deleted)


def _check_readable(loaded: Any, where: str) -> None:
    """Refuse what would make the data files say other columns than the table, or features not known (by name)."""
    configuration = loaded.metadata().configuration or {}
    mapping = configuration.get("delta.columnMapping.mode", "none")
    if mapping not in ("none", None):
        raise CatalogError(f"{where} uses column mapping (delta.columnMapping.mode={mapping}): its files name "
                           "columns other than the table does, which streamshard does not read")
    features = set(loaded.protocol().reader_features or ())
    unknown = sorted(features - _HARMLESS_FEATURES)
    if unknown:
        raise CatalogError(f"{where} needs reader feature(s) {unknown}, which streamshard does not support")


def _deleted_rows(loaded: Any) -> dict[str, np.ndarray]:
    """Per file URI with a deletion vector, the row numbers it deletes (deltalake's keep masks, inverted;
    rows past a mask's end are kept)."""
    vectors = pa.table(loaded.deletion_vectors())
    out: dict[str, np.ndarray] = {}
    for path, mask in zip(vectors.column("filepath").to_pylist(), vectors.column("selection_vector").to_pylist()):
        out[_local_uri(path)] = np.flatnonzero(~np.asarray(mask, dtype=bool)).astype(np.int64)
    return out


def _local_uri(uri: str) -> str:
    """deltalake's URI of a local file as fsspec names it (``file:///x``); others unchanged."""
    return "file://" + uri if uri.startswith("/") else uri


def _file_url(fs: Any, root_url: str, relative: str) -> str:
    """The URL of an add action's path: relative to the table root, percent-encoded as the protocol says."""
    path = unquote(relative)
    if "://" in path:  # an absolute path (shallow clones)
        return fs.unstrip_protocol(fs._strip_protocol(path))
    return posixpath.join(root_url, path)


def _delta_uri(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def delta_storage_options(path: str, storage_options: Mapping[str, Any]) -> dict[str, str]:
    """deltalake's options for an s3:// table from s3fs-style fsspec options (key, secret, token,
    client_kwargs.endpoint_url/region_name); other stores: none (pass ``DeltaTable(storage_options=)``)."""
    if not path.startswith(("s3://", "s3a://")):
        return {}
    client = dict(storage_options.get("client_kwargs") or {})
    mapping = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}
    out = {delta: str(storage_options[s3fs]) for s3fs, delta in mapping.items() if storage_options.get(s3fs)}
    endpoint = client.get("endpoint_url") or storage_options.get("endpoint_url")
    if endpoint:
        out["AWS_ENDPOINT_URL"] = str(endpoint)
        if str(endpoint).startswith("http://"):
            out["AWS_ALLOW_HTTP"] = "true"
    region = client.get("region_name") or storage_options.get("region_name")
    if region:
        out["AWS_REGION"] = str(region)
    return out
