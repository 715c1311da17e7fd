"""Triton's generate extension: POST /v2/models/{m}[/versions/{v}]/generate and
/generate_stream (server-sent events), as Triton 2.51 answers them.

The request is one JSON object. Each top-level key (document order, duplicates included)
is a model input when the model has an input of that name, else a request parameter;
"parameters" is an object whose keys go the same way; "id" is the request id and, as any
other key, also an input or a parameter. Responses are one JSON object each: every output
and response parameter as a top-level key (a one-element tensor as a scalar, others as a
flat list), "model_name", "model_version" and "id" when there is one, keys in byte order.

Sources (triton-inference-server/server v2.51.0, src/http_server.cc): HandleGenerate,
GenerateRequestClass::{ConvertGenerateRequest, ExactMappingInput, InferResponseComplete,
SendChunkResponse, FinalizeResponse, ExactMappingOutput}, SetTritonParameterFromJsonParameter,
JsonBytesArrayByteSize, ReadDataFromJson; TritonJson's texts (common, triton_json.h). Every
text below was also asked of a real Triton 2.51 (tests/e2e/test_generate.py). A tensor's
JSON values are read by the infer path's rules (datatypes.json_to_buffer). Differs from
Triton: its TritonJson errors (type mismatches, a body that is not an object, unparsable
JSON) are 500 there; they are the client's mistakes, so 400 here, as on the infer path
(docs/compat.md).

/generate runs every model, decoupled or not, and waits for the final flag: exactly one
response (or error) is its answer, else Triton's "generate expects ..." text. /generate_stream
sends each response as ``data: {json}\n\n`` (an error as ``data: {"error": ...}\n\n``);
a bare final flag sends nothing. On both, what comes first sets the status: 200, or 400 for
an error whatever its code (Triton 2.51 reads the code of an error it has freed: it answers
400 for the model's INTERNAL, NOT_FOUND, UNAVAILABLE alike). Errors found before the request
is queued (unknown model, Triton's request checks) are a plain JSON error with their status.

Differs from Triton: HTTP/1.1 /generate answers carry a Content-Length (Triton sends them
chunked; HTTP/1.0 streams go unchunked, then close); a repeated parameter key reaches the
model once, with its last value (Triton passes both, and its Python models read the last).
"""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import orjson

from services.common.datatypes import (
    BYTES_NOT_STRING_TEXT,
    NUMBER_TOO_BIG_TEXT,
    buffer_to_json_array,
    json_to_buffer,
)
from services.common.errors import JSON_NOT_OBJECT, TriremeError, internal, invalid_arg, unsupported
from services.common.errors import JSON_NOT_STRING as _NOT_STRING
from services.dataplane.api import DataPlaneAPI
from services.dataplane.types import CoreRequest, CoreResponse, InputTensor
from services.frontend.http.json_body import check_nesting, decode_json, error_body
from services.frontend.http.message import Reply, StreamReply

__all__ = ["ONE_RESPONSE_TEXT", "SSE_TYPE", "Generate", "decode_generate_request",
           "encode_generate_response", "sse_event"]

SSE_TYPE = "text/event-stream; charset=utf-8"
_JSON = "application/json"
ONE_RESPONSE_TEXT = ("generate expects model to produce exactly 1 response, use generate "
                     "stream for model that generates various number of responses")
_ENCODING_TEXT = "Unsupported content-encoding, only 'identity' is supported."
_SHAPE_TEXT = "The schema can not convert input '{}' to tensor with proper shape"
_INT64 = (-(1 << 63), (1 << 63) - 1)
_encode = orjson.dumps
_SORTED = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


class _Object(list):
    """A JSON object as its members, in order, duplicates kept (rapidjson's Members());
    a list subclass only so that json.loads can build it: it is never a JSON array."""
    __slots__ = ()

    def first(self) -> dict[str, Any]:
        """Each name's first value (rapidjson's FindMember, Triton's Find)."""
        values: dict[str, Any] = {}
        for k, v in self:
            values.setdefault(k, v)
        return values


def _parse(body: Any) -> Any:
    """The document, objects as _Object. Errors are worded and checked by the JSON reader
    every other body uses (json_body.decode_json)."""
    doc = decode_json(body)
    try:
        return json.loads(bytes(body).decode(), object_pairs_hook=_Object)
    except (RecursionError, ValueError):
        # Deeper than the stdlib reader goes (or what it reads otherwise): the members as
        # msgspec kept them, the last of a repeated name.
        if type(doc) is not dict:
            return doc
        return _Object((k, _Object(v.items()) if type(v) is dict else v)
                       for k, v in doc.items())


# ---- request: JSON -> CoreRequest ------------------------------------------------------

def decode_generate_request(model: str, version: str, body: Any,
                            metadata: dict) -> CoreRequest:
    """A generate body -> the request; ``metadata``: the model's (its inputs' names,
    datatypes and shapes, batch dimension included)."""
    doc = _parse(body)
    members = doc if type(doc) is _Object else None
    first = members.first() if members is not None else {}
    req = CoreRequest(model, version)
    if "id" in first:                          # ParseJsonTritonRequestID, before the rest
        rid = first["id"]
        if type(rid) is not str:
            raise invalid_arg(f"Unable to parse 'id': {_NOT_STRING}")
        req.id = rid
    if members is None:
        raise invalid_arg(JSON_NOT_OBJECT)
    specs = {i["name"]: i for i in metadata.get("inputs", ())}
    _convert(req, members, first, specs, top=True)
    return req


def _convert(req: CoreRequest, members: _Object, first: dict[str, Any],
             specs: dict[str, dict], top: bool) -> None:
    for key, _ in members:
        value = first[key]
        if top and key == "parameters":        # the one nested schema
            if key in specs:
                raise invalid_arg("Keyword 'parameters' for nested schema also given as "
                                  "input tensor name")
            if type(value) is not _Object:
                raise invalid_arg("Expected JSON object for keyword: 'parameters': attempt to "
                               "access JSON non-object as object")
            try:
                _convert(req, value, value.first(), specs, top=False)
            except TriremeError as e:
                raise TriremeError(e.code, f"Converting keyword: 'parameters': {e.message}") \
                    from None
        elif key in specs:
            _add_input(req, key, value, specs[key])
        else:
            req.parameters[key] = _parameter(key, value)


def _parameter(key: str, value: Any) -> Any:
    """SetTritonParameterFromJsonParameter: string, int64, bool, else any number as a double."""
    t = type(value)
    if t is str or t is bool:
        return value
    if t is int and _INT64[0] <= value <= _INT64[1]:
        return value
    if t is int or t is float:
        try:
            return float(value)
        except OverflowError:                  # rapidjson refuses it when parsing
            raise invalid_arg(NUMBER_TOO_BIG_TEXT) from None
    raise invalid_arg(f"parameter '{key}' has invalid type. It should be either 'int', "
                      f"'bool', or 'string'.")


def _fit_shape(name: str, dims: list[int], count: int) -> list[int]:
    """ExactMappingInput's two passes: the fixed dimensions (innermost first) take their
    share of the element count, the innermost variable one the rest, other variable ones 1."""
    shape = [int(d) for d in dims]
    n = count
    for d in reversed(shape):
        if d != -1:
            if (n % d if d else n):            # (a 0 dimension: Triton divides by zero)
                raise invalid_arg(_SHAPE_TEXT.format(name))
            n = n // d if d else 0
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == -1:
            shape[i], n = n, 1
    if n != 1:
        raise invalid_arg(_SHAPE_TEXT.format(name))
    return shape


def _leaves(value: Any) -> list[Any]:
    """The values of a JSON value, arrays walked depth first (ReadDataFromJsonHelper)."""
    if type(value) is not list:
        return [value]
    out: list[Any] = []
    stack = [iter(value)]
    while stack:
        for v in stack[-1]:
            if type(v) is list:
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _add_input(req: CoreRequest, name: str, value: Any, spec: dict) -> None:
    """One model input from a JSON value: a scalar is one element, an array as many as its
    top level holds; the shape comes from the model's (_fit_shape). The values are read by
    the infer path's rules and texts (datatypes.json_to_buffer, json_body.check_nesting)."""
    datatype = spec["datatype"]
    data = value if type(value) is list else [value]
    if datatype == "BYTES" and any(type(v) is not str for v in _leaves(value)):
        raise invalid_arg(BYTES_NOT_STRING_TEXT)   # (JsonBytesArrayByteSize: before the shape)
    shape = _fit_shape(name, spec["shape"], len(data))
    check_nesting(data, datatype)
    tensor = json_to_buffer(name, datatype, shape, data)
    if any(t.name == name for t in req.inputs):
        raise invalid_arg(f"[request id: {req.id or '<id_unknown>'}] input '{name}' already "
                          f"exists in request")
    req.inputs.append(InputTensor(name, datatype, shape, tensor))


# ---- responses -> JSON, SSE events ------------------------------------------------------

def encode_generate_response(resp: CoreResponse) -> bytes:
    """FinalizeResponse: one std::map of "id" (when set), "model_name", "model_version",
    the response's parameters and its outputs, the first of a name kept, written in key
    order."""
    doc: dict[str, Any] = {}
    if resp.id:
        doc["id"] = resp.id
    doc["model_name"] = resp.model_name
    doc["model_version"] = resp.model_version
    for key, value in resp.parameters.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            raise unsupported(f"Response parameter '{key}' has type "
                              f"'TRITONSERVER_PARAMETER_BYTES' which is not currently supported")
        doc.setdefault(key, value)
    for o in resp.outputs:
        if o.name not in doc:
            doc[o.name] = _output_value(o.name, o.datatype, o.shape, o.data)
    return _encode(doc, option=_SORTED)


def _output_value(name: str, datatype: str, shape: list[int], data: Any) -> Any:
    if datatype in ("FP16", "BF16"):          # WriteDataToJson's refusal
        raise invalid_arg(f"sending {datatype} data via JSON is not supported. Please use "
                          f"the binary data format for output")
    try:
        values = buffer_to_json_array(datatype, shape, data)
    except TriremeError:
        raise internal(f"output tensor shape does not match size of output for "
                       f"'{name}'") from None
    if math.prod(shape) == 1:                 # one element: the value, not an array
        return values[0].item() if isinstance(values, np.ndarray) else values[0]
    return values


def sse_event(payload: bytes) -> bytes:
    return b"data: %s\n\n" % payload


# ---- the two endpoints -------------------------------------------------------------------

ReadBody = Callable[[Any, str], Awaitable[Any]]
Item = CoreResponse | TriremeError | None     # a response, an error, or the stream's end


class Generate:
    """The handlers' generate half: ``dp``, the data plane; ``read_body(request, kind)``,
    the body under --http-max-input-size (an error raised here is the route's JSON error,
    with its status from the one table)."""

    def __init__(self, dp: DataPlaneAPI, read_body: ReadBody) -> None:
        self.dp, self._read = dp, read_body

    async def _request(self, request: Any, model: str, version: str) -> CoreRequest:
        """HandleGenerate's steps before inference, in its order."""
        metadata = await self.dp.model_metadata(model, version)
        encoding = request.headers.get("Content-Encoding")
        if encoding and encoding != "identity":   # Triton: exactly "identity" or none
            raise invalid_arg(_ENCODING_TEXT)
        body = await self._read(request, "request JSON")
        return decode_generate_request(model, version, body, metadata)

    async def _start(self, req: CoreRequest) -> tuple[AsyncIterator[CoreResponse], Item]:
        """The stream and its first item. A request the data plane refuses before sending
        it raises (Triton's synchronous errors: a plain JSON error with its own status).
        The data plane checks a request without waiting (the model's metadata is cached by
        now), so an error raised before the loop has turned is such a refusal; anything
        later came from the scheduler or the model: an item."""
        stream = self.dp.infer_stream(req)
        turned: list[bool] = []
        asyncio.get_running_loop().call_soon(turned.append, True)
        try:
            return stream, _item(await anext(stream))
        except StopAsyncIteration:
            return stream, None
        except TriremeError as e:
            await _aclose(stream)
            if not turned:
                raise
            return stream, e
        except BaseException:
            await _aclose(stream)
            raise

    def _encoded(self, resp: CoreResponse) -> tuple[int, bytes]:
        """(status, JSON body) of one response. An error (the model's, or in writing it)
        is 400 whatever its code: Triton 2.51 reads the code of an error it has already
        freed (InferResponseComplete after AddErrorJson); asked, it answers 400 for
        INTERNAL, NOT_FOUND, UNAVAILABLE, UNSUPPORTED alike."""
        try:
            return 200, encode_generate_response(resp)
        except TriremeError as e:
            return _ITEM_ERROR, error_body(e.message)
        finally:
            self.dp.release(resp)

    async def generate(self, request: Any, model: str, version: str) -> Reply:
        """Every response is awaited (the final flag ends it); exactly one is the answer,
        with the status of the first thing that came (a bare final flag: 200)."""
        stream, item = await self._start(await self._request(request, model, version))
        status, answer, count = 200, b"", 0
        try:
            while item is not None:
                if isinstance(item, TriremeError):
                    count += 1
                    if count == 1:
                        status, answer = _ITEM_ERROR, error_body(item.message)
                    break                          # (a failed stream ends with its error)
                if item.empty:
                    self.dp.release(item)
                else:
                    count += 1
                    if count == 1:
                        status, answer = self._encoded(item)
                    else:
                        self.dp.release(item)
                if item.final:
                    break
                item = await _next(stream)
        finally:
            await _aclose(stream)
        if count != 1:
            answer = error_body(ONE_RESPONSE_TEXT)
        return Reply(status, answer, _JSON)

    async def generate_stream(self, request: Any, model: str, version: str) -> Reply:
        """An SSE body whose status is the first item's."""
        stream, item = await self._start(await self._request(request, model, version))
        if item is None:
            return StreamReply(200, _Events(self, stream, None, done=True), SSE_TYPE)
        if isinstance(item, TriremeError):
            return StreamReply(_ITEM_ERROR, _Events(self, stream, _error_event(item), done=True),
                               SSE_TYPE)
        if item.empty:
            self.dp.release(item)
            return StreamReply(200, _Events(self, stream, None, done=item.final), SSE_TYPE)
        status, body = self._encoded(item)
        return StreamReply(status, _Events(self, stream, sse_event(body), done=item.final),
                           SSE_TYPE)


_ITEM_ERROR = 400


async def _next(stream: AsyncIterator[CoreResponse]) -> Item:
    try:
        return _item(await anext(stream))
    except StopAsyncIteration:
        return None
    except TriremeError as e:
        return e


def _item(resp: CoreResponse) -> Item:
    """A response, or the error of one (a decoupled model's error that is not its last
    ends the generate stream too: an SSE error event is the stream's end)."""
    return resp if resp.error is None else resp.error


async def _aclose(stream: AsyncIterator[CoreResponse]) -> None:
    """Close the data plane's stream now (an async generator: its cleanup, and the cancel
    of a request left mid-stream, would otherwise wait for the garbage collector)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _error_event(e: TriremeError) -> bytes:
    return sse_event(error_body(e.message))


class _Events:
    """The SSE body: its first event, then one per response, an error as an error event
    (a failed stream ends with it), nothing for a bare final flag. ``aclose`` closes the
    data plane's stream, which cancels the request if it has not ended."""

    def __init__(self, gen: Generate, stream: AsyncIterator[CoreResponse], first: bytes | None,
                 done: bool) -> None:
        self._gen, self._stream, self._first, self._done = gen, stream, first, done

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        while not self._done:
            item = await _next(self._stream)
            if item is None:
                break
            if isinstance(item, TriremeError):
                self._done = True
                return _error_event(item)
            self._done = item.final
            if item.empty:
                self._gen.dp.release(item)
                continue
            return sse_event(self._gen._encoded(item)[1])
        self._done = True
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._done, self._first = True, None
        await _aclose(self._stream)
