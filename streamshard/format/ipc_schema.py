"""Which fields of a file's stored Arrow schema (``ARROW:schema``) pyarrow has no type for.

pyarrow refuses a whole footer whose stored Arrow schema holds a type it does not implement (polars
writes ``Int128`` as an Arrow ``Int`` of 128 bits), with a message that names no column. The schema is an
Arrow IPC message (a flatbuffer); this reads just enough of it to name the fields: their names, children
and ``Int`` bit widths. Used only on that error path.
"""

from __future__ import annotations

import base64
import struct

_SCHEMA_HEADER = 1  # MessageHeader.Schema
_INT = 2  # Type.Int
_KNOWN_TYPES = 26  # Type.LargeListView: the last type pyarrow 14+ knows


def unsupported_fields(stored: bytes) -> list[str]:
    """Quoted paths (``'a' (a 128-bit integer)``, ``'s.x' (...)``) of the fields of a base64 ``ARROW:schema`` whose type pyarrow cannot build;
    [] when none is found or the bytes are not such a schema."""
    try:
        data = base64.b64decode(stored)
        if data[:4] == b"\xff\xff\xff\xff":  # the continuation marker, then the message's length
            data = data[8:]
        else:
            data = data[4:]
        message = _root(data)
        if _scalar(data, message, 1, "B", 0) != _SCHEMA_HEADER:
            return []
        schema = _table(data, message, 2)
        return _unsupported(data, _vector(data, schema, 1), "")
    except (IndexError, ValueError, struct.error, TypeError):
        return []


def _unsupported(data: bytes, fields: list[int], prefix: str) -> list[str]:
    out = []
    for field in fields:
        name_at = _offset(data, field, 0)
        name = "" if name_at is None else data[name_at + 4:name_at + 4 + _u32(data, name_at)].decode("utf-8", "replace")
        path = prefix + name
        kind = _scalar(data, field, 2, "B", 0)
        if kind > _KNOWN_TYPES:
            out.append(f"{path!r} (Arrow type number {kind})")
        elif kind == _INT:
            bits = _scalar(data, _table(data, field, 3), 0, "i", 0)
            if bits not in (8, 16, 32, 64):
                out.append(f"{path!r} (a {bits}-bit integer)")
        out.extend(_unsupported(data, _vector(data, field, 5), path + "."))
    return out


# -- flatbuffers ----------------------------------------------------------------------------------------
def _u32(data: bytes, at: int) -> int:
    return struct.unpack_from("<I", data, at)[0]


def _root(data: bytes) -> int:
    return _u32(data, 0)


def _field_at(data: bytes, table: int, index: int) -> int | None:
    """Where field ``index`` of the table at ``table`` is stored, or None when it is absent."""
    vtable = table - struct.unpack_from("<i", data, table)[0]
    size = struct.unpack_from("<H", data, vtable)[0]
    if 4 + 2 * index >= size:
        return None
    offset = struct.unpack_from("<H", data, vtable + 4 + 2 * index)[0]
    return table + offset if offset else None


def _scalar(data: bytes, table: int, index: int, kind: str, default: int) -> int:
    at = _field_at(data, table, index)
    return default if at is None else struct.unpack_from("<" + kind, data, at)[0]


def _offset(data: bytes, table: int, index: int) -> int | None:
    at = _field_at(data, table, index)
    return None if at is None else at + _u32(data, at)


def _table(data: bytes, table: int, index: int) -> int:
    at = _offset(data, table, index)
    if at is None:
        raise ValueError("absent table")
    return at


def _vector(data: bytes, table: int, index: int) -> list[int]:
    """The tables a vector-of-tables field points to ([] when absent)."""
    at = _offset(data, table, index)
    if at is None:
        return []
    return [at + 4 + 4 * k + _u32(data, at + 4 + 4 * k) for k in range(_u32(data, at))]
