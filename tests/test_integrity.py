"""Integrity under change and abuse: files read at the cataloged version, literal paths, errors
that name their place and cause, secrets kept out of third-party logs, deadlines that hold."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from contextlib import contextmanager

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamshard as ss
import streamshard.io.catalog as catalog_module
from streamshard.io.catalog import Catalog
from helpers import LocalUnderProtocol

from streamshard.streams.delivery import deliver
from streamshard.io.footer import SHARED_FOOTERS
from streamshard.io.reader import RowGroupReader
from streamshard.io.retry import RetryPolicy
from streamshard.io.storage import REDACTION, FileSystems, LogRedaction, redact_url, url_secrets
from streamshard.testing import faulty_proxy, write_corpus, write_fixed


def via(proxy, s3):
    options = dict(s3.storage_options)
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": proxy.endpoint_url}
    return options


def rewrite_same_size(path, first_id: int) -> None:
    """Replace ``path`` by a file of the same size, footer and row groups but other rows (and a later mtime)."""
    before = os.stat(path)
    write_fixed(f"{path}.new", first_id)
    os.replace(f"{path}.new", path)
    os.utime(path, (before.st_atime + 5, before.st_mtime + 5))
    assert os.path.getsize(path) == before.st_size  # nothing but the version can tell


# -- 1. files are read at the version the catalog recorded ----------------------------------------

def test_the_catalog_keeps_each_files_version_and_its_digest_covers_them(tmp_path):
    write_corpus(str(tmp_path / "data"), [[5], [6]])
    catalog = Catalog.build(str(tmp_path / "data"))
    assert len(catalog.versions) == 2 and all(v.startswith("mtime=") for v in catalog.versions)
    cached = Catalog.build(str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"))
    again = Catalog.build(str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"))  # from the cache
    assert cached.versions == again.versions == catalog.versions and again.digest == catalog.digest
    target = tmp_path / "data" / "part-00001.parquet"
    stat = target.stat()
    os.utime(target, (stat.st_atime, stat.st_mtime + 5))
    touched = Catalog.build(str(tmp_path / "data"))
    assert touched.num_rows == catalog.num_rows and touched.digest != catalog.digest


def test_a_local_file_rewritten_at_the_same_size_is_refused_naming_both_versions(tmp_path):
    write_fixed(tmp_path / "a.parquet", 0)
    write_fixed(tmp_path / "b.parquet", 100)
    ds = ss.ParquetStream(str(tmp_path), batch_size=50, rank=0, world_size=1)
    ds.set_epoch(0)  # the catalog records b.parquet as it is now
    rewrite_same_size(tmp_path / "b.parquet", 10_000)
    delivered = []
    with pytest.raises(ss.ReadError, match=r"b\.parquet: reading row group 0 failed: the file changed since it was "
                                           r"cataloged \(cataloged: \d+ bytes, mtime=[\d.]+,ino=\d+,ctime=[\d.]+; now: \d+ bytes, "
                                           r"mtime=[\d.]+,ino=\d+,ctime=[\d.]+\)"):
        for batch in ds:
            delivered.append(batch)
    for batch in delivered:  # nothing of the new file went out under the old ids
        assert (batch["id"] == batch["sample_id"]).all()


@pytest.mark.parametrize("backend", ["fsspec", "obstore"])
def test_an_s3_object_rewritten_at_the_same_size_is_refused_by_every_get_at_no_extra_request(s3, tmp_path, backend):
    for i in range(3):
        write_fixed(tmp_path / f"part-{i}.parquet", 100 * i)
    url = s3.upload(str(tmp_path), "versions-bucket", f"c-{backend}")
    with faulty_proxy(s3.endpoint_url) as proxy:
        options = {**via(proxy, s3), "backend": backend}
        catalog = Catalog.build(url, None, options)
        assert all(v.startswith('ETag="') for v in catalog.versions)
        everything = list(zip(catalog.rg_file.tolist(), catalog.rg_index.tolist()))

        proxy.reset_counts()
        unchecked = RowGroupReader.from_catalog(catalog, options, versions=None)
        expected = [unchecked.read(f, g) for f, g in everything]
        gets_without_check = proxy.count("GET")

        proxy.reset_counts()
        checked = RowGroupReader.from_catalog(catalog, options)
        assert [checked.read(f, g) for f, g in everything] == expected
        # The check costs no request: every GET carries the cataloged ETag (If-Match). Per file: row group 0,
        # row group 1; the footer too without versions (none to key a shared one by); with them it is the
        # catalog's read of it, kept by this process at the version it cataloged.
        assert proxy.count("HEAD") == 0
        assert (gets_without_check, proxy.count("GET")) == (9, 6)

        write_fixed(tmp_path / "part-1.parquet", 10_000)
        s3.filesystem().put_file(str(tmp_path / "part-1.parquet"), f"versions-bucket/c-{backend}/part-1.parquet")
        both = (r'part-1\.parquet: reading row group {} failed: the file changed since it was cataloged '
                r'\(cataloged: \d+ bytes, ETag="\w+"; now: \d+ bytes, ETag="\w+"\)')
        proxy.reset_counts()
        with pytest.raises(ss.ReadError, match=both.format(1)) as err:
            RowGroupReader.from_catalog(catalog, options).read(1, 1)
        assert catalog.versions[1] in str(err.value)
        assert proxy.count("HEAD") == 1  # after the refusal, to name the version the object has now
        with pytest.raises(ss.ReadError, match=both.format(0)):  # a reader that read the file before, too
            checked.read(1, 0)


@pytest.mark.parametrize("backend", ["fsspec", "obstore"])
@pytest.mark.parametrize("files", [1, 3])  # one file: read in this thread; several: on the filesystem's loop
def test_an_s3_object_rewritten_between_listing_and_footer_read_fails_the_catalog_naming_it(
        s3, tmp_path, monkeypatch, backend, files):
    for i in range(files):
        write_fixed(tmp_path / f"part-{i}.parquet", 100 * i)
    prefix = f"listed-{backend}-{files}"
    url = s3.upload(str(tmp_path), "versions-bucket", prefix)
    target = f"versions-bucket/{prefix}/part-0.parquet"
    list_entries = catalog_module.list_entries

    def list_then_rewrite(*args, **kwargs):
        entries = list_entries(*args, **kwargs)
        write_fixed(tmp_path / "part-0.parquet", 10_000)  # same size: only the ETag tells
        s3.filesystem().put_file(str(tmp_path / "part-0.parquet"), target)
        return entries

    monkeypatch.setattr(catalog_module, "list_entries", list_then_rewrite)
    options = {**s3.storage_options, "backend": backend}
    with pytest.raises(ss.CatalogError, match=r'part-0\.parquet: the file changed while it was cataloged \(listed: '
                                              r'\d+ bytes, ETag="\w+"; the store refused') as err:
        Catalog.build(url, None, options)
    listed = re.search(r'ETag="\w+"', str(err.value)).group(0)
    size = (tmp_path / "part-0.parquet").stat().st_size
    assert SHARED_FOOTERS.get(f"s3://{target}", size, listed) is None  # no footer kept under the old ETag
    monkeypatch.undo()
    assert Catalog.build(url, None, options).num_rows == 100 * files  # listed again: the new object


def test_an_s3fs_without_the_request_hook_for_if_match_fails_loudly_naming_its_version(s3, tmp_path, monkeypatch):
    # The conditional GETs go through s3fs's private ``_call_s3``: if an s3fs drops it, reads must fail
    # and say why, never fall back to GETs without the cataloged ETag.
    import s3fs

    write_fixed(tmp_path / "a.parquet", 0)
    url = s3.upload(str(tmp_path), "versions-bucket", "no-request-hook")
    options = {**s3.storage_options, "backend": "fsspec"}  # s3fs, whichever backend is the default
    catalog = Catalog.build(url, None, options)
    reader = RowGroupReader.from_catalog(catalog, options)
    monkeypatch.delattr(s3fs.S3FileSystem, "_call_s3")
    with pytest.raises(ss.ReadError, match=rf"a\.parquet: reading row group 0 failed: RuntimeError: s3fs "
                                           rf"{re.escape(s3fs.__version__)} has no coroutine S3FileSystem\._call_s3"):
        reader.read(0, 0)


def test_a_checkpoint_taken_before_a_file_was_rewritten_is_refused(tmp_path):
    write_corpus(str(tmp_path), [[40, 60], [100]])
    loader = ss.StreamLoader(ss.ParquetStream(str(tmp_path), batch_size=16, rank=0, world_size=1), num_workers=0)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    target = tmp_path / "part-00001.parquet"
    stat = target.stat()
    os.utime(target, (stat.st_atime, stat.st_mtime + 5))  # same bytes, but nothing proves it
    resumed = ss.StreamLoader(ss.ParquetStream(str(tmp_path), batch_size=16, rank=0, world_size=1), num_workers=0)
    with pytest.raises(ss.StateError, match="catalog="):
        resumed.load_state_dict(state)


def _copy_over_keeping_mtime(source, target):
    """``cp -p source target`` as rsync -t or a restore does it: new bytes at the target path, the old mtime."""
    import shutil

    stat = target.stat()
    replacement = target.with_suffix(".new")
    shutil.copyfile(source, replacement)
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, target)
    assert target.stat().st_size == stat.st_size and target.stat().st_mtime_ns == stat.st_mtime_ns


def test_a_local_file_replaced_by_a_same_size_copy_with_its_mtime_restored_is_caught(tmp_path):
    """issue 23 item 4: size and mtime were the whole local version: a cp -p of other rows over a file gave
    other rows under the old sample_ids, mid-run and after a resume."""
    data = tmp_path / "data"
    data.mkdir()
    write_fixed(data / "a.parquet", 0)
    write_fixed(data / "b.parquet", 100)
    write_fixed(tmp_path / "other.parquet", 10_000)  # the same layout and size, other values
    ds = ss.ParquetStream(str(data), batch_size=50, rank=0, world_size=1)
    loader = ss.StreamLoader(ds, num_workers=0)
    head = next(iter(loader))
    state = loader.state_dict()
    _copy_over_keeping_mtime(tmp_path / "other.parquet", data / "b.parquet")
    with pytest.raises(ss.ReadError, match=r"b\.parquet: reading row group 0 failed: the file changed"):
        for batch in loader:  # the running pass reaches b.parquet
            assert (batch["id"] == batch["sample_id"]).all(), "rows of the copy under the old ids"
    resumed = ss.StreamLoader(ss.ParquetStream(str(data), batch_size=50, rank=0, world_size=1), num_workers=0)
    with pytest.raises(ss.StateError, match="file_identity=.*inode or ctime changed"):
        resumed.load_state_dict(state)
    assert (head["id"] == head["sample_id"]).all()


def test_a_state_saved_before_file_identities_loads_with_a_warning_and_a_restaged_copy_on_request(tmp_path):
    write_corpus(str(tmp_path / "data"), [[40, 60], [100]])

    def loader():
        return ss.StreamLoader(ss.ParquetStream(str(tmp_path / "data"), batch_size=16, rank=0, world_size=1))

    first = loader()
    iterator = iter(first)
    next(iterator)
    state = first.state_dict()
    assert state["fingerprint"]["file_identity"]
    older = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "file_identity"}}
    with pytest.warns(UserWarning, match="saved before streamshard recorded 'file_identity'"):
        loader().load_state_dict(older)  # the catalog digest of an older state is unchanged: it loads
    target = tmp_path / "data" / "part-00001.parquet"
    _copy_over_keeping_mtime(target, target)  # the same bytes, copied anew: a new inode
    with pytest.raises(ss.StateError, match="file_identity"):
        loader().load_state_dict(state)
    with pytest.warns(UserWarning, match="file_identity"):
        resumed = loader()
        resumed.load_state_dict(older)  # what the error says to do when the bytes are the same
    ids = [i for b in resumed for i in b["sample_id"].tolist() if i >= 0]
    assert sorted(ids) == list(range(16, 200))


# -- 3. an existing path is taken literally, glob characters or not -------------------------------

@pytest.mark.parametrize("name, decoy", [("brack[1].parquet", "brack1.parquet"), ("star*.parquet", "starry.parquet"),
                                         ("what?.parquet", "whats.parquet")])
def test_an_existing_file_with_glob_characters_is_taken_literally(tmp_path, name, decoy):
    write_fixed(tmp_path / name, 0)
    write_fixed(tmp_path / decoy, 100)  # what the name would match as a glob
    catalog = Catalog.build(str(tmp_path / name))
    assert [os.path.basename(u) for u in catalog.urls] == [name]
    assert Catalog.build(str(tmp_path / "*.parquet")).num_files == 2  # globs still expand


def test_an_existing_directory_with_glob_characters_is_taken_literally(tmp_path):
    write_corpus(str(tmp_path / "a*b"), [[5], [6]])
    write_corpus(str(tmp_path / "axb"), [[7]])
    assert Catalog.build(str(tmp_path / "a*b") + "/").num_rows == 11
    assert Catalog.build(str(tmp_path / "a?b")).num_rows == 18  # no such directory: a glob over both


def test_s3_keys_with_glob_characters_are_taken_literally(s3, tmp_path):
    write_fixed(tmp_path / "brack[1].parquet", 0)
    write_fixed(tmp_path / "brack1.parquet", 100)
    url = s3.upload(str(tmp_path), "literal-bucket", "a*b")
    options = s3.storage_options
    assert Catalog.build(f"{url}/brack[1].parquet", storage_options=options).urls == (f"{url}/brack[1].parquet",)
    assert Catalog.build(f"{url}/", storage_options=options).num_files == 2
    assert Catalog.build("s3://literal-bucket/a*b/brack*.parquet", storage_options=options).num_files == 2


# -- 4. every error names its place and cause ------------------------------------------------------

@pytest.mark.parametrize("path, cause", [
    ("s3://no-such-bucket-x/data/", r"^'s3://no-such-bucket-x/data/' does not exist: its bucket does not exist "
                                    r"\(NoSuchBucket; FileNotFoundError: .*The specified bucket does not exist\)"),
    ("s3://no-such-bucket-x/data/*.parquet", r"no files matched 's3://no-such-bucket-x/data/\*\.parquet': "
                                             r"'s3://no-such-bucket-x/data' does not exist: its bucket does not exist "
                                             r"\(NoSuchBucket; FileNotFoundError: .*The specified bucket does not exist\)"),
    ("s3://corpus-bucket-y/nothing/", r"^'s3://corpus-bucket-y/nothing/' does not exist \((?!NoSuchBucket)"),
])
@pytest.mark.parametrize("backend", ["fsspec", "obstore"])
def test_a_missing_bucket_or_prefix_is_reported_with_its_cause(s3, path, cause, backend):
    if backend == "obstore":
        pytest.importorskip("obstore")
    s3.filesystem().makedirs("corpus-bucket-y", exist_ok=True)
    with pytest.raises(ss.CatalogError, match=cause):
        Catalog.build(path, storage_options={**s3.storage_options, "backend": backend})


def test_access_denied_while_listing_is_reported_as_such(s3, tmp_path):
    write_corpus(str(tmp_path), [[5]])
    url = s3.upload(str(tmp_path), "denied-bucket", "c")
    with faulty_proxy(s3.endpoint_url) as proxy:
        proxy.config.permanent = {".*": 403}
        with pytest.raises(ss.CatalogError, match=r"listing 's3://denied-bucket/c' failed: PermissionError"):
            Catalog.build(url, storage_options=via(proxy, s3))


def test_a_truncated_or_corrupt_file_is_named_with_its_row_group(tmp_path):
    write_fixed(tmp_path / "t.parquet", 0)
    truncated = ss.ParquetStream(str(tmp_path / "t.parquet"), batch_size=50, rank=0, world_size=1)
    truncated.set_epoch(0)
    data = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "t.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(ss.ReadError, match=r"t\.parquet: reading row group 0 failed: .*changed"):
        list(truncated)

    write_fixed(tmp_path / "c.parquet", 0)
    metadata = pq.read_metadata(tmp_path / "c.parquet")
    chunk = metadata.row_group(1).column(0)
    raw = bytearray((tmp_path / "c.parquet").read_bytes())
    raw[chunk.data_page_offset : chunk.data_page_offset + 24] = b"\xff" * 24  # the page header: garbage
    (tmp_path / "c.parquet").write_bytes(bytes(raw))
    corrupt = ss.ParquetStream(str(tmp_path / "c.parquet"), batch_size=50, rank=0, world_size=1)
    with pytest.raises(ss.ReadError, match=r"c\.parquet: reading row group 1 failed: "):
        list(corrupt)


def write_uint64(path, values_per_group) -> None:
    with pq.ParquetWriter(str(path), pa.schema([("v", pa.uint64())])) as writer:
        for values in values_per_group:
            writer.write_table(pa.table({"v": pa.array(values, pa.uint64())}))


@pytest.fixture
def uint64_corpus(tmp_path):
    write_uint64(tmp_path / "a.parquet", [list(range(20)), list(range(20))])
    write_uint64(tmp_path / "b.parquet", [list(range(20)), [1] * 19 + [2**63]])  # row group 1 cannot be int64
    write_uint64(tmp_path / "c.parquet", [list(range(20))])
    return tmp_path


@pytest.mark.parametrize("order", [{"shuffle": False}, {"shuffle": True, "shuffle_window": 4}])
def test_a_conversion_error_names_the_file_and_row_group_of_the_rows(uint64_corpus, order):
    ds = ss.ParquetStream(str(uint64_corpus), batch_size=32, seed=1, rank=0, world_size=1, **order)
    with pytest.raises(ss.ConversionError, match=r"column 'v': uint64 value 9223372036854775808 does not fit int64 "
                                                 r"\(in the rows of \S+/b\.parquet row group 1\)$"):
        list(ds)


def test_a_blend_conversion_error_names_the_corpus_file_and_row_group(uint64_corpus, tmp_path):
    write_uint64(tmp_path / "ok.parquet", [list(range(40))])
    corpus = lambda path: ss.ParquetStream(str(path), batch_size=8, rank=0, world_size=1)  # noqa: E731
    blend = ss.BlendedStream({"fine": corpus(tmp_path / "ok.parquet"), "bad": corpus(uint64_corpus / "b.parquet")},
                             weights={"fine": 0.5, "bad": 0.5}, batch_size=16, rank=0, world_size=1)
    with pytest.raises(ss.ConversionError, match=r"\(in the rows of corpus 'bad' \S+/b\.parquet row group 1\)$"):
        list(blend)


def test_a_failed_read_ends_the_pass_without_starting_the_reads_queued_behind_it(tmp_path):
    write_corpus(str(tmp_path), [[10] * 6])
    ds = ss.ParquetStream(str(tmp_path), batch_size=10, rank=0, world_size=1)
    started, third_started = [], threading.Event()

    def read(what):
        started.append(what.rg)
        if what.rg == 0:  # the batch being assembled waits, so only the pool sees row group 1 fail
            third_started.wait(timeout=1.0)
            return pq.ParquetFile(tmp_path / "part-00000.parquet").read_row_group(0)
        if what.rg == 2:
            third_started.set()
        raise ss.ReadError(f"row group {what.rg} is unreachable")

    # Two read-ahead threads: row groups 0 and 1 in flight, 2 queued behind them when 1 fails.
    with pytest.raises(ss.ReadError, match="row group 1 is unreachable"):
        list(deliver(ds.schedule(), 0, read, ds.converter, read_ahead=2))
    assert sorted(started) == [0, 1]


# -- 5. secrets stay out of third-party log records -----------------------------------------------

TOKEN = "SeSsIoN-t0ken-4b7e2f9a1c"


def test_a_session_token_appears_in_no_log_record_with_botocore_at_debug(s3, tmp_path, caplog):
    write_corpus(str(tmp_path), [[20, 20], [30]])
    url = s3.upload(str(tmp_path), "token-bucket", "c")
    options = {**s3.storage_options, "token": TOKEN, "backend": "fsspec"}  # moto accepts any session token; botocore logs
    botocore = logging.getLogger("botocore")
    level = botocore.level
    botocore.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG):
            batches = list(ss.ParquetStream(url, batch_size=16, rank=0, world_size=1, storage_options=options))
    finally:
        botocore.setLevel(level)
    assert sum(len(b["sample_id"]) for b in batches) >= 70
    texts = [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    redacted = [t for r, t in zip(caplog.records, texts) if r.name.startswith("botocore") and "***" in t]
    assert redacted, "botocore logged no request headers: the test proves nothing"
    assert not [t for t in texts if TOKEN in t]


def test_log_redaction_is_idempotent_and_removable(caplog):
    factory = logging.getLogRecordFactory()
    redaction, secret = LogRedaction(), "pAssw0rd-redaction-test"
    noisy = logging.getLogger("botocore.test_redaction")
    with caplog.at_level(logging.DEBUG, logger="botocore.test_redaction"):
        redaction.add([secret])
        redaction.add([secret])  # two holders, one factory
        noisy.debug("header %s", secret)
        redaction.discard([secret])  # one holder left: still redacted
        noisy.debug("header %s", secret)
        redaction.discard([secret])  # none left: the record factory is put back
        assert logging.getLogRecordFactory() is factory and not redaction.installed
        noisy.debug("header %s", secret)
        logging.getLogger("unrelated.test_redaction").warning("kept %s", secret)  # other loggers: untouched
    assert [r.getMessage() for r in caplog.records] == ["header ***", "header ***", f"header {secret}", f"kept {secret}"]


def test_a_filesystems_secrets_are_redacted_from_its_creation_on(caplog):
    secret = "pAssw0rd-lifetime-test"
    noisy = logging.getLogger("fsspec.test_redaction")
    with caplog.at_level(logging.DEBUG, logger="fsspec.test_redaction"):
        noisy.debug("header %s", secret)
        FileSystems({"password": secret}).resolve("memory://redaction-test/x")  # the client holds it now
        noisy.debug("header %s", secret)
        REDACTION.discard([secret])  # removable (the client lives on in this process: tests only)
        noisy.debug("header %s", secret)
    assert [r.getMessage() for r in caplog.records] == [f"header {secret}", "header ***", f"header {secret}"]


# -- 6. the retry deadline bounds a hung endpoint --------------------------------------------------

@contextmanager
def hung_endpoint():
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.1)  # the accept loop notices the end of the test
    accepted, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                accepted.append(server.accept()[0])
            except socket.timeout:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join()
        server.close()
        for conn in accepted:
            conn.close()


def hung_options(s3, endpoint):
    return {**s3.storage_options, "client_kwargs": {**s3.storage_options["client_kwargs"], "endpoint_url": endpoint}}


DEADLINE = RetryPolicy(deadline=3.0)  # botocore's own read timeout here is 30 s
SLACK = 10.0  # a generous bound: this machine is shared


def test_listing_on_a_hung_endpoint_fails_within_the_deadline(s3):
    with hung_endpoint() as endpoint:
        started = time.monotonic()
        with pytest.raises(ss.CatalogError, match=r"listing 's3://hung-bucket/c/' failed \(\d attempts in [\d.]+ s\)"):
            Catalog.build("s3://hung-bucket/c/", storage_options=hung_options(s3, endpoint), retry=DEADLINE)
        assert time.monotonic() - started < DEADLINE.deadline + SLACK


def test_reading_from_a_hung_endpoint_fails_within_the_deadline(s3, tmp_path):
    write_corpus(str(tmp_path), [[20, 20]])
    catalog = Catalog.build(s3.upload(str(tmp_path), "hung-bucket", "c"), storage_options=s3.storage_options)
    with hung_endpoint() as endpoint:
        reader = RowGroupReader.from_catalog(catalog, hung_options(s3, endpoint), retry=DEADLINE)
        started = time.monotonic()
        with pytest.raises(ss.ReadError, match=r"part-00000\.parquet: reading row group 1 failed: gave up after"):
            reader.read(0, 1)
        assert time.monotonic() - started < DEADLINE.deadline + SLACK


class SecondFooterFailsFileSystem(LocalUnderProtocol):
    """Local files under ``failsecond://``: the second file's footer is refused at once; the first
    one's read waits (up to a second) for every other read to start, as a hung request would."""

    protocol = "failsecond"
    started: list = []
    all_started = threading.Event()

    def cat_file(self, path, start=None, end=None, **kwargs):
        cls = SecondFooterFailsFileSystem
        cls.started.append(os.path.basename(path))
        if len(cls.started) == 40:
            cls.all_started.set()
        if path.endswith("part-00001.parquet"):
            raise PermissionError(f"access denied: {path}")
        if path.endswith("part-00000.parquet"):
            cls.all_started.wait(timeout=1.0)
        return super().cat_file(path, start=start, end=end, **kwargs)


def test_after_a_footer_read_fails_no_further_footer_read_starts(tmp_path):
    fsspec.register_implementation("failsecond", SecondFooterFailsFileSystem, clobber=True)
    write_corpus(str(tmp_path), [[3]] * 40)
    SecondFooterFailsFileSystem.started.clear()
    SecondFooterFailsFileSystem.all_started.clear()
    with pytest.raises(ss.CatalogError, match=r"part-00001\.parquet: reading the footer failed: PermissionError"):
        Catalog.build(f"failsecond://{tmp_path}", max_concurrency=2, distributed=False)
    # The read in flight when it failed finishes; the 38 queued behind it never start.
    assert sorted(SecondFooterFailsFileSystem.started) == ["part-00000.parquet", "part-00001.parquet"]


SIGNED = ("https://bucket.s3.amazonaws.com/k/x.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE"
          "%2F20261126%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20261126T000000Z&X-Amz-Expires=3600"
          "&X-Amz-SignedHeaders=host&X-Amz-Signature=0f1e2d3c4b5a69788796a5b4&X-Amz-Security-Token=FQoGZXIv%2Bq")


@pytest.mark.parametrize("url, secrets, kept", [
    (SIGNED, ["0f1e2d3c4b5a69788796a5b4", "FQoGZXIv+q", "FQoGZXIv%2Bq", "AKIAEXAMPLE%2F20261126"],
     ["X-Amz-Date=20261126T000000Z", "X-Amz-SignedHeaders=host", "X-Amz-Expires=3600"]),
    ("https://storage.googleapis.com/b/o.parquet?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature=9a8b7c6d5e",
     ["9a8b7c6d5e"], ["X-Goog-Algorithm=GOOG4-RSA-SHA256"]),
    ("https://acct.blob.core.windows.net/c/x.parquet?sv=2022-11-02&se=2026-12-01&sp=r&sig=AbCd%2FeF%3D",
     ["AbCd%2FeF%3D", "AbCd/eF="], ["sv=2022-11-02", "sp=r"]),
    ("s3://alice:hunter2-pw@minio.local:9000/bucket/x.parquet", ["hunter2-pw"], ["alice", "minio.local:9000"]),
    ("/data/odd?token=name/x.parquet", [], ["token=name"]),  # a local path: '?' is part of the name
])
def test_the_credentials_a_url_carries_are_found_and_only_those(url, secrets, kept):
    found = url_secrets(url)
    assert all(any(s in f for f in found) for s in secrets), found
    written = redact_url(url)
    assert not [s for s in secrets if s in written] and all(k in written for k in kept), written


def test_a_presigned_url_streams_and_its_signature_reaches_no_error_log_record_or_cache_file(s3, tmp_path, caplog):
    """Before: the signature was in the catalog cache's JSON on disk, in DEBUG records and in errors."""
    import boto3

    write_corpus(str(tmp_path / "src"), [[30, 20]])
    s3.upload(str(tmp_path / "src"), "presigned-bucket", "c")
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id=s3.key,
                          aws_secret_access_key=s3.secret, region_name=s3.region)

    def presign(key):
        return client.generate_presigned_url("get_object", Params={"Bucket": "presigned-bucket", "Key": key})

    url, missing = presign("c/part-00000.parquet"), presign("c/no-such-file.parquet")
    signatures = [v for u in (url, missing) for v in url_secrets(u) if len(v) >= 16]
    assert len(signatures) >= 2, url
    cache = tmp_path / "cache"
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):  # the second build reads its footer from the cache: matched by the written URL
            ids = [i for b in ss.ParquetStream(url, batch_size=16, rank=0, world_size=1, catalog_cache=str(cache))
                   for i in b["sample_id"].tolist()]
            assert sorted(i for i in ids if i >= 0) == list(range(50))
        with pytest.raises(ss.CatalogError) as failed:
            ss.ParquetStream(missing, rank=0, world_size=1).set_epoch(0)
    assert "1 from cache" in caplog.text
    written = "".join(p.read_text() for p in cache.iterdir())
    assert "presigned-bucket/c/part-00000.parquet?" in written
    texts = [written, str(failed.value), *(r.getMessage() + (r.exc_text or "") for r in caplog.records)]
    assert not [s for s in signatures for t in texts if s in t]


def test_a_password_in_a_url_is_kept_out_of_the_error_that_names_it():
    url = "http://reader:pAssw0rd-in-url@127.0.0.1:9/data/x.parquet"  # port 9 (discard): nothing listens
    with pytest.raises(ss.StreamshardError) as failed:
        Catalog.build([url], retry=RetryPolicy(max_attempts=1))
    assert "127.0.0.1:9" in str(failed.value) and "pAssw0rd-in-url" not in str(failed.value)
