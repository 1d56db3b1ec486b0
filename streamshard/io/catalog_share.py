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
load. A process that dies while building releases the lock (the kernel drops an ``flock`` with the
last descriptor of its file), publishes nothing, and the next one builds. The snapshot is JSON (the
integer arrays as base64 little-endian int64, the schema as Arrow IPC), so loading it runs no code;
its digest is checked on load. The directory is removed when the dataset that drew the token is
garbage-collected or its process exits (``weakref.finalize``, in that process only); a process killed
outright leaves it behind (``streamshard-catalog-*`` in the temp dir).
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import json
import os
import secrets
import shutil
import stat
import tempfile
import weakref
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from .catalog import Catalog
from ..errors import CatalogError

FORMAT = "streamshard.catalog_snapshot/1"
SNAPSHOT = "catalog.json"
LOCK = "lock"

_forks = 0  # how many times this process has forked (a DataLoader's fork workers are forks)


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(before=_count_fork)


class CatalogShare:
    """Where the processes of one dataset find its catalog snapshot: a token and, once resolved, its directory.

    The directory is resolved on first use (``tempfile.gettempdir()`` may probe the disk) and travels
    with a pickled copy, so spawned workers use the parent's. Forked workers and the owner's cleanup
    resolve it themselves: the temp dir must not change under a running DataLoader.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self._directory: str | None = None
        self._forks_at_birth = _forks
        self._pickled = False

    @classmethod
    def owned_by(cls, owner: object) -> "CatalogShare":
        """A fresh share whose directory is removed when ``owner`` is collected or this process exits.

        Creates nothing: the directory is made by the first process that needs the catalog.
        """
        share = cls(secrets.token_hex(16))
        weakref.finalize(owner, share._remove, os.getpid())
        return share

    @property
    def directory(self) -> str:
        if self._directory is None:
            self._directory = os.path.join(tempfile.gettempdir(), f"streamshard-catalog-{self.token}")
        return self._directory

    def __getstate__(self) -> dict[str, Any]:
        self._pickled = True  # a spawned worker may now need the catalog without its parent's
        return {"token": self.token, "_directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.token, self._directory = state["token"], state["_directory"]
        self._forks_at_birth, self._pickled = _forks, False

    def may_have_workers(self) -> bool:
        """Whether a process of this dataset other than this one may need its catalog: this process has
        forked or pickled it since the share was made, or some process has begun sharing already."""
        return self._pickled or _forks > self._forks_at_birth or self.started()

    def started(self) -> bool:
        """Whether some process of this dataset has begun sharing its catalog (then this one must join)."""
        return os.path.isdir(self.directory)

    def get(self, build: Callable[[], Catalog]) -> Catalog:
        """The published snapshot; if there is none yet, ``build()``'s, published for the others.

        Raises ``CatalogError`` naming the snapshot if it does not load or its digest does not match.
        """
        directory = self._make_directory()
        snapshot = os.path.join(directory, SNAPSHOT)
        fd = os.open(os.path.join(directory, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another process builds; released if it dies
            if os.path.exists(snapshot):
                return load(snapshot)
            catalog = build()
            save(catalog, snapshot)
            return catalog
        finally:
            os.close(fd)  # the flock goes with the last descriptor

    def _remove(self, owner_pid: int) -> None:
        if os.getpid() == owner_pid:  # a forked child inherits the finalizer; the directory is the owner's
            shutil.rmtree(self.directory, ignore_errors=True)

    def _make_directory(self) -> str:
        directory = self.directory
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise CatalogError(f"{directory} is not a directory of this user, so the catalog snapshot cannot be "
                               "shared through it; remove it")
        return directory


def save(catalog: Catalog, path: str) -> None:
    """Write ``catalog`` to ``path`` atomically (a reader sees the whole file or none)."""
    fd, tmp = tempfile.mkstemp(prefix=".snapshot-", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(catalog_to_json(catalog), f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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
