"""Server-side numbers: the statistics extension (/v2/models/<m>/versions/<v>/stats, gRPC
ModelStatistics) read at each window's edges and diffed (ensembles: every composing model
too), and the Prometheus GPU metrics of --collect-metrics, sampled during the windows."""
from __future__ import annotations

import re
import threading
import urllib.request
from dataclasses import dataclass, field, fields

from services.perf.clients import Control

Key = tuple[str, str]   # (model, version)


@dataclass
class ServerStats:
    """Counts and summed ns of one model over a window (perf_analyzer's ServerSideStats)."""
    inference_count: int = 0
    execution_count: int = 0
    success_count: int = 0
    cumm_time_ns: int = 0
    queue_count: int = 0
    queue_time_ns: int = 0
    compute_input_count: int = 0
    compute_input_time_ns: int = 0
    compute_infer_count: int = 0
    compute_infer_time_ns: int = 0
    compute_output_count: int = 0
    compute_output_time_ns: int = 0
    cache_hit_count: int = 0
    cache_hit_time_ns: int = 0
    cache_miss_count: int = 0
    cache_miss_time_ns: int = 0
    composing: dict[Key, ServerStats] = field(default_factory=dict)


_COUNTERS = [f.name for f in fields(ServerStats) if f.name != "composing"]
_STATS = {"success": ("success_count", "cumm_time_ns"), "queue": ("queue_count", "queue_time_ns"),
          "compute_input": ("compute_input_count", "compute_input_time_ns"),
          "compute_infer": ("compute_infer_count", "compute_infer_time_ns"),
          "compute_output": ("compute_output_count", "compute_output_time_ns"),
          "cache_hit": ("cache_hit_count", "cache_hit_time_ns"),
          "cache_miss": ("cache_miss_count", "cache_miss_time_ns")}

Snapshot = dict[Key, dict[str, int]]


def _stats(values: dict[str, int]) -> ServerStats:
    out = ServerStats()
    for name, v in values.items():
        setattr(out, name, v)
    return out


def parse_entry(entry: dict) -> dict[str, int]:
    out = {"inference_count": int(entry.get("inference_count", 0)),
           "execution_count": int(entry.get("execution_count", 0))}
    infer = entry.get("inference_stats") or {}
    for stat, (count, ns) in _STATS.items():
        d = infer.get(stat) or {}
        out[count], out[ns] = int(d.get("count", 0)), int(d.get("ns", 0))
    return out


def snapshot(control: Control, model: str, version: str, all_models: bool) -> Snapshot:
    """The cumulative statistics now: of the model's version, or (ensembles) of every model."""
    entries = control.statistics() if all_models else control.statistics(model, version)
    return {(e["name"], str(e.get("version", ""))): parse_entry(e) for e in entries}


def _version(name: str, version: str, start: Snapshot, end: Snapshot) -> str:
    """A composing step without a version: the version of that model whose counts moved
    (perf_analyzer's DetermineStatsModelVersion), else its highest."""
    if version:
        return version
    known = [v for (n, v) in end if n == name]
    moved = [v for v in known if end[(name, v)] != start.get((name, v))]
    pick = moved or known
    return max(pick, key=lambda v: int(v) if v.isdigit() else -1) if pick else ""


def diff(start: Snapshot, end: Snapshot, model: str, version: str,
         composing: dict[str, list[Key]] | None = None) -> ServerStats:
    version = _version(model, version, start, end)
    before = start.get((model, version), {})
    after = end.get((model, version))
    if after is None:
        raise KeyError(f"missing statistics for requested model '{model}' version {version}")
    out = _stats({c: after.get(c, 0) - before.get(c, 0) for c in _COUNTERS})
    for step_model, step_version in (composing or {}).get(model, []):
        v = _version(step_model, step_version, start, end)
        if (step_model, v) in end:
            out.composing[(step_model, v)] = diff(start, end, step_model, v, composing)
        else:   # (a step never run: the ensemble's response came from the cache)
            out.composing[(step_model, v)] = ServerStats()
    return out


def merge(stats: list[ServerStats]) -> ServerStats:
    """The sum of windows (perf_analyzer's MergeServerSideStats)."""
    out = _stats({c: sum(getattr(s, c) for s in stats) for c in _COUNTERS})
    if stats:
        for key in stats[0].composing:
            out.composing[key] = merge([s.composing.get(key, ServerStats()) for s in stats])
    return out


# ------------------------------------------------------------------ Prometheus metrics

_GPU = {"nv_gpu_utilization": "gpu_utilization", "nv_gpu_power_usage": "gpu_power_usage",
        "nv_gpu_memory_used_bytes": "gpu_memory_used", "nv_gpu_memory_total_bytes":
        "gpu_memory_total"}
_LINE = re.compile(r'^(nv_gpu_\w+)\{[^}]*gpu_uuid="([^"]+)"[^}]*\}\s+(\S+)')


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """{metric: {gpu uuid: value}} of the GPU metrics perf_analyzer reports."""
    out: dict[str, dict[str, float]] = {v: {} for v in _GPU.values()}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in _GPU:
            out[_GPU[m.group(1)]][m.group(2)] = float(m.group(3))
    return out


class MetricsSampler:
    """Reads --metrics-url every --metrics-interval ms on a thread; `take()` returns and
    forgets what was read since the last call (one window's samples)."""

    def __init__(self, url: str, interval_ms: int) -> None:
        self.url = url if "://" in url else f"http://{url}"
        self.interval = interval_ms / 1000
        self.samples: list[dict[str, dict[str, float]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="perf metrics")
        self._thread.start()

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self.url, timeout=5) as r:
                sample = parse_metrics(r.read().decode())
        except OSError as e:
            self.error = f"failed to read metrics from {self.url}: {e}"
            return
        with self._lock:
            self.samples.append(sample)

    def _run(self) -> None:
        while True:
            self._read()
            if self._stop.wait(self.interval):
                return

    def take(self) -> list[dict[str, dict[str, float]]]:
        with self._lock:
            out, self.samples = self.samples, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def merge_metrics(samples: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """perf_analyzer's aggregation: utilization and power averaged, memory used the maximum,
    total memory the first value seen."""
    out: dict[str, dict[str, float]] = {v: {} for v in _GPU.values()}
    for key in ("gpu_utilization", "gpu_power_usage"):
        sums: dict[str, list[float]] = {}
        for s in samples:
            for gpu, v in s[key].items():
                sums.setdefault(gpu, []).append(v)
        out[key] = {g: sum(v) / len(v) for g, v in sums.items()}
    for s in samples:
        for gpu, v in s["gpu_memory_used"].items():
            out["gpu_memory_used"][gpu] = max(v, out["gpu_memory_used"].get(gpu, v))
        for gpu, v in s["gpu_memory_total"].items():
            out["gpu_memory_total"].setdefault(gpu, v)
    return out
