"""HTTP inference bodies: KServe v2 JSON and binary-tensor bodies <-> CoreRequest /
CoreResponse, and the response's compression. (Other JSON bodies, the JSON parser and the
nesting limit: http/json_body.py.)

Pure functions on bytes, no aiohttp, so every rule here is unit-tested without a server.
Behaviour and error texts follow Triton's src/http_server.cc (ParseJsonTritonIO,
ParseJsonTritonParams, EVBufferToRawInput, FinalizeResponse, CompressionTypeUsed) and
core's raw-input deduction (InferenceRequest::Normalize).
Deliberate differences are marked "Differs from Triton".
"""

from __future__ import annotations

import functools
import struct
import zlib
from typing import Any

import msgspec
import numpy as np
import orjson

from services.common.datatypes import (
    DATATYPES,
    NotText,
    buffer_to_json_array,
    config_to_api,
    element_size,
    json_send_refused_text,
    json_to_buffer,
    numbers_to_buffer,
)
from services.common.errors import (
    JSON_NOT_ARRAY,
    JSON_NOT_BOOL,
    JSON_NOT_OBJECT,
    JSON_NOT_STRING,
    JSON_NOT_UINT,
    TriremeError,
    internal,
    invalid_arg,
    json_no_member_text,
    json_not_utf8_text,
    unable_to_parse,
)
from services.dataplane.types import CoreRequest, CoreResponse, InputTensor, RequestedOutput
from services.frontend.http.json_body import MAX_DATA_NESTING, check_nesting, decode_json
from services.frontend.http.params import check_request_params

__all__ = [
    "compress",
    "decode_infer_request",
    "decode_raw_request",
    "encode_infer_response",
    "parse_header_length",
    "response_encoding",
]

# Inference responses: orjson writes the numpy arrays of JSON outputs without a Python
# number per element, half the cost of a list through msgspec for a [1,1024] FP32 output.
_encode_response = functools.partial(orjson.dumps, option=orjson.OPT_SERIALIZE_NUMPY)
_U32 = struct.Struct("<I")
_SHM_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
_UINT64_MAX = 2**64 - 1
_ABSENT: Any = object()   # a member the JSON object does not have
_INT64_MAX = 2**63 - 1
_TYPE_SIZE = {dt: element_size(dt) or 0 for dt in DATATYPES}   # TRITONSERVER_DataTypeByteSize
_RAW_ID = "[request id: <id_unknown>] "   # LogRequest() of a raw request: it has no id


def _uint(value: Any) -> bool:
    """TritonJson's AsUInt: a JSON integer in [0, 2**64 - 1]."""
    return type(value) is int and 0 <= value < 1 << 64


# ---- inference requests ----------------------------------------------------------------

def parse_header_length(value: str | None, body_len: int) -> int | None:
    """Inference-Header-Content-Length: None when absent (the body is all JSON); 0 means
    a raw binary request (Triton's GetInferenceHeaderLength). Absent, the header length is
    the body's, as in Triton: an empty body is a raw binary request (a zero-byte tensor)."""
    if value is None:
        return None if body_len else 0
    try:
        n = int(value)
    except ValueError:
        raise invalid_arg(f"Unable to parse Inference-Header-Content-Length, got: {value}") \
            from None
    if n < 0 or n > body_len:
        raise invalid_arg(f"inference header size should be in range (0, {body_len}), "
                          f"got: {value}")
    return n


class _JsonInput(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    datatype: str
    shape: list[int]
    data: list[int | float] | msgspec.UnsetType = msgspec.UNSET
    parameters: dict | None = None


class _JsonRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: list[_JsonInput]
    id: str = ""
    parameters: dict | msgspec.UnsetType = msgspec.UNSET   # (null: refused, as Triton)
    outputs: list | msgspec.UnsetType = msgspec.UNSET


# Unknown fields are refused rather than skipped: skipping does not check what the generic
# decode would (invalid UTF-8, numbers out of range), so such bodies take the generic path.
_decode_typed = msgspec.json.Decoder(_JsonRequest).decode


def decode_infer_request(model: str, version: str, body: Any,
                         header_length: int | None = None) -> tuple[CoreRequest, bool]:
    """A JSON or binary-tensor infer body -> (request, binary outputs by default?).

    `header_length` None: the whole body is JSON; otherwise the JSON is the first
    `header_length` bytes and each input with "binary_data_size" takes its bytes, in
    input order, from the rest (as memoryview slices of `body`: no copies)."""
    mv = memoryview(body)
    end = mv.nbytes
    if header_length is None or header_length == end:
        fast = _decode_json_request(model, version, body)
        if fast is not None:
            return fast
        header_length = end
    doc = decode_json(mv[:header_length] if header_length < end else body)
    if type(doc) is not dict:   # (TritonJson finds no member in it: "inputs" is missing)
        raise unable_to_parse("inputs", json_no_member_text("inputs"))

    # Triton's order and words (ParseJsonTritonRequestID, ParseJsonTritonParams,
    # ParseJsonTritonIO): TritonJson's errors; Triton answers them 500, here 400.
    req_id = doc.get("id", "")
    if type(req_id) is not str:
        raise unable_to_parse("id", JSON_NOT_STRING)
    params = doc.get("parameters", _ABSENT)
    binary_default = False
    if params is _ABSENT:
        params = {}
    elif type(params) is not dict:
        raise invalid_arg(f"failed to get request params.: {JSON_NOT_OBJECT}")
    elif params:
        check_request_params(params)     # Triton's types, its reserved 'triton_' keys
        if "binary_data_output" in params:
            # Consumed here as Triton does: a wire setting, not a parameter for the model.
            binary_default = params.pop("binary_data_output")

    inputs_json = doc.get("inputs", _ABSENT)
    if type(inputs_json) is not list:
        raise unable_to_parse("inputs", json_no_member_text("inputs") if inputs_json is _ABSENT
                              else JSON_NOT_ARRAY)
    inputs: list[InputTensor] = []
    offset = header_length
    # Fewer "[" in the whole JSON than the depth limit: no "data" can reach it (one C pass).
    nesting = mv[:header_length].tobytes().count(b"[") >= MAX_DATA_NESTING \
        if type(body) is memoryview else body.count(b"[", 0, header_length) >= MAX_DATA_NESTING
    for item in inputs_json:
        tensor, offset = _decode_input(model, item, mv, offset, end, nesting)
        inputs.append(tensor)
    if offset != end:
        raise invalid_arg(f"unexpected additional input data for model '{model}'")

    outputs = None
    if "outputs" in doc:
        outputs_json = doc["outputs"]
        if type(outputs_json) is not list:
            raise unable_to_parse("outputs", JSON_NOT_ARRAY)
        outputs = [_decode_output(o) for o in outputs_json] or None
    return CoreRequest(model, version, req_id, inputs, outputs, params), binary_default


def _decode_json_request(model: str, version: str,
                         body: Any) -> tuple[CoreRequest, bool] | None:
    """The common all-JSON body (every input with flat numeric "data"), decoded by one
    typed msgspec call: numbers arrive as a list of ints and floats with no Python-level
    type check left to do. None for anything else or any error: the generic path below
    then decides, so results and error texts are the generic path's."""
    try:
        doc = _decode_typed(body)
    except Exception:  # noqa: BLE001 - any failure: the generic path reports it
        return None
    params = doc.parameters
    binary_default = False
    if params is msgspec.UNSET:
        params = {}
    elif params:
        check_request_params(params)     # (its errors are the generic path's too)
        if "binary_data_output" in params:
            binary_default = params.pop("binary_data_output")
    inputs: list[InputTensor] = []
    try:
        for item in doc.inputs:
            data, item_params, shape = item.data, item.parameters, item.shape
            if data is msgspec.UNSET:
                return None
            if item_params is None:
                item_params = {}
            elif "binary_data_size" in item_params or "shared_memory_region" in item_params:
                return None
            for d in shape:
                if d < 0:
                    return None
            name, datatype = item.name, item.datatype
            count = _json_element_count(name, datatype, shape)
            raw = numbers_to_buffer(name, datatype, shape, data) if count else b""
            inputs.append(InputTensor(name, datatype, shape, raw, item_params))
        outputs = None
        if doc.outputs is not msgspec.UNSET:
            outputs = [_decode_output(o) for o in doc.outputs] or None
    except TriremeError:
        return None
    return CoreRequest(model, version, doc.id, inputs, outputs, params), binary_default


def _decode_input(model: str, item: Any, mv: memoryview, offset: int, end: int,
                  nesting: bool = True) -> tuple[InputTensor, int]:
    """One of "inputs", checked in Triton's order (ParseJsonTritonIO): the content type,
    "name", "datatype", "shape", then the data. A "parameters" that is not an object holds
    nothing here, as in Triton (TritonJson's Find() finds no member in it)."""
    if type(item) is not dict:   # (TritonJson finds no member in it either)
        item = {}
    params = item.get("parameters")
    if type(params) is not dict:
        params = {}
    has_data = "data" in item
    has_binary = "binary_data_size" in params
    has_shm = "shared_memory_region" in params
    if has_data + has_binary + has_shm != 1:  # Triton's ValidateInputContentType
        found = [f for f, on in (("'data'", has_data), ("'binary_data_size'", has_binary),
                                 ("'shared_memory_region'", has_shm)) if on]
        raise invalid_arg(
            "Input must set only one of the following fields: 'data', 'binary_data_size' "
            "in 'parameters', 'shared_memory_region' in 'parameters'. But "
            + (("set " + " ".join(found)) if found else "no field is set"))
    name = _member_string(item, "name")
    datatype = _member_string(item, "datatype")
    shape = item.get("shape", _ABSENT)
    if type(shape) is not list:
        raise unable_to_parse("shape", json_no_member_text("shape") if shape is _ABSENT
                              else JSON_NOT_ARRAY)
    if not all(_uint(d) for d in shape):
        raise unable_to_parse("shape", JSON_NOT_UINT)

    if has_binary:
        size = params["binary_data_size"]
        if not _uint(size):
            raise unable_to_parse("binary_data_size", JSON_NOT_UINT)
        if offset + size > end:
            raise invalid_arg(f"unexpected size for input '{name}', expecting "
                              f"{offset + size - end} additional bytes for model '{model}'")
        return InputTensor(name, datatype, shape, mv[offset:offset + size], params), \
            offset + size
    if has_shm:
        _check_shm_params(params)
        return InputTensor(name, datatype, shape, None, params), offset
    # JSON data, read by Triton's rules (datatypes.json_to_buffer: FP16/BF16 refused)
    data = item["data"]
    if not _json_element_count(name, datatype, shape):
        return InputTensor(name, datatype, shape, b"", params), offset
    if nesting and type(data) is list:
        check_nesting(data, datatype)
    data = json_to_buffer(name, datatype, shape, data)
    return InputTensor(name, datatype, shape, data, params), offset


def _json_element_count(name: str, datatype: str, shape: list[int]) -> int:
    """The element count of a JSON-data input as Triton's HTTP server takes it, before it
    reads "data" (GetElementCount, server src/common.cc, then the byte-size check of
    ParseJsonTritonIO): the shape as int64 (a dimension of 2**63 or more is negative), a
    count or byte size beyond int64 refused. A wildcard (2**64 - 1 is -1) is left to the
    data's count check. (A shape [] holds one element, as it always has here; Triton's
    GetElementCount says 0.)"""
    count = 1
    for d in shape:
        if d == _UINT64_MAX:
            return -1
        if d > _INT64_MAX:
            dims = ",".join(str(x - (1 << 64) if x > _INT64_MAX else x) for x in shape)
            raise invalid_arg(f"invalid shape for input '{name}': shape [{dims}] contains one "
                              f"or more invalid dimensions")
        if d == 0:
            return 0
        if count > _INT64_MAX // d:
            raise invalid_arg(f"invalid shape for input '{name}': shape {_dims(shape)} causes "
                              f"total element count to exceed maximum size of {_INT64_MAX}")
        count *= d
    size = _TYPE_SIZE.get(datatype, 0)
    if size > 1 and count > _INT64_MAX // size:
        raise invalid_arg(f"byte size overflow for input '{name}': element count ({count}) * "
                          f"data type size ({size}) exceeds maximum allowed size ({_INT64_MAX})")
    return count


def _dims(shape: list[int]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _member_string(item: dict, key: str) -> str:
    """TritonJson's MemberAsString(key), wrapped in Triton's "Unable to parse '<key>'"."""
    value = item.get(key, _ABSENT)
    if type(value) is not str:
        raise unable_to_parse(key, json_no_member_text(key) if value is _ABSENT
                              else JSON_NOT_STRING)
    return value


def _check_shm_params(params: dict) -> None:
    """Triton's CheckSharedMemoryData: the types of the shared-memory parameters."""
    if "shared_memory_region" in params and type(params["shared_memory_region"]) is not str:
        raise unable_to_parse("shared_memory_region", JSON_NOT_STRING)
    for key in _SHM_KEYS[1:]:
        if key in params and not _uint(params[key]):
            raise unable_to_parse(key, JSON_NOT_UINT)


def _decode_output(item: Any) -> RequestedOutput:
    """One of "outputs", checked in Triton's order: ValidateOutputParameter, "name",
    CheckClassificationOutput, CheckSharedMemoryData, CheckBinaryOutputData. A "parameters"
    that is not an object holds nothing (as for inputs)."""
    if type(item) is not dict:
        item = {}
    params = item.get("parameters")
    if type(params) is not dict:
        params = {}
    binary = params.get("binary_data", False)
    if "shared_memory_region" in params:  # Triton's ValidateOutputParameter
        if "classification" in params:
            raise invalid_arg("Output can't set both 'shared_memory_region' and "
                              "'classification'")
        if type(binary) is not bool:
            raise invalid_arg(f"Unable to set 'binary_data': {JSON_NOT_BOOL}")
        if binary:
            raise invalid_arg("Output can't set both 'shared_memory_region' and "
                              "'binary_data'")
    name = _member_string(item, "name")
    if not params:
        return RequestedOutput(name)
    if "classification" in params:  # CheckClassificationOutput
        k = params["classification"]
        if not _uint(k):
            raise invalid_arg(f"Unable to set 'classification': {JSON_NOT_UINT}")
        # Triton keeps k as a uint32: a count whose low 32 bits are 0 asks for nothing
        params = {**params, "classification": k & 0xFFFFFFFF}
        if not params["classification"]:
            del params["classification"]
    _check_shm_params(params)
    if type(binary) is not bool:
        raise unable_to_parse("binary_data", JSON_NOT_BOOL)
    return RequestedOutput(name, params)


def decode_raw_request(model: str, version: str, body: Any, config: dict) -> CoreRequest:
    """A raw binary body (Inference-Header-Content-Length: 0) -> the model's only input.

    The shape is deduced as Triton core does: [1] (when the model batches) + config dims,
    the one variable dim taking whatever the byte size leaves; a BYTES input must have dims
    [1] and the body becomes its one element. `config` is the model's ModelConfig JSON."""
    inputs = config.get("input") or []
    if len(inputs) != 1:
        raise invalid_arg(f"{_RAW_ID}Raw request must only have 1 input (found 1) to be "
                          f"deduced but got {len(inputs)} inputs in '{model}' model "
                          f"configuration")
    cin = inputs[0]
    name = cin.get("name", "")
    datatype = config_to_api(cin.get("data_type", "TYPE_INVALID"))
    shape = [1] if int(config.get("max_batch_size") or 0) != 0 else []
    variable, count = -1, 1
    for d in cin.get("dims") or ():
        d = int(d)
        if d == -1:
            if variable != -1:
                raise invalid_arg(f"{_RAW_ID}The shape of the raw input '{name}' can not be deduced "
                                  f"because there are more than one variable-sized dimension")
            variable = len(shape)
        else:
            count *= d
        shape.append(d)
    nbytes = memoryview(body).nbytes
    data: Any = body
    if datatype == "BYTES":
        if variable != -1 or count != 1:
            raise invalid_arg(f"{_RAW_ID}For BYTE datatype raw input '{name}', the model must have "
                              f"input shape [1]")
        data = _U32.pack(nbytes) + bytes(body)
    elif variable != -1:
        per = count * (element_size(datatype) or 1)
        shape[variable] = nbytes // per if per else 0
    return CoreRequest(model, version, "", [InputTensor(name, datatype, shape, data)], raw=True)


# ---- inference responses ---------------------------------------------------------------

_JSON, _BINARY, _SHM = 0, 1, 2


def _output_kinds(req: CoreRequest) -> dict[str, int] | None:
    if not req.outputs:
        return None
    kinds = {}
    for o in req.outputs:
        p = o.parameters
        kinds[o.name] = (_SHM if "shared_memory_region" in p
                         else _BINARY if p.get("binary_data") is True else _JSON)
    return kinds


def encode_infer_response(resp: CoreResponse, req: CoreRequest,
                          binary_default: bool) -> tuple[bytes, int | None]:
    """-> (body, JSON header length or None when no binary data follows the JSON).

    An output the request names is binary when its "binary_data" is true, else JSON (as
    in Triton, the request-level "binary_data_output" only covers outputs it does not
    name); unnamed outputs follow `binary_default`. Binary outputs carry
    "binary_data_size" and their bytes follow the JSON in output order."""
    kinds = _output_kinds(req)
    default = _BINARY if binary_default else _JSON
    outputs = []
    parts: list[Any] = []
    non_finite = False
    for o in resp.outputs:
        kind = default if kinds is None else kinds.get(o.name, default)
        entry: dict[str, Any] = {"name": o.name, "datatype": o.datatype, "shape": o.shape}
        if kind == _BINARY:
            data = o.data
            nbytes = data.nbytes if type(data) is memoryview else len(data)
            entry["parameters"] = {**o.parameters, "binary_data_size": nbytes}
            if nbytes:
                parts.append(data)
        else:
            if o.parameters:
                entry["parameters"] = o.parameters
            if kind == _JSON:
                data = entry["data"] = _output_json(o.name, o.datatype, o.shape, o.data)
                if type(data) is np.ndarray and data.dtype.kind == "f" and \
                        not np.isfinite(data).all():
                    non_finite = True
        outputs.append(entry)
    doc: dict[str, Any] = {}
    rid = resp.id or req.id
    if rid:
        doc["id"] = rid
    doc["model_name"] = resp.model_name
    doc["model_version"] = resp.model_version
    if resp.parameters:
        doc["parameters"] = resp.parameters
    doc["outputs"] = outputs
    header = _encode_response(doc) if not non_finite else _encode_non_finite(doc)
    if not parts:  # Triton: no binary bytes -> plain JSON, no header-length header
        return header, None
    return b"".join([header, *parts]), len(header)


def _encode_non_finite(doc: dict[str, Any]) -> bytes:
    """The response JSON when a float output holds NaN or an infinity: written as Triton's
    rapidjson writes them (NaN, Infinity, -Infinity; Python's json and tritonclient read
    them), where orjson would write null. "outputs" is the document's last member and
    "data" each output's, so the array text goes in place of the empty ones."""
    outputs = doc["outputs"]
    texts = []
    for entry in outputs:
        data = entry.get("data")
        if type(data) is not np.ndarray or data.dtype.kind != "f" or np.isfinite(data).all():
            texts.append(_encode_response(entry))
            continue
        head = _encode_response({k: v for k, v in entry.items() if k != "data"})
        # orjson writes each non-finite value as null, and nothing else in a float array is
        pieces = _encode_response(data).split(b"null")
        bad = data[~np.isfinite(data)]
        tokens = [b"NaN" if v != v else b"Infinity" if v > 0 else b"-Infinity"
                  for v in bad.tolist()]
        body = [pieces[0]]
        for token, piece in zip(tokens, pieces[1:]):
            body += (token, piece)
        texts.append(b"".join([head[:-1], b',"data":', *body, b"}"]))
    header = _encode_response({**doc, "outputs": []})
    return b"".join([header[:-3], b"[", b",".join(texts), b"]}"])


def _output_json(name: str, datatype: str, shape: list[int], data: Any) -> Any:
    if datatype in ("FP16", "BF16"):   # Triton's WriteDataToJson: binary only
        raise invalid_arg(json_send_refused_text(datatype))
    try:
        return buffer_to_json_array(datatype, shape, data, strict=True)
    except NotText as e:       # (2.51 writes the bytes as they are; clients fail to read it)
        raise invalid_arg(json_not_utf8_text(name, e.index)) from None
    except TriremeError as e:  # the backend's fault, not the client's
        raise internal(f"output tensor shape does not match size of output for "
                       f"'{name}': {e.message}") from None


@functools.lru_cache(maxsize=128)
def response_encoding(accept_encoding: str) -> str | None:
    """"gzip", "deflate" or None from an Accept-Encoding value: the supported type with
    the highest q-weight, first one on ties (Triton's CompressionTypeUsed)."""
    best, weight = "identity", 0.0
    for item in accept_encoding.split(","):
        item = item.strip()
        if not item:
            continue
        kind, sep, q = item.partition(";q=")
        kind = kind.strip().lower()
        w = 1.0
        if sep:
            try:
                w = float(q)
            except ValueError:
                continue
        if kind in ("identity", "deflate", "gzip") and w > weight:
            best, weight = kind, w
    return None if best == "identity" else best


def compress(body: bytes, encoding: str) -> bytes:
    """gzip (RFC 1952) or deflate (zlib stream, RFC 1950, as HTTP means it)."""
    return zlib.compress(body, 6, 31 if encoding == "gzip" else 15)
