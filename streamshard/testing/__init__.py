"""Helpers for tests, demos and benchmarks: synthetic corpora and embedded object stores on 127.0.0.1.

``local_seaweedfs()``: a real S3 server (SeaweedFS), for end-to-end tests, the demo and benchmarks.
``local_gcs()``: a GCS emulator (fake-gcs-server), reached through gcsfs.
``local_s3()``: moto's S3 server, kept for fault-injection tests (it is no yardstick for speed).
"""

from .corpus import write_corpus, write_fixed
from .faulty_proxy import FaultConfig, FaultyProxy, faulty_proxy
from .gcs import LocalGCS, local_gcs
from .object_store import LocalObjectStore
from .s3 import LocalS3, local_s3
from .seaweedfs import local_seaweedfs

__all__ = [
    "FaultConfig", "FaultyProxy", "LocalGCS", "LocalObjectStore", "LocalS3", "faulty_proxy", "local_gcs",
    "local_s3", "local_seaweedfs", "write_corpus", "write_fixed",
]
