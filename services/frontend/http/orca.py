"""The `endpoint-load-metrics` response header (ORCA load report), as Triton writes it.

Triton (server/src/orca_http.cc, since 25.03; not in 2.51) adds it to the responses of the
generate endpoints when the request carries `endpoint-load-metrics-format: text` or `json`,
from the KV-cache block metrics a model publishes (TensorRT-LLM's custom family
`nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"|"used"|"max"}`):

    JSON {"named_metrics":{"kv_cache_utilization":0.25,"max_token_capacity":4096}}
    TEXT named_metrics.kv_cache_utilization=0.250000, named_metrics.max_token_capacity=4096

Any other format, or no such metrics, means no header. Pure functions, and ``load_report``
which the generate routes call: it asks the scheduler for its /metrics text only when the
request carries the format header (a Python model publishes the family through
pb_utils.MetricFamily; the scheduler renders it on /metrics).
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any

log = logging.getLogger(__name__)

REQUEST_HEADER = "endpoint-load-metrics-format"
RESPONSE_HEADER = "endpoint-load-metrics"
KV_FAMILY = "nv_trt_llm_kv_cache_block_metrics"
KV_TYPE_LABEL = "kv_cache_block_type"
FORMATS = ("text", "json")

# Triton's MetricFamilyExtractor: the family, its labels, a non-negative number.
_SAMPLE = re.compile(re.escape(KV_FAMILY) + r"(?:\{(.*?)\})?\s*(\d+(?:\.\d+)?)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_cache_metrics(prometheus_text: str) -> tuple[float, float] | None:
    """(kv_cache_utilization, max_token_capacity) from the exposition text: used / max
    blocks (0 when max is 0) and max blocks * tokens per block; None unless all three
    block types are there (Triton's ExtractKVMetrics)."""
    found: dict[str, float] = {}
    for m in _SAMPLE.finditer(prometheus_text):
        labels = dict(_LABEL.findall(m.group(1) or ""))
        kind = labels.get(KV_TYPE_LABEL)
        if kind in ("tokens_per", "used", "max"):
            found[kind] = float(m.group(2))
    if len(found) < 3:
        return None
    utilization = found["used"] / found["max"] if found["max"] > 0 else 0.0
    return utilization, found["max"] * found["tokens_per"]


def header_value(fmt: str, kv_utilization: float, max_token_capacity: float) -> str | None:
    """The header's value in ``fmt`` ("text" or "json"); None for any other format."""
    capacity = int(max_token_capacity)   # (Triton: a uint64)
    if fmt == "json":
        body = {"named_metrics": {"kv_cache_utilization": float(kv_utilization),
                                  "max_token_capacity": capacity}}
        return "JSON " + json.dumps(body, separators=(",", ":"))
    if fmt == "text":
        return (f"TEXT named_metrics.kv_cache_utilization={kv_utilization:f}, "
                f"named_metrics.max_token_capacity={capacity}")
    return None


def endpoint_load_metrics(fmt: str | None, prometheus_text: str) -> str | None:
    """The `endpoint-load-metrics` value for a request whose `endpoint-load-metrics-format`
    header is ``fmt`` (None: absent), or None: no header to add."""
    if fmt not in FORMATS:
        return None
    kv = kv_cache_metrics(prometheus_text)
    return header_value(fmt, *kv) if kv is not None else None


async def load_report(dp: Any, request: Any) -> dict[str, str] | None:
    """The header for a generate request that asks for one, when the metrics have the
    KV-cache family (Triton's StartResponse logs an error and writes none otherwise). Read
    as the request starts, so a stream holds nothing while it is asked for."""
    fmt = request.headers.get(REQUEST_HEADER)
    if fmt is None:
        return None
    if fmt not in FORMATS:
        log.error("orca_type is set to an invalid type: %s", fmt)
        return None
    value = endpoint_load_metrics(fmt, await dp.metrics_text())
    if value is None:
        log.error("%s request header is set but no KV-cache metrics were found (%s); no "
                  "header written", REQUEST_HEADER, KV_FAMILY)
        return None
    return {RESPONSE_HEADER: value}
