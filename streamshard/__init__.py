"""streamshard: stream Parquet into PyTorch, every sample to exactly one GPU, exactly once per epoch."""

from .io import fork_imports  # noqa: F401 - registers the fork's wait for other threads' imports
from .streams.blend import BlendedStream
from .plan.blend_plan import blend_length
from .plan.blend_schedule import BlendSchedule, blend_counts
from .cache import ActivationCache, CacheStats, module_fingerprint
from .io.catalog import Catalog
from .streams.dataset import ParquetStream
from .io.delta import DeltaTable
from .errors import (CatalogError, ConversionError, HandOffError, ReadError, StateError, StreamshardError,
                     TopologyError)
from .loader.stream_loader import StreamLoader
from .streams.packed import PackedStream, cu_seqlens
from .plan.permutation import Permutation, mix_seed
from .loader.prefetch import DevicePrefetcher
from .streams.sampler import ElasticSampler
from .convert.tensors import pad_lists

__all__ = [
    "ActivationCache",
    "BlendedStream",
    "BlendSchedule",
    "CacheStats",
    "Catalog",
    "CatalogError",
    "ConversionError",
    "DeltaTable",
    "DevicePrefetcher",
    "ElasticSampler",
    "HandOffError",
    "PackedStream",
    "ParquetStream",
    "Permutation",
    "ReadError",
    "StateError",
    "StreamLoader",
    "StreamshardError",
    "TopologyError",
    "blend_counts",
    "blend_length",
    "cu_seqlens",
    "mix_seed",
    "module_fingerprint",
    "pad_lists",
]
__version__ = "0.1.0"
