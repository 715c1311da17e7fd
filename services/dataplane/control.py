"""The data plane's control-plane calls: the repository, statistics, client shared
memory and the log settings, each a message to the scheduler answered by ctl_id
(DataPlane's half, a mixin: it holds ``_call`` and ``_ids``); and the trace extension's
(TraceCalls, another mixin)."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from services.common import messages as m
from services.common import trace
from services.common.errors import TriremeError, bad_version_string_text, invalid_arg

log = logging.getLogger("trireme.dataplane")


def error_from(rec: m.ErrorRecord) -> TriremeError:
    """The TriremeError a scheduler's or worker's ErrorRecord stands for."""
    return TriremeError(rec.code, rec.message)


class ControlCalls:
    _ids: Iterator[int]

    async def _call(self, msg: Any) -> Any:
        raise NotImplementedError

    async def repository_index(self, ready_only: bool) -> list[dict]:
        idx: m.Index = await self._call(m.GetIndex(next(self._ids), ready_only))
        out = []
        for e in idx.entries:
            d = {"name": e.name}
            for k in ("version", "state", "reason"):
                if getattr(e, k):
                    d[k] = getattr(e, k)
            out.append(d)
        return out

    async def load_model(self, model: str, parameters: dict) -> None:
        cfg = parameters.get("config", "")
        if cfg and not isinstance(cfg, str):
            raise invalid_arg("'config' parameter must be a string")
        files = {k: bytes(v) for k, v in parameters.items() if k.startswith("file:")}
        if files and not cfg:
            raise invalid_arg("failed to load '" + model + "', failed to parse "
                              "'file:' parameters: model configuration must be provided when "
                              "model files are provided")
        done = await self._call(m.LoadModelRequest(next(self._ids), model, cfg or "", files))
        if done.error is not None:
            raise error_from(done.error)

    async def unload_model(self, model: str, parameters: dict) -> None:
        done = await self._call(m.UnloadModelRequest(
            next(self._ids), model, bool(parameters.get("unload_dependents", False))))
        if done.error is not None:
            raise error_from(done.error)

    # ------------------------------------------------------------------ client shared memory
    async def shm_status(self, kind: str, name: str = "") -> list[dict]:
        reply: m.ShmRegions = await self._call(m.ShmStatus(next(self._ids), kind, name))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.regions

    async def shm_register(self, kind: str, name: str, key: str = "", offset: int = 0,
                           byte_size: int = 0, device_id: int = 0,
                           raw_handle: bytes = b"") -> None:
        done = await self._call(m.ShmRegister(next(self._ids), kind, name, key, offset,
                                              byte_size, device_id, raw_handle))
        if done.error is not None:
            raise error_from(done.error)

    async def shm_unregister(self, kind: str, name: str = "") -> None:
        done = await self._call(m.ShmUnregister(next(self._ids), kind, name))
        if done.error is not None:
            raise error_from(done.error)

    # ------------------------------------------------------------------ logging extension
    async def log_settings(self, *, log_info: bool | None = None,
                           log_warning: bool | None = None, log_error: bool | None = None,
                           log_verbose_level: int | None = None,
                           log_format: str | None = None) -> m.LogConfig:
        """The scheduler's log settings, after changing those given (checked already)."""
        changes = (log_info, log_warning, log_error, log_verbose_level, log_format)
        msg: m.GetLogSettings | m.SetLogSettings = (
            m.GetLogSettings(next(self._ids)) if all(v is None for v in changes) else
            m.SetLogSettings(next(self._ids), *changes))
        reply: m.LogSettings = await self._call(msg)
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.settings

    async def statistics(self, model: str = "", version: str = "") -> list[m.ModelStat]:
        """Statistics extension: every ready version ("" model), a model, or one version."""
        try:
            v = int(version) if version else -1
        except ValueError:
            raise invalid_arg(bad_version_string_text(version, "stoll")) from None
        reply: m.Stats = await self._call(m.GetStats(next(self._ids), model, max(v, -1)))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.stats

    async def metrics_text(self) -> str:
        """The scheduler's /metrics text ("" with metrics off)."""
        reply: m.MetricsText = await self._call(m.GetMetrics(next(self._ids)))
        return reply.text

    # ------------------------------------------------------------------ inference


class TraceCalls:
    """Triton's trace extension on the data plane (DataPlane's mixin): the settings calls,
    which requests to mark as traceable (the scheduler's TraceLevels), and a marked
    request's trace (services/common/trace.py: the protocol adapter's RequestTrace, found
    in trace.CURRENT). Costs a request one attribute test while nothing is traced."""
    _ids: Iterator[int]
    _segments: Any
    trace_on = False                      # some model may be traced: look closer
    trace_mode = "triton"                 # or "opentelemetry"
    _trace_default = 0
    _trace_models: dict[str, int] = {}
    _trace_options: list[tuple[str, str]] = []

    async def _call(self, msg: Any) -> Any:
        raise NotImplementedError

    def _send(self, msg: Any, frames: Any = ()) -> None:
        raise NotImplementedError

    async def trace_settings(self, model: str = "", update: m.TraceUpdate | None = None,
                             error: m.ErrorRecord | None = None) -> list[tuple[str, list[str]]]:
        """The trace settings of ``model`` ("": the global ones) after ``update``;
        ``error``: the request's own problem, raised after the scheduler's model check."""
        reply: m.TraceSettings = await self._call(
            m.TraceSettingsRequest(next(self._ids), model, update, error))
        if reply.error is not None:
            raise error_from(reply.error)
        return reply.settings

    def trace_level(self, model: str) -> int:
        """The trace level requests for ``model`` are marked with (0: not traced)."""
        return self._trace_models.get(model, self._trace_default) if self.trace_on else 0

    def _on_trace_levels(self, msg: m.TraceLevels) -> None:
        self._trace_default, self._trace_models = msg.default, msg.models
        self.trace_mode, self._trace_options = msg.mode, msg.options
        self.trace_on = bool(msg.default or any(msg.models.values()))

    def _trace_begin(self, req: Any, version: int) -> int:
        """The request is about to leave: 1 if it is marked (its adapter traces it)."""
        ctx = trace.CURRENT.get()
        level = self.trace_level(req.model) if ctx is not None else 0
        if not level:
            return 0
        inputs = None
        if level & trace.TENSORS and self.trace_mode == "triton":
            inputs = [(t.name, t.datatype, list(t.shape), bytes(t.data))
                      for t in req.inputs if t.data is not None]
        assert ctx is not None
        ctx.begin(req.model, version, req.id, inputs, self._trace_record)
        return 2 if ctx.carrier else 1   # 2: it brings a trace context (always traced)

    def _trace_result(self, result: m.InferResult, frames: list[Any]) -> None:
        """A sampled request's result: its trace so far (and, TENSORS, its outputs)."""
        ctx = trace.CURRENT.get()
        if ctx is None:
            return
        if trace.CHILDREN_KEY in result.parameters:   # (reserved: not the client's)
            ctx.children = result.parameters.pop(trace.CHILDREN_KEY)
        outputs = None
        if result.trace[trace.TRACE_LEVEL] & trace.TENSORS and self.trace_mode == "triton":
            outputs = []
            for ref in result.outputs:
                if ref.frame >= 0:
                    data = bytes(frames[ref.frame])
                elif ref.segment:
                    data = bytes(self._segments.view(ref.segment, ref.offset, ref.nbytes))
                else:   # written into the client's shared memory
                    continue
                outputs.append((ref.name, ref.datatype, list(ref.shape), data))
        ctx.arrived(result.trace, outputs)

    def _trace_stream(self, result: m.InferResult, frames: list[Any], decoupled: bool) -> None:
        """A response (or bare final flag) of a streamed request: counted by its trace
        (frontend/trace.py StreamTrace), and the sampled request's result taken in."""
        ctx = trace.CURRENT.get()
        if ctx is None:
            return
        got = getattr(ctx, "got", None)
        if got is not None:
            got(decoupled)
        if result.trace:
            self._trace_result(result, frames)

    def _trace_record(self, trace_id: int, ctx: trace.RequestTrace) -> None:
        """A sampled request's trace is complete: its text goes to the scheduler, which
        files it (mode triton); or its spans go to the collector from here, and the
        scheduler hears that it is done."""
        if self.trace_mode == "triton":
            self._send(m.TraceRecord(trace_id, ctx.text()))
            return
        from services.common import trace_otel
        try:
            trace_otel.export(ctx, self._trace_options)
        except Exception:
            log.exception("exporting trace %d failed", trace_id)
        self._send(m.TraceRecord(trace_id, ""))
