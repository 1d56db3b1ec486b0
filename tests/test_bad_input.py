"""Bad input fails with an error that names the file, column or argument at fault."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.testing import write_corpus


def catalog_of(path, **kwargs):
    return ss.ParquetStream(path, rank=0, world_size=1, **kwargs).catalog


def test_no_files_matched_names_the_pattern(tmp_path):
    with pytest.raises(ss.CatalogError, match="nope"):
        catalog_of(str(tmp_path / "nope*.parquet"))


def test_one_pattern_of_several_matching_nothing_is_an_error(tmp_path):
    write_corpus(str(tmp_path), [[5]])
    with pytest.raises(ss.CatalogError, match="typo"):
        ss.Catalog.build([str(tmp_path / "*.parquet"), str(tmp_path / "typo*.parquet")])


def test_non_parquet_file_is_named(tmp_path):
    write_corpus(str(tmp_path), [[5]])
    (tmp_path / "notes.txt").write_text("hello, this is not parquet at all")
    with pytest.raises(ss.CatalogError, match="notes.txt.*not a readable Parquet"):
        catalog_of(str(tmp_path))


def test_truncated_file_is_named(tmp_path):
    path = write_corpus(str(tmp_path), [[100, 100]])[0]
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ss.CatalogError, match="part-00000.parquet"):
        catalog_of(str(tmp_path))


def test_tiny_and_empty_files_are_rejected_by_name(tmp_path):
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(ss.CatalogError, match="zero.parquet.*too small"):
        catalog_of(str(tmp_path / "zero.parquet"))


def test_missing_column_names_file_and_column(tmp_path):
    write_corpus(str(tmp_path), [[5]])
    with pytest.raises(ss.CatalogError, match=r"part-00000.parquet.*\['nope'\]"):
        catalog_of(str(tmp_path), columns=["id", "nope"])


def test_schemas_that_disagree_name_both_files(tmp_path):
    pq.write_table(pa.table({"x": pa.array([1, 2], pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": pa.array([1.0, 2.0], pa.float64())}), tmp_path / "b.parquet")
    with pytest.raises(ss.CatalogError, match=r"'x'.*a\.parquet.*b\.parquet"):
        catalog_of(str(tmp_path))


def test_hidden_and_marker_files_in_directories_are_skipped(tmp_path):
    write_corpus(str(tmp_path), [[5], [6]])
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / ".part-00000.parquet.crc").write_bytes(b"crc")
    assert catalog_of(str(tmp_path)).num_rows == 11


def test_overlapping_patterns_do_not_duplicate_files(tmp_path):
    write_corpus(str(tmp_path), [[5], [6]])
    catalog = ss.Catalog.build([str(tmp_path), str(tmp_path / "part-00001.parquet")])
    assert catalog.num_files == 2 and catalog.num_rows == 11


def test_zero_row_files_and_row_groups_contribute_nothing(tmp_path):
    write_corpus(str(tmp_path), [[], [0, 4, 0], []])
    catalog = catalog_of(str(tmp_path))
    assert catalog.num_rows == 4 and catalog.num_files == 3
    batches = list(ss.ParquetStream(str(tmp_path), batch_size=None, rank=0, world_size=1))
    assert [b["sample_id"].tolist() for b in batches] == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -1}, "batch_size"),
        ({"unit": "rows"}, "unit"),
        ({"uneven": "repeat"}, "uneven"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"columns": "id"}, "columns"),
        ({"read_ahead": -1}, "read_ahead"),
        ({"transform": 3}, "transform"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ss.ParquetStream(str(tmp_path), **kwargs)


@pytest.mark.parametrize("paths", [[], "", None, [1]])
def test_bad_paths_are_rejected(paths):
    with pytest.raises(ValueError, match="paths"):
        ss.ParquetStream(paths)


def test_set_epoch_rejects_negative():
    with pytest.raises(ValueError, match="epoch"):
        ss.ParquetStream("x.parquet", rank=0, world_size=1).set_epoch(-1)


def test_a_file_that_changed_after_cataloging_fails_loudly(tmp_path):
    write_corpus(str(tmp_path), [[50, 50]])
    ds = ss.ParquetStream(str(tmp_path), rank=0, world_size=1)
    ds.catalog
    write_corpus(str(tmp_path), [[10]], seed=1)  # same name, different content and size
    with pytest.raises(ss.ReadError, match="part-00000.parquet"):
        list(ds)


def _patched_footer(path, tmp_path, pattern: bytes, replacement: bytes, changed) -> str:
    """A copy of ``path`` with one occurrence of ``pattern`` in its footer replaced (same length): the one
    after which pyarrow reads ``changed(metadata)`` as true. A hostile footer pyarrow still parses."""
    import struct

    data = open(path, "rb").read()
    length = struct.unpack("<i", data[-8:-4])[0]
    start = len(data) - 8 - length
    hostile = tmp_path / "hostile" / "h.parquet"
    hostile.parent.mkdir(exist_ok=True)
    at = data.find(pattern, start)
    while at >= 0:
        hostile.write_bytes(data[:at] + replacement + data[at + len(pattern):])
        if changed(pq.ParquetFile(hostile).metadata):
            return str(hostile)
        at = data.find(pattern, at + 1)
    raise AssertionError("the footer field to patch was not found")


def test_a_footer_claiming_a_negative_row_count_is_refused_naming_file_and_row_group(tmp_path):
    # issue 23 item 2: it was accepted, 201 of 600 rows lost and every sample_id pointing at another row
    pq.write_table(pa.table({"id": pa.array(range(60), pa.int64())}), tmp_path / "ok.parquet", row_group_size=30)
    # RowGroup.num_rows (i64, thrift compact: field header 0x16, zigzag varint 30 -> 0x3c) -> -1 (0x01)
    path = _patched_footer(tmp_path / "ok.parquet", tmp_path, b"\x16\x3c", b"\x16\x01",
                           lambda m: m.row_group(0).num_rows == -1)
    with pytest.raises(ss.CatalogError, match=r"h\.parquet: row group 0 claims -1 rows"):
        ss.Catalog.build(path)


def test_a_footer_whose_chunk_lies_past_the_data_is_refused_naming_file_row_group_and_column(tmp_path):
    pq.write_table(pa.table({"id": pa.array(range(60), pa.int64())}), tmp_path / "ok.parquet", row_group_size=30,
                   compression="none")
    size = pq.ParquetFile(tmp_path / "ok.parquet").metadata.row_group(1).column(0).total_compressed_size
    def varint(n: int) -> bytes:  # thrift compact i64: zigzag, then a 2-byte varint for these sizes
        assert 1 << 7 <= n < 1 << 14
        return bytes([(n & 0x7F) | 0x80, n >> 7])

    old, new = varint(2 * size), varint(2 * 8000)  # the chunk's size -> 8,000 bytes, past the file's end
    # ColumnMetaData.total_compressed_size (i64, field 7 after field 6: header 0x16)
    path = _patched_footer(tmp_path / "ok.parquet", tmp_path, b"\x16" + old, b"\x16" + new,
                           lambda m: m.row_group(1).column(0).total_compressed_size == 8000)
    with pytest.raises(ss.CatalogError, match=r"h\.parquet: row group 1, column 'id': its chunk claims bytes"):
        ss.Catalog.build(path)


def test_a_directory_of_symlinks_streams_its_targets_like_the_hugging_face_hub_cache(tmp_path):
    # issue 23 item 3: snapshots/<rev>/*.parquet -> ../../blobs/<hash>, the links made after their targets
    import time

    paths = write_corpus(str(tmp_path / "blobs"), [[40, 30], [25]])
    time.sleep(0.02)  # the links' own mtimes differ from their targets'
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(paths):
        os.symlink(os.path.relpath(path, snapshot), snapshot / f"train-{i}.parquet")
    ds = ss.ParquetStream(str(tmp_path / "snapshots"), batch_size=16, rank=0, world_size=1)
    ids = sorted(int(i) for b in ds for i in b["sample_id"] if i >= 0)
    assert ids == list(range(95))  # it was "the file changed since it was cataloged"


@pytest.mark.parametrize("make, message", [
    (lambda d: os.symlink(d / "gone.parquet", d / "dangling.parquet"),
     r"dangling\.parquet is a symbolic link to .*gone\.parquet.*which does not exist"),
    (lambda d: (os.symlink(d / "b.parquet", d / "a.parquet"), os.symlink(d / "a.parquet", d / "b.parquet")), r"is a symbolic link loop"),
])
def test_dangling_links_and_link_loops_are_named_as_such(tmp_path, make, message):
    data = tmp_path / "data"
    write_corpus(str(data), [[10]])
    make(data)
    with pytest.raises(ss.CatalogError, match=message):
        ss.Catalog.build(str(data))


def test_one_directory_named_twice_under_other_spellings_gives_each_row_once(tmp_path):
    # issue 23 item 3: [d, d/../d] and d// delivered every row twice under two sample_ids
    data = tmp_path / "data"
    write_corpus(str(data), [[40, 30], [25]])
    spellings = [str(data), f"{data}/../data", f"{tmp_path}//data", f"{data}//part-00001.parquet"]
    with pytest.warns(UserWarning, match=r"paths name 5 file\(s\) a second time under another spelling"):
        ds = ss.ParquetStream(spellings, batch_size=16, rank=0, world_size=1)
        ids = sorted(int(i) for b in ds for i in b["sample_id"] if i >= 0)
    assert ids == list(range(95)) and ds.catalog.num_files == 2


def _claiming(path, tmp_path, rows, values=None) -> str:
    """A copy of ``path`` whose footer says row group 0 has ``rows`` rows (and each of its column chunks
    ``values`` values): the footer re-encoded by fastparquet's thrift, the data untouched."""
    import struct

    from fastparquet import cencoding

    data = open(path, "rb").read()
    length = struct.unpack("<i", data[-8:-4])[0]
    meta = cencoding.from_buffer(data[-8 - length:-8], "FileMetaData")
    meta.row_groups[0].num_rows = rows
    for chunk in meta.row_groups[0].columns if values is not None else ():
        chunk.meta_data.num_values = values
    meta.num_rows = sum(group.num_rows for group in meta.row_groups)
    footer = meta.to_bytes()
    hostile = tmp_path / "hostile" / "claims.parquet"
    hostile.parent.mkdir(exist_ok=True)
    hostile.write_bytes(data[:-8 - length] + footer + struct.pack("<i", len(footer)) + b"PAR1")
    return str(hostile)


def _two_columns(tmp_path):
    path = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"id": pa.array(range(600), pa.int64()), "input_ids": pa.array([[1, 2, 3]] * 600)}),
                   path, row_group_size=200)
    return path


def test_a_footer_claiming_more_rows_than_its_column_chunks_hold_is_refused_before_planning(tmp_path):
    # issue 23 item 2: a 13 KB file claiming 2**31-1 rows had the planner allocate 8 GiB arrays (MemoryError,
    # or the OOM killer in a container); pyarrow reads the chunks' 200 rows
    path = _claiming(_two_columns(tmp_path), tmp_path, 2**31 - 1)
    assert pq.ParquetFile(path).metadata.row_group(0).num_rows == 2**31 - 1
    with pytest.raises(ss.CatalogError, match=r"claims\.parquet: row group 0 claims 2147483647 rows but its column "
                                              r"chunk 'id' holds 200 values"):
        ss.Catalog.build(path)


ROOM_JOB = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a 6 GiB container, as the OOM killer sees it
import streamshard as ss
path, kind = sys.argv[1], sys.argv[2]
ds = ss.ParquetStream(path, rank=0, world_size=1, shuffle=True, batch_size=None)
if kind == "packed":  # the token column's footer claims 2**31-1 tokens: planned per token
    ds = ss.PackedStream(ss.ParquetStream(path, rank=0, world_size=1), column="input_ids", seq_len=16, batch_size=4)
try:
    for _ in ss.StreamLoader(ds, num_workers=2, workers="threads"):
        pass
except ss.CatalogError as error:
    print("refused:", error)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind, share", [("stream", "1073742024 of its 2147483647 rows"),
                                         ("packed", "1073742424 of its 2147483647 tokens")])
def test_a_row_group_whose_planning_cannot_fit_in_the_memory_left_is_refused_naming_it(tmp_path, kind, share):
    """The chunks agree with the claim (2**31-1 values each): the plan's per-row (for a pack, per-token)
    arrays are checked against the memory left (here a 6 GiB address-space limit) before they are
    allocated. Before: MemoryError allocating 8 GiB, naming nothing (a PackedStream until 2026-11-26)."""
    import subprocess
    import sys

    path = _claiming(_two_columns(tmp_path), tmp_path, 2**31 - 1, 2**31 - 1)
    done = subprocess.run([sys.executable, "-c", ROOM_JOB, path, kind], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused:" in done.stdout, done.stdout + done.stderr[-2000:]
    assert f"claims.parquet row group 0: this worker's {share} need" in done.stdout
