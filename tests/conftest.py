"""Shared fixtures: synthetic corpora on disk and object stores on 127.0.0.1 (one server of each per session):
moto's S3 (fault injection), SeaweedFS (a real S3) and fake-gcs-server (GCS through gcsfs)."""

from __future__ import annotations

import pytest

from streamshard.testing import local_gcs, local_s3, local_seaweedfs, write_corpus

from strategies import SKEWED_LAYOUT


@pytest.fixture(scope="session")
def s3():
    with local_s3() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs():
    with local_seaweedfs() as server:
        yield server


@pytest.fixture(scope="session")
def gcs():
    with local_gcs() as server:
        yield server


@pytest.fixture
def skewed_corpus(tmp_path):
    write_corpus(str(tmp_path / "skewed"), SKEWED_LAYOUT)
    return str(tmp_path / "skewed")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    write_corpus(str(root), [[50, 30], [7], [], [64, 64, 1], [13]])
    return str(root)
