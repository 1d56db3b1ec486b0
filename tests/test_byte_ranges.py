"""Byte ranges: a worker fetches only the projected column chunks, in few requests, and decodes them right."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import streamshard as ss
from streamshard.io import storage
from streamshard.io.catalog import Catalog
from streamshard.io.footer import FOOTER_PROBE_BYTES, chunk_ranges, tail_range
from streamshard.io.reader import RowGroupReader
from streamshard.io.retry import RetryPolicy
from streamshard.testing import FaultConfig, faulty_proxy

ROWS_PER_GROUP = 10_000
GROUPS = 4


def wide_table(rows: int, seed: int) -> pa.Table:
    """Three columns of incompressible data, so chunk sizes are what the bytes say."""
    rng = np.random.default_rng(seed)
    return pa.table({
        "a": rng.integers(0, 2**62, rows),
        "b": rng.random(rows),
        "c": pa.array([f"{x:x}" for x in rng.integers(0, 2**60, rows)]),
    })


@pytest.fixture(scope="module")
def three_columns(tmp_path_factory):
    root = tmp_path_factory.mktemp("three")
    path = root / "part-0.parquet"
    pq.write_table(wide_table(ROWS_PER_GROUP * GROUPS, 0), path, row_group_size=ROWS_PER_GROUP)
    return root, pq.read_metadata(path)


@pytest.fixture(scope="module")
def s3_three(s3, three_columns):
    root, metadata = three_columns
    return s3.upload(str(root), "ranges-bucket", "three"), metadata


def column_bytes(metadata: pq.FileMetaData, name: str) -> int:
    index = metadata.schema.names.index(name)
    return sum(metadata.row_group(g).column(index).total_compressed_size for g in range(metadata.num_row_groups))


def via(proxy, s3):
    options = dict(s3.storage_options)
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return options


def test_projecting_one_of_three_columns_fetches_only_its_chunks(s3, s3_three):
    url, metadata = s3_three
    with faulty_proxy(s3.endpoint_url) as proxy:
        options = via(proxy, s3)
        catalog = Catalog.build(url, ["b"], options)
        proxy.reset_counts()
        reader = RowGroupReader.from_catalog(catalog, options)
        tables = [reader.read(0, g) for g in range(GROUPS)]
        wanted = column_bytes(metadata, "b")
        fetched = proxy.bytes("GET")
        gets = proxy.count("GET")
        print(f"\nbytes fetched / column bytes = {fetched / wanted:.3f}; GETs per row group = {gets / GROUPS:.2f}")
        assert wanted <= fetched <= 1.15 * wanted
        assert gets == GROUPS  # one coalesced range per row group; the footer: the catalog's read of it
        assert reader.stats.footers_shared == 1 and reader.stats.footers_fetched == 0
        assert proxy.count("HEAD") == 0  # the version check rides on every GET (If-Match)
        assert reader.stats.misses == 0
    expected = pq.read_table(str(url).replace("s3://", ""), filesystem=s3.filesystem(), columns=["b"])
    assert pa.concat_tables(tables).equals(expected)


def test_dataset_over_s3_fetches_little_more_than_the_projected_columns(s3, s3_three):
    url, metadata = s3_three
    with faulty_proxy(s3.endpoint_url) as proxy:
        ds = ss.ParquetStream(url, columns=["a"], rank=0, world_size=1, storage_options=via(proxy, s3))
        ds.set_epoch(0)
        proxy.reset_counts()
        rows = sum(int((batch["sample_id"] >= 0).sum()) for batch in ds)
        assert rows == ROWS_PER_GROUP * GROUPS
        assert proxy.bytes("GET") <= 1.15 * column_bytes(metadata, "a")
        assert proxy.count("GET") <= GROUPS + 1
        assert proxy.count("HEAD") == 0  # the version check rides on every GET (If-Match)


def test_adjacent_columns_are_coalesced_into_one_request(s3, s3_three):
    url, metadata = s3_three
    with faulty_proxy(s3.endpoint_url) as proxy:
        options = via(proxy, s3)
        catalog = Catalog.build(url, ["a", "b"], options)
        proxy.reset_counts()
        reader = RowGroupReader.from_catalog(catalog, options)
        for g in range(GROUPS):
            reader.read(0, g)
        assert proxy.count("GET") == GROUPS  # the footer came with the catalog (this process read it)
        assert proxy.bytes("GET") <= 1.15 * (column_bytes(metadata, "a") + column_bytes(metadata, "b"))


@pytest.fixture
def version_by_head(monkeypatch):
    """S3 checking versions as stores without If-Match (gcsfs, http) do: one info (HEAD) per file per reader."""
    monkeypatch.setattr(storage, "CONDITIONAL_GETS", False)


def test_the_version_check_is_in_flight_alongside_the_files_first_fetch(s3, s3_three, version_by_head):
    # The data GETs hang until the deadline; the one HEAD per file was sent anyway, so it is not a
    # round trip after the fetch. The failure still names the file and gives up within the policy.
    url, _ = s3_three
    with faulty_proxy(s3.endpoint_url, FaultConfig(fault_rate=1.0, faults=("stall",), fault_methods=("GET",),
                                                   stall_seconds=3.0)) as proxy:
        options = via(proxy, s3)
        proxy.config.fault_rate = 0.0
        catalog = Catalog.build(url, ["a"], options)
        proxy.config.fault_rate = 1.0
        proxy.reset_counts()
        reader = RowGroupReader.from_catalog(catalog, options, retry=RetryPolicy(max_attempts=1, deadline=1.0))
        with pytest.raises(ss.ReadError, match=r"part-0\.parquet: reading row group 0 failed: gave up"):
            reader.read(0, 0)
        reader.close()  # waits for the check in flight
        assert proxy.count("HEAD") == 1


def test_a_row_group_read_while_its_files_check_is_in_flight_waits_for_it(s3, s3_three, version_by_head):
    # Several row groups of one file read at once: one HEAD, every table right.
    url, _ = s3_three
    with faulty_proxy(s3.endpoint_url, FaultConfig(latency=0.02)) as proxy:
        options = via(proxy, s3)
        catalog = Catalog.build(url, ["a", "c"], options)
        proxy.reset_counts()
        reader = RowGroupReader.from_catalog(catalog, options)
        with ThreadPoolExecutor(GROUPS) as pool:
            tables = list(pool.map(lambda g: reader.read(0, g), range(GROUPS)))
        reader.close()
        assert proxy.count("HEAD") == 1
    expected = pq.read_table(str(url).replace("s3://", ""), filesystem=s3.filesystem(), columns=["a", "c"])
    assert pa.concat_tables(tables).equals(expected)


# -- property: the planned ranges hold every byte pyarrow reads, for many schemas ---------------

COLUMN_TYPES = {
    "int": lambda rng, n: pa.array(rng.integers(-1000, 1000, n)),
    "nullable_float": lambda rng, n: pa.array(np.where(rng.random(n) < 0.3, np.nan, rng.random(n)), from_pandas=True),
    "string": lambda rng, n: pa.array([f"s{x}" for x in rng.integers(0, 50, n)]),  # dictionary-encoded
    "list": lambda rng, n: pa.array([list(range(int(k))) for k in rng.integers(0, 5, n)], pa.list_(pa.int32())),
    "struct": lambda rng, n: pa.StructArray.from_arrays(
        [pa.array(rng.integers(0, 9, n)), pa.array(rng.random(n))], ["x", "y"]),
    "map": lambda rng, n: pa.array([[("k", int(v))] for v in rng.integers(0, 9, n)], pa.map_(pa.string(), pa.int64())),
}


class RecordingFile:
    """A local file that records every (offset, length) pyarrow reads from it."""

    def __init__(self, path):
        self.f = open(path, "rb")
        self.reads = []
        self.closed = False

    def read(self, n=-1):
        self.reads.append((self.f.tell(), n))
        return self.f.read(n)

    def seek(self, *args):
        return self.f.seek(*args)

    def tell(self):
        return self.f.tell()

    def close(self):
        self.f.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kinds=st.lists(st.sampled_from(sorted(COLUMN_TYPES)), min_size=1, max_size=5),
    groups=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    pick=st.data(),
    seed=st.integers(0, 1000),
)
def test_planned_ranges_cover_what_pyarrow_reads_and_decode_identically(tmp_path_factory, kinds, groups, pick, seed):
    root = tmp_path_factory.mktemp("prop")
    rng = np.random.default_rng(seed)
    names = [f"c{i}_{k}" for i, k in enumerate(kinds)]
    path = root / "f.parquet"
    with pq.ParquetWriter(path, pa.schema([(n, COLUMN_TYPES[k](rng, 1).type) for n, k in zip(names, kinds)])) as w:
        for rows in groups:
            w.write_table(pa.table({n: COLUMN_TYPES[k](rng, rows) for n, k in zip(names, kinds)}), row_group_size=rows)
    projection = pick.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    metadata = pq.read_metadata(path)
    ranges = chunk_ranges(metadata, projection)
    for g in range(len(groups)):
        recorder = RecordingFile(path)
        pq.ParquetFile(pa.PythonFile(recorder, mode="r"), metadata=metadata, pre_buffer=False).read_row_group(
            g, columns=projection)
        for offset, length in recorder.reads:
            assert any(s <= offset and offset + length <= e for s, e in ranges[g]), (offset, length, ranges[g])
        recorder.close()
    catalog = Catalog.build(str(path), projection)
    reader = RowGroupReader.from_catalog(catalog, retry=RetryPolicy(max_attempts=1))
    for g in range(len(groups)):
        assert reader.read(0, g).equals(pq.ParquetFile(path).read_row_group(g, columns=projection))
    assert reader.stats.misses == 0
    assert reader.stats.footers_fetched + reader.stats.footers_shared == 1
    reader.close()


def test_a_reader_without_the_catalogs_layout_gets_a_footer_under_the_probe_size_in_one_request(tmp_path):
    # A 40 KB footer (key-value metadata), as wide schemas with many row groups have: the probe of the
    # tail (the catalog's and the reader's, one constant) holds it, so the reader's first read of the
    # file is two requests (footer probe, then the chunks), not three.
    table = pa.table({"id": pa.array(range(1000), pa.int64())})
    path = tmp_path / "wide-footer.parquet"
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({"pad": "x" * 40_000})
    size = path.stat().st_size
    assert 40_000 < pq.read_metadata(path).serialized_size < FOOTER_PROBE_BYTES
    assert tail_range(size, None) == (max(0, size - FOOTER_PROBE_BYTES), size)
    reader = RowGroupReader([str(path)], [size], ["id"])
    try:
        assert reader.read(0, 0).column("id").to_pylist() == list(range(1000))
        assert (reader.stats.requests, reader.stats.footers_fetched, reader.stats.misses) == (2, 1, 0)
    finally:
        reader.close()
