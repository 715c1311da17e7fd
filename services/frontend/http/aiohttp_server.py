"""The HTTP adapter's handlers served by aiohttp's low-level server (--http-impl aiohttp).

Each aiohttp request is adapted to the handlers' request shape (http.message) and each
Reply to an aiohttp response, so routes, texts and codes are the ones the native server
gives. `make_app` wraps the same dispatch in an aiohttp web.Application (one catch-all
route) for callers that want one.
"""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import HttpVersion11, web

from services.common.errors import unknown_expect_text
from services.dataplane.api import DataPlaneAPI
from services.frontend.http.message import BodyError, BodyTooLarge, Reply
from services.frontend.http.routes import Handlers
from services.frontend.settings import FrontendSettings

__all__ = ["AioHttp", "make_app", "make_runner", "make_server"]


class _AioRequest:
    """An aiohttp request in the handlers' shape."""
    __slots__ = ("_limit", "_request", "headers", "method", "path", "query")

    def __init__(self, request: web.BaseRequest, limit: int) -> None:
        self.method, self.path, self.headers = request.method, request.path, request.headers
        self.query = request.query_string
        self._request, self._limit = request, limit

    async def read(self) -> bytes:
        return await _read_body(self._request, self._limit,
                                bool(self.headers.get("Content-Encoding")))


def _web_response(reply: Reply) -> web.Response:
    headers = {"Content-Type": reply.content_type} if reply.content_type else {}
    if reply.headers:
        headers.update(reply.headers)
    resp = web.Response(body=reply.body or None, status=reply.status, headers=headers)
    if reply.close:
        resp.force_close()
    return resp


async def _read_body(request: web.BaseRequest, limit: int, encoded: bool) -> bytes:
    """The whole (already decompressed) body, refused past `limit` bytes (BodyTooLarge).

    aiohttp decompresses gzip/deflate bodies while streaming them, so the limit applies to
    the decompressed size, as in Triton. aiohttp's own check (client_max_size) would answer
    413 with a text body; Triton answers 400 with a JSON error, so we count here. A
    Content-Length over the limit is refused before anything is read. One chunk -> returned
    as is; several -> one join. `encoded`: the request has a Content-Encoding."""
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

    async def route(request: web.Request) -> web.Response:
        return _web_response(await handlers.dispatch(_AioRequest(request, limit)))

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

    async def serve(request: web.BaseRequest) -> web.StreamResponse:
        if request.headers.get("Expect"):
            await _expect(request)
        return _web_response(await handlers.dispatch(_AioRequest(request, limit)))

    return web.Server(serve, access_log=None, debug=asyncio.get_running_loop().get_debug())


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

    async def start(self, host: str, port: int) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_port=True, backlog=1024).start()

    async def stop(self, grace: float = 60.0) -> None:
        await self._runner.cleanup()   # waits for requests in flight (its shutdown_timeout)
