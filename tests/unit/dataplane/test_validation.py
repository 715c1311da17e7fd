"""services/frontend/validation.py: Triton's checks, order, wording and codes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from services.common.errors import Code, TriremeError
from services.common.messages import ErrorRecord, IOSpec, ModelInfo
from services.dataplane.types import CoreRequest, InputTensor, RequestedOutput
from services.dataplane.validation import resolve_version, unknown_model_error, validate_infer

RID = "[request id: <id_unknown>] "
NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
        "dimension to be prepended to each input shape. If you want to specify the full shape "
        "including the batch dim in your input dims config, try setting max_batch_size to zero. "
        "See the model configuration docs for more info on max_batch_size.")


def batching(**kw) -> ModelInfo:
    """Like Triton's 'simple': two INT32 [-1,16] inputs, max_batch_size 8."""
    base = dict(ctl_id=0, name="simple", platform="onnxruntime_onnx", max_batch_size=8,
                versions={1: "READY"},
                inputs=[IOSpec("INPUT0", "INT32", [-1, 16]), IOSpec("INPUT1", "INT32", [-1, 16])],
                outputs=[IOSpec("OUTPUT0", "INT32", [-1, 16]),
                         IOSpec("OUTPUT1", "INT32", [-1, 16])])
    base.update(kw)
    return ModelInfo(**base)


def nonbatching() -> ModelInfo:
    return ModelInfo(ctl_id=0, name="nb", max_batch_size=0, versions={1: "READY"},
                     inputs=[IOSpec("X", "FP32", [2, -1])], outputs=[IOSpec("Y", "FP32", [2, -1])])


def i32(name, shape, n=None, **params) -> InputTensor:
    n = int(np.prod(shape)) if n is None else n
    return InputTensor(name, "INT32", list(shape), np.zeros(n, np.int32).tobytes(), params)


def sbytes(name, shape, items) -> InputTensor:
    data = b"".join(struct.pack("<I", len(s)) + s for s in items)
    return InputTensor(name, "BYTES", list(shape), data)


def req(*inputs, outputs=None, id="", model="simple") -> CoreRequest:
    outs = None if outputs is None else [RequestedOutput(o) for o in outputs]
    return CoreRequest(model=model, id=id, inputs=list(inputs), outputs=outs)


def fails(info, request, code=Code.INVALID_ARG) -> str:
    with pytest.raises(TriremeError) as e:
        validate_infer(info, request)
    assert e.value.code == code
    return e.value.message


# --------------------------------------------------------------------------- happy paths
def test_batching_model_returns_batch_size():
    assert validate_infer(batching(), req(i32("INPUT0", [3, 16]), i32("INPUT1", [3, 16]))) == 3


def test_wildcard_dims_accept_any_size():
    info = batching(inputs=[IOSpec("A", "INT32", [-1, -1, 4])], outputs=[])
    assert validate_infer(info, req(i32("A", [2, 7, 4]))) == 2
    assert validate_infer(info, req(i32("A", [1, 1, 4]))) == 1


def test_nonbatching_model_returns_one():
    x = InputTensor("X", "FP32", [2, 5], bytes(40))
    assert validate_infer(nonbatching(), req(x, model="nb")) == 1


def test_optional_input_may_be_absent():
    info = batching(inputs=[IOSpec("A", "INT32", [-1, 2]),
                            IOSpec("B", "INT32", [-1, 2], optional=True)])
    assert validate_infer(info, req(i32("A", [1, 2]))) == 1
    assert validate_infer(info, req(i32("A", [1, 2]), i32("B", [1, 2]))) == 1


def test_bytes_input_ok_and_memoryview_data():
    info = batching(inputs=[IOSpec("S", "BYTES", [-1, 2])], outputs=[])
    assert validate_infer(info, req(sbytes("S", [2, 2], [b"a", b"", b"ccc", b"dd"]))) == 2
    t = sbytes("S", [1, 2], [b"x", b"y"])
    t.data = memoryview(bytearray(t.data))
    assert validate_infer(info, req(t)) == 1


def test_requested_outputs_known_and_memoryview_fixed_data():
    t = i32("INPUT0", [1, 16])
    t.data = memoryview(np.zeros(16, np.int32))  # format "i": nbytes, not len, counts
    assert validate_infer(batching(), req(t, i32("INPUT1", [1, 16]), outputs=["OUTPUT1"])) == 1


def test_shared_memory_inputs_use_declared_byte_size():
    a = InputTensor("INPUT0", "INT32", [1, 16], None,
                    {"shared_memory_region": "r", "shared_memory_byte_size": 64})
    b = InputTensor("INPUT1", "INT32", [1, 16], None,
                    {"shared_memory_region": "r", "shared_memory_byte_size": 128})
    assert validate_infer(batching(), req(a, i32("INPUT1", [1, 16]))) == 1
    assert fails(batching(), req(a, b)) == (
        RID + "input byte size mismatch for input 'INPUT1' for model 'simple'. "
        "Expected 64, got 128")


def test_function_is_pure_across_reload():
    r = req(i32("INPUT0", [8, 16]), i32("INPUT1", [8, 16]))
    assert validate_infer(batching(), r) == 8
    assert fails(batching(max_batch_size=4), r).endswith("batch-size must be <= 4 for 'simple'")


# --------------------------------------------------------------------------- errors, in order
def test_duplicate_input():
    r = req(i32("INPUT0", [1, 16]), i32("INPUT0", [1, 16]), id="r7")
    assert fails(batching(), r) == "[request id: r7] input 'INPUT0' already exists in request"


def test_duplicate_output_is_answered_once():
    """Triton accepts a requested output named twice and answers it once (the first)."""
    r = req(i32("INPUT0", [1, 16]), i32("INPUT1", [1, 16]),
            outputs=["OUTPUT0", "OUTPUT1", "OUTPUT0"])
    assert validate_infer(batching(), r) == 1
    assert [o.name for o in r.outputs] == ["OUTPUT0", "OUTPUT1"]


def test_unknown_output_checked_before_inputs():
    r = req(i32("INPUT0", [1, 16]), outputs=["OUTPUT0", "NOPE"])
    assert fails(batching(), r) == "unexpected inference output 'NOPE' for model 'simple'"


def test_too_few_inputs():
    assert fails(batching(), req(i32("INPUT0", [1, 16]))) == (
        RID + "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) "
        "['INPUT0'], but missing required input(s) ['INPUT1']. Please provide all required "
        "input(s).")


def test_no_inputs():
    assert fails(batching(), req()) == (
        RID + "expected 2 inputs but got 0 inputs for model 'simple'. Got input(s) [], but "
        "missing required input(s) ['INPUT0','INPUT1']. Please provide all required input(s).")


def test_too_many_inputs_reproduces_triton_rendering():
    """Names in the order Triton 2.51 lists them (its unordered_map: the last added first)."""
    r = req(i32("INPUT0", [1, 16]), i32("INPUT1", [1, 16]), i32("EXTRA", [1, 16]))
    assert fails(batching(), r) == (
        RID + "expected 2 inputs but got 3 inputs for model 'simple'. Got input(s) "
        "['EXTRA','INPUT1','INPUT0'], but missing required input(s) ]. Please provide all "
        "required input(s).")


def test_missing_required_with_optional_inputs():
    info = batching(inputs=[IOSpec("A", "INT32", [-1, 2]),
                            IOSpec("B", "INT32", [-1, 2], optional=True),
                            IOSpec("C", "INT32", [-1, 2], optional=True)])
    expect = (RID + "expected number of inputs between 1 and 3 but got {} inputs for model "
              "'simple'. Got input(s) {}, but missing required input(s) ['A']. Please provide "
              "all required input(s).")
    assert fails(info, req()) == expect.format(0, "[]")
    # Count is within range but the required input was swapped for optional ones.
    assert fails(info, req(i32("B", [1, 2]), i32("C", [1, 2]))) == expect.format(2, "['C','B']")


def test_unexpected_input():
    r = req(i32("INPUT0", [1, 16]), i32("BOGUS", [1, 16]))
    assert fails(batching(), r) == "unexpected inference input 'BOGUS' for model 'simple'"
    x = InputTensor("Z", "FP32", [2, 1], bytes(8))
    assert fails(nonbatching(), req(x, model="nb")) == (
        "unexpected inference input 'Z' for model 'nb'")


def test_no_shape_on_batching_model():
    r = req(InputTensor("INPUT0", "INT32", [], b""), i32("INPUT1", [1, 16]))
    assert fails(batching(), r) == (
        RID + "input 'INPUT0' has no shape but model requires batch dimension for 'simple'")


def test_batch_size_mismatch():
    r = req(i32("INPUT0", [2, 16]), i32("INPUT1", [3, 16]))
    assert fails(batching(), r) == (
        RID + "input 'INPUT0' batch size does not match other inputs for 'simple'")


def test_batch_size_too_large_and_negative():
    r = req(i32("INPUT0", [9, 16]), i32("INPUT1", [9, 16]))
    assert fails(batching(), r) == RID + "inference request batch-size must be <= 8 for 'simple'"
    neg = InputTensor("A", "INT32", [-1, 16], b"")
    info = batching(inputs=[IOSpec("A", "INT32", [-1, 16])])
    assert fails(info, req(neg)) == RID + "inference request batch-size must be <= 8 for 'simple'"


def test_zero_batch_follows_triton_then_rejects():
    info = batching(inputs=[IOSpec("A", "INT32", [-1, 4])], outputs=[])
    # Triton drops the batch dim when batch is 0 and then checks 4 elements' bytes.
    assert fails(info, req(InputTensor("A", "INT32", [0, 4], b""))) == (
        RID + "input byte size mismatch for input 'A' for model 'simple'. Expected 16, got 0")
    assert fails(info, req(InputTensor("A", "INT32", [0, 4], bytes(16)))) == (
        RID + "inference request batch-size must be >= 1 for 'simple'")


def test_datatype_mismatch():
    r = req(InputTensor("INPUT0", "FP32", [1, 16], bytes(64)), i32("INPUT1", [1, 16]))
    assert fails(batching(), r) == (
        RID + "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'")
    r = req(InputTensor("INPUT0", "FLOAT", [1, 16], bytes(64)), i32("INPUT1", [1, 16]))
    assert "data-type is '<invalid>', but model" in fails(batching(), r)


def test_shape_mismatch_batching_has_note():
    r = req(i32("INPUT0", [1, 8]), i32("INPUT1", [1, 16]))
    assert fails(batching(), r) == (
        RID + "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got "
        "[1,8]. " + NOTE)
    r = req(i32("INPUT0", [4]), i32("INPUT1", [4]))  # rank: batch dim forgotten
    assert fails(batching(), r).startswith(
        RID + "unexpected shape for input 'INPUT1' for model 'simple'. Expected [-1,16], got [4]. ")
    # As in Triton, a forgotten batch dim larger than max_batch_size hits the batch check first.
    r = req(i32("INPUT0", [16]), i32("INPUT1", [16]))
    assert fails(batching(), r) == RID + "inference request batch-size must be <= 8 for 'simple'"


def test_shape_mismatch_nonbatching_exact_dims():
    x = InputTensor("X", "FP32", [3, 5], bytes(60))
    assert fails(nonbatching(), req(x, model="nb")) == (
        RID + "unexpected shape for input 'X' for model 'nb'. Expected [2,-1], got [3,5]. ")
    x = InputTensor("X", "FP32", [1, 2, 5], bytes(40))
    assert "Expected [2,-1], got [1,2,5]. " in fails(nonbatching(), req(x, model="nb"))


def test_unspecified_dimension():
    x = InputTensor("X", "FP32", [2, -1], b"")
    assert fails(nonbatching(), req(x, model="nb")) == (
        RID + "All input dimensions should be specified for input 'X' for model 'nb', got [2,-1]")


def test_byte_size_mismatch():
    r = req(i32("INPUT0", [1, 16]), i32("INPUT1", [1, 16], n=18))
    assert fails(batching(), r) == (
        RID + "input byte size mismatch for input 'INPUT1' for model 'simple'. "
        "Expected 64, got 72")


def test_bytes_element_count_too_few_and_too_many():
    info = batching(inputs=[IOSpec("S", "BYTES", [-1, 3])], outputs=[])
    assert fails(info, req(sbytes("S", [1, 3], [b"a", b"b"]))) == (
        RID + "expected 3 string elements for inference input 'S' for model 'simple', got 2")
    assert fails(info, req(sbytes("S", [1, 3], [b"a", b"b", b"c", b"d", b"e"]))) == (
        RID + "unexpected number of string elements 4 for inference input 'S' for model "
        "'simple', expecting 3")


def test_bytes_bad_framing():
    info = batching(inputs=[IOSpec("S", "BYTES", [-1, 1])], outputs=[])
    t = InputTensor("S", "BYTES", [1, 1], b"\x01\x00")
    assert fails(info, req(t)) == (
        RID + "incomplete string length indicator for inference input 'S' for model 'simple', "
        "expecting 4 bytes but only 2 bytes available. Please make sure the string length "
        "indicator is in one buffer.")
    t = InputTensor("S", "BYTES", [1, 1], struct.pack("<I", 10) + b"abc")
    assert fails(info, req(t)) == (
        "incomplete string data for inference input 'S', expecting string of length 10 but "
        "only 3 bytes available")


# --------------------------------------------------------------------------- versions
def vinfo(**versions) -> ModelInfo:
    return batching(versions={int(k[1:]): s for k, s in versions.items()})


def v_fails(info, version, code) -> str:
    with pytest.raises(TriremeError) as e:
        resolve_version(info, version)
    assert e.value.code == code
    return e.value.message


def test_default_version_is_highest_ready():
    assert resolve_version(vinfo(v1="READY", v3="READY", v4="LOADING"), "") == 3
    assert resolve_version(vinfo(v1="READY", v3="READY"), "1") == 1
    assert resolve_version(vinfo(v1="READY"), " 1") == 1   # std::stol semantics


def test_no_ready_version():
    assert v_fails(vinfo(v2="UNAVAILABLE"), "", Code.NOT_FOUND) == (
        "Request for unknown model: 'simple' has no available versions")


def test_unknown_version():
    assert v_fails(vinfo(v1="READY"), "2", Code.NOT_FOUND) == (
        "Request for unknown model: 'simple' version 2 is not found")


def test_version_not_ready():
    assert v_fails(vinfo(v1="READY", v2="LOADING"), "2", Code.UNAVAILABLE) == (
        "Request for unknown model: 'simple' version 2 is not at ready state")


def test_bad_version_strings():
    assert v_fails(vinfo(v1="READY"), "abc", Code.INVALID_ARG) == (
        "failed to get model version from specified version string 'abc' (details: stol), "
        "version should be an integral value > 0")
    assert v_fails(vinfo(v1="READY"), "-1", Code.INVALID_ARG) == (
        "invalid model version specified '-1' , version should be an integral value > 0")


def test_model_error_and_unknown_model():
    info = batching(error=ErrorRecord(int(Code.NOT_FOUND),
                                      "Request for unknown model: 'x' is not found"))
    assert v_fails(info, "", Code.NOT_FOUND) == "Request for unknown model: 'x' is not found"
    err = unknown_model_error("x")
    assert err.code == Code.NOT_FOUND
    assert err.message == "Request for unknown model: 'x' is not found"
