"""Triton's log settings (the logging extension and the --log-* flags), applied to the
Python logging of this process. Every process uses it; the scheduler holds the settings
(one source of truth) and tells the others (messages.LogSettingsChanged).

    start:      flags, else the parent's settings (LOG_ENV) ─configure()─▶ root handler
    scheduler:  answer(GetLogSettings | SetLogSettings): applied here, then sent to every
                frontend, worker and worker host (and to each as it connects)
    the others: apply(LogSettingsChanged.settings)

How Triton's six settings map onto Python logging:

- ``log_error`` / ``log_warning`` / ``log_info``: records at ERROR and above, at WARNING,
  at INFO are written or not, each on its own (Triton's three switches, not a threshold).
- ``log_verbose_level`` N: Triton writes a verbose message of level L when L <= N. Here a
  DEBUG record of Trireme's own loggers (``trireme.*``, ``services.*``, a Python model's
  ``pb_utils.Logger.log_verbose``) is level 1; from 2 on, the DEBUG records of every
  library in the process too (asyncio, aiohttp, grpc, hpack, ...) and anything below
  DEBUG. Verbose lines are "I" lines, as Triton's, whether log_info is on or not.
- ``log_format``: Triton's line prefixes (triton-inference-server/common src/logging.cc,
  LogMessage::LogPreamble and LogTimestamp; UTC)::

      default   I1124 08:00:00.123456 1234 main.py:42] "message"
      ISO8601   2025-11-24T08:00:00Z I 1234 main.py:42] "message"

  with the writing process's pid and the Python source file's name and line. The message
  is written as a JSON string, as Triton 2.51 does (TRITON_SERVER_ESCAPE_LOG_MESSAGES=0:
  as it is), so a record with a traceback stays one line.
- ``log_file``: every record of the process is appended there (one write per record on
  an O_APPEND descriptor: processes sharing the file never split each other's lines);
  "": stderr (Triton 2.51 writes every level there). A file that cannot be opened leaves
  the previous destination, as Triton's SetLogFile does (at start: stderr, log_file ""),
  with a warning. Triton refuses to change it at run time, so a process keeps the one it
  started with: its --log-file, else its parent's. `trireme serve` hands its own to every
  process it starts; a worker host (`trireme workers`) its own to its workers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import msgspec

from services.common import messages as m
from services.common.errors import Code
from services.common.flags import parse_bool

__all__ = [
    "FORMATS",
    "LOG_ENV",
    "LOG_FILE_TEXT",
    "RUNTIME_FIELDS",
    "TritonFormatter",
    "add_log_args",
    "answer",
    "apply",
    "as_json",
    "changed",
    "configure",
    "current",
    "from_args",
    "inherited",
    "reset",
    "verbose_level",
]

log = logging.getLogger("trireme.logsettings")

FORMATS = ("default", "ISO8601")
# Both protocols' answer to a log_file in an update (UNSUPPORTED): HandleLogging
# (src/http_server.cc) and CommonHandler::RegisterLogging (src/grpc/grpc_server.cc).
LOG_FILE_TEXT = "log file location can not be updated through network protocol"
RUNTIME_FIELDS = ("log_info", "log_warning", "log_error", "log_verbose_level", "log_format")
"""The settings an update may change, in the order Triton checks and applies them."""

OWN_LOGGERS = ("trireme", "services")
"""Trireme's loggers: their DEBUG records are verbose level 1."""

ESCAPE_ENV = "TRITON_SERVER_ESCAPE_LOG_MESSAGES"
LOG_ENV = "TRIREME_LOG_SETTINGS"
"""configure() keeps this process's settings here (a LogConfig as JSON), so every process
it starts (a frontend, a worker) starts with them: their --log-* defaults."""
_INT32 = 2**31


def verbose_level(value: int) -> int:
    """The level Triton keeps for a requested one: LOG_SET_VERBOSE(static_cast<int32_t>(v))
    with max(0, L), so a value past INT32_MAX wraps (2**32 + 1 is 1) and a negative
    int32 is 0."""
    v = value & 0xFFFFFFFF
    return v if v < _INT32 else 0


# ---------------------------------------------------------------- formatting
def _letter(levelno: int) -> str:
    return "E" if levelno >= logging.ERROR else "W" if levelno >= logging.WARNING else "I"


class TritonFormatter(logging.Formatter):
    """A record as one Triton log line in ``log_format`` ("default" or "ISO8601")."""

    def __init__(self, log_format: str = "default", escape: bool | None = None) -> None:
        super().__init__()
        self.iso = log_format == "ISO8601"
        self.escape = (os.environ.get(ESCAPE_ENV) != "0") if escape is None else escape

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text}\n{self.formatStack(record.stack_info)}"
        # rapidjson's SerializeString; a table (extra={"table": True}) is written as it is,
        # as Triton's LOG_TABLE_INFO writes its model and option tables
        if self.escape and not getattr(record, "table", False):
            text = json.dumps(text, ensure_ascii=False)
        secs = int(record.created)
        t = time.gmtime(secs)
        where = f"{record.process} {record.filename}:{record.lineno}] {text}"
        if self.iso:
            return (f"{t.tm_year}-{t.tm_mon:02d}-{t.tm_mday:02d}T{t.tm_hour:02d}:"
                    f"{t.tm_min:02d}:{t.tm_sec:02d}Z {_letter(record.levelno)} {where}")
        usec = min(int((record.created - secs) * 1e6), 999999)
        return (f"{_letter(record.levelno)}{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:"
                f"{t.tm_min:02d}:{t.tm_sec:02d}.{usec:06d} {where}")


class _Handler(logging.Handler):
    """The one handler on the root logger: Triton's switches (filter), format and
    destination (stderr, or a file appended to)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.settings = m.LogConfig()
        self.setFormatter(TritonFormatter())
        self._fd: int | None = None
        self._path = ""

    def filter(self, record: logging.LogRecord) -> bool:
        s, level = self.settings, record.levelno
        if level >= logging.ERROR:
            return s.log_error
        if level >= logging.WARNING:
            return s.log_warning
        if level >= logging.INFO:
            return s.log_info
        return s.log_verbose_level >= (1 if level >= logging.DEBUG else 2)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            if self._fd is None:
                stream = sys.stderr
                if stream is not None:
                    stream.write(line)
                    stream.flush()
                return
            data = line.encode("utf-8", "backslashreplace")
            while data:
                data = data[os.write(self._fd, data):]
        except Exception:  # noqa: BLE001 - logging's contract: handleError reports it
            self.handleError(record)

    def set_file(self, path: str) -> None:
        """Write to ``path`` ("": stderr) from now on. OSError when it cannot be opened:
        the destination stays."""
        if path == self._path:
            return
        fd = None
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.acquire()
        try:
            old, self._fd, self._path = self._fd, fd, path
        finally:
            self.release()
        if old is not None:
            os.close(old)

    def close(self) -> None:
        self.set_file("")
        super().close()


# ---------------------------------------------------------------- this process
_handler: _Handler | None = None
_current = m.LogConfig()


def current() -> m.LogConfig:
    """The settings this process runs with (log_file: the file really written to)."""
    return _current


def as_json(settings: m.LogConfig) -> dict[str, Any]:
    """The logging extension's answer, in Triton's member order."""
    return {"log_file": settings.log_file, "log_info": settings.log_info,
            "log_warning": settings.log_warning, "log_error": settings.log_error,
            "log_verbose_level": settings.log_verbose_level,
            "log_format": settings.log_format}


def configure(settings: m.LogConfig) -> m.LogConfig:
    """Make this process log as ``settings`` say (at start in place of
    logging.basicConfig, and again on each change); returns what it runs with."""
    global _handler, _current
    root = logging.getLogger()
    if _handler is None:
        _handler = _Handler()
        root.addHandler(_handler)
    wanted = settings.log_file
    failed: OSError | None = None
    try:
        _handler.set_file(wanted)
    except OSError as e:
        failed = e
        settings = msgspec.structs.replace(settings, log_file=_current.log_file)
    _handler.acquire()
    try:
        _handler.settings = settings
        _handler.setFormatter(TritonFormatter(settings.log_format))
    finally:
        _handler.release()
    verbose = settings.log_verbose_level
    switched = [level for on, level in ((settings.log_info, logging.INFO),
                                        (settings.log_warning, logging.WARNING),
                                        (settings.log_error, logging.ERROR)) if on]
    root.setLevel(1 if verbose >= 2 else min(switched, default=logging.CRITICAL + 1))
    own = 1 if verbose >= 2 else logging.DEBUG if verbose == 1 else logging.NOTSET
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(own)
    _current = settings
    os.environ[LOG_ENV] = msgspec.json.encode(settings).decode()
    if failed is not None:
        log.warning("cannot open the log file '%s' (%s); logging to %s", wanted,
                    failed.strerror or failed,
                    f"'{_current.log_file}'" if _current.log_file else "stderr")
    log.debug("log settings: %s", json.dumps(as_json(settings)))
    return settings


def apply(settings: m.LogConfig) -> m.LogConfig:
    """The scheduler's settings (LogSettingsChanged), but this process's own log_file."""
    return configure(msgspec.structs.replace(settings, log_file=_current.log_file))


def reset() -> None:
    """Undo configure(): the root handler and the levels it set go (tests)."""
    global _handler, _current
    if _handler is not None:
        logging.getLogger().removeHandler(_handler)
        _handler.close()
        _handler = None
    logging.getLogger().setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    _current = m.LogConfig()
    os.environ.pop(LOG_ENV, None)


def inherited() -> m.LogConfig:
    """The settings this process's parent ran with when it started it (LOG_ENV), else
    Triton's defaults."""
    try:
        return msgspec.json.decode(os.environ.get(LOG_ENV) or "[]", type=m.LogConfig)
    except msgspec.DecodeError:
        return m.LogConfig()


# ---------------------------------------------------------------- the scheduler's side
def _problem(changes: dict[str, Any]) -> str:
    """What is wrong with an update the frontend should have refused ("" : nothing)."""
    for name, value in changes.items():
        if name == "log_verbose_level":
            if type(value) is not int or not 0 <= value < _INT32:
                return "expect int32 for 'log_verbose_level'"
        elif name == "log_format":
            if value not in FORMATS:
                return f"invalid argument for log_format, got: {value}"
        elif type(value) is not bool:
            return f"expect boolean for '{name}'"
    return ""


def answer(msg: m.GetLogSettings | m.SetLogSettings) -> m.LogSettings:
    """The scheduler's answer to a frontend: the settings, after applying an update here.
    An update is applied whole or not at all (Triton applies the settings before a bad
    one); the caller then sends changed() to every other process."""
    if isinstance(msg, m.SetLogSettings):
        changes = {name: value for name in RUNTIME_FIELDS
                   if (value := getattr(msg, name)) is not None}
        problem = _problem(changes)
        if problem:
            return m.LogSettings(msg.ctl_id, _current,
                                 m.ErrorRecord(int(Code.INVALID_ARG), problem))
        if changes:
            configure(msgspec.structs.replace(_current, **changes))
    return m.LogSettings(msg.ctl_id, _current)


def changed() -> m.LogSettingsChanged:
    """This process's settings, for the others to apply."""
    return m.LogSettingsChanged(_current)


# ---------------------------------------------------------------- flags

def _verbose_flag(value: str) -> int:
    """--log-verbose as Triton parses it (ParseIntBoolOption): true (1), false (0) or an
    int32; a negative level is 0 (LOG_SET_VERBOSE's max(0, L))."""
    v = value.strip().lower()
    if v in ("true", "false"):
        return int(v == "true")
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid option value. Got {value}") from None
    if not -_INT32 <= n < _INT32:
        raise argparse.ArgumentTypeError(
            f"Provided option value is out of bound. Got {value}")
    return max(n, 0)


def add_log_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Triton's logging flags (src/command_line_parser.cc, the "Logging" group); their
    defaults are the settings the process inherited (LOG_ENV), else Triton's."""
    d = inherited()
    g = p.add_argument_group("logging (Triton's flags; the logging extension changes all "
                             "but --log-file at run time)")
    return [
        g.add_argument("--log-verbose", type=_verbose_flag, default=d.log_verbose_level,
                       metavar="LEVEL",
                       help="verbose logging level: 0 (the default) disables it, 1 "
                            "writes Trireme's debug messages, 2 and more those of every "
                            "library too"),
        g.add_argument("--log-info", type=parse_bool, default=d.log_info, metavar="BOOL",
                       help="enable/disable info-level logging (default true)"),
        g.add_argument("--log-warning", type=parse_bool, default=d.log_warning,
                       metavar="BOOL", help="enable/disable warning-level logging (default true)"),
        g.add_argument("--log-error", type=parse_bool, default=d.log_error, metavar="BOOL",
                       help="enable/disable error-level logging (default true)"),
        g.add_argument("--log-format", choices=FORMATS, default=d.log_format,
                       help='"default" (the default): LMMDD hh:mm:ss.ssssss; "ISO8601": '
                            "YYYY-MM-DDThh:mm:ssZ L"),
        g.add_argument("--log-file", default=d.log_file, metavar="PATH",
                       help="append the log of this process and of those it starts to this "
                            "file (default: stderr)"),
    ]


def from_args(args: argparse.Namespace) -> m.LogConfig:
    """The settings the flags of add_log_args ask for."""
    return m.LogConfig(log_file=args.log_file, log_info=args.log_info,
                       log_warning=args.log_warning, log_error=args.log_error,
                       log_verbose_level=args.log_verbose, log_format=args.log_format)
