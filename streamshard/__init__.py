"""streamshard: stream Parquet into PyTorch, every sample to exactly one GPU, exactly once per epoch."""

from .blend import BlendedStream
from .blend_plan import blend_length
from .blend_schedule import BlendSchedule, blend_counts
from .cache import ActivationCache, CacheStats, module_fingerprint
from .catalog import Catalog
from .dataset import ParquetStream
from .delta import DeltaTable
from .errors import (CatalogError, ConversionError, HandOffError, ReadError, StateError, StreamshardError,
                     TopologyError)
from .loader import StreamLoader
from .packed import PackedStream, cu_seqlens
from .permutation import Permutation, mix_seed
from .prefetch import DevicePrefetcher
from .sampler import ElasticSampler
from .tensors import pad_lists

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
