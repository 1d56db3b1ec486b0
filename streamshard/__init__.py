"""streamshard: stream Parquet into PyTorch, every sample to exactly one GPU, exactly once per epoch."""

from .catalog import Catalog
from .dataset import ParquetStream
from .errors import CatalogError, ConversionError, ReadError, StreamshardError
from .permutation import Permutation

__all__ = [
    "Catalog",
    "CatalogError",
    "ConversionError",
    "ParquetStream",
    "Permutation",
    "ReadError",
    "StreamshardError",
]
__version__ = "0.1.0"
