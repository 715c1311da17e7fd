"""End to end over HTTP: the official, unmodified `tritonclient.http` plus raw requests
(urllib, aiohttp) against a real Trireme server (the `server` fixture of tests/conftest.py).

The repository holds "add_sub" (ONNX: INPUT0, INPUT1 FP32 [16] -> OUTPUT0 = sum,
OUTPUT1 = difference, max_batch_size 8) and "identity_<dt>" (INPUT0 -> OUTPUT0, dims [-1],
max_batch_size 8) for each datatype. Expected texts are Triton's (src/http_server.cc).
"""
from __future__ import annotations

import asyncio
import gzip
import json
import urllib.error
import urllib.request
import zlib

import aiohttp
import numpy as np
import pytest
import tritonclient.http as httpclient
from conftest import start_server, wait_models
from models_python import IDENTITY, INIT_FAILS, io_config, python_model
from tritonclient.utils import InferenceServerException

UNKNOWN_MODEL = "Request for unknown model: 'nope' is not found"
HEADER_LENGTH = "Inference-Header-Content-Length"


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url)
    yield c
    c.close()


def add_sub_inputs(batch: int = 1, seed: int = 0, binary: bool = True):
    rng = np.random.default_rng(seed)
    a = rng.random((batch, 16), dtype=np.float32)
    b = rng.random((batch, 16), dtype=np.float32)
    inputs = [httpclient.InferInput("INPUT0", [batch, 16], "FP32"),
              httpclient.InferInput("INPUT1", [batch, 16], "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a, b


def request(server, method: str, path: str, body: bytes | None = None,
            headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One raw HTTP request -> (status, headers, body); error statuses do not raise."""
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=body, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def json_infer_body(a: np.ndarray, b: np.ndarray, **extra) -> bytes:
    return json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "FP32", "shape": list(a.shape), "data": a.ravel().tolist()},
        {"name": "INPUT1", "datatype": "FP32", "shape": list(b.shape), "data": b.ravel().tolist()},
    ], **extra}).encode()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


# ---- health, metadata, config, repository --------------------------------------------------

def test_health_answers_have_no_body(server):
    """Triton answers health and readiness with the status alone; its QA scripts read them
    with `curl -s -w %{http_code}` and compare the output with "200" (qa/common/util.sh's
    wait_for_server_ready, L0_lifecycle), which a body would break."""
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/add_sub/ready"):
        status, _, body = request(server, "GET", path)
        assert (status, body) == (200, b"")


@pytest.fixture(scope="module")
def json_health(tmp_path_factory):
    """--http-health-body json; one model fails to load, so the server is live, not ready.
    "fixed4" (INPUT0 FP32 [4], no batching) also serves the raw binary tests."""
    root = tmp_path_factory.mktemp("health") / "models"
    python_model(root, "fixed4", IDENTITY, io_config(
        "fixed4", [("INPUT0", "TYPE_FP32", "[ 4 ]")], [("OUTPUT0", "TYPE_FP32", "[ 4 ]")]))
    python_model(root, "init_fails", INIT_FAILS, io_config(
        "init_fails", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    with start_server(root, "--http-health-body", "json", "--exit-on-error", "false",
                      ready=False) as srv:
        wait_models(srv, ["fixed4"], ["init_fails"])
        yield srv


def test_health_answers_in_json(json_health):
    """The Open Inference Protocol's bodies, which KServe's own client reads (is_server_live
    / is_server_ready call .json() on them), with Triton's statuses; tritonclient reads the
    status alone and answers as before."""
    for path, status, doc in (
            ("/v2/health/live", 200, {"live": True}),
            ("/v2/health/ready", 400, {"ready": False}),
            ("/v2/models/fixed4/ready", 200, {"name": "fixed4", "ready": True}),
            ("/v2/models/init_fails/ready", 400, {"error": "Model version not ready"})):
        got_status, headers, body = request(json_health, "GET", path)
        assert (got_status, json.loads(body)) == (status, doc), path
        assert headers["Content-Type"] == "application/json"
    client = httpclient.InferenceServerClient(json_health.http_url)
    assert client.is_server_live() and not client.is_server_ready()
    assert client.is_model_ready("fixed4") and not client.is_model_ready("init_fails")


def test_kserve_client_reads_the_json_health_answers(json_health):
    """KServe 0.21's InferenceRESTClient (protocol v2): JSONDecodeError on Triton's empty
    bodies, True on these. (Not a dependency: skipped where kserve is not installed.)"""
    kserve = pytest.importorskip("kserve")

    async def ask():
        c = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2"))
        try:
            url = f"http://{json_health.http_url}"
            assert await c.is_server_live(url) is True
            assert await c.is_model_ready(url, "fixed4") is True
            assert await c.is_model_ready(url, "init_fails") is False
            with pytest.raises(Exception) as e:   # not ready: 400, which it raises on
                await c.is_server_ready(url)
            assert "400" in str(e.value)
        finally:
            await c.close()
    asyncio.run(ask())


def test_raw_binary_errors_name_the_raw_input(json_health):
    """Triton names a raw request's input "raw_input" (its HTTP server's name for it) in the
    byte-size check, and prefixes its errors with the request's log id."""
    for body in (b"", b"\0" * 12):
        status, _, got = request(json_health, "POST", "/v2/models/fixed4/infer", body,
                                 {HEADER_LENGTH: "0"} if body else None)
        assert (status, error_of(got)) == (400, (
            "[request id: <id_unknown>] input byte size mismatch for input 'raw_input' for "
            f"model 'fixed4'. Expected 16, got {len(body)}"))


def test_health_and_readiness(client, server):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert not client.is_model_ready("nope")
    status, _, body = request(server, "GET", "/v2/models/nope/ready")
    assert (status, error_of(body)) == (400, "Model version not ready")
    assert request(server, "GET", "/v2/health/live")[0] == 200


def test_server_and_model_metadata(client):
    md = client.get_server_metadata()
    assert md["name"] and md["version"]
    # exactly what is implemented, in Triton's order
    assert md["extensions"] == [
        "classification", "sequence", "model_repository", "model_repository(unload_dependents)",
        "schedule_policy",
        "model_configuration", "system_shared_memory", "cuda_shared_memory",
        "binary_tensor_data", "parameters", "statistics", "trace", "logging"]
    md = client.get_model_metadata("add_sub")
    assert md["name"] == "add_sub" and md["platform"] == "onnxruntime_onnx"
    assert [(t["name"], t["datatype"], t["shape"]) for t in md["inputs"]] == [
        ("INPUT0", "FP32", [-1, 16]), ("INPUT1", "FP32", [-1, 16])]
    cfg = client.get_model_config("add_sub")
    assert cfg["name"] == "add_sub" and cfg["max_batch_size"] == 8
    assert cfg["input"][0]["dims"] == [16]


def test_unknown_model_is_404(client, server):
    for call in (lambda: client.get_model_metadata("nope"),
                 lambda: client.get_model_config("nope"),
                 lambda: client.infer("nope", add_sub_inputs()[0])):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "404"
        assert info.value.message() == UNKNOWN_MODEL
    status, headers, body = request(server, "POST", "/v2/models/nope/infer", b'{"inputs": []}')
    assert (status, error_of(body)) == (404, UNKNOWN_MODEL)
    assert headers["Content-Type"] == "application/json"


def test_repository_index(client, server):
    by_name = {m["name"]: m for m in client.get_model_repository_index()}
    assert by_name["add_sub"]["state"] == "READY" and "identity_fp32" in by_name
    status, _, body = request(server, "POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and "add_sub" in {m["name"] for m in json.loads(body)}
    status, _, body = request(server, "POST", "/v2/repository/index", b'{"ready": 1}')
    assert (status, error_of(body)) == (400, "Invalid value for 'ready': expected a boolean")


def test_repository_request_errors(server):
    status, _, body = request(server, "POST", "/v2/repository/models/add_sub/load",
                              b'{"parameters": {"bogus": "x"}}')
    assert (status, error_of(body)) == (400, "unrecognized load parameter 'bogus'.")
    status, _, body = request(server, "POST", "/v2/repository/models/add_sub/unload",
                              b'{"parameters": {"unload_dependents": "yes"}}')
    assert status == 400 and "Unable to parse 'unload_dependents'" in error_of(body)
    status, _, body = request(server, "POST", "/v2/repository/other/models/add_sub/load", b"")
    assert (status, error_of(body)) == (501, "'repository_name' specification is not supported")
    assert httpclient.InferenceServerClient(server.http_url).is_model_ready("add_sub")


# ---- routing ------------------------------------------------------------------------------

@pytest.mark.parametrize("method, path", [
    ("POST", "/v2/health/live"), ("POST", "/v2"), ("GET", "/v2/models/add_sub/infer"),
    ("POST", "/v2/models/add_sub/config"), ("GET", "/v2/repository/index"),
    ("GET", "/v2/models/add_sub/generate"),
])
def test_wrong_method_is_405(server, method, path):
    status, headers, body = request(server, method, path, b"{}" if method == "POST" else None)
    assert (status, error_of(body)) == (405, "Method Not Allowed")
    assert headers["Content-Type"] == "application/json"


@pytest.mark.parametrize("path", ["/", "/v1/models/add_sub", "/v2/nothing",
                                  "/v2/models/add_sub/versions/x", "/v2/models/add_sub/bogus",
                                  "/v2/trace", "/v2/logging/x"])
def test_unknown_path_is_404(server, path):
    status, _, body = request(server, "GET", path)
    assert (status, error_of(body)) == (404, "Not Found")


# ---- inference ----------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False])
def test_infer_with_tritonclient(client, binary):
    inputs, a, b = add_sub_inputs(batch=3, binary=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary)
               for n in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("add_sub", inputs, outputs=outputs)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    response = result.get_response()
    assert response["model_name"] == "add_sub" and response["model_version"]
    for out in response["outputs"]:
        assert ("binary_data_size" in out.get("parameters", {})) == binary
        assert ("data" in out) == (not binary)


def test_json_infer(server):
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.ones((1, 16), np.float32)
    status, headers, body = request(server, "POST", "/v2/models/add_sub/infer",
                                    json_infer_body(a, b), {"Content-Type": "application/json"})
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert HEADER_LENGTH not in headers
    doc = json.loads(body)
    assert "id" not in doc and doc["model_name"] == "add_sub"
    outs = {o["name"]: o for o in doc["outputs"]}
    assert outs["OUTPUT0"]["datatype"] == "FP32" and outs["OUTPUT0"]["shape"] == [1, 16]
    assert outs["OUTPUT0"]["data"] == (a + b).ravel().tolist()
    assert outs["OUTPUT1"]["data"] == (a - b).ravel().tolist()


def test_binary_infer_by_hand(server):
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.full((1, 16), 2, np.float32)
    header = json.dumps({
        "inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16],
                    "parameters": {"binary_data_size": 64}} for n in ("INPUT0", "INPUT1")],
        "parameters": {"binary_data_output": True}}).encode()
    status, headers, body = request(server, "POST", "/v2/models/add_sub/infer",
                                    header + a.tobytes() + b.tobytes(),
                                    {HEADER_LENGTH: str(len(header))})
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    n = int(headers[HEADER_LENGTH])
    doc = json.loads(body[:n])
    sizes = [o["parameters"]["binary_data_size"] for o in doc["outputs"]]
    assert sizes == [64, 64] and len(body) == n + 128
    got = {o["name"]: np.frombuffer(body[n + 64 * i:n + 64 * (i + 1)], "<f4")
           for i, o in enumerate(doc["outputs"])}
    np.testing.assert_array_equal(got["OUTPUT0"], (a + b).ravel())
    np.testing.assert_array_equal(got["OUTPUT1"], (a - b).ravel())


def test_binary_sizes_that_do_not_add_up(server):
    header = json.dumps({"inputs": [{"name": n, "datatype": "FP32", "shape": [1, 16],
                                     "parameters": {"binary_data_size": 64}}
                                    for n in ("INPUT0", "INPUT1")]}).encode()
    status, _, body = request(server, "POST", "/v2/models/add_sub/infer",
                              header + b"\0" * 100, {HEADER_LENGTH: str(len(header))})
    assert status == 400
    assert error_of(body) == ("unexpected size for input 'INPUT1', expecting 28 additional "
                              "bytes for model 'add_sub'")


def test_raw_binary_request(server):
    data = np.arange(10, dtype=np.float32)
    status, headers, body = request(server, "POST", "/v2/models/identity_fp32/infer",
                                    data.tobytes(), {HEADER_LENGTH: "0"})
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    n = int(headers[HEADER_LENGTH])
    (out,) = json.loads(body[:n])["outputs"]
    assert out["shape"] == [1, 10] and out["parameters"]["binary_data_size"] == 40
    np.testing.assert_array_equal(np.frombuffer(body[n:], "<f4"), data)


def test_raw_binary_needs_a_single_input(server):
    status, _, body = request(server, "POST", "/v2/models/add_sub/infer", b"\0" * 128,
                              {HEADER_LENGTH: "0"})
    assert status == 400
    assert error_of(body) == ("[request id: <id_unknown>] Raw request must only have 1 input "
                              "(found 1) to be deduced but got 2 inputs in 'add_sub' model "
                              "configuration")


def test_requested_output_subset(client):
    inputs, a, b = add_sub_inputs()
    result = client.infer("add_sub", inputs,
                          outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


def test_request_id_echo(client, server):
    inputs, _, _ = add_sub_inputs()
    assert client.infer("add_sub", inputs, request_id="req-42").get_response()["id"] == "req-42"
    assert "id" not in client.infer("add_sub", inputs).get_response()
    a = np.zeros((1, 16), np.float32)
    status, _, body = request(server, "POST", "/v2/models/add_sub/infer",
                              json_infer_body(a, a, id="raw-7"))
    assert status == 200 and json.loads(body)["id"] == "raw-7"


def test_bytes_in_json_and_binary(client):
    data = np.array([[b"abc", b"", "héllo".encode(), b"x" * 300]], dtype=object)
    for binary in (False, True):
        inp = httpclient.InferInput("INPUT0", list(data.shape), "BYTES")
        inp.set_data_from_numpy(data, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        result = client.infer("identity_bytes", [inp], outputs=[out])
        got = result.as_numpy("OUTPUT0")
        assert got.shape == data.shape
        assert [x if isinstance(x, bytes) else x.encode() for x in got.ravel()] == \
            data.ravel().tolist()


def test_malformed_json_is_400(server):
    status, headers, body = request(server, "POST", "/v2/models/add_sub/infer", b"AAAA")
    assert status == 400 and headers["Content-Type"] == "application/json"
    assert error_of(body) == "failed to parse the request JSON buffer: Invalid value. at 0"
    status, _, body = request(server, "POST", "/v2/models/add_sub/infer", b'{"inputs": [}')
    assert status == 400
    assert error_of(body).startswith("failed to parse the request JSON buffer: ")
    status, _, body = request(server, "POST", "/v2/models/add_sub/infer",
                              b'{"inputs": [{"name": "INPUT0", "datatype": "FP32"}]}')
    assert status == 400 and "Input must set only one of the following fields" in error_of(body)


def _body(inputs: list | None = None, **extra) -> bytes:
    """An add_sub request with ``inputs`` changed (a dict of INPUT0's fields to replace,
    None: to drop) and request-level members added."""
    good = [{"name": n, "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}
            for n in ("INPUT0", "INPUT1")]
    if inputs is not None:
        good[0] = {k: v for k, v in {**good[0], **inputs[0]}.items() if v is not None}
    return json.dumps({"inputs": good, **extra}).encode()


NO_MEMBER = "attempt to access non-existing object member '{}'"
NOT_ARRAY = "attempt to access JSON non-array as array"
NOT_STRING = "attempt to access JSON non-string as string"
NO_CONTENT = ("Input must set only one of the following fields: 'data', 'binary_data_size' in "
              "'parameters', 'shared_memory_region' in 'parameters'. But no field is set")


@pytest.mark.parametrize("body, text", [
    # asked of Triton 2.51 (it answers 500 but for NO_CONTENT: TritonJson's errors are INTERNAL
    # there; the client's mistake, 400 here: docs/compat.md)
    (b"{}", "Unable to parse 'inputs': " + NO_MEMBER.format("inputs")),
    (b"[]", "Unable to parse 'inputs': " + NO_MEMBER.format("inputs")),
    (b'{"inputs": {}}', "Unable to parse 'inputs': " + NOT_ARRAY),
    (b'{"inputs": [1]}', NO_CONTENT),
    (_body([{"name": None}]), "Unable to parse 'name': " + NO_MEMBER.format("name")),
    (_body([{"name": 1}]), "Unable to parse 'name': " + NOT_STRING),
    (_body([{"datatype": None}]), "Unable to parse 'datatype': " + NO_MEMBER.format("datatype")),
    (_body([{"datatype": 1}]), "Unable to parse 'datatype': " + NOT_STRING),
    (_body([{"shape": 16}]), "Unable to parse 'shape': " + NOT_ARRAY),
    (_body([{"shape": [1, "16"]}]), "Unable to parse 'shape': attempt to access JSON "
                                    "non-unsigned-integer as unsigned-integer"),
    (_body([{"data": 1}]), "Unable to parse 'data': " + NOT_ARRAY),
    (_body(parameters=[]), "failed to get request params.: attempt to get members for non-object"),
    (_body(parameters=None), "failed to get request params.: attempt to get members for non-object"),
    (_body(id=1), "Unable to parse 'id': " + NOT_STRING),
    (_body(outputs={}), "Unable to parse 'outputs': " + NOT_ARRAY),
    (_body(outputs=[1]), "Unable to parse 'name': " + NO_MEMBER.format("name")),
    (_body(outputs=[{"name": "OUTPUT0", "parameters": {"binary_data": 1}}]),
     "Unable to parse 'binary_data': attempt to access JSON non-boolean as boolean"),
    # rapidjson's words and offsets (the document, then the parser's first error)
    (b"", "failed to parse the request JSON buffer: The document is empty. at 0"),
    (b"{", "failed to parse the request JSON buffer: Missing a name for object member. at 1"),
    (b'{"inputs":[],}', "failed to parse the request JSON buffer: Missing a name for object "
                        "member. at 13"),
    (b'{"inputs" []}', "failed to parse the request JSON buffer: Missing a colon after a name "
                       "of object member. at 10"),
    (b'{"inputs":[] "id":"x"}', "failed to parse the request JSON buffer: Missing a comma or "
                                "'}' after an object member. at 13"),
    (b'{"inputs":[1,2', "failed to parse the request JSON buffer: Missing a comma or ']' after "
                        "an array element. at 14"),
    (b'{"inputs":"abc', "failed to parse the request JSON buffer: Missing a closing quotation "
                        "mark in string. at 14"),
    (b'{"inputs":"\\q"}', "failed to parse the request JSON buffer: Invalid escape character "
                          "in string. at 11"),
    (b'{"inputs":1.}', "failed to parse the request JSON buffer: Miss fraction part in number. "
                       "at 12"),
    (b'{"inputs":1e400}', "failed to parse the request JSON buffer: Number too big to be stored "
                          "in double. at 10"),
    (b"{} {}", "failed to parse the request JSON buffer: The document root must not be followed "
               "by other values. at 3"),
    (b"\0\0\x80?", "failed to parse the request JSON buffer: The document is empty. at 0"),
    (b'{"inputs":NaN}', "Unable to parse 'inputs': " + NOT_ARRAY),   # NaN is a number to it
])
def test_malformed_bodies_in_tritons_words(server, body, text):
    """Each malformed shape of an infer body, sent to Triton 2.51 and to Trireme: the same
    text (without Inference-Header-Content-Length, a body is JSON; an empty one is raw)."""
    status, headers, got = request(server, "POST", "/v2/models/add_sub/infer", body,
                                   {"Content-Type": "application/json"})
    if not body:   # Triton: a raw binary request of 0 bytes, which add_sub cannot take
        text = ("[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be "
                "deduced but got 2 inputs in 'add_sub' model configuration")
    assert (status, error_of(got)) == (400, text)
    assert headers["Content-Type"] == "application/json"


def test_what_triton_ignores_or_reads_in_a_body(server):
    """Triton ignores a "parameters" of an input or an output that is not an object, and
    reads NaN, Infinity, -Infinity and Inf as numbers (rapidjson's kParseNanAndInfFlag)."""
    for body in (_body([{"parameters": 1}]), _body(outputs=[{"name": "OUTPUT0", "parameters": []}])):
        status, _, got = request(server, "POST", "/v2/models/add_sub/infer", body)
        assert status == 200, got
    body = (b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,5],'
            b'"data":[NaN,Infinity,-Infinity,Inf,-Inf]}]}')
    status, _, got = request(server, "POST", "/v2/models/identity_fp32/infer", body)
    assert status == 200, got
    assert got.endswith(b'"data":[NaN,Infinity,-Infinity,Infinity,-Infinity]}]}')


def test_an_empty_body_is_a_raw_binary_request(server):
    """Triton takes the header length to be the body's when the header is absent: an empty
    body is a raw binary request, a zero-byte tensor for the model's one input."""
    status, headers, body = request(server, "POST", "/v2/models/identity_fp32/infer", b"")
    assert (status, headers["Content-Type"]) == (200, "application/json")
    assert json.loads(body)["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32",
                                            "shape": [1, 0],
                                            "parameters": {"binary_data_size": 0}}]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(client, algorithm):
    inputs, a, b = add_sub_inputs(batch=2)
    result = client.infer("add_sub", inputs, request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)


def test_gzip_by_hand(server):
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    status, headers, body = request(
        server, "POST", "/v2/models/add_sub/infer", gzip.compress(json_infer_body(a, a)),
        {"Content-Encoding": "gzip", "Accept-Encoding": "deflate;q=0.5, gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    outs = {o["name"]: o for o in json.loads(gzip.decompress(body))["outputs"]}
    assert outs["OUTPUT0"]["data"] == (2 * a).ravel().tolist()
    status, headers, body = request(
        server, "POST", "/v2/models/add_sub/infer", zlib.compress(json_infer_body(a, a)),
        {"Content-Encoding": "deflate", "Accept-Encoding": "identity"})
    assert status == 200 and "Content-Encoding" not in headers
    assert json.loads(body)["model_name"] == "add_sub"
    status, headers, body = request(server, "POST", "/v2/models/add_sub/infer", b"{}",
                                    {"Content-Encoding": "compress"})
    assert (status, error_of(body)) == (501, "Unsupported compression type")
    assert headers["Accept-Encoding"] == "gzip, deflate"


def test_aiohttp_client_keep_alive(server):
    # A persistent connection carries many requests, errors included.
    a = np.ones((1, 16), np.float32)

    async def main():
        url = f"http://{server.http_url}/v2/models/add_sub/infer"
        async with aiohttp.ClientSession() as session:
            for k in range(20):
                body = json_infer_body(a, a, id=str(k)) if k % 5 else b"not json"
                async with session.post(url, data=body) as r:
                    doc = await r.json(content_type=None)
                    if k % 5:
                        assert r.status == 200 and doc["id"] == str(k)
                    else:
                        assert r.status == 400 and "failed to parse" in doc["error"]

    asyncio.run(main())


def test_identity_datatypes_over_json(client, server):
    for dt, data in [("int32", np.array([[-5, 0, 2**31 - 1]], np.int32)),
                     ("uint8", np.array([[0, 255]], np.uint8)),
                     ("bool", np.array([[True, False]])),
                     ("fp64", np.array([[0.1, -1e300]], np.float64))]:
        if not (server.repo / f"identity_{dt}").is_dir():
            continue
        inp = httpclient.InferInput("INPUT0", list(data.shape), dt.upper() if dt != "bool"
                                    else "BOOL")
        inp.set_data_from_numpy(data, binary_data=False)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)
        got = client.infer(f"identity_{dt}", [inp], outputs=[out]).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(got, data)


# ---- body size limit ----------------------------------------------------------------------

def test_body_larger_than_http_max_input_size(standard_repo):
    with start_server(standard_repo, "--http-max-input-size", "4096") as small:
        data = np.zeros(2048, np.float32)                      # 8 KiB raw body
        status, _, body = request(small, "POST", "/v2/models/identity_fp32/infer",
                                  data.tobytes(), {HEADER_LENGTH: "0"})
        assert status == 400
        msg = error_of(body)
        assert msg == ("Raw input has a byte_size (8192 bytes) that exceeds the maximum allowed "
                       "value of 4096 bytes. Use --http-max-input-size to increase the limit.")

        a = np.zeros((1, 16), np.float32)
        padded = json_infer_body(a, a)[:-1] + b" " * 8192 + b"}"
        status, _, body = request(small, "POST", "/v2/models/add_sub/infer", padded)
        assert status == 400 and error_of(body).startswith("request JSON size of ")
        # the limit applies after decompression
        status, _, body = request(small, "POST", "/v2/models/add_sub/infer",
                                  gzip.compress(padded), {"Content-Encoding": "gzip"})
        assert status == 400 and error_of(body) == (
            "Decompressed data size exceeds the maximum allowed value of 4096 bytes. Use "
            "--http-max-input-size to increase the limit.")
        # a body under the limit still works
        status, _, body = request(small, "POST", "/v2/models/add_sub/infer",
                                  json_infer_body(a, a))
        assert status == 200, body
