"""Triton's trace extension over gRPC: the TraceSetting RPC (global settings when
model_name is empty; a request with settings changes them), and the traced ModelInfer.

The settings are the scheduler's (``dp.trace_settings``; services/scheduler/
trace_settings.py). What is left here is what Triton's gRPC layer checks: each setting's
values, in its order and words. Source (triton-inference-server/server v2.51.0,
src/grpc/grpc_server.cc): CommonHandler::RegisterTrace. Checked against tritonserver 2.51
(the unit tests hold its answers): the model is checked first ("Request for unknown model
: m", INVALID_ARGUMENT); a trace_file key is refused whatever it holds (UNIMPLEMENTED); a
setting with no value clears it; more than one value for trace_rate, trace_count or
log_frequency is "expect only 1 value for '<name>'"; unknown keys and levels are ignored;
an empty settings map only reads.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from protos import grpc_service_pb2 as pb
from services.common import messages as m
from services.common.errors import TriremeError, invalid_arg
from services.dataplane.api import DataPlaneAPI
from services.frontend import trace

__all__ = ["TraceRpcs", "settings_to_proto", "traced_model_infer", "traced_stream_one",
           "update_from_proto"]


def update_from_proto(request: pb.TraceSettingRequest) -> m.TraceUpdate | None:
    """The update a request asks for (None: it only reads), checked in Triton's order;
    the first problem raises, in Triton's words and code."""
    settings = request.settings
    if not settings:
        return None
    if "trace_file" in settings:
        raise trace.unsupported_file()
    update = m.TraceUpdate()
    if "trace_level" in settings:
        names = list(settings["trace_level"].value)
        if not names:
            update.clear.append("level")
        else:
            level = trace.level_bits(names)
            if level is not None:
                update.set["level"] = level
    for name, key in (("trace_rate", "rate"), ("trace_count", "count"),
                      ("log_frequency", "log_frequency")):
        if name not in settings:
            continue
        values = settings[name].value
        if not values:
            update.clear.append(key)
        elif len(values) > 1:
            raise invalid_arg(f"expect only 1 value for '{name}'")
        elif key == "count":
            update.set[key] = trace.parse_count(values[0], grpc=True)
        else:
            update.set[key] = trace.parse_uint(name, values[0])
    return update


def settings_to_proto(settings: list[tuple[str, list[str]]]) -> pb.TraceSettingResponse:
    resp = pb.TraceSettingResponse()
    for key, values in settings:
        resp.settings[key].value.extend(values)
    return resp


def _metadata(request: Any, context: Any) -> dict[str, str]:
    """The call's trace context metadata (grpc.aio's context has all of it; the native
    server's, the W3C trace context headers when the call has them)."""
    read = getattr(context, "invocation_metadata", None)
    metadata = dict(read() or ()) if read is not None else {}
    return trace.trace_headers(metadata.get)


def traced_model_infer(handler: Any, dp: DataPlaneAPI) -> Any:
    """ModelInfer(request, context), tracing the requests whose model the scheduler says
    may be traced (services/frontend/trace.py)."""
    if not trace.supports_tracing(dp):
        return handler
    run = trace.runner(handler, "GRPC", dp, _metadata)

    def model_infer(request: Any, context: Any) -> Any:
        if dp.trace_on and dp.trace_level(request[0].model_name):
            return run(request, context)
        return handler(request, context)
    return model_infer


def traced_stream_one(handler: Any, dp: DataPlaneAPI) -> Any:
    """The producer of one ModelStreamInfer request (methods.GrpcService._stream_one:
    request first), tracing the requests whose model may be traced, each its own trace
    (frontend/trace.py StreamTrace). Differs from Triton: GRPC_WAITREAD_START is when the
    request was read (Triton: when its handler began waiting for it), and a stream's
    requests bring no W3C trace context (mode opentelemetry samples them by rate)."""
    if not trace.supports_tracing(dp):
        return handler
    run = trace.stream_runner(handler, dp)

    def stream_one(request: Any, *args: Any) -> Any:
        if dp.trace_on and dp.trace_level(request[0].model_name):
            return run(request, *args)
        return handler(request, *args)
    return stream_one


class TraceRpcs:
    """TraceSetting over the data plane ``dp`` (methods.GrpcService owns one)."""

    __slots__ = ("_dp",)

    def __init__(self, dp: DataPlaneAPI) -> None:
        self._dp = dp

    def handlers(self) -> dict[str, Callable[[Any, Any], Awaitable[Any]]]:
        """RPC name -> handler, for the service's method table."""
        return {"TraceSetting": self.TraceSetting}

    async def TraceSetting(self, request: pb.TraceSettingRequest,
                           context: Any) -> pb.TraceSettingResponse:
        update = error = None
        try:
            update = update_from_proto(request)
        except TriremeError as e:   # answered after the model check, as Triton does
            error = trace.error_record(e)
        return settings_to_proto(await self._dp.trace_settings(request.model_name, update,
                                                               error))
