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
from conftest import start_server
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
    assert error_of(body) == ("Raw request must only have 1 input (found 1) to be deduced but "
                              "got 2 inputs in 'add_sub' model configuration")


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
