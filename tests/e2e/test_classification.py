"""The classification extension end to end, over HTTP and gRPC with the official clients
(`class_count=`): an output requested with "classification": k comes back as BYTES
"<value>:<index>[:<label>]" entries, shape [batch, k'] for a batching model, [k'] otherwise.

The expected entries are what Triton 2.51 answered to the same requests (its order of tied
values included); labels come from the output's label_filename (an empty line: no label)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server

LABELS = "zero\none\n\nthree\nfour\n"     # index 2: empty, no label; 5 and on: none
ROWS = np.array([[1, 5, 3, 5, 2, 0.5], [9, 8, 7, 6, 5, 4]], np.float32)
TOP3 = [[b"5.000000:1:one", b"5.000000:3:three", b"3.000000:2"],
        [b"9.000000:0:zero", b"8.000000:1:one", b"7.000000:2"]]
ALL = [[b"5.000000:1:one", b"5.000000:3:three", b"3.000000:2", b"2.000000:4:four",
        b"1.000000:0:zero", b"0.500000:5"],
       [b"9.000000:0:zero", b"8.000000:1:one", b"7.000000:2", b"6.000000:3:three",
        b"5.000000:4:four", b"4.000000:5"]]
UNSUPPORTED = "class result not available for output due to unsupported type '{}'"


def _config(name: str, datatype: str, batch: int, dims: str, labels: bool) -> str:
    label = ' label_filename: "labels.txt"' if labels else ""
    return (f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {batch}\n'
            f'input [{{ name: "INPUT0" data_type: TYPE_{datatype} dims: {dims} }}]\n'
            f'output [{{ name: "OUTPUT0" data_type: TYPE_{datatype} dims: {dims}{label} }}]\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n')


def _ensemble(name: str, step: str, own_labels: bool) -> str:
    """One step, IN -> ``step`` -> OUT; no label file of its own unless ``own_labels``."""
    inner = ("IN", "OUT") if step.startswith("cls_ens") else ("INPUT0", "OUTPUT0")
    label = ' label_filename: "own.txt"' if own_labels else ""
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 8\n'
            'input [{ name: "IN" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
            f'output [{{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ]{label} }}]\n'
            f'ensemble_scheduling {{ step [{{ model_name: "{step}" model_version: -1 '
            f'input_map {{ key: "{inner[0]}" value: "IN" }} '
            f'output_map {{ key: "{inner[1]}" value: "OUT" }} }}] }}\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("classification") / "models"
    for name, onnx_type, datatype, batch, dims, labels in (
            ("cls_fp32", "fp32", "FP32", 8, "[ -1 ]", True),
            ("cls_fp32_nobatch", "fp32", "FP32", 0, "[ -1, -1 ]", True),
            ("cls_int32", "int32", "INT32", 8, "[ -1 ]", False),
            ("cls_bytes", "bytes", "STRING", 8, "[ -1 ]", False),
            ("cls_bool", "bool", "BOOL", 8, "[ -1 ]", False)):
        models.identity(root / name, onnx_type)
        models.write_config(root / name, _config(name, datatype, batch, dims, labels))
        (root / name / "labels.txt").write_text(LABELS)
    models.add_sub(root / "add_sub", size=6)
    models.write_config(root / "add_sub", (
        'name: "add_sub"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 6 ] },'
        ' { name: "INPUT1" data_type: TYPE_FP32 dims: [ 6 ] }]\n'
        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 6 ] label_filename: "l.txt" },'
        ' { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 6 ] }]\n'))
    (root / "add_sub" / "l.txt").write_text("a\nb\nc\nd\ne\nf\n")
    for name, step, own in (("cls_ens", "cls_fp32", False), ("cls_ens_ens", "cls_ens", False),
                            ("cls_ens_own", "cls_fp32", True)):
        models.write_config(root / name, _ensemble(name, step, own))
        (root / name / "1").mkdir()
    (root / "cls_ens_own" / "own.txt").write_text("A\nB\n")
    with start_server(root) as srv:
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


def _infer(client, model, arr, datatype, k, binary=True, output="OUTPUT0", input="INPUT0"):
    mod = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    inp = mod.InferInput(input, list(arr.shape), datatype)
    extra = {"binary_data": binary} if mod is httpclient else {}
    if mod is httpclient:
        inp.set_data_from_numpy(arr, binary_data=binary)
    else:
        inp.set_data_from_numpy(arr)
    out = mod.InferRequestedOutput(output, class_count=k, **extra)
    return client.infer(model, [inp], outputs=[out])


def _out(result, name: str = "OUTPUT0") -> np.ndarray:
    """A BYTES output as bytes (tritonclient gives str for one that came as JSON)."""
    out = result.as_numpy(name)
    return np.array([x.encode() if isinstance(x, str) else x for x in out.ravel()],
                    object).reshape(out.shape)


def _post(server, model: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(params=["http", "http-json", "grpc"])
def call(request, http, grpc):
    client = grpc if request.param == "grpc" else http
    binary = request.param != "http-json"
    return lambda *a, **kw: _infer(client, *a, binary=binary, **kw)


# ---- the entries -------------------------------------------------------------------------

def test_batched_top_k_with_labels(call):
    r = call("cls_fp32", ROWS, "FP32", 3)
    out = _out(r)
    assert out.dtype == object and out.shape == (2, 3)
    assert out.tolist() == TOP3
    meta = r.get_output("OUTPUT0")
    assert (meta["datatype"] if isinstance(meta, dict) else meta.datatype) == "BYTES"


def test_k_larger_than_the_row(call):
    out = _out(call("cls_fp32", ROWS, "FP32", 10))
    assert out.shape == (2, 6) and out.tolist() == ALL


def test_model_without_batching_classifies_the_whole_tensor(call):
    out = _out(call("cls_fp32_nobatch", ROWS, "FP32", 2))
    assert out.shape == (2,)
    assert out.tolist() == [b"9.000000:6", b"8.000000:7"]   # indices into the whole tensor
    out = _out(call("cls_fp32_nobatch", ROWS, "FP32", 100))
    assert out.shape == (12,) and out[-1] == b"0.500000:5"


@pytest.mark.parametrize("model", ["cls_ens", "cls_ens_ens"])
def test_ensemble_output_has_the_labels_of_the_output_it_maps_from(call, model):
    """Triton completes an ensemble's labels from its steps' models (through an ensemble of
    ensembles too): the ensemble's OUT has no label file, cls_fp32's OUTPUT0 has."""
    out = _out(call(model, ROWS, "FP32", 3, input="IN", output="OUT"), "OUT")
    assert out.tolist() == TOP3


def test_ensemble_own_label_file_wins(call):
    out = _out(call("cls_ens_own", ROWS, "FP32", 2, input="IN", output="OUT"), "OUT")
    assert out.tolist() == [[b"5.000000:1:B", b"5.000000:3"], [b"9.000000:0:A", b"8.000000:1:B"]]


def test_int32_without_labels(call):
    out = _out(call("cls_int32", np.array([[1, -5, 3, 7]], np.int32), "INT32", 2))
    assert out.tolist() == [[b"7:3", b"3:2"]]


def test_ties_beyond_sixteen_elements_in_std_sort_order(call):
    """A row of 20 zeros: libstdc++'s introsort leaves them 10, 19, 18, ... (as Triton)."""
    out = _out(call("cls_fp32", np.zeros((1, 20), np.float32), "FP32", 4))
    assert out.tolist() == [[b"0.000000:10", b"0.000000:19", b"0.000000:18", b"0.000000:17"]]


@pytest.mark.parametrize("model,datatype,arr", [
    ("cls_bytes", "BYTES", np.array([[b"a", b"b"]], object)),
    ("cls_bool", "BOOL", np.array([[True, False]])),
])
def test_unsupported_datatype_is_invalid_arg(http, grpc, model, datatype, arr):
    """Triton 2.51 crashes on a BYTES output (a division by its 0-byte element size); the
    text is the one later Tritons and 2.51's BOOL answer."""
    with pytest.raises(InferenceServerException) as e:
        _infer(http, model, arr, datatype, 1)
    assert (e.value.status(), e.value.message()) == ("400", UNSUPPORTED.format(datatype))
    with pytest.raises(InferenceServerException) as e:
        _infer(grpc, model, arr, datatype, 1)
    assert (e.value.status(), e.value.message()) == ("StatusCode.INVALID_ARGUMENT",
                                                     UNSUPPORTED.format(datatype))
    assert http.is_server_ready()


def test_classification_beside_a_plain_output(http, grpc):
    a = np.array([[1, 2, 3, 4, 5, 6]], np.float32)
    b = np.array([[6, 5, 4, 3, 2, 1]], np.float32)
    for mod, client in ((httpclient, http), (grpcclient, grpc)):
        inputs = [mod.InferInput("INPUT0", [1, 6], "FP32"), mod.InferInput("INPUT1", [1, 6], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        r = client.infer("add_sub", inputs, outputs=[
            mod.InferRequestedOutput("OUTPUT0", class_count=2),
            mod.InferRequestedOutput("OUTPUT1")])
        # a + b is 7 everywhere: the first two of six tied values, as insertion sort leaves them
        assert r.as_numpy("OUTPUT0").tolist() == [[b"7.000000:0:a", b"7.000000:1:b"]]
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)


def test_grpc_stream_classifies_too(grpc):
    import queue
    results: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inp = grpcclient.InferInput("INPUT0", [2, 6], "FP32")
        inp.set_data_from_numpy(ROWS)
        grpc.async_stream_infer("cls_fp32", [inp], outputs=[
            grpcclient.InferRequestedOutput("OUTPUT0", class_count=3)])
        result, error = results.get(timeout=30)
    finally:
        grpc.stop_stream()
    assert error is None
    assert result.as_numpy("OUTPUT0").tolist() == TOP3


# ---- the parameter --------------------------------------------------------------------------

def _json_request(k) -> dict:
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
            "outputs": [{"name": "OUTPUT0", "parameters": {"classification": k}}]}


def test_http_json_response_shape(server):
    status, body = _post(server, "cls_fp32", _json_request(2))
    assert status == 200
    assert body["outputs"] == [{"name": "OUTPUT0", "datatype": "BYTES", "shape": [1, 2],
                                "data": ["3.000000:2", "2.000000:1:one"]}]


@pytest.mark.parametrize("k", [-1, 1.5, "2", True, None, 2**64])
def test_http_classification_must_be_an_unsigned_integer(server, k):
    """Triton answers 500 (TritonJson's error passes through as INTERNAL); a client's
    mistake, so 400 here, in Triton's words."""
    status, body = _post(server, "cls_fp32", _json_request(k))
    assert (status, body) == (400, {"error": "Unable to set 'classification': attempt to "
                                             "access JSON non-unsigned-integer as "
                                             "unsigned-integer"})


@pytest.mark.parametrize("k,classified", [(0, False), (2**32, False), (2**32 + 2, True)])
def test_http_count_is_a_uint32(server, k, classified):
    """Triton keeps the count as a uint32: 0 (also 2**32) asks for no classification."""
    status, body = _post(server, "cls_fp32", _json_request(k))
    assert status == 200
    out = body["outputs"][0]
    if classified:
        assert (out["datatype"], out["shape"], out["data"]) == (
            "BYTES", [1, 2], ["3.000000:2", "2.000000:1:one"])
    else:
        assert (out["datatype"], out["data"]) == ("FP32", [1.0, 2.0, 3.0])


def test_grpc_count_of_two_to_the_32_asks_for_none(grpc):
    out = _infer(grpc, "cls_fp32", ROWS, "FP32", 2**32).as_numpy("OUTPUT0")
    assert out.shape == (2, 0)


def test_classification_with_shared_memory_is_refused(server):
    body = _json_request(2)
    body["outputs"][0]["parameters"].update(shared_memory_region="r",
                                           shared_memory_byte_size=64)
    assert _post(server, "cls_fp32", body) == (400, {
        "error": "Output can't set both 'shared_memory_region' and 'classification'"})


def test_missing_label_file_fails_the_load(tmp_path):
    """Triton fails the load: "failed to open text file for read <path>: <strerror>"
    (wrapped in its explicit-load words); the model is UNAVAILABLE with that reason (a load
    on its own and as an ensemble's step)."""
    root = tmp_path / "models"
    models.identity(root / "nolabels", "fp32")
    models.write_config(root / "nolabels", _config("nolabels", "FP32", 8, "[ -1 ]", True))
    models.write_config(root / "nolabels_ens", _ensemble("nolabels_ens", "nolabels", False))
    (root / "nolabels_ens" / "1").mkdir()
    text = f"failed to open text file for read {root / 'nolabels' / 'labels.txt'}: No such file or directory"
    with start_server(root, "--model-control-mode", "explicit") as srv:
        http = httpclient.InferenceServerClient(srv.http_url)
        grpc = grpcclient.InferenceServerClient(srv.grpc_url)
        try:
            for client, status in ((http, "400"), (grpc, "StatusCode.INVALID_ARGUMENT")):
                with pytest.raises(InferenceServerException) as e:
                    client.load_model("nolabels")
                assert (e.value.status(), e.value.message()) == (status, (
                    f"load failed for model 'nolabels': version 1 is at UNAVAILABLE state: "
                    f"Internal: {text};\n"))
                assert not client.is_model_ready("nolabels")
                with pytest.raises(InferenceServerException) as e:
                    client.load_model("nolabels_ens")
                assert e.value.status() == status and text in e.value.message()
            index = {m["name"]: m for m in http.get_model_repository_index()}
            assert (index["nolabels"]["state"], index["nolabels"]["reason"]) == ("UNAVAILABLE", text)
            # the file appears: the next load succeeds and classifies with its labels
            (root / "nolabels" / "labels.txt").write_text(LABELS)
            http.load_model("nolabels_ens")
            out = _out(_infer(grpc, "nolabels_ens", ROWS, "FP32", 3, input="IN", output="OUT"), "OUT")
            assert out.tolist() == TOP3
        finally:
            http.close()
            grpc.close()
