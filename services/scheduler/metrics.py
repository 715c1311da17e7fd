"""Prometheus metrics for every model, served by the scheduler on --metrics-port.

Names and labels are Triton's (reference/protocol.md §6), so dashboards built for Triton
keep working. The scheduler sees every request's fate, so it is the one place they count.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LABELS = ("model", "version")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.success = Counter("nv_inference_request_success", "Number of successful inference requests",
                               _LABELS, registry=r)
        self.failure = Counter("nv_inference_request_failure", "Number of failed inference requests",
                               (*_LABELS, "reason"), registry=r)
        self.count = Counter("nv_inference_count", "Number of inferences performed", _LABELS, registry=r)
        self.exec_count = Counter("nv_inference_exec_count", "Number of model executions performed",
                                  _LABELS, registry=r)
        self.compute_input = Counter("nv_inference_compute_input_duration_us",
                                     "Cumulative compute input duration in microseconds", _LABELS, registry=r)
        self.compute_infer = Counter("nv_inference_compute_infer_duration_us",
                                     "Cumulative compute inference duration in microseconds", _LABELS, registry=r)
        self.compute_output = Counter("nv_inference_compute_output_duration_us",
                                      "Cumulative inference compute output duration in microseconds",
                                      _LABELS, registry=r)
        self.pending_gauge = Gauge("nv_inference_pending_request_count",
                                   "Instantaneous number of pending requests awaiting execution per-model.",
                                   _LABELS, registry=r)
        # Prometheus client label lookups are not free: keep the children per (model, version).
        self._children: dict[tuple[str, int], tuple[Any, ...]] = {}

    def _c(self, model: str, version: int) -> tuple[Any, ...]:
        key = (model, version)
        c = self._children.get(key)
        if c is None:
            v = str(version)
            c = self._children[key] = (
                self.success.labels(model, v), self.count.labels(model, v),
                self.exec_count.labels(model, v), self.compute_input.labels(model, v),
                self.compute_infer.labels(model, v), self.compute_output.labels(model, v),
                self.pending_gauge.labels(model, v), self.failure.labels(model, v, "BACKEND"))
        return c

    def executed(self, model: str, version: int, batch: list[Any], done: Any, n: int) -> None:
        ok, count, execs, cin, cinf, cout, _, fail = self._c(model, version)
        good = n - done.failed
        if good:
            ok.inc(good)
            count.inc(sum(p.req.batch_size for p in batch) if done.failed == 0 else good)
        if done.failed:
            fail.inc(done.failed)
        execs.inc()
        cin.inc(done.compute_input_ns / 1000)
        cinf.inc(done.compute_infer_ns / 1000)
        cout.inc(done.compute_output_ns / 1000)

    def failed(self, model: str, version: int, n: int) -> None:
        self.failure.labels(model, str(version), "OTHER").inc(n)

    def pending(self, model: str, version: int, delta: int) -> None:
        self._c(model, version)[6].inc(delta)

    async def serve(self, host: str, port: int) -> web.AppRunner:
        async def handle(_: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})
        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_port=True).start()
        return runner
