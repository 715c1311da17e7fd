"""The control messages of Triton's extensions beyond inference: client shared memory,
logging, trace. Registered and encoded with every other message by
services/common/messages.py, which re-exports them (``m.ShmRegister`` etc.)."""
from __future__ import annotations

from typing import Any

from services.common.msgbase import ErrorRecord, Msg


# ---------------------------------------------------------------- client shared memory
class ShmRegister(Msg):
    """Register a client shared-memory region (``kind`` "system" or "cuda")."""
    ctl_id: int
    kind: str
    name: str
    key: str = ""
    offset: int = 0
    byte_size: int = 0
    device_id: int = 0
    raw_handle: bytes = b""


class ShmUnregister(Msg):
    ctl_id: int
    kind: str
    name: str = ""                 # "": every region of that kind


class ShmStatus(Msg):
    ctl_id: int
    kind: str
    name: str = ""                 # "": every region of that kind


class ShmRegions(Msg):
    """ShmStatus's answer: the regions as Triton lists them (dicts of its JSON fields)."""
    ctl_id: int
    regions: list[dict[str, Any]] = []
    error: ErrorRecord | None = None


class ForgetRegions(Msg):
    """Client shared-memory objects no longer registered: the worker unmaps them."""
    keys: list[str]


# ---------------------------------------------------------------- logging extension
class LogConfig(Msg):
    """Triton's log settings, the logging extension's six fields (services/common/
    logsettings.py applies them to a process)."""
    log_file: str = ""             # "": stderr
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"    # "default" | "ISO8601"


class GetLogSettings(Msg):
    ctl_id: int


class SetLogSettings(Msg):
    """Change the settings given (None: unchanged), checked by the frontend in Triton's
    words; log_file cannot change at run time (Triton refuses it)."""
    ctl_id: int
    log_info: bool | None = None
    log_warning: bool | None = None
    log_error: bool | None = None
    log_verbose_level: int | None = None
    log_format: str | None = None


class LogSettings(Msg):
    """The scheduler's settings after a GetLogSettings or SetLogSettings (the source of
    truth: every process follows them)."""
    ctl_id: int
    settings: LogConfig
    error: ErrorRecord | None = None


class LogSettingsChanged(Msg):
    """The scheduler's settings, sent to every frontend, worker and worker host as it
    connects (after its FrontendHello, WorkerReady, HostHello) and to all of them on each
    change. A process keeps its own log_file: the one it started with."""
    settings: LogConfig


# ---------------------------------------------------------------- trace extension
class TraceUpdate(Msg):
    """The trace settings a request changes: ``set`` name -> value ("level" as Triton's
    bit mask, "rate", "count", "log_frequency"), ``clear`` the names set back to the
    fallback (the global setting, or the start-up one for the global setting)."""
    set: dict[str, int] = {}
    clear: list[str] = []


class TraceSettingsRequest(Msg):
    """Read (``update`` None) or change the trace settings of ``model`` ("": the global
    ones). ``error``: what the frontend found wrong in the request, answered after the
    model check (Triton's order)."""
    ctl_id: int
    model: str = ""
    update: TraceUpdate | None = None
    error: ErrorRecord | None = None


class TraceSettings(Msg):
    """The settings after a TraceSettingsRequest, as Triton lists them: (key, values)."""
    ctl_id: int
    settings: list[tuple[str, list[str]]] = []
    error: ErrorRecord | None = None


class TraceLevels(Msg):
    """Which requests a frontend marks as traceable (InferRequest.trace): the level of
    ``models`` listed, else ``default`` (0: not traced). Sent after each FrontendHello and
    whenever it changes."""
    default: int = 0
    models: dict[str, int] = {}
    mode: str = "triton"
    options: list[tuple[str, str]] = []   # the mode's --trace-config settings (opentelemetry's)


class TraceRecord(Msg):
    """A sampled request's trace in Triton's JSON (its activity objects, comma-joined),
    written by the frontend once the response is sent; the scheduler files it."""
    trace_id: int
    text: str


# ---------------------------------------------------------------- metrics
class MetricSeries(Msg):
    """One labelled series of a model's custom metric (pb_utils.MetricFamily)."""
    labels: dict[str, str]
    value: float = 0.0             # counter, gauge
    buckets: list[float] = []      # histogram: upper bounds, cumulative counts, sum, count
    counts: list[int] = []
    sum: float = 0.0
    count: int = 0


class MetricFamilyRecord(Msg):
    name: str
    description: str
    kind: str                      # counter | gauge | histogram
    series: list[MetricSeries]



class GetMetrics(Msg):
    """The scheduler's /metrics text, for a generate response's ORCA load report (the
    endpoint-load-metrics header; frontend/http/orca.py)."""
    ctl_id: int


class MetricsText(Msg):
    """GetMetrics's answer: "" when metrics are off (--allow-metrics=false)."""
    ctl_id: int
    text: str
