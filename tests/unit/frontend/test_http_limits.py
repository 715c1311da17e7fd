"""The HTTP/1.1 server's limits, in one process, with small values
so that each test takes a second or two: bodies held as the bytes that came (never the
size declared) and released the moment their connection closes, header / body / idle
timeouts, the connection cap, Triton's cap on chunks, and the flags that set them.
Against the real `trireme serve`: tests/adversarial/test_http_*.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import socket
import time

import psutil
import pytest

from services.common.procutil import malloc_trim
from services.frontend.http.engine import NativeHttpServer
from services.frontend.http.limits import BODY_MIN_RATE
from services.frontend.http.message import CHUNKS_TEXT, MAX_CHUNKS, Reply, Request
from services.frontend.http.routes import Handlers, start_http
from services.frontend.main import add_frontend_args, frontend_argv, settings_from_args
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_http1 import FakeDataPlane, connect, infer_body, post, response, run, until

MIB = 1 << 20


async def _echo(req) -> Reply:
    body = await req.read()
    return Reply(200, b"%d" % len(body), "text/plain")


@contextlib.asynccontextmanager
async def native(handle=_echo, limit: int = 64 * MIB, **limits):
    server = NativeHttpServer(handle, limit, **limits)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop(1.0)


async def _served(port: int) -> None:
    """A well-behaved client on another connection gets its answer."""
    reader, writer = await connect(port)
    writer.write(post("/x", b"hello"))
    status, _, body = await asyncio.wait_for(response(reader), 5)
    assert (status, body) == (200, b"5")
    writer.close()


async def _closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything the server still sends, up to its close (EOF or reset)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                out += chunk
    return out


def _error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def _rss() -> int:
    return psutil.Process().memory_info().rss


# ---- memory -------------------------------------------------------------------------------

def test_a_declared_size_is_not_allocated():
    """50 connections declare 60 MB each and send one byte: the server holds bytes, not
    3 GB. (Before: bytearray(60_000_000) per connection.)"""
    async def body():
        waiting = []

        async def handle(req):
            waiting.append(req)
            await req.read()
            return Reply(200)

        async with native(handle) as server:
            gc.collect()
            before = _rss()
            conns = []
            for _ in range(50):
                reader, writer = await connect(server.port)
                writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 60000000\r\n\r\nx")
                conns.append((reader, writer))
            await until(lambda: len(waiting) == 50 and all(r.size for r in waiting),
                        "every body's first byte")
            assert _rss() - before < 16 * MIB
            assert all(r.size == 1 for r in waiting)
            for _, writer in conns:
                writer.close()
    run(body)


def test_a_body_costs_at_most_twice_what_came():
    """Pieces are kept until half the declared size has come; then one buffer of that size."""
    async def body():
        seen = []

        async def handle(req):
            seen.append(req)
            return Reply(200, b"%d" % len(await req.read()))

        async with native(handle) as server:
            reader, writer = await connect(server.port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (8 * MIB))
            sent = 0
            for size in (MIB // 2, MIB, 2 * MIB):
                writer.write(b"a" * size)
                sent += size
                await until(lambda s=sent: seen and seen[0].size == s, "the piece")
                held = seen[0]._body
                nbytes = len(held) if not isinstance(held, list) else sum(map(len, held))
                assert sent <= nbytes <= 2 * sent
            writer.write(b"a" * (8 * MIB - sent))
            status, _, answer = await response(reader)
            assert (status, answer) == (200, b"%d" % (8 * MIB))
            writer.close()
    run(body)


def _live_requests() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Request)


def test_request_memory_goes_when_the_connection_closes_with_gc_off():
    """Clients that vanish mid-body: their requests and bodies are freed on close, by
    reference counting alone (the cyclic GC is off), and RSS comes back."""
    async def body():
        async def handle(req):
            await req.read()
            return Reply(200)

        async with native(handle) as server:
            gc.collect()
            gc.disable()
            try:
                malloc_trim()    # free heap pages left by earlier tests would hide the bodies
                before, live = _rss(), _live_requests()
                conns = []
                for _ in range(10):
                    reader, writer = await connect(server.port)
                    writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
                                 % (12 * MIB) + b"z" * (7 * MIB))
                    conns.append(writer)
                await until(lambda: sum(c._parsing is not None and c._parsing.size == 7 * MIB
                                        for c in server.connections) == 10, "the bodies")
                peak = _rss()
                assert peak - before > 60 * MIB            # they are held while open
                assert _live_requests() == live + 10
                for writer in conns:
                    writer.close()
                await until(lambda: not server.connections, "the connections to close")
                await until(lambda: _live_requests() == live, "the requests to go")
                # freed, not necessarily handed back: glibc keeps freed heap pages (an earlier
                # test's large buffers can move its mmap threshold above these bodies) until
                # trimmed, as the frontend's housekeeping does once traffic stops
                await until(lambda: malloc_trim() is not None and
                            _rss() - before < (peak - before) / 4, "RSS to come back")
            finally:
                gc.enable()
    run(body)


# ---- timeouts -----------------------------------------------------------------------------

def test_slow_head_is_408_and_closed_others_served():
    async def body():
        async with native(header_timeout=0.5) as server:
            reader, writer = await connect(server.port)
            start = time.monotonic()
            head = b"POST /x HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 40

            async def trickle():
                with contextlib.suppress(ConnectionError):
                    for byte in head:
                        writer.write(bytes([byte]))
                        await asyncio.sleep(0.05)

            sender = asyncio.ensure_future(trickle())
            await _served(server.port)
            answer = await _closed(reader)
            assert time.monotonic() - start < 3
            assert _error(answer) == (408, "request head not received within 0.5 s "
                                           "(--http-header-timeout-secs)")
            assert b"Connection: close" in answer
            assert server.counters["header_timeouts"] == 1
            sender.cancel()
            writer.close()
            # a connection that sends nothing at all: closed at the header timeout
            silent_r, silent_w = await connect(server.port)
            assert await _closed(silent_r) == b""
            silent_w.close()
            await _served(server.port)
    run(body)


def test_slow_body_is_408_and_closed_others_served():
    async def body():
        async with native(body_timeout=0.5) as server:
            reader, writer = await connect(server.port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n")
            start = time.monotonic()

            async def trickle():
                with contextlib.suppress(ConnectionError):
                    while True:
                        writer.write(b"x")                    # one byte at a time
                        await asyncio.sleep(0.05)

            sender = asyncio.ensure_future(trickle())
            await _served(server.port)
            answer = await _closed(reader)
            assert time.monotonic() - start < 3
            assert _error(answer) == (408, "request body not received within 0.5 s "
                                           "(--http-body-timeout-secs)")
            assert server.counters["body_timeouts"] == 1
            sender.cancel()
            writer.close()
    run(body)


def test_a_body_arriving_fast_enough_is_never_cut():
    """Longer than the body timeout, but faster than BODY_MIN_RATE: it gets through."""
    async def body():
        async with native(body_timeout=0.3) as server:
            reader, writer = await connect(server.port)
            piece, pieces = BODY_MIN_RATE // 4, 12              # 3 s of body at 4x the rate
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
                         % (piece * pieces))
            start = time.monotonic()
            for _ in range(pieces):
                writer.write(b"y" * piece)
                await asyncio.sleep(1 / 16)
            status, _, answer = await response(reader)
            assert time.monotonic() - start > 0.6
            assert (status, answer) == (200, b"%d" % (piece * pieces))
            writer.close()
    run(body)


def test_a_body_refused_up_front_then_never_sent():
    """A body refused at its head (over the limit) is dropped as it comes, and the body
    timeout still ends the connection when the rest never comes."""
    async def body():
        async def handle(req):
            try:
                await req.read()
            except Exception:                           # noqa: BLE001 - BodyTooLarge
                return Reply(413)
            return Reply(200)

        async with native(handle, limit=1000, body_timeout=0.4) as server:
            reader, writer = await connect(server.port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 60000000\r\n\r\nx")
            assert (await response(reader))[0] == 413
            assert await _closed(reader) == b""
            assert server.counters["body_timeouts"] == 1
            writer.close()
    run(body)


def test_a_client_that_does_not_read_our_answer_is_cut():
    """Our answer sits unread for the idle timeout: the connection is dropped."""
    async def body():
        async def handle(req):
            return Reply(200, b"b" * (16 * MIB))

        async with native(handle, idle_timeout=0.5) as server:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            await asyncio.get_running_loop().sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await until(lambda: server.counters["write_stalls"] == 1, "the stall to be cut")
            await until(lambda: not server.connections, "the connection to go")
            sock.close()
    run(body)


# ---- connections and chunks ---------------------------------------------------------------

def test_connections_past_the_cap_are_503():
    async def body():
        async with native(max_connections=4) as server:
            held = []
            for _ in range(4):
                reader, writer = await connect(server.port)
                writer.write(post("/x", b"ab"))
                assert (await response(reader))[0] == 200
                held.append(writer)
            reader, writer = await connect(server.port)
            answer = await _closed(reader)
            assert _error(answer) == (503, "Service Unavailable: this server is at its limit "
                                           "of 4 connections (--http-max-connections)")
            assert server.counters["connections_refused"] == 1
            writer.close()
            held.pop().close()
            await until(lambda: len(server.connections) == 3, "a free slot")
            await _served(server.port)
            for w in held:
                w.close()
    run(body)


def _chunked(n: int) -> bytes:
    return (b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"1\r\nA\r\n" * n + b"0\r\n\r\n")


@pytest.mark.parametrize("chunks", [MAX_CHUNKS, MAX_CHUNKS + 1, 1_000_000])
def test_triton_cap_on_chunks(chunks):
    async def body():
        async with native() as server:
            reader, writer = await connect(server.port)
            writer.write(_chunked(chunks))
            if chunks <= MAX_CHUNKS:
                status, _, answer = await response(reader)
                assert (status, answer) == (200, b"%d" % chunks)
                assert server.counters["chunk_floods"] == 0
            else:
                answer = await _closed(reader, 20)
                assert _error(answer) == (400, CHUNKS_TEXT)
                assert b"Connection: close" in answer
                assert server.counters["chunk_floods"] == 1
            writer.close()
            await _served(server.port)
    run(body, 60)


@pytest.mark.parametrize("declared", [10, 100_000])
def test_chunked_with_a_content_length_is_read_by_its_chunks(declared):
    """Transfer-Encoding: chunked beside a Content-Length (RFC 9112 §6.3; Triton takes it):
    the chunks are the body and the limit holds as they come, whatever length is declared
    (one over the limit is not refused up front, one under it does not cut the body); the
    connection closes after the answer, so a request pipelined behind it is never read."""
    async def body():
        async def handle(req):
            try:
                return await _echo(req)
            except Exception:                           # noqa: BLE001 - BodyTooLarge
                return Reply(413, close=True)

        async with native(handle, limit=1000) as server:
            for size, status in ((500, 200), (2000, 413)):
                reader, writer = await connect(server.port)
                writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n" % declared
                             + b"%X\r\n%s\r\n0\r\n\r\n" % (size, b"A" * size) + post("/x", b"behind"))
                answer = await _closed(reader)
                head, _, rest = answer.partition(b"\r\n\r\n")
                assert b"Connection: close" in head
                assert int(head.split()[1]) == status      # one answer: "behind" is unread
                assert rest == (b"500" if status == 200 else b"")
                writer.close()
            await _served(server.port)
    run(body)


# ---- the aiohttp alternative --------------------------------------------------------------

def test_aiohttp_body_timeout_and_connection_cap():
    async def body():
        dp = FakeDataPlane()
        server = await start_http(dp, FrontendSettings(
            "", host="127.0.0.1", http_port=0, http_impl="aiohttp", http_body_timeout_secs=0.4,
            http_max_connections=2))
        try:
            reader, writer = await connect(server.port)
            full = infer_body([1.0])
            writer.write(post("/v2/models/m/infer", full)[:-5])     # the body, short of 5
            assert _error(await _closed(reader)) == (
                408, "request body not received within 0.4 s (--http-body-timeout-secs)")
            writer.close()
            conns = [await connect(server.port) for _ in range(2)]
            await asyncio.sleep(0.1)
            extra_r, extra_w = await connect(server.port)
            assert _error(await _closed(extra_r))[0] == 503
            extra_w.close()
            for _, w in conns:
                w.close()
        finally:
            await server.stop(1.0)
    run(body)


# ---- flags --------------------------------------------------------------------------------

def test_flags_reach_the_engine():
    p = argparse.ArgumentParser()
    add_frontend_args(p)
    args = p.parse_args(["--http-header-timeout-secs", "1.5", "--http-body-timeout-secs", "2",
                         "--http-idle-timeout-secs", "3", "--http-max-connections", "7"])
    argv = frontend_argv(args)
    for flag, value in (("--http-header-timeout-secs", "1.5"), ("--http-body-timeout-secs",
                        "2.0"), ("--http-idle-timeout-secs", "3.0"),
                        ("--http-max-connections", "7")):
        assert argv[argv.index(flag) + 1] == value            # `trireme serve` forwards them
    settings = settings_from_args(args, "unix:///tmp/x")
    server = NativeHttpServer(Handlers(FakeDataPlane(), settings).dispatch,
                              settings.http_max_input_size, settings=settings)
    assert (server.header_timeout, server.body_timeout, server.idle_timeout,
            server.max_connections) == (1.5, 2.0, 3.0, 7)
    defaults = NativeHttpServer(_echo, 1)
    assert (defaults.header_timeout, defaults.body_timeout, defaults.idle_timeout,
            defaults.max_connections) == (60.0, 60.0, 75.0, 1024)
