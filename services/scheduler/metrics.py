"""Prometheus metrics for every model, served by the scheduler on --metrics-port.

Names, types, help texts and labels are Triton's (core/src/metrics.cc, metric_model_reporter
.cc; ../shared/reference/protocol.md §6), so dashboards and alerts built for Triton keep working, and
so is what --metrics-config turns on and off. prometheus_client would expose counters as
`<name>_total` plus `<name>_created`; Triton exposes the bare name, so the text format is
written here, families in Triton's order (counters, gauges, histograms, summaries). The
figures are read from the same StatsRegistry the statistics extension answers from.

Beyond Triton, as its users asked: nv_inference_pending_request_count is always on, and
nv_inference_batch_size is a histogram of the batch sizes actually executed, so a batcher
that forms smaller batches than expected shows up on a dashboard.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from services.scheduler.metrics_config import FIRST_RESPONSE, MetricsOptions
from services.scheduler.metrics_host import HostMetrics
from services.scheduler.metrics_latency import CACHE_SUMMARIES, SUMMARIES
from services.scheduler.stats import BATCH_BUCKETS, StatsRegistry, VersionStats

log = logging.getLogger("trireme.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_US = 1000
# name -> (type, help, value of one VersionStats; None: the failures), in exposition order
COUNTERS: dict[str, tuple[str, str, Callable[[VersionStats], int] | None]] = {
    "nv_inference_request_success": (
        "counter", "Number of successful inference requests, all batch sizes",
        lambda s: s.success[0]),
    "nv_inference_request_failure": (
        "counter", "Number of failed inference requests, all batch sizes", None),
    "nv_inference_count": (
        "counter", "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count),
    "nv_inference_exec_count": (
        "counter", "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count),
    # Triton counts successes only in the request duration (InferenceStatsAggregator)
    "nv_inference_request_duration_us": (
        "counter", "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: s.success[1] // _US),
    "nv_inference_queue_duration_us": (
        "counter", "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.queue[1] // _US),
    "nv_inference_compute_input_duration_us": (
        "counter", "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.compute_input[1] // _US),
    "nv_inference_compute_infer_duration_us": (
        "counter", "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.compute_infer[1] // _US),
    "nv_inference_compute_output_duration_us": (
        "counter",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
        lambda s: s.compute_output[1] // _US),
    "nv_inference_pending_request_count": (
        "gauge", "Instantaneous number of pending requests awaiting execution per-model.",
        lambda s: s.pending),
}
# --metrics-config counter_latencies=false leaves these out
LATENCY_COUNTERS = frozenset(n for n in COUNTERS if n.endswith("_duration_us"))
FIRST_RESPONSE_HELP = "Duration from request to first response in milliseconds"
# (summary family, help) in the order of metrics_latency.SUMMARIES; the compute ones' help
# texts say "Cumulative" in Triton too.
SUMMARY_FAMILIES = (
    ("nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)"),
    ("nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)"),
    ("nv_inference_compute_input_summary_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_infer_summary_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("nv_inference_compute_output_summary_us",
     "Cumulative inference compute output duration in microseconds (does not include cached "
     "requests)"),
)
CACHE_SUMMARY_FAMILIES = (
    ("nv_cache_hit_summary_per_model",
     "Summary of cache hit counts/durations per model, in microseconds."),
    ("nv_cache_miss_summary_per_model",
     "Summary of cache miss counts/durations per model, in microseconds."),
)
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
# Triton's per-model response cache counters, for the versions whose requests are looked up
CACHE_COUNTERS: tuple[tuple[str, str, Callable[[VersionStats], int]], ...] = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model",
     lambda s: s.cache_hits[0]),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     lambda s: s.cache_hits[1] // _US),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model",
     lambda s: s.cache_misses[0]),
    ("nv_cache_miss_duration_per_model",
     "Total cache miss (insert+lookup) duration per model, in microseconds",
     lambda s: s.cache_misses[1] // _US),
)
HISTOGRAM = ("nv_inference_batch_size", "Batch sizes of model executions")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self, stats: StatsRegistry, ready: Callable[[], list],
                 custom: Callable[[], list] = list, cluster: Callable[[], list[str]] = list,
                 split: Callable[[str], tuple[str, str]] = lambda key: (key, ""),
                 flush: Callable[[], Awaitable[None]] | None = None,
                 cache: Callable[[], list[tuple[str, str, float]]] = list) -> None:
        self.stats = stats
        self.cache = cache          # () -> the response cache's gauges (family, help, value)
        self.flush = flush          # brings in the statistics workers keep (direct path)
        self.ready = ready          # () -> sorted [(model key, version)] ready now: unloaded drop out
        self.split = split          # model key -> (name, namespace: --model-namespacing's, or "")
        self.custom = custom        # () -> per worker, its model's MetricFamilyRecords
        self.cluster = cluster      # () -> lines of cluster_families()
        o = stats.options
        self.host = HostMetrics(o.cpu, o.gpu, o.interval_ms)

    @property
    def options(self) -> MetricsOptions:
        return self.stats.options

    def render(self, now_ns: int | None = None) -> str:
        """The exposition text; ``now_ns`` (monotonic) ends the summaries' windows."""
        o = self.options
        rows = [(k, self.stats.versions[k]) for k in self.ready() if k in self.stats.versions]
        labels = {key: _labels(*self.split(key[0]), key[1], s) for key, s in rows}
        out: list[str] = []
        out += self._model_families(rows, labels, "counter")
        out += _cache_counters([r for r in rows if r[1].cached], labels)
        out += self.host.counters()
        out += self._model_families(rows, labels, "gauge")
        for family, text, value in self.cache():
            out += [f"# HELP {family} {text}", f"# TYPE {family} gauge", f"{family} {_num(value)}"]
        out += self.host.gauges()
        if rows:
            for _, s in rows:
                if s.latency is not None:
                    s.latency.fold()
            out += self._histograms(rows, labels)
            if o.summary_latencies:
                out += _summaries(rows, labels, [q for q, _ in o.quantiles],
                                  time.monotonic_ns() if now_ns is None else now_ns)
        return "\n".join(out + _custom(self.custom()) + self.cluster()) + "\n"

    def _model_families(self, rows: list, labels: dict, kind: str) -> list[str]:
        out: list[str] = []
        for family, (k, text, value) in COUNTERS.items() if rows else ():
            if k != kind or (family in LATENCY_COUNTERS and not self.options.counter_latencies):
                continue
            out += [f"# HELP {family} {text}", f"# TYPE {family} {kind}"]
            for key, s in rows:
                if value is None:     # failures, one series per reason as Triton
                    out += [f'{family}{{{labels[key]},reason="{reason}"}} {s.failures.get(reason, 0)}'
                            for reason in FAILURE_REASONS]
                else:
                    out.append(f"{family}{{{labels[key]}}} {value(s)}")
        return out

    def _histograms(self, rows: list, labels: dict) -> list[str]:
        out: list[str] = []
        if self.options.histogram_latencies:
            out += [f"# HELP {FIRST_RESPONSE} {FIRST_RESPONSE_HELP}",
                    f"# TYPE {FIRST_RESPONSE} histogram"]
            for key, s in rows:
                h = s.latency.first if s.latency is not None else None
                if h is None:
                    continue
                lab = labels[key]   # prometheus-cpp's order: count, sum, buckets
                out += [f"{FIRST_RESPONSE}_count{{{lab}}} {h.count}",
                        f"{FIRST_RESPONSE}_sum{{{lab}}} {_num(h.sum)}"]
                bounds = [_num(b) for b in h.bounds.tolist()] + ["+Inf"]
                out += [f'{FIRST_RESPONSE}_bucket{{{lab},le="{b}"}} {n}'
                        for b, n in zip(bounds, h.cumulative())]
        name, text = HISTOGRAM
        out += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
        for key, s in rows:
            out += _histogram(name, labels[key], s)
        return out

    async def serve(self, host: str, port: int) -> web.AppRunner:
        """Serve /metrics; the CPU/GPU poller runs until the returned runner is cleaned up."""
        async def handle(_: web.Request) -> web.Response:
            if self.flush is not None:
                await self.flush()
            return web.Response(body=self.render().encode(), headers={"Content-Type": CONTENT_TYPE})

        async def stop_host(_: web.Application) -> None:
            await self.host.stop()
        app = web.Application()
        app.router.add_get("/metrics", handle)
        app.on_cleanup.append(stop_host)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_port=True).start()
        log.info("Started Metrics Service at %s:%d", host, port)
        self.host.start()
        return runner


def _cache_counters(rows: list, labels: dict) -> list[str]:
    out: list[str] = []
    for family, text, value in CACHE_COUNTERS if rows else ():
        out += [f"# HELP {family} {text}", f"# TYPE {family} counter"]
        out += [f"{family}{{{labels[key]}}} {value(s)}" for key, s in rows]
    return out


def _labels(name: str, namespace: str, version: int, s: VersionStats) -> str:
    tags = "".join(f',{k}="{_escape(v)}"' for k, v in s.tags)
    ns = f',namespace="{_escape(namespace)}"' if namespace else ""   # (Triton's, when namespacing)
    return f'model="{_escape(name)}"{ns},version="{version}"{tags}'


def _summaries(rows: list, labels: dict, qs: list[float], now_ns: int) -> list[str]:
    out: list[str] = []
    cached = [r for r in rows if r[1].cached]
    for which, (name, text), among in [*((w, f, rows) for w, f in zip(SUMMARIES, SUMMARY_FAMILIES)),
                                       *((w, f, cached) for w, f in zip(CACHE_SUMMARIES,
                                                                        CACHE_SUMMARY_FAMILIES))]:
        if not among:
            continue
        out += [f"# HELP {name} {text}", f"# TYPE {name} summary"]
        for key, s in among:
            # (Triton: no request summary for a model with a cache, its hits would mislead)
            if s.latency is None or s.latency.summaries is None or which == "request" and s.cached:
                continue
            sm, lab = s.latency.summaries[which], labels[key]
            out += [f"{name}_count{{{lab}}} {sm.count}", f"{name}_sum{{{lab}}} {sm.sum}"]
            out += [f'{name}{{{lab},quantile="{_num(q)}"}} {_num(v)}'
                    for q, v in zip(qs, sm.quantiles(qs, now_ns))]
    return out


def cluster_families(frontends: dict[str, int], hosts: dict[str, int]) -> list[str]:
    """Trireme's own: where requests enter and where instances run, so that a deployment
    shows its frontends sharing the load and its worker hosts holding the instances."""
    out = ["# HELP trireme_frontend_requests Inference requests received from each frontend "
           "(by the address its results go to)", "# TYPE trireme_frontend_requests counter"]
    out += [f'trireme_frontend_requests{{frontend="{_escape(f)}"}} {n}'
            for f, n in sorted(frontends.items())]
    out += ["# HELP trireme_worker_host_instances Model instances running on each worker host",
            "# TYPE trireme_worker_host_instances gauge"]
    out += [f'trireme_worker_host_instances{{host="{_escape(h)}"}} {n}'
            for h, n in sorted(hosts.items())]
    return out


def _histogram(name: str, labels: str, s: VersionStats) -> list[str]:
    lines = []
    total = rows = 0
    sizes = sorted(s.batches.items())
    i = 0
    for bound in BATCH_BUCKETS:
        while i < len(sizes) and sizes[i][0] <= bound:
            total += sizes[i][1][0]
            rows += sizes[i][0] * sizes[i][1][0]
            i += 1
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
    for bs, b in sizes[i:]:
        total += b[0]
        rows += bs * b[0]
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {total}')
    lines.append(f"{name}_sum{{{labels}}} {rows}")
    lines.append(f"{name}_count{{{labels}}} {total}")
    return lines


def _custom(per_worker: list[list]) -> list[str]:
    """Python models' custom metrics (pb_utils.MetricFamily). Instances of a model share a
    family as they would in Triton's one process: counters and histograms of the same
    labels add up; a gauge shows the last value set."""
    families: dict[str, tuple[str, str, dict]] = {}
    for records in per_worker:
        for f in records:
            kind, _, series = families.setdefault(f.name, (f.kind, f.description, {}))
            for s in f.series:
                key = tuple(sorted(s.labels.items()))
                cur = series.get(key)
                if cur is None or kind == "gauge" or cur.buckets != s.buckets:
                    series[key] = msgspec.structs.replace(s, counts=list(s.counts))
                else:
                    cur.value += s.value
                    cur.counts = [a + b for a, b in zip(cur.counts, s.counts)]
                    cur.sum += s.sum
                    cur.count += s.count
    out: list[str] = []
    for name, (kind, text, series) in sorted(families.items()):
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for key, s in sorted(series.items()):
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
            if kind != "histogram":
                out.append(f"{name}{{{labels}}} {_num(s.value)}" if labels else f"{name} {_num(s.value)}")
                continue
            sep = "," if labels else ""
            for bound, n in zip(s.buckets, s.counts):
                out.append(f'{name}_bucket{{{labels}{sep}le="{_num(bound)}"}} {n}')
            out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {s.count}')
            out.append(f"{name}_sum{{{labels}}} {_num(s.sum)}")
            out.append(f"{name}_count{{{labels}}} {s.count}")
    return out


def _num(v: float) -> str:
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return str(int(f)) if f.is_integer() else repr(f)


def memory_families(loads: dict[str, int], evictions: dict[str, int],
                    resident: dict[tuple[str, int], int]) -> list[str]:
    """Trireme's own, for memory-aware serving (memory.py): how often each model loaded and
    was evicted, and what its loaded versions hold (their workers' size after load)."""
    out = ["# HELP trireme_model_loads_total Loads of each model (by request, at start-up or "
           "on demand)", "# TYPE trireme_model_loads_total counter"]
    out += [f'trireme_model_loads_total{{model="{_escape(k)}"}} {n}' for k, n in sorted(loads.items())]
    out += ["# HELP trireme_model_evictions_total Unloads of each model to fit the model memory "
            "budget", "# TYPE trireme_model_evictions_total counter"]
    out += [f'trireme_model_evictions_total{{model="{_escape(k)}"}} {n}'
            for k, n in sorted(evictions.items())]
    out += ["# HELP trireme_model_resident_bytes Bytes the instances of each loaded model version "
            "hold (their workers' proportional set size after load and warmup)",
            "# TYPE trireme_model_resident_bytes gauge"]
    out += [f'trireme_model_resident_bytes{{model="{_escape(k)}",version="{v}"}} {n}'
            for (k, v), n in sorted(resident.items())]
    return out
