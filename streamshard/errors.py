"""The few exception types streamshard raises; each carries what is at fault in its message."""

from __future__ import annotations


class StreamshardError(Exception):
    """Base class of every error this package raises on purpose. Its message never holds a secret this
    process knows of (storage options' and URLs' credentials: ``storage.REDACTION``)."""

    def __init__(self, *args: object) -> None:
        from .io.storage import REDACTION  # here: storage imports the errors of retry, which import these

        super().__init__(*(REDACTION.redact(a) if isinstance(a, str) else a for a in args))


class CatalogError(StreamshardError, ValueError):
    """A set of paths cannot become a catalog: nothing matched, not Parquet, schemas disagree."""


class ReadError(StreamshardError, OSError):
    """Reading a row group failed; the message names the URL, the row group and the cause."""


class ConversionError(StreamshardError, TypeError):
    """A column has no tensor meaning (or needs a cast); the message names the file and column."""


class StateError(StreamshardError, ValueError):
    """A checkpoint state is malformed, out of range, or does not fit this dataset (field named)."""


class TopologyError(StreamshardError, RuntimeError):
    """The data-parallel rank is not known yet (or contradicts itself); the message names the variables."""


class HandOffError(StreamshardError, RuntimeError):
    """A batch could not leave a DataLoader worker process (shared memory and the pipe both failed)."""
