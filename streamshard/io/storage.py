"""Filesystems for URLs: one fsspec instance per protocol, reused for every file it serves.

Resolving a filesystem can be costly (an S3 client, credentials, a session), so neither the
catalog nor a reader should do it per file, whatever fsspec's own instance cache is set to.

Retries are ours (``streamshard.io.retry``): where a backend has its own retry layer and lets us
configure it, we turn it down to one attempt (unless the caller set it), so the bounds on
attempts and time that the caller chose are the bounds that hold. On async backends every call
also carries the time left until the retry deadline as its timeout (``timeout_kw``).

Secrets: the values of secret-looking storage options, and the credentials a URL carries (a
presigned query string's signature, credential and token; ``user:password@``), are replaced by
``***`` in our messages (``FileSystems.redact``; every ``StreamshardError``), in every log record of
the storage libraries' loggers (``LogRedaction``), whatever level their owner enables, and in what
we write to disk (``redact_url``: the catalog cache). They are registered when a filesystem (client)
is created with them or a URL is first resolved: the client holding them lives as long as the
process (it is shared), and so does the redaction.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
import os
import threading
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import unquote

import fsspec
from fsspec.core import split_protocol

from ..plan.state import IDENTITY_MARK

# Per-protocol defaults that make the backend's own retries a single attempt and its waits
# bounded. Caller's storage_options win, key by key (dicts merge one level deep).
_BACKEND_DEFAULTS: dict[str, dict[str, Any]] = {
    "s3": {
        "config_kwargs": {
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # botocore's
            "connect_timeout": 10,
            "read_timeout": 30,
            "max_pool_connections": 64,  # enough for the catalog's concurrent footer reads
        },
    },
}
_BACKEND_DEFAULTS["s3a"] = _BACKEND_DEFAULTS["s3"]
# Instance attributes set the same way (s3fs reads its own retry count from ``self.retries``).
_BACKEND_ATTRIBUTES: dict[str, dict[str, Any]] = {"s3": {"retries": 1}, "s3a": {"retries": 1}}

# storage_options keys whose string values are secrets (matched as substrings, lower case).
_SECRET_KEY_PARTS = ("secret", "token", "password", "passwd", "credential", "key", "session", "auth", "sas")
# Query parameters of a URL that are secrets: those whose names hold a part above, and the signatures
# of presigned URLs (S3's X-Amz-Signature, GCS's X-Goog-Signature, Azure SAS's sig, CloudFront's
# Signature and Policy), named exactly ("SignedHeaders" holds no secret).
_URL_SECRET_KEYS = frozenset({"sig", "signature", "policy", "x-amz-signature", "x-goog-signature"})


class FileSystems:
    """Maps URLs to ``(filesystem, path)``, creating each protocol's filesystem once."""

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self._secrets = sorted(set(_secret_values(self.storage_options)), key=len, reverse=True)
        self._by_protocol: dict[str, fsspec.AbstractFileSystem] = {}
        self._lock = threading.Lock()

    def resolve(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        protocol = split_protocol(url)[0] or "file"
        if "?" in url or "@" in url:
            self.add_secrets(url_secrets(url))
        with self._lock:
            fs = self._by_protocol.get(protocol)
            if fs is None:
                fs = self._by_protocol[protocol] = _shared_filesystem(protocol, url, self.storage_options)
        return fs, fs._strip_protocol(url)

    def redact(self, text: str) -> str:
        """``text`` with every secret of the storage options and of the URLs resolved so far (in this
        process, by any ``FileSystems``) replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return REDACTION.redact(text)

    def add_secrets(self, secrets: Iterable[str]) -> None:
        """Redact ``secrets`` from now on, here and in the storage libraries' log records (for as long
        as the process lives: a URL's credentials may sit in a shared client's connection pool)."""
        REDACTION.add_permanent(secrets)


def url_secrets(url: str) -> list[str]:
    """The credentials ``url`` carries, as they appear in it and decoded: the password of a
    ``user:password@`` and the values of secret-looking query parameters (presigned URLs)."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # a local path: '?' and '@' are only characters of its name
        return []
    found: list[str] = []
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, at, _ = authority.rpartition("@")
    if at and ":" in userinfo:
        found.append(userinfo.split(":", 1)[1])
    query = rest.partition("?")[2].partition("#")[0]
    for pair in filter(None, query.split("&")):
        key, _, value = pair.partition("=")
        key = unquote(key).lower()
        if key in _URL_SECRET_KEYS or any(part in key for part in _SECRET_KEY_PARTS):
            found.append(value)
    secrets = {form for raw in found for form in (raw, unquote(raw), unquote(raw.replace("+", " ")))}
    return sorted((x for x in secrets if len(x) >= 4), key=len, reverse=True)


def redact_url(url: str) -> str:
    """``url`` with its credentials (:func:`url_secrets`) replaced by ``***``: what may be written down."""
    for secret in url_secrets(url):
        url = url.replace(secret, "***")
    return url


# Filesystems shared by every FileSystems of this process with the same protocol and options:
# readers are made per epoch and per worker, and a new S3 client plus its first request took
# 75-310 ms here (a request on a warm client: ~5 ms). Keyed by
# process id too, because an async client must not be used across a fork.
_SHARED: dict[tuple[int, str, str], Any] = {}
_SHARED_LOCK = threading.Lock()


def _fresh_shared_lock_in_child() -> None:
    """A forked child's lock anew: a thread of its parent (a counting thread making its reader, which may
    take a new S3 client's 75-310 ms) may have held it at the fork, and that thread is not in the child."""
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_shared_lock_in_child)


def _shared_filesystem(protocol: str, url: str, storage_options: dict[str, Any]) -> Any:
    key = (os.getpid(), protocol, json.dumps(storage_options, sort_keys=True, default=repr))
    with _SHARED_LOCK:
        fs = _SHARED.get(key)
        if fs is None:
            # Before the client exists: its first requests (and their DEBUG log lines) carry the secrets.
            REDACTION.add(set(_secret_values(storage_options)))
            fs = _SHARED[key] = _new_filesystem(protocol, url, storage_options)[0]
        return fs


# storage_options["backend"]: who serves s3:// (other protocols: fsspec). "auto", the default: obstore where
# it can stand in for s3fs (``obstore_fs.auto_config``), else s3fs ("fsspec").
BACKENDS = ("auto", "fsspec", "obstore")


def _new_filesystem(protocol: str, url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    backend = storage_options.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"storage_options backend={backend!r} is not one of {BACKENDS}")
    storage_options = {k: v for k, v in storage_options.items() if k != "backend"}
    if backend != "fsspec" and protocol in ("s3", "s3a"):
        fs = _obstore_filesystem(storage_options, explicit=backend == "obstore")
        if fs is not None:
            return fs, fs._strip_protocol(url)
    options = with_backend_defaults(protocol, storage_options)
    attributes = {k: v for k, v in _BACKEND_ATTRIBUTES.get(protocol, {}).items() if k not in storage_options}
    if attributes:
        options = {**options, "skip_instance_cache": True}  # a private instance: ours to configure
    fs, path = fsspec.core.url_to_fs(url, **options)
    for name, value in attributes.items():
        setattr(fs, name, value)
    return fs, path


def _obstore_filesystem(storage_options: dict[str, Any], explicit: bool) -> Any:
    """The obstore filesystem for ``storage_options``, or None where s3fs serves instead.

    Asked for (``explicit``): obstore, unless this process was forked after obstore ran (a warning).
    By default: obstore when installed, not forked after use, and ``obstore_fs.auto_config`` finds the
    options, credentials and region it needs; else s3fs, silently (the reason at DEBUG).
    """
    from importlib.util import find_spec

    if not explicit and find_spec("obstore") is None:
        return None
    from . import obstore_fs

    if obstore_fs.forked_after_use():
        if explicit:
            _warn_forked_obstore()
        else:
            logging.getLogger("streamshard").debug("s3:// through s3fs: forked after obstore ran in pid %d",
                                                   obstore_fs._first_use_pid)
        return None
    if explicit:  # options refused by name; credentials resolved here, not on the event loop's thread
        return obstore_fs.ObstoreFileSystem(storage_options, resolved=obstore_fs.credential_source(
            obstore_fs.store_config(storage_options)))
    config, why_not = obstore_fs.auto_config(storage_options)
    if config is None:
        logging.getLogger("streamshard").debug("s3:// through s3fs, not obstore: %s", why_not)
        return None
    return obstore_fs.ObstoreFileSystem(storage_options, resolved=config)


def _warn_forked_obstore() -> None:
    from . import obstore_fs

    logging.getLogger("streamshard").warning(
        "storage_options backend='obstore': this process was forked after obstore ran in its parent "
        "(pid %d), and obstore's runtime does not survive a fork; serving s3:// through s3fs here. "
        "StreamLoader's thread workers (workers='threads', its default for plain streams) keep obstore, as do "
        "worker processes started with multiprocessing_context='forkserver' or 'spawn'.",
        obstore_fs._first_use_pid)


def with_backend_defaults(protocol: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` completed with the backend defaults above (the caller's values win)."""
    defaults = _BACKEND_DEFAULTS.get(protocol)
    if not defaults:
        return dict(storage_options)
    merged = copy.deepcopy(defaults)
    for key, value in storage_options.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def is_async(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` serves many ranged requests concurrently (``cat_ranges`` gathers them)."""
    return bool(getattr(fs, "async_impl", False))


def timeout_kw(fs: fsspec.AbstractFileSystem, seconds: float) -> dict[str, float]:
    """Keyword arguments that cut a call of ``fs`` off after ``seconds`` (``FSTimeoutError``).

    fsspec's blocking wrappers of async filesystems (s3fs, gcsfs, http) take ``timeout=`` and
    cancel the request when it passes; synchronous ones (local disk) have no such hook.
    """
    return {"timeout": max(float(seconds), 0.001)} if is_async(fs) else {}


# What changes when a file is rewritten, in the order preferred: ETag/generation on object
# stores, else the modification time.
_VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "mtime", "LastModified", "last_modified", "updated")


def file_version(info: dict[str, Any]) -> str:
    """A file's version token from its fsspec ``info``/listing entry: ``"ETag=..."``, ``"mtime=..."``, or ''.

    A local file's is ``"mtime=<m>,ino=<inode>,ctime=<c>"``: a file replaced by one of the same size
    with its mtime restored (``cp -p``, ``rsync -t``) keeps the mtime but not the inode or ctime.
    """
    for key in _VERSION_KEYS:
        value = info.get(key)
        if value not in (None, ""):
            if key == "mtime" and info.get("ino") and info.get("created") is not None:
                return f"mtime={value}{IDENTITY_MARK}{info['ino']},ctime={info['created']}"
            return f"{key}={value}"
    return ""


def file_change(info: dict[str, Any], size: int, version: str) -> str | None:
    """How a file's current ``info`` differs from the ``size`` and ``version`` cataloged; None if it does not.

    The version is compared under the key it was recorded with (an ``info`` without that key can
    only be compared by size).
    """
    now_size = info.get("size")
    now_size = int(now_size) if isinstance(now_size, (int, float)) else size  # a store that does not say: trust
    key = version.split("=", 1)[0] if version else ""
    if IDENTITY_MARK in version:  # a local file: mtime, inode and ctime
        now_version = file_version(info)
    else:
        now_version = f"{key}={info[key]}" if key and info.get(key) not in (None, "") else ""
    if now_size == size and (not now_version or now_version == version):
        return None
    was = f"{size} bytes" + (f", {version}" if version else "")
    now = f"{now_size} bytes" + (f", {now_version}" if now_version else "")
    return f"the file changed since it was cataloged (cataloged: {was}; now: {now})"


# -- GETs conditioned on the cataloged version ------------------------------------------------------


CONDITIONAL_GETS = True  # False: S3 checks versions by one HEAD per file per reader, as gcsfs does (A/B, tests)


class ObjectChanged(OSError):
    """A GET conditioned on the cataloged ETag (``If-Match``) was refused (HTTP 412): the object changed."""


def if_match_etag(fs: Any, version: str) -> str | None:
    """The ETag to send as ``If-Match`` with ``fs``'s ranged GETs of a file cataloged at ``version``, or None
    (``version`` is not an ETag, or ``fs`` cannot send one: then the version is checked apart, by ``info``).

    The S3 backends can (s3fs through its ``get_object`` call, obstore through its get options); gcsfs
    and local disk cannot, through fsspec."""
    if not CONDITIONAL_GETS or not version.startswith("ETag=") or len(version) <= 5:
        return None
    return version[5:] if getattr(fs, "if_match_ranges", False) or _is_s3fs(fs) else None


def cat_ranges_if_match(fs: Any, path: str, starts: list[int], ends: list[int], etag: str,
                        timeout: float) -> list[Any]:
    """``fs.cat_ranges`` (errors returned in place) with every GET conditioned on ``etag``; a GET of
    another version fails with ``ObjectChanged``. ``fs`` must be one ``if_match_etag`` accepted."""
    if getattr(fs, "if_match_ranges", False):
        return fs.cat_ranges([path] * len(starts), starts, ends, on_error="return", if_match=etag,
                             **timeout_kw(fs, timeout))
    import fsspec.asyn

    async def gather() -> list[Any]:
        return await asyncio.gather(*(_s3fs_get_if_match(fs, path, s, e, etag) for s, e in zip(starts, ends)),
                                    return_exceptions=True)

    return fsspec.asyn.sync(fs.loop, gather, timeout=max(float(timeout), 0.001))


async def cat_file_if_match(fs: Any, path: str, start: int, end: int, etag: str) -> bytes:
    """The bytes ``[start, end)`` by one GET conditioned on ``etag`` (a coroutine on ``fs``'s loop); a GET of
    another version fails with ``ObjectChanged``. ``fs`` must be one ``if_match_etag`` accepted."""
    if getattr(fs, "if_match_ranges", False):
        return await fs._cat_file(path, start, end, if_match=etag)
    return await _s3fs_get_if_match(fs, path, start, end, etag)


async def object_exists(fs: Any, path: str) -> bool | None:
    """Whether an object is stored under exactly ``path``, by one HEAD (a coroutine on ``fs``'s loop):
    s3fs and the obstore backend; None for a filesystem that has no such request (ask ``info``).

    ``info`` of a missing key asks the store twice, a HEAD and then a one-key listing to tell a
    directory; the catalog has the listing already, so it needs only the HEAD."""
    own = getattr(fs, "_object_exists", None)
    if own is not None:
        return await own(path)
    if not _is_s3fs(fs):
        return None
    bucket, key, _ = fs.split_path(path)
    if not key:
        return False
    try:
        await s3fs_request(fs)("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return False
    return True


def _is_s3fs(fs: Any) -> bool:
    try:
        from s3fs import S3FileSystem
    except ImportError:
        return False
    return isinstance(fs, S3FileSystem)


async def _s3fs_get_if_match(fs: Any, path: str, start: int, end: int, etag: str) -> bytes:
    """One ranged ``get_object`` with ``IfMatch``, as s3fs's own ``_cat_file`` makes it."""
    bucket, key, version_id = fs.split_path(path)
    request = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}", "IfMatch": etag}
    if version_id:
        request["VersionId"] = version_id
    try:
        response = await s3fs_request(fs)("get_object", **request)
    except OSError as exc:
        if _precondition_failed(exc):
            raise ObjectChanged(f"{path}: If-Match {etag} refused (412 PreconditionFailed)") from exc
        raise
    try:
        return await response["Body"].read()
    finally:
        response["Body"].close()


def s3fs_request(fs: Any) -> Callable[..., Awaitable[Any]]:
    """The coroutine of s3fs's ``fs`` that sends one S3 request with the arguments given (``_call_s3``: the
    async twin of its public ``call_s3``; the one s3fs internal streamshard uses, and only through here).

    s3fs has no public way to send a ranged GET with an ``If-Match`` of our choosing at one request per
    range: ``cat_file``/``_cat_file`` take no request arguments; ``open()`` conditions its reads on the ETag
    its own HEAD finds at open (one more request per file, and the object as it is now, not as cataloged;
    nothing at all when given ``size=``) and reads one range at a time; ``s3_additional_kwargs`` applies
    to every request of the filesystem, which all files share. So when an s3fs no longer has it, this
    raises, naming the s3fs version, rather than letting the GETs go out without the condition.
    """
    call = getattr(fs, "_call_s3", None)
    if call is None or not inspect.iscoroutinefunction(call):
        import s3fs

        raise RuntimeError(f"s3fs {s3fs.__version__} has no coroutine S3FileSystem._call_s3, which streamshard "
                           f"uses to send GETs conditioned on the cataloged ETag (If-Match); use an s3fs that has "
                           f"it or storage_options backend='obstore'")
    return call


def _precondition_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) is the store refusing a condition: HTTP 412 / PreconditionFailed."""
    link: BaseException | None = exc
    while link is not None:
        response = getattr(link, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return error.get("Code") == "PreconditionFailed" or status == 412
        link = link.__cause__
    return False


def _secret_values(options: Any, secret_key: bool = False) -> Iterable[str]:
    """String values stored under secret-looking keys, however deeply nested."""
    if isinstance(options, dict):
        for key, value in options.items():
            is_secret = secret_key or any(part in str(key).lower() for part in _SECRET_KEY_PARTS)
            yield from _secret_values(value, is_secret)
    elif isinstance(options, (list, tuple)):
        for value in options:
            yield from _secret_values(value, secret_key)
    elif secret_key and isinstance(options, str) and len(options) >= 4:
        yield options


def check_short_read(
    fs: fsspec.AbstractFileSystem, path: str, url: str, size: int, got: int, want: int, error: type[Exception],
    timeout: float = 10.0,
) -> None:
    """Called when a ranged read returned ``got`` of ``want`` bytes; always raises.

    A file whose size differs from the cataloged ``size`` changed under us: ``error`` (permanent,
    naming the URL). Otherwise the body was cut short in transit: ``TransientError`` (retried).
    """
    try:
        fs.invalidate_cache(path)  # a listing cache would otherwise answer with the old size
        now: int | None = int(fs.info(path, **timeout_kw(fs, timeout))["size"])
    except FileNotFoundError:
        now = None
    except Exception:  # noqa: BLE001 - cannot tell whether it changed; let the retry policy decide
        now = size
    raise short_read_error(url, size, now, got, want, error)


def short_read_error(url: str, size: int, now: int | None, got: int, want: int, error: type[Exception]) -> Exception:
    """What a short read means, given the file's size ``now`` (None: it is gone): ``error`` or ``TransientError``."""
    from .retry import TransientError

    if now is None:
        return error(f"{url}: file no longer exists (it was cataloged with {size} bytes)")
    if now != size:
        return error(f"{url}: file is {now} bytes now but was cataloged with {size}; did it change?")
    return TransientError(f"{url}: got {got} of {want} bytes (truncated response)")


# -- secrets in third-party log records -----------------------------------------------------------

# Loggers whose records may carry request headers or credentials (botocore logs the session token
# header at DEBUG). Child loggers ("botocore.endpoint") included: names are matched by prefix.
REDACTED_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3transfer", "s3fs", "fsspec", "urllib3", "aiohttp",
                    "gcsfs", "google", "adlfs", "azure", "streamshard")


class LogRedaction:
    """Replaces registered secret values by ``***`` in the log records of ``REDACTED_LOGGERS``.

    A filter on the ``botocore`` logger would miss the records of its children (``botocore.endpoint``
    logs the request headers; filters of a parent are not consulted for propagated records), so this
    wraps the log record factory instead: every record of those loggers, whichever handler gets it.
    A record is rewritten only when it holds a secret. Secrets are reference-counted (``add`` and
    ``discard`` in pairs; adding a secret twice installs nothing twice); with none left, or after
    ``clear()``, the previous factory is put back (or, when another library wrapped ours since, ours
    stays in its chain as a pass-through).
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._permanent: set[str] = set()
        self._secrets: tuple[str, ...] = ()
        self._previous: Any = None
        self._lock = threading.Lock()
        self._installed = self._factory  # one bound method, so ``is`` can recognise it later

    @property
    def installed(self) -> bool:
        return logging.getLogRecordFactory() is self._installed

    def add(self, secrets: Iterable[str]) -> None:
        with self._lock:
            for secret in secrets:
                self._counts[secret] = self._counts.get(secret, 0) + 1
            self._update()

    def discard(self, secrets: Iterable[str]) -> None:
        with self._lock:
            for secret in secrets:
                left = self._counts.get(secret, 0) - 1
                if left > 0:
                    self._counts[secret] = left
                else:
                    self._counts.pop(secret, None)
            self._update()

    def clear(self) -> None:
        """Forget every secret and put the previous record factory back (when still possible)."""
        with self._lock:
            self._counts.clear()
            self._permanent.clear()
            self._update()

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def add_permanent(self, secrets: Iterable[str]) -> None:
        """``add`` for secrets never discarded, each counted once however often it is added."""
        with self._lock:
            fresh = [x for x in secrets if x not in self._permanent]
            if not fresh:
                return
            self._permanent.update(fresh)
        self.add(fresh)

    def _update(self) -> None:
        self._secrets = tuple(sorted(self._counts, key=len, reverse=True))
        if self._secrets and self._previous is None:
            self._previous = logging.getLogRecordFactory()
            logging.setLogRecordFactory(self._installed)
        elif not self._secrets and self._previous is not None and self.installed:
            logging.setLogRecordFactory(self._previous)
            self._previous = None

    def _factory(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = (self._previous or logging.LogRecord)(*args, **kwargs)
        secrets = self._secrets
        if secrets and record.name.startswith(REDACTED_LOGGERS):
            self._scrub(record, secrets)
        return record

    def _scrub(self, record: logging.LogRecord, secrets: tuple[str, ...]) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format string: the handler will report it, unredacted args aside
            message = f"{record.msg!r} % {record.args!r}"
        if any(secret in message for secret in secrets):
            record.msg, record.args = self.redact(message), ()
        if record.exc_info and record.exc_info[0] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if any(secret in text for secret in secrets):
                record.exc_info, record.exc_text = None, self.redact(text)  # the exception object holds it too
        if record.stack_info and any(secret in record.stack_info for secret in secrets):
            record.stack_info = self.redact(record.stack_info)


REDACTION = LogRedaction()
