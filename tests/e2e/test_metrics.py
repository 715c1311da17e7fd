"""Prometheus metrics on --metrics-port, with Triton's names and labels."""
from __future__ import annotations

import re
import urllib.request

import numpy as np
import tritonclient.http as httpclient


def scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_counters_follow_requests_with_triton_names(server):
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.ones((3, 16), np.float32)
    inputs = [httpclient.InferInput("INPUT0", [3, 16], "FP32"),
              httpclient.InferInput("INPUT1", [3, 16], "FP32")]
    for i in inputs:
        i.set_data_from_numpy(x)
    before = scrape(server)
    key = 'model="add_sub",version="1"'
    for _ in range(4):
        client.infer("add_sub", inputs)
    after = scrape(server)

    def delta(family: str) -> float:
        name = f"{family}{{{key}}}"
        return after[name] - before.get(name, 0.0)

    assert delta("nv_inference_request_success") == 4
    assert delta("nv_inference_exec_count") == 4
    assert delta("nv_inference_count") == 12          # rows, not requests
    assert delta("nv_inference_compute_infer_duration_us") > 0
    assert after[f"nv_inference_pending_request_count{{{key}}}"] == 0
    # Triton's bare counter names: no prometheus_client "_total" / "_created" samples.
    assert not [n for n in after if re.match(r"nv_\w+_(total|created)\{", n)]
