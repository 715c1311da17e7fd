"""The native gRPC server's flood limits (grpc/limits.py), with raw HTTP/2 frames: refused
streams, control frames, ping strikes, rapid reset, and a peer that does not read (the
write-buffer water marks). The helpers are in h2_raw.py.
"""
from __future__ import annotations

import asyncio
import socket

import pytest

from services.frontend.grpc.h2_frames import PREFACE, frame_header
from tests.unit.frontend.h2_raw import (
    ACK,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    PING,
    PRIORITY,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    call_ok,
    closed_then_served,
    goaway,
    headers_frame,
    next_frame,
    run,
    server_conn,
    until,
)
from tests.unit.frontend.test_grpc_codec import echo_request
from tests.unit.frontend.test_grpc_native import RawClient, decode_response, grpc_message, request_headers


def test_refusing_streams_without_end_is_a_flood():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.frame(HEADERS, END_HEADERS, 3, request_headers())          # open, the limit
        block = bytearray()
        for sid in range(5, 5 + 2 * 60, 2):                          # 60 refused streams
            block += headers_frame(sid)
        c.send(bytes(block))
        assert await goaway(c) == (3, ENHANCE_YOUR_CALM, b"")
        await closed_then_served(c, server.trireme_port)
    run(body, max_concurrent_streams=1, max_control_frames=50)


# ---- control frame floods -----------------------------------------------------------------
FLOODS = {
    "PING": lambda i: frame_header(8, PING, 0, 0) + i.to_bytes(8, "big"),
    "SETTINGS": lambda i: frame_header(6, SETTINGS, 0, 0) + b"\x00\x04\x00\x01\x00\x00",
    "empty DATA": lambda i: frame_header(0, DATA, 0, 3),
    "PRIORITY": lambda i: frame_header(5, PRIORITY, 0, 3) + b"\x00\x00\x00\x00\x10",
    "unknown type": lambda i: frame_header(4, 0x42, 0, 0) + b"grea",
    "WINDOW_UPDATE on a closed stream": lambda i: frame_header(4, WINDOW_UPDATE, 0, 1)
    + b"\x00\x00\x00\x01",
}


@pytest.mark.parametrize("kind", list(FLOODS))
def test_control_frame_flood_gets_enhance_your_calm(kind):
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.frame(HEADERS, END_HEADERS, 3, request_headers())          # an open stream
        c.send(b"".join(FLOODS[kind](i) for i in range(300)))
        assert await goaway(c) == (3, ENHANCE_YOUR_CALM, b"")
        await closed_then_served(c, server.trireme_port)
    # ping strikes off: this is the frame counter's test
    run(body, max_control_frames=200, max_ping_strikes=0)


def test_control_frames_below_the_rate_are_fine():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        for i in range(4):                            # 4 windows of 40 frames each
            c.send(b"".join(FLOODS["PRIORITY"](j) for j in range(40)))
            await call_ok(c, 1 + 2 * i, f"r{i}")
            await asyncio.sleep(0.06)                 # the window is 50 ms
        c.close()
    run(body, max_control_frames=50, control_frame_window_s=0.05)


# ---- ping strikes (grpc core's policy, Triton's flags) -------------------------------------
def test_pings_faster_than_the_policy_get_too_many_pings():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        for i in range(3):                            # the first one, then 2 strikes
            c.frame(PING, 0, 0, i.to_bytes(8, "big"))
            flags, payload = await until(c, PING)
            assert flags == ACK and payload == i.to_bytes(8, "big")
        await call_ok(c, 1)                           # our HEADERS/DATA reset the strikes
        for i in range(3):
            c.frame(PING, 0, 0, i.to_bytes(8, "big"))
            await until(c, PING)
        c.frame(PING, 0, 0, b"12345678")              # the third strike
        assert await goaway(c) == (1, ENHANCE_YOUR_CALM, b"too_many_pings")
        await closed_then_served(c, server.trireme_port)
    run(body)


def test_pings_at_the_allowed_interval_are_answered():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, END_HEADERS, 1, request_headers())      # a call open: the data interval
        for i in range(6):
            c.frame(PING, 0, 0, i.to_bytes(8, "big"))
            flags, payload = await until(c, PING)
            assert payload == i.to_bytes(8, "big")
            await asyncio.sleep(0.06)
        c.frame(DATA, END_STREAM, 1, grpc_message(echo_request("m", "x").SerializeToString()))
        _, data, _ = await c.response(1)
        assert decode_response(data).id == "x"
        c.close()
    run(body, min_recv_ping_interval_without_data_ms=50)


# ---- rapid reset ----------------------------------------------------------------------------
def test_rapid_reset_gets_enhance_your_calm():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)                           # earns nothing: the budget is full
        burst = bytearray()
        for sid in range(3, 3 + 2 * 20, 2):           # budget 2 × 5 streams: the 10th trips
            burst += headers_frame(sid)
            burst += frame_header(4, RST_STREAM, 0, sid) + (8).to_bytes(4, "big")
        c.send(bytes(burst))
        assert await goaway(c) == (3 + 2 * 9, ENHANCE_YOUR_CALM, b"")
        await closed_then_served(c, server.trireme_port)
    run(body, max_concurrent_streams=5)


def test_cancelling_fewer_calls_than_are_answered_is_fine():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        sid = 1
        for i in range(30):                           # 30 answered, 30 cancelled, interleaved
            await call_ok(c, sid, f"r{i}")
            c.frame(HEADERS, END_HEADERS, sid + 2, request_headers())
            c.frame(RST_STREAM, 0, sid + 2, (8).to_bytes(4, "big"))
            sid += 4
        await call_ok(c, sid, "last")
        c.close()
    run(body, max_concurrent_streams=5)


def test_resets_spread_over_time_are_a_deadline_storm_not_a_flood():
    """Calls whose deadlines expire in waves reset their streams before an answer; time
    refills the budget (all of it each second), so a client pacing 20 resets a second
    against a budget of 10 keeps its connection."""
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        sid = 1
        for _ in range(15):                           # 1.5 budgets, over 0.75 s
            c.frame(HEADERS, END_HEADERS, sid, request_headers())
            c.frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big"))
            sid += 2
            await asyncio.sleep(0.05)                 # the client's pace, not a wait
        await call_ok(c, sid, "still served")
        c.close()
    run(body, max_concurrent_streams=5)


# ---- a peer that does not read ---------------------------------------------------------------
def test_a_peer_that_does_not_read_stops_being_read():
    """PINGs from a client that never reads: once our acks fill the kernel buffers and pass
    the high-water mark, the server stops reading; reading again drains them and the
    connection serves as before."""
    async def body(server, dp):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.trireme_port))
        reader, writer = await asyncio.open_connection(sock=sock)
        c = RawClient(reader, writer)
        c.send(PREFACE + frame_header(6, SETTINGS, 0, 0) + b"\x00\x04\x7f\xff\xff\xff")
        await writer.drain()
        while not server._connections:
            await asyncio.sleep(0.01)
        conn = server_conn(server)
        conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                            16 << 10)
        pings = b"".join(frame_header(8, PING, 0, 0) + i.to_bytes(8, "big") for i in range(4096))
        sent = 0
        while not conn._reading_paused:
            writer.write(pings)
            sent += len(pings)
            try:
                await asyncio.wait_for(writer.drain(), 0.2)
            except TimeoutError:
                pass
            assert sent < 200 << 20, "the server never stopped reading"
        buffered = conn._transport.get_write_buffer_size()
        assert buffered <= (64 << 10) + (256 << 10), buffered     # high-water + one read's acks
        # Read everything: the server reads again, answers every PING, and serves a call.
        acks = 0
        c.frame(HEADERS, END_HEADERS, 1, request_headers())
        c.frame(DATA, END_STREAM, 1, grpc_message(echo_request("m", "late").SerializeToString()))
        while True:
            t, flags, sid, payload = await next_frame(c, 30)
            if t == PING:
                acks += 1
            elif t == HEADERS and flags & END_STREAM:
                break
        assert acks == sent // 17
        assert not conn._reading_paused
        c.close()
    run(body, max_ping_strikes=0, max_control_frames=10**9, write_buffer_high=64 << 10,
        write_buffer_low=16 << 10)
