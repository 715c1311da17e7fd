"""Triton's full metrics set on a served repository: --metrics-config histograms and
summaries, model_metrics buckets, metric_tags labels, failure reasons, CPU metrics, and the
families each flag turns off (qa/L0_metrics checks the same names)."""
from __future__ import annotations

import queue
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import models
from tests.conftest import start_server, wait_until
from tests.models_python import RAISER, REPEAT, io_config, python_model

FIRST = "nv_inference_first_response_histogram_ms"
SUMMARIES = ["nv_inference_request_summary_us", "nv_inference_queue_summary_us",
             "nv_inference_compute_input_summary_us", "nv_inference_compute_infer_summary_us",
             "nv_inference_compute_output_summary_us"]
DURATIONS = ["nv_inference_request_duration_us", "nv_inference_queue_duration_us",
             "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
             "nv_inference_compute_output_duration_us"]
ADD_SUB = 'model="add_sub",version="1",_team="search"'
REPEAT_L = 'model="repeat",version="1"'
RAISER_L = 'model="raiser",version="1"'
LATE_L = 'model="late_final",version="1"'
# Decoupled: IN = 0: its first response at once and its final (with data) 300 ms later, both
# from execute(); IN > 0: execute() returns at once, its thread sends the first response IN ms
# after the request came in and the final at 300 ms.
LATE_FINAL = '''
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            start = time.monotonic()
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            if x[0] == 0:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
                self.respond(start, x, sender)
            else:
                threading.Thread(target=self.respond, args=(start, x, sender)).start()
        return None

    def respond(self, start, x, sender):
        pause = threading.Event()
        if x[0] > 0:
            pause.wait(max(0.0, start + x[0] / 1000 - time.monotonic()))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        pause.wait(max(0.0, start + 0.3 - time.monotonic()))
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def scrape_text(srv) -> str:
    with urllib.request.urlopen(srv.metrics_url, timeout=5) as r:
        return r.read().decode()


def parse(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """({family: type}, {series: value})."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return types, series


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("metrics_full") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", (
        'name: "add_sub"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'instance_group [{ kind: KIND_CPU, count: 1 }]\n'
        'metric_tags { key: "team" value: "search" }\n'
        'model_metrics { metric_control: [ { metric_identifier: { family: '
        '"nv_inference_first_response_histogram_ms" } histogram_options: '
        '{ buckets: [ 1, 2.5, 4, 8000 ] } } ] }\n'))
    python_model(root, "repeat", REPEAT, io_config(
        "repeat", [("IN", "TYPE_INT32", "[ -1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    python_model(root, "late_final", LATE_FINAL, io_config(
        "late_final", [("IN", "TYPE_INT32", "[ 1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    python_model(root, "raiser", RAISER, io_config(
        "raiser", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    return root


@pytest.fixture(scope="module")
def full(repo):
    with start_server(repo, "--metrics-config", "histogram_latencies=true",
                      "--metrics-config", "summary_latencies=true",
                      "--metrics-interval-ms", "100") as srv:
        yield srv


def _add_sub_inputs():
    x = np.ones((2, 16), np.float32)
    inputs = [httpclient.InferInput("INPUT0", [2, 16], "FP32"),
              httpclient.InferInput("INPUT1", [2, 16], "FP32")]
    for i in inputs:
        i.set_data_from_numpy(x)
    return inputs


def _stream_repeat(srv, n: int) -> None:
    """n requests to the decoupled model on one stream; returns when each got its final."""
    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    c.start_stream(lambda result, error: answers.put((result, error)))
    try:
        for _ in range(n):
            i = grpcclient.InferInput("IN", [3], "INT32")
            i.set_data_from_numpy(np.array([1, 2, 3], np.int32))
            c.async_stream_infer("repeat", [i], enable_empty_final_response=True)
        finals = 0
        while finals < n:
            result, error = answers.get(timeout=30)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                finals += 1
    finally:
        c.stop_stream()
        c.close()


def test_histograms_summaries_and_labels_follow_the_requests(full):
    client = httpclient.InferenceServerClient(full.http_url)
    for _ in range(5):
        client.infer("add_sub", _add_sub_inputs())
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([-1], np.int32))     # raises in execute(): BACKEND
    with pytest.raises(Exception, match="negative input"):
        client.infer("raiser", [x])
    _stream_repeat(full, 3)

    def settled():
        _, s = parse(scrape_text(full))
        return (s.get(f"{FIRST}_count{{{ADD_SUB}}}") == 5
                and s.get(f"{FIRST}_count{{{REPEAT_L}}}") == 3
                and s.get(f"{FIRST}_count{{{RAISER_L}}}") == 1) and s
    series = wait_until(settled, 30, "the first-response histograms to count every request")
    types, _ = parse(scrape_text(full))

    # every family, with its type
    for name in ["nv_inference_request_success", "nv_inference_request_failure",
                 "nv_inference_count", "nv_inference_exec_count", *DURATIONS]:
        assert types[name] == "counter", name
    for name in ["nv_inference_pending_request_count", "nv_cpu_utilization",
                 "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"]:
        assert types[name] == "gauge", name
    assert types[FIRST] == "histogram" and types["nv_inference_batch_size"] == "histogram"
    for name in SUMMARIES:
        assert types[name] == "summary", name

    # add_sub: its metric_tags label everywhere, its model_metrics buckets
    assert series[f"nv_inference_request_success{{{ADD_SUB}}}"] == 5
    buckets = [k for k in series if k.startswith(f"{FIRST}_bucket{{{ADD_SUB}")]
    assert [re.search(r'le="([^"]+)"', k).group(1) for k in buckets] == ["1", "2.5", "4", "8000", "+Inf"]
    assert series[f'{FIRST}_bucket{{{ADD_SUB},le="8000"}}'] == 5
    assert series[f'{FIRST}_bucket{{{ADD_SUB},le="+Inf"}}'] == 5
    # summaries: count = successes, sum = the counter (each request's whole µs, summed)
    for name in SUMMARIES:
        assert series[f"{name}_count{{{ADD_SUB}}}"] == 5, name
        for q in ("0.5", "0.9", "0.95", "0.99", "0.999"):
            assert series[f'{name}{{{ADD_SUB},quantile="{q}"}}'] >= 0
    assert abs(series[f"nv_inference_request_summary_us_sum{{{ADD_SUB}}}"]
               - series[f"nv_inference_request_duration_us{{{ADD_SUB}}}"]) <= 5
    median = series[f'nv_inference_request_summary_us{{{ADD_SUB},quantile="0.5"}}']
    assert 0 < median <= series[f'nv_inference_request_summary_us{{{ADD_SUB},quantile="0.999"}}']

    # the decoupled model: one first response per request, default buckets
    assert [re.search(r'le="([^"]+)"', k).group(1)
            for k in series if k.startswith(f"{FIRST}_bucket{{{REPEAT_L}")] == \
        ["100", "500", "2000", "5000", "+Inf"]
    assert series[f"nv_inference_request_success{{{REPEAT_L}}}"] == 3

    # a failure: its reason, the first response (the error), no summary observation
    assert series[f'nv_inference_request_failure{{{RAISER_L},reason="BACKEND"}}'] == 1
    for reason in ("REJECTED", "CANCELED", "OTHER"):
        assert series[f'nv_inference_request_failure{{{RAISER_L},reason="{reason}"}}'] == 0
    assert series[f"nv_inference_request_summary_us_count{{{RAISER_L}}}"] == 0

    # label sets: model, version (and the tags), and exactly one of reason / le / quantile
    for key in series:
        m = re.fullmatch(r"(\w+)\{(.*)\}", key)
        if m and m.group(1).startswith("nv_inference"):
            names = re.findall(r'(\w+)="', m.group(2))
            assert names[:2] == ["model", "version"], key
            extra = [n for n in names[2:] if not n.startswith("_")]
            assert extra in ([], ["reason"], ["le"], ["quantile"]), key


def _stream_late_final(srv, first_ms: int, n: int) -> list[float]:
    """n requests to late_final, one after the other's final (one instance: none waits in
    the queue); the seconds from each request to its final response."""
    answers: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    c.start_stream(lambda result, error: answers.put((time.monotonic(), result, error)))
    finals = []
    try:
        for _ in range(n):
            i = grpcclient.InferInput("IN", [1], "INT32")
            i.set_data_from_numpy(np.array([first_ms], np.int32))
            sent = time.monotonic()
            c.async_stream_infer("late_final", [i])
            while True:
                at, result, error = answers.get(timeout=30)
                assert error is None, error
                if result.as_numpy("OUT")[0] == first_ms + 1:
                    finals.append(at - sent)
                    break
        return finals
    finally:
        c.stop_stream()
        c.close()


def test_first_response_of_a_decoupled_model_is_its_first_not_its_last(full):
    """Triton observes the histogram as a request's first response is sent (core
    InferenceResponse::UpdateResponseMetrics), not when the request is released."""
    def histogram(count):
        def read():
            _, s = parse(scrape_text(full))
            return s.get(f"{FIRST}_count{{{LATE_L}}}") == count and s
        return wait_until(read, 30, f"{count} first responses of late_final")

    # first and final from execute(), the final (the batch's end) 300 ms after the first
    finals = _stream_late_final(full, 0, 3)
    assert min(finals) >= 0.3
    s = histogram(3)
    before = s[f"{FIRST}_sum{{{LATE_L}}}"]
    assert before < 3 * 100
    assert s[f'{FIRST}_bucket{{{LATE_L},le="100"}}'] == 3
    # first from the model's thread 150 ms in (after execute() returned), final at 300 ms
    finals = _stream_late_final(full, 150, 2)
    assert min(finals) >= 0.3
    s = histogram(5)
    assert s[f'{FIRST}_bucket{{{LATE_L},le="100"}}'] == 3
    assert s[f'{FIRST}_bucket{{{LATE_L},le="500"}}'] == 5
    assert 2 * 150 <= s[f"{FIRST}_sum{{{LATE_L}}}"] - before < 2 * 290


def test_cpu_metrics_present_and_plausible(full):
    def read():
        _, s = parse(scrape_text(full))
        return s
    s = read()
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    assert s["nv_cpu_memory_total_bytes"] == total
    assert 0 < s["nv_cpu_memory_used_bytes"] <= total
    assert 0.0 <= s["nv_cpu_utilization"] <= 1.0
    # read every 50 ms (half of --metrics-interval-ms 100): the figures move
    first = (s["nv_cpu_utilization"], s["nv_cpu_memory_used_bytes"])
    wait_until(lambda: (lambda t: (t["nv_cpu_utilization"], t["nv_cpu_memory_used_bytes"]) != first)(read()),
               10, "the CPU metrics to be read again")


def test_no_gpu_metrics_without_nvml_gpu(full):
    import importlib.util
    if importlib.util.find_spec("pynvml") is not None:
        pytest.skip("nvidia-ml-py is installed: GPU metrics may be there")
    assert "nv_gpu_" not in scrape_text(full) and "nv_energy_consumption" not in scrape_text(full)


def test_flags_off_leave_their_families_out(repo):
    with start_server(repo, "--metrics-config", "counter_latencies=false",
                      "--allow-cpu-metrics", "false") as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        client.infer("add_sub", _add_sub_inputs())
        wait_until(lambda: parse(scrape_text(srv))[1].get(f"nv_inference_request_success{{{ADD_SUB}}}") == 1,
                   30, "the request to be counted")
        text = scrape_text(srv)
        for name in DURATIONS + SUMMARIES + [FIRST, "nv_cpu_"]:
            assert name not in text, name
        assert "nv_inference_exec_count{" in text and "nv_inference_pending_request_count{" in text


def test_allow_metrics_false_serves_no_metrics(repo):
    with start_server(repo, "--allow-metrics", "false", "--metrics-config",
                      "summary_latencies=true") as srv:
        with pytest.raises(urllib.error.URLError):
            scrape_text(srv)
