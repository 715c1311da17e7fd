"""Python backend end to end: Triton-style model.py files served unmodified, with the
official client. One server holds every model (tests/models_python.py)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import queue
import re
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import start_server, wait_until
from tests.faults.test_worker_crash import worker_pid
from tests.models_python import python_repository


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = python_repository(tmp_path_factory.mktemp("python") / "models")
    # two models fail to load on purpose: ready means the initial load is over
    with start_server(root, "--strict-readiness", "false", "--exit-on-error", "false") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield c
    c.close()


def _inp(name, arr, mod=httpclient):
    dt = "BYTES" if arr.dtype == object else {"float32": "FP32", "int32": "INT32"}[arr.dtype.name]
    i = mod.InferInput(name, list(arr.shape), dt)
    i.set_data_from_numpy(arr)
    return i


A = np.array([1, 2, 3, 4], np.float32)
B = np.array([0.5, 0.5, 0.5, 0.5], np.float32)


def test_triton_add_sub_example(client):
    r = client.infer("add_sub", [_inp("INPUT0", A), _inp("INPUT1", B)])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)


def test_initialize_args_request_id_parameters_zero_copy(client, server):
    x = np.array([5], np.int32)
    r = client.infer("args", [_inp("X", x)], request_id="req-9", parameters={"color": "red"},
                     outputs=[httpclient.InferRequestedOutput("INFO")])
    assert r.as_numpy("EXTRA") is None          # only the requested output comes back
    info = json.loads(r.as_numpy("INFO")[0])
    assert info["id"] == "req-9"
    assert info["parameters"] == {"color": "red"}
    assert info["requested"] == ["INFO"]
    assert info["owns_data"] is False           # a view on the bytes as they arrived
    args = info["args"]
    assert sorted(args) == ["model_config", "model_instance_device_id", "model_instance_kind",
                            "model_instance_name", "model_name", "model_repository", "model_version"]
    assert (args["model_name"], args["model_version"], args["model_instance_kind"],
            args["model_instance_name"], args["model_instance_device_id"]) == \
        ("args", "1", "CPU", "args_0_0", "0")
    assert args["model_repository"].endswith("/models/args")
    assert json.loads(args["model_config"])["input"][0]["data_type"] == "TYPE_INT32"


def test_strings(client):
    text = np.array([b"hello", "wörld".encode(), b""], dtype=object)
    r = client.infer("strings", [_inp("TEXT", text)])
    assert r.as_numpy("UPPER").tolist() == [b"HELLO", "WÖRLD".encode(), b""]
    assert r.as_numpy("LENGTH").tolist() == [5, 5, 0]


@pytest.mark.parametrize("target", ["add_sub", "onnx_add_sub"])
def test_bls_sync(client, target):
    name = np.array([target.encode()], dtype=object)
    r = client.infer("bls", [_inp("MODEL_NAME", name), _inp("INPUT0", A), _inp("INPUT1", B)])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)


def test_bls_unknown_model_raises_in_the_model(client):
    name = np.array([b"undefined_model"], dtype=object)
    with pytest.raises(InferenceServerException) as e:
        client.infer("bls", [_inp("MODEL_NAME", name), _inp("INPUT0", A), _inp("INPUT1", B)])
    assert e.value.status() == "500"
    assert e.value.message().startswith(
        "Failed to process the request(s) for model 'bls_0_0', message: "
        "TritonModelException: Failed for execute the inference request. "
        "Model 'undefined_model' is not ready.\n\nAt:\n")
    assert re.search(r"/models/bls/1/model\.py\(\d+\): execute\n$", e.value.message())


def test_bls_async_two_models_at_once(client):
    names = np.array([b"onnx_add_sub", b"add_sub"], dtype=object)
    r = client.infer("bls_async", [_inp("MODEL_NAMES", names), _inp("INPUT0", A), _inp("INPUT1", B)])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)


def test_bls_to_a_decoupled_model(client):
    r = client.infer("bls_decoupled", [_inp("IN", np.array([3, 4, 5], np.int32))])
    assert r.as_numpy("SUM").tolist() == [12, 3]


def test_decoupled_over_grpc_stream(server):
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        c.async_stream_infer("repeat", [_inp("IN", np.array([7, 8, 9], np.int32), grpcclient)],
                             request_id="r1", enable_empty_final_response=True)
        seen = [got.get(timeout=30) for _ in range(4)]
    finally:
        c.stop_stream()
        c.close()
    assert all(err is None for _, err in seen), seen
    values = [r.as_numpy("OUT").tolist() for r, _ in seen[:3]]
    assert values == [[7], [8], [9]]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in seen]
    assert finals == [False, False, False, True]
    assert seen[3][0].as_numpy("OUT") is None     # the bare final flag
    assert {r.get_response().id for r, _ in seen} == {"r1"}


def test_decoupled_error_response_does_not_end_the_stream(server):
    """A decoupled model's error response that is not its last reaches the client as a
    stream error naming the request, and its later responses still come (Triton's)."""
    got: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        c.async_stream_infer("repeat", [_inp("IN", np.array([7, -1, 9], np.int32), grpcclient)],
                             request_id="r2")
        seen = [got.get(timeout=30) for _ in range(3)]
    finally:
        c.stop_stream()
        c.close()
    assert seen[0][0].as_numpy("OUT").tolist() == [7]
    assert seen[1][0] is None and "negative value -1" in str(seen[1][1])
    assert seen[2][0].as_numpy("OUT").tolist() == [9]
    assert got.empty()


def test_decoupled_refused_outside_a_stream(server, client):
    x = np.array([1], np.int32)
    with pytest.raises(InferenceServerException) as e:
        client.infer("repeat", [_inp("IN", x)])
    assert (e.value.status(), e.value.message()) == (
        "501", "HTTP end point doesn't support models with decoupled transaction policy")
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as e:
            g.infer("repeat", [_inp("IN", x, grpcclient)])
        assert e.value.status() == "StatusCode.UNIMPLEMENTED"
        assert e.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
    finally:
        g.close()


def test_model_errors_fail_their_request_only(client):
    one = np.array([1], np.int32)
    with pytest.raises(InferenceServerException) as e:
        client.infer("raiser", [_inp("X", np.array([-1], np.int32))])
    assert e.value.status() == "500"
    assert e.value.message().startswith(
        "Failed to process the request(s) for model 'raiser_0_0', message: "
        "ValueError: negative input\n\nAt:\n")
    with pytest.raises(InferenceServerException) as e:
        client.infer("raiser", [_inp("X", np.array([100], np.int32))])
    assert (e.value.status(), e.value.message()) == ("400", "one hundred is not allowed")
    with pytest.raises(InferenceServerException) as e:
        client.infer("raiser", [_inp("X", np.array([5], np.int32))])
    assert (e.value.status(), e.value.message()) == (
        "500", "model 'raiser' returned an output it cannot send: unsupported numpy dtype complex64")
    assert client.infer("raiser", [_inp("X", one)]).as_numpy("Y").tolist() == [1]


def test_segfault_fails_the_request_and_the_instance_comes_back(server, client):
    pid = worker_pid(server, "raiser")
    with pytest.raises(InferenceServerException) as e:
        client.infer("raiser", [_inp("X", np.array([7], np.int32))])
    assert e.value.status() == "500"
    assert e.value.message() == ("model instance 'raiser_0_0' of model 'raiser' exited "
                                 "unexpectedly (exit code -11); the request was not completed")
    r = client.infer("add_sub", [_inp("INPUT0", A), _inp("INPUT1", B)])   # others unaffected
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
    wait_until(lambda: _titled(server, "(raiser v") - {pid}, 30, "raiser restarted")
    assert client.infer("raiser", [_inp("X", np.array([2], np.int32))]).as_numpy("Y").tolist() == [2]


def _titled(server, text: str) -> set[int]:
    import psutil
    found = set()
    for pid in server.family():
        try:
            if text in " ".join(psutil.Process(pid).cmdline()):
                found.add(pid)
        except psutil.NoSuchProcess:
            pass
    return found


def test_is_ready_decides_model_readiness(server, client):
    marker = server.repo / "probed" / "healthy"
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_model_ready("probed") and g.is_model_ready("probed")
        marker.unlink()
        assert not client.is_model_ready("probed") and not g.is_model_ready("probed")
        assert client.is_model_ready("add_sub")          # a model without is_ready
        marker.touch()
        assert client.is_model_ready("probed")
    finally:
        marker.touch()
        g.close()


def test_custom_metrics_on_the_metrics_endpoint(server, client):
    for n in (1, 3, 9):
        r = client.infer("metered", [_inp("X", np.ones(n, np.int32))])
        assert r.as_numpy("Y").tolist() == [n]
    with urllib.request.urlopen(server.metrics_url) as f:
        text = f.read().decode()
    block = [ln for ln in text.splitlines() if "requests_seen" in ln or "input_size" in ln]
    assert block == [
        "# HELP input_size Elements per request", "# TYPE input_size histogram",
        'input_size_bucket{model="metered",le="1"} 1', 'input_size_bucket{model="metered",le="4"} 2',
        'input_size_bucket{model="metered",le="+Inf"} 3', 'input_size_sum{model="metered"} 13',
        'input_size_count{model="metered"} 3',
        "# HELP requests_seen Requests this model executed", "# TYPE requests_seen counter",
        'requests_seen{model="metered"} 3']


def test_auto_complete_config(client):
    cfg = client.get_model_config("auto")
    assert cfg["max_batch_size"] == 4
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [("IN", "TYPE_INT32", [2])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [("OUT", "TYPE_INT32", [2])]
    r = client.infer("auto", [_inp("IN", np.array([[1, 2], [3, 4]], np.int32))])
    assert r.as_numpy("OUT").tolist() == [[2, 4], [6, 8]]


def test_load_failures_leave_others_serving(client):
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["init_fails"]["state"] == "UNAVAILABLE"
    assert index["init_fails"]["reason"].startswith(
        "initialize of model 'init_fails' failed: RuntimeError: no weights for init_fails\n\nAt:\n")
    assert index["exits"]["state"] == "UNAVAILABLE"
    assert index["exits"]["reason"] == ("instance 'exits_0_0' of model 'exits' exited with "
                                        "code 3 while loading")
    assert index["add_sub"]["state"] == "READY"


@pytest.mark.parametrize("model,value", [("env_dir", 41), ("env_tar", 42)])
def test_execution_env_path(client, model, value):
    r = client.infer(model, [_inp("X", np.array([0], np.int32))])
    assert r.as_numpy("VALUE").tolist() == [value]


def test_whole_dynamic_batch_reaches_execute(server, client):
    before = client.get_inference_statistics("add_sub_batched")["model_stats"][0]
    a = np.tile(A, (1, 1))
    c4 = httpclient.InferenceServerClient(server.http_url, concurrency=4, network_timeout=60)
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: c4.infer(
            "add_sub_batched", [_inp("INPUT0", a + k), _inp("INPUT1", a)]), range(4)))
    c4.close()
    for k, r in enumerate(results):
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a + k)
    after = client.get_inference_statistics("add_sub_batched")["model_stats"][0]
    assert after["inference_count"] - before.get("inference_count", 0) == 4
    assert after["execution_count"] - before.get("execution_count", 0) == 1
    assert [b["batch_size"] for b in after["batch_stats"]] == [4]


def test_frontend_and_scheduler_import_no_framework(server):
    """Only workers map a framework; Python workers map none either."""
    import psutil
    frameworks = ("onnxruntime", "libtorch", "tensorflow", "openvino")
    for pid in server.family():
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline())
        maps = open(f"/proc/{pid}/maps").read()
        loaded = [f for f in frameworks if f in maps]
        if "onnx_add_sub" in cmd:
            assert loaded == ["onnxruntime"]
        else:
            assert loaded == [], (cmd, loaded)
