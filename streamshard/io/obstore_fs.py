"""An optional S3 backend on obstore (Rust: object_store + reqwest), behind the same URLs and options.

Chosen with ``storage_options={"backend": "obstore", ...}``; the other options keep their s3fs
meaning (``key``, ``secret``, ``token``, ``anon``, ``endpoint_url``, ``region``, ``client_kwargs``,
``config_kwargs``, ``use_ssl``, ``requester_pays``, ``profile``) and an option it cannot honour is
refused by name rather than ignored.

Credentials: options given (``key``/``secret``/``token``, ``anon``) win. Otherwise they come from
botocore's credential chain, as s3fs's do (``BotocoreCredentials``): environment, the ``profile``'s
(or ``AWS_PROFILE``'s) ``~/.aws`` credentials and config, ``credential_process``, SSO, assumed roles,
web identity, container and instance metadata; credentials that expire are refreshed by botocore
before they do, and obstore asks again at their expiry. botocore is imported only when needed (about
0.1 s of CPU): not when the options or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` and a region
(option or ``AWS_REGION``/``AWS_DEFAULT_REGION``) say it all, as botocore would read the environment
first too. Without botocore installed, obstore's own chain applies (environment, web identity,
container and instance metadata; no profiles).

Measured on SeaweedFS (``benchmarks/object_client.py``), a ranged GET costs the client 3-8x less
CPU than through s3fs/aiobotocore, which is what a cold catalog of many small files and a worker's
read-ahead spend their time on.

``ObstoreFileSystem`` is an fsspec ``AsyncFileSystem``, so the catalog and the reader use it as they
use s3fs: ``info`` (size and ``ETag``, in s3fs's format, so versions, catalog caches and checkpoint
digests agree across backends), listings (one paginated flat listing per ``find``), ``cat_file``
and ``cat_ranges`` (each range exactly, never coalesced). obstore's own retries are off: ours apply
(``io/retry.py``). Errors become what ``retry.is_transient`` and our messages expect:
``FileNotFoundError`` (missing key or bucket), ``PermissionError`` (401/403), ``TransientError``
(5xx, throttling, connection resets, timeouts, cut bodies), ``OSError`` otherwise; each names the
URL and the store's error code and message.

obstore runs its requests on a tokio runtime, which does not survive ``fork``: a child forked after
the runtime started hangs on its first request. ``forked_after_use()`` tells ``storage`` when this
process is such a child; it then serves S3 through s3fs instead, with a warning (DataLoader workers
started with ``multiprocessing_context="spawn"`` or ``"forkserver"`` keep obstore).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from datetime import timezone
from typing import Any, Sequence

import fsspec.asyn
from fsspec.spec import AbstractBufferedFile

from .retry import TransientError
from .storage import ObjectChanged

PROTOCOLS = ("s3", "s3a")
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_STATUS = re.compile(r"status code: (\d{3})")
_XML = re.compile(r"<Code>([^<]*)</Code>\s*<Message>([^<]*)</Message>")
_TOP_LEVEL = {"backend", "key", "secret", "token", "anon", "endpoint_url", "region", "client_kwargs",
              "config_kwargs", "use_ssl", "requester_pays", "profile"}
_CLIENT_KWARGS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
_CONFIG_KWARGS = {"connect_timeout", "read_timeout", "s3", "retries", "max_pool_connections", "signature_version"}

_first_use_pid: int | None = None  # the process in which obstore's runtime may have started


def forked_after_use() -> bool:
    """Whether this process was forked from one that had already used obstore (its runtime is gone here)."""
    return _first_use_pid is not None and _first_use_pid != os.getpid()


def store_config(storage_options: dict[str, Any]) -> dict[str, Any]:
    """obstore ``S3Store`` keyword arguments (bucket aside) equivalent to s3fs-style ``storage_options``.

    Raises ``ValueError`` naming any option it cannot honour, so a setting is never silently dropped.
    """
    unknown = sorted(set(storage_options) - _TOP_LEVEL)
    client = dict(storage_options.get("client_kwargs") or {})
    settings = dict(storage_options.get("config_kwargs") or {})
    unknown += [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KWARGS)]
    unknown += [f"config_kwargs.{k}" for k in sorted(set(settings) - _CONFIG_KWARGS)]
    addressing = (settings.get("s3") or {}).get("addressing_style", "auto")
    unknown += [f"config_kwargs.s3.{k}" for k in sorted(set(settings.get("s3") or {}) - {"addressing_style"})]
    if unknown:
        raise ValueError(f"storage_options {unknown} are not supported with backend='obstore' "
                         f"(supported: {sorted(_TOP_LEVEL)}; client_kwargs {sorted(_CLIENT_KWARGS)}; "
                         f"config_kwargs {sorted(_CONFIG_KWARGS)})")
    config: dict[str, Any] = {}
    credentials = {"access_key_id": storage_options.get("key") or client.get("aws_access_key_id"),
                   "secret_access_key": storage_options.get("secret") or client.get("aws_secret_access_key"),
                   "session_token": storage_options.get("token") or client.get("aws_session_token")}
    config.update({k: v for k, v in credentials.items() if v})
    if storage_options.get("anon"):
        config["skip_signature"] = True
    endpoint = storage_options.get("endpoint_url") or client.get("endpoint_url")
    region = storage_options.get("region") or client.get("region_name")
    if region:
        config["region"] = region
    if endpoint:
        config["endpoint"] = endpoint
    # Like botocore: path-style for a custom endpoint unless asked otherwise, virtual-hosted on AWS.
    config["virtual_hosted_style_request"] = addressing == "virtual" or (addressing == "auto" and not endpoint)
    if storage_options.get("requester_pays"):
        config["request_payer"] = True
    if storage_options.get("profile") and not storage_options.get("anon") and not credentials["access_key_id"]:
        config["profile"] = storage_options["profile"]  # for the credential chain (``credential_source``)
    client_options: dict[str, Any] = {
        "connect_timeout": f"{float(settings.get('connect_timeout', 10))}s",
        "read_timeout": f"{float(settings.get('read_timeout', 30))}s",
        "timeout": "3600s",  # a whole request is bounded by our retry deadline instead
    }
    if (endpoint and str(endpoint).startswith("http://")) or storage_options.get("use_ssl") is False:
        client_options["allow_http"] = True
    return {**config, "client_options": client_options, "retry_config": {"max_retries": 0}}


_REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")


def needs_credential_chain(config: dict[str, Any]) -> bool:
    """Whether ``config`` (from ``store_config``) leaves credentials or the region to botocore's chain.

    Not when the options give the credentials (or ``anon``), nor when, with no ``profile`` option,
    the environment's ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (which botocore reads first)
    and a region (option, environment, or a custom endpoint's) are there for obstore to read itself.
    """
    if config.get("skip_signature"):
        return False
    if config.get("access_key_id"):
        return not config.get("region") and not config.get("endpoint") and not _env_region()
    if config.get("profile"):
        return True
    env_keys = bool(os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))
    return not (env_keys and (config.get("region") or config.get("endpoint") or _env_region()))


def _env_region() -> str | None:
    return next((os.environ[name] for name in _REGION_ENV if os.environ.get(name)), None)


class BotocoreCredentials:
    """An obstore credential provider fed by botocore's credential chain (what s3fs, boto3 and the AWS CLI read).

    ``botocore.session.Session(profile=...)`` resolves the chain once, when the filesystem is made (it may
    run a ``credential_process`` or read an SSO token cache); each call returns botocore's current
    credentials, which botocore refreshes before they expire, with their expiry so that obstore asks
    again then (None: static credentials). ``region`` is the profile's (or the environment's) region.
    """

    def __init__(self, profile: str | None = None) -> None:
        import botocore.session

        self.profile = profile
        session = botocore.session.Session(profile=profile)
        self.region: str | None = session.get_config_variable("region")
        self._credentials = session.get_credentials()  # None: the chain found nothing

    @property
    def found(self) -> bool:
        return self._credentials is not None

    def __call__(self) -> dict[str, Any]:
        if self._credentials is None:
            raise PermissionError(f"no AWS credentials found by botocore's chain (profile {self.profile!r})")
        frozen = self._credentials.get_frozen_credentials()  # refreshed by botocore when near expiry
        expiry = getattr(self._credentials, "_expiry_time", None)  # RefreshableCredentials only
        if expiry is not None:  # botocore's is dateutil's tzutc/tzlocal; obstore takes datetime.timezone.utc only
            expiry = (expiry if expiry.tzinfo else expiry.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": expiry}


def credential_source(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``AWS_CA_BUNDLE``'s certificates trusted, and botocore's chain filled in where
    ``needs_credential_chain``: a ``credential_provider``
    (unless botocore finds nothing: obstore's own chain then answers) and the chain's region when none was
    given. Unchanged when botocore is not installed (obstore's own chain: environment, web identity,
    container and instance metadata)."""
    config = dict(config)
    bundle = os.environ.get("AWS_CA_BUNDLE")
    if bundle and "client_options" in config:  # botocore trusts these CAs (only); obstore adds them to its roots
        try:
            with open(bundle, encoding="ascii", errors="replace") as f:
                config["client_options"] = {**config["client_options"], "root_certificate": f.read()}
        except OSError as exc:
            raise ValueError(f"AWS_CA_BUNDLE={bundle!r} cannot be read: {exc}") from None
    profile = config.pop("profile", None)
    if not needs_credential_chain({**config, "profile": profile}):
        return config
    try:
        provider = BotocoreCredentials(profile)
    except ImportError:
        if profile:
            raise ValueError(f"storage_options profile={profile!r} with backend='obstore' needs botocore "
                             f"(pip install botocore) to read the AWS profile") from None
        return config
    if provider.region and not config.get("region"):
        config["region"] = provider.region
    if provider.found and not config.get("access_key_id"):
        config["credential_provider"] = provider
    return config


def auto_config(storage_options: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The resolved ``S3Store`` settings (``credential_source``) when obstore can serve ``storage_options`` as s3fs
    would, else ``(None, why not)``: every option is one it honours, the store is a custom endpoint or the
    options name the bucket's region, and it has credentials (options, environment, botocore's chain) or
    ``anon``. On AWS s3fs finds each bucket's region by itself (botocore follows the redirect a bucket in
    another region answers with); obstore signs for the region it is given and fails there, so a region
    from the environment or a profile, a default rather than the bucket's, keeps s3fs."""
    try:
        config = store_config(storage_options)
    except ValueError as exc:
        return None, str(exc)
    if not (config.get("region") or config.get("endpoint")):
        return None, ("on AWS with no region in the options: s3fs finds each bucket's region, obstore uses the one "
                      "it is given (pass storage_options region=, or backend='obstore', to use obstore)")
    # an endpoint option outranks a configured endpoint (for botocore too); trusted CAs have no option here
    configured = [c for c in configured_outside_options() if "ca_bundle" in c.lower() or not config.get("endpoint")]
    if configured:
        return None, f"{', '.join(configured)} configure S3 requests outside the options: botocore reads them, obstore does not"
    try:
        config = credential_source(config)
    except ValueError as exc:  # an unreadable AWS_CA_BUNDLE, say: s3fs reports it as it always has
        return None, str(exc)
    has_credentials = config.get("skip_signature") or config.get("access_key_id") or config.get("credential_provider") \
        or (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))
    if not has_credentials:
        return None, "no credentials found by botocore's chain (s3fs's client keeps looking, as before)"
    return config, ""


# Settings botocore (so s3fs) takes from the environment or the AWS config file that obstore does not read:
# where to send requests, and which certificate authorities to trust.
_BOTOCORE_ONLY_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
_BOTOCORE_ONLY_KEYS = re.compile(r"^\s*(endpoint_url|ca_bundle)\s*=", re.MULTILINE)


def configured_outside_options() -> list[str]:
    """What configures S3 requests outside the options as botocore (so s3fs) would read it and obstore would
    not: ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, or an ``endpoint_url``/``ca_bundle`` in the AWS
    config file (``AWS_CONFIG_FILE``, else ``~/.aws/config``; any profile, read as text without
    botocore), each named; empty: nothing."""
    found = [name for name in _BOTOCORE_ONLY_ENV if os.environ.get(name)]
    path = os.path.expanduser(os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            found += [f"{key} in {path}" for key in sorted(set(_BOTOCORE_ONLY_KEYS.findall(f.read())))]
    except OSError:
        pass
    return found


class ObstoreFileSystem(fsspec.asyn.AsyncFileSystem):
    """fsspec filesystem for ``s3://`` served by obstore; one ``S3Store`` per bucket, made on first use."""

    protocol = PROTOCOLS
    if_match_ranges = True  # ``cat_ranges(..., if_match=etag)``: GETs conditioned on the cataloged version
    cachable = False  # shared by ``storage.FileSystems`` per process and options, not by fsspec
    root_marker = ""

    def __init__(self, storage_options: dict[str, Any], resolved: dict[str, Any] | None = None) -> None:
        global _first_use_pid
        self._config = store_config(storage_options)  # before anything else: refuse bad options early
        super().__init__()
        self._stores: dict[str, Any] = {}
        # _config with the credential chain's provider and region (``credential_source``), on first use if not given
        self._resolved: dict[str, Any] | None = resolved
        self._stores_lock = threading.Lock()
        if _first_use_pid is None:
            _first_use_pid = os.getpid()

    # -- paths and stores ------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        for protocol in PROTOCOLS:
            if path.startswith(f"{protocol}://"):
                path = path[len(protocol) + 3 :]
                break
        return path.rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return f"s3://{self._strip_protocol(name)}"

    def _store(self, path: str) -> tuple[Any, str, str]:
        """``(store, bucket, key)`` of a path (``bucket/key``, with or without ``s3://``)."""
        from obstore.store import S3Store

        bucket, _, key = self._strip_protocol(path).partition("/")
        if not bucket:
            raise ValueError(f"{path!r} names no bucket")
        with self._stores_lock:
            if self._resolved is None:  # botocore's chain, if needed, once per filesystem (first request)
                self._resolved = credential_source(self._config)
            store = self._stores.get(bucket)
            if store is None:
                store = self._stores[bucket] = S3Store(bucket, **self._resolved)
        return store, bucket, key

    # -- reading ---------------------------------------------------------------------------------
    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, if_match: str | None = None,
                        **kwargs: Any) -> bytes:
        """The bytes ``[start, end)``; with ``if_match`` (an ETag) a GET of another version fails, ``ObjectChanged``."""
        import obstore

        store, bucket, key = self._store(path)
        try:
            if if_match is not None and start is not None and end is not None and 0 <= start < end:
                result = await obstore.get_async(store, key, options={"range": (start, end), "if_match": if_match})
                return (await result.bytes_async()).to_bytes()
            if if_match is not None:
                raise ValueError("if_match is for a range [start, end) with 0 <= start < end")
            if start is None and end is None:
                result = await obstore.get_async(store, key)
                return (await result.bytes_async()).to_bytes()
            if start is None or start < 0 or end is None or end < 0:
                size = (await self._info(path))["size"]
                start = 0 if start is None else (start + size if start < 0 else start)
                end = size if end is None else (end + size if end < 0 else end)
            if end <= start:
                return b""
            return (await obstore.get_range_async(store, key, start=start, end=end)).to_bytes()
        except Exception as exc:  # noqa: BLE001 - obstore's errors become ours (see module docstring)
            raise _error(f"s3://{bucket}/{key}", exc) from None

    async def _cat_ranges(
        self, paths: Sequence[str], starts: Sequence[int] | int, ends: Sequence[int] | int, max_gap: Any = None,
        batch_size: int | None = None, on_error: str = "return", if_match: str | None = None, **kwargs: Any,
    ) -> list[Any]:
        """Each ``[start, end)`` exactly (one GET each, ``batch_size`` in flight, each conditioned on the ETag
        ``if_match`` when given); errors returned in place."""
        if isinstance(starts, int):
            starts = [starts] * len(paths)
        if isinstance(ends, int):
            ends = [ends] * len(paths)
        if not len(paths) == len(starts) == len(ends):
            raise ValueError("paths, starts and ends must have the same length")
        slots = asyncio.Semaphore(batch_size or 64)

        async def one(path: str, start: int, end: int) -> bytes:
            async with slots:
                return await self._cat_file(path, start, end, if_match=if_match)

        results = await asyncio.gather(*(one(p, s, e) for p, s, e in zip(paths, starts, ends)),
                                       return_exceptions=True)
        if on_error == "raise":
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return list(results)

    # -- metadata and listings -------------------------------------------------------------------
    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        import obstore

        store, bucket, key = self._store(path)
        url = f"s3://{bucket}/{key}"
        if key:
            try:
                return _file_info(bucket, await obstore.head_async(store, key))
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001
                raise _error(url, exc) from None
        try:  # a directory (or the bucket) exists when anything is listed under it
            listing = await obstore.list_with_delimiter_async(store, key or None)
        except Exception as exc:  # noqa: BLE001
            raise _error(url, exc) from None
        if key and not listing["objects"] and not listing["common_prefixes"]:
            raise FileNotFoundError(f"{url}: no such object or directory")
        return {"name": f"{bucket}/{key}".rstrip("/"), "size": 0, "type": "directory"}

    async def _object_exists(self, path: str) -> bool:
        """Whether an object is stored under exactly ``path`` (one HEAD; ``storage.object_exists``)."""
        import obstore

        store, bucket, key = self._store(path)
        if not key:
            return False
        try:
            await obstore.head_async(store, key)
        except FileNotFoundError:
            return False
        except Exception as exc:  # noqa: BLE001
            raise _error(f"s3://{bucket}/{key}", exc) from None
        return True

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        import obstore

        store, bucket, key = self._store(path)
        try:
            listing = await obstore.list_with_delimiter_async(store, key or None)
        except Exception as exc:  # noqa: BLE001
            raise _error(f"s3://{bucket}/{key}", exc) from None
        objects = await self._without_folder_markers(store, bucket, listing["objects"])
        entries = [_file_info(bucket, meta) for meta in objects]
        entries += [{"name": f"{bucket}/{p.rstrip('/')}", "size": 0, "type": "directory"}
                    for p in listing["common_prefixes"]]
        if not entries:
            entries = [await self._info(path)]  # a file lists as itself; else FileNotFoundError
        return entries if detail else [e["name"] for e in entries]

    async def _find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
                    **kwargs: Any) -> Any:
        """Everything under ``path`` from one flat, paginated listing (not a walk: one request per 1,000 keys)."""
        import obstore

        store, bucket, key = self._store(path)
        try:
            metas = await obstore.list(store, key or None, chunk_size=1000).collect_async()
            metas = await self._without_folder_markers(store, bucket, metas)
        except Exception as exc:  # noqa: BLE001
            error = _error(f"s3://{bucket}/{key}", exc)
            if not isinstance(error, FileNotFoundError):
                raise error from None
            metas = []  # a missing bucket finds nothing, as with s3fs (the catalog then asks why)
        out: dict[str, dict[str, Any]] = {}
        base = f"{bucket}/{key}".rstrip("/")
        for meta in metas:
            info = _file_info(bucket, meta)
            relative = info["name"][len(base) + 1 :].split("/")
            if withdirs:  # the directories above it, down to maxdepth (a file deeper still has them)
                for depth in range(1, min(len(relative), (maxdepth or len(relative)) + 1)):
                    name = "/".join([base, *relative[:depth]])
                    out.setdefault(name, {"name": name, "size": 0, "type": "directory"})
            if maxdepth is not None and len(relative) > maxdepth:
                continue
            out[info["name"]] = info
        if not out and key:
            try:  # find on a file gives the file
                info = await self._info(path)
                if info["type"] == "file":
                    out[info["name"]] = info
            except FileNotFoundError:
                pass
        names = sorted(out)
        return {n: out[n] for n in names} if detail else names

    async def _without_folder_markers(self, store: Any, bucket: str, metas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``metas`` without the zero-byte ``d/`` keys the S3 console, EMR and Spark leave as folders.

        object_store lists the key ``d/`` as ``d`` (it drops the trailing slash), so such a marker looks
        like an empty object named ``d``; s3fs lists it as a directory. A HEAD of ``d`` tells them apart:
        an object stored under exactly ``d`` answers, a marker ``d/`` does not. Only zero-byte objects are
        asked (never Parquet; rare), all at once."""
        empty = [meta for meta in metas if int(meta["size"]) == 0]
        if not empty:
            return metas
        import obstore

        async def stored(meta: dict[str, Any]) -> bool:
            try:
                await obstore.head_async(store, meta["path"])
            except FileNotFoundError:
                return False
            return True

        answers = await asyncio.gather(*(stored(meta) for meta in empty))
        markers = {meta["path"] for meta, found in zip(empty, answers) if not found}
        return [meta for meta in metas if meta["path"] not in markers]

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> "ObstoreFile":
        if mode != "rb":
            raise NotImplementedError("the obstore backend reads only (mode='rb')")
        return ObstoreFile(self, path, mode, block_size="default" if block_size is None else block_size,
                           cache_options=cache_options, **kwargs)


class ObstoreFile(AbstractBufferedFile):
    """A read-only file whose reads are ranged GETs through the filesystem."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start=start, end=end)


def _file_info(bucket: str, meta: dict[str, Any]) -> dict[str, Any]:
    """An obstore ``ObjectMeta`` as s3fs describes a file (``ETag`` with its quotes, ``LastModified``)."""
    info = {"name": f"{bucket}/{meta['path']}", "size": int(meta["size"]), "type": "file",
            "LastModified": meta["last_modified"]}
    if meta.get("e_tag"):
        info["ETag"] = meta["e_tag"]
    if meta.get("version"):
        info["VersionId"] = meta["version"]
    return info


def _error(url: str, exc: BaseException) -> Exception:
    """An obstore exception as the exception type our retries and messages understand, naming ``url``."""
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    status_match = _STATUS.search(text)
    status = int(status_match.group(1)) if status_match else None
    xml = _XML.search(text)
    code = xml.group(1) if xml else None
    summary = (f"{status} {code}: {xml.group(2)}" if xml else (f"HTTP {status}" if status else text.splitlines()[0]))
    message = f"{url}: {summary}"
    if type(exc).__name__ == "PreconditionError" or status == 412:
        return ObjectChanged(message)
    if isinstance(exc, FileNotFoundError) or status == 404:
        return FileNotFoundError(message)
    if type(exc).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or status in (401, 403):
        return PermissionError(message)
    if status in _TRANSIENT_STATUS or code in ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"):
        return TransientError(message)
    if status is None and "HTTP error" in text:  # connection refused or reset, timeout, body cut short
        return TransientError(message)
    return OSError(message)
