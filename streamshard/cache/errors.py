"""The exception and warning types of :class:`streamshard.cache.ActivationCache` (re-exported by the package)."""

from __future__ import annotations

from ..errors import StreamshardError

__all__ = ["CacheError", "CacheLockedError", "CacheWarning", "RecordSpecError"]


class CacheError(StreamshardError, RuntimeError):
    """The cache cannot do what was asked (closed, used after fork, bad ``fn`` output)."""


class CacheLockedError(CacheError):
    """Another process (or another cache object) already has this cache directory open."""


class RecordSpecError(CacheError, ValueError):
    """A tensor's per-sample shape or dtype differs from the records already in the cache."""


class CacheWarning(UserWarning):
    """The disk tier degraded (full, write error, corrupt record); values are recomputed instead."""
