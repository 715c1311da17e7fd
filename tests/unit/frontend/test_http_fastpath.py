"""The HTTP fast paths answer exactly as the generic code they shortcut.

- http_codec: the typed JSON decode of an infer body against the generic decode.
- datatypes: numbers_to_buffer against json_to_buffer; buffer_to_json's memoryview path
  against numpy's tolist().
- http_server: aiohttp's low-level server (make_runner, --http-impl aiohttp) against the
  same handlers in a web.Application, byte for byte on the wire (Date aside), Expect
  handling included. The native server against aiohttp's: tests/unit/frontend/test_http1.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import struct

import numpy as np
import pytest
from aiohttp import web

from services.common import datatypes as dt
from services.common.errors import TriremeError
from services.dataplane.types import CoreResponse, OutputTensor
from services.frontend.http import aiohttp_server as http_server
from services.frontend.http import codec
from services.frontend.settings import FrontendSettings


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except TriremeError as e:
        return ("error", e.code, e.message)


# ---- decode: typed fast path vs generic ---------------------------------------------------

def _request_view(result):
    if result[0] != "ok":
        return result
    req, binary = result[1]
    return ("ok", req.model, req.version, req.id, req.parameters, binary,
            [(t.name, t.datatype, t.shape, None if t.data is None else bytes(t.data),
              t.parameters) for t in req.inputs],
            None if req.outputs is None else [(o.name, o.parameters) for o in req.outputs])


def _generic(monkeypatch, body, header_length=None):
    def refuse(_body):
        raise ValueError("generic path")
    with monkeypatch.context() as m:
        m.setattr(codec, "_decode_typed", refuse)
        return _request_view(_outcome(codec.decode_infer_request, "m", "2", body,
                                      header_length))


def _inp(data, datatype="FP32", shape=None, **extra):
    n = len(data) if isinstance(data, list) else 1
    return {"name": "IN", "datatype": datatype, "shape": [n] if shape is None else shape,
            "data": data, **extra}


FAST_BODIES = [
    {"inputs": [_inp([0.473189, 0.511822, -1.5e-7, 3])]},
    {"inputs": [_inp([1, 2, 3], "INT32"), _inp([1.5, 2], "FP64")]},
    {"id": "r1", "parameters": {"binary_data_output": True, "priority": 1},
     "inputs": [_inp([1.0, 2.0], shape=[1, 2])],
     "outputs": [{"name": "OUT"}, {"name": "O2", "parameters": {"binary_data": True}}]},
    {"inputs": [_inp([255, 0], "UINT8"), _inp([2**64 - 1, 0], "UINT64"),
                _inp([-(2**63), 2**63 - 1], "INT64"), _inp([-128], "INT8")]},
    {"inputs": [_inp([], shape=[0, 3]), _inp([1e-45, 3.4028235e38, -0.0, 0], "FP32")]},
    {"inputs": [_inp([2**53 - 1, -(2**49) + 1, 0.1], "FP64")],
     "parameters": {"binary_data_output": False}},
    {"inputs": [_inp([7], parameters={"custom": 1})], "outputs": []},
]

SLOW_BODIES = [  # each takes (part of) the generic path; results must not change
    {"inputs": [_inp([2**53 + 1, 1.5])]},                # int past 2**53 for a float type
    {"inputs": [_inp([16777217, 2**60])]},
    {"inputs": [_inp([2**70, 1.5])]},                    # numpy refuses: object array
    {"inputs": [_inp([1e39, -1e39])]},                   # FP32 overflow -> inf
    {"inputs": [_inp([1e300], "FP64")]},
    {"inputs": [_inp([256], "UINT8")]},                  # out of range
    {"inputs": [_inp([1.0], "INT32")]},                  # float for an int type
    {"inputs": [_inp([-1, 2**63], "UINT64")]},
    {"inputs": [_inp([1.5, 70000], "FP16")]},
    {"inputs": [_inp([1.5, 3], "BF16")]},
    {"inputs": [_inp([True, 1.5])]},                     # bools: generic decode
    {"inputs": [_inp([True, False], "BOOL")]},
    {"inputs": [_inp(["a", "bc"], "BYTES")]},
    {"inputs": [_inp([[1.0, 2.0], [3.0, 4.0]], shape=[2, 2])]},
    {"inputs": [_inp(2.5, shape=[1])]},                  # bare scalar
    {"inputs": [_inp([1.0, 2.0], shape=[3])]},           # count mismatch
    {"inputs": [_inp([1.0], "NOPE")]},
    {"inputs": [_inp([1.0], shape=[-1])]},
    {"inputs": [_inp([1.0], parameters={"binary_data_size": 4})]},
    {"inputs": [_inp([1.0], parameters={"shared_memory_region": "r"})]},
    {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1],
                 "parameters": {"shared_memory_region": "r"}}]},
    {"inputs": [_inp([1.0], extra=1)]},                  # unknown fields
    {"model_name": "x", "inputs": [_inp([1.0])]},
    {"id": None, "inputs": [_inp([1.0])]},
    {"id": 3, "inputs": [_inp([1.0])]},
    {"parameters": {"binary_data_output": 1}, "inputs": [_inp([1.0])]},
    {"parameters": [], "inputs": [_inp([1.0])]},
    {"inputs": [_inp([1.0])], "outputs": None},
    {"inputs": [_inp([1.0])], "outputs": [{"name": "O", "parameters": {"binary_data": 1}}]},
    {"inputs": [_inp([1.0])], "outputs": ["O"]},
    {"inputs": {}},
    {},
    [1],
]

RAW_BODIES = [
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1],"x":"\xff"}]}',
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1]}],"x":[1e400]}',
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1e400]}]}',
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[2],"data":[-0,1]}]}',
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1]}]} x',
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":[1]}',
    b'{"inputs":[{"name":"A","name":"IN","datatype":"FP32","shape":[1],"data":[1]}]}',
    b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1],"data":["x"],"data":[2]}]}',
    b'',
    b'   ',
]


@pytest.mark.parametrize("doc", FAST_BODIES)
def test_fast_decode_taken_and_same_as_generic(monkeypatch, doc):
    body = json.dumps(doc).encode()
    assert codec._decode_json_request("m", "2", body) is not None
    fast = _request_view(_outcome(codec.decode_infer_request, "m", "2", body))
    assert fast[0] == "ok"
    assert fast == _generic(monkeypatch, body)
    # The JSON part of a binary-tensor body that has no binary part: the same.
    assert _request_view(_outcome(codec.decode_infer_request, "m", "2", body, len(body))) \
        == _generic(monkeypatch, body, len(body))


@pytest.mark.parametrize("body", [json.dumps(d).encode() for d in SLOW_BODIES] + RAW_BODIES)
def test_other_bodies_same_as_generic(monkeypatch, body):
    assert _request_view(_outcome(codec.decode_infer_request, "m", "2", body)) \
        == _generic(monkeypatch, body)


def test_minus_zero_int_is_plus_zero():
    # JSON "-0" is the integer 0 (numpy writes +0.0), "-0.0" the float -0.0.
    body = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[2],"data":[-0,-0.0]}]}'
    req, _ = codec.decode_infer_request("m", "", body)
    assert req.inputs[0].data == struct.pack("<ff", 0.0, -0.0)


# ---- numbers_to_buffer vs json_to_buffer ---------------------------------------------------

_SPECIAL = [0, -0.0, 1, -1, 0.5, 127, 128, -129, 255, 256, 65504.0, 65520.0, 2**24 + 1,
            2**31, -(2**31) - 1, 2**32, 2**49, 2**49 + 1, 2**53 - 1, 2**53, 2**53 + 1,
            -(2**53) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30,
            1e-45, 1e-46, 5e-324, 3.4028235e38, 3.4028236e38, 1e39, -1e39, 1e308, 0.1]
_NUMERIC = ["FP32", "FP64", "FP16", "BF16", "INT8", "INT16", "INT32", "INT64", "UINT8",
            "UINT16", "UINT32", "UINT64"]


def _value(rng: random.Random):
    r = rng.random()
    if r < 0.25:
        return rng.choice(_SPECIAL)
    if r < 0.5:
        return rng.randint(-300, 300)
    if r < 0.75:
        return rng.uniform(-1, 1) * 10.0 ** rng.randint(-40, 40)
    return struct.unpack("<f", struct.pack("<f", rng.uniform(-100, 100)))[0]


@pytest.mark.parametrize("datatype", _NUMERIC)
def test_numbers_to_buffer_same_as_json_to_buffer(datatype):
    rng = random.Random(datatype)
    for _ in range(3000):
        n = rng.choice([1, 2, 5, 16])
        kind = rng.random()
        values = [(_value(rng) if kind < 0.5 else rng.randint(-100, 100) if kind < 0.75
                   else rng.uniform(-100, 100)) for _ in range(n)]
        shape = [n] if rng.random() < 0.95 else [n + 1]
        want = _outcome(dt.json_to_buffer, "x", datatype, shape, values)
        assert _outcome(dt.numbers_to_buffer, "x", datatype, shape, values) == want, values


def test_numbers_to_buffer_packs_directly():
    calls = []
    real = dt.json_to_buffer
    try:
        dt.json_to_buffer = lambda *a: calls.append(a) or real(*a)
        assert dt.numbers_to_buffer("x", "FP32", [1, 3], [0.5, 2, -1e15]) == \
            np.array([0.5, 2, -1e15], np.float32).tobytes()
        assert dt.numbers_to_buffer("x", "INT16", [2], [-5, 7]) == struct.pack("<hh", -5, 7)
        assert calls == []
        dt.numbers_to_buffer("x", "FP32", [1], [2**53])    # could round differently
        assert len(calls) == 1
    finally:
        dt.json_to_buffer = real


# ---- buffer_to_json vs numpy ---------------------------------------------------------------

def _same(a, b) -> bool:
    if type(a) is float:
        return (a == b or (a != a and b != b)) and math.copysign(1, a) == math.copysign(1, b)
    return a == b


@pytest.mark.parametrize("datatype", _NUMERIC + ["BOOL"])
def test_buffer_to_json_same_as_numpy(datatype):
    rng = random.Random(datatype)
    dtype = dt.numpy_dtype(datatype)
    for _ in range(200):
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        raw = rng.randbytes(math.prod(shape) * dtype.itemsize)
        want = np.frombuffer(raw, dtype=dtype).tolist()
        for buf in (raw, memoryview(raw), bytearray(raw)):
            got = dt.buffer_to_json(datatype, shape, buf)
            assert [type(v) for v in got] == [type(v) for v in want]
            assert all(_same(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(TriremeError, match="needs"):
        dt.buffer_to_json(datatype, [3], b"\0" * (3 * dtype.itemsize + 1))


# ---- aiohttp's low-level server vs a web.Application -------------------------------------

class _StubDataPlane:
    async def infer(self, req, endpoint="HTTP end point"):
        t = req.inputs[0]
        return CoreResponse(req.model, "1", req.id,
                            [OutputTensor("OUT", t.datatype, t.shape, t.data)])

    def release(self, resp):
        pass

    def live(self):
        return True


_INFER = b'{"inputs":[{"name":"IN","datatype":"FP32","shape":[1,2],"data":[0.5,-2]}]}'


def _post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", "Connection: close",
            f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_EXCHANGES = [
    [_post("/v2/models/m/infer", _INFER)],
    [_post("/v2/models/m/versions/3/infer", _INFER, "Accept-Encoding: gzip")],
    [_post("/v2/models/m/infer", b"{")],
    [_post("/v2/models/m/infer", _INFER, "Expect: 100-continue")[:-len(_INFER)], _INFER],
    [_post("/v2/models/m/infer", _INFER, "Expect: 100-Continue", version="1.0")],
    [_post("/v2/models/m/infer", _INFER, "Expect: something")],
    [_post("/v2/models//infer", _INFER)],
    [_post("/v2/models/infer", _INFER)],
    [_post("/v2/health/live", b"")],
    [b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"],
    [b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"],
    [b"BROKEN\r\n\r\n"],
]


async def _exchange(port: int, parts: list[bytes]) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    for i, part in enumerate(parts):
        writer.write(part)
        await writer.drain()
        if i < len(parts) - 1:      # an interim answer (100 Continue) comes first
            got += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    got += await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return re.sub(rb"\r\nDate: [^\r]*", b"", got)


async def _answers(runner: web.BaseRunner) -> list:
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        protocol = runner.server()
        return [protocol.debug, protocol.access_logger] + \
            [await _exchange(port, parts) for parts in _EXCHANGES]
    finally:
        await runner.cleanup()


def test_server_answers_as_the_application():
    settings = FrontendSettings("")

    async def both():
        app = web.AppRunner(http_server.make_app(_StubDataPlane(), settings),
                            access_log=None, handle_signals=False)
        return (await _answers(app),
                await _answers(http_server.make_runner(_StubDataPlane(), settings)))

    via_app, via_server = asyncio.run(both())
    assert via_server == via_app
    answers = via_server[2:]
    assert answers[0].startswith(b"HTTP/1.1 200 OK") and b'"data":[0.5,-2.0]' in answers[0]
    assert answers[3].startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK")
    assert answers[5].startswith(b"HTTP/1.1 417")
