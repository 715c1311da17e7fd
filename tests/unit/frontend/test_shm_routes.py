"""HTTP: Triton's shared-memory extensions (/v2/systemsharedmemory, /v2/cudasharedmemory)
over a fake data plane (no scheduler).

The handlers are driven through routes.Handlers.dispatch with a small request object, then
over both real servers (native, aiohttp) with the official tritonclient and a plain HTTP
client. Texts and codes are Triton's (src/http_server.cc HandleSystemSharedMemory,
HandleCudaSharedMemory; TritonJson's texts, INTERNAL there).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import threading
from typing import Any

import pytest

from services.common.errors import Code, TriremeError
from services.dataplane.types import CoreRequest, CoreResponse, OutputTensor, RequestedOutput
from services.frontend.http import codec
from services.frontend.http.message import BodyTooLarge, Headers
from services.frontend.http.routes import Handlers, start_http
from services.frontend.restricted import Restrictions
from services.frontend.settings import FrontendSettings

DISABLED = ("Client shared memory is disabled. Start the server with "
            "'--allow-client-shm=true' to enable.")
HANDLE = bytes(range(64))                       # a cudaIpcMemHandle_t's 64 bytes
HANDLE_B64 = base64.b64encode(HANDLE).decode()


class ShmDataPlane:
    """The three shm methods over an in-memory registry, with the manager's texts; every
    call is recorded in ``calls``."""

    def __init__(self, allowed: bool = True) -> None:
        self.allowed = allowed
        self.regions: dict[str, dict] = {}      # name -> status dict (with "kind")
        self.calls: list[tuple] = []

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    async def shm_status(self, kind: str, name: str = "") -> list[dict]:
        self.calls.append(("status", kind, name))
        if name and (name not in self.regions or self.regions[name]["kind"] != kind):
            raise TriremeError(Code.NOT_FOUND, f"Unable to find {kind} shared memory region: "
                                               f"'{name}'")
        return [{k: v for k, v in r.items() if k != "kind"} for n, r in self.regions.items()
                if r["kind"] == kind and (not name or n == name)]

    async def shm_register(self, kind: str, name: str, key: str = "", offset: int = 0,
                           byte_size: int = 0, device_id: int = 0,
                           raw_handle: bytes = b"") -> None:
        self.calls.append(("register", kind, name, key, offset, byte_size, device_id,
                           raw_handle))
        if not self.allowed:
            raise TriremeError(Code.UNSUPPORTED, DISABLED)
        if not name:
            raise TriremeError(Code.INVALID_ARG, f"'region name' is necessary to register "
                                                 f"{kind} shared memory region")
        if name in self.regions:
            raise TriremeError(Code.ALREADY_EXISTS,
                               f"shared memory region '{name}' already in manager")
        if kind == "system":
            self.regions[name] = {"kind": kind, "byte_size": byte_size, "offset": offset,
                                  "key": key, "name": name}      # any order: Triton's is sent
        else:
            self.regions[name] = {"kind": kind, "byte_size": byte_size,
                                  "device_id": device_id, "name": name}

    async def shm_unregister(self, kind: str, name: str = "") -> None:
        self.calls.append(("unregister", kind, name))
        if not self.allowed:
            raise TriremeError(Code.UNSUPPORTED, DISABLED)
        for n in [n for n, r in self.regions.items()
                  if r["kind"] == kind and (not name or n == name)]:
            del self.regions[n]


class Request:
    """The handlers' request shape; ``read()`` records that the body was read and raises
    ``too_large`` when set (what the servers raise for a body over the limit)."""

    def __init__(self, method: str, path: str, body: bytes = b"",
                 too_large: BodyTooLarge | None = None, headers: dict | None = None) -> None:
        self.method, self.path, self.query = method, path, ""
        self.headers = Headers({k.lower(): v for k, v in (headers or {}).items()})
        self.body, self.too_large, self.read_called = body, too_large, False

    async def read(self) -> bytes:
        self.read_called = True
        if self.too_large is not None:
            raise self.too_large
        return self.body


def handlers(dp: ShmDataPlane, **settings: Any) -> Handlers:
    return Handlers(dp, FrontendSettings(scheduler_addr="", **settings))


def ask(h: Handlers, method: str, path: str, body: Any = b"", **kw: Any):
    """-> (status, body bytes, content type)."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    reply = asyncio.run(h.dispatch(Request(method, path, body, **kw)))
    return reply.status, bytes(reply.body), reply.content_type


def error(status: int, text: str):
    return status, json.dumps({"error": text}, separators=(",", ":")).encode(), "application/json"


OK = (200, b"", "application/json")
SYS = "/v2/systemsharedmemory"
CUDA = "/v2/cudasharedmemory"


# ---- system shared memory --------------------------------------------------------------------

def test_system_register_status_unregister():
    dp = ShmDataPlane()
    h = handlers(dp)
    assert ask(h, "GET", f"{SYS}/status") == (200, b"[]", "application/json")
    assert ask(h, "POST", f"{SYS}/region/r0/register",
               {"key": "/k0", "offset": 4096, "byte_size": 64}) == OK
    assert ask(h, "POST", f"{SYS}/region/r1/register", {"key": "/k1", "byte_size": 8}) == OK
    assert dp.calls[1:] == [("register", "system", "r0", "/k0", 4096, 64, 0, b""),
                            ("register", "system", "r1", "/k1", 0, 8, 0, b"")]  # offset: 0
    # Triton's GetStatus: compact, members in its order
    assert ask(h, "GET", f"{SYS}/status") == (
        200, b'[{"name":"r0","key":"/k0","offset":4096,"byte_size":64},'
             b'{"name":"r1","key":"/k1","offset":0,"byte_size":8}]', "application/json")
    assert ask(h, "GET", f"{SYS}/region/r1/status") == (
        200, b'[{"name":"r1","key":"/k1","offset":0,"byte_size":8}]', "application/json")
    assert ask(h, "GET", f"{SYS}/region/nope/status") == error(
        404, "Unable to find system shared memory region: 'nope'")
    assert ask(h, "POST", f"{SYS}/region/r0/register", {"key": "/k0", "byte_size": 64}) == \
        error(400, "shared memory region 'r0' already in manager")
    assert ask(h, "POST", f"{SYS}/region/r0/unregister") == OK
    assert dp.calls[-1] == ("unregister", "system", "r0")
    assert ask(h, "POST", f"{SYS}/unregister") == OK                   # all of them
    assert dp.calls[-1] == ("unregister", "system", "")
    assert ask(h, "GET", f"{SYS}/status")[1] == b"[]"


def test_the_key_is_cut_at_a_nul_as_triton_reads_it():
    dp = ShmDataPlane()
    assert ask(handlers(dp), "POST", f"{SYS}/region/r/register",
               {"key": "/k\u0000tail", "byte_size": 8}) == OK
    assert dp.calls[0][3] == "/k"


@pytest.mark.parametrize("body, status, text", [
    # HandleSystemSharedMemory's own checks (INVALID_ARG)
    ({}, 400, "Shared memory register request has no 'key' field"),
    ([], 400, "Shared memory register request has no 'key' field"),
    ("key", 400, "Shared memory register request has no 'key' field"),
    ({"key": "/k"}, 400, "Shared memory register request has no 'byte_size' field"),
    ({"key": "/k", "offset": 0}, 400, "Shared memory register request has no 'byte_size' field"),
    # TritonJson's (INTERNAL), in Triton's order: key, offset, byte_size
    ({"key": 1}, 400, "attempt to access JSON non-string as string"),
    ({"key": None, "byte_size": 8}, 400, "attempt to access JSON non-string as string"),
    ({"key": "/k", "offset": -1}, 400,
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"key": "/k", "offset": 1.0, "byte_size": 8}, 400,
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"key": "/k", "byte_size": "8"}, 400,
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"key": "/k", "byte_size": True}, 400,
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"key": "/k", "byte_size": 2**64}, 400,
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    # the body is parsed even when empty (EVRequestToJsonAllowsEmpty); TritonJson: INTERNAL
    (b"", 400, "failed to parse the request JSON buffer: The document is empty. at 0"),
    (b"{", 400, "failed to parse the request JSON buffer: Missing a name for object member. at 1"),
])
def test_system_register_body_errors(body, status, text):
    dp = ShmDataPlane()
    assert ask(handlers(dp), "POST", f"{SYS}/region/r/register", body) == error(status, text)
    assert dp.calls == []                       # refused before the registry is asked


def test_system_register_takes_the_largest_uint64():
    dp = ShmDataPlane()
    assert ask(handlers(dp), "POST", f"{SYS}/region/r/register",
               {"key": "/k", "offset": 2**64 - 1, "byte_size": 0}) == OK
    assert dp.calls[0][4:6] == (2**64 - 1, 0)


# ---- CUDA shared memory ----------------------------------------------------------------------

def cuda_body(b64: Any = HANDLE_B64, **kw: Any) -> dict:
    return {"raw_handle": {"b64": b64}, "device_id": 0, "byte_size": 64, **kw}


def test_cuda_register_status_unregister():
    dp = ShmDataPlane()
    h = handlers(dp)
    assert ask(h, "POST", f"{CUDA}/region/g0/register", cuda_body(device_id=1)) == OK
    assert dp.calls == [("register", "cuda", "g0", "", 0, 64, 1, HANDLE)]
    assert ask(h, "GET", f"{CUDA}/status") == (
        200, b'[{"name":"g0","device_id":1,"byte_size":64}]', "application/json")
    assert ask(h, "GET", f"{CUDA}/region/g0/status")[1] == \
        b'[{"name":"g0","device_id":1,"byte_size":64}]'
    assert ask(h, "GET", f"{SYS}/status")[1] == b"[]"                  # kinds apart
    assert ask(h, "GET", f"{CUDA}/region/x/status") == error(
        404, "Unable to find cuda shared memory region: 'x'")
    assert ask(h, "POST", f"{CUDA}/region/g0/unregister") == OK
    assert ask(h, "POST", f"{CUDA}/unregister") == OK
    assert dp.calls[-2:] == [("unregister", "cuda", "g0"), ("unregister", "cuda", "")]


@pytest.mark.parametrize("b64", [
    HANDLE_B64.rstrip("="),                                   # padding is not needed
    HANDLE_B64[:40] + "\n" + HANDLE_B64[40:],                 # nor is the alphabet alone
    " " + HANDLE_B64.replace("A", "A=") + "*",                # libb64 skips what is not
])
def test_cuda_handle_is_decoded_as_libb64_does(b64):
    dp = ShmDataPlane()
    assert ask(handlers(dp), "POST", f"{CUDA}/region/g/register", cuda_body(b64)) == OK
    assert dp.calls[0][7] == HANDLE


BAD_HANDLE = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"
NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"


@pytest.mark.parametrize("body, status, text", [
    ({}, 400, "Shared memory register request has no 'raw_handle' field"),
    ({"byte_size": "x"}, 400, "Shared memory register request has no 'raw_handle' field"),
    ([1], 400, "Shared memory register request has no 'raw_handle' field"),
    ({"raw_handle": HANDLE_B64}, 400, "attempt to access non-existing object member 'b64'"),
    ({"raw_handle": {}}, 400, "attempt to access non-existing object member 'b64'"),
    ({"raw_handle": {"b64": 5}}, 400, "attempt to access JSON non-string as string"),
    # then byte_size, then device_id (MemberAsUInt: both required)
    ({"raw_handle": {"b64": "x"}}, 400, "attempt to access non-existing object member "
                                        "'byte_size'"),
    ({"raw_handle": {"b64": "x"}, "byte_size": 64}, 400,
     "attempt to access non-existing object member 'device_id'"),
    (cuda_body(byte_size=-1), 400, NOT_UINT),
    (cuda_body(device_id=-1), 400, NOT_UINT),
    (cuda_body(device_id=0.0), 400, NOT_UINT),
    # the handle is decoded last: 64 bytes or Triton's INVALID_ARG
    (cuda_body(base64.b64encode(b"A" * 48).decode()), 400, BAD_HANDLE),   # QA's small one
    (cuda_body(base64.b64encode(HANDLE + b"x").decode()), 400, BAD_HANDLE),
    (cuda_body("!!not base64!!"), 400, BAD_HANDLE),
    (cuda_body(HANDLE_B64[:85]), 400, BAD_HANDLE),            # 4k+1 chars: 63 bytes, no error
    (cuda_body(""), 400, BAD_HANDLE),
    (b"", 400, "failed to parse the request JSON buffer: The document is empty. at 0"),
])
def test_cuda_register_body_errors(body, status, text):
    dp = ShmDataPlane()
    assert ask(handlers(dp), "POST", f"{CUDA}/region/g/register", body) == error(status, text)
    assert dp.calls == []


# ---- what every endpoint shares ----------------------------------------------------------------

@pytest.mark.parametrize("base", [SYS, CUDA])
def test_register_without_a_region_name_asks_the_registry_without_reading_the_body(base):
    """Triton: the allow check, then "'region name' is necessary ...", the body unread.
    Both are the registry's: the frontend passes the empty name on."""
    kind = "system" if base == SYS else "cuda"
    for dp, answer in [(ShmDataPlane(), error(400, f"'region name' is necessary to register "
                                                    f"{kind} shared memory region")),
                       (ShmDataPlane(allowed=False), error(501, DISABLED))]:
        request = Request("POST", f"{base}/register", b"not json")
        reply = asyncio.run(handlers(dp).dispatch(request))
        assert (reply.status, reply.body, reply.content_type) == answer
        assert not request.read_called
        assert dp.calls == [("register", kind, "", "", 0, 0, 0, b"")]


@pytest.mark.parametrize("base", [SYS, CUDA])
def test_disabled_server_refuses_changes_but_lists(base):
    """Triton's L0_shared_memory test_client_shm_disabled_by_default."""
    dp = ShmDataPlane(allowed=False)
    h = handlers(dp)
    body = {"key": "/k", "byte_size": 8} if base == SYS else cuda_body()
    assert ask(h, "GET", f"{base}/status") == (200, b"[]", "application/json")
    assert ask(h, "POST", f"{base}/region/r/register", body) == error(501, DISABLED)
    assert ask(h, "POST", f"{base}/region/r/unregister") == error(501, DISABLED)
    assert ask(h, "POST", f"{base}/unregister") == error(501, DISABLED)


@pytest.mark.parametrize("base", [SYS, CUDA])
@pytest.mark.parametrize("method, path", [
    ("POST", "/status"), ("PUT", "/region/r/status"), ("DELETE", "/status"),
    ("GET", "/region/r/register"), ("GET", "/register"), ("PUT", "/region/r/register"),
    ("GET", "/unregister"), ("GET", "/region/r/unregister"),
])
def test_wrong_method_is_405(base, method, path):
    dp = ShmDataPlane()
    assert ask(handlers(dp), method, base + path, b"{}") == error(405, "Method Not Allowed")
    assert dp.calls == []


@pytest.mark.parametrize("path", [
    f"{SYS}", f"{SYS}/", f"{SYS}/region/r", f"{SYS}/region//status", f"{SYS}/region/a/b/status",
    f"{SYS}/status/x", f"{SYS}/region/r/load", f"{CUDA}/stats", "/v2/sharedmemory/status",
    f"{CUDA}/region/r/status/",
])
def test_other_paths_are_404(path):
    dp = ShmDataPlane()
    assert ask(handlers(dp), "GET", path) == error(404, "Not Found")
    assert ask(handlers(dp), "POST", path) == error(404, "Not Found")
    assert dp.calls == []


def test_region_names_are_whatever_the_path_holds():
    dp = ShmDataPlane()
    h = handlers(dp)
    assert ask(h, "POST", f"{SYS}/region/status/register", {"key": "/k", "byte_size": 1}) == OK
    assert ask(h, "GET", f"{SYS}/region/status/status")[0] == 200
    assert ask(h, "POST", f"{SYS}/region/a b%é/unregister") == OK
    assert dp.calls[1:] == [("status", "system", "status"), ("unregister", "system", "a b%é")]


@pytest.mark.parametrize("size, got", [(5000, "5000"), (None, "more than 4096")])
def test_register_body_over_the_limit(size, got):
    """EVBufferToJson's text (Triton's QA test_exceeds_cshm_handle_size_limit)."""
    dp = ShmDataPlane()
    h = handlers(dp, http_max_input_size=4096)
    text = (f"request JSON size of {got} bytes exceeds the maximum allowed input size of "
            f"4096 bytes. Use --http-max-input-size to increase the limit.")
    for base in (SYS, CUDA):
        assert ask(h, "POST", f"{base}/region/r/register",
                   too_large=BodyTooLarge(size)) == error(400, text)
    assert dp.calls == []


def test_restricted_shared_memory_is_refused_first():
    settings = {"restricted": Restrictions.parse(["shared-memory:k=v"], [])}
    dp = ShmDataPlane()
    h = handlers(dp, **settings)
    refusal = error(403, "This API is restricted, expecting header 'k'")
    assert ask(h, "GET", f"{SYS}/status") == refusal
    assert ask(h, "POST", f"{CUDA}/status") == refusal                # before the 405
    request = Request("POST", f"{SYS}/region/r/register", b"{}")
    assert asyncio.run(h.dispatch(request)).status == 403 and not request.read_called
    assert ask(h, "GET", f"{SYS}/status", headers={"k": "v"})[0] == 200
    assert dp.calls == [("status", "system", "")]


def test_server_metadata_lists_both_extensions_in_tritons_order():
    status, body, _ = ask(handlers(ShmDataPlane()), "GET", "/v2")
    ext = json.loads(body)["extensions"]
    assert status == 200
    assert ext[ext.index("model_configuration"):ext.index("binary_tensor_data") + 1] == [
        "model_configuration", "system_shared_memory", "cuda_shared_memory",
        "binary_tensor_data"]


def test_output_in_shared_memory_is_written_without_data():
    """Triton's http_server.cc: an output the client put in shared memory is listed by
    name, datatype and shape only; no binary part, no header length when it is alone."""
    resp = CoreResponse("m", "1", outputs=[
        OutputTensor("S", "FP32", [2, 2], b""),
        OutputTensor("J", "INT32", [1], b"\x07\0\0\0")])
    req = CoreRequest("m", outputs=[
        RequestedOutput("S", {"shared_memory_region": "o", "shared_memory_byte_size": 16}),
        RequestedOutput("J", {})])
    body, header_length = codec.encode_infer_response(resp, req, True)
    assert header_length is None
    assert json.loads(body)["outputs"] == [
        {"name": "S", "datatype": "FP32", "shape": [2, 2]},
        {"name": "J", "datatype": "INT32", "shape": [1], "data": [7]}]


# ---- over the real servers -------------------------------------------------------------------

@contextlib.contextmanager
def serving(impl: str, dp: ShmDataPlane):
    """start_http on a free port, its loop in a thread, so that blocking clients can call
    it from this one."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    settings = FrontendSettings(scheduler_addr="", host="127.0.0.1", http_port=0,
                                http_impl=impl)
    server = asyncio.run_coroutine_threadsafe(start_http(dp, settings), loop).result(20)
    try:
        yield server.port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1.0), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(20)
        loop.close()


@pytest.mark.parametrize("impl", ["native", "aiohttp"])
def test_tritonclient_round_trip(impl):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    dp = ShmDataPlane()
    with serving(impl, dp) as port:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert c.get_system_shared_memory_status() == []
            c.register_system_shared_memory("in put", "/key0", 64, offset=4096)
            assert c.get_system_shared_memory_status("in put") == [
                {"name": "in put", "key": "/key0", "offset": 4096, "byte_size": 64}]
            with pytest.raises(InferenceServerException) as info:
                c.register_system_shared_memory("in put", "/key0", 64)
            assert "shared memory region 'in put' already in manager" in str(info.value)
            c.register_cuda_shared_memory("g", HANDLE_B64, 2, 128)
            assert c.get_cuda_shared_memory_status() == [
                {"name": "g", "device_id": 2, "byte_size": 128}]
            assert dp.calls[-2] == ("register", "cuda", "g", "", 0, 128, 2, HANDLE)
            with pytest.raises(InferenceServerException) as info:
                c.get_cuda_shared_memory_status("in put")
            assert "Unable to find cuda shared memory region: 'in put'" in str(info.value)
            c.unregister_system_shared_memory("in put")
            c.unregister_cuda_shared_memory()
            assert c.get_system_shared_memory_status() == []
            assert c.get_cuda_shared_memory_status() == []
            assert "cuda_shared_memory" in c.get_server_metadata()["extensions"]
        finally:
            c.close()


@pytest.mark.parametrize("impl", ["native", "aiohttp"])
def test_answers_on_the_wire(impl):
    """Status, type and length as Triton sends them: 200 with an empty JSON body on
    register, the array on status, the JSON error otherwise."""
    dp = ShmDataPlane()
    with serving(impl, dp) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)

        def call(method: str, path: str, body: bytes | None = None):
            conn.request(method, path, body)
            r = conn.getresponse()
            return r.status, r.getheader("Content-Type"), r.getheader("Content-Length"), r.read()

        try:
            assert call("POST", f"{SYS}/region/r/register", b'{"key":"/k","byte_size":8}') == (
                200, "application/json", "0", b"")
            listed = b'[{"name":"r","key":"/k","offset":0,"byte_size":8}]'
            assert call("GET", f"{SYS}/status") == (
                200, "application/json", str(len(listed)), listed)
            refused = b'{"error":"Shared memory register request has no \'key\' field"}'
            assert call("POST", f"{SYS}/region/r/register", b"{}") == (
                400, "application/json", str(len(refused)), refused)
            assert call("GET", f"{CUDA}/unregister")[:2] == (405, "application/json")
            assert call("POST", f"{CUDA}/unregister") == (200, "application/json", "0", b"")
        finally:
            conn.close()
