"""Triton's shared-memory extensions over HTTP: /v2/systemsharedmemory/... and
/v2/cudasharedmemory/... (status, register, unregister).

The registry is the scheduler's (``dp.shm_status`` / ``shm_register`` / ``shm_unregister``,
which carry the manager's checks and texts, "--allow-client-shm" included). This module does
what Triton's HTTP layer does before it calls its manager: the method check, the register
body, and the status array as Triton writes it. Sources (triton-inference-server/server,
src/http_server.cc): HandleSystemSharedMemory, HandleCudaSharedMemory, EVBufferToJson;
src/common.cc DecodeBase64 (libb64); src/shared_memory_manager.cc GetStatus (the fields);
TritonJson's texts (common, triton_json.h), whose errors are INTERNAL (500) in
http_server.cc: a malformed body is the client's mistake, so they are 400 here
(docs/compat.md).

Errors are raised as TriremeError and mapped to a status by routes.py's one table.

Differs from Triton: its allow check comes before the body is read, ours is the
scheduler's, after the body is checked: on a server started without --allow-client-shm a
malformed register body is answered with the body's error, not the refusal (a register
without a region name still gets the refusal first: no body is read for it). A JSON
object with a repeated member is read with its last value (Triton: its first).
"""
from __future__ import annotations

import base64
import re
from typing import Any

from services.common.errors import (
    JSON_NOT_STRING,
    JSON_NOT_UINT,
    TriremeError,
    invalid_arg,
    json_no_member_text,
)
from services.dataplane.api import DataPlaneAPI
from services.frontend.http import json_body
from services.frontend.http.message import BodyTooLarge, Reply

__all__ = ["SHM_PREFIXES", "SHM_RE", "SharedMemoryRoutes", "decode_cuda_register",
           "decode_system_register", "encode_status"]

# Triton's systemsharedmemory_regex_ and cudasharedmemory_regex_ (FullMatch), as one.
SHM_RE = re.compile(r"/v2/(system|cuda)sharedmemory(?:/region/([^/]+))?/"
                    r"(status|register|unregister)")
SHM_PREFIXES = ("/v2/systemsharedmemory", "/v2/cudasharedmemory")

_JSON = "application/json"
_NOT_ALLOWED = Reply(405, json_body.error_body("Method Not Allowed"), _JSON)
_OK = Reply(200, b"", _JSON)            # Triton sets the JSON type on every answer

# HandleSystemSharedMemory / HandleCudaSharedMemory (INVALID_ARG)
NO_KEY_TEXT = "Shared memory register request has no 'key' field"
NO_BYTE_SIZE_TEXT = "Shared memory register request has no 'byte_size' field"
NO_RAW_HANDLE_TEXT = "Shared memory register request has no 'raw_handle' field"
BAD_HANDLE_TEXT = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"
# TritonJson (INTERNAL in Triton, 400 here): services/common/errors.py
_NOT_STRING, _NOT_UINT = JSON_NOT_STRING, JSON_NOT_UINT

CUDA_IPC_HANDLE_SIZE = 64               # sizeof(cudaIpcMemHandle_t)
_INT_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_NOT_BASE64 = re.compile(rb"[^A-Za-z0-9+/]")


def size_limit_text(size: int | None, limit: int) -> str:
    """EVBufferToJson's text for a body over --http-max-input-size (Triton's QA checks it)."""
    return json_body.size_limit_message("request JSON", size, limit)


# ---- register bodies -----------------------------------------------------------------------

def _parse(body: Any) -> Any:
    """The body as JSON, an empty one included (EVRequestToJsonAllowsEmpty); rapidjson's
    words (INTERNAL in Triton; 400 here)."""
    try:
        return json_body.decode_json(body)
    except TriremeError as e:
        raise invalid_arg(e.message) from None


def _uint(value: Any) -> int:
    """TritonJson's AsUInt: a JSON integer in uint64 (a number written with a fraction or
    an exponent, or a bool, is not one)."""
    if type(value) is not int or not 0 <= value <= _UINT64_MAX:
        raise invalid_arg(_NOT_UINT)
    return value


def _c_string(value: str) -> str:
    """A TritonJson string Triton hands on as a ``const char*``: cut at its first NUL."""
    return value.partition("\0")[0]


def decode_system_register(body: Any) -> tuple[str, int, int]:
    """{"key": str, "offset": uint (optional, 0), "byte_size": uint} -> (key, offset,
    byte_size), checked in Triton's order."""
    doc = _parse(body)
    if type(doc) is not dict or "key" not in doc:
        raise invalid_arg(NO_KEY_TEXT)
    key = doc["key"]
    if type(key) is not str:
        raise invalid_arg(_NOT_STRING)
    offset = _uint(doc["offset"]) if "offset" in doc else 0
    if "byte_size" not in doc:
        raise invalid_arg(NO_BYTE_SIZE_TEXT)
    return _c_string(key), offset, _uint(doc["byte_size"])


def _member_uint(doc: dict, name: str) -> int:
    """TritonJson's MemberAsUInt."""
    if name not in doc:
        raise invalid_arg(json_no_member_text(name))
    return _uint(doc[name])


def _libb64_decode(text: bytes) -> bytes:
    """Triton's DecodeBase64 (libb64's base64_decode_block): every byte outside the base64
    alphabet ('=' included) is skipped, a lone trailing character is dropped; never an
    error."""
    chars = _NOT_BASE64.sub(b"", text)
    if len(chars) % 4 == 1:
        chars = chars[:-1]
    return base64.b64decode(chars + b"=" * (-len(chars) % 4))


def decode_cuda_register(body: Any) -> tuple[bytes, int, int]:
    """{"raw_handle": {"b64": str}, "device_id": uint, "byte_size": uint} -> (raw_handle,
    device_id, byte_size), checked in Triton's order; the handle must decode to the 64
    bytes of a cudaIpcMemHandle_t."""
    doc = _parse(body)
    if type(doc) is not dict or "raw_handle" not in doc:
        raise invalid_arg(NO_RAW_HANDLE_TEXT)
    raw = doc["raw_handle"]
    if type(raw) is not dict or "b64" not in raw:
        raise invalid_arg(json_no_member_text("b64"))
    b64 = raw["b64"]
    if type(b64) is not str:
        raise invalid_arg(_NOT_STRING)
    byte_size = _member_uint(doc, "byte_size")
    device_id = _member_uint(doc, "device_id")
    encoded = b64.encode("utf-8", "surrogatepass")
    if len(encoded) > _INT_MAX:
        raise invalid_arg("'raw_handle' exceeds the maximum allowed data size limit INT_MAX")
    handle = _libb64_decode(encoded)
    if len(handle) != CUDA_IPC_HANDLE_SIZE:
        raise invalid_arg(BAD_HANDLE_TEXT)
    return handle, device_id, byte_size


# ---- status --------------------------------------------------------------------------------

def encode_status(kind: str, regions: list[dict]) -> bytes:
    """The JSON array GetStatus writes: system {"name", "key", "offset", "byte_size"},
    cuda {"name", "device_id", "byte_size"}, in that member order."""
    if kind == "system":
        doc = [{"name": r["name"], "key": r["key"], "offset": int(r["offset"]),
                "byte_size": int(r["byte_size"])} for r in regions]
    else:
        doc = [{"name": r["name"], "device_id": int(r["device_id"]),
                "byte_size": int(r["byte_size"])} for r in regions]
    return json_body.encode_json(doc)


# ---- the handler ---------------------------------------------------------------------------

class SharedMemoryRoutes:
    """Both extensions' endpoints over the data plane ``dp``; ``limit``: the largest body
    read (--http-max-input-size)."""

    def __init__(self, dp: DataPlaneAPI, limit: int) -> None:
        self.dp = dp
        self.limit = limit

    async def handle(self, request: Any, kind: str, region: str | None, action: str) -> Reply:
        """One request whose path matched SHM_RE: ``kind`` "system" or "cuda", ``region``
        the region name (None: none in the path), ``action`` status|register|unregister."""
        name = region or ""
        if action == "status":
            if request.method != "GET":
                return _NOT_ALLOWED
            regions = await self.dp.shm_status(kind, name)
            return Reply(200, encode_status(kind, regions), _JSON)
        if request.method != "POST":
            return _NOT_ALLOWED
        if action == "unregister":
            await self.dp.shm_unregister(kind, name)
        elif not name:
            # Triton answers "--allow-client-shm" first, then "'region name' is necessary
            # ...", without reading the body: the registry does both, in that order.
            await self.dp.shm_register(kind, "")
        elif kind == "system":
            key, offset, byte_size = decode_system_register(await self._read(request))
            await self.dp.shm_register(kind, name, key=key, offset=offset,
                                       byte_size=byte_size)
        else:
            handle, device_id, byte_size = decode_cuda_register(await self._read(request))
            await self.dp.shm_register(kind, name, byte_size=byte_size, device_id=device_id,
                                       raw_handle=handle)
        return _OK

    async def _read(self, request: Any) -> Any:
        try:
            return await request.read()
        except BodyTooLarge as e:
            raise invalid_arg(size_limit_text(e.size, self.limit)) from None
