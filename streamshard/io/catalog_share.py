"""One catalog snapshot per dataset, shared by DataLoader workers whose parent never read it.

Under a plain ``DataLoader(ds, num_workers=N)`` nobody reads the catalog before the workers start.
If each worker listed the files itself, a file landing between two listings would give rows twice or
never. Instead the first process of the dataset that needs the catalog builds it under an exclusive
``flock`` and publishes it as ``catalog.json`` in a directory of its own under the temp dir, named by a
token the dataset drew when it was constructed; every other process of that dataset (the other
workers, the workers of later passes, the main process) loads that snapshot instead of listing again.
A parent that reads the catalog before it could have started any worker without one (``set_epoch``,
``StreamLoader``) writes nothing: its workers inherit the catalog or receive it pickled. Once it may
have (this process forked after the dataset was made, or the dataset was pickled), its first catalog
goes through the share as well, so a parent asked for ``len()`` while its workers start (``list(loader)``
asks right after ``iter()``) loads their snapshot or publishes its own for them: never a second listing
that a file landing in between would make differ. A parent whose build splits the footer reads over
the ranks always builds (its collectives must not depend on when its workers started) and then
adopts whatever snapshot its workers published first.

The lock orders nothing but the build: whoever takes it first builds and the others wait for it, then
load; a process that dies while building publishes nothing, and the next one builds
(``io/process_share.py``: the directory, its lock and its removal). The snapshot is JSON (the integer
arrays as base64 little-endian int64, the schema as Arrow IPC), so loading it runs no code; its digest
is checked on load.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from .catalog import Catalog
from .catalog_cache import write_json_atomically
from .process_share import ProcessShare
from ..errors import CatalogError

FORMAT = "streamshard.catalog_snapshot/1"
SNAPSHOT = "catalog.json"


class CatalogShare(ProcessShare):
    """Where the processes of one dataset find its catalog snapshot (``io/process_share.py``)."""

    prefix = "streamshard-catalog-"

    def get(self, build: Callable[[], Catalog]) -> Catalog:
        """The published snapshot; if there is none yet, ``build()``'s, published for the others.

        Raises ``CatalogError`` naming the snapshot if it does not load or its digest does not match.
        """
        with self.locked() as directory:
            snapshot = os.path.join(directory, SNAPSHOT)
            if os.path.exists(snapshot):
                return load(snapshot)
            catalog = build()
            save(catalog, snapshot)
            return catalog


def save(catalog: Catalog, path: str) -> None:
    """Write ``catalog`` to ``path`` atomically (a reader sees the whole file or none)."""
    write_json_atomically(path, catalog_to_json(catalog), ".snapshot-")


def load(path: str) -> Catalog:
    """The catalog ``save`` wrote to ``path``, checked against the digest stored with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        catalog, written = catalog_from_json(data), data["digest"]
    except (OSError, ValueError, KeyError, TypeError, binascii.Error, pa.ArrowException) as exc:
        raise CatalogError(f"catalog snapshot {path} does not load ({type(exc).__name__}: {exc})") from exc
    if catalog.digest != written:
        raise CatalogError(f"catalog snapshot {path} is damaged: its digest is {catalog.digest}, "
                           f"it was written as {written!r:.40}")
    return catalog


def catalog_to_json(catalog: Catalog) -> dict[str, Any]:
    """A catalog as JSON-safe data, exactly (every array and the schema round-trip bit for bit)."""
    return {
        "format": FORMAT,
        "digest": catalog.digest,
        "urls": list(catalog.urls),
        "versions": list(catalog.versions),
        "schema": base64.b64encode(catalog.schema.serialize().to_pybytes()).decode("ascii"),
        **{name: _pack(getattr(catalog, name)) for name in _ARRAYS},
        "partition_values": _table_to_text(catalog.partition_values),
        "tables": list(catalog.tables),
        "deleted_rows": None if catalog.deleted_rows is None else
        {str(f): _pack(rows) for f, rows in catalog.deleted_rows.items()},
        "rg_stored_rows": _pack(catalog.rg_stored_rows),
    }


def catalog_from_json(data: dict[str, Any]) -> Catalog:
    """The catalog ``catalog_to_json`` described (raises ValueError/KeyError/TypeError if it is malformed)."""
    if data.get("format") != FORMAT:
        raise ValueError(f"format is {data.get('format')!r:.60}, not {FORMAT!r}")
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["schema"], validate=True)))
    return Catalog(urls=tuple(data["urls"]), versions=tuple(data["versions"]), schema=schema,
                   **{name: _unpack(data[name]) for name in _ARRAYS},
                   partition_values=_table_from_text(data.get("partition_values")), tables=tuple(data.get("tables", ())),
                   deleted_rows=None if data.get("deleted_rows") is None else
                   {int(f): _unpack(rows) for f, rows in data["deleted_rows"].items()},
                   rg_stored_rows=_unpack(data.get("rg_stored_rows")))


def _table_to_text(table: pa.Table | None) -> str | None:
    """A small Arrow table (the partition keys) as base64 Arrow IPC: loading it runs no code."""
    if table is None:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode("ascii")


def _table_from_text(text: str | None) -> pa.Table | None:
    if text is None:
        return None
    return pa.ipc.open_stream(pa.py_buffer(base64.b64decode(text, validate=True))).read_all()


_ARRAYS = ("file_sizes", "rg_file", "rg_index", "rg_rows", "footer_lengths", "rg_ranges", "rg_values")


def _pack(array: np.ndarray | None) -> dict[str, Any] | None:
    if array is None:
        return None
    data = np.ascontiguousarray(array, dtype="<i8")
    return {"shape": list(data.shape), "int64": base64.b64encode(data.tobytes()).decode("ascii")}


def _unpack(packed: dict[str, Any] | None) -> np.ndarray | None:
    if packed is None:
        return None
    raw = np.frombuffer(base64.b64decode(packed["int64"], validate=True), dtype="<i8")
    return raw.reshape([int(n) for n in packed["shape"]]).astype(np.int64)  # a writable copy in native order
