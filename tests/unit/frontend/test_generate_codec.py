"""The generate extension's codec and answers (services/frontend/http/generate.py) without a
server: request JSON -> CoreRequest, responses -> JSON and SSE events, and what the two
endpoints answer over a fake data plane. Texts and codes are Triton 2.51's (its
src/http_server.cc; each one also asked of a real Triton: tests/e2e/test_generate.py)."""
from __future__ import annotations

import asyncio
import json
import struct

import numpy as np
import pytest

from services.common.errors import Code, TriremeError
from services.dataplane.types import CoreResponse, OutputTensor
from services.frontend.http.generate import (
    ONE_RESPONSE_TEXT,
    SSE_TYPE,
    Generate,
    decode_generate_request,
    encode_generate_response,
    sse_event,
)
from services.frontend.http.message import Headers, StreamReply

META = {"inputs": [
    {"name": "PROMPT", "datatype": "BYTES", "shape": [1, 1]},
    {"name": "STREAM", "datatype": "BOOL", "shape": [1, 1]},
    {"name": "ids", "datatype": "INT32", "shape": [1, -1]},
    {"name": "u8", "datatype": "UINT8", "shape": [-1]},
    {"name": "i8", "datatype": "INT8", "shape": [-1]},
    {"name": "f32", "datatype": "FP32", "shape": [2]},
    {"name": "f16", "datatype": "FP16", "shape": [1]},
    {"name": "grid", "datatype": "INT64", "shape": [-1, 2, -1]},
    {"name": "zero", "datatype": "INT32", "shape": [0]},
]}


def decode(body: str | bytes):
    return decode_generate_request("m", "", body.encode() if isinstance(body, str) else body,
                                   META)


def fails(body: str | bytes) -> tuple[Code, str]:
    with pytest.raises(TriremeError) as e:
        decode(body)
    return e.value.code, e.value.message


def strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(s)) + s for s in items)


# ---- request -> CoreRequest -------------------------------------------------------------------

def test_inputs_and_parameters_by_name():
    req = decode('{"PROMPT": "hi", "STREAM": true, "id": "7", "temperature": 0.5, "n": 3,'
                 ' "flag": false, "tag": "x"}')
    assert req.id == "7"
    assert [(t.name, t.datatype, t.shape, bytes(t.data)) for t in req.inputs] == [
        ("PROMPT", "BYTES", [1, 1], strings(b"hi")), ("STREAM", "BOOL", [1, 1], b"\x01")]
    # "id" is also a parameter (Triton: it is in no schema, so it maps as any other key).
    assert req.parameters == {"id": "7", "temperature": 0.5, "n": 3, "flag": False, "tag": "x"}


def test_parameter_numbers_as_triton_types_them():
    req = decode('{"a": 9223372036854775807, "b": -9223372036854775808, '
                 '"c": 9223372036854775808, "d": 18446744073709551615, "e": 2.0}')
    assert req.parameters == {"a": 2**63 - 1, "b": -2**63, "c": 2.0**63, "d": 2.0**64, "e": 2.0}
    assert [type(v) for v in req.parameters.values()] == [int, int, float, float, float]


def test_nested_parameters():
    req = decode('{"PROMPT": "p", "parameters": {"STREAM": false, "k": "v"}, "top": 1}')
    assert [t.name for t in req.inputs] == ["PROMPT", "STREAM"]
    assert req.parameters == {"k": "v", "top": 1}
    assert fails('{"parameters": 1}') == (Code.INVALID_ARG, "Expected JSON object for keyword: "
                                          "'parameters': attempt to access JSON non-object as object")
    assert fails('{"parameters": {"x": [1]}}') == (
        Code.INVALID_ARG, "Converting keyword: 'parameters': parameter 'x' has invalid type. It "
                          "should be either 'int', 'bool', or 'string'.")
    assert fails('{"parameters": {"parameters": {}}}')[1].startswith(
        "Converting keyword: 'parameters': parameter 'parameters' has invalid type")
    meta = {"inputs": [{"name": "parameters", "datatype": "BYTES", "shape": [1]}]}
    with pytest.raises(TriremeError) as e:
        decode_generate_request("m", "", b'{"parameters": {}}', meta)
    assert e.value.message == ("Keyword 'parameters' for nested schema also given as input "
                               "tensor name")


def test_a_repeated_parameter_reaches_the_model_with_its_last_value():
    """Triton passes both; a model reads the JSON's last (Differs: once here)."""
    assert decode('{"a": 1, "parameters": {"a": 2}}').parameters == {"a": 2}
    assert decode('{"a": 1, "a": 2}').parameters == {"a": 1}    # each time its first value


@pytest.mark.parametrize("value", ["null", "[1]", '{"x": 1}'])
def test_invalid_parameter_types(value):
    assert fails(f'{{"p": {value}}}') == (Code.INVALID_ARG, "parameter 'p' has invalid type. It "
                                          "should be either 'int', 'bool', or 'string'.")


def test_duplicates_use_the_first_value_and_fail_at_the_second():
    assert fails('{"PROMPT": "a", "STREAM": true, "PROMPT": 5, "STREAM": "x"}') == \
        (Code.INVALID_ARG, "[request id: <id_unknown>] input 'PROMPT' already exists in request")
    assert fails('{"id": "r1", "PROMPT": "a", "parameters": {"PROMPT": "b"}}') == \
        (Code.INVALID_ARG, "Converting keyword: 'parameters': [request id: r1] input 'PROMPT' "
                           "already exists in request")
    # A later key's own error comes first when the duplicate comes after it.
    assert fails('{"PROMPT": "a", "STREAM": 1, "PROMPT": "b"}')[1] == \
        "Unable to parse 'data': attempt to access JSON non-boolean as boolean"


def test_shapes_from_the_model():
    def shape(name, value):
        return decode(json.dumps({name: value})).inputs[0].shape
    assert shape("ids", [1, 2, 3]) == [1, 3]
    assert shape("ids", 7) == [1, 1]
    assert shape("ids", []) == [1, 0]
    assert shape("grid", [1, 2, 3, 4]) == [1, 2, 2]    # innermost variable dim takes the rest
    assert shape("f32", [1, 2]) == [2]
    for name, value in (("f32", [1]), ("f32", [1, 2, 3]), ("grid", [1, 2, 3]), ("zero", [1])):
        assert fails(json.dumps({name: value})) == (
            Code.INVALID_ARG, f"The schema can not convert input '{name}' to tensor with proper "
                              f"shape")


def test_number_conversions_wrap_as_c_casts():
    def data(name, value):
        return bytes(decode(json.dumps({name: value})).inputs[0].data)
    assert data("u8", [300, 255, 0]) == bytes([44, 255, 0])
    assert data("i8", [200, -129]) == np.array([200, -129], np.int64).astype(np.int8).tobytes()
    assert data("ids", -3000000000) == np.int32(1294967296).tobytes()
    assert data("f32", [0.1, 3]) == np.array([0.1, 3.0], np.float32).tobytes()
    assert data("ids", [[1], [2]]) == np.array([1, 2], np.int32).tobytes()  # nested, same count


@pytest.mark.parametrize("body, text", [
    ('{"ids": 1.5}', "non-signed-integer as signed-integer"),
    ('{"ids": true}', "non-signed-integer as signed-integer"),
    ('{"u8": -1}', "non-unsigned-integer as unsigned-integer"),
    ('{"f32": ["1", 2]}', "non-number as double"),
    ('{"STREAM": 1}', "non-boolean as boolean"),
])
def test_type_errors_are_the_clients(body, text):
    assert fails(body) == (Code.INVALID_ARG, f"Unable to parse 'data': attempt to access JSON {text}")


def test_bytes_inputs():
    assert fails('{"PROMPT": 1}') == (Code.INVALID_ARG, "Unable to parse JSON bytes array: attempt "
                                                     "to access JSON non-string as string")
    assert fails('{"PROMPT": {"a": "b"}}')[1].startswith("Unable to parse JSON bytes array")
    # Every string of a nested array is sent; the count is the core's check (validation).
    t = decode('{"PROMPT": [["a", "b"]]}').inputs[0]
    assert (t.shape, bytes(t.data)) == ([1, 1], strings(b"a", b"b"))
    assert bytes(decode('{"PROMPT": "\\u00e9\\u0000"}').inputs[0].data) == \
        strings("é\0".encode())


def test_data_count_mismatch():
    for body in ('{"ids": [[1, 2], [3]]}', '{"ids": [[], []]}'):
        assert fails(body) == (Code.INVALID_ARG, "Unable to parse 'data': Shape does not match true "
                                              "shape of 'data' field")


def test_fp16_input_refused():
    assert fails('{"f16": 1.0}') == (Code.INVALID_ARG, "receiving FP16 data via JSON is not "
                                     "supported. Please use the binary data format for input f16")


def test_body_errors_are_the_clients():
    assert fails("") == (Code.INVALID_ARG, "failed to parse the request JSON buffer: The document "
                                        "is empty. at 0")
    assert fails("[1]") == (Code.INVALID_ARG, "attempt to get members for non-object")
    assert fails('"x"') == (Code.INVALID_ARG, "attempt to get members for non-object")
    assert fails('{"id": 5}') == (Code.INVALID_ARG, "Unable to parse 'id': attempt to access JSON "
                                                 "non-string as string")
    assert fails('{"PROMPT": ')[0] == Code.INVALID_ARG


def test_deeply_nested_body_is_read():
    deep = '{"p": "x", "deep": ' + "[" * 5000 + "]" * 5000 + "}"
    assert fails(deep)[1].startswith("parameter 'deep' has invalid type")


# ---- responses -> JSON -----------------------------------------------------------------------

def out(name: str, datatype: str, shape: list[int], values) -> OutputTensor:
    if datatype == "BYTES":
        return OutputTensor(name, datatype, shape, strings(*(v.encode() for v in values)))
    return OutputTensor(name, datatype, shape, np.array(values, datatype.lower().replace(
        "fp", "float").replace("bool", "bool_")).tobytes())


def test_response_keys_in_byte_order_scalars_and_lists():
    resp = CoreResponse("m", "3", "42", [
        out("TEXT", "BYTES", [1, 1], ["hi"]), out("a", "INT32", [2], [1, 2]),
        out("Z", "FP32", [1], [0.1]), out("e", "INT64", [1, 0], []),
        out("b", "BOOL", [3], [True, False, True])])
    assert encode_generate_response(resp) == (
        b'{"TEXT":"hi","Z":0.10000000149011612,"a":[1,2],"b":[true,false,true],"e":[],'
        b'"id":"42","model_name":"m","model_version":"3"}')
    assert b'"id"' not in encode_generate_response(CoreResponse("m", "1", ""))


def test_reserved_keys_then_parameters_then_outputs_win():
    resp = CoreResponse("m", "1", "", [out("model_name", "BYTES", [1], ["x"]),
                                       out("p", "INT32", [1], [9]), out("q", "INT32", [1], [5])],
                        parameters={"p": "param", "r": True, "model_version": "no"})
    assert json.loads(encode_generate_response(resp)) == {
        "model_name": "m", "model_version": "1", "p": "param", "q": 5, "r": True}


def test_response_errors():
    with pytest.raises(TriremeError) as e:
        encode_generate_response(CoreResponse("m", "1", "", parameters={"b": b"x"}))
    assert (e.value.code, e.value.message) == (Code.UNSUPPORTED, "Response parameter 'b' has type "
                                               "'TRITONSERVER_PARAMETER_BYTES' which is not "
                                               "currently supported")
    with pytest.raises(TriremeError) as e:
        encode_generate_response(CoreResponse("m", "1", "", [out("h", "FP16", [1], [1.0])]))
    assert e.value.message == ("sending FP16 data via JSON is not supported. Please use the "
                               "binary data format for output")
    with pytest.raises(TriremeError) as e:
        encode_generate_response(CoreResponse("m", "1", "", [
            OutputTensor("o", "INT32", [2], b"\0\0\0\0")]))
    assert (e.value.code, e.value.message) == (
        Code.INTERNAL, "output tensor shape does not match size of output for 'o'")


def test_sse_event():
    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'


# ---- the endpoints over a fake data plane ------------------------------------------------------

def response(value: str, final: bool = True) -> CoreResponse:
    return CoreResponse("m", "1", "", [out("TEXT", "BYTES", [1], [value])], final=final)


EMPTY_FINAL = CoreResponse("m", "1", "", final=True, empty=True)


class FakePlane:
    """``script``: what the request's stream brings, each item after a loop turn (as results
    come); ``refuse``: an error raised before anything is sent (validation)."""

    def __init__(self, script=(), refuse: TriremeError | None = None) -> None:
        self.script, self.refuse = list(script), refuse
        self.released = 0
        self.closed = asyncio.Event()
        self.gate = asyncio.Event()

    async def model_metadata(self, model: str, version: str) -> dict:
        if model == "nope":
            raise TriremeError(Code.NOT_FOUND, "Request for unknown model: 'nope' is not found")
        return META

    async def infer_stream(self, req):
        if self.refuse is not None:
            raise self.refuse
        try:
            for item in self.script:
                await asyncio.sleep(0)
                if item == "wait":
                    await self.gate.wait()
                    continue
                if isinstance(item, TriremeError):
                    raise item
                yield item
        finally:
            self.closed.set()

    def release(self, resp) -> None:
        self.released += 1


class Request:
    def __init__(self, body: bytes = b'{"PROMPT": "p"}', **headers: str) -> None:
        self.method, self.body = "POST", body
        self.headers = Headers({k.replace("_", "-").lower(): v for k, v in headers.items()})


async def read_body(request, kind: str) -> bytes:
    return request.body


async def answer(dp, route: str, request=None):
    gen = Generate(dp, read_body)
    return await getattr(gen, route)(request or Request(), "m", "")


async def body_of(reply) -> bytes:
    if not isinstance(reply, StreamReply):
        return reply.body
    try:
        return b"".join([piece async for piece in reply.chunks])
    finally:
        await reply.chunks.aclose()


def run(coro):
    return asyncio.run(coro)


def ok(value: str) -> bytes:
    return b'{"TEXT":"%s","model_name":"m","model_version":"1"}' % value.encode()


def err(text: str) -> bytes:
    return json.dumps({"error": text}, separators=(",", ":")).encode()


@pytest.mark.parametrize("script, plain, streamed", [
    ([response("a")], (200, ok("a")), (200, sse_event(ok("a")))),
    ([response("a", False), EMPTY_FINAL], (200, ok("a")), (200, sse_event(ok("a")))),
    ([EMPTY_FINAL], (200, err(ONE_RESPONSE_TEXT)), (200, b"")),
    ([response("a", False), response("b")], (200, err(ONE_RESPONSE_TEXT)),
     (200, sse_event(ok("a")) + sse_event(ok("b")))),
    ([TriremeError(Code.UNAVAILABLE, "boom")], (400, err("boom")), (400, sse_event(err("boom")))),
    ([response("a", False), TriremeError(Code.INTERNAL, "late")], (200, err(ONE_RESPONSE_TEXT)),
     (200, sse_event(ok("a")) + sse_event(err("late")))),
])
def test_answers(script, plain, streamed):
    """The first item sets the status (an error one: 400, whatever its code, as Triton
    2.51); /generate needs exactly one response or error."""
    async def body():
        for route, want in (("generate", plain), ("generate_stream", streamed)):
            dp = FakePlane(script)
            reply = await answer(dp, route)
            content = await body_of(reply)
            assert (reply.status, content) == want
            assert reply.content_type == ("application/json" if route == "generate" else SSE_TYPE)
            assert dp.closed.is_set()
            assert dp.released == sum(1 for i in script if isinstance(i, CoreResponse))
    run(body())


def test_refused_before_sending_raises_for_the_routes_json_error():
    """The data plane's own checks fail without a loop turn: Triton's synchronous errors,
    answered by the route with their own status as plain JSON."""
    async def body():
        for route in ("generate", "generate_stream"):
            dp = FakePlane(refuse=TriremeError(Code.INVALID_ARG, "bad"))
            with pytest.raises(TriremeError) as e:
                await answer(dp, route)
            assert e.value.code == Code.INVALID_ARG
            with pytest.raises(TriremeError) as e:
                await answer(dp, route, Request(b"{}", Content_Encoding="gzip"))
            assert e.value.message == "Unsupported content-encoding, only 'identity' is supported."
            reply = await answer(FakePlane([response("a")]), route,
                                 Request(Content_Encoding="identity"))
            assert reply.status == 200
            with pytest.raises(TriremeError) as e:
                await Generate(dp, read_body).generate(Request(), "nope", "")
            assert e.value.code == Code.NOT_FOUND
    run(body())


def test_closing_the_events_mid_stream_closes_the_request():
    async def body():
        dp = FakePlane([response("a", False), "wait", response("b")])
        reply = await answer(dp, "generate_stream")
        assert await anext(reply.chunks) == sse_event(ok("a"))
        pending = asyncio.ensure_future(anext(reply.chunks))
        await asyncio.sleep(0.01)
        assert not dp.closed.is_set()
        pending.cancel()                       # the client left: the server cancels
        with pytest.raises(asyncio.CancelledError):
            await pending
        await reply.chunks.aclose()
        assert dp.closed.is_set()
        # Never read at all: closing still ends the request.
        dp = FakePlane([response("a", False), "wait"])
        reply = await answer(dp, "generate_stream")
        await reply.chunks.aclose()
        assert dp.closed.is_set()
    run(body())
