"""Restricted API groups end to end: a real `trireme serve` with Triton's flags
(--http-restricted-api, --grpc-restricted-protocol) and the official tritonclient.

One server, explicit model control, "add_sub" loaded at start:
- HTTP: model-repository needs `admin-key: admin-value`; inference and metadata need
  `infer-key: infer-value`; health, statistics, model-config are open.
- gRPC: inference and health need metadata `triton-grpc-protocol-infer-key: infer-value`;
  model-config needs `triton-grpc-protocol-cfg-key: cfg-value`; the repository is open, so
  the start-up log warns that the gRPC model-repository API lets callers run code.
A refusal is Triton's: HTTP 403 {"error": "This API is restricted, expecting header
'<key>'"}, gRPC UNAVAILABLE "This protocol is restricted, expecting header
'triton-grpc-protocol-<key>'".
"""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server
from tritonclient.utils import InferenceServerException

HTTP_INFER = {"infer-key": "infer-value"}
HTTP_ADMIN = {"admin-key": "admin-value"}
GRPC_INFER = {"triton-grpc-protocol-infer-key": "infer-value"}
GRPC_CFG = {"triton-grpc-protocol-cfg-key": "cfg-value"}
HTTP_REFUSED_INFER = "This API is restricted, expecting header 'infer-key'"
HTTP_REFUSED_ADMIN = "This API is restricted, expecting header 'admin-key'"
GRPC_REFUSED_INFER = ("This protocol is restricted, expecting header "
                      "'triton-grpc-protocol-infer-key'")
GRPC_REFUSED_CFG = "This protocol is restricted, expecting header 'triton-grpc-protocol-cfg-key'"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("restricted") / "models"
    models.add_sub(repo / "add_sub")
    models.write_config(repo / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\n'
                        'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n')
    with start_server(repo, "--model-control-mode", "explicit", "--load-model", "add_sub",
                      "--http-restricted-api", "model-repository:admin-key=admin-value",
                      "--http-restricted-api=inference,metadata:infer-key=infer-value",
                      "--grpc-restricted-protocol=inference,health:infer-key=infer-value",
                      "--grpc-restricted-protocol", "model-config:cfg-key=cfg-value") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    c = httpclient.InferenceServerClient(server.http_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


# Headers are always passed as copies ({**HTTP_INFER}): tritonclient.http adds its own to
# the dict it is given.


def inputs(mod):
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    ins = [mod.InferInput("INPUT0", [1, 16], "FP32"), mod.InferInput("INPUT1", [1, 16], "FP32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(a)
    return ins, a


def http_refused(fn, text: str, *args, **kw) -> None:
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kw)
    assert info.value.status() == "403"
    assert info.value.message() == text


def grpc_refused(fn, text: str, *args, **kw) -> None:
    with pytest.raises(InferenceServerException) as info:
        fn(*args, **kw)
    assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert info.value.message() == text


def test_start_up_warns_that_the_open_grpc_repository_api_runs_code(server):
    log = server.log()
    warning = next(line for line in log.splitlines() if "model-repository API" in line)
    assert warning.startswith("W")
    assert "not restricted on gRPC;" in warning and "HTTP" not in warning.split(";")[0]
    assert "run code" in warning and "'file:'" in warning


def test_http_refusal_is_tritons_403_and_json(server):
    req = urllib.request.Request(f"http://{server.http_url}/v2", headers={"infer-key": "no"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 403
    assert json.loads(info.value.read()) == {"error": HTTP_REFUSED_INFER}


def test_http_restricted_groups(http):
    ins, a = inputs(httpclient)
    # inference: missing, wrong value, another group's header, then the right one
    http_refused(http.infer, HTTP_REFUSED_INFER, "add_sub", ins)
    http_refused(http.infer, HTTP_REFUSED_INFER, "add_sub", ins, headers={"infer-key": "x"})
    http_refused(http.infer, HTTP_REFUSED_INFER, "add_sub", ins, headers={**HTTP_ADMIN})
    out = http.infer("add_sub", ins, headers={**HTTP_INFER})
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), a + a)
    # metadata
    http_refused(http.get_server_metadata, HTTP_REFUSED_INFER)
    http_refused(http.get_model_metadata, HTTP_REFUSED_INFER, "add_sub",
                 headers={"infer-key": "infer-value2"})
    assert http.get_server_metadata(headers={**HTTP_INFER})["name"] == "trireme"
    assert http.get_model_metadata("add_sub", headers={**HTTP_INFER})["name"] == "add_sub"
    # model repository, with its own key
    http_refused(http.get_model_repository_index, HTTP_REFUSED_ADMIN, headers={**HTTP_INFER})
    http_refused(http.unload_model, HTTP_REFUSED_ADMIN, "add_sub", headers={**HTTP_INFER})
    http_refused(http.load_model, HTTP_REFUSED_ADMIN, "add_sub",
                 files={"file:1/model.py": b"import os"})
    index = http.get_model_repository_index(headers={**HTTP_ADMIN})
    assert {m["name"]: m.get("state") for m in index} == {"add_sub": "READY"}
    http.load_model("add_sub", headers={**HTTP_ADMIN})          # a reload of the same files
    assert http.is_model_ready("add_sub")


def test_http_unrestricted_groups_need_no_header(http):
    assert http.is_server_live() and http.is_server_ready()    # health
    assert http.is_model_ready("add_sub")
    assert http.get_model_config("add_sub")["name"] == "add_sub"  # model-config
    stats = http.get_inference_statistics("add_sub")            # statistics
    assert stats["model_stats"][0]["name"] == "add_sub"
    assert http.get_inference_statistics("add_sub", headers={**HTTP_INFER})["model_stats"]


def test_grpc_restricted_groups(grpc):
    ins, a = inputs(grpcclient)
    grpc_refused(grpc.infer, GRPC_REFUSED_INFER, "add_sub", ins)
    grpc_refused(grpc.infer, GRPC_REFUSED_INFER, "add_sub", ins,
                 headers={"triton-grpc-protocol-infer-key": "x"})
    grpc_refused(grpc.infer, GRPC_REFUSED_INFER, "add_sub", ins, headers={**HTTP_INFER})  # no prefix
    out = grpc.infer("add_sub", ins, headers={**GRPC_INFER})
    np.testing.assert_array_equal(out.as_numpy("OUTPUT1"), a - a)
    grpc_refused(grpc.is_server_live, GRPC_REFUSED_INFER)
    grpc_refused(grpc.is_server_ready, GRPC_REFUSED_INFER, headers={**GRPC_CFG})
    grpc_refused(grpc.is_model_ready, GRPC_REFUSED_INFER, "add_sub")
    assert grpc.is_server_live(headers={**GRPC_INFER})
    assert grpc.is_model_ready("add_sub", headers={**GRPC_INFER})
    grpc_refused(grpc.get_model_config, GRPC_REFUSED_CFG, "add_sub", headers={**GRPC_INFER})
    assert grpc.get_model_config("add_sub", headers={**GRPC_CFG}).config.name == "add_sub"


def test_grpc_stream_is_refused_without_the_key(grpc):
    ins, a = inputs(grpcclient)
    results: queue.Queue = queue.Queue()
    grpc.start_stream(lambda result, error: results.put(error or result))
    try:
        err = results.get(timeout=10)
        assert isinstance(err, InferenceServerException)
        assert err.status() == "StatusCode.UNAVAILABLE"
        assert err.message() == GRPC_REFUSED_INFER
    finally:
        grpc.stop_stream()
    grpc.start_stream(lambda result, error: results.put(error or result), headers={**GRPC_INFER})
    try:
        grpc.async_stream_infer("add_sub", ins, request_id="1")
        got = results.get(timeout=30)
        assert not isinstance(got, InferenceServerException), got
        np.testing.assert_array_equal(got.as_numpy("OUTPUT0"), a + a)
    finally:
        grpc.stop_stream()


def test_grpc_unrestricted_groups_need_no_header(grpc):
    assert grpc.get_server_metadata().name == "trireme"                # metadata
    assert grpc.get_model_metadata("add_sub").name == "add_sub"
    assert grpc.get_inference_statistics("add_sub").model_stats[0].name == "add_sub"
    index = grpc.get_model_repository_index()                          # open on gRPC
    assert [m.name for m in index.models] == ["add_sub"]
