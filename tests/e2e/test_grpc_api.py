"""End to end over gRPC with the official, unmodified `tritonclient.grpc` (sync and aio)
against a real Trireme server (the `server` fixture of tests/conftest.py).

The repository holds "add_sub" (ONNX: INPUT0, INPUT1 FP32 [16] -> OUTPUT0 = sum,
OUTPUT1 = difference, max_batch_size 8) and "identity_<dt>" (INPUT0 -> OUTPUT0, dims [-1],
max_batch_size 8) for each datatype. This module imports tritonclient's protos only (never
ours), so it can share a pytest process with any other test.
"""
from __future__ import annotations

import asyncio
import queue
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

UNKNOWN_MODEL = "Request for unknown model: 'nope' is not found"
DATATYPES = ["bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
             "fp16", "fp32", "fp64", "bytes", "bf16"]


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


def add_sub_inputs(batch: int = 1, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.random((batch, 16), dtype=np.float32)
    b = rng.random((batch, 16), dtype=np.float32)
    inputs = [grpcclient.InferInput("INPUT0", [batch, 16], "FP32"),
              grpcclient.InferInput("INPUT1", [batch, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def sample(dt: str) -> np.ndarray:
    """A [1, n] array for identity_<dt>, with each type's edge values."""
    if dt == "bool":
        return np.array([[True, False, True, True, False]])
    if dt == "bytes":  # valid UTF-8 only: ONNX Runtime's Python API holds strings as str
        return np.array([[b"abc", b"", b"\x00\x01", "héllo".encode(), b"x" * 300]], dtype=object)
    if dt == "bf16":
        return np.array([[0.5, -1.25, 3.0e38, 1.0]], dtype=ml_dtypes.bfloat16)
    if dt.startswith("fp"):
        big = {"fp16": 65504.0, "fp32": 3.0e38, "fp64": 1e300}[dt]
        return np.array([[0.5, -1.25, big, 0.0]], dtype={"fp16": np.float16, "fp32": np.float32,
                                                         "fp64": np.float64}[dt])
    info = np.iinfo(np.dtype(dt))
    return np.array([[info.min, 0, 1, info.max]], dtype=np.dtype(dt))


# ---- health, metadata, config, repository --------------------------------------------------

def test_health(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert not client.is_model_ready("nope")


def test_grpc_health_check(server):
    with grpc.insecure_channel(server.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")  # bytes in, bytes out
        # HealthCheckResponse{status: SERVING} is field 1 = varint 1.
        assert check(b"", timeout=10) == b"\x08\x01"


def test_server_metadata(client):
    md = client.get_server_metadata()
    assert md.name and md.version
    assert "model_repository" in md.extensions
    as_json = client.get_server_metadata(as_json=True)
    assert as_json["name"] == md.name


def test_model_metadata(client):
    md = client.get_model_metadata("add_sub")
    assert md.name == "add_sub" and md.platform == "onnxruntime_onnx"
    assert len(md.versions) >= 1
    assert [(t.name, t.datatype, list(t.shape)) for t in md.inputs] == [
        ("INPUT0", "FP32", [-1, 16]), ("INPUT1", "FP32", [-1, 16])]
    assert sorted(t.name for t in md.outputs) == ["OUTPUT0", "OUTPUT1"]


def test_model_config(client):
    cfg = client.get_model_config("add_sub").config
    assert cfg.name == "add_sub" and cfg.max_batch_size == 8
    assert sorted(i.name for i in cfg.input) == ["INPUT0", "INPUT1"]
    assert list(cfg.input[0].dims) == [16]
    as_json = client.get_model_config("add_sub", as_json=True)
    assert as_json["config"]["name"] == "add_sub"


def test_unknown_model_is_not_found(client):
    for call in (lambda: client.get_model_metadata("nope"),
                 lambda: client.get_model_config("nope"),
                 lambda: client.infer("nope", add_sub_inputs()[0])):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.NOT_FOUND"
        assert UNKNOWN_MODEL in info.value.message()


def test_repository_index(client):
    index = client.get_model_repository_index()
    by_name = {m.name: m for m in index.models}
    assert "add_sub" in by_name and by_name["add_sub"].state == "READY"
    assert "identity_fp32" in by_name


def test_repository_parameter_errors(server):
    # Wire-level checks the official client cannot provoke; no model changes state.
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        load = service_pb2.RepositoryModelLoadRequest(model_name="add_sub")
        load.parameters["bogus"].bool_param = True
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelLoad(load, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "unrecognized load parameter 'bogus'."
        unload = service_pb2.RepositoryModelUnloadRequest(model_name="add_sub")
        unload.parameters["unload_dependents"].string_param = "yes"
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelUnload(unload, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert grpcclient.InferenceServerClient(server.grpc_url).is_model_ready("add_sub")


# ---- inference --------------------------------------------------------------------------

def test_infer_raw(client):
    inputs, a, b = add_sub_inputs(batch=3)
    result = client.infer("add_sub", inputs)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    response = result.get_response()
    assert response.model_name == "add_sub" and response.model_version
    # One raw entry per output, in output order (the client indexes them by position).
    assert len(response.raw_output_contents) == len(response.outputs) == 2


def test_requested_output_subset(client):
    inputs, a, b = add_sub_inputs()
    result = client.infer("add_sub", inputs, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


def test_request_id_echo(client):
    inputs, _, _ = add_sub_inputs()
    assert client.infer("add_sub", inputs, request_id="req-42").get_response().id == "req-42"
    assert client.infer("add_sub", inputs).get_response().id == ""


def test_typed_contents_and_mixed_error(server):
    # tritonclient always sends raw_input_contents; typed InferTensorContents by hand.
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        req = service_pb2.ModelInferRequest(model_name="identity_int32", id="typed")
        inp = req.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 3])
        inp.contents.int_contents.extend([7, -8, 2**31 - 1])
        resp = stub.ModelInfer(req, timeout=30)
        assert resp.id == "typed"
        assert np.frombuffer(resp.raw_output_contents[0], "<i4").tolist() == [7, -8, 2**31 - 1]

        req.raw_input_contents.append(np.zeros(3, np.int32).tobytes())
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(req, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == ("contents field must not be specified when using "
                                        "raw_input_contents for 'INPUT0' for model "
                                        "'identity_int32'")


@pytest.mark.parametrize("dt", DATATYPES)
def test_identity_round_trip(client, server, dt):
    name = f"identity_{dt}"
    if not (Path(server.repo) / name).is_dir():
        pytest.skip(f"{name} is not in the test repository")
    data = sample(dt)
    inp = grpcclient.InferInput("INPUT0", list(data.shape), dt.upper())
    inp.set_data_from_numpy(data)
    out = client.infer(name, [inp]).as_numpy("OUTPUT0")
    assert out.shape == data.shape
    if dt == "bytes":
        assert out.tolist() == data.tolist()
    elif dt == "bf16":
        assert out.view(np.uint16).tolist() == data.view(np.uint16).tolist()
    else:
        assert out.dtype == data.dtype
        np.testing.assert_array_equal(out, data)


def test_large_tensor_round_trip(client):
    data = np.random.default_rng(1).random((1, 1 << 20), dtype=np.float32)   # 4 MiB
    inp = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    out = client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, data)


# ---- streaming ----------------------------------------------------------------------------

def test_stream_infer_continues_after_error(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        expected = {}
        for k in range(5):
            inputs, a, b = add_sub_inputs(seed=k)
            expected[str(k)] = a + b
            client.async_stream_infer("nope" if k == 2 else "add_sub", inputs, request_id=str(k))
        got = [results.get(timeout=60) for _ in range(5)]
    finally:
        client.stop_stream()
        client.close()
    errors = [e for r, e in got if e is not None]
    assert len(errors) == 1 and UNKNOWN_MODEL in errors[0].message()
    ok = [r for r, e in got if e is None]
    assert [r.get_response().id for r in ok] == ["0", "1", "3", "4"]  # request order kept
    for r in ok:
        np.testing.assert_allclose(r.as_numpy("OUTPUT0"), expected[r.get_response().id],
                                   rtol=1e-6)


def test_aio_client(server):
    async def main():
        async with grpcclient_aio.InferenceServerClient(server.grpc_url) as client:
            assert await client.is_server_ready()
            assert (await client.get_model_metadata("add_sub")).name == "add_sub"
            inputs, a, b = add_sub_inputs(batch=2)
            result = await client.infer("add_sub", inputs, request_id="aio")
            assert result.get_response().id == "aio"
            np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)

            async def requests():
                for k in range(4):
                    yield {"model_name": "nope" if k == 1 else "add_sub",
                           "inputs": add_sub_inputs(seed=k)[0], "request_id": f"s{k}"}

            got = []
            async for result, error in client.stream_infer(inputs_iterator=requests()):
                got.append((result, error))
                if len(got) == 4:
                    break
            assert got[1][0] is None and UNKNOWN_MODEL in got[1][1].message()
            assert [r.get_response().id for r, e in got if e is None] == ["s0", "s2", "s3"]
    asyncio.run(asyncio.wait_for(main(), 120))
