"""Helpers for tests, demos and benchmarks: synthetic corpora and an embedded S3 server."""

from .corpus import write_corpus
from .s3 import LocalS3, local_s3

__all__ = ["LocalS3", "local_s3", "write_corpus"]
