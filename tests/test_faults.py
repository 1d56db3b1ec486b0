"""Storage faults through a fault-injecting proxy in front of moto: retried, bounded, named, secret-free."""

from __future__ import annotations

import logging
import time

import fsspec
import pytest
import torch
from helpers import LocalUnderProtocol
from torch.utils.data import DataLoader

import streamshard as ss
from streamshard.io.catalog import Catalog
from streamshard.io.footer import SHARED_FOOTERS
from streamshard.io.reader import RowGroupReader
from streamshard.io.retry import RetriesExhausted, RetryPolicy, call_with_retry, is_transient
from streamshard.testing import FaultConfig, faulty_proxy, write_corpus

LAYOUT = [[300, 200], [150], [120, 80, 100], [250]]
NUM_ROWS = sum(sum(f) for f in LAYOUT)
FAST = RetryPolicy(max_attempts=8, base_delay=0.01, max_delay=0.1, deadline=10.0)


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory):
    local = tmp_path_factory.mktemp("faults")
    write_corpus(str(local), LAYOUT)
    return s3.upload(str(local), "faults-bucket", "c")


@pytest.fixture
def proxy(s3):
    with faulty_proxy(s3.endpoint_url, FaultConfig(seed=7)) as p:
        yield p


def via(proxy, s3, **client):
    options = dict(s3.storage_options)
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    options.update(client)
    return options


def epoch(ds, num_workers):
    ds.set_epoch(1)
    return list(DataLoader(ds, batch_size=None, num_workers=num_workers))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]) if isinstance(x[key], torch.Tensor) else x[key] == y[key]


@pytest.mark.parametrize("num_workers", [2])
def test_an_epoch_with_ten_percent_faults_yields_the_fault_free_batches(s3, corpus, proxy, num_workers):
    def make(options):
        return ss.ParquetStream(corpus, columns=["id", "input_ids"], batch_size=64, shuffle=True, seed=3,
                                rank=0, world_size=1, storage_options=options, read_ahead=3)

    clean = epoch(make(s3.storage_options), num_workers)
    proxy.config.fault_rate = 0.10
    proxy.config.faults = ("503", "500", "reset", "truncate")
    proxy.config.fault_methods = ("GET", "HEAD")
    SHARED_FOOTERS.clear()  # the catalog reads its footers under faults too, not from the clean epoch's reads
    faulty = epoch(make(via(proxy, s3)), num_workers)
    assert sum(proxy.faults_injected.values()) > 0, "the proxy injected nothing: the test proves nothing"
    assert_same_batches(clean, faulty)
    ids = torch.cat([b["sample_id"] for b in faulty])
    assert sorted(ids[ids >= 0].tolist()) == list(range(NUM_ROWS))


@pytest.mark.parametrize("backend", ["auto", "fsspec"])  # the default client (obstore where installed) and s3fs
def test_every_fault_kind_is_retried_by_the_reader(s3, corpus, proxy, backend):
    catalog = Catalog.build(corpus, ["id"], via(proxy, s3, backend=backend))
    expected = [RowGroupReader.from_catalog(catalog, s3.storage_options).read(int(f), int(g))
                for f, g in zip(catalog.rg_file, catalog.rg_index)]
    proxy.config.fault_rate = 0.4
    proxy.config.faults = ("503", "500", "reset", "truncate", "stall")
    proxy.config.stall_seconds = 0.5
    options = via(proxy, s3, config_kwargs={"read_timeout": 0.2, "connect_timeout": 0.2}, backend=backend)
    SHARED_FOOTERS.clear()  # the footers are fetched under faults too, not taken from the catalog's reads
    for attempt in range(1):
        reader = RowGroupReader.from_catalog(catalog, options, retry=FAST)
        got = [reader.read(int(f), int(g)) for f, g in zip(catalog.rg_file, catalog.rg_index)]
        assert all(a.equals(b) for a, b in zip(got, expected))
    assert set(proxy.faults_injected) == {"503", "500", "reset", "truncate", "stall"}


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_a_permanently_failing_object_is_named_within_a_bounded_time(s3, corpus, proxy, read_ahead):
    options = via(proxy, s3)
    ds = ss.ParquetStream(corpus, columns=["id"], rank=0, world_size=1, storage_options=options, read_ahead=read_ahead)
    ds.set_epoch(0)  # the catalog is built while the object is still healthy
    proxy.reset_counts()
    proxy.config.permanent = {r"part-00002\.parquet$": 503}
    started = time.monotonic()
    with pytest.raises(ss.ReadError, match=r"part-00002\.parquet.*row group \d.*gave up after 6 attempts") as err:
        list(ds)
    elapsed = time.monotonic() - started
    assert elapsed < RetryPolicy().deadline
    assert "SlowDown" in str(err.value) or "reduce your request rate" in str(err.value)
    # A read is one GET (the coalesced column chunks; the footer came with the catalog) per attempt.
    attempts, gets, per_attempt = RetryPolicy().max_attempts, proxy.count("GET", "part-00002"), 1
    if read_ahead == 0:
        assert gets == attempts * per_attempt  # one read at a time: our retries are the only ones
    else:
        # Reads already in flight when the first one gives up finish their own bounded retries.
        assert attempts * per_attempt <= gets <= attempts * per_attempt * (read_ahead + 2)


@pytest.mark.parametrize("status", [403, 404])
def test_permanent_http_errors_fail_fast_without_retries(s3, corpus, proxy, status):
    catalog = Catalog.build(corpus, ["id"], via(proxy, s3))
    proxy.config.permanent = {r"part-00001\.parquet$": status}
    proxy.reset_counts()
    reader = RowGroupReader.from_catalog(catalog, via(proxy, s3))
    with pytest.raises(ss.ReadError, match=r"part-00001\.parquet: reading row group 0 failed: (PermissionError|FileNotFoundError)"):
        reader.read(1, 0)
    assert proxy.count("GET", "part-00001") == 1  # the data, once (the footer came with the catalog): no retry


def test_a_file_that_changed_size_since_cataloging_is_an_error_naming_it(s3, tmp_path):
    write_corpus(str(tmp_path), [[100, 100], [50]])
    url = s3.upload(str(tmp_path), "changing-bucket", "c")
    catalog = Catalog.build(url, ["id"], s3.storage_options)
    write_corpus(str(tmp_path), [[10], [50]], seed=1)  # part-00000 is rewritten, much smaller
    s3.upload(str(tmp_path), "changing-bucket", "c")
    reader = RowGroupReader.from_catalog(catalog, s3.storage_options, retry=FAST)
    started = time.monotonic()
    with pytest.raises(ss.ReadError, match=r"part-00000\.parquet.*row group 1.*(change|cataloged)"):
        reader.read(0, 1)
    assert time.monotonic() - started < 5


def test_catalog_retries_listing_and_footers(s3, corpus, proxy):
    clean = Catalog.build(corpus, None, s3.storage_options)
    proxy.config.fault_rate = 0.4
    proxy.config.faults = ("503", "reset", "truncate")
    SHARED_FOOTERS.clear()  # the footers are read under faults, not taken from the clean build's reads
    faulty = Catalog.build(corpus, None, via(proxy, s3), retry=FAST)
    assert proxy.faults_injected, "no faults were injected"
    assert faulty.urls == clean.urls and (faulty.rg_rows == clean.rg_rows).all()
    assert (faulty.rg_ranges == clean.rg_ranges).all()


# -- secrets -------------------------------------------------------------------------------------

SECRET = "sUp3r-s3cr3t-V4lue-0123456789"


class LeakyFileSystem(LocalUnderProtocol):
    """A backend that puts its credentials into its error messages (some do)."""

    protocol = "leaky"
    failures_left = 0

    def __init__(self, *args, token=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.token = token

    def _open(self, path, mode="rb", **kwargs):
        if LeakyFileSystem.failures_left > 0:
            LeakyFileSystem.failures_left -= 1
            raise ConnectionResetError(f"connection reset while authenticating with token={self.token}")
        raise PermissionError(f"access denied for token={self.token} on {path}")


def test_secrets_never_appear_in_errors_or_logs(tmp_path, caplog):
    fsspec.register_implementation("leaky", LeakyFileSystem, clobber=True)
    write_corpus(str(tmp_path), [[10]])
    catalog = Catalog.build(str(tmp_path), ["id"])
    LeakyFileSystem.failures_left = 2  # two transient faults (logged), then a permanent one
    reader = RowGroupReader([f"leaky://{catalog.urls[0].split('://', 1)[1]}"], catalog.file_sizes, ["id"],
                            {"token": SECRET}, retry=FAST)
    with caplog.at_level(logging.DEBUG, logger="streamshard"):
        with pytest.raises(ss.ReadError, match=r"part-00000\.parquet.*PermissionError.*token=\*\*\*") as err:
            reader.read(0, 0)
    assert SECRET not in str(err.value) and SECRET not in repr(err.value)
    assert err.value.__cause__ is None or SECRET not in str(err.value.__cause__)
    assert "retrying" in caplog.text and "token=***" in caplog.text
    assert SECRET not in caplog.text


def test_secret_in_s3_options_stays_out_of_a_failed_reads_error(s3, corpus, proxy, caplog):
    options = via(proxy, s3)
    options["secret"] = SECRET  # moto accepts any secret
    catalog = Catalog.build(corpus, ["id"], options)
    proxy.config.permanent = {r"part-00000\.parquet$": 403}
    with caplog.at_level(logging.DEBUG, logger="streamshard"):
        with pytest.raises(ss.ReadError) as err:
            RowGroupReader.from_catalog(catalog, options, retry=FAST).read(0, 0)
    assert SECRET not in str(err.value) and SECRET not in caplog.text


# -- the retry policy on its own -----------------------------------------------------------------

def test_retry_is_bounded_by_attempts_and_deadline():
    calls = []

    def always_reset():
        calls.append(time.monotonic())
        raise ConnectionResetError("reset")

    with pytest.raises(RetriesExhausted) as err:
        call_with_retry(always_reset, RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.02), "x")
    assert len(calls) == 4 and err.value.attempts == 4
    calls.clear()
    started = time.monotonic()
    with pytest.raises(RetriesExhausted):
        call_with_retry(always_reset, RetryPolicy(max_attempts=100, base_delay=0.05, max_delay=0.05, deadline=0.3), "x")
    # The deadline, not the 100 attempts, stopped it (a loose bound: this machine is shared).
    assert 3 <= len(calls) < 100 and time.monotonic() - started < 5


def test_transient_and_permanent_errors_are_told_apart():
    class ClientError(Exception):
        def __init__(self, status, code):
            super().__init__(code)
            self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}

    assert is_transient(ClientError(503, "SlowDown")) and is_transient(ClientError(500, "InternalError"))
    assert not is_transient(ClientError(403, "AccessDenied")) and not is_transient(ClientError(404, "NoSuchKey"))
    wrapped = OSError(121, "internal error")
    wrapped.__cause__ = ClientError(500, "InternalError")
    assert is_transient(wrapped)
    assert is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError("x")) and not is_transient(ValueError("bad"))
