"""Prometheus metrics for every model, served by the scheduler on --metrics-port.

Names, types and labels are Triton's (reference/protocol.md §6), so dashboards and alerts
built for Triton keep working. prometheus_client would expose counters as `<name>_total`
plus `<name>_created`; Triton exposes the bare name, so the text format is written here.
The scheduler sees every request's fate, so it is the one place they are counted.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help), in exposition order
FAMILIES: dict[str, tuple[str, str]] = {
    "nv_inference_request_success": ("counter", "Number of successful inference requests, all batch sizes"),
    "nv_inference_request_failure": ("counter", "Number of failed inference requests, all batch sizes"),
    "nv_inference_count": ("counter", "Number of inferences performed (does not include cached requests)"),
    "nv_inference_exec_count": ("counter", "Number of model executions performed (does not include cached requests)"),
    "nv_inference_compute_input_duration_us": ("counter", "Cumulative compute input duration in microseconds"),
    "nv_inference_compute_infer_duration_us": ("counter", "Cumulative compute inference duration in microseconds"),
    "nv_inference_compute_output_duration_us": ("counter", "Cumulative inference compute output duration in microseconds"),
    "nv_inference_pending_request_count": ("gauge", "Instantaneous number of pending requests awaiting execution per-model."),
}


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self) -> None:
        # (family, model, version, reason) -> value; reason is "" except for failures.
        self.values: dict[tuple[str, str, int, str], float] = {}

    def _add(self, family: str, model: str, version: int, v: float, reason: str = "") -> None:
        key = (family, model, version, reason)
        self.values[key] = self.values.get(key, 0) + v

    def executed(self, model: str, version: int, batch: list[Any], done: Any, n: int) -> None:
        good = n - done.failed
        if good:
            self._add("nv_inference_request_success", model, version, good)
            rows = sum(p.req.batch_size for p in batch) if done.failed == 0 else good
            self._add("nv_inference_count", model, version, rows)
        if done.failed:
            self._add("nv_inference_request_failure", model, version, done.failed, "BACKEND")
        self._add("nv_inference_exec_count", model, version, 1)
        self._add("nv_inference_compute_input_duration_us", model, version, done.compute_input_ns // 1000)
        self._add("nv_inference_compute_infer_duration_us", model, version, done.compute_infer_ns // 1000)
        self._add("nv_inference_compute_output_duration_us", model, version, done.compute_output_ns // 1000)

    def failed(self, model: str, version: int, n: int) -> None:
        self._add("nv_inference_request_failure", model, version, n, "OTHER")

    def pending(self, model: str, version: int, delta: int) -> None:
        self._add("nv_inference_pending_request_count", model, version, delta)

    def render(self) -> str:
        by_family: dict[str, list[str]] = {f: [] for f in FAMILIES}
        for (family, model, version, reason), v in sorted(self.values.items()):
            labels = f'model="{_escape(model)}",version="{version}"'
            if reason:
                labels = f'{labels},reason="{reason}"'
            text_v = str(int(v)) if float(v).is_integer() else repr(float(v))
            by_family[family].append(f"{family}{{{labels}}} {text_v}")
        out: list[str] = []
        for family, (kind, text) in FAMILIES.items():
            if by_family[family]:
                out += [f"# HELP {family} {text}", f"# TYPE {family} {kind}", *by_family[family]]
        return "\n".join(out) + "\n"

    async def serve(self, host: str, port: int) -> web.AppRunner:
        async def handle(_: web.Request) -> web.Response:
            return web.Response(body=self.render().encode(), headers={"Content-Type": CONTENT_TYPE})
        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_port=True).start()
        return runner
