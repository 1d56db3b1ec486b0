"""The obstore backend reads the AWS credential chain as s3fs does (through botocore): a ``~/.aws`` profile,
``credential_process`` (refreshed when its credentials expire), the environment. Real SeaweedFS, real profile
files and a real credential process (a script printing JSON); nothing mocked."""

from __future__ import annotations

import json
import sys
import textwrap
from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("obstore")
pytest.importorskip("botocore")

import streamshard as ss  # noqa: E402
from streamshard.io.catalog import Catalog  # noqa: E402
from streamshard.io.obstore_fs import ObstoreFileSystem  # noqa: E402
from streamshard.io.storage import FileSystems  # noqa: E402
from streamshard.testing import write_corpus  # noqa: E402
from helpers import assert_exactly_once  # noqa: E402

BUCKET = "streamshard-credentials"
LAYOUT = [[30, 20], [25]]


@pytest.fixture(scope="module")
def url(seaweedfs, tmp_path_factory):
    local = tmp_path_factory.mktemp("credentials-corpus")
    write_corpus(str(local), LAYOUT)
    return seaweedfs.upload(str(local), BUCKET, "corpus")


@pytest.fixture
def aws_home(tmp_path, monkeypatch):
    """An empty AWS environment: no AWS_* variables, profile files under ``tmp_path`` (written by the test)."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata lookups from a test
    return tmp_path


def options(seaweedfs, profile: str) -> dict:
    """The backend and the endpoint only: credentials and region must come from the profile."""
    return {"backend": "obstore", "profile": profile, "client_kwargs": {"endpoint_url": seaweedfs.endpoint_url}}


def credential_process(tmp_path, seaweedfs, name: str, expires_in: timedelta | None) -> tuple[str, object]:
    """A real credential_process script printing the server's keys (with an Expiration when ``expires_in``);
    each run appends a line to a log, so the test can count how often the chain ran it."""
    log = tmp_path / f"{name}.runs"
    script = tmp_path / f"{name}.py"
    expiry = "" if expires_in is None else \
        f'"Expiration": (datetime.now(timezone.utc) + timedelta(seconds={expires_in.total_seconds()})).isoformat(),'
    script.write_text(textwrap.dedent(f"""
        import json
        from datetime import datetime, timedelta, timezone
        with open({str(log)!r}, "a") as f:
            f.write("run\\n")
        print(json.dumps({{"Version": 1, "AccessKeyId": {seaweedfs.key!r}, "SecretAccessKey": {seaweedfs.secret!r},
                          {expiry}}}))
    """))
    return f"{sys.executable} {script}", log


def epoch_rows(url: str, storage_options: dict) -> list:
    ds = ss.ParquetStream(url, columns=["id"], batch_size=16, rank=0, world_size=1, storage_options=storage_options)
    return [list(ss.StreamLoader(ds, num_workers=0))]


def test_a_profile_in_the_shared_credentials_file_with_its_region_in_the_config_file(seaweedfs, url, aws_home):
    (aws_home / "credentials").write_text(f"[reader]\naws_access_key_id = {seaweedfs.key}\n"
                                          f"aws_secret_access_key = {seaweedfs.secret}\n"
                                          f"[wrong]\naws_access_key_id = {seaweedfs.key}\naws_secret_access_key = nope\n")
    (aws_home / "config").write_text("[profile reader]\nregion = us-east-1\n[profile wrong]\nregion = us-east-1\n")
    storage_options = options(seaweedfs, "reader")
    fs = FileSystems(storage_options).resolve(url)[0]
    assert isinstance(fs, ObstoreFileSystem)
    assert_exactly_once(epoch_rows(url, storage_options), sum(map(sum, LAYOUT)))
    with pytest.raises(ss.CatalogError, match=r"403|PermissionError|SignatureDoesNotMatch|AccessDenied"):
        Catalog.build(url, ["id"], options(seaweedfs, "wrong"))  # the profile's own keys are the ones signed with


def test_static_credentials_from_a_credential_process_are_fetched_once(seaweedfs, url, aws_home):
    command, log = credential_process(aws_home, seaweedfs, "static", expires_in=None)
    (aws_home / "config").write_text(f"[profile static]\nregion = us-east-1\ncredential_process = {command}\n")
    storage_options = options(seaweedfs, "static")
    assert_exactly_once(epoch_rows(url, storage_options), sum(map(sum, LAYOUT)))
    assert log.read_text().count("run") == 1  # a listing, 2 footers and 3 row groups: one run of the process


def test_expiring_credentials_from_a_credential_process_are_refreshed(seaweedfs, url, aws_home):
    # Two minutes left: inside botocore's mandatory refresh window (10 min), so each time obstore asks
    # (it asks again as the expiry nears) botocore runs the process again, as s3fs's client would.
    command, log = credential_process(aws_home, seaweedfs, "expiring", expires_in=timedelta(minutes=2))
    (aws_home / "config").write_text(f"[profile expiring]\nregion = us-east-1\ncredential_process = {command}\n")
    storage_options = options(seaweedfs, "expiring")
    assert_exactly_once(epoch_rows(url, storage_options), sum(map(sum, LAYOUT)))
    assert log.read_text().count("run") >= 2


def test_provider_reports_the_expiry_botocore_holds(seaweedfs, aws_home):
    from streamshard.io.obstore_fs import BotocoreCredentials

    command, _ = credential_process(aws_home, seaweedfs, "expiry", expires_in=timedelta(hours=1))
    (aws_home / "config").write_text(f"[profile expiry]\nregion = eu-west-3\ncredential_process = {command}\n")
    provider = BotocoreCredentials("expiry")
    credential = provider()
    assert provider.region == "eu-west-3"
    assert (credential["access_key_id"], credential["secret_access_key"]) == (seaweedfs.key, seaweedfs.secret)
    left = credential["expires_at"] - datetime.now(timezone.utc)
    assert timedelta(minutes=55) < left <= timedelta(hours=1)


def test_environment_keys_and_region_need_no_botocore(seaweedfs, url, aws_home, monkeypatch):
    from streamshard.io.obstore_fs import needs_credential_chain, store_config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    storage_options = {"backend": "obstore", "client_kwargs": {"endpoint_url": seaweedfs.endpoint_url}}
    assert not needs_credential_chain(store_config(storage_options))
    assert needs_credential_chain(store_config({**storage_options, "profile": "other"}))  # a profile beats env
    assert_exactly_once(epoch_rows(url, storage_options), sum(map(sum, LAYOUT)))


def test_the_default_backend_is_obstore_where_it_can_stand_in_for_s3fs(seaweedfs, aws_home, monkeypatch):
    from s3fs import S3FileSystem

    endpoint = {"client_kwargs": {"endpoint_url": seaweedfs.endpoint_url}}
    assert isinstance(FileSystems(seaweedfs.storage_options).resolve("s3://b/k")[0], ObstoreFileSystem)
    assert isinstance(FileSystems({**seaweedfs.storage_options, "backend": "fsspec"}).resolve("s3://b/k")[0],
                      S3FileSystem)
    # an option obstore cannot honour: s3fs, not an error (with backend="obstore" it is refused by name)
    verify = {**seaweedfs.storage_options, "client_kwargs": {**endpoint["client_kwargs"], "verify": False}}
    assert isinstance(FileSystems(verify).resolve("s3://b/k")[0], S3FileSystem)
    # no credentials anywhere (and no instance metadata): s3fs, whose client keeps looking as before
    assert isinstance(FileSystems(endpoint).resolve("s3://b/k")[0], S3FileSystem)
    # credentials but no region in the options, on AWS: s3fs finds each bucket's region (botocore follows the
    # redirect of a bucket in another region), obstore signs for the region it is given and fails there; a
    # region from the environment (or a profile) is a default, not the bucket's, so it keeps s3fs too
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret)
    assert isinstance(FileSystems({"config_kwargs": {"connect_timeout": 5}}).resolve("s3://b/k")[0], S3FileSystem)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")  # (other options: clients are shared per options)
    assert isinstance(FileSystems({"config_kwargs": {"connect_timeout": 6}}).resolve("s3://b/k")[0], S3FileSystem)
    assert isinstance(FileSystems({"config_kwargs": {"connect_timeout": 7}, "region": "eu-west-1"}).resolve(
        "s3://b/k")[0], ObstoreFileSystem)


def test_an_endpoint_configured_outside_the_options_keeps_the_default_on_s3fs(seaweedfs, url, aws_home, monkeypatch):
    """botocore (s3fs) reads an endpoint from AWS_ENDPOINT_URL(_S3) or the config file; obstore does not, so the
    default must not send such a user's requests to AWS instead."""
    from s3fs import S3FileSystem

    (aws_home / "credentials").write_text(f"[ep]\naws_access_key_id = {seaweedfs.key}\n"
                                          f"aws_secret_access_key = {seaweedfs.secret}\n")
    (aws_home / "config").write_text(f"[profile ep]\nregion = us-east-1\nendpoint_url = {seaweedfs.endpoint_url}\n")
    storage_options = {"profile": "ep"}
    assert isinstance(FileSystems(storage_options).resolve(url)[0], S3FileSystem)
    assert_exactly_once(epoch_rows(url, storage_options), sum(map(sum, LAYOUT)))  # s3fs found the server
    (aws_home / "config").write_text("[profile ep]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", seaweedfs.endpoint_url)
    assert isinstance(FileSystems({"profile": "ep", "config_kwargs": {"connect_timeout": 7}}).resolve(url)[0],
                      S3FileSystem)
    (aws_home / "config").write_text("[profile ep]\nregion = us-east-1\nca_bundle = /etc/ssl/certs/ours.pem\n")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    ca_options = {**seaweedfs.storage_options, "config_kwargs": {"connect_timeout": 8}}  # (clients are shared per options)
    assert isinstance(FileSystems(ca_options).resolve(url)[0], S3FileSystem)  # trusted CAs obstore does not read


def test_aws_ca_bundle_is_given_to_obstore_as_trusted_roots(seaweedfs, url, aws_home, monkeypatch):
    from streamshard.io.obstore_fs import auto_config

    bundle = aws_home / "bundle.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))
    config, why_not = auto_config(seaweedfs.storage_options)
    assert config is not None, why_not
    assert config["client_options"]["root_certificate"] == bundle.read_text()
    monkeypatch.setenv("AWS_CA_BUNDLE", str(aws_home / "missing.pem"))
    assert auto_config(seaweedfs.storage_options)[0] is None  # unreadable: s3fs, which reports it
