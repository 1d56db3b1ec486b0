"""Helpers for tests, demos and benchmarks: synthetic corpora and an embedded S3 server."""

from .corpus import write_corpus
from .faulty_proxy import FaultConfig, FaultyProxy, faulty_proxy
from .s3 import LocalS3, local_s3

__all__ = ["FaultConfig", "FaultyProxy", "LocalS3", "faulty_proxy", "local_s3", "write_corpus"]
