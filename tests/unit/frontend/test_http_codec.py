"""Unit tests for services/frontend/http_codec.py: HTTP bodies <-> CoreRequest/CoreResponse.

Pure functions on bytes, no server. Expected error texts are Triton's (src/http_server.cc)
where Triton has one.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import struct
import zlib

import numpy as np
import pytest

from services.common.errors import Code, TriremeError
from services.dataplane.types import CoreRequest, CoreResponse, OutputTensor, RequestedOutput
from services.frontend.http import codec, json_body


def _body(doc: dict, *tensors: bytes) -> tuple[bytes, int]:
    header = json.dumps(doc).encode()
    return header + b"".join(tensors), len(header)


def _raises(fn, *args, code: Code = Code.INVALID_ARG) -> str:
    with pytest.raises(TriremeError) as info:
        fn(*args)
    assert info.value.code == code
    return info.value.message


def _bytes_tensor(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


# ---- requests ------------------------------------------------------------------------

def test_json_request():
    body = json.dumps({
        "id": "req-7",
        "parameters": {"priority": 1, "binary_data_output": True},
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [[1.0, 2.0, 3.5]]},
            {"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["ab", "c"],
             "parameters": {"foo": "bar"}},
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": False}}],
    }).encode()
    req, binary_default = codec.decode_infer_request("m", "2", body)
    assert (req.model, req.version, req.id) == ("m", "2", "req-7")
    assert binary_default is True
    assert req.parameters == {"priority": 1}  # binary_data_output is consumed here
    a, t = req.inputs
    assert (a.name, a.datatype, a.shape) == ("INPUT0", "FP32", [1, 3])
    assert np.array_equal(np.frombuffer(a.data, "<f4"), [1.0, 2.0, 3.5])
    assert bytes(t.data) == _bytes_tensor(b"ab", b"c")
    assert t.parameters == {"foo": "bar"}
    assert [(o.name, o.parameters) for o in req.outputs] == [("OUTPUT0", {"binary_data": False})]


def test_json_request_defaults():
    body = b'{"inputs":[{"name":"X","datatype":"INT32","shape":[0],"data":[]}]}'
    req, binary_default = codec.decode_infer_request("m", "", body)
    assert req.id == "" and req.outputs is None and req.parameters == {}
    assert binary_default is False
    assert req.inputs[0].data == b""
    # an empty "outputs" array asks for every output
    body = b'{"inputs":[],"outputs":[]}'
    assert codec.decode_infer_request("m", "", body)[0].outputs is None


def test_binary_request_with_two_inputs_is_zero_copy():
    a = np.arange(4, dtype="<f4").tobytes()
    b = np.arange(3, dtype="<i8").tobytes()
    body, n = _body({"inputs": [
        {"name": "A", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
        {"name": "J", "datatype": "INT32", "shape": [2], "data": [5, 6]},
        {"name": "B", "datatype": "INT64", "shape": [3], "parameters": {"binary_data_size": 24}},
    ]}, a, b)
    req, _ = codec.decode_infer_request("m", "", body, codec.parse_header_length(str(n), len(body)))
    ia, ij, ib = req.inputs
    assert isinstance(ia.data, memoryview) and ia.data.obj is body  # a view, not a copy
    assert bytes(ia.data) == a and bytes(ib.data) == b
    assert np.array_equal(np.frombuffer(ij.data, "<i4"), [5, 6])
    assert ia.parameters == {"binary_data_size": 16}


def test_binary_sizes_that_do_not_add_up():
    data = b"\x00" * 8
    doc = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [4],
                       "parameters": {"binary_data_size": 16}}]}
    body, n = _body(doc, data)
    msg = _raises(codec.decode_infer_request, "m", "", body, n)
    assert msg == "unexpected size for input 'A', expecting 8 additional bytes for model 'm'"
    body, n = _body(doc, data * 3)
    msg = _raises(codec.decode_infer_request, "m", "", body, n)
    assert msg == "unexpected additional input data for model 'm'"
    # binary_data_size with no header length: the whole body is JSON, nothing follows
    body, _ = _body(doc)
    assert "expecting 16 additional bytes" in _raises(codec.decode_infer_request, "m", "", body)


def test_header_length_checks():
    assert codec.parse_header_length(None, 10) is None
    assert codec.parse_header_length("0", 10) == 0
    assert codec.parse_header_length("10", 10) == 10
    assert _raises(codec.parse_header_length, "11", 10) == \
        "inference header size should be in range (0, 10), got: 11"
    assert "Unable to parse Inference-Header-Content-Length" in \
        _raises(codec.parse_header_length, "x", 10)


@pytest.mark.parametrize("body, text", [
    (b"AAAA", "failed to parse the request JSON buffer: Invalid value. at 0"),
    (b"", "failed to parse the request JSON buffer: The document is empty. at 0"),
    (b'{"inputs": [}', "failed to parse the request JSON buffer: "),
    (b'{"inputs": []} x', "failed to parse the request JSON buffer: The document root must "
                          "not be followed by other values."),
    (b'{"inputs": [', "failed to parse the request JSON buffer: "),
])
def test_malformed_json(body, text):
    assert _raises(codec.decode_infer_request, "m", "", body).startswith(text)


@pytest.mark.parametrize("doc, text", [
    ([], "Unable to parse 'inputs'"),
    ({}, "Unable to parse 'inputs'"),
    ({"inputs": {}}, "Unable to parse 'inputs'"),
    ({"id": 5, "inputs": []}, "Unable to parse 'id'"),
    ({"inputs": [], "parameters": {"binary_data_output": 1}},
     "Unable to parse 'binary_data_output'"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [1]}]},
     "Input must set only one of the following fields: 'data', 'binary_data_size' in "
     "'parameters', 'shared_memory_region' in 'parameters'. But no field is set"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "data": [1],
                  "parameters": {"binary_data_size": 4}}]},
     "But set 'data' 'binary_data_size'"),
    ({"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}, "Unable to parse 'name'"),
    ({"inputs": [{"name": "A", "shape": [1], "data": [1]}]}, "Unable to parse 'datatype'"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [-1], "data": [1]}]},
     "Unable to parse 'shape'"),
    ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [True], "data": [1]}]},
     "Unable to parse 'shape'"),
    ({"inputs": [], "outputs": {}}, "Unable to parse 'outputs'"),
    ({"inputs": [], "outputs": [{"name": "O", "parameters": {"binary_data": "yes"}}]},
     "Unable to parse 'binary_data'"),
    ({"inputs": [], "outputs": [{"name": "O", "parameters": {
        "shared_memory_region": "r", "binary_data": True}}]},
     "Output can't set both 'shared_memory_region' and 'binary_data'"),
])
def test_request_field_errors(doc, text):
    assert text in _raises(codec.decode_infer_request, "m", "", json.dumps(doc).encode())


def test_json_data_errors_are_tritons():
    """ReadDataFromJson's texts (datatypes.json_to_buffer), through the typed fast path and
    the generic one alike."""
    for data, shape, text in (
            ([1, "x"], [2], "Unable to parse 'data': attempt to access JSON non-signed-integer "
                            "as signed-integer"),
            ([1, 2], [3], "Unable to parse 'data': Shape does not match true shape of 'data' "
                          "field"),
            (5, [1], "Unable to parse 'data': attempt to access JSON non-array as array")):
        doc = {"inputs": [{"name": "A", "datatype": "INT32", "shape": shape, "data": data}]}
        assert _raises(codec.decode_infer_request, "m", "", json.dumps(doc).encode()) == text
    for datatype in ("FP16", "BF16"):
        doc = {"inputs": [{"name": "A", "datatype": datatype, "shape": [2], "data": [1, 2]}]}
        assert _raises(codec.decode_infer_request, "m", "", json.dumps(doc).encode()) == (
            f"receiving {datatype} data via JSON is not supported. Please use the binary "
            f"data format for input A")


_MAX = 2**63 - 1


@pytest.mark.parametrize("datatype,shape,text", [
    # Triton's QA (L0_http test_buffer_size_overflow): checked before the data is read
    ("FP32", [16, 2**60 + 2], "invalid shape for input 'A': shape [16,1152921504606846978] "
                              f"causes total element count to exceed maximum size of {_MAX}"),
    ("FP32", [4, 2**60 + 2], "byte size overflow for input 'A': element count "
                             f"(4611686018427387912) * data type size (4) exceeds maximum "
                             f"allowed size ({_MAX})"),
    # GetElementCount walks in order: the overflow comes before a later 0
    ("INT8", [2**62, 4, 0], "invalid shape for input 'A': shape [4611686018427387904,4,0] "
                            f"causes total element count to exceed maximum size of {_MAX}"),
    # a dimension Triton's int64 holds as negative
    ("FP32", [2**63, 2], "invalid shape for input 'A': shape [-9223372036854775808,2] "
                         "contains one or more invalid dimensions"),
    # a one-byte type has no byte-size check: the data's count decides
    ("INT8", [4, 2**60 + 2], "Unable to parse 'data': Shape does not match true shape of "
                             "'data' field"),
])
def test_json_element_count_is_checked_before_the_data(datatype, shape, text):
    for data in ([1], "not an array"):
        doc = {"inputs": [{"name": "A", "datatype": datatype, "shape": shape, "data": data}]}
        got = _raises(codec.decode_infer_request, "m", "", json.dumps(doc).encode())
        assert got == (text if "Shape does not" not in text or data != "not an array" else
                       "Unable to parse 'data': attempt to access JSON non-array as array")


def test_shared_memory_input_passes_through():
    params = {"shared_memory_region": "r0", "shared_memory_offset": 16,
              "shared_memory_byte_size": 64}
    doc = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [16], "parameters": params}]}
    req, _ = codec.decode_infer_request("m", "", json.dumps(doc).encode())
    assert req.inputs[0].data is None and req.inputs[0].parameters == params


# ---- raw binary ------------------------------------------------------------------------

def _config(*inputs, max_batch_size=8):
    return {"name": "m", "max_batch_size": max_batch_size, "input": list(inputs)}


def test_raw_request_deduces_the_variable_dim():
    body = np.arange(6, dtype="<f4").tobytes()
    cfg = _config({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]})
    req = codec.decode_raw_request("m", "3", body, cfg)
    (t,) = req.inputs
    assert (req.model, req.version, req.outputs) == ("m", "3", None)
    assert (t.name, t.datatype, t.shape) == ("INPUT0", "FP32", [1, 6])
    assert t.data is body
    cfg = _config({"name": "X", "data_type": "TYPE_INT16", "dims": [2, -1]}, max_batch_size=0)
    assert codec.decode_raw_request("m", "", body, cfg).inputs[0].shape == [2, 6]  # 24 bytes of INT16
    cfg = _config({"name": "X", "data_type": "TYPE_FP32", "dims": ["16"]})  # int64 as text
    assert codec.decode_raw_request("m", "", body, cfg).inputs[0].shape == [1, 16]


def test_raw_request_errors():
    """Triton 2.51's texts, each with LogRequest()'s prefix (a raw request has no id)."""
    two = _config({"name": "A", "data_type": "TYPE_FP32", "dims": [16]},
                  {"name": "B", "data_type": "TYPE_FP32", "dims": [16]})
    assert _raises(codec.decode_raw_request, "add_sub", "", b"x", two) == (
        "[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be "
        "deduced but got 2 inputs in 'add_sub' model configuration")
    cfg = _config({"name": "A", "data_type": "TYPE_FP32", "dims": [-1, -1]})
    assert "can not be deduced because there are more than one variable-sized dimension" in \
        _raises(codec.decode_raw_request, "m", "", b"x", cfg)
    cfg = _config({"name": "A", "data_type": "TYPE_STRING", "dims": [-1]})
    assert _raises(codec.decode_raw_request, "m", "", b"x", cfg) == \
        "[request id: <id_unknown>] For BYTE datatype raw input 'A', the model must have input shape [1]"


def test_raw_bytes_input_becomes_one_element():
    cfg = _config({"name": "S", "data_type": "TYPE_STRING", "dims": [1]})
    (t,) = codec.decode_raw_request("m", "", b"hello", cfg).inputs
    assert (t.datatype, t.shape, bytes(t.data)) == ("BYTES", [1, 1], _bytes_tensor(b"hello"))


# ---- responses -------------------------------------------------------------------------

def _resp(**kw):
    out0 = np.arange(4, dtype="<f4")
    outputs = [
        OutputTensor("OUTPUT0", "FP32", [1, 4], memoryview(out0.tobytes())),
        OutputTensor("OUTPUT1", "INT64", [2], np.array([7, -1], "<i8").tobytes()),
    ]
    return CoreResponse("m", "1", outputs=outputs, **kw)


def _split(body: bytes, header_length: int | None):
    if header_length is None:
        return json.loads(body), b""
    return json.loads(body[:header_length]), body[header_length:]


def test_json_response():
    req = CoreRequest("m", id="abc")
    body, n = codec.encode_infer_response(_resp(), req, False)
    assert n is None
    doc = json.loads(body)
    assert list(doc) == ["id", "model_name", "model_version", "outputs"]
    assert (doc["id"], doc["model_name"], doc["model_version"]) == ("abc", "m", "1")
    assert doc["outputs"] == [
        {"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 4], "data": [0.0, 1.0, 2.0, 3.0]},
        {"name": "OUTPUT1", "datatype": "INT64", "shape": [2], "data": [7, -1]},
    ]


def test_binary_response_for_all_outputs():
    body, n = codec.encode_infer_response(_resp(parameters={"p": 1}), CoreRequest("m"), True)
    doc, rest = _split(body, n)
    assert "id" not in doc and doc["parameters"] == {"p": 1}
    sizes = [o["parameters"]["binary_data_size"] for o in doc["outputs"]]
    assert sizes == [16, 16] and all("data" not in o for o in doc["outputs"])
    assert np.array_equal(np.frombuffer(rest[:16], "<f4"), [0, 1, 2, 3])
    assert np.array_equal(np.frombuffer(rest[16:], "<i8"), [7, -1])


@pytest.mark.parametrize("requested, binary_default, binary", [
    # per-output "binary_data" decides for the outputs the request names ...
    ([("OUTPUT0", True), ("OUTPUT1", False)], False, [True, False]),
    ([("OUTPUT0", False), ("OUTPUT1", True)], True, [False, True]),
    # ... a named output without it is JSON, even with binary_data_output (as Triton)
    ([("OUTPUT0", None), ("OUTPUT1", True)], True, [False, True]),
    # outputs the request does not name follow binary_data_output
    (None, True, [True, True]),
    (None, False, [False, False]),
])
def test_output_binary_data_rules(requested, binary_default, binary):
    outputs = None
    if requested is not None:
        outputs = [RequestedOutput(name, {} if b is None else {"binary_data": b})
                   for name, b in requested]
    body, n = codec.encode_infer_response(_resp(), CoreRequest("m", outputs=outputs),
                                          binary_default)
    doc, rest = _split(body, n)
    got = ["binary_data_size" in o.get("parameters", {}) for o in doc["outputs"]]
    assert got == binary
    assert [("data" in o) for o in doc["outputs"]] == [not b for b in binary]
    assert len(rest) == 16 * sum(binary)


@pytest.mark.parametrize("datatype", ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8",
                                      "INT16", "INT32", "INT64", "FP32", "FP64"])
def test_json_output_numbers_are_written_as_doubles(datatype):
    """Every value of a JSON output reads back as the tensor's value widened to a double
    (what Triton writes), extremes and unaligned bytes included; NaN and infinities are
    written as Triton's rapidjson writes them (NaN, Infinity, -Infinity)."""
    from services.common.datatypes import numpy_dtype
    dtype = numpy_dtype(datatype)
    if datatype == "BOOL":
        arr = np.array([True, False, True])
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        arr = np.array([info.min, info.max, 0, 1, info.max // 3], dtype=dtype)
    else:
        import ml_dtypes
        fin = ml_dtypes.finfo(dtype)
        with np.errstate(over="ignore"):
            arr = np.array([0.1, -2.5e-3, 1e20, 3e-30, float(fin.max), float(fin.tiny),
                            -0.0, np.inf, -np.inf, np.nan, 123456.789], dtype=dtype)
    raw = memoryview(b"\0" + arr.tobytes())[1:]          # an unaligned frame
    resp = CoreResponse("m", "1", outputs=[OutputTensor("O", datatype, [arr.size], raw)])
    body, n = codec.encode_infer_response(resp, CoreRequest("m"), False)
    got = json.loads(body)["outputs"][0]["data"]
    want = (arr.astype(np.float64) if dtype.kind == "f" else arr).tolist()
    assert [("nan" if isinstance(v, float) and math.isnan(v) else v) for v in got] == \
        [("nan" if isinstance(v, float) and math.isnan(v) else v) for v in want]
    assert all(type(g) is type(w) for g, w in zip(got, want))
    if dtype.kind == "f":
        assert b'"data":[0.1' in body and b",NaN," in body
        assert b",Infinity,-Infinity," in body


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_json_output_of_fp16_and_bf16_is_refused(datatype):
    resp = CoreResponse("m", "1", outputs=[OutputTensor("O", datatype, [1], b"\0\0")])
    with pytest.raises(TriremeError) as e:
        codec.encode_infer_response(resp, CoreRequest("m"), False)
    assert (e.value.code, e.value.message) == (Code.INVALID_ARG, (
        f"sending {datatype} data via JSON is not supported. Please use the binary data "
        f"format for output"))
    body, n = codec.encode_infer_response(resp, CoreRequest("m"), True)   # binary: fine
    assert body[n:] == b"\0\0"


def test_empty_binary_output_is_plain_json():
    resp = CoreResponse("m", "1", outputs=[OutputTensor("O", "FP32", [0], b"")])
    body, n = codec.encode_infer_response(resp, CoreRequest("m"), True)
    assert n is None
    assert json.loads(body)["outputs"][0]["parameters"] == {"binary_data_size": 0}


def test_bytes_output_in_json_and_binary():
    raw = _bytes_tensor(b"hello", b"", "wörld".encode())
    resp = CoreResponse("m", "1", outputs=[OutputTensor("S", "BYTES", [3], raw)])
    body, n = codec.encode_infer_response(resp, CoreRequest("m"), False)
    assert json.loads(body)["outputs"][0]["data"] == ["hello", "", "wörld"]
    body, n = codec.encode_infer_response(resp, CoreRequest("m"), True)
    assert body[n:] == raw


def test_output_size_mismatch_is_internal():
    resp = CoreResponse("m", "1", outputs=[OutputTensor("O", "FP32", [3], b"\0" * 8)])
    msg = _raises(codec.encode_infer_response, resp, CoreRequest("m"), False,
                  code=Code.INTERNAL)
    assert msg.startswith("output tensor shape does not match size of output for 'O'")


# ---- compression -----------------------------------------------------------------------

@pytest.mark.parametrize("accept, chosen", [
    ("gzip", "gzip"), ("deflate", "deflate"), ("identity", None), ("br", None),
    ("gzip, deflate", "gzip"), ("deflate;q=0.5, gzip;q=0.8", "gzip"),
    ("gzip;q=0.2, identity;q=0.5", None), ("gzip;q=x, deflate", "deflate"), ("", None),
])
def test_response_encoding(accept, chosen):
    assert codec.response_encoding(accept) == chosen


def test_compress():
    data = b"x" * 1000
    assert gzip.decompress(codec.compress(data, "gzip")) == data
    assert zlib.decompress(codec.compress(data, "deflate")) == data


# ---- repository bodies -----------------------------------------------------------------

def test_repository_bodies():
    assert json_body.decode_index_request(b"") is False
    assert json_body.decode_index_request(b'{"ready": true}') is True
    assert _raises(json_body.decode_index_request, b'{"ready": 1}') == \
        "Invalid value for 'ready': expected a boolean"  # Triton's text
    cfg = '{"backend": "onnxruntime"}'
    body = json.dumps({"parameters": {
        "config": cfg, "file:1/model.onnx": base64.b64encode(b"\x00\x01onnx").decode()}})
    assert json_body.decode_load_request(body.encode()) == {
        "config": cfg, "file:1/model.onnx": b"\x00\x01onnx"}
    assert json_body.decode_load_request(b"") == {}
    assert "Unable to parse parameter 'config'" in \
        _raises(json_body.decode_load_request, b'{"parameters": {"config": {}}}')
    assert json_body.decode_unload_request(b"") == {"unload_dependents": False}
    assert json_body.decode_unload_request(
        b'{"parameters": {"unload_dependents": true}}') == {"unload_dependents": True}
    assert "Unable to parse 'unload_dependents'" in _raises(
        json_body.decode_unload_request, b'{"parameters": {"unload_dependents": "y"}}')


def test_error_body_and_size_message():
    assert json.loads(json_body.error_body("boom")) == {"error": "boom"}
    msg = json_body.size_limit_message("request JSON", 2048, 1024)
    assert msg == ("request JSON size of 2048 bytes exceeds the maximum allowed input size of 1024 "
                   "bytes. Use --http-max-input-size to increase the limit.")
    # Triton's raw-input and decompression texts (http_server.cc, data_compressor.h)
    assert json_body.size_limit_message("raw request", 2048, 1024) == (
        "Raw input has a byte_size (2048 bytes) that exceeds the maximum allowed value of 1024 "
        "bytes. Use --http-max-input-size to increase the limit.")
    assert json_body.size_limit_message("decompressed", None, 1024) == (
        "Decompressed data size exceeds the maximum allowed value of 1024 bytes. Use "
        "--http-max-input-size to increase the limit.")


def test_unknown_load_parameter():
    assert _raises(json_body.decode_load_request, b'{"parameters": {"bogus": "x"}}') == \
        "unrecognized load parameter 'bogus'."


def test_http_status_table():
    from services.frontend.http.routes import http_status
    assert {c: http_status(c) for c in Code} == {
        Code.UNKNOWN: 400, Code.INTERNAL: 500, Code.NOT_FOUND: 404, Code.INVALID_ARG: 400,
        Code.UNAVAILABLE: 503, Code.UNSUPPORTED: 501, Code.ALREADY_EXISTS: 400,
        Code.CANCELLED: 400}
