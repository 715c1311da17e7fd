"""BF16 end to end, and the JSON rules of every datatype, as Triton 2.51 applies them.

- JSON cannot carry FP16 or BF16, either way: Triton's 400s, in its words.
- Binary BF16 works both ways over HTTP and gRPC (raw contents), through Python models:
  Triton's own qa model identity_bf16 (unmodified: it checks that as_numpy() refuses a BF16
  tensor and goes through DLPack and torch) and an arithmetic one.
  And through an ONNX model (onnxruntime's Python API takes no bfloat16 array: the backend
  feeds and reads BF16 through OrtValues).
- Other datatypes' JSON: BOOL only true/false, integers wrap to their width as a C cast, floats
  take any number, BYTES only strings; the texts are Triton's (which answers them with 500:
  400 here, the client's mistake)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server

# server qa/python_models/identity_bf16/model.py, as Triton ships it
IDENTITY_BF16 = '''
import json

import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.input0_config = pb_utils.get_input_config_by_name(self.model_config, "INPUT0")
        self.output0_config = pb_utils.get_output_config_by_name(self.model_config, "OUTPUT0")

    def validate_bf16_tensor(self, tensor, tensor_config):
        dtype = tensor_config["data_type"]
        if dtype != "TYPE_BF16":
            raise Exception(f"Expected a BF16 tensor, but got {dtype} instead.")
        try:
            _ = tensor.as_numpy()
        except pb_utils.TritonModelException as e:
            expected_error = "tensor dtype is bf16 and cannot be converted to numpy"
            assert expected_error in str(e).lower()
        else:
            raise Exception("Expected BF16 conversion to numpy to fail")

    def execute(self, requests):
        responses = []
        for request in requests:
            input_tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            bf16_dlpack = input_tensor.to_dlpack()
            torch_tensor = torch.utils.dlpack.from_dlpack(bf16_dlpack)
            output_tensor = pb_utils.Tensor.from_dlpack(
                "OUTPUT0", torch.utils.dlpack.to_dlpack(torch_tensor)
            )
            responses.append(pb_utils.InferenceResponse([output_tensor]))
            self.validate_bf16_tensor(input_tensor, self.input0_config)
            self.validate_bf16_tensor(output_tensor, self.output0_config)
        return responses
'''

# OUTPUT0 = 2 * INPUT0 in torch (through DLPack); OUTPUT1 = INPUT0 + 1 made with numpy and
# handed back as an ml_dtypes.bfloat16 array
ARITHMETIC_BF16 = '''
import ml_dtypes
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, "INPUT0"))
            doubled = pb_utils.Tensor.from_dlpack("OUTPUT0", x * 2)
            plus_one = (x.float().numpy() + 1).astype(ml_dtypes.bfloat16)
            responses.append(pb_utils.InferenceResponse(
                [doubled, pb_utils.Tensor("OUTPUT1", plus_one)]))
        return responses
'''


def _python_model(root, name: str, source: str, outputs: tuple[str, ...]) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    outs = ", ".join(f'{{ name: "{o}" data_type: TYPE_BF16 dims: [ -1 ] }}' for o in outputs)
    models.write_config(root / name, (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 64\n'
        'input [{ name: "INPUT0" data_type: TYPE_BF16 dims: [ -1 ] }]\n'
        f'output [{outs}]\ninstance_group [{{ kind: KIND_CPU, count: 1 }}]\n'))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16") / "models"
    _python_model(root, "identity_bf16", IDENTITY_BF16, ("OUTPUT0",))
    _python_model(root, "arithmetic_bf16", ARITHMETIC_BF16, ("OUTPUT0", "OUTPUT1"))
    for dt in ("fp16", "fp32", "int8", "uint8", "int64", "uint64", "bool", "bytes"):
        models.identity(root / f"identity_{dt}", dt)
        models.write_config(root / f"identity_{dt}",
                            "max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n")
    _onnx_bf16(root / "onnx_bf16")
    with start_server(root) as srv:
        yield srv


def _onnx_bf16(model_dir) -> None:
    """INPUT0 (BF16) -> OUTPUT0 = 2 x INPUT0 (BF16) and OUTPUT1 = the same as FP32."""
    from onnx import TensorProto, helper
    g = helper.make_graph(
        [helper.make_node("Cast", ["INPUT0"], ["x"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["x", "two"], ["OUTPUT1"]),
         helper.make_node("Cast", ["OUTPUT1"], ["OUTPUT0"], to=TensorProto.BFLOAT16)], "bf16",
        [helper.make_tensor_value_info("INPUT0", TensorProto.BFLOAT16, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.BFLOAT16, ["batch", "n"]),
         helper.make_tensor_value_info("OUTPUT1", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    models._save(g, model_dir / "1" / "model.onnx")
    models.write_config(model_dir, "max_batch_size: 8\n")


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_bf16_through_an_onnx_model(server, mod):
    url = server.http_url if mod is httpclient else server.grpc_url
    client = mod.InferenceServerClient(url)
    x = np.array([[1.5, -2.0, 0.0078125, 1e30], [0.0, 1.0, -1.0, 2.5]], dtype=ml_dtypes.bfloat16)
    inp = mod.InferInput("INPUT0", list(x.shape), "BF16")
    inp.set_data_from_numpy(x, **({"binary_data": True} if mod is httpclient else {}))
    outs = [mod.InferRequestedOutput(n, **({"binary_data": True} if mod is httpclient else {}))
            for n in ("OUTPUT0", "OUTPUT1")]
    r = client.infer("onnx_bf16", [inp], outputs=outs)
    want = x.astype(np.float32) * 2
    o = r.get_output("OUTPUT0")
    assert (o["datatype"] if mod is httpclient else o.datatype) == "BF16"
    got = np.frombuffer(r.as_numpy("OUTPUT0").tobytes(), dtype=ml_dtypes.bfloat16).reshape(2, 4) \
        if r.as_numpy("OUTPUT0").dtype != ml_dtypes.bfloat16 else r.as_numpy("OUTPUT0")
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), want)


def _post(server, model: str, body: dict | bytes, header_length: int | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {} if header_length is None else {
        "Inference-Header-Content-Length": str(header_length)}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer",
                                 data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _json_input(datatype: str, shape: list, data) -> dict:
    return {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": shape, "data": data}]}


def _binary_request(arr: np.ndarray, datatype: str, outputs: list | None = None):
    head = {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": list(arr.shape),
                        "parameters": {"binary_data_size": arr.nbytes}}]}
    if outputs is not None:
        head["outputs"] = outputs
    header = json.dumps(head).encode()
    return header + arr.tobytes(), len(header)


X = np.array([[1.5, -2.0, 3.0e38, 0.0078125]], ml_dtypes.bfloat16)


# ---- JSON refuses FP16 and BF16 ---------------------------------------------------------

@pytest.mark.parametrize("model,datatype", [("identity_bf16", "BF16"), ("identity_fp16", "FP16")])
def test_json_input_is_refused(server, model, datatype):
    status, body = _post(server, model, _json_input(datatype, [1, 2], [1.5, 2]))
    assert (status, json.loads(body)) == (400, {"error": (
        f"receiving {datatype} data via JSON is not supported. Please use the binary data "
        f"format for input INPUT0")})


@pytest.mark.parametrize("model,datatype,arr", [
    ("identity_bf16", "BF16", X),
    ("identity_fp16", "FP16", np.array([[1.5, -2]], np.float16)),
])
def test_json_output_is_refused(server, model, datatype, arr):
    """Triton runs the model, then refuses to write the output as JSON."""
    want = (400, {"error": f"sending {datatype} data via JSON is not supported. Please use the "
                           f"binary data format for output"})
    body, n = _binary_request(arr, datatype)                       # outputs JSON by default
    status, answer = _post(server, model, body, n)
    assert (status, json.loads(answer)) == want
    body, n = _binary_request(arr, datatype, [{"name": "OUTPUT0"}])
    status, answer = _post(server, model, body, n)
    assert (status, json.loads(answer)) == want
    # no elements: nothing read from JSON (Triton too), but the output is still refused
    status, answer = _post(server, model, _json_input(datatype, [1, 0], []))
    assert (status, json.loads(answer)) == want


def test_binary_output_beside_a_json_request(server):
    body, n = _binary_request(X, "BF16", [{"name": "OUTPUT0", "parameters": {"binary_data": True}}])
    status, answer = _post(server, "identity_bf16", body, n)
    assert status == 200
    head = json.loads(answer[:answer.index(b"}]}") + 3])
    assert head["outputs"] == [{"name": "OUTPUT0", "datatype": "BF16", "shape": [1, 4],
                                "parameters": {"binary_data_size": 8}}]
    assert answer.endswith(X.tobytes())


# ---- binary BF16 through Python models ------------------------------------------------------

@pytest.mark.parametrize("mod", [httpclient, grpcclient])
def test_triton_identity_bf16_model(server, mod):
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    try:
        inp = mod.InferInput("INPUT0", list(X.shape), "BF16")
        inp.set_data_from_numpy(X)
        out = client.infer("identity_bf16", [inp]).as_numpy("OUTPUT0")
    finally:
        client.close()
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == X.shape
    assert out.view(np.uint16).tolist() == X.view(np.uint16).tolist()


@pytest.mark.parametrize("mod", [httpclient, grpcclient])
def test_bf16_arithmetic_in_a_python_model(server, mod):
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    x = np.array([[1.5, -2.0, 0.25, 100.0], [3.0, 0.0, -0.5, 7.0]], ml_dtypes.bfloat16)
    try:
        inp = mod.InferInput("INPUT0", list(x.shape), "BF16")
        inp.set_data_from_numpy(x)
        r = client.infer("arithmetic_bf16", [inp])
    finally:
        client.close()
    assert r.as_numpy("OUTPUT0").dtype == ml_dtypes.bfloat16
    assert r.as_numpy("OUTPUT0").astype(np.float32).tolist() == \
        [[3.0, -4.0, 0.5, 200.0], [6.0, 0.0, -1.0, 14.0]]
    assert r.as_numpy("OUTPUT1").astype(np.float32).tolist() == \
        [[2.5, -1.0, 1.25, 101.0], [4.0, 1.0, 0.5, 8.0]]


# ---- the other datatypes' JSON rules -----------------------------------------------------

@pytest.mark.parametrize("model,datatype,data,want", [
    ("identity_int8", "INT8", [300, -200], [44, 56]),                 # wrapped, as a C cast
    ("identity_uint8", "UINT8", [256, 2], [0, 2]),
    ("identity_uint64", "UINT64", [2**64 - 1, 0], [2**64 - 1, 0]),
    ("identity_int64", "INT64", [-(2**63), 2**63 - 1], [-(2**63), 2**63 - 1]),
    ("identity_fp32", "FP32", [[1], [2**70]], [1.0, float(np.float32(2.0**70))]),
    ("identity_bool", "BOOL", [True, False], [True, False]),
    ("identity_bytes", "BYTES", [["é"], ["b"]], ["é", "b"]),
])
def test_json_values_triton_accepts(server, model, datatype, data, want):
    status, body = _post(server, model, _json_input(datatype, [1, 2], data))
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == want


def test_json_output_writes_nan_and_infinities_as_triton(server):
    arr = np.array([[np.nan, np.inf, -np.inf, 0.5]], np.float32)
    body, n = _binary_request(arr, "FP32")
    status, answer = _post(server, "identity_fp32", body, n)
    assert status == 200
    assert b'"data":[NaN,Infinity,-Infinity,0.5]' in answer


NOT = "Unable to parse 'data': attempt to access JSON non-"


@pytest.mark.parametrize("model,datatype,shape,data,text", [
    ("identity_uint8", "UINT8", [1, 2], [-1, 2], NOT + "unsigned-integer as unsigned-integer"),
    ("identity_int64", "INT64", [1, 2], [2**63, 1], NOT + "signed-integer as signed-integer"),
    ("identity_int8", "INT8", [1, 2], [1.0, 2], NOT + "signed-integer as signed-integer"),
    ("identity_int8", "INT8", [1, 2], [True, 2], NOT + "signed-integer as signed-integer"),
    ("identity_fp32", "FP32", [1, 2], ["1", 2], NOT + "number as double"),
    ("identity_fp32", "FP32", [1, 2], [None, 2], NOT + "number as double"),
    ("identity_bool", "BOOL", [1, 2], [1, 0], NOT + "boolean as boolean"),
    ("identity_fp32", "FP32", [1, 1], 5, NOT + "array as array"),
    ("identity_fp32", "FP32", [1, 2], [1],
     "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ("identity_fp32", "FP32", [1, 2], [1, 2, 3],
     "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ("identity_bytes", "BYTES", [1, 2], ["a", 1],
     "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    ("identity_bytes", "BYTES", [1, 2], ["a"],
     "[request id: <id_unknown>] expected 2 string elements for inference input 'INPUT0' for "
     "model 'identity_bytes', got 1"),
    ("identity_fp32", "FOO", [1, 2], [1, 2], "invalid datatype for input INPUT0"),
])
def test_json_values_triton_refuses(server, model, datatype, shape, data, text):
    status, body = _post(server, model, _json_input(datatype, shape, data))
    assert (status, json.loads(body)) == (400, {"error": text})


def test_grpc_typed_contents_have_no_bf16_field(server):
    """gRPC: BF16 travels as raw contents only (no typed field holds it)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("INPUT0", [1, 2], "BF16")
        inp._input.contents.fp32_contents.extend([1.0, 2.0])
        with pytest.raises(InferenceServerException) as e:
            client.infer("identity_bf16", [inp])
    finally:
        client.close()
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == ("unexpected explicit tensor data for input tensor 'INPUT0' "
                                 "for model 'identity_bf16' of type 'FP32', expected datatype "
                                 "'BF16'")
