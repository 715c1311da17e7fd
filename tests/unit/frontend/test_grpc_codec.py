"""gRPC adapter: the pure protobuf <-> internal conversions (grpc_codec), and the service
over a fake data plane (no scheduler, no workers) with both servers (native and grpc.aio).

Imports only our generated protos (never tritonclient's), so this module is safe in any
pytest process.
"""
from __future__ import annotations

import asyncio
import struct

import grpc
import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError

from protos import grpc_service_pb2 as pb
from services.common.errors import Code, TriremeError
from services.dataplane.types import CoreResponse, OutputTensor
from services.frontend.grpc import codec
from services.frontend.grpc.methods import grpc_status, start_grpc
from services.frontend.settings import FrontendSettings


def framed(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def infer_request(**kw) -> pb.ModelInferRequest:
    kw.setdefault("model_name", "m")
    return pb.ModelInferRequest(**kw)


def tensor(name="A", datatype="FP32", shape=(2,), **kw):
    return pb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape, **kw)


def error_of(fn, *args) -> TriremeError:
    with pytest.raises(TriremeError) as info:
        fn(*args)
    return info.value


# ---- decode_infer_request ---------------------------------------------------------------

@pytest.fixture(params=["protobuf", "zero-copy"])
def wire_path(request, monkeypatch):
    """Both (de)serialization paths: plain protobuf for small messages, and the zero-copy
    one used above codec.SMALL_MESSAGE bytes."""
    if request.param == "zero-copy":
        monkeypatch.setattr(codec, "SMALL_MESSAGE", 0)
    return request.param


def test_decode_splits_raw_contents_into_views(wire_path):
    a = np.arange(6, dtype=np.float32).tobytes()
    b = b"\x01\x02"
    msg = infer_request(id="r1", inputs=[tensor("A", shape=[6]), tensor("B", "UINT8", [2])],
                        raw_input_contents=[a, b])
    msg.parameters["k"].int64_param = 7
    header, raw = codec.decode_infer_request(msg.SerializeToString())
    assert [bytes(r) for r in raw] == [a, b]
    if wire_path == "zero-copy":
        assert all(isinstance(r, memoryview) for r in raw)
        assert len(header.raw_input_contents) == 0
    assert header.id == "r1" and [i.name for i in header.inputs] == ["A", "B"]
    assert header.parameters["k"].int64_param == 7


def test_decode_without_raw_and_with_unknown_fields(wire_path):
    msg = infer_request(inputs=[tensor(contents=pb.InferTensorContents(fp32_contents=[1, 2]))])
    # unknown varint field 99 and fixed32 field 98 after a raw entry
    extra = bytes([0x98, 0x06, 0x05]) + bytes([0x95, 0x06]) + b"\0\0\0\0"
    data = msg.SerializeToString() + extra
    header, raw = codec.decode_infer_request(data)
    assert raw == [] and header.inputs[0].contents.fp32_contents == [1, 2]
    data = (infer_request(raw_input_contents=[b"xyz"]).SerializeToString() + extra)
    header, raw = codec.decode_infer_request(data)
    assert [bytes(r) for r in raw] == [b"xyz"] and header.model_name == "m"


@pytest.mark.parametrize("data", [b"\x3a\x05ab", b"\x0a", b"\xff" * 11, b"\x0b"])
def test_decode_malformed(data, wire_path):
    with pytest.raises(DecodeError):
        codec.decode_infer_request(data)


# ---- request_from_proto: raw and typed inputs ------------------------------------------

def test_raw_inputs_pair_by_position(wire_path):
    a = np.arange(4, dtype=np.float32).tobytes()
    msg = infer_request(model_version="3", id="x", inputs=[tensor("A", shape=[1, 4]),
                                                           tensor("B", "BYTES", [1])],
                        raw_input_contents=[a, framed(b"hi")])
    req = codec.request_from_proto(*codec.decode_infer_request(msg.SerializeToString()))
    assert (req.model, req.version, req.id) == ("m", "3", "x")
    assert [(i.name, i.datatype, i.shape) for i in req.inputs] == [
        ("A", "FP32", [1, 4]), ("B", "BYTES", [1])]
    assert bytes(req.inputs[0].data) == a and bytes(req.inputs[1].data) == framed(b"hi")
    assert req.outputs is None


TYPED_CASES = [
    ("BOOL", "bool_contents", [True, False, True], np.bool_),
    ("INT8", "int_contents", [-128, 0, 127], np.int8),
    ("INT16", "int_contents", [-32768, 5, 32767], np.int16),
    ("INT32", "int_contents", [-(2**31), 0, 2**31 - 1], np.int32),
    ("INT64", "int64_contents", [-(2**63), 0, 2**63 - 1], np.int64),
    ("UINT8", "uint_contents", [0, 7, 255], np.uint8),
    ("UINT16", "uint_contents", [0, 7, 65535], np.uint16),
    ("UINT32", "uint_contents", [0, 7, 2**32 - 1], np.uint32),
    ("UINT64", "uint64_contents", [0, 7, 2**64 - 1], np.uint64),
    ("FP32", "fp32_contents", [0.5, -1.25, 3.0e38], np.float32),
    ("FP64", "fp64_contents", [0.1, -1.25, 1e300], np.float64),
]


@pytest.mark.parametrize("datatype,field,values,np_dtype", TYPED_CASES)
def test_typed_contents(datatype, field, values, np_dtype):
    contents = pb.InferTensorContents(**{field: values})
    msg = infer_request(inputs=[tensor("A", datatype, [3], contents=contents)])
    data = codec.request_from_proto(msg).inputs[0].data
    assert bytes(data) == np.array(values, dtype=np.dtype(np_dtype).newbyteorder("<")).tobytes()


def test_typed_bytes_contents_are_serialized():
    contents = pb.InferTensorContents(bytes_contents=[b"abc", b"", "héllo".encode()])
    msg = infer_request(inputs=[tensor("S", "BYTES", [3], contents=contents)])
    data = codec.request_from_proto(msg).inputs[0].data
    assert bytes(data) == framed(b"abc", b"", "héllo".encode())


def test_typed_narrow_ints_keep_low_bytes():
    contents = pb.InferTensorContents(int_contents=[300, -1])
    msg = infer_request(inputs=[tensor("A", "INT8", [2], contents=contents)])
    assert bytes(codec.request_from_proto(msg).inputs[0].data) == bytes([44, 255])


def test_typed_empty_contents_is_empty_tensor():
    msg = infer_request(inputs=[tensor("A", "FP32", [0], contents=pb.InferTensorContents())])
    assert bytes(codec.request_from_proto(msg).inputs[0].data) == b""


def test_typed_type_mismatch():
    contents = pb.InferTensorContents(fp32_contents=[1.0])
    msg = infer_request(inputs=[tensor("A", "FP16", [1], contents=contents)])
    assert error_of(codec.request_from_proto, msg).message == (
        "unexpected explicit tensor data for input tensor 'A' for model 'm' of type 'FP32', "
        "expected datatype 'FP16'")
    msg = infer_request(inputs=[tensor("A", "BF16", [1], contents=contents)])
    assert error_of(codec.request_from_proto, msg).code == Code.INVALID_ARG


def test_typed_two_fields():
    contents = pb.InferTensorContents(int_contents=[1], fp32_contents=[1.0])
    msg = infer_request(inputs=[tensor("A", "INT32", [1], contents=contents)])
    assert error_of(codec.request_from_proto, msg).message == (
        "unexpected explicit tensor data for input tensor 'A' for model 'm', binary data was "
        "already supplied.")


def test_mixed_raw_and_typed_is_refused():
    contents = pb.InferTensorContents(fp32_contents=[1.0, 2.0])
    msg = infer_request(inputs=[tensor("A"), tensor("B", contents=contents)],
                        raw_input_contents=[b"\0" * 8])
    err = error_of(codec.request_from_proto, msg)
    assert err.code == Code.INVALID_ARG
    assert err.message == ("contents field must not be specified when using raw_input_contents "
                           "for 'B' for model 'm'")


def test_missing_data():
    msg = infer_request(inputs=[tensor("A"), tensor("B")], raw_input_contents=[b"\0" * 8])
    assert error_of(codec.request_from_proto, msg).message == (
        "unable to find data for input tensor 'B' for model 'm' in request.")


def shm_params(t, region="r", offset=None, size=16):
    if region is not None:
        t.parameters["shared_memory_region"].string_param = region
    if offset is not None:
        t.parameters["shared_memory_offset"].int64_param = offset
    if size is not None:
        t.parameters["shared_memory_byte_size"].int64_param = size
    return t


def test_shared_memory_input_takes_no_raw_entry():
    msg = infer_request(inputs=[shm_params(tensor("A"), offset=8), tensor("B")],
                        raw_input_contents=[b"\1" * 8])
    req = codec.request_from_proto(msg)
    assert req.inputs[0].data is None
    assert req.inputs[0].parameters == {"shared_memory_region": "r", "shared_memory_offset": 8,
                                        "shared_memory_byte_size": 16}
    assert bytes(req.inputs[1].data) == b"\1" * 8


@pytest.mark.parametrize("kw,text", [
    (dict(region=None, offset=4), "'shared_memory_offset' can not be specified without "
                                  "'shared_memory_region' parameter for tensor 'A'"),
    (dict(size=None), "'shared_memory_byte_size' must be specified along with "
                      "'shared_memory_region' parameter for tensor 'A'"),
])
def test_shared_memory_parameter_rules(kw, text):
    msg = infer_request(inputs=[shm_params(tensor("A"), **kw)])
    assert error_of(codec.request_from_proto, msg).message == text


def test_shared_memory_parameter_types():
    t = shm_params(tensor("A"))
    t.parameters["shared_memory_byte_size"].string_param = "16"
    assert error_of(codec.request_from_proto, infer_request(inputs=[t])).message == (
        "invalid value type for 'shared_memory_byte_size' parameter for tensor 'A', "
        "expected int64_param.")
    t = shm_params(tensor("A", contents=pb.InferTensorContents(fp32_contents=[1, 2])))
    assert "unexpected 'content' provided when using shared memory for input tensor 'A'" in \
        error_of(codec.request_from_proto, infer_request(inputs=[t])).message


# ---- parameters -------------------------------------------------------------------------

def test_request_parameters_both_ways():
    msg = infer_request()
    msg.parameters["b"].bool_param = True
    msg.parameters["i"].int64_param = -5
    msg.parameters["s"].string_param = "x"
    msg.parameters["d"].double_param = 2.5
    msg.parameters["u"].uint64_param = 2**64 - 1
    msg.parameters["sequence_id"].string_param = "seq"
    msg.parameters["sequence_start"].bool_param = True
    msg.parameters["priority"].uint64_param = 2
    msg.parameters["timeout"].int64_param = 100
    values = codec.request_from_proto(msg).parameters
    assert values == {"b": True, "i": -5, "s": "x", "d": 2.5, "u": 2**64 - 1,
                      "sequence_id": "seq", "sequence_start": True, "priority": 2,
                      "timeout": 100}
    back = pb.ModelInferResponse()
    codec.params_to_proto(values, back.parameters)
    assert codec.params_from_proto(back.parameters) == values
    assert back.parameters["u"].WhichOneof("parameter_choice") == "uint64_param"
    assert back.parameters["i"].WhichOneof("parameter_choice") == "int64_param"


def test_params_to_proto_numpy_scalars_and_unsupported():
    out = pb.ModelInferResponse()
    codec.params_to_proto({"n": np.int32(3), "f": np.float32(0.5)}, out.parameters)
    assert codec.params_from_proto(out.parameters) == {"n": 3, "f": 0.5}
    with pytest.raises(TriremeError) as info:
        codec.params_to_proto({"x": b"raw"}, out.parameters)
    assert info.value.code == Code.UNSUPPORTED


@pytest.mark.parametrize("key,setter,text", [
    ("sequence_id", "bool_param", "invalid value type for 'sequence_id' parameter, expected "
                                  "int64_param or string_param."),
    ("sequence_end", "int64_param", "invalid value type for 'sequence_end' parameter, "
                                    "expected bool_param."),
    ("priority", "string_param", "invalid value type for 'priority' parameter, expected "
                                 "int64_param or uint64_param."),
    ("timeout", "uint64_param", "invalid value type for 'timeout' parameter, expected "
                                "int64_param."),
    ("triton_x", "bool_param", "parameter keys starting with 'triton_' are reserved for "
                               "Triton usage. Only the following keys starting with 'triton_' "
                               "are allowed: triton_enable_empty_final_response"),
])
def test_reserved_parameter_types(key, setter, text):
    msg = infer_request()
    value = {"bool_param": True, "int64_param": 1, "string_param": "1", "uint64_param": 1}
    setattr(msg.parameters[key], setter, value[setter])
    err = error_of(codec.request_from_proto, msg)
    assert (err.code, err.message) == (Code.INVALID_ARG, text)


def test_negative_priority_and_unset_parameter():
    msg = infer_request()
    msg.parameters["priority"].int64_param = -1
    assert error_of(codec.request_from_proto, msg).message == (
        "invalid value for 'priority', expected value >= 0.")
    msg = infer_request()
    msg.parameters["k"].SetInParent()
    assert error_of(codec.request_from_proto, msg).message == (
        "invalid value type for 'k' parameter, expected int64_param, bool_param, or "
        "string_param.")


def test_requested_outputs():
    outs = [pb.ModelInferRequest.InferRequestedOutputTensor(name="B"),
            pb.ModelInferRequest.InferRequestedOutputTensor(name="A")]
    outs[0].parameters["classification"].int64_param = 3
    req = codec.request_from_proto(infer_request(outputs=outs))
    assert [(o.name, o.parameters) for o in req.outputs] == [("B", {"classification": 3}),
                                                             ("A", {})]
    outs[0].parameters["classification"].string_param = "3"
    assert error_of(codec.request_from_proto, infer_request(outputs=outs)).message == (
        "invalid value type for 'classification' parameter, expected int64_param")
    outs[0].parameters["classification"].int64_param = 0
    assert error_of(codec.request_from_proto, infer_request(outputs=outs)).message == (
        "invalid value for 'classification' parameter, expected >= 0")
    outs[0].parameters["classification"].int64_param = 2
    shm_params(outs[0])
    assert error_of(codec.request_from_proto, infer_request(outputs=outs)).message == (
        "output can't set both 'shared_memory_region' and 'classification'")


# ---- responses ---------------------------------------------------------------------------

BF16 = np.array([1, 2], ml_dtypes.bfloat16)


def core_response() -> CoreResponse:
    f = np.arange(6, dtype=np.float32).reshape(2, 3)
    return CoreResponse(
        model_name="m", model_version="2", id="req-9",
        outputs=[OutputTensor("Z", "FP32", [2, 3], memoryview(f)),       # multi-dim view
                 OutputTensor("A", "BYTES", [2], framed(b"x", b"yz")),
                 OutputTensor("E", "INT8", [0], b""),
                 OutputTensor("H", "BF16", [2], BF16.view(np.uint8).data,
                              parameters={"shared": True})],
        parameters={"flag": True, "n": 3, "s": "t"})


def check_response(msg: pb.ModelInferResponse) -> None:
    assert (msg.model_name, msg.model_version, msg.id) == ("m", "2", "req-9")
    assert [o.name for o in msg.outputs] == ["Z", "A", "E", "H"]   # output order kept
    assert [(o.datatype, list(o.shape)) for o in msg.outputs] == [
        ("FP32", [2, 3]), ("BYTES", [2]), ("INT8", [0]), ("BF16", [2])]
    assert len(msg.raw_output_contents) == 4                         # one per output
    assert msg.raw_output_contents[0] == np.arange(6, dtype=np.float32).tobytes()
    assert msg.raw_output_contents[1] == framed(b"x", b"yz")
    assert msg.raw_output_contents[2] == b""
    assert msg.raw_output_contents[3] == BF16.tobytes()
    assert codec.params_from_proto(msg.outputs[3].parameters) == {"shared": True}
    assert codec.params_from_proto(msg.parameters) == {"flag": True, "n": 3, "s": "t"}


def test_encode_infer_response(wire_path):
    check_response(pb.ModelInferResponse.FromString(codec.encode_infer_response(core_response())))


def test_encode_stream_response_and_error(wire_path):
    msg = pb.ModelStreamInferResponse.FromString(codec.encode_stream_response(core_response()))
    assert msg.error_message == ""
    check_response(msg.infer_response)
    big = CoreResponse("m", "1", outputs=[OutputTensor("O", "UINT8", [300], b"\7" * 300)])
    msg = pb.ModelStreamInferResponse.FromString(codec.encode_stream_response(big))
    assert msg.infer_response.raw_output_contents[0] == b"\7" * 300   # multi-byte varints
    msg = pb.ModelStreamInferResponse.FromString(codec.encode_stream_error("boom", "id7"))
    assert (msg.error_message, msg.infer_response.id) == ("boom", "id7")


# ---- metadata, config, repository ---------------------------------------------------------

def test_metadata_conversions():
    sm = codec.server_metadata_to_proto({"name": "triton", "version": "2.73.0",
                                         "extensions": ["model_repository", "statistics"]})
    assert (sm.name, sm.version, list(sm.extensions)) == (
        "triton", "2.73.0", ["model_repository", "statistics"])
    mm = codec.model_metadata_to_proto({
        "name": "add_sub", "versions": ["1", 2], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}]})
    assert list(mm.versions) == ["1", "2"] and mm.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in mm.inputs] == [
        ("INPUT0", "FP32", [-1, 16])]
    assert mm.outputs[0].name == "OUTPUT0"


def test_model_config_conversion():
    resp = codec.model_config_to_proto({
        "name": "add_sub", "platform": "onnxruntime_onnx", "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["16"]}],
        "dynamic_batching": {"preferred_batch_size": [8]},
        "instance_group": [{"kind": "KIND_CPU", "count": 2}],
        "parameters": {"k": {"string_value": "v"}},
        "a_future_field": 1})
    c = resp.config
    assert (c.name, c.max_batch_size, list(c.input[0].dims)) == ("add_sub", 8, [16])
    assert c.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert c.instance_group[0].count == 2 and c.parameters["k"].string_value == "v"
    with pytest.raises(TriremeError) as info:
        codec.model_config_to_proto({"max_batch_size": "many"})
    assert info.value.code == Code.INTERNAL


def test_repository_conversions():
    idx = codec.repository_index_to_proto([
        {"name": "a", "version": "1", "state": "READY", "reason": ""},
        {"name": "b", "state": "UNAVAILABLE", "reason": "unloaded"}, {"name": "c"}])
    assert [(m.name, m.version, m.state, m.reason) for m in idx.models] == [
        ("a", "1", "READY", ""), ("b", "", "UNAVAILABLE", "unloaded"), ("c", "", "", "")]

    load = pb.RepositoryModelLoadRequest(model_name="m")
    load.parameters["config"].string_param = '{"max_batch_size": 2}'
    load.parameters["file:1/model.onnx"].bytes_param = b"\0\1"
    assert codec.load_parameters(load) == {"config": '{"max_batch_size": 2}',
                                           "file:1/model.onnx": b"\0\1"}
    load.parameters["config"].bytes_param = b"{}"
    assert error_of(codec.load_parameters, load).message == (
        "invalid value type for load parameter 'config', expected string_param.")
    load = pb.RepositoryModelLoadRequest(model_name="m")
    load.parameters["file:1/x"].string_param = "x"
    assert error_of(codec.load_parameters, load).message == (
        "invalid value type for load parameter 'file:1/x', expected bytes_param.")
    load = pb.RepositoryModelLoadRequest(model_name="m")
    load.parameters["other"].bool_param = True
    assert error_of(codec.load_parameters, load).message == "unrecognized load parameter 'other'."
    err = error_of(codec.load_parameters, pb.RepositoryModelLoadRequest(repository_name="r"))
    assert (err.code, err.message) == (Code.UNSUPPORTED,
                                       "'repository_name' specification is not supported")

    unload = pb.RepositoryModelUnloadRequest(model_name="m")
    assert codec.unload_parameters(unload) == {"unload_dependents": False}
    unload.parameters["unload_dependents"].bool_param = True
    assert codec.unload_parameters(unload) == {"unload_dependents": True}
    unload.parameters["unload_dependents"].string_param = "yes"
    assert error_of(codec.unload_parameters, unload).message == (
        "invalid value type for 'unload_dependents' parameter, expected bool_param.")


def test_status_table():
    assert {c: grpc_status(c) for c in Code} == {
        Code.UNKNOWN: grpc.StatusCode.UNKNOWN, Code.INTERNAL: grpc.StatusCode.INTERNAL,
        Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
        Code.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
        Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
        Code.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
        Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
        Code.CANCELLED: grpc.StatusCode.CANCELLED}


# ---- the grpc.aio service over a fake data plane -------------------------------------------

class FakeDataPlane:
    """Echoes INPUT0 as OUTPUT0; model 'nope' is unknown; 'slow' answers after `gate`."""

    async def trace_settings(self, model: str = "", update=None, error=None):
        return [("trace_level", ["OFF"])]

    def __init__(self) -> None:
        self.released = 0
        self.gate = asyncio.Event()            # opens the 'slow' model
        self.slow_cancelled = asyncio.Event()
        self.slow_entered = asyncio.Event()    # a 'slow' request is waiting for the gate
        self.fast_seen = 0
        self.fast_done = asyncio.Event()       # set once 3 other requests were handled
        self.calls: list[tuple] = []

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def server_metadata(self) -> dict:
        return {"name": "trireme", "version": "0.1.0", "extensions": ["model_repository"]}

    def _known(self, model: str) -> None:
        if model == "nope":
            raise TriremeError(Code.NOT_FOUND, f"Request for unknown model: '{model}' is not found")

    async def model_ready(self, model: str, version: str) -> bool:
        return model != "nope"

    async def model_metadata(self, model: str, version: str) -> dict:
        self._known(model)
        return {"name": model, "versions": ["1"], "platform": "p", "inputs": [], "outputs": []}

    async def unload_model(self, model: str, parameters: dict) -> None:
        self.calls.append(("unload", model, parameters))

    async def infer_stream(self, req, on_sent=None):
        if on_sent is not None:
            on_sent()
        yield await self.infer(req)

    async def infer(self, req, endpoint: str = ""):
        if req.model == "slow":
            self.slow_entered.set()
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.slow_cancelled.set()
                raise
        else:
            self.fast_seen += 1
            if self.fast_seen == 3:
                self.fast_done.set()
        self._known(req.model)
        i = req.inputs[0]
        return CoreResponse(req.model, "1", req.id,
                            [OutputTensor("OUTPUT0", i.datatype, i.shape, memoryview(i.data))])

    def release(self, resp) -> None:
        self.released += 1


def run_with_server(body, impl: str = "native"):
    async def main():
        dp = FakeDataPlane()
        server = await start_grpc(dp, FrontendSettings(scheduler_addr="", host="127.0.0.1",
                                                       grpc_port=0, grpc_impl=impl))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
                await asyncio.wait_for(body(ch, dp), 20)
        finally:
            await server.stop(None)
    asyncio.run(main())


def method(ch, name, req_cls, resp_cls):
    return ch.unary_unary(f"/inference.GRPCInferenceService/{name}",
                          request_serializer=req_cls.SerializeToString,
                          response_deserializer=resp_cls.FromString)


def echo_request(model: str, rid: str, n: int = 2) -> pb.ModelInferRequest:
    return pb.ModelInferRequest(model_name=model, id=rid,
                                inputs=[tensor("INPUT0", "INT32", [n])],
                                raw_input_contents=[np.arange(1, n + 1, dtype="<i4").tobytes()])


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_service_unary_rpcs(impl):
    async def body(ch, dp):
        live = method(ch, "ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse)
        assert (await live(pb.ServerLiveRequest())).live
        md = method(ch, "ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse)
        assert (await md(pb.ServerMetadataRequest())).name == "trireme"
        infer = method(ch, "ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse)
        resp = await infer(echo_request("m", "abc"))
        assert resp.id == "abc"
        assert resp.raw_output_contents[0] == np.array([1, 2], np.int32).tobytes()
        big = echo_request("m", "big", n=100_000)                     # the zero-copy path
        resp = await infer(big)
        assert resp.raw_output_contents == big.raw_input_contents
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await infer(echo_request("nope", ""))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert info.value.details() == "Request for unknown model: 'nope' is not found"
        bad = echo_request("m", "")
        bad.inputs[0].contents.int_contents.append(1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await infer(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        unload = method(ch, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest,
                        pb.RepositoryModelUnloadResponse)
        await unload(pb.RepositoryModelUnloadRequest(model_name="m"))
        assert dp.calls == [("unload", "m", {"unload_dependents": False})]
        trace = method(ch, "TraceSetting", pb.TraceSettingRequest, pb.TraceSettingResponse)
        got = await trace(pb.TraceSettingRequest())
        assert list(got.settings["trace_level"].value) == ["OFF"]
        health = ch.unary_unary("/grpc.health.v1.Health/Check")
        assert await health(b"") == b"\x08\x01"
        assert dp.released == 2
    run_with_server(body, impl)


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_stream_keeps_order_and_survives_errors(impl):
    async def body(ch, dp):
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=pb.ModelInferRequest.SerializeToString,
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        call = stream()
        await call.write(echo_request("slow", "0"))       # held until the gate opens
        for i, model in enumerate(["m", "nope", "m"], start=1):
            await call.write(echo_request(model, str(i), n=2 if i < 3 else 100_000))
        await dp.fast_done.wait()   # the later requests finished first; order must not change
        dp.gate.set()
        await call.done_writing()
        got = [r async for r in call]
        assert [r.infer_response.id for r in got] == ["0", "1", "2", "3"]
        assert [r.error_message for r in got] == [
            "", "", "Request for unknown model: 'nope' is not found", ""]
        assert got[3].infer_response.raw_output_contents[0] == np.arange(
            1, 100_001, dtype="<i4").tobytes()
        assert await call.code() == grpc.StatusCode.OK
        assert dp.released == 3
    run_with_server(body, impl)


@pytest.mark.parametrize("impl", ["native", "aio"])
def test_stream_client_cancel_releases_everything(impl):
    async def body(ch, dp):
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=pb.ModelInferRequest.SerializeToString,
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)
        call = stream()
        await call.write(echo_request("slow", "0"))
        for i in (1, 2, 3):
            await call.write(echo_request("m", str(i)))
        await dp.fast_done.wait()
        call.cancel()
        await dp.slow_cancelled.wait()   # the in-flight inference is cancelled with the RPC
        assert dp.released == 3          # finished responses were released, never leaked
    run_with_server(body, impl)
