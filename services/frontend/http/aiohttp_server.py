"""The HTTP adapter's handlers served by aiohttp's low-level server (--http-impl aiohttp).

Each aiohttp request is adapted to the handlers' request shape (http.message) and each
Reply to an aiohttp response (a StreamReply to a StreamResponse written piece by piece), so
routes, texts and codes are the ones the native server gives. `make_app` wraps the same
dispatch in an aiohttp web.Application (one catch-all route) for callers that want one.

Limits, as the native server applies them where aiohttp lets us: bodies are read as they
arrive (never allocated at their declared size) and checked against --http-max-input-size
declared and actual; --http-body-timeout-secs (the same rule: the timeout plus one second
per BODY_MIN_RATE bytes received; 408 and close); --http-max-connections (503 and close);
--http-idle-timeout-secs (aiohttp's keepalive_timeout). Not here: a header timeout and
Triton's cap on the chunks of a chunked body (aiohttp hands over neither heads in progress
nor chunk boundaries); the native server, the default, has both.
"""
from __future__ import annotations

import asyncio
import errno
from ssl import SSLContext
from typing import Any

from aiohttp import HttpVersion11, web

from services.common.errors import PortTaken, unknown_expect_text
from services.dataplane.api import DataPlaneAPI
from services.frontend.http.json_body import error_body
from services.frontend.http.limits import BODY_MIN_RATE
from services.frontend.http.message import BodyError, BodyTooLarge, Reply, StreamReply
from services.frontend.http.routes import Handlers
from services.frontend.listen import BACKLOG, where
from services.frontend.settings import FrontendSettings

__all__ = ["AioHttp", "make_app", "make_runner", "make_server"]


class _AioRequest:
    """An aiohttp request in the handlers' shape. ``reply``: set when reading the body timed
    out; it replaces the handler's answer."""
    __slots__ = ("_limit", "_request", "_timeout", "headers", "method", "path", "query",
                 "reply")

    def __init__(self, request: web.BaseRequest, limit: int, timeout: float = 0.0) -> None:
        self.method, self.path, self.headers = request.method, request.path, request.headers
        self.query = request.query_string
        self._request, self._limit, self._timeout = request, limit, timeout
        self.reply: Reply | None = None

    @property
    def raw_headers(self) -> Any:
        """The headers as sent (aiohttp's ``headers`` spell the names it knows its way)."""
        return self._request.raw_headers

    async def read(self) -> bytes:
        try:
            return await _read_body(self._request, self._limit,
                                    bool(self.headers.get("Content-Encoding")), self._timeout)
        except _BodyTimeout:
            text = (f"request body not received within {self._timeout:g} s "
                    f"(--http-body-timeout-secs)")
            self.reply = Reply(408, error_body(text), "application/json", close=True)
            raise BodyError(text) from None


class _BodyTimeout(Exception):
    pass


def _web_response(reply: Reply) -> web.Response:
    headers = {"Content-Type": reply.content_type} if reply.content_type else {}
    if reply.headers:
        headers.update(reply.headers)
    resp = web.Response(body=reply.body or None, status=reply.status, headers=headers)
    if reply.close:
        resp.force_close()
    return resp


async def _read_body(request: web.BaseRequest, limit: int, encoded: bool,
                     timeout: float = 0.0) -> bytes:
    """The whole (already decompressed) body, refused past `limit` bytes (BodyTooLarge).

    aiohttp decompresses gzip/deflate bodies while streaming them, so the limit applies to
    the decompressed size, as in Triton. aiohttp's own check (client_max_size) would answer
    413 with a text body; Triton answers 400 with a JSON error, so we count here. A
    Content-Length over the limit is refused before anything is read. One chunk -> returned
    as is; several -> one join. `encoded`: the request has a Content-Encoding. `timeout`
    (> 0): the body must have arrived within it, plus a second per BODY_MIN_RATE bytes
    (_BodyTimeout)."""
    declared = request.content_length
    if declared is not None and not encoded:
        if declared > limit:
            raise BodyTooLarge(declared)
        if declared == 0:
            return b""
    content = request.content
    if declared is None or declared > 65536:
        set_chunk = getattr(content, "set_read_chunk_size", None)
        if set_chunk is not None:
            set_chunk(min(limit, declared or limit))  # fewer pause/resume cycles, big bodies
    try:
        if timeout > 0:
            return await _read_chunks_timed(content, declared, encoded, limit, timeout)
        return await _read_chunks(content, declared, encoded, limit)
    except web.RequestPayloadError as e:
        detail = str(e).strip().splitlines()[-1].strip()  # "400, message:\n  <text>"
        raise BodyError(detail) from None


async def _read_chunks(content: Any, declared: int | None, encoded: bool,
                       limit: int) -> bytes:
    first = await content.readany()
    if (declared is not None and not encoded and len(first) == declared) or not first:
        return first
    parts, total = [first], len(first)
    while True:
        if total > limit:
            raise BodyTooLarge(None if encoded or declared is None else declared)
        chunk = await content.readany()
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)


async def _read_chunks_timed(content: Any, declared: int | None, encoded: bool, limit: int,
                             timeout: float) -> bytes:
    """_read_chunks under the body timeout. A body that has all arrived is read as
    _read_chunks reads it, with no timer at all."""
    if content.is_eof():
        return await _read_chunks(content, declared, encoded, limit)
    loop = asyncio.get_running_loop()
    start = loop.time()
    parts: list[bytes] = []
    total = 0
    while True:
        if total > limit:
            raise BodyTooLarge(None if encoded or declared is None else declared)
        try:
            async with asyncio.timeout_at(start + timeout + total / BODY_MIN_RATE):
                chunk = await content.readany()
        except TimeoutError:
            raise _BodyTimeout() from None
        if not chunk:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        parts.append(chunk)
        total += len(chunk)


async def _respond(request: web.BaseRequest, req: _AioRequest, reply: Reply,
                   streams: dict[Any, asyncio.Task] | None = None) -> web.StreamResponse:
    """The aiohttp response for a handler's ``reply`` (``req.reply``, an answer of this
    server's own, wins). A StreamReply's pieces are written as they come (chunked on
    HTTP/1.1; ``write`` waits while the client is not reading). ``streams``: the
    _Server's connection -> streaming task, so a client that leaves mid-stream cancels it
    at once (without it, the next write finds the connection gone)."""
    if req.reply is not None:
        if isinstance(reply, StreamReply):
            await reply.chunks.aclose()
        return await _cut(request, req.reply)
    if not isinstance(reply, StreamReply):
        return _web_response(reply)
    chunks = reply.chunks
    protocol = request.protocol
    try:
        headers = {"Content-Type": reply.content_type} if reply.content_type else {}
        if reply.headers:
            headers.update(reply.headers)
        resp = web.StreamResponse(status=reply.status, headers=headers)
        if streams is not None:
            streams[protocol] = asyncio.current_task()  # type: ignore[assignment]
        await resp.prepare(request)
        async for piece in chunks:
            if piece:
                await resp.write(piece)
        await resp.write_eof()
        return resp
    finally:
        if streams is not None:
            streams.pop(protocol, None)
        await chunks.aclose()


async def _cut(request: web.BaseRequest, reply: Reply) -> web.StreamResponse:
    """Answer ``reply`` and close at once: aiohttp would otherwise go on reading the body
    that did not come in time (its lingering close) before it closes."""
    resp = _web_response(reply)
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


async def _expect(request: web.BaseRequest) -> None:
    """aiohttp's default expect handler, as web.Application runs it before a route's
    handler: "100-continue" answers 100 Continue on HTTP/1.1, anything else 417."""
    expect = request.headers.get("Expect", "")
    if request.version == HttpVersion11:
        if expect.lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the response itself is still to come
        else:
            raise web.HTTPExpectationFailed(text=unknown_expect_text(expect))
    await request.writer.drain()


def make_app(dp: DataPlaneAPI, settings: FrontendSettings) -> web.Application:
    """The aiohttp application serving Triton's HTTP API over `dp` (start_http serves the
    same handlers through make_server, without the Application's per-request routing)."""
    handlers, limit = Handlers(dp, settings), settings.http_max_input_size
    timeout = settings.http_body_timeout_secs

    async def route(request: web.Request) -> web.StreamResponse:
        req = _AioRequest(request, limit, timeout)
        return await _respond(request, req, await handlers.dispatch(req))

    app = web.Application(client_max_size=limit)
    app.router.add_route("*", "/{tail:.*}", route)
    return app


def make_server(dp: DataPlaneAPI, settings: FrontendSettings) -> web.Server:
    """aiohttp's low-level server over `dp` (call it on the running loop): every request
    goes straight to our dispatch, skipping web.Application's router, match info and
    Request object, after what web.Application does for a route (answer an Expect
    header). No access log (it costs per request); debug as web.Application derives it
    (the loop's), so aiohttp's own error pages stay the same."""
    handlers, limit = Handlers(dp, settings), settings.http_max_input_size
    timeout = settings.http_body_timeout_secs

    async def serve(request: web.BaseRequest) -> web.StreamResponse:
        if request.headers.get("Expect"):
            await _expect(request)
        req = _AioRequest(request, limit, timeout)
        return await _respond(request, req, await handlers.dispatch(req), server.streams)

    server = _Server(serve, settings.http_max_connections, access_log=None,
                     debug=asyncio.get_running_loop().get_debug(),
                     keepalive_timeout=settings.http_idle_timeout_secs)
    return server


class _Server(web.Server):
    """aiohttp's low-level server with --http-max-connections: past the cap, a connection
    is answered 503 and closed, as the native server does. And a streamed answer's task is
    cancelled when its client goes away, as the native server does (aiohttp cancels no
    handler by default: a stream waiting for its next piece would go on unseen)."""

    def __init__(self, handler: Any, max_connections: int, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections
        self.refused = 0
        self.streams: dict[Any, asyncio.Task] = {}   # connection -> task streaming to it
        body = error_body(f"Service Unavailable: this server is at its limit of "
                          f"{max_connections} connections (--http-max-connections)")
        self._refusal = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json"
                         b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                         % (len(body), body))

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        if 0 < self.max_connections <= len(self._connections):
            self.refused += 1
            transport.write(self._refusal)
            transport.close()
            return
        super().connection_made(handler, transport)

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        task = self.streams.pop(handler, None)
        if task is not None:
            task.cancel()
        super().connection_lost(handler, exc)


def make_runner(dp: DataPlaneAPI, settings: FrontendSettings) -> web.BaseRunner:
    """The runner start_http serves for --http-impl aiohttp (set up and add sites to use
    it)."""
    return web.ServerRunner(make_server(dp, settings), handle_signals=False)


class AioHttp:
    """What start_http returns for --http-impl aiohttp."""

    def __init__(self, dp: DataPlaneAPI, settings: FrontendSettings) -> None:
        self._runner = make_runner(dp, settings)

    @property
    def port(self) -> int:
        return self._runner.addresses[0][1]

    async def start(self, host: str, port: int, ssl: SSLContext | None = None, *,
                    fd: int = -1, reuse_port: bool = False) -> None:
        """Listen (listen.py); with ``ssl`` (tls.server_context) serve HTTPS (the TLS
        handshake has asyncio's default bound, 60 s: TCPSite passes no
        ssl_handshake_timeout)."""
        await self._runner.setup()
        at = where(host, port, fd, reuse_port)
        site = (web.SockSite(self._runner, at["sock"], ssl_context=ssl, backlog=BACKLOG)
                if "sock" in at else web.TCPSite(self._runner, host, port, ssl_context=ssl,
                                                 reuse_port=reuse_port, backlog=BACKLOG))
        try:
            await site.start()
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortTaken("HTTP", host, port) from None
            raise

    async def stop(self, grace: float = 60.0) -> None:
        await self._runner.cleanup()   # waits for requests in flight (its shutdown_timeout)
