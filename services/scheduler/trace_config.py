"""Triton's trace flags, the start-up trace settings: --trace-config (global settings, and
those of mode triton or opentelemetry) and tritonserver's deprecated --trace-file,
--trace-level, --trace-rate, --trace-count and --trace-log-frequency, parsed as Triton's
command_line_parser.cc does (triton-inference-server/server v2.51.0: ParseTraceConfigOption,
SetGlobalTraceArgs, SetTritonTraceArgs, SetOpenTelemetryTraceArgs,
ProcessOpenTelemetryBatchSpanProcessorArgs, PostProcessTraceArgs), with its texts.
The settings store that starts from them: trace_settings.py.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from services.common.trace import TENSORS, TIMESTAMPS, stoi

__all__ = ["TraceConfig", "TraceConfigError", "add_trace_args", "config_from_args",
           "parse_trace_config"]

_UINT32 = 0xFFFFFFFF
_MODES = ("triton", "opentelemetry")


def _c_int(v: int) -> int:
    """An int32 as C stores it into uint32_t (Triton's rate and log_frequency)."""
    return v & _UINT32


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
