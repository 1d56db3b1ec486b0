"""The activation cache: per-sample outputs of a frozen model prefix, by ``sample_id``.

``from streamshard.cache import ActivationCache, CacheStats, module_fingerprint`` is the public way
in; the modules split the work by job (the tiers, identity and limits are described in
:mod:`streamshard.cache.activation`):

    activation  ``ActivationCache`` (get / put / get_or_compute), ``CacheStats``, ``module_fingerprint``
    host        the host-memory tier (torch-free numpy)
    disk        the disk tier: checksummed fixed-size records in one append-only file
    directory   a cache directory's identity (``meta.json``), lock and open files
    index       the vectorised id -> slot map both tiers use (pure numpy, no I/O)
    errors      the exception and warning types
"""

from .activation import ActivationCache, CacheStats, module_fingerprint
from .errors import CacheError, CacheLockedError, CacheWarning, RecordSpecError

__all__ = [
    "ActivationCache",
    "CacheError",
    "CacheLockedError",
    "CacheStats",
    "CacheWarning",
    "RecordSpecError",
    "module_fingerprint",
]
