"""Streamed answers (StreamReply: the generate extension's server-sent events) on both HTTP
servers, at the byte level over a fake data plane: chunked framing with one chunk per
piece, the connection going on after the last chunk (keep-alive, pipelining), HTTP/1.0,
a client that leaves mid-stream (its request is closed at once, the server goes on), and
on the native server back-pressure and a graceful stop.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from services.dataplane.types import CoreResponse, OutputTensor
from services.frontend.http.engine import NativeHttpServer
from services.frontend.http.message import Reply, StreamReply
from services.frontend.http.routes import start_http
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_http1 import (
    IMPLS,
    LIMIT,
    connect,
    no_other_tasks,
    post,
    run,
    server_conns,
    until,
)

SSE = "text/event-stream; charset=utf-8"
META = {"inputs": [{"name": "N", "datatype": "INT32", "shape": [1]},
                   {"name": "GATED", "datatype": "BOOL", "shape": [1]}]}


class StreamPlane:
    """Model "m": N responses "0", "1", ... then a bare final flag. With GATED, response i
    waits for ``gates[i]``. ``ended``: the streams closed so far (finished or abandoned),
    ``cancelled``: those closed before their end."""

    def __init__(self) -> None:
        self.gates = [asyncio.Event() for _ in range(8)]
        self.ended = 0
        self.cancelled = 0
        self.waiting = asyncio.Event()

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    async def model_metadata(self, model: str, version: str) -> dict:
        return META

    async def infer_stream(self, req):
        n = int.from_bytes(req.inputs[0].data, "little")
        gated = len(req.inputs) > 1 and bytes(req.inputs[1].data) == b"\x01"
        done = False
        try:
            for i in range(n):
                if gated:
                    self.waiting.set()
                    await self.gates[i].wait()
                else:
                    await asyncio.sleep(0)
                data = b"%c\0\0\0%d" % (len(str(i)), i)
                yield CoreResponse("m", "1", req.id, [OutputTensor("T", "BYTES", [1], data)],
                                   final=False)
            await asyncio.sleep(0)
            yield CoreResponse("m", "1", req.id, final=True, empty=True)
            done = True
        finally:
            self.ended += 1
            self.cancelled += not done

    def release(self, resp) -> None:
        pass


def event(i: int) -> bytes:
    return b'data: {"T":"%d","model_name":"m","model_version":"1"}\n\n' % i


def request(n: int, gated: bool = False, version: str = "1.1", *extra: str) -> bytes:
    return post("/v2/models/m/generate_stream", json.dumps({"N": n, "GATED": gated}).encode(),
                *extra, version=version)


@contextlib.asynccontextmanager
async def serving(impl: str):
    dp = StreamPlane()
    server = await start_http(dp, FrontendSettings("", host="127.0.0.1", http_port=0,
                                                   http_max_input_size=LIMIT, http_impl=impl))
    try:
        yield server, dp
    finally:
        await server.stop(1.0)


async def head(reader) -> tuple[int, dict[str, str]]:
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, v in
                                      (line.split(":", 1) for line in lines[1:] if line)}


async def chunk(reader) -> bytes:
    size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
    data = await reader.readexactly(size + 2)
    assert data.endswith(b"\r\n")
    return data[:-2]


@pytest.mark.parametrize("impl", IMPLS)
def test_one_chunk_per_event_then_the_connection_goes_on(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            # Pipelined: the second request waits for the end of the first's stream.
            writer.write(request(3) + request(1))
            for n in (3, 1):
                status, headers = await head(reader)
                assert (status, headers["content-type"]) == (200, SSE)
                assert headers["transfer-encoding"] == "chunked"
                assert "content-length" not in headers
                assert [await chunk(reader) for _ in range(n)] == [event(i) for i in range(n)]
                assert await chunk(reader) == b""
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await head(reader))[0] == 200
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_each_piece_leaves_when_it_comes(impl):
    async def body():
        async with serving(impl) as (server, dp):
            reader, writer = await connect(server.port)
            writer.write(request(2, gated=True))
            await asyncio.wait_for(dp.waiting.wait(), 5)
            dp.gates[0].set()
            assert (await head(reader))[0] == 200
            assert await chunk(reader) == event(0)   # while the next one is still held
            dp.gates[1].set()
            assert await chunk(reader) == event(1)
            assert await chunk(reader) == b""
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_http10_gets_the_pieces_then_close(impl):
    async def body():
        async with serving(impl) as (server, _):
            reader, writer = await connect(server.port)
            writer.write(request(2, False, "1.0"))
            status, headers = await head(reader)
            assert status == 200 and "transfer-encoding" not in headers
            assert await reader.read() == event(0) + event(1)
            writer.close()
    run(body)


@pytest.mark.parametrize("impl", IMPLS)
def test_client_leaving_mid_stream_closes_its_request(impl):
    """The stream waits for its model (nothing to write): the client's leaving alone must
    end it, and the server serves the next client."""
    async def body():
        async with serving(impl) as (server, dp):
            reader, writer = await connect(server.port)
            writer.write(request(3, gated=True))
            dp.gates[0].set()
            assert (await head(reader))[0] == 200
            assert await chunk(reader) == event(0)
            writer.close()
            await until(lambda: dp.cancelled == 1, "the request to be closed")
            await until(lambda: server_conns(server.port) == 0, "the connection to go")
            reader, writer = await connect(server.port)
            writer.write(request(1))
            assert (await head(reader))[0] == 200
            assert await chunk(reader) == event(0)
            writer.close()
        await no_other_tasks()
    run(body)


class _Transport:
    """Takes writes (what the client would read)."""

    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data) -> None:
        self.out += data

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


class _Pieces:
    """A StreamReply's body from a queue; None ends it. ``closed``: aclose was called."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        piece = await self.queue.get()
        if piece is None:
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        self.closed = True


def test_back_pressure_holds_the_next_piece():
    """The native server writes a piece only while the client reads (resume_writing)."""
    async def body():
        pieces = _Pieces()

        async def handle(req):
            return StreamReply(200, pieces, SSE)

        server = NativeHttpServer(handle, LIMIT)
        conn, transport = server.protocol(), _Transport()
        conn.connection_made(transport)
        conn.data_received(b"GET /s HTTP/1.1\r\n\r\n")
        pieces.queue.put_nowait(b"one")
        await until(lambda: transport.out.endswith(b"3\r\none\r\n"), "the first piece")
        conn.pause_writing()                           # the client stopped reading
        pieces.queue.put_nowait(b"two")
        await until(lambda: b"two" in transport.out, "the piece already taken")
        pieces.queue.put_nowait(b"three")
        for _ in range(5):
            await asyncio.sleep(0)
        assert b"three" not in transport.out           # held until the client reads
        conn.resume_writing()
        pieces.queue.put_nowait(None)
        await until(lambda: transport.out.endswith(b"5\r\nthree\r\n0\r\n\r\n"), "the end")
        assert pieces.closed
        conn.connection_lost(None)
    run(body)


def test_graceful_stop_cuts_a_stream_after_the_grace():
    async def body():
        pieces = _Pieces()
        started = asyncio.Event()

        async def handle(req):
            if req.path == "/plain":
                return Reply(200, b"ok")
            started.set()
            return StreamReply(200, pieces, SSE)

        server = NativeHttpServer(handle, LIMIT)
        await server.start("127.0.0.1", 0)
        reader, writer = await connect(server.port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.wait_for(started.wait(), 5)
        await server.stop(0.2)                         # the stream never ends by itself
        assert pieces.closed
        assert (await head(reader))[0] == 200
        writer.close()
    run(body)
