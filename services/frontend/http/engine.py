"""The native HTTP/1.1 server, on the frontend's event loop: one asyncio.Protocol per
connection (http/connection.py), parsed by httptools (llhttp).

Why not aiohttp: per request it builds a BaseRequest, a StreamReader, a Response and a
payload writer (its cost per request: docs/benchmarks.md, "Figures behind design
choices"). Here a request is one small object (http.message.Request), its body one buffer,
its answer one write. The handlers are http.routes.Handlers, the same as on the aiohttp
path (--http-impl aiohttp), so routes, error texts and status codes cannot drift.

A connection answers its requests one at a time, in the order they arrived (pipelining):
the parser queues each request once its head is read, and one task per busy connection
runs the handler of the first and writes its answer, then takes the next. The body is
gathered while the handler waits for it (http.message.Request: it grows with the bytes
that arrive, never with the size declared), inflated on the way in for gzip/deflate so
that the size limit applies to the decompressed size, as in Triton.
Back-pressure: reading pauses while the client is not reading our answers
(pause_writing) or too many pipelined requests wait behind the one being answered.
A StreamReply (the generate extension's server-sent events) is written as a chunked body,
each piece when it comes and the next only once the client reads; a client that leaves
mid-stream cancels the task answering it, which closes the stream (and its request).

The server holds what all its connections share: the limits (http/limits.py: their
defaults, flags and sources) with a counter each, the 503 answer past the connection cap,
and the one timer that looks at every connection a few times per timeout.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from collections.abc import Awaitable, Callable
from ssl import SSLContext
from typing import Any

from services.common.errors import PortTaken
from services.frontend.http.connection import Connection
from services.frontend.http.json_body import error_body
from services.frontend.http.limits import (
    BODY_TIMEOUT,
    COUNTERS,
    HEADER_TIMEOUT,
    IDLE_CHECKS,
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
)
from services.frontend.http.message import Reply
from services.frontend.listen import BACKLOG, where

log = logging.getLogger(__name__)

__all__ = ["NativeHttpServer"]


Handler = Callable[[Any], Awaitable[Reply]]


class NativeHttpServer:
    """Serves ``handle(request) -> Reply`` on host:port. SO_REUSEPORT lets several frontend
    processes share the port; bodies over ``limit`` bytes are refused (BodyTooLarge).

    The limits (http/limits.py) come from the arguments, else from ``settings`` (a
    FrontendSettings: --http-header-timeout-secs, --http-body-timeout-secs,
    --http-idle-timeout-secs, --http-max-connections), else the defaults there. A timeout
    of 0 (or less) is off, and so is a max_connections of 0."""

    def __init__(self, handle: Handler, limit: int, idle_timeout: float | None = None, *,
                 header_timeout: float | None = None, body_timeout: float | None = None,
                 max_connections: int | None = None, settings: Any = None) -> None:
        def pick(value: Any, name: str, default: Any) -> Any:
            if value is not None:
                return value
            return getattr(settings, name, default) if settings is not None else default

        self.handle = handle
        self.limit = limit
        self.idle_timeout = float(pick(idle_timeout, "http_idle_timeout_secs", IDLE_TIMEOUT))
        self.header_timeout = float(pick(header_timeout, "http_header_timeout_secs",
                                         HEADER_TIMEOUT))
        self.body_timeout = float(pick(body_timeout, "http_body_timeout_secs", BODY_TIMEOUT))
        self.max_connections = int(pick(max_connections, "http_max_connections",
                                        MAX_CONNECTIONS))
        self.connections: set[Connection] = set()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.stopping = False
        self.port = 0
        self.refusal = self._refusal()
        # Requests keep their headers as sent (names in their case, repeats) for
        # --http-header-forward-pattern (forward.py): only when it is given.
        self.raw_headers = getattr(settings, "http_header_forward_pattern", None) is not None
        self._logged: dict[str, float] = {}
        self._server: asyncio.AbstractServer | None = None
        self._all_closed: asyncio.Event | None = None
        timeouts = [t for t in (self.idle_timeout, self.header_timeout, self.body_timeout)
                    if t > 0]
        self._check_every = min(timeouts) / IDLE_CHECKS if timeouts else math.inf
        self._timer: asyncio.TimerHandle | None = None

    def _refusal(self) -> bytes:
        body = error_body(f"Service Unavailable: this server is at its limit of "
                          f"{self.max_connections} connections (--http-max-connections)")
        return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))

    def count(self, what: str) -> None:
        """One more of ``what`` (a flood, a timeout); logged at most every 10 s per kind."""
        n = self.counters[what] = self.counters[what] + 1
        now = time.monotonic()
        if now - self._logged.get(what, -math.inf) >= 10.0:
            self._logged[what] = now
            log.warning("HTTP %s: %d so far", what.replace("_", " "), n)

    def protocol(self) -> asyncio.Protocol:
        """A new connection (create_server's factory; call it on the running loop). Tests
        and benchmarks drive one with a fake transport."""
        return Connection(self)

    async def start(self, host: str, port: int, ssl: SSLContext | None = None, *,
                    fd: int = -1, reuse_port: bool = False) -> None:
        """Listen; with ``ssl`` (tls.server_context) serve HTTPS. A connection is created at
        accept and its first head is timed from then, so the TLS handshake counts against
        the header timeout: asyncio bounds the handshake by it (ssl_handshake_timeout), the
        timer the rest."""
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {}
        if ssl is not None:
            tls = {"ssl": ssl, "ssl_handshake_timeout": self.header_timeout or None}
        try:
            self._server = await loop.create_server(
                self.protocol, **where(host, port, fd, reuse_port), backlog=BACKLOG, **tls)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortTaken("HTTP", host, port) from None
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        if self._check_every < math.inf:
            self._timer = loop.call_later(self._check_every, self._check_idle)

    def _check_idle(self) -> None:
        """One timer for all connections rather than one per request (re-arming a timer
        costs on every answer; this costs nothing per request)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in list(self.connections):
            conn.tick(now)
        self._timer = loop.call_later(self._check_every, self._check_idle)

    def connection_closed(self) -> None:
        if self._all_closed is not None and not self.connections:
            self._all_closed.set()

    async def stop(self, grace: float = 60.0) -> None:
        """Stop accepting, close idle connections, give requests in flight ``grace``
        seconds to be answered (as aiohttp's shutdown_timeout), then cut the rest."""
        self.stopping = True
        if self._timer is not None:
            self._timer.cancel()
        if self._server is not None:
            self._server.close()
        self._all_closed = asyncio.Event()
        for conn in list(self.connections):
            conn.shutdown()
        if self.connections:
            try:
                await asyncio.wait_for(self._all_closed.wait(), grace)
            except TimeoutError:
                pass
        tasks = [c._task for c in self.connections if c._task is not None]
        for conn in list(self.connections):
            conn.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
