"""The HTTP adapter: Triton's HTTP/REST API (KServe v2 + Triton extensions) over aiohttp.

Thin by design: each handler reads the request, converts it with http_codec into the
internal types, calls the one data plane object (`dp`) and converts the answer back. No
model logic here. Routing follows Triton's src/http_server.cc (HTTPAPIServer::Handle and
its regexes); the error -> HTTP status mapping is the one table below.

Our own dispatch behind aiohttp's low-level server (no aiohttp router or Application
object per request): the exact paths are a dict lookup, model paths one precompiled regex,
and unknown paths / wrong methods answer Triton's JSON bodies {"error": "Not Found"} (404)
and {"error": "Method Not Allowed"} (405). `make_app` wraps the same dispatch in a
web.Application (one catch-all route) for callers that want one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from aiohttp import HttpVersion11, web

from ..common.errors import Code, TriremeError, invalid_arg
from . import http_codec as codec
from . import stats_codec
from .settings import FrontendSettings

__all__ = ["make_app", "make_server", "make_runner", "start_http", "http_status"]

log = logging.getLogger(__name__)

# The one table: error code -> HTTP status (Triton's HttpCodeFromError).
_HTTP_STATUS = {
    Code.INTERNAL: 500,
    Code.NOT_FOUND: 404,
    Code.UNAVAILABLE: 503,
    Code.UNSUPPORTED: 501,
    Code.INVALID_ARG: 400,
    Code.ALREADY_EXISTS: 400,
    Code.CANCELLED: 400,
    Code.UNKNOWN: 400,
}


def http_status(code: Code) -> int:
    return _HTTP_STATUS.get(code, 400)


_JSON = "application/json"
_BINARY = "application/octet-stream"
_HEADER_LENGTH = "Inference-Header-Content-Length"

# Triton's routing regexes (FullMatch); "/v2/models/stats" is an exact path, matched first.
# Kinds without a handler yet answer 404: model generate / generate_stream / trace/setting,
# /v2/logging, /v2/trace/setting, /v2/systemsharedmemory/..., /v2/cudasharedmemory/...
_MODEL_RE = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?"
                       r"(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?")
_REPOSITORY_RE = re.compile(r"/v2/repository(?:/([^/]+))?/(index|models/([^/]+)/(load|unload))")


def _json_response(payload: bytes, status: int = 200) -> web.Response:
    return web.Response(body=payload, status=status, headers={"Content-Type": _JSON})


def _error_response(status: int, message: str, headers: dict | None = None) -> web.Response:
    hdrs = {"Content-Type": _JSON}
    if headers:
        hdrs.update(headers)
    return web.Response(body=codec.error_body(message), status=status, headers=hdrs)


def _not_allowed() -> web.Response:
    return _error_response(405, "Method Not Allowed")


def _not_found() -> web.Response:
    return _error_response(404, "Not Found")


class _BrokenBody(Exception):
    """The body could not be read (bad gzip/deflate data, broken chunking): 400, and the
    connection closes since the rest of the body cannot be skipped."""


async def _read_body(request: web.BaseRequest, limit: int, kind: str,
                     encoded: bool) -> bytes:
    """The whole (already decompressed) body, refused past `limit` bytes.

    aiohttp decompresses gzip/deflate bodies while streaming them, so the limit applies to
    the decompressed size, as in Triton. aiohttp's own check (client_max_size) would answer
    413 with a text body; Triton answers 400 with a JSON error, so we count here and raise
    INVALID_ARG (-> 400) with Triton's wording. A Content-Length over the limit is refused
    before anything is read. One chunk -> returned as is; several -> one join. `encoded`:
    the request has a Content-Encoding."""
    declared = request.content_length
    if declared is not None and not encoded:
        if declared > limit:
            raise invalid_arg(codec.size_limit_message(kind, declared, limit))
        if declared == 0:
            return b""
    content = request.content
    if declared is None or declared > 65536:
        set_chunk = getattr(content, "set_read_chunk_size", None)
        if set_chunk is not None:
            set_chunk(min(limit, declared or limit))  # fewer pause/resume cycles, big bodies
    try:
        return await _read_chunks(content, declared, encoded, limit, kind)
    except web.RequestPayloadError as e:
        detail = str(e).strip().splitlines()[-1].strip()  # "400, message:\n  <text>"
        raise _BrokenBody(f"failed to read the request body: {detail}") from None


async def _read_chunks(content: Any, declared: int | None, encoded: bool, limit: int,
                       kind: str) -> bytes:
    first = await content.readany()
    if (declared is not None and not encoded and len(first) == declared) or not first:
        return first
    parts, total = [first], len(first)
    while True:
        if total > limit:
            raise invalid_arg(codec.size_limit_message(
                kind, None if encoded or declared is None else declared, limit))
        chunk = await content.readany()
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)
        total += len(chunk)


def _version(v: str | None) -> str:
    return str(int(v)) if v else ""  # Triton parses the version as int64: "01" is 1


class _Handlers:
    """Route table and handlers; holds the data plane and the settings."""

    def __init__(self, dp: Any, settings: FrontendSettings) -> None:
        self.dp = dp
        self.limit = settings.http_max_input_size
        self._exact = {
            "/v2": self.server_metadata,
            "/v2/health/live": self.health_live,
            "/v2/health/ready": self.health_ready,
            "/v2/models/stats": self.all_model_stats,
        }
        self._model_kinds = {
            "": self.model_metadata,
            "ready": self.model_ready,
            "config": self.model_config,
            "stats": self.model_stats,
            "infer": self.infer,
        }

    async def serve(self, request: web.BaseRequest) -> web.StreamResponse:
        """The low-level server's handler: first what web.Application does for a route
        (answer an Expect header), then our dispatch."""
        if request.headers.get("Expect"):
            await _expect(request)
        return await self.dispatch(request)

    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        try:
            if path.endswith("/infer") and path.startswith("/v2/models/"):
                model = path[11:-6]
                if model and "/" not in model:  # _MODEL_RE's unversioned infer, no regex
                    return await self.infer(request, model, "")
            handler = self._exact.get(path)
            if handler is not None:
                return await handler(request)
            if path.startswith("/v2/models/"):
                m = _MODEL_RE.fullmatch(path)
                if m is not None:
                    handler = self._model_kinds.get(m.group(3) or "")
                    if handler is not None:
                        return await handler(request, m.group(1), _version(m.group(2)))
            elif path.startswith("/v2/repository/"):
                m = _REPOSITORY_RE.fullmatch(path)
                if m is not None:
                    return await self.repository(request, m.group(1), m.group(3),
                                                 m.group(4))
            return _not_found()
        except TriremeError as e:
            return _error_response(http_status(e.code), e.message)
        except _BrokenBody as e:
            resp = _error_response(400, str(e))
            resp.force_close()
            return resp
        except Exception as e:  # noqa: BLE001 - one final answer for every request
            log.exception("HTTP %s %s failed", request.method, path)
            return _error_response(500, f"internal error: {type(e).__name__}: {e}")

    # ---- health and metadata ------------------------------------------------------------
    async def health_live(self, request: web.BaseRequest) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        return web.Response(status=200 if self.dp.live() else 400)

    async def health_ready(self, request: web.BaseRequest) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        return web.Response(status=200 if self.dp.ready() else 400)

    async def server_metadata(self, request: web.BaseRequest) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        return _json_response(codec.encode_json(self.dp.server_metadata()))

    async def model_metadata(self, request: web.BaseRequest, model: str,
                             version: str) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        return _json_response(codec.encode_json(await self.dp.model_metadata(model, version)))

    async def model_ready(self, request: web.BaseRequest, model: str,
                          version: str) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        if await self.dp.model_ready(model, version):
            return web.Response(status=200)
        return _error_response(400, "Model version not ready")  # Triton's HandleModelReady

    async def model_config(self, request: web.BaseRequest, model: str,
                           version: str) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        return _json_response(codec.encode_json(await self.dp.model_config(model, version)))

    # ---- statistics -------------------------------------------------------------------
    async def all_model_stats(self, request: web.BaseRequest) -> web.Response:
        return await self.model_stats(request, "", "")

    async def model_stats(self, request: web.BaseRequest, model: str,
                          version: str) -> web.Response:
        if request.method != "GET":
            return _not_allowed()
        stats = await self.dp.statistics(model, version)
        return _json_response(codec.encode_json(stats_codec.stats_to_json(stats)))

    # ---- model repository ---------------------------------------------------------------
    async def repository(self, request: web.BaseRequest, repo: str | None, model: str | None,
                         action: str | None) -> web.Response:
        if request.method != "POST":
            return _not_allowed()
        body = await _read_body(request, self.limit, "Request JSON",
                                bool(request.headers.get("Content-Encoding")))
        if model is None:  # index; Triton ignores a repository name here
            ready_only = codec.decode_index_request(body)
            return _json_response(codec.encode_json(await self.dp.repository_index(ready_only)))
        if repo:
            raise TriremeError(Code.UNSUPPORTED,
                               "'repository_name' specification is not supported")
        if action == "load":
            await self.dp.load_model(model, codec.decode_load_request(body))
        else:
            await self.dp.unload_model(model, codec.decode_unload_request(body))
        return web.Response(status=200, headers={"Content-Type": _JSON})

    # ---- inference ----------------------------------------------------------------------
    async def infer(self, request: web.BaseRequest, model: str, version: str) -> web.Response:
        if request.method != "POST":
            return _not_allowed()
        headers = request.headers
        encoding = headers.get("Content-Encoding")
        if encoding and encoding.strip().lower() not in ("identity", "gzip", "deflate"):
            # Triton's DecompressBuffer: UNSUPPORTED, and it advertises what it accepts.
            return _error_response(http_status(Code.UNSUPPORTED),
                                   "Unsupported compression type",
                                   {"Accept-Encoding": "gzip, deflate"})
        header_text = headers.get(_HEADER_LENGTH)
        raw = header_text is not None and header_text.strip() == "0"
        kind = ("Raw request" if raw else "Request JSON" if header_text is None
                else "Request")
        body = await _read_body(request, self.limit, kind, bool(encoding))
        header_length = codec.parse_header_length(header_text, len(body))
        if header_length == 0:  # raw binary: the body is the model's one input
            config = await self.dp.model_config(model, version)
            req = codec.decode_raw_request(model, version, body, config)
            binary_default = True
        else:
            req, binary_default = codec.decode_infer_request(model, version, body,
                                                             header_length)
        resp = await self.dp.infer(req)
        try:
            payload, json_length = codec.encode_infer_response(resp, req, binary_default)
        finally:
            self.dp.release(resp)  # the body is built: outputs are no longer referenced
        if json_length is None:
            out = {"Content-Type": _JSON}
        else:
            out = {"Content-Type": _BINARY, _HEADER_LENGTH: str(json_length)}
        accept = headers.get("Accept-Encoding")
        if accept:
            chosen = codec.response_encoding(accept)
            if chosen is not None:
                payload = codec.compress(payload, chosen)
                out["Content-Encoding"] = chosen
        return web.Response(body=payload, status=200, headers=out)


async def _expect(request: web.BaseRequest) -> None:
    """aiohttp's default expect handler, as web.Application runs it before a route's
    handler: "100-continue" answers 100 Continue on HTTP/1.1, anything else 417."""
    expect = request.headers.get("Expect", "")
    if request.version == HttpVersion11:
        if expect.lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the response itself is still to come
        else:
            raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    await request.writer.drain()


def make_app(dp: Any, settings: FrontendSettings) -> web.Application:
    """The aiohttp application serving Triton's HTTP API over `dp` (start_http serves the
    same handlers through make_server, without the Application's per-request routing)."""
    handlers = _Handlers(dp, settings)
    app = web.Application(client_max_size=settings.http_max_input_size)
    app.router.add_route("*", "/{tail:.*}", handlers.dispatch)
    return app


def make_server(dp: Any, settings: FrontendSettings) -> web.Server:
    """aiohttp's low-level server over `dp` (call it on the running loop): every request
    goes straight to our dispatch, skipping web.Application's router, match info and
    Request object. No access log (it costs per request); debug as web.Application
    derives it (the loop's), so aiohttp's own error pages stay the same."""
    handlers = _Handlers(dp, settings)
    return web.Server(handlers.serve, access_log=None,
                      debug=asyncio.get_running_loop().get_debug())


def make_runner(dp: Any, settings: FrontendSettings) -> web.BaseRunner:
    """The runner start_http serves (set up and add sites to use it)."""
    return web.ServerRunner(make_server(dp, settings), handle_signals=False)


async def start_http(dp: Any, settings: FrontendSettings) -> web.BaseRunner:
    """Serve on settings.host:settings.http_port. SO_REUSEPORT lets several frontend
    processes share the port."""
    runner = make_runner(dp, settings)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.http_port, reuse_port=True,
                       backlog=1024)
    await site.start()
    return runner
