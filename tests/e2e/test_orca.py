"""The ORCA load report end to end: a generate request with `endpoint-load-metrics-format:
text|json` gets an `endpoint-load-metrics` header computed from the KV-cache block metrics a
model publishes (nv_trt_llm_kv_cache_block_metrics, here through pb_utils.MetricFamily), as
Triton (server src/orca_http.cc, since 25.03) writes it on generate and generate_stream
answers. The infer endpoint, another format, or no such metrics: no header."""
from __future__ import annotations

import json
import urllib.request

import pytest
import requests
from conftest import start_server, wait_until
from models_python import io_config, python_model

KV = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Publishes TensorRT-LLM's KV-cache family: 64 tokens per block, 3 of 12 blocks used."""

    def initialize(self, args):
        family = pb_utils.MetricFamily(name="nv_trt_llm_kv_cache_block_metrics",
                                       description="KV cache blocks",
                                       kind=pb_utils.MetricFamily.GAUGE)
        self.blocks = {t: family.Metric(labels={"kv_cache_block_type": t})
                       for t in ("tokens_per", "used", "max")}
        for t, v in (("tokens_per", 64), ("used", 3), ("max", 12)):
            self.blocks[t].set(v)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "text_output", np.array([b"ok"], dtype=object))]) for _ in requests]
'''
TEXT = "TEXT named_metrics.kv_cache_utilization=0.250000, named_metrics.max_token_capacity=768"
JSON = {"named_metrics": {"kv_cache_utilization": 0.25, "max_token_capacity": 768}}


def _repo(root, publish: bool):
    python_model(root, "kv", KV if publish else KV.replace("self.blocks[t].set(v)", "pass")
                 .replace('("tokens_per", "used", "max")}', "()}"), io_config(
        "kv", [("text_input", "TYPE_STRING", "[ 1 ]")], [("text_output", "TYPE_STRING", "[ 1 ]")]))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server(_repo(tmp_path_factory.mktemp("orca") / "models", True)) as srv:
        def published():
            with urllib.request.urlopen(srv.metrics_url, timeout=5) as r:
                return b'kv_cache_block_type="max"' in r.read()
        wait_until(published, 30, "the model's KV-cache metrics")
        yield srv


def _generate(srv, path: str, fmt: str | None):
    headers = {} if fmt is None else {"endpoint-load-metrics-format": fmt}
    return requests.post(f"http://{srv.http_url}/v2/models/kv/{path}",
                         json={"text_input": "hi"}, headers=headers, timeout=30)


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_text_and_json_reports(server, path):
    r = _generate(server, path, "text")
    assert r.status_code == 200, r.text
    assert r.headers["endpoint-load-metrics"] == TEXT
    r = _generate(server, path, "json")
    assert r.status_code == 200, r.text
    value = r.headers["endpoint-load-metrics"]
    assert value.startswith("JSON ") and json.loads(value[5:]) == JSON


@pytest.mark.parametrize("fmt", [None, "xml"])
def test_no_header_unless_asked_in_a_known_format(server, fmt):
    r = _generate(server, "generate", fmt)
    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers


def test_infer_endpoint_has_no_report(server):
    body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": ["hi"]}]}
    r = requests.post(f"http://{server.http_url}/v2/models/kv/infer", json=body,
                      headers={"endpoint-load-metrics-format": "text"}, timeout=30)
    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers


def test_no_report_without_the_kv_metrics(tmp_path):
    with start_server(_repo(tmp_path / "models", False)) as srv:
        r = _generate(srv, "generate", "text")
        assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers
