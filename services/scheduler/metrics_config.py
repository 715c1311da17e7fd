"""Triton's metrics settings: --metrics-config, --metrics-interval-ms, --allow-cpu-metrics,
--allow-gpu-metrics, and a model config's `model_metrics` and `metric_tags`.

Parsed as Triton parses them (server/src/command_line_parser.cc ParseMetricsConfigOption;
core/src/metric_model_reporter.cc MetricReporterConfig::ParseConfig), so a command line
written for tritonserver means the same here, errors and all.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trireme.scheduler")

FIRST_RESPONSE = "nv_inference_first_response_histogram_ms"
# core/src/metric_model_reporter.h MetricReporterConfig: histogram_options_, quantiles_
DEFAULT_BUCKETS: dict[str, tuple[float, ...]] = {FIRST_RESPONSE: (100.0, 500.0, 2000.0, 5000.0)}
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = (
    (0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001))
SETTINGS = ("counter_latencies", "histogram_latencies", "summary_latencies", "summary_quantiles")
DEFAULT_INTERVAL_MS = 2000

# std::stod reads the longest number at the start and ignores the rest ("0.0.1" is 0.0):
# Triton's own QA passes summary_quantiles=0.1:0.0.1 and expects quantile 0.1.
_STOD = re.compile(r"\s*[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf(?:inity)?|nan)", re.I)


def format_error(arg: str) -> str:
    return f"--metrics-config option format is <setting>=<value>. Got {arg}"


def parse_setting(arg: str) -> tuple[str, str]:
    """One --metrics-config value: `<setting>=<value>`; raises ValueError in Triton's words
    (no '=', a ',' in the setting: per-name settings do not exist, or an empty side)."""
    eq = arg.find("=")
    if eq < 0 or "," in arg[:eq] or eq == 0 or eq == len(arg) - 1:
        raise ValueError(format_error(arg))
    return arg[:eq], arg[eq + 1:]


def _stod(text: str) -> float:
    m = _STOD.match(text)
    if m is None:
        raise ValueError(f"stod: no conversion of '{text}'")
    return float(m.group(0))


def parse_quantiles(text: str, error: Callable[[str], None] = log.error
                    ) -> tuple[tuple[float, float], ...]:
    """summary_quantiles="<quantile>:<error>,...": pairs that do not parse are logged in
    Triton's words and skipped (as Triton does); none left means the defaults."""
    out = []
    for pair in text.split(","):
        q, colon, err = pair.partition(":")
        if not colon:
            error(f"Invalid option: [{pair}]. No ':' delimiter found. Expected format is "
                  "<quantile>:<error>")
            continue
        try:
            quantile, epsilon = _stod(q), _stod(err)
        except ValueError as e:
            error(f"Invalid option: [{pair}]. Error: {e}")
            continue
        if not 0.0 <= quantile <= 1.0 or math.isnan(epsilon):
            error(f"Invalid option: [{pair}]. Error: a quantile is between 0 and 1")
            continue
        out.append((quantile, epsilon))
    return tuple(out) or DEFAULT_QUANTILES


@dataclass(frozen=True)
class MetricsOptions:
    """What /metrics shows and what the scheduler records for it."""
    enabled: bool = True
    """--allow-metrics: False records nothing beyond the statistics extension's totals."""
    counter_latencies: bool = True
    """nv_inference_{request,queue,compute_*}_duration_us (counter_latencies=false: absent)."""
    histogram_latencies: bool = False
    """nv_inference_first_response_histogram_ms (histogram_latencies=true)."""
    summary_latencies: bool = False
    """nv_inference_{request,queue,compute_*}_summary_us (summary_latencies=true)."""
    quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    """summary_quantiles: (quantile, error) pairs."""
    interval_ms: int = DEFAULT_INTERVAL_MS
    """--metrics-interval-ms: how often the CPU and GPU figures are read."""
    cpu: bool = True
    """--allow-cpu-metrics (and --allow-metrics)."""
    gpu: bool = True
    """--allow-gpu-metrics (and --allow-metrics): only where NVML finds a GPU."""

    @classmethod
    def parse(cls, settings: Sequence[str] = (), interval_ms: int = DEFAULT_INTERVAL_MS,
              enabled: bool = True, cpu: bool = True, gpu: bool = True) -> MetricsOptions:
        """From the flags; raises ValueError (Triton's words) for a malformed setting. As in
        Triton a flag is on only for the exact value that turns it on; other values and
        unknown settings change nothing (a warning says so)."""
        pairs = [parse_setting(s) for s in settings]
        kw: dict[str, Any] = {}
        for name, value in pairs:
            if name == "counter_latencies":
                kw[name] = value != "false"
            elif name in ("histogram_latencies", "summary_latencies"):
                kw[name] = value == "true"
            elif name == "summary_quantiles":
                kw["quantiles"] = parse_quantiles(value)
            else:
                log.warning("--metrics-config: unknown setting '%s' ignored (known: %s)",
                            name, ", ".join(SETTINGS))
                continue
            if name != "summary_quantiles" and value not in ("true", "false"):
                log.warning("--metrics-config %s=%s: the value is 'true' or 'false'; read as %s",
                            name, value, str(kw[name]).lower())
        if not enabled:   # Triton: allow_{cpu,gpu}_metrics &= allow_metrics
            kw.update(histogram_latencies=False, summary_latencies=False)
            cpu = gpu = False
        return cls(enabled=enabled, interval_ms=interval_ms, cpu=cpu, gpu=gpu, **kw)

    @classmethod
    def from_settings(cls, settings: Any) -> MetricsOptions:
        """From a SchedulerSettings (its metrics fields)."""
        return cls.parse(getattr(settings, "metrics_config", ()),
                         getattr(settings, "metrics_interval_ms", DEFAULT_INTERVAL_MS),
                         getattr(settings, "allow_metrics", True),
                         getattr(settings, "allow_cpu_metrics", True),
                         getattr(settings, "allow_gpu_metrics", True))


def histogram_buckets(config: Any, model: str = "") -> dict[str, tuple[float, ...]]:
    """A model's histogram bucket bounds: the defaults, overridden per family by its config's
    `model_metrics { metric_control { metric_identifier { family } histogram_options
    { buckets } } }` (unknown families are warned about in Triton's words and ignored)."""
    out = dict(DEFAULT_BUCKETS)
    if config is None or not config.HasField("model_metrics"):
        return out
    for control in config.model_metrics.metric_control:
        family = control.metric_identifier.family
        if family not in out:
            log.warning("Metric family '%s' in 'metric_identifier' is not a customizable metric "
                        "in Triton core.", family)
            continue
        bounds = tuple(control.histogram_options.buckets)
        if list(bounds) != sorted(set(bounds)):
            log.warning("model '%s': histogram buckets of '%s' are sorted and deduplicated: "
                        "%s", model, family, sorted(set(bounds)))
            bounds = tuple(sorted(set(bounds)))
        out[family] = bounds
    return out


def metric_tags(config: Any) -> tuple[tuple[str, str], ...]:
    """A model's `metric_tags`: each is one more label on its series, named with a leading
    underscore as Triton names it (MetricModelReporter::GetMetricLabels)."""
    if config is None:
        return ()
    return tuple(sorted((f"_{k}", v) for k, v in config.metric_tags.items()))
