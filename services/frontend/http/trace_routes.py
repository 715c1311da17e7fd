"""Triton's trace extension over HTTP: GET and POST /v2/trace/setting and
/v2/models/{m}/trace/setting, and the traced inference handler.

The settings are the scheduler's (``dp.trace_settings``; services/scheduler/
trace_settings.py). This module does what Triton's HTTP layer does: the method check, the
update body checked in its order and words, and the answer as Triton writes it. Source
(triton-inference-server/server v2.51.0, src/http_server.cc): HTTPAPIServer::HandleTrace,
EVBufferToJson, and the trace/setting kind of the model regex (a version in the path is
404); TritonJson's texts (common, triton_json.h), INTERNAL there. Checked against
tritonserver 2.51 (the unit tests hold its answers): the model is checked before the body
("Request for unknown model : m", 400); an empty body is 500 "The document is empty"; a
body that is not an object ([], null) updates nothing but still makes the setting anew;
null clears a setting (it follows the global one again, or the start-up one); unknown
names and levels are ignored; numbers must be strings, parsed by std::stoi (leading
spaces, trailing text ignored) and stored as uint32 ("-1" is 4294967295).

Differs from Triton: a JSON object with a repeated member is read with its last value
(Triton: its first).
"""
from __future__ import annotations

from typing import Any

from services.common import messages as m
from services.common.errors import JSON_NOT_ARRAY, JSON_NOT_STRING, TriremeError, internal, invalid_arg
from services.dataplane.api import DataPlaneAPI
from services.frontend import trace
from services.frontend.http import json_body
from services.frontend.http.message import BodyTooLarge, Reply, StreamReply
from services.frontend.http.shm_routes import size_limit_text

__all__ = ["TRACE_PATH", "TraceRoutes", "decode_update", "encode_settings"]

TRACE_PATH = "/v2/trace/setting"

_JSON = "application/json"
_NOT_ALLOWED = Reply(405, json_body.error_body("Method Not Allowed"), _JSON)
_NOT_FOUND = Reply(404, json_body.error_body("Not Found"), _JSON)
# TritonJson (INTERNAL): services/common/errors.py
NOT_ARRAY_TEXT, NOT_STRING_TEXT = JSON_NOT_ARRAY, JSON_NOT_STRING


def _string(value: Any) -> str:
    if type(value) is not str:
        raise internal(NOT_STRING_TEXT)
    return value


def decode_update(body: Any) -> m.TraceUpdate:
    """A POST body -> the update, checked in Triton's order; the first problem raises, in
    Triton's words and code."""
    try:
        doc = json_body.decode_json(body)
    except TriremeError as e:   # EVBufferToJson: rapidjson's words, INTERNAL
        raise internal(e.message) from None
    update = m.TraceUpdate()
    if type(doc) is not dict:
        return update
    if "trace_file" in doc:
        raise trace.unsupported_file()
    if "trace_level" in doc:
        value = doc["trace_level"]
        if value is None:
            update.clear.append("level")
        else:
            if type(value) is not list:
                raise internal(NOT_ARRAY_TEXT)
            level = trace.level_bits(value, _string)
            if level is not None:
                update.set["level"] = level
    for name, key in (("trace_rate", "rate"), ("trace_count", "count"),
                      ("log_frequency", "log_frequency")):
        if name not in doc:
            continue
        value = doc[name]
        if value is None:
            update.clear.append(key)
        elif key == "count":
            update.set[key] = trace.parse_count(_string(value), grpc=False)
        else:
            update.set[key] = trace.parse_uint(name, _string(value))
    return update


def encode_settings(settings: list[tuple[str, list[str]]]) -> bytes:
    """Triton's answer: trace_level an array, every other setting a string (a setting
    given more than once, opentelemetry's resource, once per value, as TritonJson adds it)."""
    members = []
    for key, values in settings:
        k = json_body.encode_json(key).decode()
        if key == "trace_level":
            members.append(f"{k}:{json_body.encode_json(values).decode()}")
        else:
            members += [f"{k}:{json_body.encode_json(v).decode()}" for v in values]
    return ("{" + ",".join(members) + "}").encode()


class TraceRoutes:
    """The two trace/setting paths over the data plane ``dp``; ``limit``: the largest
    body read (--http-max-input-size). ``traced(infer)``: the inference handler, tracing
    the requests the scheduler says may be traced."""

    def __init__(self, dp: DataPlaneAPI, limit: int) -> None:
        self.dp = dp
        self.limit = limit

    async def handle(self, request: Any) -> Reply:
        return await self._handle(request, "")

    async def handle_model(self, request: Any, model: str, version: str) -> Reply:
        if version:   # Triton's trace/setting takes no version: the path is not found
            return _NOT_FOUND
        return await self._handle(request, model)

    async def _handle(self, request: Any, model: str) -> Reply:
        update = error = None
        if request.method == "POST":
            try:
                try:
                    body = await request.read()
                except BodyTooLarge as e:
                    raise invalid_arg(size_limit_text(e.size, self.limit)) from None
                update = decode_update(body)
            except TriremeError as e:   # answered after the model check, as Triton does
                error = trace.error_record(e)
        elif request.method != "GET":
            return _NOT_ALLOWED
        settings = await self.dp.trace_settings(model, update, error)
        return Reply(200, encode_settings(settings), _JSON)

    def traced(self, infer: Any) -> Any:
        """``infer(request, model, version)``, tracing the requests whose model the
        scheduler says may be traced (services/frontend/trace.py)."""
        dp = self.dp
        if not trace.supports_tracing(dp):
            return infer
        run = trace.runner(infer, "HTTP", dp,
                           lambda request, model, version: trace.trace_headers(request.headers.get))

        def traced_infer(request: Any, model: str, version: str) -> Any:
            if dp.trace_on and dp.trace_level(model):
                return run(request, model, version)
            return infer(request, model, version)
        return traced_infer

    def traced_generate(self, generate: Any, stream: bool) -> Any:
        """``generate(request, model, version)`` (stream: generate_stream, whose answer's
        body is read after it returns), tracing as ``traced`` does; the trace is a
        services/frontend/trace.py StreamTrace, written once the body has been sent."""
        dp = self.dp
        if not trace.supports_tracing(dp):
            return generate
        run = trace.runner(generate, "HTTP", dp,
                           lambda request, model, version: trace.trace_headers(request.headers.get),
                           trace.StreamTrace)

        async def run_stream(request: Any, model: str, version: str) -> Any:
            ctx = trace.StreamTrace("HTTP")
            if dp.trace_mode == "opentelemetry":
                headers = trace.trace_headers(request.headers.get)
                if trace.valid_traceparent(headers.get("traceparent")):
                    ctx.carrier = headers
            token = trace.CURRENT.set(ctx)
            try:
                reply = await generate(request, model, version)
            except BaseException:
                ctx.finish()
                raise
            finally:
                trace.CURRENT.reset(token)
            if isinstance(reply, StreamReply):   # (REQUEST_END: when the final flag came)
                reply.chunks = trace.TracedChunks(reply.chunks, ctx)
            else:
                ctx.finish()
            return reply

        def traced_generate(request: Any, model: str, version: str) -> Any:
            if dp.trace_on and dp.trace_level(model):
                return (run_stream if stream else run)(request, model, version)
            return generate(request, model, version)
        return traced_generate
