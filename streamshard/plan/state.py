"""The checkpoint contract shared by every object that iterates (pure: json-safe dicts, no torch).

A state is a small JSON dict: ``version``, ``kind``, ``epoch``, a ``fingerprint`` of everything
that decides the order of the epoch, and the progress (``history``: batches per rank consumed
under each topology this epoch, oldest first). Loading checks the fingerprint field by field and
every number against its range, so a state that does not fit is refused with the field named,
never guessed at.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any, Mapping

import numpy as np

from .elastic import Segment
from ..errors import StateError

STATE_VERSION = 2
MAX_WORLD_SIZE = 1 << 16
MAX_NUM_WORKERS = 1 << 10
MAX_GLOBAL_WORKERS = 1 << 18  # folding a history costs O(global workers) per segment
MAX_SEGMENTS = 1 << 12


IDENTITY_MARK = ",ino="  # in a local file's version (``storage.file_version``): its inode and ctime follow


def split_version(version: str) -> tuple[str, str]:
    """``(content version, file identity)`` of a version token: a local file's inode and ctime are its
    identity ('' elsewhere): a copy with the same content and mtime keeps the first, not the second."""
    content, mark, identity = version.partition(IDENTITY_MARK)
    return content, (mark + identity)[1:] if mark else ""


def catalog_digest(urls: Any, file_sizes: Any, rg_file: Any, rg_rows: Any, versions: Any = (), tables: Any = ()) -> str:
    """A short hash of a catalog's files, sizes, versions and row-group layout: what sample ids depend on.

    ``versions`` (ETag/mtime per file as listed) makes a checkpoint of other file versions a mismatch;
    ``tables`` (``delta:<url>@<version>`` per table read; hashed only when there are some, so the digests
    of catalogs without tables stay what they were) one of another table version.
    A local file's inode and ctime are left out here (as before they were recorded) and hashed by
    :func:`identity_digest` instead, a fingerprint field of its own that older states lack.
    """
    h = hashlib.sha256()
    for url in urls:
        h.update(url.encode())
        h.update(b"\0")
    h.update(b"versions\0")
    for version in versions:
        h.update(split_version(str(version))[0].encode())
        h.update(b"\0")
    for array in (file_sizes, rg_file, rg_rows):
        h.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    if tables:
        h.update(b"tables\0")
        for table in tables:
            h.update(str(table).encode())
            h.update(b"\0")
    return h.hexdigest()[:20]


def identity_digest(versions: Any) -> str:
    """A short hash of the files' identities (a local file's inode and ctime; '' for other stores): a
    file replaced by another of the same size and mtime (``cp -p``) changes it."""
    identities = [split_version(str(v))[1] for v in versions]
    if not any(identities):
        return ""
    h = hashlib.sha256()
    for identity in identities:
        h.update(identity.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


# Fingerprint fields added after states were first saved: a state without one was saved before it
# existed and is checked without it (with a warning saying what could not be checked).
ADDED_LATER = {"file_identity": "a local file replaced since by a copy with the same size and mtime (cp -p) "
                                "cannot be told apart"}


def check_fingerprint(saved: Any, mine: Mapping[str, Any], what: str) -> None:
    """Raise ``StateError`` naming the first field where ``saved`` differs from ``mine``."""
    if not isinstance(saved, Mapping):
        raise StateError(f"state['fingerprint'] must be a dict, got {type(saved).__name__}")
    mine = _as_saved_before(mine, saved)
    for key, value in mine.items():
        if key not in saved:
            raise StateError(f"state['fingerprint'] has no {key!r}; this {what} has {key}={value!r}")
        if saved[key] != value:
            hint = {"catalog": " (the files, their sizes or their row groups changed)",
                    "file_identity": " (a local file was replaced, or copied anew, since: inode or ctime changed; "
                                     "if the files are the same bytes copied again, delete "
                                     "state['fingerprint']['file_identity'] to load it anyway)",
                    "tables": " (another version of the table: pin the saved one with ss.DeltaTable(path, "
                              "version=...))"}.get(key, "")
            raise StateError(
                f"the state was saved with {key}={saved[key]!r} but this {what} has {key}={value!r}{hint}; "
                "resuming would deliver other rows than the saved run"
            )
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise StateError(f"state['fingerprint'] has fields this {what} does not know: {extra}")


def require(state: Any, kinds: tuple[str, ...], keys: tuple[str, ...], what: str) -> Mapping[str, Any]:
    """``state`` if it is a dict of this version and kind with every key; ``StateError`` otherwise."""
    if not isinstance(state, Mapping):
        raise StateError(f"a {what} state must be a dict, got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise StateError(f"state['version'] is {state.get('version')!r}; this streamshard reads version {STATE_VERSION}")
    if state.get("kind") not in kinds:
        raise StateError(f"state['kind'] is {state.get('kind')!r}; a {what} loads {list(kinds)}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise StateError(f"state has no {missing[0]!r} (a {state['kind']} state of a {what} needs {list(keys)})")
    return state


def int_field(state: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StateError(f"state[{key!r}] must be an int, got {value!r:.80}")
    if value < low or (high is not None and value > high):
        raise StateError(f"state[{key!r}] = {value} is outside [{low}, {high if high is not None else 'inf'}]")
    return int(value)


SEGMENT_FIELDS = ("world_size", "num_workers", "batches")


def parse_history(raw: Any) -> list[Segment]:
    """The ``history`` list as segments (empty: the epoch's beginning); every count checked against
    its range. A segment is ``[world_size, num_workers, batches]`` (states before issue 22 wrote it as
    a dict of those fields, still read)."""
    if not isinstance(raw, list) or len(raw) > MAX_SEGMENTS:
        raise StateError(f"state['history'] must be a list of at most {MAX_SEGMENTS} segments, got {raw!r:.80}")
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, (list, tuple)) and len(item) == len(SEGMENT_FIELDS):
            item = dict(zip(SEGMENT_FIELDS, item))
        if not isinstance(item, Mapping) or set(item) != set(SEGMENT_FIELDS):
            raise StateError(f"state['history'][{i}] must be [world_size, num_workers, batches], got {item!r:.80}")
        world = int_field(item, "world_size", 1, MAX_WORLD_SIZE)
        workers = int_field(item, "num_workers", 0, MAX_NUM_WORKERS)
        if world * max(workers, 1) > MAX_GLOBAL_WORKERS:
            raise StateError(f"state['history'][{i}]: {world} ranks x {workers} workers exceeds {MAX_GLOBAL_WORKERS} global workers")
        out.append(Segment(world, workers, int_field(item, "batches", 0)))
    return out


def history_json(history: list[Segment]) -> list[list[int]]:
    """Segments as ``[world_size, num_workers, batches]``: a list of lists is one entry for
    ``torch.distributed.checkpoint``, which flattens dicts and loads only the keys the loading side's
    own state has (a dict per segment would lose the segments a fresh loader does not have)."""
    return [[segment.world_size, segment.num_workers, segment.batches] for segment in history]


def _as_saved_before(mine: Any, saved: Any) -> Any:
    """``mine`` without the ``ADDED_LATER`` fields that ``saved`` lacks (at any depth: a blend's corpora),
    warning once per field what that leaves unchecked."""
    if isinstance(mine, Mapping) and isinstance(saved, Mapping):
        out = {}
        for key, value in mine.items():
            if key in ADDED_LATER and key not in saved:
                warnings.warn(f"this state was saved before streamshard recorded {key!r}: loading it, but "
                              f"{ADDED_LATER[key]}", stacklevel=4)
                continue
            out[key] = _as_saved_before(value, saved.get(key))
        return out
    if isinstance(mine, list) and isinstance(saved, list) and len(mine) == len(saved):
        return [_as_saved_before(m, s) for m, s in zip(mine, saved)]
    return mine
