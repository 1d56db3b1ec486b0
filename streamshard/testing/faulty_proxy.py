"""A fault-injecting HTTP reverse proxy on 127.0.0.1, for testing storage code against real faults.

Put it in front of an S3 endpoint (moto's server) and point the client's ``endpoint_url`` at
it. It can add latency to every request and, at a given rate, answer 503 SlowDown / 500
InternalError, reset the connection, cut a body short, or stall past the client's timeout.
It counts requests and body bytes per (method, path), so tests can check what a reader fetched.

Fault decisions are deterministic for a seed: each request is identified by (method, path,
Range header, how many times that same request was seen before), and hashed with the seed,
so the k-th attempt of a given request meets the same fate whatever the thread interleaving.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import struct
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator
from urllib.parse import urlsplit

FAULT_KINDS = ("503", "500", "reset", "truncate", "stall")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "content-length"}
_ERROR_BODY = {
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
         b"<Message>Please reduce your request rate.</Message></Error>",
    500: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
         b"<Message>We encountered an internal error. Please try again.</Message></Error>",
    403: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
         b"<Message>Access Denied</Message></Error>",
    404: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code>"
         b"<Message>The specified key does not exist.</Message></Error>",
}


@dataclass
class FaultConfig:
    """What the proxy does to requests; change fields any time (e.g. faults on after an upload).

    latency: seconds added before each request is forwarded. fault_rate: probability that a
    request of ``fault_methods`` gets one of ``faults`` (chosen uniformly). permanent: regex on
    the path -> HTTP status (or "reset") returned for every request of matching paths.
    stall_seconds: how long a "stall" holds the connection before closing it.
    """

    latency: float = 0.0
    fault_rate: float = 0.0
    faults: tuple[str, ...] = ("503", "reset", "truncate")
    fault_methods: tuple[str, ...] = ("GET",)
    permanent: dict[str, int | str] = field(default_factory=dict)
    seed: int = 0
    stall_seconds: float = 5.0

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {FAULT_KINDS}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate must be in [0, 1], got {self.fault_rate}")


class FaultyProxy:
    """A running proxy: ``endpoint_url`` to connect to, ``config`` to steer, counters to read."""

    def __init__(self, upstream: str, config: FaultConfig | None = None, max_connections: int = 128) -> None:
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
        self.config = config or FaultConfig()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._seen: Counter = Counter()
        self.requests: Counter = Counter()  # (method, path) -> requests
        self.bytes_sent: Counter = Counter()  # (method, path) -> response body bytes sent
        self.faults_injected: Counter = Counter()  # kind -> count
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def reset_counts(self) -> None:
        """Zero the request, byte and fault counters (not the fault decisions' history)."""
        with self._lock:
            self.requests.clear()
            self.bytes_sent.clear()
            self.faults_injected.clear()

    def count(self, method: str | None = None, path: str | None = None) -> int:
        """Requests seen, optionally only of one method and/or paths containing ``path``."""
        return _total(self.requests, method, path)

    def bytes(self, method: str | None = None, path: str | None = None) -> int:
        """Body bytes sent, filtered like ``count``."""
        return _total(self.bytes_sent, method, path)

    def request_counts(self) -> list[tuple[str, str, int]]:
        """Every ``(method, path with its query, requests)`` seen since the counters were zeroed."""
        with self._lock:
            return [(m, p, n) for (m, p), n in sorted(self.requests.items())]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # -- used by the handler -------------------------------------------------------------------
    def decide(self, method: str, path: str, byte_range: str) -> str | int | None:
        """The fate of one request: None (forward), a fault kind, or a permanent status."""
        config = self.config
        for pattern, outcome in config.permanent.items():
            if re.search(pattern, path):
                return outcome
        if method not in config.fault_methods or config.fault_rate <= 0:
            return None
        key = (method, path, byte_range)
        with self._lock:
            nth = self._seen[key]
            self._seen[key] += 1
        digest = hashlib.sha256(f"{config.seed}|{method}|{path}|{byte_range}|{nth}".encode()).digest()
        draw, pick = struct.unpack("<QQ", digest[:16])
        if draw / 2**64 >= config.fault_rate:
            return None
        return config.faults[pick % len(config.faults)]

    def record(self, method: str, path: str, body_bytes: int, fault: str | int | None) -> None:
        with self._lock:
            self.requests[(method, path)] += 1
            self.bytes_sent[(method, path)] += body_bytes
            if fault is not None:
                self.faults_injected[str(fault)] += 1


def _total(counter: Counter, method: str | None, path: str | None) -> int:
    return sum(n for (m, p), n in counter.items() if (method is None or m == method) and (path is None or path in p))


def _handler_for(proxy: FaultyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        owner = proxy

    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real clients use
    timeout = 30  # an idle client connection is closed after this
    owner: FaultyProxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self) -> None:
        self._proxy()

    def do_HEAD(self) -> None:
        self._proxy()

    def do_PUT(self) -> None:
        self._proxy()

    def do_POST(self) -> None:
        self._proxy()

    def do_DELETE(self) -> None:
        self._proxy()

    def _proxy(self) -> None:
        owner = self.owner
        with owner._slots:
            body = self._request_body()
            path = self.path.split("?", 1)[0]
            fate = owner.decide(self.command, path, self.headers.get("Range", ""))
            if owner.config.latency > 0:
                time.sleep(owner.config.latency)
            if fate == "reset":
                owner.record(self.command, path, 0, fate)
                return self._reset()
            if fate == "stall":
                owner.record(self.command, path, 0, fate)
                time.sleep(owner.config.stall_seconds)
                return self._reset()
            if fate in ("503", "500") or isinstance(fate, int):
                status = int(fate)
                owner.record(self.command, path, 0, fate)
                return self._send(status, {"Content-Type": "application/xml"}, _ERROR_BODY.get(status, b""))
            status, headers, payload = self._forward(body)
            if fate == "truncate" and len(payload) > 1:
                owner.record(self.command, path, len(payload) // 2, fate)
                self._send(status, headers, payload, cut=len(payload) // 2)
                return self._close_early()
            owner.record(self.command, path, 0 if self.command == "HEAD" else len(payload), None)
            self._send(status, headers, payload)

    def _request_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
        owner = self.owner
        upstream = http.client.HTTPConnection(owner.upstream_host, owner.upstream_port, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
            out = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
            if self.command == "HEAD":
                out["Content-Length"] = response.getheader("Content-Length", "0")
            return response.status, out, payload
        finally:
            upstream.close()

    def _send(self, status: int, headers: dict[str, str], payload: bytes, cut: int | None = None) -> None:
        self.send_response_only(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if self.command != "HEAD" or "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload if cut is None else payload[:cut])
        self.wfile.flush()

    def _close_early(self) -> None:
        """End the connection cleanly (FIN) before the promised Content-Length was sent."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), as a dropped connection looks."""
        try:
            self.wfile.flush()
        except OSError:
            pass
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


@contextmanager
def faulty_proxy(upstream: str, config: FaultConfig | None = None) -> Iterator[FaultyProxy]:
    """Run a ``FaultyProxy`` in front of ``upstream`` for the duration of the block."""
    proxy = FaultyProxy(upstream, config)
    try:
        yield proxy
    finally:
        proxy.stop()
