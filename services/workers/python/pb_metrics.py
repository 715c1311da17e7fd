"""A Python model's custom metrics (pb_utils.MetricFamily, pb_utils.Metric): kept in the
worker, sent to the scheduler as a snapshot with the next BatchDone after a change, and
rendered on /metrics beside Triton's."""
from __future__ import annotations

import re
from typing import Any, ClassVar

from services.workers.python.pb_errors import TritonModelException

_families: dict[str, MetricFamily] = {}
_metrics_changed = False     # the worker sends a snapshot with its next BatchDone when set
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class MetricFamily:
    """A custom metric family, exported on the server's /metrics beside Triton's."""
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    _KINDS: ClassVar[dict[int, str]] = {0: "counter", 1: "gauge", 2: "histogram"}

    def __init__(self, name: str, description: str, kind: int) -> None:
        if not _METRIC_NAME.fullmatch(name or ""):
            raise TritonModelException(f"invalid metric family name '{name}'")
        if kind not in self._KINDS:
            raise TritonModelException(f"unknown metric kind {kind} for metric family '{name}'")
        known = _families.get(name)
        if known is not None and (known._kind, known._description) != (kind, description):
            raise TritonModelException(f"metric family '{name}' already exists with a "
                                       "different kind or description")
        self._name, self._description, self._kind = name, description, kind
        self._metrics: dict[tuple, Metric] = known._metrics if known else {}
        _families[name] = self

    def Metric(self, labels: dict[str, str] | None = None,
               buckets: list[float] | None = None) -> Metric:
        if (self._kind == self.HISTOGRAM) != (buckets is not None):
            raise TritonModelException("buckets are required for, and only for, histogram metrics")
        key = tuple(sorted((labels or {}).items()))
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = Metric(self._kind, dict(key), buckets)
        return metric

    def _record(self) -> Any:
        from services.common.messages import MetricFamilyRecord
        return MetricFamilyRecord(self._name, self._description, self._KINDS[self._kind],
                                  [m._series() for m in self._metrics.values()])


class Metric:
    def __init__(self, kind: int, labels: dict[str, str], buckets: list[float] | None) -> None:
        self._kind, self._labels = kind, labels
        self._value = 0.0
        self._buckets = sorted(float(b) for b in buckets or ())
        self._counts = [0] * len(self._buckets)
        self._sum, self._count = 0.0, 0

    def _changed(self) -> None:
        global _metrics_changed
        _metrics_changed = True

    def increment(self, value: float) -> None:
        if self._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("increment is not supported for histogram metrics")
        if self._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a counter can only be incremented by a value >= 0")
        self._value += value
        self._changed()

    def set(self, value: float) -> None:
        if self._kind != MetricFamily.GAUGE:
            raise TritonModelException("set is only supported for gauge metrics")
        self._value = float(value)
        self._changed()

    def observe(self, value: float) -> None:
        if self._kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("observe is only supported for histogram metrics")
        for i, bound in enumerate(self._buckets):
            if value <= bound:
                self._counts[i] += 1
        self._sum += value
        self._count += 1
        self._changed()

    def value(self) -> float:
        if self._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("value is not supported for histogram metrics")
        return self._value

    def _series(self) -> Any:
        from services.common.messages import MetricSeries
        return MetricSeries(self._labels, self._value, self._buckets, list(self._counts),
                            self._sum, self._count)


def take_metrics() -> list | None:
    """A snapshot of every family if something changed since the last one (the worker's)."""
    global _metrics_changed
    if not _metrics_changed:
        return None
    _metrics_changed = False
    return [f._record() for f in _families.values()]
