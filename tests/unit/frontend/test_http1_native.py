"""The native HTTP/1.1 server's own behaviour, beyond what it shares with aiohttp's
(tests/unit/frontend/test_http1.py): bodies refused and skipped on a kept connection, cancelled
handlers, oversized heads, broken bodies, graceful stop, back-pressure, idle timeout.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import re

import pytest

from services.frontend.http.engine import NativeHttpServer
from services.frontend.http.limits import MAX_QUEUED
from services.frontend.http.message import Reply
from services.frontend.http.routes import start_http
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_http1 import (
    LIMIT,
    FakeDataPlane,
    connect,
    data_of,
    infer_body,
    no_other_tasks,
    post,
    response,
    run,
    server_conns,
    serving,
    until,
)


def test_refused_body_is_skipped_and_the_connection_kept():
    async def body():
        async with serving("native") as (server, _):
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/m/infer", b" " * 5000)
                         + post("/v2/models/m/infer", infer_body([7.0], "next")))
            assert (await response(reader))[0] == 400
            status, _, answer = await response(reader)
            assert (status, data_of(answer)) == (200, ("next", [7.0]))
            writer.write(post("/v2/nowhere", b"x" * 3000)               # answered unread
                         + b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await response(reader))[0] == 404
            assert (await response(reader))[0] == 200
            writer.close()
    run(body)


def test_disconnect_while_the_handler_waits_cancels_it():
    async def body():
        async with serving("native") as (server, dp):
            reader, writer = await connect(server.port)
            writer.write(post("/v2/models/slow/infer", infer_body([1.0], "s")))
            await asyncio.wait_for(dp.entered.wait(), 10)
            writer.close()
            await asyncio.wait_for(dp.cancelled.wait(), 10)
            await until(lambda: server_conns(server.port) == 0, "the connection to go")
            await no_other_tasks()
    run(body)


def test_head_too_large_is_400():
    async def body():
        async with serving("native") as (server, _):
            reader, writer = await connect(server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nX-Big: " + b"a" * 70_000
                         + b"\r\n\r\n")
            status, _, answer = await response(reader)
            assert status == 400 and "too large" in json.loads(answer)["error"]
            assert await reader.read() == b""
            writer.close()
    run(body)


def test_endless_header_is_cut_off():
    """A header that never ends: httptools gathers its pieces before any callback, so the
    bytes read are what stops it (the client may see the 400 or, still writing, a reset)."""
    async def body():
        async with serving("native") as (server, _):
            reader, writer = await connect(server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nX-Big: ")
            with pytest.raises(ConnectionError):
                for _ in range(100):                     # up to 25 MiB
                    writer.write(b"a" * 256 * 1024)
                    await writer.drain()
            writer.close()
            await until(lambda: server_conns(server.port) == 0, "the connection to go")
            reader, writer = await connect(server.port)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await response(reader))[0] == 200
            writer.close()
    run(body)


def test_broken_bodies_are_400_and_close():
    async def body():
        async with serving("native") as (server, _):
            for raw in [post("/v2/models/m/infer", b"\x1f\x8b\x08\x00garbage",
                             "Content-Encoding: gzip"),
                        post("/v2/models/m/infer", gzip.compress(infer_body([1.0]))[:-8],
                             "Content-Encoding: gzip"),
                        b"POST /v2/models/m/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"5\r\nabcdeXX\r\n"]:
                reader, writer = await connect(server.port)
                writer.write(raw)
                status, headers, answer = await response(reader)
                assert (status, headers["connection"]) == (400, "close")
                assert json.loads(answer)["error"].startswith("failed to read the request body: ")
                assert await reader.read() == b""
                writer.close()
    run(body)


def test_graceful_stop_finishes_requests_in_flight():
    async def body():
        dp = FakeDataPlane()
        server = await start_http(dp, FrontendSettings("", host="127.0.0.1", http_port=0))
        busy_r, busy_w = await connect(server.port)
        idle_r, idle_w = await connect(server.port)
        busy_w.write(post("/v2/models/slow/infer", infer_body([1.0], "s")))
        await asyncio.wait_for(dp.entered.wait(), 10)
        await until(lambda: server_conns(server.port) == 2, "both connections")
        stop = asyncio.ensure_future(server.stop(10))
        assert await idle_r.read() == b""              # the idle connection goes at once
        assert not stop.done()
        dp.gate.set()
        status, headers, answer = await response(busy_r)
        assert (status, headers["connection"], data_of(answer)) == (200, "close", ("s", [1.0]))
        await stop
        with pytest.raises(OSError):
            await connect(server.port)
        busy_w.close()
        idle_w.close()
    run(body)


class _Transport:
    """Takes writes; records pause_reading / resume_reading."""

    def __init__(self) -> None:
        self.out, self.calls, self.closing = bytearray(), [], False

    def write(self, data) -> None:
        self.out += data

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def test_back_pressure():
    """Reading pauses while too many pipelined requests wait and while the client does not
    read our answers; each answer still comes, in order, once it may."""
    async def body():
        async def handle(req):
            return Reply(200, req.path.encode())

        server = NativeHttpServer(handle, LIMIT)
        conn, transport = server.protocol(), _Transport()
        conn.connection_made(transport)
        n = MAX_QUEUED + 8
        conn.data_received(b"".join(b"GET /%d HTTP/1.1\r\n\r\n" % i for i in range(n)))
        assert transport.calls == ["pause"]
        await until(lambda: transport.out.count(b"HTTP/1.1 200") == n, "every answer")
        assert transport.calls == ["pause", "resume"]
        assert re.findall(rb"\r\n\r\n/(\d+)", bytes(transport.out)) == \
            [str(i).encode() for i in range(n)]
        transport.out.clear()
        conn.pause_writing()                           # the client stopped reading
        assert transport.calls[-1] == "pause"
        conn.data_received(b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\n")
        await until(lambda: b"/a" in transport.out, "the first answer")
        for _ in range(5):
            await asyncio.sleep(0)
        assert b"/b" not in transport.out              # held until the client reads
        conn.resume_writing()
        assert transport.calls[-1] == "resume"
        await until(lambda: transport.out.endswith(b"/b"), "the second answer")
        conn.connection_lost(None)
    run(body)


def test_idle_connection_closes_after_the_timeout():
    async def body():
        async def handle(req):
            return Reply(200)

        server = NativeHttpServer(handle, LIMIT, idle_timeout=0.25)
        await server.start("127.0.0.1", 0)
        try:
            reader, writer = await connect(server.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await response(reader))[0] == 200
            assert await asyncio.wait_for(reader.read(), 5) == b""   # closed when idle
            writer.close()
        finally:
            await server.stop(1.0)
    run(body)
