"""Which listed names are data: the rules a directory or glob listing applies (pure: names only, no I/O).

Writers and stores leave things beside the data that are never Parquet rows: job markers
(``_SUCCESS``, ``_committed_<id>``, ``_started_<id>``), checksums (``.part-0.parquet.crc``), summary
files (``_metadata``, ``_common_metadata``), logs (``_delta_log/``), the zero-byte ``prefix/`` object
an S3 console's "Create folder" writes, and EMR's ``<dir>_$folder$``. Spark, Hive and
``pyarrow.dataset`` skip names starting with ``.`` or ``_``; so does the catalog, under directories
and for what a glob's wildcards matched. A file named explicitly is read whatever its name.
"""

from __future__ import annotations

GLOB_CHARS = ("*", "?", "[")
_MARKER_SUFFIXES = ("_$folder$",)  # EMR's folder marker objects
_NOT_DATA_SUFFIXES = (".crc",)  # Hadoop checksum files, hidden or not


def is_hidden(name: str) -> bool:
    """Whether one path component is hidden from listings (``.x``, ``_x``), as Spark, Hive and pyarrow treat it."""
    return name.startswith((".", "_"))


def is_marker_name(name: str) -> bool:
    """Whether a file name is a marker or side file whatever its first character (``x_$folder$``, ``x.crc``)."""
    return name.endswith(_MARKER_SUFFIXES + _NOT_DATA_SUFFIXES)


def is_folder_marker(path: str, size: int) -> bool:
    """A zero-byte object whose key ends with ``/``: a folder an object-store console made, never data."""
    return path.endswith("/") and size == 0


def listed_under_directory_is_data(relative: str, size: int) -> bool:
    """Whether a file found under a directory, at ``relative`` (``a/b/part-0.parquet``), is data."""
    if not relative or is_folder_marker(relative, size):
        return False
    parts = relative.rstrip("/").split("/")
    return not any(is_hidden(part) for part in parts) and not is_marker_name(parts[-1])


def matched_by_glob_is_data(pattern: str, match: str, size: int) -> bool:
    """Whether a file a glob matched is data: no component that a wildcard (not the pattern's own
    text) matched is hidden, and it is no marker. ``data/_tmp/*.parquet`` still reads ``_tmp``."""
    if is_folder_marker(match, size):
        return False
    wanted, got = pattern.strip("/").split("/"), match.strip("/").split("/")
    literal = {part for part in wanted if not has_glob(part)}
    first_wild = next((i for i, part in enumerate(wanted) if has_glob(part)), len(wanted))
    matched = got[first_wild:]
    if any(is_hidden(part) and part not in literal for part in matched):
        return False
    return not (is_marker_name(got[-1]) and got[-1] not in literal)


def has_glob(text: str) -> bool:
    return any(ch in text for ch in GLOB_CHARS)
