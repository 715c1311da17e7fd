"""Property-based fuzzing of the request decoders.

Whatever a client sends, the HTTP infer decoder (JSON, and JSON + binary tensors behind
Inference-Header-Content-Length) and the gRPC ModelInferRequest decoder either decode it or
raise TriremeError with a client-error code (HTTP status below 500), within a bounded time:
never another exception (a 500), never a hang. Inputs: arbitrary bytes, and valid requests
put through structured mutations (a JSON node replaced by any JSON value, fields dropped,
sizes and header lengths changed, bytes flipped, inserted, cut).

Bounded and deterministic for CI: a fixed number of examples, derandomized, no deadline
(the time bound is the test's own, generous enough for a loaded machine).
"""
from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import grpc_service_pb2 as pb
from services.common.errors import TriremeError
from services.frontend.grpc import codec as grpc_codec
from services.frontend.http import codec as http_codec
from services.frontend.http import json_body as http_json
from services.frontend.http.routes import http_status

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = 5.0    # seconds: one decode taking longer than this counts as a hang

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BF16", "BYTES"]
NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
         "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
         "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
         "BF16": np.uint16}
RAW_CONFIG = {"max_batch_size": 8,
              "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}


def _client_error(e: TriremeError) -> None:
    assert http_status(e.code) < 500, f"{e.code.name}: {e.message}"
    assert e.message, "an error without a text"


def _decodes_or_refuses(fn, *args) -> object:
    """fn(*args): a result, or TriremeError with a 4xx code; nothing else, and in time."""
    start = time.monotonic()
    try:
        return fn(*args)
    except TriremeError as e:
        _client_error(e)
        return e
    finally:
        assert time.monotonic() - start < SLOW, "decoding took too long"


# ---- JSON values and valid requests --------------------------------------------------------

_STRINGS = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "\x00", "INPUT0",
                                                    "binary_data_size", "-1", "1e400"])
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | _STRINGS)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_STRINGS, inner, max_size=4),
    max_leaves=12)


@st.composite
def infer_requests(draw) -> tuple[dict, list[bytes]]:
    """A valid KServe v2 infer request: (JSON document, binary tensors in input order)."""
    inputs, blobs = [], []
    for i in range(draw(st.integers(1, 3))):
        datatype = draw(st.sampled_from(DATATYPES))
        n = draw(st.integers(0, 4))
        item: dict = {"name": f"INPUT{i}", "datatype": datatype, "shape": [1, n]}
        # binary tensor data; FP16 and BF16 have no JSON form (Triton refuses it): always binary
        if datatype in ("FP16", "BF16") or draw(st.booleans()):
            if datatype == "BYTES":
                blob = b"".join(struct.pack("<I", 3) + b"abc" for _ in range(n))
            else:
                blob = np.zeros(n, NUMPY[datatype]).tobytes()
            item["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            item["data"] = ["x" * k for k in range(n)]
        elif datatype == "BOOL":
            item["data"] = [bool(k % 2) for k in range(n)]
        else:
            item["data"] = [k for k in range(n)]
        inputs.append(item)
    doc: dict = {"inputs": inputs}
    if draw(st.booleans()):
        doc["id"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        doc["parameters"] = {"binary_data_output": draw(st.booleans()), "priority": 1}
    if draw(st.booleans()):
        doc["outputs"] = [{"name": "OUTPUT0", "parameters": {"binary_data": draw(st.booleans())}}]
    return doc, blobs


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _replace(doc, path, new):
    if not path:
        return new
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return doc


def _delete(doc, path):
    if path:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        del parent[path[-1]]
    return doc


def _body(doc, blobs) -> tuple[bytes, str | None]:
    header = json.dumps(doc).encode()
    if not blobs:
        return header, None
    return header + b"".join(blobs), str(len(header))


def _decode_http(body: bytes, header: str | None):
    def decode():
        length = http_codec.parse_header_length(header, len(body))
        if length == 0:
            return http_codec.decode_raw_request("m", "", body, RAW_CONFIG)
        return http_codec.decode_infer_request("m", "", body, length)
    return _decodes_or_refuses(decode)


_BYTE_EDITS = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete"]),
                                 st.integers(0, 1 << 16), st.binary(min_size=1, max_size=3)),
                       max_size=4)


def _edit(body: bytes, edits) -> bytes:
    out = bytearray(body)
    for kind, at, data in edits:
        if not out:
            out += data
            continue
        at %= len(out)
        if kind == "flip":
            out[at] ^= data[0] or 1
        elif kind == "insert":
            out[at:at] = data
        else:
            del out[at:at + len(data)]
    return bytes(out)


# ---- HTTP -----------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@FUZZ
@given(body=st.binary(max_size=512),
       header=st.none() | st.sampled_from(["0", "1", "-1", "x", "99999999999", " 3"])
       | st.integers(0, 600).map(str))
def test_http_arbitrary_bytes(body, header):
    _decode_http(body, header)


@pytest.mark.timeout(300)
@FUZZ
@given(request=infer_requests(), data=st.data())
def test_http_valid_requests_mutated(request, data):
    doc, blobs = request
    body, header = _body(doc, blobs)
    ok = _decode_http(body, header)
    assert not isinstance(ok, TriremeError), ok.message   # valid as generated: it decodes
    for _ in range(data.draw(st.integers(1, 3), "mutations")):
        kind = data.draw(st.sampled_from(["replace", "delete", "header", "bytes", "cut"]))
        if kind in ("replace", "delete"):
            doc = json.loads(json.dumps(doc))
            paths = list(_paths(doc))
            path = paths[data.draw(st.integers(0, len(paths) - 1), "path")]
            if kind == "replace":
                doc = _replace(doc, path, data.draw(JSON_VALUES, "value"))
            else:
                doc = _delete(doc, path)
            body, header = _body(doc, blobs)
        elif kind == "header":
            header = data.draw(st.none() | st.integers(-5, len(body) + 5).map(str), "header")
        elif kind == "bytes":
            body = _edit(body, data.draw(_BYTE_EDITS, "edits"))
        else:
            body = body[:data.draw(st.integers(0, len(body)), "cut")]
        _decode_http(body, header)


def _nested(depth: int, value: str) -> str:
    return "[" * depth + value + "]" * depth


@pytest.mark.parametrize("depth", [99, 100, 120, 1000, 100_000])
@pytest.mark.parametrize("datatype,value", [("BYTES", '"hello"'), ("INT64", "123")])
def test_http_tensor_nesting(depth, datatype, value):
    """Triton's limit on a tensor's "data" (HTTP_MAX_JSON_NESTING_DEPTH = 100: the data at
    depth 0, a value at depth 100 is refused), its texts, at any depth of the document."""
    data = _nested(depth, value)
    body = ('{"inputs":[{"name":"INPUT0","datatype":"' + datatype
            + '","shape":[1,1],"data":' + data + "}]}").encode()
    result = _decode_http(body, None)
    if depth < 100:
        assert not isinstance(result, TriremeError), result
        return
    assert isinstance(result, TriremeError)
    text = "JSON nesting depth exceeds maximum allowed limit (100)"
    assert result.message == (text if datatype == "BYTES" else f"Unable to parse 'data': {text}")


DEEP = 100_000


@pytest.mark.parametrize("doc,refused", [
    (b"[" * DEEP + b"]" * DEEP, True),
    (b'{"inputs":' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", True),
    (b"[" * DEEP, True),
    # an unknown field is skipped, however deep (Triton's parser has no depth limit either)
    (b'{"inputs":[],"x":' + b"[" * DEEP + b"]" * DEEP + b"}", False),
], ids=["array", "object", "unterminated", "unknown-field"])
def test_http_deep_documents(doc, refused):
    """A document nested 100k levels deep is a 400 naming what is wrong, never a
    RecursionError (which would be a 500)."""
    result = _decode_http(doc, None)
    assert isinstance(result, TriremeError) == refused, result


def test_http_repository_index_deeply_nested():
    """Triton's qa/L0_http test_repository_index_deeply_nested_json, on the decoder."""
    depth = 250_000
    with pytest.raises(TriremeError) as e:
        http_json.decode_index_request(b'{"ready":' + b"[" * depth + b"true" + b"]" * depth
                                       + b"}")
    assert e.value.message == "Invalid value for 'ready': expected a boolean"


def _shallow_reference(doc: bytes, keep: int) -> bytes:
    """http_json._shallow, a byte at a time."""
    out, depth, in_string, escaped, deep = bytearray(), 0, False, False, False
    for b in doc:
        if in_string:
            if escaped:
                escaped = False
            elif b == 92:
                escaped = True
            elif b == 34:
                in_string = False
            before = after = depth
        elif b == 34:
            in_string = True
            before = after = depth
        elif b in b"[{":
            before, after = depth, depth + 1
        elif b in b"]}":
            before, after = depth, depth - 1
        else:
            before = after = depth
        depth = after
        now_deep = max(before, after) > keep
        if now_deep and not deep:
            out.append(48)
        elif not now_deep:
            out.append(b)
        deep = now_deep
    return bytes(out)


@FUZZ
@given(doc=st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"a", b",", b"1"]),
                    max_size=400).map(b"".join),
       scan=st.integers(1, 64), keep=st.integers(0, 6))
def test_shallow_scan_matches_a_bytewise_reference(doc, scan, keep):
    """The vectorised scan, cut into slices of any size, against the plain loop."""
    saved = http_json._SCAN, http_json._KEPT_DEPTH
    http_json._SCAN, http_json._KEPT_DEPTH = scan, keep
    try:
        assert http_json._shallow(doc) == _shallow_reference(doc, keep)
    finally:
        http_json._SCAN, http_json._KEPT_DEPTH = saved


# ---- gRPC -----------------------------------------------------------------------------------

def _decode_grpc(data: bytes):
    def decode():
        msg, raw = grpc_codec.decode_infer_request(data)
        return grpc_codec.request_from_proto(msg, raw)
    return _decodes_or_refuses(decode)


_CONTENTS = {   # datatype -> (InferTensorContents field, the k-th element)
    "BOOL": ("bool_contents", lambda k: bool(k % 2)), "UINT8": ("uint_contents", int),
    "UINT16": ("uint_contents", int), "UINT32": ("uint_contents", int),
    "UINT64": ("uint64_contents", int), "INT8": ("int_contents", int),
    "INT16": ("int_contents", int), "INT32": ("int_contents", int),
    "INT64": ("int64_contents", int), "FP32": ("fp32_contents", float),
    "FP64": ("fp64_contents", float), "BYTES": ("bytes_contents", lambda k: b"x" * k)}


@st.composite
def infer_messages(draw) -> bytes:
    """A valid ModelInferRequest: typed contents or raw inputs (large enough, sometimes, for
    the raw-input walker beyond SMALL_MESSAGE), parameters, outputs."""
    msg = pb.ModelInferRequest(model_name="m", id=draw(st.text(max_size=6)))
    raw = draw(st.booleans())
    for i in range(draw(st.integers(1, 3))):
        t = msg.inputs.add(name=f"INPUT{i}", datatype=draw(st.sampled_from(DATATYPES)),
                           shape=[1, draw(st.integers(0, 4))])
        if raw:
            size = draw(st.sampled_from([0, 4, 64, grpc_codec.SMALL_MESSAGE + 8]))
            msg.raw_input_contents.append(bytes(size))
        else:   # the contents field of its datatype (FP16 and BF16 have none: zeros raw)
            field, value = _CONTENTS.get(t.datatype, (None, None))
            if field is None:
                t.ClearField("datatype")
                t.datatype = "INT32"
                field, value = _CONTENTS["INT32"]
            getattr(t.contents, field).extend(value(k) for k in range(t.shape[1]))
        if draw(st.booleans()):
            t.parameters["custom"].int64_param = 3
    if draw(st.booleans()):
        msg.parameters["priority"].uint64_param = 1
        msg.parameters["sequence_id"].string_param = "s"
    if draw(st.booleans()):
        msg.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 2
    return msg.SerializeToString()


@pytest.mark.timeout(300)
@FUZZ
@given(data=st.binary(max_size=512))
def test_grpc_arbitrary_bytes(data):
    _decode_grpc(data)


@pytest.mark.timeout(300)
@FUZZ
@given(data=st.binary(min_size=1, max_size=64))
def test_grpc_arbitrary_bytes_past_the_small_message_size(data):
    """The raw-input walker (messages over SMALL_MESSAGE bytes) on garbage."""
    _decode_grpc(data + b"\x3a\x82\x80\x01" + bytes(grpc_codec.SMALL_MESSAGE))
    _decode_grpc(b"\x3a\x82\x80\x01" + bytes(grpc_codec.SMALL_MESSAGE) + data)


@pytest.mark.timeout(300)
@FUZZ
@given(message=infer_messages(), data=st.data())
def test_grpc_valid_requests_mutated(message, data):
    ok = _decode_grpc(message)
    assert not isinstance(ok, TriremeError), ok.message   # valid as generated: it decodes
    for _ in range(data.draw(st.integers(1, 3), "mutations")):
        if data.draw(st.booleans(), "cut"):
            message = message[:data.draw(st.integers(0, len(message)), "at")]
        else:
            message = _edit(message, data.draw(_BYTE_EDITS, "edits"))
        _decode_grpc(message)


@pytest.mark.parametrize("depth", [50, 101, 10_000])
def test_grpc_deeply_nested_unknown_groups(depth):
    """Unknown fields may be groups, nested at will: refused as malformed, never a crash."""
    field = 15
    data = bytes([field << 3 | 3]) * depth + bytes([field << 3 | 4]) * depth
    result = _decode_grpc(data)
    assert result is not None
