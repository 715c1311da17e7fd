"""JSON bodies, but for an inference's: any JSON document parsed with Triton's error texts
(rapidjson's wording) at any depth, Triton's nesting limit on a tensor's "data", the error
body {"error": ...}, and the model-repository bodies (index, load, unload).

Pure functions on bytes, as http/codec.py. Behaviour and error texts follow Triton's
src/http_server.cc (HandleRepositoryControl) and src/common.h.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgspec
import numpy as np

from services.common.errors import invalid_arg, unrecognized_load_parameter
from services.frontend.http import json_syntax

__all__ = [
    "MAX_DATA_NESTING",
    "NESTING_TEXT",
    "check_nesting",
    "decode_index_request",
    "decode_json",
    "decode_load_request",
    "decode_unload_request",
    "encode_json",
    "error_body",
    "json_object",
    "size_limit_message",
]

encode_json = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_PARSE_FAILED = "failed to parse the request JSON buffer: "
# Triton's HTTP_MAX_JSON_NESTING_DEPTH (src/common.h): a tensor's JSON "data" nested this
# deep is refused, in these words (ReadDataFromJson prefixes "Unable to parse 'data'" for
# every datatype but BYTES).
MAX_DATA_NESTING = 100
NESTING_TEXT = f"JSON nesting depth exceeds maximum allowed limit ({MAX_DATA_NESTING})"
# A document deeper than msgspec can decode (it recurses, ~1000 levels) is decoded with
# every value below this depth replaced by 0 (_shallow). Nothing valid nests that deep, so
# the answer is the one the same document gets from Triton, whose parser has no depth limit:
# the error of the field that holds the deep value.
_KEPT_DEPTH = 128
_SCAN = 1 << 18             # bytes per step of _shallow's scan (bounded temporaries)


def error_body(message: str) -> bytes:
    """Triton's error body: {"error": "<message>"}."""
    return encode_json({"error": message})


def size_limit_message(kind: str, size: int | None, limit: int) -> str:
    """Text for a body over --http-max-input-size, Triton's EVBufferToJson words ("request
    JSON size of N bytes exceeds the maximum allowed input size of M bytes. Use
    --http-max-input-size to increase the limit."; Triton's QA matches on them). ``kind``
    names the body ("request JSON", "raw request", "decompressed": its own texts);
    ``size`` None: the body was streamed and reading stopped at the limit."""
    got = f"{size}" if size is not None else f"more than {limit}"
    use = "Use --http-max-input-size to increase the limit."
    if kind == "raw request":   # Triton's EVBufferToRawInput
        return (f"Raw input has a byte_size ({got} bytes) that exceeds the maximum allowed "
                f"value of {limit} bytes. {use}")
    if kind == "decompressed":   # a gzip/deflate body: Triton's DataCompressor
        return f"Decompressed data size exceeds the maximum allowed value of {limit} bytes. {use}"
    return f"{kind} size of {got} bytes exceeds the maximum allowed input size of {limit} bytes. {use}"


# ---- JSON ------------------------------------------------------------------------------

def decode_json(buf: Any) -> Any:
    """Parse a JSON document as Triton's parser (rapidjson) reads it: NaN, Inf and Infinity
    are numbers, a NUL byte ends the document. Its errors are rapidjson's, in its words and
    at its offsets (json_syntax.py): "failed to parse the request JSON buffer: <reason> at
    <offset>". Any depth: a document nested deeper than msgspec's recursion allows is read
    with its deep values cut off (_shallow), never a RecursionError (which would be a 500)."""
    try:
        return _decode(buf)
    except (msgspec.DecodeError, ValueError):
        return _decode_refused(bytes(buf))
    except RecursionError:
        pass
    try:
        return _decode(_shallow(buf))
    except (msgspec.DecodeError, ValueError):
        return _decode_refused(bytes(buf))
    except RecursionError:   # only if the stack was nearly spent already
        raise invalid_arg(f"{_PARSE_FAILED}the document is nested too deeply") from None


def _decode_refused(data: bytes) -> Any:
    """A body msgspec refused: rapidjson's error, or the document rapidjson reads where
    msgspec does not (NaN and the infinities, bytes after a NUL)."""
    spellings: list[tuple[int, int, bytes]] = []
    reason, end = json_syntax.scan(data, spellings)
    if reason is not None:
        raise invalid_arg(f"{_PARSE_FAILED}{reason} at {end}")
    data = data[:end]
    try:
        data.decode()
    except UnicodeDecodeError as e:
        # Differs from Triton, which takes a string's bytes as they are: text is UTF-8.
        raise invalid_arg(f"{_PARSE_FAILED}Invalid encoding in string. at {e.start}") from None
    if spellings:   # rapidjson's -NaN, Inf and -Inf: Python's json reads NaN and Infinity
        parts: list[bytes] = []
        at = 0
        for start, stop, spelling in spellings:
            parts += (data[at:start], spelling)
            at = stop
        data = b"".join([*parts, data[at:]])
    try:
        return _decode(data)        # (a NUL ended the document: msgspec reads the rest)
    except (msgspec.DecodeError, ValueError, RecursionError):
        pass
    try:
        return json.loads(data)     # NaN, Infinity, -Infinity
    except RecursionError:
        return json.loads(_shallow(data))


def _shallow(buf: Any) -> bytes:
    """``buf`` with each array or object that starts deeper than _KEPT_DEPTH levels replaced
    by ``0``. One vectorised scan, a slice at a time: string contents (escapes included) do
    not count as brackets. The result nests at most _KEPT_DEPTH + 1 levels."""
    data = np.frombuffer(buf, np.uint8)
    parts: list[bytes] = []
    depth = 0               # nesting before the slice
    in_string = 0           # 1: the slice starts inside a string
    backslashes = 0         # backslashes that end the previous slice
    deep_before = False     # the previous slice ends inside a replaced value
    for start in range(0, data.size, _SCAN):
        c = data[start:start + _SCAN]
        opens = (c == 91) | (c == 123)
        closes = (c == 93) | (c == 125)
        quote = c == 34
        if in_string or quote.any():
            slash = c == 92
            if backslashes or slash.any():   # a quote after an odd run of them is escaped
                index = np.arange(c.size, dtype=np.int32)
                last_other = np.maximum.accumulate(
                    np.where(slash, np.int32(-1 - backslashes), index))
                run = index[1:] - 1 - last_other[:-1]
                quote[0] &= backslashes % 2 == 0
                quote[1:] &= run % 2 == 0
                backslashes = int(c.size - 1 - last_other[-1]) if slash[-1] else 0
            before = np.cumsum(quote, dtype=np.int32)
            before -= quote
            before += in_string
            outside = (before & 1) == 0
            opens &= outside
            closes &= outside
            in_string = int(before[-1] + quote[-1]) & 1
        else:
            backslashes = 0                      # (outside strings they mean nothing)
        step = opens.view(np.int8) - closes.view(np.int8)
        after = np.cumsum(step, dtype=np.int32)
        after += depth
        deep = after > _KEPT_DEPTH
        deep |= (after - step) > _KEPT_DEPTH
        first = deep.copy()
        first[1:] &= ~deep[:-1]
        first[0] &= not deep_before
        kept = c.copy()
        kept[first] = 48                         # "0" for the whole deep value
        parts.append(kept[~deep | first].tobytes())
        depth = int(after[-1])
        deep_before = bool(deep[-1])
    return b"".join(parts)


def json_object(doc: Any, what: str) -> dict:
    if type(doc) is not dict:
        raise invalid_arg(f"Unable to parse '{what}': expected a JSON object")
    return doc


def check_nesting(data: list, datatype: str) -> None:
    """Triton's depth limit on a tensor's "data": a value (array or not) at depth
    MAX_DATA_NESTING, the data array itself at depth 0, is refused. Level by level, each
    level's lists found at C speed: a flat list costs one pass of ``map(type, ...)``."""
    level = [data]
    for _ in range(MAX_DATA_NESTING - 1):
        deeper = [x for lst in level if list in map(type, lst) for x in lst if type(x) is list]
        if not deeper:
            return
        level = deeper
    if any(level):                 # a non-empty list at depth 99: a value at depth 100
        raise invalid_arg(NESTING_TEXT if datatype == "BYTES"
                          else f"Unable to parse 'data': {NESTING_TEXT}")


# ---- model repository requests ----------------------------------------------------------

def decode_index_request(body: Any) -> bool:
    """Repository index body {"ready": bool} (optional) -> ready_only."""
    if not body:
        return False
    ready = json_object(decode_json(body), "ready").get("ready", False)
    if type(ready) is not bool:
        raise invalid_arg("Invalid value for 'ready': expected a boolean")  # Triton's
    return ready


def decode_load_request(body: Any) -> dict[str, Any]:
    """Load body {"parameters": {"config": str, "file:<v>/<name>": base64 str}} -> the
    data plane's parameters, file contents decoded to bytes."""
    if not body:
        return {}
    params = json_object(decode_json(body), "parameters").get("parameters", {})
    params = json_object(params, "parameters")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if type(value) is not str:
            raise invalid_arg(f"Unable to parse parameter '{key}': expected a string")
        if key == "config":
            out[key] = value
        elif key.startswith("file:"):
            try:
                out[key] = base64.b64decode(value)
            except (binascii.Error, ValueError):
                raise invalid_arg(f"Unable to parse parameter '{key}': invalid base64 "
                                  f"content") from None
        else:  # Triton answers 500 "unexpected error on creating Triton parameter"
            raise unrecognized_load_parameter(key)  # as our gRPC
    return out


def decode_unload_request(body: Any) -> dict[str, Any]:
    """Unload body {"parameters": {"unload_dependents": bool}} (optional)."""
    unload_dependents = False
    if body:
        params = json_object(decode_json(body), "parameters").get("parameters", {})
        value = json_object(params, "parameters").get("unload_dependents", False)
        if type(value) is not bool:
            raise invalid_arg("Unable to parse 'unload_dependents': expected a boolean")
        unload_dependents = value
    return {"unload_dependents": unload_dependents}
