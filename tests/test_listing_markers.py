"""Listings hold only data (issue 24 item 3): folder markers, job markers, checksums and hidden files
are skipped under directories and in what a glob's wildcards matched, on every store; a file named
explicitly is still read."""

from __future__ import annotations

import io

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
from streamshard.format.listing_rules import listed_under_directory_is_data, matched_by_glob_is_data

BUCKET = "streamshard-markers"
SIDE_FILES = ("_SUCCESS", "_committed_6243", "_started_6243", ".part-0.parquet.crc", "part-0.parquet.crc",
              "sub_$folder$", "_metadata")


def _parquet(rows: int, first: int = 0) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"x": pa.array(range(first, first + rows), pa.int64())}), sink)
    return sink.getvalue()


def _ids(paths, **options) -> list[int]:
    stream = ss.ParquetStream(paths, batch_size=1000, rank=0, world_size=1, storage_options=options or None)
    return sorted(x for batch in stream for x, sid in zip(batch["x"].tolist(), batch["sample_id"].tolist())
                  if sid >= 0)


def test_rules_on_names():
    assert listed_under_directory_is_data("a/part-0.parquet", 10)
    assert not listed_under_directory_is_data("a/", 0)  # the S3 console's "Create folder"
    assert not listed_under_directory_is_data("a_$folder$", 0)
    assert not listed_under_directory_is_data("x.parquet.crc", 8)
    assert not listed_under_directory_is_data("_temporary/0/part-0.parquet", 10)
    assert matched_by_glob_is_data("d/*/*.parquet", "d/a/p.parquet", 10)
    assert not matched_by_glob_is_data("d/*", "d/_SUCCESS", 0)
    assert not matched_by_glob_is_data("d/**", "d/.hidden/p.parquet", 10)
    assert matched_by_glob_is_data("d/_tmp/*.parquet", "d/_tmp/p.parquet", 10)  # the pattern names _tmp itself


def test_local_directory_and_glob_skip_side_files(tmp_path):
    root = tmp_path / "out"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "part-0.parquet").write_bytes(_parquet(5))
    (root / "part-1.parquet").write_bytes(_parquet(3, 5))
    (root / ".hidden").mkdir()
    (root / ".hidden" / "part-9.parquet").write_bytes(_parquet(4, 100))
    for name in SIDE_FILES:
        (root / name).write_bytes(b"")
    (root / "sub" / "_SUCCESS").write_bytes(b"")
    want = list(range(8))
    assert _ids(str(root)) == want
    assert _ids(str(root / "*")) == want  # the glob matches _SUCCESS, sub_$folder$, ...: skipped
    assert _ids(str(root / "**")) == want
    # named explicitly, a hidden file is read
    assert _ids([str(root), str(root / ".hidden" / "part-9.parquet")]) == want + list(range(100, 104))


def test_explicitly_named_marker_is_still_refused_as_not_parquet(tmp_path):
    (tmp_path / "_SUCCESS").write_bytes(b"")
    with pytest.raises(ss.CatalogError, match="_SUCCESS"):
        ss.Catalog.build(str(tmp_path / "_SUCCESS"))


def test_memory_filesystem_skips_side_files():
    fs = fsspec.filesystem("memory")
    base = "/streamshard-markers-test"
    try:
        fs.pipe(f"{base}/d/a.parquet", _parquet(4))
        for name in SIDE_FILES:
            fs.pipe(f"{base}/d/{name}", b"")
        assert _ids(f"memory://{base}/d") == [0, 1, 2, 3]
        assert _ids(f"memory://{base}/d/*") == [0, 1, 2, 3]
    finally:
        fs.rm(base, recursive=True)


@pytest.mark.parametrize("backend", ["fsspec", "obstore"])
def test_s3_console_folder_markers_are_not_files(s3, backend):
    """Keys as the S3 console, EMR and Spark leave them: ``d/`` and ``d/sub/`` zero-byte objects, ``d/sub_$folder$``,
    ``_SUCCESS``; before, the catalog failed on the first (``not a Parquet file (0 bytes is too small)``)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.key,
                          aws_secret_access_key=s3.secret, region_name=s3.region)
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": s3.region})
    objects = {"d/": b"", "d/sub/": b"", "d/sub/part-0.parquet": _parquet(5), "d/part-1.parquet": _parquet(2, 5),
               "d/sub_$folder$": b"", "d/_SUCCESS": b"", "d/empty/": b"", "d/sub/.part-0.parquet.crc": b"c"}
    for key, body in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
    if backend == "obstore":
        pytest.importorskip("obstore")
    options = {**s3.storage_options, "backend": backend}
    want = list(range(7))
    assert _ids(f"s3://{BUCKET}/d", **options) == want
    assert _ids(f"s3://{BUCKET}/d/", **options) == want
    assert _ids(f"s3://{BUCKET}/d/**", **options) == want
    assert _ids(f"s3://{BUCKET}/d/*", **options) == want
    assert _ids(f"s3://{BUCKET}/d/*/*.parquet", **options) == [0, 1, 2, 3, 4]
