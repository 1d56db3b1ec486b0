"""Retrying storage requests: exponential backoff with jitter, bounded in attempts and in time.

Retries happen per request (one ranged GET, one footer, one listing), below the batch level,
so a retry can neither repeat nor skip a batch. Only transient faults are retried (HTTP 5xx,
SlowDown/throttling, connection resets, timeouts, truncated bodies); permanent ones (403, 404,
a corrupt or changed file) surface at once, so a bad path fails fast.

The deadline bounds the whole call, waits and attempts in flight included: ``call_within`` tells
each attempt the seconds left, which the storage code passes on as the request's timeout (a hung
endpoint then fails at the deadline, not after the backend's own connect/read timeouts per attempt).
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import logging
import random
import socket
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterator, TypeVar

log = logging.getLogger("streamshard")

T = TypeVar("T")

MIN_ATTEMPT_SECONDS = 0.05  # an attempt is never given less than this (a zero timeout would mean none)
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests",
}
_PERMANENT_STATUS = {400, 401, 403, 404, 405, 409, 411, 412, 416}
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE, errno.ECONNREFUSED, errno.EAGAIN}
# Exception class names of optional backends (botocore, aiohttp, urllib3) that mean "try again".
_TRANSIENT_NAMES = {
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "ResponseParserError",
    "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
    "ServerTimeoutError", "ClientConnectorError", "ProtocolError", "FSTimeoutError",
}


class TransientError(OSError):
    """A fault worth retrying that no library raised: e.g. a body shorter than its range."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to retry one storage request.

    Attempt ``k`` (from 1) that fails transiently waits ``uniform(0.5, 1) * min(max_delay,
    base_delay * 2**(k-1))`` before the next, until ``max_attempts`` attempts or ``deadline``
    seconds (from the first attempt) would be exceeded; then the last error is raised. Under
    ``call_within`` an attempt still running at the deadline is cut off there.
    """

    max_attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 4.0
    deadline: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay < 0 or self.max_delay < 0 or self.deadline <= 0:
            raise ValueError(f"delays must be >= 0 and deadline > 0, got {self}")

    def delays(self) -> Iterator[float]:
        """The jittered waits between attempts (``max_attempts - 1`` of them)."""
        for k in range(self.max_attempts - 1):
            cap = min(self.max_delay, self.base_delay * (2**k))
            yield cap * random.uniform(0.5, 1.0)


class RetriesExhausted(Exception):
    """Every attempt a policy allows failed transiently; ``last`` is the final error."""

    def __init__(self, attempts: int, elapsed: float, last: BaseException) -> None:
        super().__init__(f"gave up after {attempts} attempts in {elapsed:.1f} s: {describe(last)}")
        self.attempts, self.elapsed, self.last = attempts, elapsed, last


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    redact: Callable[[str], str] = lambda text: text,
) -> T:
    """``fn()``, retried on transient errors as ``policy`` allows.

    Permanent errors propagate unchanged on the first attempt; running out of attempts or time
    raises ``RetriesExhausted`` (from the last error). Every retry is logged at WARNING on the
    ``streamshard`` logger with ``what`` (say, the URL and range) passed through ``redact``.
    ``fn`` itself is not interrupted: use ``call_within`` when an attempt can hang.
    """
    return call_within(lambda _left: fn(), policy, what, redact)


def call_within(
    fn: Callable[[float], T],
    policy: RetryPolicy,
    what: str,
    redact: Callable[[str], str] = lambda text: text,
) -> T:
    """Like ``call_with_retry``, but each attempt is ``fn(seconds_left)``: the time until the deadline.

    An attempt that honours ``seconds_left`` (``storage.timeout_kw``) keeps the whole call, all
    attempts and waits included, within ``policy.deadline``.
    """
    start = time.monotonic()
    delays = policy.delays()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(max(policy.deadline - (time.monotonic() - start), MIN_ATTEMPT_SECONDS))
        except Exception as exc:  # noqa: BLE001 - classified by _next_delay; permanent ones re-raised
            delay = _next_delay(exc, attempt, start, delays, policy, what, redact)
        time.sleep(delay)


async def call_within_async(
    fn: Callable[[float], Awaitable[T]],
    policy: RetryPolicy,
    what: str,
    redact: Callable[[str], str] = lambda text: text,
) -> T:
    """``call_within`` for coroutines: ``await fn(seconds_left)``, retried; waits do not block the loop.

    ``fn`` must itself bound each attempt by ``seconds_left`` (``asyncio.wait_for``).
    """
    start = time.monotonic()
    delays = policy.delays()
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn(max(policy.deadline - (time.monotonic() - start), MIN_ATTEMPT_SECONDS))
        except Exception as exc:  # noqa: BLE001 - classified by _next_delay; permanent ones re-raised
            delay = _next_delay(exc, attempt, start, delays, policy, what, redact)
        await asyncio.sleep(delay)


def _next_delay(
    exc: Exception, attempt: int, start: float, delays: Iterator[float], policy: RetryPolicy, what: str,
    redact: Callable[[str], str],
) -> float:
    """The wait before retrying after ``exc``, logged; re-raises a permanent ``exc``, or ``RetriesExhausted``."""
    if not is_transient(exc):
        raise exc
    delay = next(delays, None)
    elapsed = time.monotonic() - start
    if delay is None or elapsed + delay + MIN_ATTEMPT_SECONDS > policy.deadline:
        raise RetriesExhausted(attempt, elapsed, exc) from exc
    log.warning(
        "%s: transient %s (attempt %d of %d); retrying in %.2f s",
        redact(what), redact(describe(exc)), attempt, policy.max_attempts, delay,
    )
    return delay


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    text = str(exc).replace("\n", " ").strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the request that raised ``exc`` may succeed.

    Walks the exception's cause chain (fsspec backends wrap library errors) and decides on the
    first link that says anything: an HTTP status or error code, a known class, an errno.
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        verdict = _verdict(link)
        if verdict is not None:
            return verdict
        link = link.__cause__ or link.__context__
    return False


def _verdict(exc: BaseException) -> bool | None:
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status, code = _http_status(exc)
    if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
        return True
    if status in _PERMANENT_STATUS or code:
        return False
    if isinstance(exc, (TimeoutError, ConnectionError, socket.timeout, http.client.IncompleteRead,
                        http.client.RemoteDisconnected)):
        return True
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return None


def _http_status(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and error code of a botocore-style ``ClientError`` (else None, None)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        meta = response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        code = error.get("Code")
        if isinstance(code, str) and code.isdigit():
            status = status or int(code)
        return (int(status) if status else None), (str(code) if code else None)
    status = getattr(exc, "status", None) or getattr(exc, "code", None)
    return (status if isinstance(status, int) and 100 <= status < 600 else None), None
