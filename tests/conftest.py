"""Shared fixtures: synthetic corpora on disk and a real S3 endpoint (moto) on 127.0.0.1."""

from __future__ import annotations

import pytest

from streamshard.testing import local_s3, write_corpus

from strategies import SKEWED_LAYOUT


@pytest.fixture(scope="session")
def s3():
    with local_s3() as server:
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
