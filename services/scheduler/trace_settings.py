"""Triton's trace extension, the scheduler's half: the settings (global and per model), the
sampling of requests, trace ids, and the trace file. One place for every frontend, so
trace_rate and trace_count count the server's requests, as Triton's do.

A port of Triton's TraceManager (triton-inference-server/server v2.51.0, src/tracer.cc,
tracer.h; the flags: src/command_line_parser.cc):
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

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common import messages as m
from services.common.errors import Code
from services.common.trace import (
    CHILDREN_KEY,
    COMPUTE_NAMES,
    TENSORS,
    TIMESTAMPS,
    level_names,
    model_object,
    stoi,
    timestamp,
)

log = logging.getLogger("trireme.trace")

__all__ = ["TraceConfig", "TraceManager", "add_trace_args", "config_from_args"]

MIN_TRACE_COUNT_VALUE = -1
OPEN_TRACE_LIMIT_S = 600.0
_UINT32 = 0xFFFFFFFF
_FIELDS = ("level", "rate", "count", "log_frequency")
_MODES = ("triton", "opentelemetry")


def _c_int(v: int) -> int:
    """An int32 as C stores it into uint32_t (Triton's rate and log_frequency)."""
    return v & _UINT32


# ---- start-up flags ------------------------------------------------------------------------

@dataclass
class TraceConfig:
    """The global trace settings the server starts with (--trace-config, and tritonserver's
    deprecated --trace-file/--trace-level/--trace-rate/--trace-count/--trace-log-frequency),
    Triton's defaults: OFF, rate 1000, count -1, log frequency 0, no file, mode triton."""
    level: int = 0
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = "triton"
    options: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """Mode -> the "<mode>,<setting>=<value>" pairs as given ("" for the global ones):
    what a read of the settings lists besides the fields above."""


class TraceConfigError(ValueError):
    pass


def _int_option(value: str) -> int:
    """ParseOption<int> (command_line_parser.cc), its texts."""
    try:
        return stoi(value)
    except OverflowError:
        raise TraceConfigError(f"Provided option value is out of bound. Got {value}\n") from None
    except ValueError:
        raise TraceConfigError(f"Invalid option value. Got {value}\n") from None


def _uint32_option(value: str) -> int:
    """ParseOption<uint32_t>: std::stoul (64 bits, a minus sign negates) into a uint32."""
    try:
        v = stoi(value, bits=64)
    except OverflowError:
        raise TraceConfigError(f"Provided option value is out of bound. Got {value}\n") from None
    except ValueError:
        raise TraceConfigError(f"Invalid option value. Got {value}\n") from None
    return v & _UINT32


# OpenTelemetry's BatchSpanProcessor settings and where their defaults come from, in the
# order Triton lists the defaults it adds (ProcessOpenTelemetryBatchSpanProcessorArgs)
BSP_DEFAULTS = (("bsp_max_export_batch_size", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512"),
                ("bsp_schedule_delay", "OTEL_BSP_SCHEDULE_DELAY", "5000"),
                ("bsp_max_queue_size", "OTEL_BSP_MAX_QUEUE_SIZE", "2048"))


def _batch_span_processor_options(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The opentelemetry settings with their bsp_* values checked and normalised, then
    the bsp_* settings not given, from the environment or Triton's defaults."""
    out, given = [], set()
    names = {name for name, _, _ in BSP_DEFAULTS}
    for setting, value in pairs:
        if setting in names:
            try:
                value = str(_uint32_option(value))
            except TraceConfigError as e:
                raise TraceConfigError(
                    f'Bad option: "--trace-config opentelemetry,{setting}".\n{e}') from None
            given.add(setting)
        out.append((setting, value))
    for setting, env, default in BSP_DEFAULTS:
        if setting not in given:
            value = os.environ.get(env, default)
            try:
                out.append((setting, str(_uint32_option(value))))
            except TraceConfigError as e:
                raise TraceConfigError(f'Bad option: "{env}".\n{e}') from None
    return out


def _level_option(value: str) -> int:
    """ParseTraceLevelOption: 0 for off."""
    v = value.lower()
    if v in ("false", "off"):
        return 0
    if v in ("true", "on", "min", "max", "timestamps"):
        return TIMESTAMPS
    if v == "tensors":
        return TENSORS
    raise TraceConfigError(f"invalid value for trace level option: {v}")


def _mode_option(value: str) -> str:
    v = value.lower()
    if v not in _MODES:
        raise TraceConfigError(f'invalid value for trace mode option: {v}. Available options '
                               f'are "triton" and "opentelemetry"')
    return v


def parse_trace_config(arg: str) -> tuple[str, str, str]:
    """ParseTraceConfigOption: "<mode>,<setting>=<value>" or "<setting>=<value>" ->
    (mode, "" for a global setting; setting; value)."""
    usage = f"--trace-config option format is '<trace mode>,<setting>=<value>'. Got {arg}\n"
    comma = arg.find(",")
    mode = ""
    if comma > 0:
        mode = _mode_option(arg[:comma])
    elif comma == 0:
        raise TraceConfigError("No trace mode specified. --trace-config option format is "
                               f"<trace mode>,<setting>=<value> or <setting>=<value>. Got {arg}\n")
    eq = arg.find("=", comma + 1)
    if eq < 0:
        raise TraceConfigError(usage)
    setting, value = arg[comma + 1:eq], arg[eq + 1:]
    if not setting or not value:
        raise TraceConfigError(usage)
    return mode, setting, value


def _trace_config_arg(v: str) -> str:
    try:
        parse_trace_config(v)
    except TraceConfigError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return v


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """Triton's trace flags (tritonserver --help): --trace-config, repeatable, and the
    deprecated ones it still takes."""
    p.add_argument("--trace-config", action="append", default=[], type=_trace_config_arg,
                   metavar="<mode>,<setting>=<value>",
                   help="trace settings, repeatable: level=OFF|TIMESTAMPS|TENSORS (repeat to "
                        "combine), rate=N (trace every Nth request, default 1000), count=N "
                        "(-1: no limit), mode=triton|opentelemetry; triton,file=PATH, "
                        "triton,log-frequency=N; opentelemetry,url=URL, "
                        "opentelemetry,resource=KEY=VALUE")
    p.add_argument("--trace-file", default=None, help="DEPRECATED: use --trace-config triton,file=")
    p.add_argument("--trace-level", action="append", default=[],
                   help="DEPRECATED: use --trace-config level=")
    p.add_argument("--trace-rate", default=None, help="DEPRECATED: use --trace-config rate=")
    p.add_argument("--trace-count", default=None, help="DEPRECATED: use --trace-config count=")
    p.add_argument("--trace-log-frequency", default=None,
                   help="DEPRECATED: use --trace-config triton,log-frequency=")


def config_from_args(args: argparse.Namespace) -> TraceConfig:
    """The start-up settings from the flags, as Triton's parser makes them (the deprecated
    flags first, --trace-config overriding them, a level of off wins). Raises
    TraceConfigError with Triton's text."""
    cfg = TraceConfig()
    warn = sys.stderr.write
    disable = False
    deprecated = {"file": args.trace_file is not None, "level": bool(args.trace_level),
                  "rate": args.trace_rate is not None, "count": args.trace_count is not None,
                  "log-frequency": args.trace_log_frequency is not None}
    if args.trace_file is not None:
        warn("Warning: '--trace-file' has been deprecated and will be removed in future "
             "releases. Use '--trace-config triton,file=<filepath> instead.\n")
        cfg.file = args.trace_file
    for v in args.trace_level:
        warn("Warning: '--trace-level' has been deprecated and will be removed in future "
             "releases. Use '--trace-config level=<OFF|TIMESTAMPS|TENSORS> instead.\n")
        lv = _level_option(v)
        disable |= lv == 0
        cfg.level |= lv
    if args.trace_rate is not None:
        cfg.rate = _int_option(args.trace_rate)
    if args.trace_count is not None:
        cfg.count = _int_option(args.trace_count)
    if args.trace_log_frequency is not None:
        cfg.log_frequency = _int_option(args.trace_log_frequency)
    for arg in args.trace_config:
        mode, setting, value = parse_trace_config(arg)
        cfg.options.setdefault(mode, []).append((setting, value))
    for setting, value in cfg.options.get("", []):   # SetGlobalTraceArgs
        try:
            if setting == "rate":
                if deprecated["rate"]:
                    warn("Warning: Overriding deprecated '--trace-rate' in favor of provided "
                         "rate value in --trace-config!\n")
                cfg.rate = _int_option(value)
            elif setting == "level":
                if deprecated["level"]:
                    warn("Warning: Overriding deprecated '--trace-level' in favor of provided "
                         "level in --trace-config!\n")
                lv = _level_option(value)
                disable |= lv == 0
                cfg.level |= lv
            elif setting == "mode":
                cfg.mode = _mode_option(value)
            elif setting == "count":
                if deprecated["count"]:
                    warn("Warning: Overriding deprecated '--trace-count' in favor of provided "
                         "count in --trace-config!\n")
                cfg.count = _int_option(value)
        except TraceConfigError as e:
            raise TraceConfigError(f'Bad option: "--trace-config {setting}".\n{e}') from None
    if cfg.mode == "triton":   # SetTritonTraceArgs
        for setting, value in cfg.options.get("triton", []):
            try:
                if setting == "file":
                    if deprecated["file"]:
                        warn("Warning: Overriding deprecated '--trace-file' in favor of "
                             "provided file in --trace-config!\n")
                    cfg.file = value
                elif setting == "log-frequency":
                    if deprecated["log-frequency"]:
                        warn("Warning: Overriding deprecated '--trace-log-frequency' in favor "
                             "of provided log-frequency in --trace-config!\n")
                    cfg.log_frequency = _int_option(value)
            except TraceConfigError as e:
                raise TraceConfigError(
                    f'Bad option: "--trace-config triton,{setting}".\n{e}') from None
    else:
        if deprecated["file"]:
            warn("Warning: '--trace-file' is deprecated and will be ignored with "
                 "opentelemetry tracing mode. \n")
        if deprecated["log-frequency"]:
            warn("Warning: '--trace-log-frequency' is deprecated and will be ignored with "
                 "opentelemetry tracing mode.\n")
        cfg.options["opentelemetry"] = _batch_span_processor_options(
            cfg.options.get("opentelemetry", []))
    if disable:
        cfg.level = 0
    cfg.rate, cfg.log_frequency = _c_int(cfg.rate), _c_int(cfg.log_frequency)
    return cfg


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
