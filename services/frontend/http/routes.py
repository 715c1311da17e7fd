"""The HTTP adapter: Triton's HTTP/REST API (KServe v2 + Triton extensions).

Thin by design: each handler reads the request, converts it with http/codec.py into the
internal types, calls the one data plane object (`dp`) and converts the answer back. No
model logic here. Routing follows Triton's src/http_server.cc (HTTPAPIServer::Handle and
its regexes); the error -> HTTP status mapping is the one table below.

Handlers see a small request shape (method, path, query, case-insensitive headers,
`await read()` for the whole decompressed body; see http/message.py) and answer a Reply. Two
servers carry them: the native HTTP/1.1 server (http/engine.py, the default) and aiohttp's low-level
server (--http-impl aiohttp), each adapting its own request and response objects, so
routes, texts and codes are the same on both.

Our own dispatch: the exact paths are a dict lookup, model paths one precompiled regex,
and unknown paths / wrong methods answer Triton's JSON bodies {"error": "Not Found"} (404)
and {"error": "Method Not Allowed"} (405). aiohttp_server carries the same dispatch over
aiohttp (--http-impl aiohttp).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from ssl import SSLContext
from typing import Any

from services.common.errors import REPOSITORY_NAME_UNSUPPORTED, Code, TriremeError, invalid_arg, unsupported
from services.dataplane.api import DataPlaneAPI
from services.frontend import forward, stats_codec, tls
from services.frontend.http import codec, json_body, orca
from services.frontend.http.generate import Generate
from services.frontend.http.logging_routes import LOGGING_PATH, LoggingRoute
from services.frontend.http.message import BodyError, BodyTooLarge, Reply
from services.frontend.http.shm_routes import SHM_PREFIXES, SHM_RE, SharedMemoryRoutes
from services.frontend.http.trace_routes import TRACE_PATH, TraceRoutes
from services.frontend.restricted import Restriction, http_group, http_refusal_text
from services.frontend.settings import FrontendSettings

__all__ = ["Handlers", "http_status", "start_http"]

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
# The shared-memory paths: http/shm_routes.py (SHM_RE); /v2/logging:
# http/logging_routes.py; /v2/trace/setting and model trace/setting: http/trace_routes.py.
_MODEL_RE = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?"
                       r"(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?")
_REPOSITORY_RE = re.compile(r"/v2/repository(?:/([^/]+))?/(index|models/([^/]+)/(load|unload))")


def _json_reply(payload: bytes, status: int = 200) -> Reply:
    return Reply(status, payload, _JSON)


def _error_reply(status: int, message: str, headers: dict | None = None) -> Reply:
    return Reply(status, json_body.error_body(message), _JSON, headers)


def _refusal(restriction: Restriction) -> Reply:
    """Triton's RespondIfRestricted: 403 Forbidden and its JSON error."""
    return _error_reply(403, http_refusal_text(restriction.header))


# Replies are never changed once built: the fixed ones are shared.
_NOT_ALLOWED = _error_reply(405, "Method Not Allowed")
_NOT_FOUND = _error_reply(404, "Not Found")
_OK = Reply(200)
_NOT_LIVE = Reply(400)
# --http-health-body json: the Open Inference Protocol's bodies, with Triton's statuses
_JSON_HEALTH = {(kind, state): Reply(200 if state else 400, json_body.encode_json({kind: state}),
                                     _JSON) for kind in ("live", "ready") for state in (True, False)}


def _with_headers(reply: Reply, headers: dict[str, str] | None) -> Reply:
    if headers:
        reply.headers = {**(reply.headers or {}), **headers}
    return reply


def _sent_headers(request: Any) -> Any:
    """(name, value) of every header as sent: ``raw_headers`` (the native server keeps them
    while --http-header-forward-pattern is given; aiohttp always has them)."""
    raw = getattr(request, "raw_headers", None)
    if raw is None:
        return request.headers.items()
    return [(k.decode("latin-1"), v.decode("utf-8", "replace")) for k, v in raw]


def _version(v: str | None) -> str:
    return str(int(v)) if v else ""  # Triton parses the version as int64: "01" is 1


class Handlers:
    """Route table and handlers; holds the data plane and the settings.

    ``dispatch(request)`` answers one request. It is chosen once, here: the plain router, or
    with --http-restricted-api the router behind the restriction check, so an unrestricted
    server pays nothing for the feature."""

    dispatch: Callable[[Any], Awaitable[Reply]]

    def __init__(self, dp: DataPlaneAPI, settings: FrontendSettings) -> None:
        self.dp = dp
        self.limit = settings.http_max_input_size
        self._forward = forward.maybe(settings.http_header_forward_pattern)
        self._metadata = json_body.encode_json(settings.server_metadata())
        self._json_health = settings.http_health_body == "json"
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
            "generate": self.generate,
            "generate_stream": self.generate_stream,
        }
        self._generate = Generate(dp, self._body)
        self._shm = SharedMemoryRoutes(dp, self.limit)
        self._exact[LOGGING_PATH] = LoggingRoute(dp, self.limit).handle
        trace = TraceRoutes(dp, self.limit)   # the trace extension, and infer traced
        self._exact[TRACE_PATH] = trace.handle
        self._model_kinds["trace/setting"] = trace.handle_model
        self.infer = self._model_kinds["infer"] = trace.traced(self.infer)  # type: ignore[method-assign]
        for kind, stream in (("generate", False), ("generate_stream", True)):
            self._model_kinds[kind] = trace.traced_generate(self._model_kinds[kind], stream)
        restricted = settings.restricted.http
        if restricted:
            # group -> (header, value, the 403 Triton answers without them), built once
            self._restricted = {group: (r.header, r.value, _refusal(r))
                                for group, r in restricted.items()}
            self.dispatch = self._restricted_route
        else:
            self.dispatch = self._route

    async def _restricted_route(self, request: Any) -> Reply:
        """Triton's RETURN_AND_RESPOND_IF_RESTRICTED, which opens every Handle* method: a
        request for a restricted group without the header, or with another value, is
        answered 403 before its method, its body or anything else is looked at (the unread
        body is dropped). The header's name is matched in any case, its value exactly; a
        repeated header counts by its first value (libevhtp's evhtp_kv_find)."""
        group = http_group(request.path)
        if group is not None:
            rule = self._restricted.get(group)
            if rule is not None and request.headers.get(rule[0]) != rule[1]:
                return rule[2]
        return await self._route(request)

    async def _route(self, request: Any) -> Reply:
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
                    model_handler = self._model_kinds.get(m.group(3) or "")
                    if model_handler is not None:
                        return await model_handler(request, m.group(1), _version(m.group(2)))
            elif path.startswith("/v2/repository/"):
                m = _REPOSITORY_RE.fullmatch(path)
                if m is not None:
                    return await self.repository(request, m.group(1), m.group(3),
                                                 m.group(4))
            elif path.startswith(SHM_PREFIXES):
                m = SHM_RE.fullmatch(path)
                if m is not None:
                    return await self._shm.handle(request, m.group(1), m.group(2), m.group(3))
            return _NOT_FOUND
        except TriremeError as e:
            return _error_reply(http_status(e.code), e.message)
        except BodyError as e:
            # The rest of the body cannot be skipped: 400, and the connection closes.
            return Reply(400, json_body.error_body(f"failed to read the request body: {e}"),
                         _JSON, close=True)
        except Exception as e:
            log.exception("HTTP %s %s failed", request.method, path)
            return _error_reply(500, f"internal error: {type(e).__name__}: {e}")

    async def _body(self, request: Any, kind: str) -> Any:
        """The whole (decompressed) body; over --http-max-input-size: Triton's 400 text.
        `kind` names the body in that text ("request JSON", "raw request", "request",
        "decompressed")."""
        try:
            return await request.read()
        except BodyTooLarge as e:
            raise invalid_arg(json_body.size_limit_message(kind, e.size, self.limit)) from None

    # ---- health and metadata ------------------------------------------------------------
    async def health_live(self, request: Any) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        return self._health("live", self.dp.live())

    async def health_ready(self, request: Any) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        return self._health("ready", self.dp.ready())

    def _health(self, kind: str, state: bool) -> Reply:
        """Triton's answer: 200 or 400 and no body (its QA scripts compare curl's output
        with "200"); with --http-health-body json, {"live": true} and so on."""
        if self._json_health:
            return _JSON_HEALTH[(kind, state)]
        return _OK if state else _NOT_LIVE

    async def server_metadata(self, request: Any) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        return _json_reply(self._metadata)

    async def model_metadata(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        return _json_reply(json_body.encode_json(await self.dp.model_metadata(model, version)))

    async def model_ready(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        if await self.dp.model_ready(model, version):
            if self._json_health:
                return _json_reply(json_body.encode_json({"name": model, "ready": True}))
            return _OK
        return _error_reply(400, "Model version not ready")  # Triton's HandleModelReady

    async def model_config(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        return _json_reply(json_body.encode_json(await self.dp.model_config(model, version)))

    # ---- statistics -------------------------------------------------------------------
    async def all_model_stats(self, request: Any) -> Reply:
        return await self.model_stats(request, "", "")

    async def model_stats(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "GET":
            return _NOT_ALLOWED
        stats = await self.dp.statistics(model, version)
        return _json_reply(json_body.encode_json(stats_codec.stats_to_json(stats)))

    # ---- model repository ---------------------------------------------------------------
    async def repository(self, request: Any, repo: str | None, model: str | None,
                         action: str | None) -> Reply:
        if request.method != "POST":
            return _NOT_ALLOWED
        body = await self._body(request, "request JSON")
        if model is None:  # index; Triton ignores a repository name here
            ready_only = json_body.decode_index_request(body)
            return _json_reply(json_body.encode_json(await self.dp.repository_index(ready_only)))
        if repo:
            raise unsupported(REPOSITORY_NAME_UNSUPPORTED)
        if action == "load":
            await self.dp.load_model(model, json_body.decode_load_request(body))
        else:
            await self.dp.unload_model(model, json_body.decode_unload_request(body))
        return Reply(200, b"", _JSON)

    # ---- inference ----------------------------------------------------------------------
    async def infer(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "POST":
            return _NOT_ALLOWED
        headers = request.headers
        encoding = headers.get("Content-Encoding")
        if encoding and encoding.strip().lower() not in ("identity", "gzip", "deflate"):
            # Triton's DecompressBuffer: UNSUPPORTED, and it advertises what it accepts.
            return _error_reply(http_status(Code.UNSUPPORTED), "Unsupported compression type",
                                {"Accept-Encoding": "gzip, deflate"})
        header_text = headers.get(_HEADER_LENGTH)
        raw = header_text is not None and header_text.strip() == "0"
        kind = ("decompressed" if encoding and encoding.strip().lower() != "identity"
                else "raw request" if raw else "request JSON" if header_text is None
                else "request")
        body = await self._body(request, kind)
        header_length = codec.parse_header_length(header_text, len(body))
        if header_length == 0:  # raw binary: the body is the model's one input
            config = await self.dp.model_config(model, version)
            req = codec.decode_raw_request(model, version, body, config)
            binary_default = True
        else:
            req, binary_default = codec.decode_infer_request(model, version, body,
                                                             header_length)
        if self._forward is not None:   # (after the body, as Triton's ForwardHeaders)
            self._forward.apply(req.parameters, _sent_headers(request))
        resp = await self.dp.infer(req)
        try:
            payload, json_length = codec.encode_infer_response(resp, req, binary_default)
        finally:
            self.dp.release(resp)  # the body is built: outputs are no longer referenced
        if json_length is None:
            content_type, out = _JSON, None
        else:
            content_type, out = _BINARY, {_HEADER_LENGTH: str(json_length)}
        accept = headers.get("Accept-Encoding")
        if accept:
            chosen = codec.response_encoding(accept)
            if chosen is not None:
                payload = codec.compress(payload, chosen)
                out = {**(out or {}), "Content-Encoding": chosen}
        return Reply(200, payload, content_type, out)

    # ---- generate extension (the codec and both answers: http/generate.py) -------------
    async def generate(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "POST":
            return _NOT_ALLOWED
        report = await orca.load_report(self.dp, request)
        return _with_headers(await self._generate.generate(request, model, version), report)

    async def generate_stream(self, request: Any, model: str, version: str) -> Reply:
        if request.method != "POST":
            return _NOT_ALLOWED
        report = await orca.load_report(self.dp, request)
        return _with_headers(await self._generate.generate_stream(request, model, version),
                             report)


# ---- the native server (the default) ----------------------------------------------------

class _NativeHttp:
    """What start_http returns for --http-impl native."""

    def __init__(self, dp: DataPlaneAPI, settings: FrontendSettings) -> None:
        from services.frontend.http.engine import NativeHttpServer
        self._server = NativeHttpServer(Handlers(dp, settings).dispatch,
                                        settings.http_max_input_size, settings=settings)

    @property
    def port(self) -> int:
        return self._server.port

    async def start(self, host: str, port: int, ssl: SSLContext | None = None, *,
                    fd: int = -1, reuse_port: bool = False) -> None:
        await self._server.start(host, port, ssl, fd=fd, reuse_port=reuse_port)

    async def stop(self, grace: float = 60.0) -> None:
        await self._server.stop(grace)


async def start_http(dp: DataPlaneAPI, settings: FrontendSettings) -> Any:
    """Serve on settings.host:settings.http_port, or the socket `trireme serve` handed
    down (listen.py), with the server settings.http_impl names ("native" or "aiohttp");
    returns it (`.port`: the bound port, `await .stop(grace)`)."""
    if settings.http_impl == "native":
        server: Any = _NativeHttp(dp, settings)
    else:
        from services.frontend.http.aiohttp_server import AioHttp
        server = AioHttp(dp, settings)
    ssl_context = None
    if settings.http_tls is not None:
        ssl_context = tls.server_context(settings.http_tls, "http/1.1")
    await server.start(settings.host, settings.http_port, ssl_context,
                       fd=settings.http_listen_fd, reuse_port=settings.reuse_port)
    log.info("Started HTTPService at %s:%d (%s)%s", settings.host, server.port,
             settings.http_impl, tls.describe(settings.http_tls))
    return server
