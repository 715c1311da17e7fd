"""Triton's trace mode opentelemetry (--trace-config mode=opentelemetry): a sampled
request's times as OpenTelemetry spans, exported over OTLP/HTTP to the collector at
``--trace-config opentelemetry,url=...``, by the frontend that served the request (the
times of the scheduler and the worker come back with the result, as in mode triton).

The spans are Triton's (src/tracer.cc, TraceManager::Trace): a root span "InferRequest"
(kind SERVER; child of the request's own W3C trace context when it brings one, in a
``traceparent`` HTTP header or gRPC metadata) with the protocol's times as events; under
it a span named after the model (attributes triton.model_name, triton.model_version,
triton.trace_id, triton.trace_parent_id, triton.request_id) with REQUEST_START,
QUEUE_START and REQUEST_END; under that a span "compute" with the four COMPUTE_* events.
An ensemble's steps are spans of their models under the ensemble's. Resource: service.name
"triton-inference-server" unless ``opentelemetry,resource=service.name=...`` says
otherwise, and each ``resource=key=value``; the tracer is "triton-server".

Needs the optional extra ``trireme[trace]`` (opentelemetry-sdk and the OTLP/HTTP
exporter); without it a sampled request is logged once as not exported. Nothing here is
imported until a request is traced in this mode.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from services.common.trace import COMPUTE_NAMES, QUEUE_START, TRACE_ID, RequestTrace

log = logging.getLogger("trireme.trace")

__all__ = ["DEFAULT_URL", "Exporter", "export"]

DEFAULT_URL = "http://localhost:4318/v1/traces"   # opentelemetry-cpp's OtlpHttpExporter default
SERVICE_NAME = "triton-inference-server"
TRACER_NAME = "triton-server"

_exporters: dict[tuple[tuple[str, str], ...], Exporter | None] = {}


def export(ctx: RequestTrace, options: list[tuple[str, str]]) -> None:
    """Export ``ctx``'s spans with the exporter ``options`` configure (made once)."""
    key = tuple(options)
    exporter = _exporters.get(key)
    if key not in _exporters:
        try:
            exporter = Exporter(options)
        except ImportError as e:
            log.error("trace mode opentelemetry needs the OpenTelemetry SDK (pip install "
                      "'trireme[trace]'): %s; traces are not exported", e)
            exporter = None
        _exporters[key] = exporter
    if exporter is not None:
        exporter.export(ctx)


class Exporter:
    """One TracerProvider with a BatchSpanProcessor over an OTLP/HTTP span exporter."""

    def __init__(self, options: list[tuple[str, str]]) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        url, attributes = DEFAULT_URL, {"service.name": SERVICE_NAME}
        bsp = {"bsp_max_queue_size": 2048, "bsp_schedule_delay": 5000,
               "bsp_max_export_batch_size": 512}
        for key, value in options:       # ProcessOpenTelemetryParameters
            if key == "url":
                url = value
            elif key == "resource":
                name, _, v = value.partition("=")
                attributes[name] = v
            elif key in bsp:
                bsp[key] = int(value)
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url), max_queue_size=bsp["bsp_max_queue_size"],
            schedule_delay_millis=bsp["bsp_schedule_delay"],
            max_export_batch_size=min(bsp["bsp_max_export_batch_size"],
                                      bsp["bsp_max_queue_size"])))
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        self._server = SpanKind.SERVER
        self._in = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        self.url = url

    def export(self, ctx: RequestTrace) -> None:
        """The spans of one sampled request (its times are CLOCK_MONOTONIC: shifted to
        the wall clock by the offset between the two now, as Triton's time_offset_)."""
        offset = time.time_ns() - time.monotonic_ns()
        h = ctx.head
        tid = h[TRACE_ID]

        def at(ns: int) -> int:
            return ns + offset

        def span(name: str, parent: Any, start: int, events: list[tuple[str, int]],
                 attributes: dict[str, Any] | None = None) -> Any:
            s = self.tracer.start_span(name, context=parent, kind=self._server,
                                       start_time=at(start), attributes=attributes)
            for event, ns in events:
                if ns:
                    s.add_event(event, timestamp=at(ns))
            return s

        parent = self._propagator.extract(ctx.carrier) if ctx.carrier else None
        send_end = ctx.send_end or time.monotonic_ns()
        if ctx.protocol == "GRPC":
            names = ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE",
                     "GRPC_SEND_START", "GRPC_SEND_END")
        else:
            names = ("HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE",
                     "HTTP_SEND_START", "HTTP_SEND_END")
        root = span("InferRequest", parent, ctx.recv_end or ctx.request_start,
                    list(zip(names, (ctx.recv_start, ctx.recv_end, ctx.response,
                                     ctx.send_start, ctx.send_end))))
        request_end = ctx.request_end or ctx.response
        model_spans = {tid: self._model(span, at, self._in(root), tid, 0, ctx.model,
                                        ctx.version, ctx.request_id, ctx.request_start,
                                        h[QUEUE_START], list(h[QUEUE_START + 1:]), request_end)}
        for child in sorted(ctx.children, key=lambda c: c[0]):   # parents before their steps
            cid, parent_id, model, version, request_id, start, queue, *compute, end = child
            above = model_spans.get(parent_id, model_spans[tid])
            model_spans[cid] = self._model(span, at, self._in(above), cid, parent_id, model,
                                           version, request_id, start, queue, compute, end)
        root.end(end_time=at(send_end))

    def _model(self, span: Any, at: Any, parent: Any, tid: int, parent_id: int, model: str,
               version: int, request_id: str, start: int, queue: int, compute: list[int],
               end: int) -> Any:
        """A model's request span (and its compute span); ended here, returned for its
        steps to hang under."""
        attributes: dict[str, Any] = {"triton.model_name": model, "triton.model_version": version,
                                      "triton.trace_id": tid, "triton.trace_parent_id": parent_id}
        if request_id:
            attributes["triton.request_id"] = request_id
        s = span(model, parent, start, [("REQUEST_START", start), ("QUEUE_START", queue)],
                 attributes)
        if len(compute) == 4 and compute[0]:
            c = span("compute", self._in(s), compute[0], list(zip(COMPUTE_NAMES, compute)))
            c.end(end_time=at(compute[3]))
        s.add_event("REQUEST_END", timestamp=at(end))
        s.end(end_time=at(end))
        return s

    def shutdown(self) -> None:
        self.provider.shutdown()
