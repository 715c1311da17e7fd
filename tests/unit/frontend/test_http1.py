"""The native HTTP/1.1 server (http1 over http_message) at the byte level, next to aiohttp's.

A raw-socket client written here does what tritonclient never does: pipelining, chunked and
trickled bodies, Expect, HTTP/1.0, malformed requests, clients that vanish mid-body. Each
test starts start_http on a free port over a fake data plane (no scheduler, no workers);
where both servers should agree it runs against both (--http-impl native | aiohttp).
What only the native server does: tests/unit/frontend/test_http1_native.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket

import numpy as np
import psutil
import pytest

from services.dataplane.types import CoreResponse, OutputTensor
from services.frontend.http.routes import start_http
from services.frontend.settings import FrontendSettings

IMPLS = ["native", "aiohttp"]
LIMIT = 4096
SIZE_TEXT = ("request JSON size of {} bytes exceeds the maximum allowed input size of 4096 bytes. "
             "Use --http-max-input-size to increase the limit.")


class FakeDataPlane:
    """Echoes INPUT0 as OUTPUT0. Model "slow" waits for ``gate`` (``entered`` tells that it
    has started, ``cancelled`` that its caller went away)."""

    def __init__(self) -> None:
        self.entered, self.gate, self.cancelled = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.seen: list[str] = []
        self.kept: list = []

    async def infer(self, req, endpoint: str = "HTTP end point"):
        self.seen.append(req.id)
        if req.id.startswith("keep"):          # holds the input past the answer
            self.kept.append(req.inputs[0].data)
        if req.model == "slow":
            self.entered.set()
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        t = req.inputs[0]
        return CoreResponse(req.model, "1", req.id,
                            [OutputTensor("OUTPUT0", t.datatype, t.shape, t.data)])

    def release(self, resp) -> None:
        pass

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True


@contextlib.asynccontextmanager
async def serving(impl: str, limit: int = LIMIT):
    dp = FakeDataPlane()
    server = await start_http(dp, FrontendSettings("", host="127.0.0.1", http_port=0,
                                                   http_max_input_size=limit, http_impl=impl))
    try:
        yield server, dp
    finally:
        await server.stop(1.0)


def run(body, timeout: float = 20) -> None:
    async def main():
        async with asyncio.timeout(timeout):      # no task of its own (see no_other_tasks)
            await body()
    asyncio.run(main())


async def until(cond, what: str, timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def infer_body(values, rid: str = "") -> bytes:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, len(values)],
                       "data": values}]}
    if rid:
        doc["id"] = rid
    return json.dumps(doc).encode()


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: t", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def connect(port: int):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def response(reader: asyncio.StreamReader,
                   head_request: bool = False) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in
               (line.split(":", 1) for line in head[1:] if line)}
    if head_request:
        return status, headers, b""
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def data_of(body: bytes) -> tuple[str, list]:
    doc = json.loads(body)
    return doc.get("id", ""), doc["outputs"][0]["data"]


def server_conns(port: int) -> int:
    """Established connections on the server's side of ``port`` (this process)."""
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


async def no_other_tasks() -> None:
    me = asyncio.current_task()
    await until(lambda: not [t for t in asyncio.all_tasks() if t is not me], "tasks to end")


# ---- over both servers ------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
def test_pipelined_requests_answered_in_order(impl):
    async def body():
        async with serving(impl) as (server, dp):
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", infer_body([1.0], "a"))
                         + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n"
                         + post("/v2/models/m/infer", infer_body([3.0, 4.0], "c")))
            first, second, third = [await response(reader) for _ in range(3)]
            assert (first[0], data_of(first[2])) == (200, ("a", [1.0]))
            assert second[:1] == (200,) and second[2] == b""
            assert (third[0], data_of(third[2])) == (200, ("c", [3.0, 4.0]))
            assert dp.seen == ["a", "c"]
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_body(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            payload = infer_body([0.5, -2.0, 8.0], "ch")
            pieces = [payload[i:i + 10] for i in range(0, len(payload), 10)]
            writer.write(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n"
                         + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
                         + b"0\r\n\r\n")
            status, _, answer = await response(reader)
            assert (status, data_of(answer)) == (200, ("ch", [0.5, -2.0, 8.0]))
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_request_in_tiny_writes(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            raw = post("/v2/models/m/infer", infer_body([float(i) for i in range(50)], "t"))
            for i in range(0, len(raw), 7):
                writer.write(raw[i:i + 7])
                await writer.drain()
            status, _, answer = await response(reader)
            assert (status, data_of(answer)) == (200, ("t", [float(i) for i in range(50)]))
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_binary_body_in_many_reads(impl):
    """4 MiB of tensor over Content-Length: gathered in one buffer, echoed byte for byte."""
    async def body():
        async with serving(impl, limit=64 << 20) as (server, _):
            reader, writer = await connect(server.port)
            x = np.random.default_rng(0).random(1 << 20, dtype=np.float32)
            header = json.dumps({
                "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, x.size],
                            "parameters": {"binary_data_size": x.nbytes}}],
                "parameters": {"binary_data_output": True}}).encode()
            writer.write(post("/v2/models/m/infer", header + x.tobytes(),
                              f"Inference-Header-Content-Length: {len(header)}"))
            status, headers, answer = await response(reader)
            assert status == 200
            n = int(headers["inference-header-content-length"])
            np.testing.assert_array_equal(np.frombuffer(answer[n:], np.float32), x)
            writer.close()
    run(body)


def binary_infer(x: np.ndarray, rid: str) -> bytes:
    header = json.dumps({
        "id": rid, "parameters": {"binary_data_output": True},
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, x.size],
                    "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    return post("/v2/models/m/infer", header + x.tobytes(),
                f"Inference-Header-Content-Length: {len(header)}")


def output_of(headers: dict, answer: bytes) -> np.ndarray:
    return np.frombuffer(answer[int(headers["inference-header-content-length"]):], np.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_same_size_bodies_in_a_row(impl):
    """A connection reuses a big body's buffer for the next body of its size, but never one
    that is still referenced (here the data plane keeps the first request's input)."""
    async def body():
        async with serving(impl, limit=64 << 20) as (server, dp):
            reader, writer = await connect(server.port)
            xs = [np.full(300_000, float(i), np.float32) for i in range(4)]
            for i, x in enumerate(xs):
                writer.write(binary_infer(x, "keep" if i == 0 else f"n{i:03}"))  # same sizes
                status, headers, answer = await response(reader)
                assert status == 200
                np.testing.assert_array_equal(output_of(headers, answer), x)
            writer.write(b"".join(binary_infer(x, f"p{i:03}") for i, x in enumerate(xs)))
            for x in xs:                                   # pipelined
                status, headers, answer = await response(reader)
                np.testing.assert_array_equal(output_of(headers, answer), x)
            np.testing.assert_array_equal(np.frombuffer(dp.kept[0], np.float32), xs[0])
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_expect_100_continue(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            payload = infer_body([2.0], "e")
            writer.write(post("/v2/models/m/infer", payload, "Expect: 100-continue")
                         [:-len(payload)])
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(payload)
            status, _, answer = await response(reader)
            assert (status, data_of(answer)) == (200, ("e", [2.0]))
            writer.write(post("/v2/models/m/infer", payload, "Expect: something"))
            status, _, answer = await response(reader)
            assert (status, answer) == (417, b"Unknown Expect: something")
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_http10(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)   # no keep-alive: answer, then close
            writer.write(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
            assert (await response(reader))[0] == 200
            assert await reader.read() == b""
            writer.close()
            reader, writer = await connect(server.port)   # keep-alive asked for: kept
            writer.write(b"GET /v2/health/live HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            status, headers, _ = await response(reader)
            assert (status, headers["connection"].lower()) == (200, "keep-alive")
            writer.write(b"GET /v2/health/ready HTTP/1.0\r\n\r\n")
            assert (await response(reader))[0] == 200
            assert await reader.read() == b""
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_connection_close(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            status, headers, _ = await response(reader)
            assert (status, headers["connection"]) == (200, "close")
            assert await reader.read() == b""
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("garbage", [
    b"BROKEN\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n",
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Length: 1x\r\n\r\n"])
def test_malformed_request_is_400_and_others_go_on(impl, garbage):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            writer.write(garbage)
            assert (await response(reader))[0] == 400
            assert await reader.read() == b""
            writer.close()
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", infer_body([1.0], "ok")))
            assert (await response(reader))[0] == 200
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_disconnect_mid_body(impl):
    async def body():
        async with serving(impl) as (server, dp):
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", b"{" + b" " * 99_999)[:-90_000])
            await writer.drain()
            await until(lambda: server_conns(server.port) == 1, "the connection")
            writer.close()
            await until(lambda: server_conns(server.port) == 0, "the connection to go")
            await no_other_tasks()
            assert dp.seen == []
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", infer_body([1.0], "after")))
            status, _, answer = await response(reader)
            assert (status, data_of(answer)) == (200, ("after", [1.0]))
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_content_length_over_the_limit(impl):
    async def body():
        async with serving(impl) as (server, dp):
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", b" " * 5000))
            status, headers, answer = await response(reader)
            assert status == 400 and headers["content-type"] == "application/json"
            assert json.loads(answer)["error"] == SIZE_TEXT.format(5000)
            assert dp.seen == []
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_gzip_over_the_limit_once_inflated(impl):
    async def body():
        async with serving(impl) as (server, _):
            padded = infer_body([1.0], "z")[:-1] + b" " * 8192 + b"}"
            packed = gzip.compress(padded)
            assert len(packed) < LIMIT < len(padded)
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", packed, "Content-Encoding: gzip"))
            status, _, answer = await response(reader)
            assert status == 400
            assert json.loads(answer)["error"] == (   # Triton's DataCompressor text
                "Decompressed data size exceeds the maximum allowed value of 4096 bytes. "
                "Use --http-max-input-size to increase the limit.")
            writer.close()
            reader, writer = await connect(server.port)   # under the limit once inflated
            writer.write(post("/v2/models/m/infer", gzip.compress(infer_body([1.0], "z")),
                              "Content-Encoding: gzip"))
            status, _, answer = await response(reader)
            assert (status, data_of(answer)) == (200, ("z", [1.0]))
            writer.close()
    run(body)


_SAME = [  # what both servers answer alike (status, Content-Type and other headers, body)
    post("/v2/models/m/infer", infer_body([0.5, -2.0])),
    post("/v2/models/m/versions/3/infer", infer_body([1.0]), "Accept-Encoding: gzip"),
    post("/v2/models/m/infer", gzip.compress(infer_body([1.0])), "Content-Encoding: gzip",
         "Accept-Encoding: deflate"),
    post("/v2/models/m/infer", b"{"),
    post("/v2/models/m/infer", b"{}", "Content-Encoding: compress"),
    post("/v2/models/m/infer", b"\0" * 8, "Inference-Header-Content-Length: x"),
    post("/v2/models//infer", b"{}"),
    post("/v2/models/infer", b"{}"),
    post("/v2/health/live", b""),
    post("/v2/repository/index", b" " * 5000),
    b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n",
    b"HEAD /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /v2/models/m/infer?x=1 HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /v2/models/a%2Fb HTTP/1.1\r\nHost: t\r\n\r\n",
]


def test_native_answers_as_aiohttp():
    async def answers(impl: str) -> list:
        out = []
        async with serving(impl) as (server, _):
            for raw in _SAME:
                reader, writer = await connect(server.port)
                writer.write(raw)
                status, headers, answer = await response(reader, raw.startswith(b"HEAD"))
                for name in ("date", "server", "connection"):
                    headers.pop(name, None)
                out.append((status, headers, answer))
                writer.close()
        return out

    async def body():
        assert await answers("native") == await answers("aiohttp")
    run(body)
