"""Pure conversions between the gRPC protobuf messages and the frontend's internal types.

No I/O, no server state: every function here takes messages or dicts and returns messages,
bytes or `services.dataplane.types` objects, raising TriremeError (INVALID_ARG for bad client
input) in Triton's words (server src/grpc/infer_handler.cc, grpc_utils.h, grpc_server.cc).

Tensor bytes avoid copies on the hot path:
- `decode_infer_request` splits a serialized ModelInferRequest into the protobuf header
  (everything but `raw_input_contents`) and one memoryview per raw input into the wire
  buffer, so raw tensor data is never copied by protobuf.
- `encode_infer_response` / `encode_stream_response` serialize the header with protobuf and
  append each `raw_output_contents` entry (field 6) straight from the output's buffer (which
  may be a memoryview into shared memory), so output bytes are copied exactly once, into
  the wire message.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from protos import grpc_service_pb2 as pb
from protos import model_config_pb2 as mc
from services.common.datatypes import serialize_bytes_tensor
from services.common.errors import (
    REPOSITORY_NAME_UNSUPPORTED,
    Code,
    TriremeError,
    invalid_arg,
    unrecognized_load_parameter,
    unsupported,
)
from services.dataplane.types import CoreRequest, CoreResponse, InputTensor, RequestedOutput

__all__ = [
    "MalformedMessage",
    "decode_infer_request",
    "encode_infer_response",
    "encode_stream_error",
    "encode_stream_response",
    "load_parameters",
    "model_config_to_proto",
    "model_metadata_to_proto",
    "params_from_proto",
    "params_to_proto",
    "repository_index_to_proto",
    "request_from_proto",
    "server_metadata_to_proto",
    "unload_parameters",
]

_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1

# ---- wire-format helpers ---------------------------------------------------------------

SMALL_MESSAGE = 16 * 1024    # below this, plain protobuf (de)serialization is faster
_RAW_INPUT_FIELD = 7          # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_TAG = b"\x32"     # ModelInferResponse.raw_output_contents: field 6, wire type 2
_STREAM_INFER_TAG = b"\x12"   # ModelStreamInferResponse.infer_response: field 2, wire type 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]  # IndexError on truncation, mapped by the caller
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


class MalformedMessage(TriremeError, DecodeError):
    """A request message protobuf cannot read: INVALID_ARG (the client's fault, never an
    internal error), and a DecodeError, as protobuf itself raises."""


def _malformed(what: str, detail: object) -> MalformedMessage:
    text = str(detail).strip() or type(detail).__name__
    return MalformedMessage(Code.INVALID_ARG, f"malformed {what}: {text}")


def decode_infer_request(data: bytes) -> tuple[pb.ModelInferRequest, list[Any]]:
    """Serialized ModelInferRequest -> (message without raw contents, raw inputs as views).

    Only the top level is walked (a handful of fields); nested messages go to protobuf.
    Below SMALL_MESSAGE bytes protobuf alone is faster, and copies are cheap.
    Malformed input raises MalformedMessage (INVALID_ARG; a protobuf DecodeError too).
    """
    try:
        if len(data) <= SMALL_MESSAGE:
            msg = pb.ModelInferRequest.FromString(data)
            return msg, list(msg.raw_input_contents)
        return _split_infer_request(data)
    except MalformedMessage:
        raise
    except (DecodeError, RecursionError, ValueError, TypeError) as e:
        raise _malformed("ModelInferRequest", e) from None


def _split_infer_request(data: bytes) -> tuple[pb.ModelInferRequest, list[Any]]:
    buf = memoryview(data)
    raw: list[memoryview] = []
    header: list[memoryview] = []
    pos, n, start = 0, len(buf), 0
    try:
        while pos < n:
            field_start = pos
            key, pos = _read_varint(buf, pos)
            wire = key & 7
            if wire == 2:
                length, pos = _read_varint(buf, pos)
                end = pos + length
                if end > n:
                    raise ValueError("truncated length-delimited field")
                if key >> 3 == _RAW_INPUT_FIELD:
                    if start < field_start:
                        header.append(buf[start:field_start])
                    raw.append(buf[pos:end])
                    start = end
                pos = end
            elif wire == 0:
                _, pos = _read_varint(buf, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise ValueError(f"unsupported wire type {wire}")
        if pos > n:
            raise ValueError("truncated field")
    except (IndexError, ValueError) as e:
        raise _malformed("ModelInferRequest", e) from None
    if not raw:
        return pb.ModelInferRequest.FromString(data), raw
    if start < n:
        header.append(buf[start:n])
    return pb.ModelInferRequest.FromString(b"".join(header)), raw


def _as_bytes_view(data: Any) -> memoryview:
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


# ---- parameters --------------------------------------------------------------------------

def _param_value(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def params_from_proto(params: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """map<string, InferParameter> -> {key: bool | int | str | float} (unset oneof -> None)."""
    return {key: _param_value(p) for key, p in params.items()}


def _set_param(p: pb.InferParameter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, (int, np.integer)):
        value = int(value)
        if value > _INT64_MAX:
            if value > _UINT64_MAX:
                raise TriremeError(Code.INTERNAL, f"parameter '{key}' value {value} is out "
                                                  f"of range for uint64")
            p.uint64_param = value
        else:
            p.int64_param = value
    elif isinstance(value, str):
        p.string_param = value
    elif isinstance(value, (float, np.floating)):
        p.double_param = float(value)
    else:
        raise TriremeError(Code.UNSUPPORTED, f"Response parameter '{key}' of type "
                                             f"'{type(value).__name__}' is not supported")


def params_to_proto(values: Mapping[str, Any], target: Any) -> None:
    """{key: value} into a map<string, InferParameter> field (bool, int, str, float)."""
    for key, value in values.items():
        _set_param(target[key], key, value)


_RESERVED_TRITON_PARAMS = ("triton_enable_empty_final_response",)


def _check_request_params(params: Mapping[str, pb.InferParameter]) -> None:
    """The request-level parameter types Triton's gRPC frontend enforces."""
    for key, p in params.items():
        kind = p.WhichOneof("parameter_choice")
        if key == "sequence_id":
            if kind not in ("int64_param", "string_param"):
                raise invalid_arg("invalid value type for 'sequence_id' parameter, expected "
                                  "int64_param or string_param.")
        elif key in ("sequence_start", "sequence_end"):
            if kind != "bool_param":
                raise invalid_arg(f"invalid value type for '{key}' parameter, expected "
                                  "bool_param.")
        elif key == "priority":
            if kind == "int64_param":
                if p.int64_param < 0:
                    raise invalid_arg("invalid value for 'priority', expected value >= 0.")
            elif kind != "uint64_param":
                raise invalid_arg("invalid value type for 'priority' parameter, expected "
                                  "int64_param or uint64_param.")
        elif key == "timeout":
            if kind != "int64_param":
                raise invalid_arg("invalid value type for 'timeout' parameter, expected "
                                  "int64_param.")
        elif key.startswith("triton_"):
            if key not in _RESERVED_TRITON_PARAMS:
                raise invalid_arg(
                    "parameter keys starting with 'triton_' are reserved for Triton usage. "
                    "Only the following keys starting with 'triton_' are allowed: "
                    + " ".join(_RESERVED_TRITON_PARAMS))
            if kind != "bool_param":
                raise invalid_arg(f"invalid value type for '{key}' parameter, expected "
                                  "bool_param.")
        elif kind is None:
            # Triton also refuses double/uint64 here; we pass them on (a superset).
            raise invalid_arg(f"invalid value type for '{key}' parameter, expected "
                              "int64_param, bool_param, or string_param.")


def _check_shm_params(name: str, params: Mapping[str, pb.InferParameter]) -> bool:
    """Validate shared_memory_* tensor parameters; True when the tensor uses one."""
    region = params.get("shared_memory_region")
    has_shm = region is not None
    if region is not None and region.WhichOneof("parameter_choice") != "string_param":
        raise invalid_arg(f"invalid value type for 'shared_memory_region' parameter for "
                          f"tensor '{name}', expected string_param.")
    for key in ("shared_memory_offset", "shared_memory_byte_size"):
        p = params.get(key)
        if p is None:
            continue
        if not has_shm:
            raise invalid_arg(f"'{key}' can not be specified without 'shared_memory_region' "
                              f"parameter for tensor '{name}'")
        if p.WhichOneof("parameter_choice") != "int64_param":
            raise invalid_arg(f"invalid value type for '{key}' parameter for tensor "
                              f"'{name}', expected int64_param.")
    if has_shm and "shared_memory_byte_size" not in params:
        raise invalid_arg(f"'shared_memory_byte_size' must be specified along with "
                          f"'shared_memory_region' parameter for tensor '{name}'")
    return has_shm


def _check_output_params(out: Any) -> None:
    has_shm = _check_shm_params(out.name, out.parameters)
    cls = out.parameters.get("classification")
    if cls is None:
        return
    if cls.WhichOneof("parameter_choice") != "int64_param":
        raise invalid_arg("invalid value type for 'classification' parameter, expected "
                          "int64_param")
    if cls.int64_param <= 0:
        raise invalid_arg("invalid value for 'classification' parameter, expected >= 0")
    if has_shm:
        raise invalid_arg("output can't set both 'shared_memory_region' and "
                          "'classification'")


# ---- typed tensor contents -> raw bytes --------------------------------------------------

# InferTensorContents field -> (tensor datatype, numpy dtype of the field), in the order
# Triton checks them. int_contents / uint_contents also carry INT8/INT16 and UINT8/UINT16
# (the low bytes of each 32-bit element).
_TYPED_FIELDS: tuple[tuple[str, str, str | None], ...] = (
    ("bool_contents", "BOOL", "?"),
    ("int_contents", "INT32", "<i4"),
    ("int64_contents", "INT64", "<i8"),
    ("uint_contents", "UINT32", "<u4"),
    ("uint64_contents", "UINT64", "<u8"),
    ("fp32_contents", "FP32", "<f4"),
    ("fp64_contents", "FP64", "<f8"),
    ("bytes_contents", "BYTES", None),
)
_NARROW = {"int_contents": {"INT8": "<i1", "INT16": "<i2"},
           "uint_contents": {"UINT8": "<u1", "UINT16": "<u2"}}
_KNOWN_DATATYPES = frozenset(("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                              "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16"))


def _typed_contents_to_bytes(inp: Any, model: str) -> bytes | memoryview:
    contents = inp.contents
    declared = inp.datatype if inp.datatype in _KNOWN_DATATYPES else "INVALID"
    data: bytes | memoryview = b""
    for field, tensor_dt, np_dt in _TYPED_FIELDS:
        values = getattr(contents, field)
        if not values:
            continue
        narrow = _NARROW.get(field, {}).get(declared)
        if narrow is not None:
            tensor_dt = declared
        if len(data) != 0:
            raise invalid_arg(f"unexpected explicit tensor data for input tensor "
                              f"'{inp.name}' for model '{model}', binary data was already "
                              f"supplied.")
        if tensor_dt != declared:
            raise invalid_arg(f"unexpected explicit tensor data for input tensor "
                              f"'{inp.name}' for model '{model}' of type '{tensor_dt}', "
                              f"expected datatype '{declared}'")
        if np_dt is None:
            data = serialize_bytes_tensor(list(values))
        else:
            arr = np.fromiter(values, dtype=np_dt, count=len(values))
            if narrow is not None:
                arr = arr.astype(narrow)  # keeps the low bytes, as Triton does
            data = arr.data.cast("B")
    return data


# ---- ModelInferRequest -> CoreRequest ----------------------------------------------------

def request_from_proto(msg: pb.ModelInferRequest,
                       raw: list[memoryview] | None = None) -> CoreRequest:
    """ModelInferRequest (+ raw inputs from decode_infer_request) -> CoreRequest.

    Data for each input, as Triton's InferGRPCToInput: shared memory (parameters only,
    data None), else typed `contents`, else the next `raw_input_contents` entry; typed
    contents together with raw_input_contents is an error.
    """
    if raw is None:
        raw = list(msg.raw_input_contents)
    model = msg.model_name
    # Empty parameter maps (most requests) skip their checks: each look into a map costs
    # about as much as reading it whole, a third of this function on a small request.
    request_params = msg.parameters
    if request_params:
        _check_request_params(request_params)
    inputs: list[InputTensor] = []
    index = 0
    for inp in msg.inputs:
        params = inp.parameters
        has_shm = _check_shm_params(inp.name, params) if params else False
        has_contents = inp.HasField("contents")
        data: Any
        if has_shm:
            if has_contents:
                raise invalid_arg(f"unexpected 'content' provided when using shared memory "
                                  f"for input tensor '{inp.name}' for model '{model}'")
            data = None
        elif has_contents:
            if raw:
                raise invalid_arg(f"contents field must not be specified when using "
                                  f"raw_input_contents for '{inp.name}' for model '{model}'")
            data = _typed_contents_to_bytes(inp, model)
        elif index < len(raw):
            data = raw[index]
            index += 1
        else:
            raise invalid_arg(f"unable to find data for input tensor '{inp.name}' for model "
                              f"'{model}' in request.")
        # (a slice of a repeated field is a list, at half the cost of list())
        inputs.append(InputTensor(name=inp.name, datatype=inp.datatype, shape=inp.shape[:],
                                  data=data,
                                  parameters=params_from_proto(params) if params else {}))
    outputs: list[RequestedOutput] | None = None
    if len(msg.outputs):
        outputs = []
        for out in msg.outputs:
            params = out.parameters
            if params:
                _check_output_params(out)
            outputs.append(RequestedOutput(name=out.name, parameters=params_from_proto(params)
                                           if params else {}))
    return CoreRequest(model=model, version=msg.model_version, id=msg.id, inputs=inputs,
                       outputs=outputs, parameters=params_from_proto(request_params)
                       if request_params else {})


# ---- CoreResponse -> ModelInferResponse / ModelStreamInferResponse bytes -----------------

def _infer_response_parts(resp: CoreResponse) -> list[Any]:
    head = pb.ModelInferResponse(model_name=resp.model_name, model_version=resp.model_version,
                                 id=resp.id)
    if resp.parameters:
        params_to_proto(resp.parameters, head.parameters)
    datas: list[Any] = []
    total = 0
    for out in resp.outputs:
        t = head.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        if out.parameters:
            params_to_proto(out.parameters, t.parameters)
        data = out.data
        if type(data) is bytes:
            total += len(data)
        else:
            data = _as_bytes_view(data)
            total += data.nbytes
        datas.append(data)
    if total <= SMALL_MESSAGE:
        head.raw_output_contents.extend([bytes(d) for d in datas])
        return [head.SerializeToString()]
    parts: list[Any] = [head.SerializeToString()]
    for data in datas:
        parts += (_RAW_OUTPUT_TAG, _varint(len(data) if type(data) is bytes else data.nbytes),
                  data)
    return parts


def encode_infer_response(resp: CoreResponse) -> bytes:
    """CoreResponse -> serialized ModelInferResponse, one raw_output_contents per output,
    in output order (the official client indexes raw outputs by position)."""
    return b"".join(_infer_response_parts(resp))


def encode_stream_response(resp: CoreResponse) -> bytes:
    """CoreResponse -> serialized ModelStreamInferResponse{infer_response}."""
    parts = _infer_response_parts(resp)
    size = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    return b"".join([_STREAM_INFER_TAG, _varint(size), *parts])


def encode_stream_error(message: str, request_id: str = "") -> bytes:
    """ModelStreamInferResponse{error_message, infer_response{id}}: the id tells the
    client which request failed, as Triton does."""
    msg = pb.ModelStreamInferResponse(error_message=message)
    msg.infer_response.id = request_id
    return msg.SerializeToString()


# ---- metadata, config, repository --------------------------------------------------------

def server_metadata_to_proto(d: Mapping[str, Any]) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(name=d.get("name", ""), version=d.get("version", ""),
                                     extensions=d.get("extensions", ()))


def _tensor_metadata(items: Iterable[Mapping[str, Any]]) -> list[Any]:
    return [pb.ModelMetadataResponse.TensorMetadata(
        name=t["name"], datatype=t["datatype"], shape=t.get("shape", ())) for t in items]


def model_metadata_to_proto(d: Mapping[str, Any]) -> pb.ModelMetadataResponse:
    return pb.ModelMetadataResponse(
        name=d.get("name", ""), versions=[str(v) for v in d.get("versions", ())],
        platform=d.get("platform", ""), inputs=_tensor_metadata(d.get("inputs", ())),
        outputs=_tensor_metadata(d.get("outputs", ())))


def model_config_to_proto(d: Mapping[str, Any]) -> pb.ModelConfigResponse:
    """ModelConfig as a JSON dict (protobuf JSON mapping) -> ModelConfigResponse."""
    config = mc.ModelConfig()
    try:
        json_format.ParseDict(d, config, ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise TriremeError(Code.INTERNAL, f"unable to convert model configuration: {e}") from e
    return pb.ModelConfigResponse(config=config)


def repository_index_to_proto(items: Iterable[Mapping[str, Any]]) -> pb.RepositoryIndexResponse:
    resp = pb.RepositoryIndexResponse()
    for item in items:
        m = resp.models.add(name=item["name"])
        for key in ("version", "state", "reason"):
            value = item.get(key)
            if value is not None:
                setattr(m, key, str(value))
    return resp


def _check_repository_name(repository_name: str) -> None:
    if repository_name:
        raise unsupported(REPOSITORY_NAME_UNSUPPORTED)


def load_parameters(msg: pb.RepositoryModelLoadRequest) -> dict[str, Any]:
    """RepositoryModelLoad parameters -> {"config": str, "file:<v>/<name>": bytes}."""
    _check_repository_name(msg.repository_name)
    out: dict[str, Any] = {}
    for key, p in msg.parameters.items():
        kind = p.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise invalid_arg(f"invalid value type for load parameter '{key}', expected "
                                  "string_param.")
            out[key] = p.string_param
        elif key.startswith("file:"):
            if kind != "bytes_param":
                raise invalid_arg(f"invalid value type for load parameter '{key}', expected "
                                  "bytes_param.")
            out[key] = p.bytes_param
        else:
            raise unrecognized_load_parameter(key)
    return out


def unload_parameters(msg: pb.RepositoryModelUnloadRequest) -> dict[str, Any]:
    """RepositoryModelUnload parameters -> {"unload_dependents": bool}; others ignored."""
    _check_repository_name(msg.repository_name)
    p = msg.parameters.get("unload_dependents")
    if p is None:
        return {"unload_dependents": False}
    if p.WhichOneof("parameter_choice") != "bool_param":
        raise invalid_arg("invalid value type for 'unload_dependents' parameter, expected "
                          "bool_param.")
    return {"unload_dependents": p.bool_param}
