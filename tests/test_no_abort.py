"""No input aborts the process (issue 24 item 4): encrypted Parquet, footers whose chunks do not fit their
schema, metadata pointing past the end. What could abort runs in a subprocess, so a regression fails the
test instead of killing pytest."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pyarrow.parquet.encryption as pe
import pytest

import streamshard as ss
from streamshard.format import parquet_thrift
from streamshard.io.reader import RowGroupReader
from streamshard.io.retry import RetryPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ToyKms(pe.KmsClient):
    """An in-memory KMS: a wrapped key is the key in base64 (what matters here is the file layout)."""

    def __init__(self, config: pe.KmsConnectionConfig) -> None:
        super().__init__()

    def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> bytes:
        return base64.b64encode(key_bytes)

    def unwrap_key(self, wrapped_key: bytes, master_key_identifier: str) -> bytes:
        return base64.b64decode(wrapped_key)


def write_encrypted(path, plaintext_footer: bool) -> None:
    """A file with modular encryption: column ``x`` under its own key, the footer in clear or encrypted."""
    config = pe.EncryptionConfiguration(footer_key="footer", column_keys={"col": ["x"]},
                                        plaintext_footer=plaintext_footer, double_wrapping=False)
    props = pe.CryptoFactory(_ToyKms).file_encryption_properties(pe.KmsConnectionConfig(), config)
    table = pa.table({"x": pa.array(range(10), pa.int64()), "y": pa.array(range(10), pa.int64())})
    with pq.ParquetWriter(path, table.schema, encryption_properties=props) as writer:
        writer.write_table(table)


def without_encryption_algorithm(source, target) -> None:
    """``source`` (plaintext-footer encrypted) with ``FileMetaData.encryption_algorithm`` and what follows cut
    off: a damaged footer whose column chunks still carry column-key crypto metadata (pyarrow aborts on it
    just the same, and nothing at the file level says it is encrypted)."""
    data = open(source, "rb").read()
    length = struct.unpack("<i", data[-8:-4])[0]
    footer = data[-8 - length:-8]
    i = fid = 0
    while footer[i] != 0:
        at = i
        kind, fid, i = parquet_thrift._field(footer, i, fid)
        if fid == 8:  # encryption_algorithm
            break
        i = parquet_thrift._skip(footer, i, kind, 1, in_struct=True)
    else:
        raise AssertionError("no encryption_algorithm field in the footer")
    cut = footer[:at] + b"\x00"
    open(target, "wb").write(data[:-8 - length] + cut + struct.pack("<i", len(cut)) + b"PAR1")


_CATALOG_EACH = textwrap.dedent("""
    import json, sys
    import streamshard as ss
    from streamshard.cli import main
    out = {}
    for path in sys.argv[1:]:
        try:
            ss.Catalog.build(path)
            out[path] = "cataloged"
        except ss.StreamshardError as exc:
            out[path] = f"{type(exc).__name__}: {exc}"
        out[path + " inspect"] = main(["inspect", path])
    print(json.dumps(out))
""")


def _run_isolated(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow
def test_encrypted_files_are_refused_by_name_and_never_abort_the_process(tmp_path):
    # It aborted (SIGABRT, from pyarrow's uncaught C++ exception) while the catalog was built; inspect too.
    plaintext, encrypted, damaged = (str(tmp_path / n) for n in ("plain.parquet", "pare.parquet", "cut.parquet"))
    write_encrypted(plaintext, plaintext_footer=True)
    write_encrypted(encrypted, plaintext_footer=False)
    without_encryption_algorithm(plaintext, damaged)
    done = _run_isolated(_CATALOG_EACH, plaintext, encrypted, damaged)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out[plaintext].startswith("CatalogError") and "plain.parquet: encrypted Parquet is not supported" in \
        out[plaintext]
    assert out[encrypted].startswith("CatalogError") and "pare.parquet: encrypted Parquet is not supported" in \
        out[encrypted] and "PARE" in out[encrypted]
    assert out[damaged].startswith("CatalogError") and "cut.parquet: encrypted Parquet is not supported" in \
        out[damaged] and "column chunk 0 of row group 0" in out[damaged]
    for path in (plaintext, encrypted, damaged):
        assert out[path + " inspect"] == 1  # one line, exit code 1
    assert done.stderr.count("encrypted Parquet is not supported") == 3


def _with_footer_bytes_replaced(source, target, old: bytes, new: bytes) -> None:
    """``source`` with the one occurrence of ``old`` in its footer replaced by ``new`` (the footer's length
    fixed after)."""
    data = open(source, "rb").read()
    length = struct.unpack("<i", data[-8:-4])[0]
    footer = data[-8 - length:-8]
    assert footer.count(old) == 1, f"{old!r} is not in the footer once"
    footer = footer.replace(old, new)
    open(target, "wb").write(data[:-8 - length] + footer + struct.pack("<i", len(footer)) + b"PAR1")


@pytest.mark.slow
def test_chunks_that_contradict_their_schema_are_refused_without_aborting(tmp_path):
    # Found by fuzzing: one flipped footer byte aborted the process ("ColumnMetaData type does not match
    # ColumnDescriptor physical type"; "Definition level histogram size mismatch").
    ints = tmp_path / "ints.parquet"  # ColumnMetaData opens with field 1, type i32 (0x15): INT32 = 1 (zigzag 0x02)
    pq.write_table(pa.table({"a": pa.array(range(10), pa.int32())}), ints)
    _with_footer_bytes_replaced(ints, tmp_path / "type.parquet", b"\x15\x02\x19", b"\x15\x0a\x19")  # -> DOUBLE
    strings = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"id": pa.array(range(10), pa.int64()), "s": pa.array([None, "a"] * 5)}), strings)
    # size_statistics of 's': field 3, definition_level_histogram, a list of 2 i64 (5 nulls, 5 values) -> 1 entry
    _with_footer_bytes_replaced(strings, tmp_path / "levels.parquet", b"\x19\x26\x0a\x0a\x00", b"\x19\x16\x0a\x00")
    paths = [str(tmp_path / "type.parquet"), str(tmp_path / "levels.parquet")]
    done = _run_isolated(_CATALOG_EACH, *paths)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out[paths[0]].startswith("CatalogError") and \
        "type.parquet: corrupt Parquet footer: row group 0, column 'a': its chunk says DOUBLE but the schema says " \
        "INT32" in out[paths[0]]
    assert out[paths[1]].startswith("CatalogError") and \
        "levels.parquet: corrupt Parquet footer: row group 0, column 's': its definition level histogram has 1 " \
        "entries for 2 levels" in out[paths[1]]


def test_metadata_pointing_past_the_end_is_a_read_error_at_once(tmp_path):
    # It was retried 6 times as a "truncated response" (the bytes are not there to be had).
    pq.write_table(pa.table({"id": pa.array(range(60), pa.int64())}), tmp_path / "ok.parquet", row_group_size=30,
                   compression="none")
    meta = pq.ParquetFile(tmp_path / "ok.parquet").metadata
    size = meta.row_group(1).column(0).total_compressed_size

    def varint(n: int) -> bytes:  # thrift compact i64: zigzag, then a 2-byte varint for these sizes
        return bytes([(n & 0x7F) | 0x80, n >> 7])

    data = open(tmp_path / "ok.parquet", "rb").read()
    hostile = tmp_path / "past.parquet"
    at = len(data)
    while True:  # the occurrence that is the last chunk's total_compressed_size: make it 8,000 bytes
        at = data.rindex(b"\x16" + varint(2 * size), 0, at)
        hostile.write_bytes(data[:at + 1] + varint(2 * 8000) + data[at + 3:])
        if pq.ParquetFile(hostile).metadata.row_group(1).column(0).total_compressed_size == 8000:
            break
    reader = RowGroupReader([str(hostile)], [len(data)], ["id"],
                            retry=RetryPolicy(max_attempts=6, base_delay=5.0, max_delay=5.0))
    with pytest.raises(ss.ReadError, match=r"past\.parquet: reading row group 1 failed: its metadata points at "
                                           r"bytes \[\d+, \d+\) but the file has \d+; the file is damaged"):
        reader.read(0, 1)
    assert reader.stats.requests == 1  # the footer; the range past the end is never asked for
