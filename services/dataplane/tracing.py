"""Triton's trace extension on the request path (owned by DataPlane, client.py): which
requests to mark as traceable (the scheduler's TraceLevels), and a marked request's trace
(services/common/trace.py: the protocol adapter's RequestTrace, found in trace.CURRENT):
its input and output tensors at level TENSORS, its responses when streamed, and its
record once complete (a trace file's text for the scheduler, or OpenTelemetry spans).

The DataPlane copies ``on`` and ``mode`` into its ``trace_on`` and ``trace_mode`` (what
the adapters read) whenever they change, and tests ``trace_on`` before calling anything
here: a request costs one attribute test while nothing is traced. The settings are read
and changed by a control call (control.py)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from services.common import messages as m
from services.common import trace

log = logging.getLogger("trireme.dataplane")


class Tracer:
    def __init__(self, send: Callable[[Any], None],
                 view: Callable[[str, int, int], memoryview]) -> None:
        self._send = send   # a message to the scheduler
        self._view = view   # a worker's output block (the owner's SegmentMap.view)
        self.on = False           # some model may be traced: look closer
        self.mode = "triton"      # or "opentelemetry"
        self._default = 0
        self._models: dict[str, int] = {}
        self._options: list[tuple[str, str]] = []

    def level(self, model: str) -> int:
        """The trace level requests for ``model`` are marked with (0: not traced)."""
        return self._models.get(model, self._default) if self.on else 0

    def levels(self, msg: m.TraceLevels) -> None:
        """The scheduler's TraceLevels: the levels, mode and exporter options from now on."""
        self._default, self._models = msg.default, msg.models
        self.mode, self._options = msg.mode, msg.options
        self.on = bool(msg.default or any(msg.models.values()))

    def begin(self, req: Any, version: int) -> int:
        """The request is about to leave: 1 if it is marked (its adapter traces it)."""
        ctx = trace.CURRENT.get()
        level = self.level(req.model) if ctx is not None else 0
        if not level:
            return 0
        inputs = None
        if level & trace.TENSORS and self.mode == "triton":
            inputs = [(t.name, t.datatype, list(t.shape), bytes(t.data))
                      for t in req.inputs if t.data is not None]
        assert ctx is not None
        ctx.begin(req.model, version, req.id, inputs, self._record)
        return 2 if ctx.carrier else 1   # 2: it brings a trace context (always traced)

    def result(self, result: m.InferResult, frames: list[Any]) -> None:
        """A sampled request's result: its trace so far (and, TENSORS, its outputs)."""
        ctx = trace.CURRENT.get()
        if ctx is None:
            return
        if trace.CHILDREN_KEY in result.parameters:   # (reserved: not the client's)
            ctx.children = result.parameters.pop(trace.CHILDREN_KEY)
        outputs = None
        if result.trace[trace.TRACE_LEVEL] & trace.TENSORS and self.mode == "triton":
            outputs = []
            for ref in result.outputs:
                if ref.frame >= 0:
                    data = bytes(frames[ref.frame])
                elif ref.segment:
                    data = bytes(self._view(ref.segment, ref.offset, ref.nbytes))
                else:   # written into the client's shared memory
                    continue
                outputs.append((ref.name, ref.datatype, list(ref.shape), data))
        ctx.arrived(result.trace, outputs)

    def stream(self, result: m.InferResult, frames: list[Any], decoupled: bool) -> None:
        """A response (or bare final flag) of a streamed request: counted by its trace
        (frontend/trace.py StreamTrace), and the sampled request's result taken in."""
        ctx = trace.CURRENT.get()
        if ctx is None:
            return
        got = getattr(ctx, "got", None)
        if got is not None:
            got(decoupled)
        if result.trace:
            self.result(result, frames)

    def _record(self, trace_id: int, ctx: trace.RequestTrace) -> None:
        """A sampled request's trace is complete: its text goes to the scheduler, which
        files it (mode triton); or its spans go to the collector from here, and the
        scheduler hears that it is done."""
        if self.mode == "triton":
            self._send(m.TraceRecord(trace_id, ctx.text()))
            return
        from services.common import trace_otel
        try:
            trace_otel.export(ctx, self._options)
        except Exception:
            log.exception("exporting trace %d failed", trace_id)
        self._send(m.TraceRecord(trace_id, ""))
