"""Per-version inference statistics: the one record behind the statistics extension and the
Prometheus metrics, so the two can never disagree.

The scheduler sees each request arrive, leave the queue and finish (BatchDone), and the worker
reports each batch's compute_input / compute_infer / compute_output time. As in Triton, every
request of a batch is charged the whole batch's compute time in inference_stats, while
batch_stats counts executions per batch size.

The opt-in latency histograms and summaries (--metrics-config histogram_latencies=true,
summary_latencies=true) cost one struct.pack per request here; metrics_latency.py folds them
when /metrics is read. Off (the default), they cost one attribute test per batch.
"""
from __future__ import annotations

import time
from typing import Any

from services.common import messages as m
from services.scheduler.metrics_config import FIRST_RESPONSE, MetricsOptions, histogram_buckets, metric_tags
from services.scheduler.metrics_latency import FOLD_BYTES, RECORD, LatencyRecorder

_pack = RECORD.pack
# Bucket bounds of the executed-batch-size histogram (Prometheus `le`), +Inf implied.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class VersionStats:
    __slots__ = ("batcher", "batches", "cache_hits", "cache_misses", "cached", "compute_infer",
                 "compute_input", "compute_output", "direct_pending", "execution_count", "fail",
                 "failures", "inference_count", "last_inference_ms", "latency", "queue", "success",
                 "tags")

    def __init__(self, latency: LatencyRecorder | None = None,
                 tags: tuple[tuple[str, str], ...] = ()) -> None:
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        # [count, ns] pairs
        self.success = [0, 0]
        self.fail = [0, 0]
        self.queue = [0, 0]
        self.compute_input = [0, 0]
        self.compute_infer = [0, 0]
        self.compute_output = [0, 0]
        self.cache_hits = [0, 0]
        self.cache_misses = [0, 0]
        self.cached = False                         # its requests are looked up (response cache)
        self.batches: dict[int, list[int]] = {}     # batch size -> [executions, in_ns, infer_ns, out_ns]
        self.failures: dict[str, int] = {}          # Prometheus failure reason -> requests
        self.batcher = None                         # the version's Batcher (VersionQueue sets it)
        self.direct_pending = 0                     # waiting at its instances (routes.py, per scrape)
        self.latency = latency                      # histograms / summaries, when enabled
        self.tags = tags                            # extra labels: the config's metric_tags

    @property
    def pending(self) -> int:
        """nv_inference_pending_request_count, as Triton counts it: requests waiting to
        execute (queued, or held by the rate limiter, or sent to an instance directly and
        not begun), not those a worker is running."""
        queued = len(self.batcher) if self.batcher is not None else 0
        return queued + self.direct_pending

    def executed(self, rows: int, requests: list[tuple[int, int]], failed: int,
                 compute: tuple[int, int, int], now_ns: int, first: list[int] | None = None) -> None:
        """One batch finished. ``requests``: (arrival_ns, dispatch_ns) of each request;
        the first ``len(requests) - failed`` succeeded (a batch fails or succeeds whole).
        ``first``: BatchDone.first, when response senders answered (each request's first
        response may have left before ``now_ns``, or be still to come)."""
        cin, cinf, cout = compute
        self.execution_count += 1
        self.last_inference_ms = time.time_ns() // 1_000_000
        b = self.batches.get(rows)
        if b is None:
            b = self.batches[rows] = [0, 0, 0, 0]
        b[0] += 1
        b[1] += cin
        b[2] += cinf
        b[3] += cout
        if failed:
            for arrival, _ in requests:
                self.failed(now_ns - arrival, "BACKEND")
            return
        n = len(requests)
        self.inference_count += rows
        self.success[0] += n
        self.queue[0] += n
        self.compute_input[0] += n
        self.compute_input[1] += cin * n
        self.compute_infer[0] += n
        self.compute_infer[1] += cinf * n
        self.compute_output[0] += n
        self.compute_output[1] += cout * n
        success, queue = self.success, self.queue
        lat = self.latency
        if lat is None:
            for arrival, dispatched in requests:
                success[1] += now_ns - arrival
                queue[1] += dispatched - arrival
            return
        if first:   # their first responses are timed apart (LatencyRecorder.streamed)
            lat.sent(now_ns, requests, first)
            buf = lat.streamed
        else:
            buf = lat.records   # LatencyRecorder.batch, inlined: this runs per request
        for arrival, dispatched in requests:
            success[1] += now_ns - arrival
            queue[1] += dispatched - arrival
            buf += _pack(now_ns, arrival, dispatched, cin, cinf, cout)
        if len(buf) >= FOLD_BYTES:
            lat.fold()

    def first_response(self, duration_ns: int) -> None:
        """A request's first response, sent after its batch was done (a decoupled model's,
        from its own thread), left ``duration_ns`` after the request arrived."""
        if self.latency is not None:
            self.latency.first_response(duration_ns)

    def completed(self, rows: int, duration_ns: int) -> None:
        """A request answered without an execution of its own: an ensemble's. Triton counts
        it as one execution of its batch size (core ensemble_scheduler.cc RequestTracker:
        UpdateSuccessWithDuration, UpdateInferBatchStatsWithDuration), so the ensemble has
        an execution_count, batch_stats and queue / compute records as any model has; its
        steps count in their composing models' statistics too. Triton's compute durations
        here are the sums of its steps'; the workers do not report those per request, so
        they are 0 (docs/compat.md)."""
        rows = max(1, rows)
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.inference_count += rows
        self.execution_count += 1
        self.success[0] += 1
        self.success[1] += duration_ns
        for record in (self.queue, self.compute_input, self.compute_infer, self.compute_output):
            record[0] += 1
        b = self.batches.get(rows)
        if b is None:
            b = self.batches[rows] = [0, 0, 0, 0]
        b[0] += 1
        if self.latency is not None:
            self.latency.answered(time.monotonic_ns(), duration_ns, True)

    def cache_hit(self, queue_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache, as Triton counts it: a success (and
        a queue record, up to the lookup), no inference or execution."""
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.success[0] += 1
        self.success[1] += queue_ns + lookup_ns
        self.queue[0] += 1
        self.queue[1] += queue_ns
        self.cache_hits[0] += 1
        self.cache_hits[1] += lookup_ns
        if self.latency is not None:
            now = time.monotonic_ns()
            if self.latency.first is not None:
                self.latency.answered(now, queue_ns + lookup_ns, True)
            self.latency.cached(now, queue_ns, lookup_ns)

    def cache_miss(self, ns: int) -> None:
        """A miss's answer was inserted (or refused): ``ns`` is its lookup and insertion."""
        self.cache_misses[0] += 1
        self.cache_misses[1] += ns
        if self.latency is not None:
            self.latency.cached(time.monotonic_ns(), -1, ns)

    def failed(self, duration_ns: int, reason: str) -> None:
        """A request that got an error outside a model execution (rejected at the queue,
        worker lost, version unloaded), or one of a failed batch."""
        self.fail[0] += 1
        self.fail[1] += duration_ns
        self.failures[reason] = self.failures.get(reason, 0) + 1
        if self.latency is not None:   # an error is a response: it counts as the first one
            self.latency.answered(time.monotonic_ns(), duration_ns, False)

    def to_message(self, name: str, version: int) -> m.ModelStat:
        d = m.Duration
        return m.ModelStat(
            name, str(version), self.last_inference_ms, self.inference_count, self.execution_count,
            d(*self.success), d(*self.fail), d(*self.queue), d(*self.compute_input),
            d(*self.compute_infer), d(*self.compute_output), d(*self.cache_hits),
            d(*self.cache_misses),
            [m.BatchStat(bs, d(b[0], b[1]), d(b[0], b[2]), d(b[0], b[3]))
             for bs, b in sorted(self.batches.items())])


class StatsRegistry:
    """The record of each loaded version. A (re)load starts a fresh record, as Triton's new
    model object does; requests still running on the old one update the old record, which
    they hold a reference to. ``options`` says which latency families are recorded."""

    def __init__(self, options: MetricsOptions | None = None) -> None:
        self.options = options or MetricsOptions()
        self.versions: dict[tuple[str, int], VersionStats] = {}

    @classmethod
    def for_settings(cls, settings: Any) -> StatsRegistry:
        """The registry a scheduler's settings (its --metrics-* flags) ask for."""
        return cls(MetricsOptions.from_settings(settings))

    def fresh(self, model: str, version: int, config: Any = None) -> VersionStats:
        """A new record for a version being loaded with ``config`` (its model_metrics
        histogram buckets and metric_tags labels)."""
        o = self.options
        latency = None
        if o.histogram_latencies or o.summary_latencies:
            bounds = histogram_buckets(config, model)[FIRST_RESPONSE] if o.histogram_latencies else None
            latency = LatencyRecorder(bounds, o.summary_latencies)
        s = self.versions[(model, version)] = VersionStats(latency, metric_tags(config))
        return s

    def get(self, model: str, version: int) -> VersionStats:
        s = self.versions.get((model, version))
        if s is None:
            s = self.versions[(model, version)] = VersionStats()
        return s
