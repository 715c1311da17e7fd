"""Triton's trace extension, the scheduler's half: the settings (global and per model), the
sampling of requests, trace ids, and the trace file. One place for every frontend, so
trace_rate and trace_count count the server's requests, as Triton's do.

A port of Triton's TraceManager (triton-inference-server/server v2.51.0, src/tracer.cc,
tracer.h; its start-up settings: trace_config.py):
- A setting is an object with its own counters (requests seen, traces left, traces
  collected and not yet written). An update replaces the object, so counters start again;
  a model setting falls back to the global one field by field until that field is set,
  and is rebuilt when the global one changes (UpdateTraceSettingInternal).
- Sampling (TraceSetting::SampleTrace): every ``rate``-th request a frontend marks as
  traceable, while ``count`` (-1: no limit) lasts; ``count`` counts down and is what a
  read of the settings shows.
- Writing (TraceSetting::WriteTrace): each trace goes into the setting's buffer; the
  buffer goes to ``<file>.<n>`` (n counts per file from 0) when ``log_frequency`` traces
  have been collected, or once ``count`` is used up and every sampled trace is in; what
  is left when the setting is replaced (once its open traces are in) or at shutdown goes
  to ``<file>.<n>`` when log_frequency is set, else onto ``<file>`` (one JSON array over
  the whole run, closed at shutdown: TraceFile::SaveTraces).

Traces of ensemble steps are child traces of the ensemble's (their own ids, "parent_id"),
whatever the step model's own settings say (Triton spawns them from the parent's trace);
the scheduler writes their part (it sees their results) and the frontend the rest.

Differs from Triton: TENSORS of ensemble steps are not written (only the ensemble's own
inputs and outputs); a trace whose answer never reached its frontend (the client went
away first) is given up after OPEN_TRACE_LIMIT_S.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from services.common import messages as m
from services.common.errors import Code
from services.common.trace import (
    CHILDREN_KEY,
    COMPUTE_NAMES,
    TIMESTAMPS,
    level_names,
    model_object,
    timestamp,
)
from services.scheduler.trace_config import TraceConfig

log = logging.getLogger("trireme.trace")

__all__ = ["TraceManager"]

OPEN_TRACE_LIMIT_S = 600.0
_FIELDS = ("level", "rate", "count", "log_frequency")


# ---- the settings -----------------------------------------------------------------------

class TraceFile:
    """One trace file path (TraceFile): indexed files ``<path>.<n>``, and ``<path>`` itself,
    one JSON array over the run (closed by close())."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = 0
        self._opened = False

    def save(self, traces: list[str], indexed: bool) -> None:
        try:
            if indexed:   # written whole under a hidden name, then renamed: never read half
                name = f"{self.path}.{self.index}"
                self.index += 1
                head, tail = os.path.split(name)
                partial = os.path.join(head, f".{tail}.partial")
                with open(partial, "w") as f:
                    f.write("[" + ",".join(traces) + "]")
                os.replace(partial, name)
            else:
                with open(self.path, "a" if self._opened else "w") as f:
                    f.write(("," if self._opened else "[") + ",".join(traces))
                self._opened = True
        except OSError as e:
            log.error("failed creating trace file: %s", e)

    def close(self) -> None:
        if self._opened:
            try:
                with open(self.path, "a") as f:
                    f.write("]")
            except OSError as e:
                log.error("failed closing trace file: %s", e)
            self._opened = False


class Setting:
    """One TraceSetting: its values, which of them are its own (``specified``) rather than
    its fallback's, and its counters."""

    def __init__(self, level: int, rate: int, count: int, log_frequency: int, file: TraceFile,
                 mode: str, options: dict[str, list[tuple[str, str]]],
                 specified: frozenset[str] = frozenset()) -> None:
        self.level, self.rate, self.count, self.log_frequency = level, rate, count, log_frequency
        self.file, self.mode, self.options = file, mode, options
        self.specified = specified
        self.sampled = 0              # sample_: the requests it saw while valid
        self.collected = 0
        self.in_stream: list[str] = []
        self.open = 0                 # sampled traces not yet written or given up
        self.retired = False
        if not level:
            self.reason = "tracing is disabled"
        elif rate == 0:
            self.reason = "sample rate must be non-zero"
        elif mode == "triton" and not file.path:
            self.reason = "trace file name is not given"
        else:
            self.reason = ""

    def valid(self) -> bool:
        return not self.reason and self.count != 0

    def effective_level(self) -> int:
        """The level a frontend marks requests with: none while nothing can be sampled
        (opentelemetry: a request that brings a trace context of its own always is)."""
        if self.mode == "opentelemetry":
            return self.level
        return self.level if self.valid() else 0

    def sample(self, force: bool = False) -> bool:
        """SampleTrace: is this request traced? ``force``: it brings an OpenTelemetry
        context (traced whatever the rate and count, while the level is not OFF)."""
        hit = False
        if self.rate != 0:
            if not self.valid() and not force:
                return False
            self.sampled += 1
            hit = self.sampled % self.rate == 0
            if hit and self.count > 0:
                self.count -= 1
            elif hit and self.count == 0:
                hit = False
        return hit or (force and self.level != 0)

    def write(self, trace: str) -> None:
        """WriteTrace: into the buffer; to an indexed file when it is time."""
        self.in_stream.append(trace)
        self.collected += 1
        if ((self.count == 0 and self.collected == self.sampled) or
                (self.log_frequency and len(self.in_stream) >= self.log_frequency)):
            traces, self.in_stream = self.in_stream, []
            self.file.save(traces, True)

    def finalize(self) -> None:
        """The setting is gone (~TraceSetting): what is left goes to the file."""
        if self.mode == "triton" and self.in_stream:
            traces, self.in_stream = self.in_stream, []
            self.file.save(traces, self.log_frequency != 0)

    def release(self) -> None:
        """One of its open traces is written or given up."""
        self.open -= 1
        if self.retired and self.open <= 0:
            self.finalize()


class OpenTrace:
    """A sampled request whose trace is not written yet. ``head`` travels with the request
    (BatchItem.trace) and its result (InferResult.trace)."""

    __slots__ = ("children", "frontend", "head", "id", "model", "parent_id", "request_id",
                 "request_start", "root", "setting", "since", "spans", "version")

    def __init__(self, trace_id: int, setting: Setting, level: int, queue_start: int,
                 frontend: bytes, root: OpenTrace | None = None) -> None:
        self.id = trace_id
        self.setting = setting
        self.head = [trace_id, level, queue_start]
        self.frontend = frontend
        self.root = root if root is not None else self
        self.children: list[str] = []        # its steps' trace text (mode triton)
        self.spans: list[list[Any]] = []     # its steps' times (mode opentelemetry: CHILDREN_KEY)
        self.parent_id = 0
        self.model, self.version, self.request_id = "", 0, ""
        self.request_start = queue_start
        self.since = time.monotonic()


class TraceManager:
    """The settings, the sampling and the files. ``send(identity, msg)`` reaches a
    frontend, ``frontends()`` lists them (for TraceLevels), ``step_identity`` is the
    scheduler's own identity for ensemble steps."""

    def __init__(self, config: TraceConfig | None, send: Callable[[bytes, Any], None],
                 frontends: Callable[[], Iterable[bytes]], step_identity: bytes = b"") -> None:
        cfg = config or TraceConfig()
        self.config = cfg
        self._send = send
        self._frontends = frontends
        self._step_identity = step_identity
        self._files: dict[str, TraceFile] = {cfg.file: TraceFile(cfg.file)}
        args = (cfg.level, cfg.rate, cfg.count, cfg.log_frequency, self._files[cfg.file],
                cfg.mode, cfg.options)
        self.default = Setting(*args)        # global_default_: what clearing goes back to
        self.global_setting = Setting(*args)
        self.models: dict[str, Setting] = {}
        self._fallback_models: set[str] = set()
        self._next_id = 1
        self._open: dict[int, OpenTrace] = {}
        self._children: dict[int, tuple[OpenTrace, int]] = {}  # step req_id -> (parent, start)
        self._levels = self.levels()
        if cfg.level and self.global_setting.reason:
            log.warning("tracing is not possible with the start-up settings: %s",
                        self.global_setting.reason)

    # -- the settings API ------------------------------------------------------------------
    def answer(self, msg: m.TraceSettingsRequest, model_ready: bool) -> m.TraceSettings:
        """A TraceSettingsRequest's answer, checked in Triton's order: the model, the
        request's own error (the frontend's parse), the update."""
        def error(code: Code, text: str) -> m.TraceSettings:
            return m.TraceSettings(msg.ctl_id, error=m.ErrorRecord(int(code), text))
        if msg.model and not model_ready:
            return error(Code.INVALID_ARG, f"Request for unknown model : {msg.model}")
        if msg.error is not None:
            return m.TraceSettings(msg.ctl_id, error=msg.error)
        if msg.update is not None:
            text = self.update(msg.model, msg.update)
            self._broadcast()
            if text:
                return error(Code.INVALID_ARG, text)
        return m.TraceSettings(msg.ctl_id, self.settings_of(msg.model))

    def setting(self, model: str) -> Setting:
        return self.models.get(model, self.global_setting)

    def settings_of(self, model: str) -> list[tuple[str, list[str]]]:
        """GetTraceSetting, listed as HandleTrace writes it."""
        s = self.setting(model)
        out = [("trace_level", level_names(s.level)), ("trace_rate", [str(s.rate)]),
               ("trace_count", [str(s.count)])]
        if s.mode == "triton":
            out += [("log_frequency", [str(s.log_frequency)]), ("trace_file", [s.file.path])]
        out.append(("trace_mode", [s.mode]))
        for key, value in s.options.get(s.mode, ()):
            if key not in ("file", "log-frequency"):
                out.append((key, [value]))
        return out

    def update(self, model: str, new: m.TraceUpdate) -> str:
        """UpdateTraceSetting: "" or the error text (INVALID_ARG). A global update rebuilds
        the model settings that fall back to it."""
        err = self._update(model, new)
        if err or model:
            return err
        for name in list(self._fallback_models):
            err = self._update(name, m.TraceUpdate())
            if err:
                return err
        return ""

    def _update(self, model: str, new: m.TraceUpdate) -> str:
        """UpdateTraceSettingInternal."""
        current = self.models.get(model) if model else self.global_setting
        fallback = self.global_setting if model else self.default
        values = {"level": fallback.level, "rate": fallback.rate, "count": fallback.count,
                  "log_frequency": fallback.log_frequency}
        specified = set()
        for name in _FIELDS:
            if name in new.clear:
                continue
            if name in new.set:
                values[name] = new.set[name]
                specified.add(name)
            elif current is not None and name in current.specified:
                values[name] = getattr(current, name)
                specified.add(name)
        file_specified = current is not None and "file" in current.specified
        path = current.file.path if file_specified and current is not None else fallback.file.path
        if model:
            if specified == set(_FIELDS) and file_specified:
                self._fallback_models.discard(model)
            elif not specified and not file_specified:
                old = self.models.pop(model, None)   # the model follows the global setting
                if old is not None:
                    self._retire(old)
                return ""
            else:
                self._fallback_models.add(model)
        file = self._files.get(path)
        if file is None:
            file = self._files[path] = TraceFile(path)
        setting = Setting(values["level"], values["rate"], values["count"],
                          values["log_frequency"], file, fallback.mode, fallback.options,
                          frozenset(specified | ({"file"} if file_specified else set())))
        if not setting.valid() and setting.level:
            return f"Attempting to set invalid trace setting :{setting.reason}"
        if model:
            old = self.models.get(model)
            self.models[model] = setting
        else:
            old, self.global_setting = self.global_setting, setting
        if old is not None:
            self._retire(old)
        return ""

    def _retire(self, setting: Setting) -> None:
        """The setting is replaced: it writes what it holds once its open traces are in."""
        setting.retired = True
        if setting.open <= 0:
            setting.finalize()

    # -- which requests frontends mark --------------------------------------------------------
    def levels(self) -> m.TraceLevels:
        default = self.global_setting.effective_level()
        models = {name: lv for name, s in self.models.items()
                  if (lv := s.effective_level()) != default}
        mode = self.global_setting.mode
        return m.TraceLevels(default, models, mode, self.global_setting.options.get(mode, []))

    def hello(self, identity: bytes) -> None:
        """A frontend said hello: tell it what to mark (if anything)."""
        if self._levels.default or self._levels.models:
            self._send(identity, self._levels)

    def _broadcast(self) -> None:
        levels = self.levels()
        if levels != self._levels:
            self._levels = levels
            for identity in list(self._frontends()):
                self._send(identity, levels)

    # -- sampling ----------------------------------------------------------------------------
    def sample(self, identity: bytes, req: m.InferRequest, arrival_ns: int) -> OpenTrace | None:
        """A request its frontend marked: an OpenTrace if it is traced (an ensemble step of
        a traced request always is), else None."""
        if identity == self._step_identity:
            expected = self._children.pop(req.req_id, None)
            if expected is None:
                return None
            parent, start = expected
            root = parent.root
            child = OpenTrace(self._new_id(), root.setting, parent.head[1], arrival_ns,
                              identity, root)
            child.parent_id, child.request_start = parent.id, start
            child.model, child.version, child.request_id = req.model, req.version, req.request_id
            self._open[child.id] = child
            return child
        setting = self.setting(req.model)
        if not setting.sample(req.trace == 2 and setting.mode == "opentelemetry"):
            if setting.count == 0 and setting.mode == "triton":   # used up: stop marking
                self._broadcast()
            return None
        self._expire()
        trace = OpenTrace(self._new_id(), setting, setting.level, arrival_ns, identity)
        setting.open += 1
        self._open[trace.id] = trace
        if setting.count == 0:
            self._broadcast()
        return trace

    def _new_id(self) -> int:
        trace_id = self._next_id
        self._next_id += 1
        return trace_id

    def expect_child(self, step_req_id: int, parent: OpenTrace) -> None:
        """An ensemble step of a traced request is about to be queued (REQUEST_START)."""
        self._children[step_req_id] = (parent, time.monotonic_ns())

    def step_done(self, result: m.InferResult) -> None:
        """A traced step's final result reached the scheduler: its part of the trace."""
        child = self._open.pop(result.trace[0], None)
        if child is None or child.root is child:
            return
        level = child.head[1]
        if not level & TIMESTAMPS:
            return
        tid = child.id
        if child.setting.mode != "triton":   # the frontend makes its spans
            compute = list(result.trace[3:7]) or [0, 0, 0, 0]
            child.root.spans.append([tid, child.parent_id, child.model, child.version,
                                     child.request_id, child.request_start, result.trace[2],
                                     *compute, time.monotonic_ns()])
            return
        parts = [model_object(tid, child.model, child.version, child.request_id, child.parent_id),
                 timestamp(tid, "REQUEST_START", child.request_start),
                 timestamp(tid, "QUEUE_START", result.trace[2])]
        parts += [timestamp(tid, name, ns) for name, ns in zip(COMPUTE_NAMES, result.trace[3:])]
        parts.append(timestamp(tid, "REQUEST_END", time.monotonic_ns()))
        child.root.children.append(",".join(parts))

    def answered(self, trace: OpenTrace, result: m.InferResult) -> None:
        """The final answer of a traced request the scheduler makes itself (an ensemble's):
        its trace so far, and (opentelemetry) its steps' times for the frontend's spans."""
        result.trace = trace.head
        if trace.spans:
            result.parameters = {**result.parameters, CHILDREN_KEY: trace.spans}

    # -- writing -----------------------------------------------------------------------------
    def record(self, msg: m.TraceRecord) -> None:
        """A frontend's part of a trace: the trace is complete; its setting files it (mode
        triton; an OpenTelemetry trace went to the collector from the frontend)."""
        trace = self._open.pop(msg.trace_id, None)
        if trace is None or trace.root is not trace:
            return
        setting = trace.setting
        parts = [*reversed(trace.children), msg.text] if msg.text else trace.children
        if parts and setting.mode == "triton":
            setting.write(",".join(parts))
        setting.release()

    def frontend_lost(self, identity: bytes) -> None:
        """Traces whose frontend is gone never complete: give them up."""
        for trace_id in [t.id for t in self._open.values()
                         if t.frontend == identity and t.root is t]:
            self._give_up(trace_id)

    def _expire(self) -> None:
        """Give up traces whose record has not come for OPEN_TRACE_LIMIT_S (their caller
        left before the answer): oldest first, so this stops at the first young one."""
        limit = time.monotonic() - OPEN_TRACE_LIMIT_S
        while self._open:
            trace = next(iter(self._open.values()))
            if trace.since > limit:
                break
            self._give_up(trace.id)
        # steps expected but never queued (their model was not ready): forgotten likewise
        ns_limit = time.monotonic_ns() - int(OPEN_TRACE_LIMIT_S * 1e9)
        while self._children:
            step_id, (_, start) = next(iter(self._children.items()))
            if start > ns_limit:
                break
            del self._children[step_id]

    def _give_up(self, trace_id: int) -> None:
        trace = self._open.pop(trace_id, None)
        if trace is not None and trace.root is trace:
            trace.setting.release()

    def close(self) -> None:
        """Shutdown: every setting writes what it holds, then the files are closed."""
        for s in (self.global_setting, *self.models.values()):
            s.finalize()
        for f in self._files.values():
            f.close()
