"""HTTP/1.1 on the frontend's event loop: an asyncio.Protocol per connection, parsed by
httptools (llhttp).

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

Limits (docs/security.md), each with a counter in ``NativeHttpServer.counters``:
- connections: past ``max_connections`` open ones, a new connection is answered 503 and
  closed at once (the client learns why; nothing of it is read or kept).
- header timeout: a request head (request line and headers) must be complete within
  ``header_timeout`` seconds of its first byte, a new connection's first head within that
  time of the connection; else 408 and close (nginx's client_header_timeout).
- body timeout: a body must be complete within ``body_timeout`` seconds of its head, plus
  one second per BODY_MIN_RATE bytes it has brought, so any body arriving at least that
  fast is never cut while a trickle of a byte a second is; else 408 and close. (A body
  answered before it arrived, refused as too large say, is dropped as it comes, and its
  connection closes at ``body_timeout`` if the body is still coming.)
- idle timeout: a keep-alive connection with nothing to do closes after ``idle_timeout``;
  so does one whose client reads none of our answer for that long (a write stall).
- chunked bodies: more than MAX_CHUNKS chunks is Triton's 400, and reading stops.
Time is kept by one timer for all connections, which looks at each connection a few
times per timeout: nothing is timed per request or per read.
"""
from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from ssl import SSLContext
from typing import Any
from urllib.parse import unquote

import httptools

from services.common.errors import unknown_expect_text
from services.frontend.http.codec import error_body
from services.frontend.http.message import BROKEN, CHUNKS_TEXT, DONE, MAX_CHUNKS, RECEIVING, Reply, Request

log = logging.getLogger(__name__)

__all__ = ["NativeHttpServer"]

MAX_HEAD = 64 * 1024           # request line + headers; more is refused as malformed
MAX_HEAD_READ = 1 << 20        # bytes read while a head stays incomplete (httptools gathers
                               # a header's pieces before it calls on_header)
MAX_QUEUED = 32                # pipelined requests waiting behind the one being answered
MAX_QUEUED_BYTES = 1 << 20     # ... and their bodies, before reading pauses
SMALL_WRITE = 64 * 1024        # answers up to this size leave in one joined write
# A body buffer in this size range is kept by its connection for the next body of the same
# size: a fresh multi-MiB buffer costs a page fault per 4 KiB page (glibc maps it afresh)
# on every body. Dropped when the connection goes idle.
SPARE_MIN, SPARE_MAX = 256 * 1024, 16 * 1024 * 1024
IDLE_TIMEOUT = 75.0            # an idle keep-alive connection closes after this (as aiohttp)
HEADER_TIMEOUT = 60.0          # a request head must arrive within this (nginx's default)
BODY_TIMEOUT = 60.0            # a body must arrive within this, plus 1 s per BODY_MIN_RATE
BODY_MIN_RATE = 64 * 1024      # bytes: a body at least this fast per second is never cut
MAX_CONNECTIONS = 1024         # open connections per frontend (nginx's worker_connections)
IDLE_CHECKS = 5                # each timeout is checked this many times over its length
COUNTERS = ("connections_refused", "header_timeouts", "body_timeouts", "write_stalls",
            "chunk_floods", "malformed")


def _unshared_refs() -> int:
    """What sys.getrefcount says of a buffer only a local variable holds (the interpreter's
    own count differs between Python versions)."""
    buf = bytearray(1)
    return sys.getrefcount(buf)


_UNSHARED = _unshared_refs()


def _date_line() -> bytes:
    now = int(time.time())
    if now != _DATE[0]:
        _DATE[0] = now
        _DATE[1] = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _DATE[1]


_DATE: list[Any] = [0, b""]
_PREFIXES: dict[tuple[int, str | None], bytes] = {}
_METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS")}
_NAMES: dict[bytes, str] = {}      # header name as sent -> lower-case str (bounded below)
_TARGETS: dict[bytes, tuple[str, str]] = {}   # request target -> (path, query), bounded


def _prefix(status: int, content_type: str | None) -> bytes:
    """Status line and Content-Type, built once per pair."""
    key = (status, content_type)
    prefix = _PREFIXES.get(key)
    if prefix is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        prefix = f"HTTP/1.1 {status} {reason}\r\n".encode()
        if content_type:
            prefix += f"Content-Type: {content_type}\r\n".encode("latin-1")
        if len(_PREFIXES) < 256:
            _PREFIXES[key] = prefix
    return prefix


def _target(url: bytes) -> tuple[str, str]:
    """Request target -> (path as aiohttp's request.path gives it: percent-decoded, query)."""
    hit = _TARGETS.get(url)
    if hit is not None:
        return hit
    if url[:1] != b"/" and b"://" in url:       # absolute form: keep its path and query
        parsed = httptools.parse_url(url)
        raw_path, raw_query = parsed.path or b"/", parsed.query or b""
    else:
        raw_path, _, raw_query = url.partition(b"?")
    path = raw_path.decode("utf-8", "surrogateescape")
    if "%" in path:
        try:
            path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            pass                               # yarl keeps an invalid escape as it is
    hit = (path, raw_query.decode("latin-1"))
    if len(_TARGETS) >= 1024:
        _TARGETS.clear()
    _TARGETS[url] = hit
    return hit


class _Stop(Exception):
    """Raised in a parser callback to stop parsing (too large a head, connection ending)."""


def _error(status: int, text: str) -> Reply:
    return Reply(status, error_body(text), "application/json", close=True)


# Phases of a connection, as the server's timer sees them (_Connection.tick).
_HEAD, _BODY, _ANSWER, _IDLE, _STALL = range(5)


Handler = Callable[[Any], Awaitable[Reply]]


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    def __init__(self, server: NativeHttpServer) -> None:
        self._server = server
        self._handle = server.handle
        self._limit = server.limit
        self._loop = asyncio.get_running_loop()
        self._parser: Any = httptools.HttpRequestParser(self)   # None once closed
        self._transport: asyncio.Transport | None = None
        self._parsing: Request | None = None  # the request the parser is filling in
        self._url = b""
        self._head = 0                         # bytes of the head being parsed
        self._head_read = 0                    # bytes read while it is incomplete
        self._queue: deque[Request] = deque()  # read, waiting for their turn
        self._busy = False                     # a task is answering (self._task)
        self._task: asyncio.Task | None = None
        self._no_more = False                  # no new request will be taken
        self._dead = False                     # the parser stopped: input is ignored
        self._close_after_body = False         # close once the current body has arrived
        self._write_paused = False
        self._read_paused = False
        self._drain: asyncio.Future | None = None
        self._closed = False
        self._stop_reading = False             # reading stays paused (a flood was cut)
        self._served = False                   # a request has been read on this connection
        self._phase: tuple[int, Any] | None = None   # what the timer saw last, since when
        self._since = self._loop.time()
        self._spare: bytearray | None = None   # the last body's buffer, for the next body

    # -- asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if len(server.connections) >= server.max_connections > 0:
            # Over the cap: answered at once and closed, nothing read (nginx's limit_conn
            # and uvicorn's --limit-concurrency answer 503 too).
            server.count("connections_refused")
            self._no_more = self._dead = self._closed = True
            transport.write(server.refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        """Everything this connection holds goes now, not when the cyclic GC next runs: the
        parser (which refers back to us), the request being read and those queued (their
        bodies), the spare buffer, and the task answering (cancelled: the DataPlane frees
        what a cancelled infer held)."""
        self._closed = self._no_more = self._dead = True
        self._server.connections.discard(self)
        self._parser = None
        req, self._parsing, self._phase = self._parsing, None, None
        if req is not None and req.state == RECEIVING:
            req.end(BROKEN, "the connection closed")  # wakes a handler waiting for it
        for queued in self._queue:
            if queued.state == RECEIVING:
                queued.end(BROKEN, "the connection closed")
        self._queue.clear()
        self._spare = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None
        self._server.connection_closed()

    def data_received(self, data: bytes) -> None:
        if self._dead:
            return
        try:
            self._parser.feed_data(data)
            req = self._parsing
            if req is not None and not req.method:     # still in a request's head
                self._head_read += len(data)
                if self._head_read > MAX_HEAD_READ:
                    self._dead = True
                    self._malformed("request head too large")
        except httptools.HttpParserUpgrade as e:
            # Upgrade: / CONNECT: we never switch protocols; answer in HTTP/1.1 and go on
            # parsing what follows with a fresh parser.
            self._parser = httptools.HttpRequestParser(self)
            if e.args[0] < len(data):
                self.data_received(data[e.args[0]:])
                return
        except httptools.HttpParserCallbackError as e:
            self._dead = True
            cause = e.__context__
            if not isinstance(cause, _Stop):
                log.error("HTTP parser callback failed", exc_info=cause)
                self._malformed("internal error")
            elif not self._no_more:
                self._malformed(str(cause))
        except httptools.HttpParserError as e:
            self._dead = True
            self._malformed(str(e) or type(e).__name__)
        if not self._closed:
            self._next()

    # eof_received: not defined, so the transport closes on the client's FIN. Clients do not
    # half-close an HTTP connection, they go away: its handler is cancelled (connection_lost).

    def pause_writing(self) -> None:
        self._write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._flow()

    # -- httptools callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._no_more:
            raise _Stop("closing")
        self._served = True
        self._parsing = Request(self._loop, self._limit)
        self._url = b""
        self._head = self._head_read = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head += len(url)
        if self._head > MAX_HEAD:
            raise _Stop("request head too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head += len(name) + len(value) + 4
        if self._head > MAX_HEAD:
            raise _Stop("request head too large")
        key = _NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
            if len(_NAMES) < 512:
                _NAMES[name] = key
        headers = self._parsing.headers  # type: ignore[union-attr]
        if not dict.__contains__(headers, key):
            dict.__setitem__(headers, key, value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        req = self._parsing
        assert req is not None
        parser = self._parser
        method = parser.get_method()
        req.method = _METHODS.get(method) or method.decode("latin-1")
        req.version = parser.get_http_version()
        req.keep_alive = parser.should_keep_alive()
        req.path, req.query = _target(self._url)
        headers = req.headers
        if req.start_body(dict.get(headers, "content-length"),
                          dict.get(headers, "content-encoding"), self._spare):
            self._spare = None
        self._queue.append(req)

    def on_body(self, body: bytes) -> None:
        req = self._parsing
        if req is not None and req.state == RECEIVING:
            req.feed(body)

    def on_chunk_header(self) -> None:
        """A chunk's size line. Every chunk but the last (size 0) is non-empty, so the
        chunks before this one are all non-empty: more than MAX_CHUNKS of them is Triton's
        400, and, as Triton does, nothing more is read from this client."""
        req = self._parsing
        if req is None:
            return
        req.chunks += 1
        if req.chunks > MAX_CHUNKS + 1:
            self._server.count("chunk_floods")
            if req.state == RECEIVING:
                req.reply = _error(400, CHUNKS_TEXT)
                req.end(BROKEN, CHUNKS_TEXT)
            self._stop_reading = self._no_more = True
            self._parsing = None
            if req.state != RECEIVING and not self._busy and not self._queue:
                self._close()                  # answered already: nothing left to say
            raise _Stop(CHUNKS_TEXT)

    def on_message_complete(self) -> None:
        req = self._parsing
        self._parsing = None
        if req is not None and req.state == RECEIVING:
            req.complete()
        if self._close_after_body:
            self._close()

    # -- answering --------------------------------------------------------------------------
    def _malformed(self, detail: str) -> None:
        """A parse error: no request after this one. A body cut by it fails that request
        (its handler answers 400 and the connection closes); otherwise a 400 takes the
        place of the request that could not be read."""
        self._no_more = True
        self._server.count("malformed")
        req = self._parsing
        self._parsing = None
        if req is not None and req.method:
            if req.state == RECEIVING:
                req.end(BROKEN, detail)
            elif not self._busy and not self._queue:
                self._close()
            return
        bad = Request(self._loop, self._limit)
        bad.bad = detail
        self._queue.append(bad)

    def _next(self) -> None:
        """Start answering if requests wait and no task is at it; pause or resume reading."""
        if not self._busy and self._queue and not self._closed:
            self._busy = True
            self._task = self._loop.create_task(self._serve(self._queue.popleft()))
        self._flow()

    def _flow(self) -> None:
        queue = self._queue
        pause = self._write_paused or self._stop_reading or len(queue) >= MAX_QUEUED or (
            len(queue) > 1 and sum(r.size for r in queue) > MAX_QUEUED_BYTES)
        if pause != self._read_paused and self._transport is not None and not self._closed:
            self._read_paused = pause
            if pause:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    async def _serve(self, req: Request) -> None:
        """Answer ``req``, then every request queued behind it, in order."""
        try:
            while True:
                try:
                    reply = await self._answer(req)
                except Exception:
                    if req.reply is None:
                        raise
                if req.reply is not None:      # the engine's own answer (a limit, a timeout)
                    reply = req.reply
                self._send(req, reply)
                if self._closed:
                    return
                if self._write_paused:
                    self._drain = self._loop.create_future()
                    await self._drain
                    self._drain = None
                if not self._queue:
                    if self._no_more and self._parsing is None:
                        self._close()          # the client is done sending
                    return
                req = self._queue.popleft()
                self._flow()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("HTTP connection failed")
            self._close()
        finally:
            self._busy = False

    async def _answer(self, req: Request) -> Reply:
        if req.reply is not None:              # decided by the engine before its turn
            return req.reply
        if req.bad is not None:
            return Reply(400, error_body(f"malformed HTTP request: {req.bad}"),
                         "application/json", close=True)
        expect = dict.get(req.headers, "expect")
        if expect and req.version == "1.1":    # as aiohttp: nothing to answer on HTTP/1.0
            if expect.lower() != "100-continue":
                return Reply(417, unknown_expect_text(expect).encode(),
                             "text/plain; charset=utf-8", close=True)
            if not self._closed:
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        return await self._handle(req)

    def _send(self, req: Request, reply: Reply) -> None:
        transport = self._transport
        if self._closed or transport is None or transport.is_closing():
            return
        keep = req.keep_alive and not reply.close and not self._server.stopping
        body = reply.body
        n = len(body) if type(body) is not memoryview else body.nbytes
        extra = b""
        if reply.headers:
            extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items()).encode("latin-1")
        if not keep:
            extra += b"Connection: close\r\n"
        elif req.version == "1.0":
            extra += b"Connection: keep-alive\r\n"
        head = b"%sContent-Length: %d\r\n%s%s\r\n" % (
            _prefix(reply.status, reply.content_type), n, extra, _date_line())
        if req.method == "HEAD" or not n:
            transport.write(head)
        elif n <= SMALL_WRITE:
            transport.write(b"".join((head, body)))
        else:
            transport.write(head)
            transport.write(body)
        if req.state == RECEIVING:
            req.end(DONE)                    # answered without its body: drop the rest
        else:
            buf = req.take_body()
            # Reused only when nothing else holds it: no handler, tensor view or message frame.
            if type(buf) is bytearray and SPARE_MIN <= len(buf) <= SPARE_MAX \
                    and sys.getrefcount(buf) == _UNSHARED:
                self._spare = buf
        if not keep:
            self._no_more = True
            self._queue.clear()
            if self._parsing is req and not self._dead:
                self._close_after_body = True  # closing now could reset the connection
            else:                              # before the client reads this answer
                self._close()

    def _close(self) -> None:
        self._no_more = self._dead = True
        self._queue.clear()
        if self._transport is not None and not self._closed:
            self._closed = True
            self._transport.close()

    # -- from the server --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Graceful stop: an idle connection closes now, a busy one after its answer."""
        if not self._busy and not self._queue:
            self._close()

    def tick(self, now: float) -> None:
        """From the server's timer: which phase the connection is in, since when, and
        whether that has lasted past its timeout. A phase is timed from the first tick that
        sees it (a new connection's first head: from the connection), so a timeout fires
        within one check interval after it is due."""
        server = self._server
        req = self._parsing
        if self._closed or (self._write_paused and (self._busy or self._queue)):
            phase: tuple[int, Any] = (_STALL, self._task)   # (closing: our last answer)
        elif req is not None and not self._read_paused:
            phase = (_BODY if req.method else _HEAD, req)
        elif self._busy or self._queue:
            phase = (_ANSWER, None)            # a handler is at work; not the client's time
        elif not self._served:
            phase = (_HEAD, None)              # nothing sent yet on a new connection
        else:
            phase = (_IDLE, None)
            self._spare = None
        if phase != self._phase:
            if self._phase is not None or phase[0] != _HEAD:
                self._since = now              # (a new connection: since connection_made)
            self._phase = phase
        elapsed = now - self._since
        kind = phase[0]
        if kind == _HEAD:
            if 0 < server.header_timeout <= elapsed:
                server.count("header_timeouts")
                if req is None:
                    self._close()
                else:
                    self._cut(req, 408, f"request head not received within "
                              f"{server.header_timeout:g} s (--http-header-timeout-secs)")
        elif kind == _BODY:
            assert req is not None
            if 0 < server.body_timeout and \
                    elapsed >= server.body_timeout + req.size / BODY_MIN_RATE:
                server.count("body_timeouts")
                self._cut(req, 408, f"request body not received within "
                          f"{server.body_timeout:g} s (--http-body-timeout-secs)")
        elif kind == _IDLE:
            if 0 < server.idle_timeout <= elapsed:
                if self._write_paused:         # our last answer is not being read
                    server.count("write_stalls")
                    self.abort()
                else:
                    self._close()
        elif kind == _STALL:
            if 0 < server.idle_timeout <= elapsed:
                server.count("write_stalls")
                self.abort()                   # what we wrote is not being read: drop it

    def _cut(self, req: Request, status: int, text: str) -> None:
        """A request that did not arrive in time: nothing more is read; its answer (or, when
        no handler has it yet, this connection's last answer) is ``status`` and the
        connection closes once it is written."""
        self._stop_reading = self._no_more = self._dead = True
        self._parsing = None
        self._flow()
        if not req.method:                     # an incomplete head: no handler has it
            bad = Request(self._loop, self._limit)
            bad.reply = _error(status, text)
            self._queue.append(bad)
            self._next()
        elif req.state == RECEIVING:
            req.reply = _error(status, text)
            req.end(BROKEN, text)              # the handler waiting for it answers now
        elif not self._busy and not self._queue:
            self._close()                      # answered already: nothing left to say

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._transport is not None:
            self._transport.abort()


class NativeHttpServer:
    """Serves ``handle(request) -> Reply`` on host:port. SO_REUSEPORT lets several frontend
    processes share the port; bodies over ``limit`` bytes are refused (BodyTooLarge).

    The limits (module docstring) come from the arguments, else from ``settings`` (a
    FrontendSettings: --http-header-timeout-secs, --http-body-timeout-secs,
    --http-idle-timeout-secs, --http-max-connections), else the defaults here. A timeout
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
        self.connections: set[_Connection] = set()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.stopping = False
        self.port = 0
        self.refusal = self._refusal()
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
        return _Connection(self)

    async def start(self, host: str, port: int, ssl: SSLContext | None = None) -> None:
        """Listen; with ``ssl`` (tls.server_context) serve HTTPS. A connection is created at
        accept and its first head is timed from then, so the TLS handshake counts against
        the header timeout: asyncio bounds the handshake by it (ssl_handshake_timeout), the
        timer the rest."""
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {}
        if ssl is not None:
            tls = {"ssl": ssl, "ssl_handshake_timeout": self.header_timeout or None}
        self._server = await loop.create_server(self.protocol, host or None, port,
                                                reuse_port=True, backlog=1024, **tls)
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
