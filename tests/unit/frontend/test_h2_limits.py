"""The native gRPC server's limits (grpc/limits.py), rule by rule, with raw HTTP/2 frames.

Each test breaks one rule on one connection and checks the exact answer (RST_STREAM or
GOAWAY, its error code and last-stream-id), then that a well-behaved client is served: on
the same connection after a stream error, on a new one after a connection error. The server
is the real NativeGrpcServer over a fake data plane (no scheduler, no workers); the limits
are passed in small so that each rule trips in a few frames.
"""
from __future__ import annotations

import asyncio
import gzip
import socket
import tracemalloc

import grpc
import pytest

from protos import grpc_service_pb2 as pb
from services.frontend.grpc import h2
from services.frontend.grpc.aio_server import server_options
from services.frontend.grpc.h2_frames import PREFACE, encode_literal_headers, frame_header
from services.frontend.grpc.limits import GrpcLimits, add_grpc_limit_args
from services.frontend.grpc.methods import rpc_methods, start_grpc
from services.frontend.grpc.native import NativeGrpcServer
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_grpc_codec import echo_request
from tests.unit.frontend.test_grpc_native import (
    INFER,
    RawClient,
    StrictDataPlane,
    decode_response,
    grpc_message,
    request_headers,
)

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, SETTINGS_TIMEOUT, FRAME_SIZE_ERROR, \
    REFUSED_STREAM, ENHANCE_YOUR_CALM = 0, 1, 3, 4, 6, 7, 11
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
MAX_WINDOW = 2**31 - 1
WAIT_S = 5.0


def run(body, **limits):
    """``body(server, dp)`` against a NativeGrpcServer with these limits."""
    async def main():
        dp = StrictDataPlane()
        settings = FrontendSettings(scheduler_addr="", host="127.0.0.1", grpc_port=0)
        server = NativeGrpcServer(rpc_methods(dp, settings), GrpcLimits(**limits))
        await server.start("127.0.0.1", 0)
        try:
            await asyncio.wait_for(body(server, dp), 20)
        finally:
            await server.stop(None)
    asyncio.run(main())


async def next_frame(c: RawClient, timeout: float = WAIT_S) -> tuple[int, int, int, bytes]:
    return await asyncio.wait_for(c.read_frame(), timeout)


async def until(c: RawClient, ftype: int, sid: int | None = None,
                timeout: float = WAIT_S) -> tuple[int, bytes]:
    """The flags and payload of the next frame of ``ftype`` (on stream ``sid``); SETTINGS
    acked on the way, other frames skipped."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        t, flags, fsid, payload = await next_frame(c, deadline - loop.time())
        if t == SETTINGS and not flags & ACK:
            c.frame(SETTINGS, ACK, 0)
        if t == ftype and (sid is None or fsid == sid):
            return flags, payload


async def goaway(c: RawClient) -> tuple[int, int, bytes]:
    """(last-stream-id, error code, debug data) of the server's GOAWAY."""
    _, payload = await until(c, GOAWAY)
    return (int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big"),
            bytes(payload[8:]))


async def reset_code(c: RawClient, sid: int) -> int:
    _, payload = await until(c, RST_STREAM, sid)
    return int.from_bytes(payload, "big")


async def closed(c: RawClient, timeout: float = WAIT_S) -> None:
    """The server closes the connection (frames before the end are skipped)."""
    async def drain():
        while await c.reader.read(65536):
            pass
    await asyncio.wait_for(drain(), timeout)


async def call_ok(c: RawClient, sid: int, rid: str = "ok") -> None:
    """One ModelInfer on stream ``sid`` of ``c``, answered correctly."""
    c.frame(HEADERS, END_HEADERS, sid, request_headers())
    c.frame(DATA, END_STREAM, sid, grpc_message(echo_request("m", rid).SerializeToString()))
    _, data, trailers = await c.response(sid)
    assert trailers[b"grpc-status"] == b"0"
    assert decode_response(data).id == rid


async def served(port: int) -> None:
    """A real gRPC client on a new connection is served."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                               response_deserializer=pb.ModelInferResponse.FromString)
        resp = await asyncio.wait_for(infer(echo_request("m", "after", n=3)), WAIT_S)
        assert resp.id == "after"
        assert resp.raw_output_contents[0] == b"\x01\0\0\0\x02\0\0\0\x03\0\0\0"


def server_conn(server: NativeGrpcServer) -> h2.H2Connection:
    (conn,) = server._connections
    return conn


# ---- SETTINGS we advertise ---------------------------------------------------------------
def test_our_settings_advertise_the_limits():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        flags, payload = await until(c, SETTINGS)
        assert not flags & ACK
        settings = {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                    for i in range(0, len(payload), 6)}
        assert settings[3] == 100                    # MAX_CONCURRENT_STREAMS
        assert settings[6] == 16384                  # MAX_HEADER_LIST_SIZE
        assert settings[2] == 0                      # ENABLE_PUSH
        c.close()
    run(body)


# ---- max concurrent streams ------------------------------------------------------------
def test_a_stream_beyond_max_concurrent_streams_is_refused():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        for sid in (1, 3, 5):                        # three calls held open (no END_STREAM)
            c.frame(HEADERS, END_HEADERS, sid, request_headers())
        c.frame(HEADERS, END_HEADERS, 7, request_headers())
        assert await reset_code(c, 7) == REFUSED_STREAM
        c.frame(DATA, 0, 7, b"late data of a refused stream is ignored")
        # finishing one makes room for another
        c.frame(DATA, END_STREAM, 1, grpc_message(echo_request("m", "one").SerializeToString()))
        _, data, trailers = await c.response(1)
        assert decode_response(data).id == "one"
        await call_ok(c, 9, "nine")
        c.frame(HEADERS, END_HEADERS, 11, request_headers())
        c.frame(HEADERS, END_HEADERS, 13, request_headers())
        assert await reset_code(c, 13) == REFUSED_STREAM
        c.close()
        await served(server.trireme_port)
    run(body, max_concurrent_streams=3)


def test_refusing_streams_without_end_is_a_flood():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.frame(HEADERS, END_HEADERS, 3, request_headers())          # open, the limit
        block = bytearray()
        for sid in range(5, 5 + 2 * 60, 2):                          # 60 refused streams
            block += frame_header(len(request_headers()), HEADERS, END_HEADERS, sid)
            block += request_headers()
        c.send(bytes(block))
        assert await goaway(c) == (3, ENHANCE_YOUR_CALM, b"")
        await closed(c)
        await served(server.trireme_port)
    run(body, max_concurrent_streams=1, max_control_frames=50)


# ---- header list size -------------------------------------------------------------------
def test_continuation_beyond_the_header_list_size_closes_the_connection():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        conn = server_conn(server)
        block = request_headers(extra=((b"x-big", b"v" * 20000),))
        c.frame(HEADERS, 0, 3, block[:4000])                         # no END_HEADERS
        for i in range(4000, len(block), 4000):
            c.frame(CONTINUATION, 0, 3, block[i:i + 4000])
        assert await goaway(c) == (1, ENHANCE_YOUR_CALM, b"")
        assert len(conn._header_block) <= 16384                     # never held beyond it
        await closed(c)
        await served(server.trireme_port)
    run(body)


def test_a_header_frame_declaring_more_than_the_limit_is_refused_before_its_payload():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.send(frame_header(500_000, HEADERS, END_HEADERS, 3) + b"\x00" * 100)
        assert await goaway(c) == (1, ENHANCE_YOUR_CALM, b"")
        await closed(c)
    run(body)


def test_a_header_block_that_decodes_beyond_the_limit_closes_the_connection():
    """An HPACK bomb: a 4,000-byte field put in the dynamic table, then referenced by
    one-byte indexes. The block is small, the header list it decodes to is not."""
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        value = b"v" * 4000
        insert = b"\x40" + h2._hpack_int(5, 7) + b"x-big" + h2._hpack_int(len(value), 7) + value
        block = request_headers() + insert + b"\xbe" * 8           # index 62: the new entry
        assert len(block) < 5000
        c.frame(HEADERS, END_HEADERS | END_STREAM, 3, block)
        assert await goaway(c) == (1, ENHANCE_YOUR_CALM, b"")
        await closed(c)
        await served(server.trireme_port)
    run(body)


def test_a_header_block_within_the_limit_is_served():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        block = request_headers(extra=((b"x-fits", b"f" * 12000),))
        c.frame(HEADERS, 0, 1, block[:5000])
        c.frame(CONTINUATION, 0, 1, block[5000:10000])
        c.frame(CONTINUATION, END_HEADERS, 1, block[10000:])
        c.frame(DATA, END_STREAM, 1, grpc_message(echo_request("m", "fits").SerializeToString()))
        _, data, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"0"
        assert decode_response(data).id == "fits"
        c.close()
    run(body)


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
        await closed(c)
        await served(server.trireme_port)
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
        await closed(c)
        await served(server.trireme_port)
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
            burst += frame_header(len(request_headers()), HEADERS, END_HEADERS, sid)
            burst += request_headers()
            burst += frame_header(4, RST_STREAM, 0, sid) + (8).to_bytes(4, "big")
        c.send(bytes(burst))
        assert await goaway(c) == (3 + 2 * 9, ENHANCE_YOUR_CALM, b"")
        await closed(c)
        await served(server.trireme_port)
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


# ---- flow control --------------------------------------------------------------------------
def test_connection_window_overflow_is_a_flow_control_error():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.frame(WINDOW_UPDATE, 0, 0, MAX_WINDOW.to_bytes(4, "big"))
        assert await goaway(c) == (1, FLOW_CONTROL_ERROR, b"")
        await closed(c)
        await served(server.trireme_port)
    run(body)


def test_stream_window_overflow_resets_the_stream_only():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)   # streams start at 2^31-1
        c.frame(HEADERS, END_HEADERS, 1, request_headers())
        c.frame(WINDOW_UPDATE, 0, 1, (1).to_bytes(4, "big"))
        assert await reset_code(c, 1) == FLOW_CONTROL_ERROR
        await call_ok(c, 3)
        c.close()
    run(body)


def test_initial_window_change_that_overflows_a_stream_is_a_flow_control_error():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port, {4: 65_535})
        await call_ok(c, 1)
        c.frame(HEADERS, END_HEADERS, 3, request_headers())
        c.frame(WINDOW_UPDATE, 0, 3, (MAX_WINDOW - 65_535).to_bytes(4, "big"))   # at the max
        c.frame(SETTINGS, 0, 0, b"\x00\x04" + (65_536).to_bytes(4, "big"))
        assert await goaway(c) == (3, FLOW_CONTROL_ERROR, b"")
        await closed(c)
    run(body)


# ---- RFC 9113 frame rules ------------------------------------------------------------------
CONNECTION_ERRORS = {
    # name: (frames after one call on stream 1, error code)
    "SETTINGS not a multiple of 6": (frame_header(5, SETTINGS, 0, 0) + b"\0" * 5, FRAME_SIZE_ERROR),
    "SETTINGS declared 7, never sent": (frame_header(7, SETTINGS, 0, 0), FRAME_SIZE_ERROR),
    "SETTINGS ACK with a payload": (frame_header(6, SETTINGS, ACK, 0) + b"\0" * 6, FRAME_SIZE_ERROR),
    "PING of 7": (frame_header(7, PING, 0, 0) + b"\0" * 7, FRAME_SIZE_ERROR),
    "WINDOW_UPDATE of 3": (frame_header(3, WINDOW_UPDATE, 0, 0) + b"\0" * 3, FRAME_SIZE_ERROR),
    "RST_STREAM of 5": (frame_header(5, RST_STREAM, 0, 1) + b"\0" * 5, FRAME_SIZE_ERROR),
    "GOAWAY of 4": (frame_header(4, GOAWAY, 0, 0) + b"\0" * 4, FRAME_SIZE_ERROR),
    "HEADERS too short for priority": (frame_header(3, HEADERS, END_HEADERS | PRIORITY_FLAG, 3)
                                       + b"\0" * 3, FRAME_SIZE_ERROR),
    "frame beyond our max frame size": (frame_header(2**21, DATA, 0, 1), FRAME_SIZE_ERROR),
    "WINDOW_UPDATE of 0": (frame_header(4, WINDOW_UPDATE, 0, 0) + b"\0" * 4, PROTOCOL_ERROR),
    "CONTINUATION without HEADERS": (frame_header(1, CONTINUATION, END_HEADERS, 3) + b"\x82",
                                     PROTOCOL_ERROR),
    "DATA on stream 0": (frame_header(1, DATA, 0, 0) + b"x", PROTOCOL_ERROR),
    "DATA on an idle stream": (frame_header(1, DATA, 0, 99) + b"x", PROTOCOL_ERROR),
    "RST_STREAM on an idle stream": (frame_header(4, RST_STREAM, 0, 99) + b"\0" * 4, PROTOCOL_ERROR),
    "WINDOW_UPDATE on an idle stream": (frame_header(4, WINDOW_UPDATE, 0, 99) + b"\0\0\0\1",
                                        PROTOCOL_ERROR),
    "padding longer than the frame": (frame_header(3, DATA, PADDED, 1) + b"\x05ab", PROTOCOL_ERROR),
    "PING on a stream": (frame_header(8, PING, 0, 1) + b"\0" * 8, PROTOCOL_ERROR),
    "SETTINGS on a stream": (frame_header(0, SETTINGS, 0, 1), PROTOCOL_ERROR),
    "HEADERS on an even stream": (frame_header(1, HEADERS, END_HEADERS, 2) + b"\x82", PROTOCOL_ERROR),
    "ENABLE_PUSH of 2": (frame_header(6, SETTINGS, 0, 0) + b"\x00\x02\x00\x00\x00\x02", PROTOCOL_ERROR),
    "PUSH_PROMISE": (frame_header(4, PUSH_PROMISE, END_HEADERS, 1) + b"\0\0\0\2", PROTOCOL_ERROR),
}


@pytest.mark.parametrize("name", list(CONNECTION_ERRORS))
def test_connection_errors(name):
    frames, code = CONNECTION_ERRORS[name]

    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.send(frames)
        assert await goaway(c) == (1, code, b"")
        await closed(c)
        await served(server.trireme_port)
    run(body)


@pytest.mark.parametrize("frame,code", [
    (frame_header(4, PRIORITY, 0, 3) + b"\0" * 4, FRAME_SIZE_ERROR),      # RFC 9113 §6.3
    (frame_header(4, WINDOW_UPDATE, 0, 3) + b"\0" * 4, PROTOCOL_ERROR),   # §6.9
], ids=["PRIORITY of 4", "stream WINDOW_UPDATE of 0"])
def test_stream_errors_leave_the_connection_serving(frame, code):
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, END_HEADERS, 3, request_headers())
        c.send(frame)
        assert await reset_code(c, 3) == code
        await call_ok(c, 5)
        c.close()
    run(body)


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


# ---- timeouts ------------------------------------------------------------------------------
def test_no_preface_is_closed_after_the_handshake_timeout():
    async def body(server, dp):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.trireme_port)
        writer.write(b"PRI * HTTP/2.0\r\n")                 # half a preface, then nothing
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), WAIT_S) != b"x"   # until EOF
        assert reader.at_eof()
        assert asyncio.get_running_loop().time() - t0 < 2
        writer.close()
        c = await RawClient.connect(server.trireme_port)        # a prompt client is served
        await asyncio.sleep(0.4)
        await call_ok(c, 1)
        c.close()
    run(body, handshake_timeout_s=0.2)


def test_preface_without_settings_gets_settings_timeout():
    async def body(server, dp):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.trireme_port)
        c = RawClient(reader, writer)
        c.send(PREFACE)
        assert await goaway(c) == (0, SETTINGS_TIMEOUT, b"")
        await closed(c)
    run(body, handshake_timeout_s=0.2)


def test_an_idle_connection_gets_goaway_and_is_closed():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, END_HEADERS, 1, request_headers())
        c.frame(DATA, END_STREAM, 1, grpc_message(echo_request("slow", "held").SerializeToString()))
        await asyncio.sleep(0.6)                  # 3 idle timeouts with a call open: kept
        dp.gate.set()
        _, data, _ = await c.response(1)
        assert decode_response(data).id == "held"
        t0 = asyncio.get_running_loop().time()
        assert await goaway(c) == (1, NO_ERROR, b"idle_timeout")
        assert asyncio.get_running_loop().time() - t0 < 1.5
        await closed(c)
    run(body, idle_timeout_s=0.2)


def test_keepalive_pings_and_the_watchdog():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        flags, payload = await until(c, PING)         # the server's keepalive PING
        assert flags == 0 and payload == b"trireme!"
        c.frame(PING, ACK, 0, payload)                # answered: another one comes
        flags, payload = await until(c, PING)
        assert flags == 0
        assert await goaway(c) == (0, NO_ERROR, b"keepalive_timeout")   # not answered
        await closed(c)
    run(body, keepalive_time_ms=100, keepalive_timeout_ms=1000, keepalive_permit_without_calls=True,
        max_pings_without_data=0)


def test_keepalive_sends_at_most_max_pings_without_data():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        for _ in range(2):
            _, payload = await until(c, PING)
            c.frame(PING, ACK, 0, payload)
        with pytest.raises(TimeoutError):              # a third waits for our data
            await until(c, PING, timeout=0.5)
        await call_ok(c, 1)
        _, payload = await until(c, PING)
        c.close()
    run(body, keepalive_time_ms=50, keepalive_permit_without_calls=True)


def test_no_keepalive_without_calls_unless_permitted():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        with pytest.raises(TimeoutError):
            await until(c, PING, timeout=0.4)
        c.frame(HEADERS, END_HEADERS, 1, request_headers())      # a call open: PINGs come
        await until(c, PING)
        c.close()
    run(body, keepalive_time_ms=50)


def test_max_connection_age():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, END_HEADERS, 1, request_headers())
        c.frame(DATA, END_STREAM, 1, grpc_message(echo_request("slow", "aged").SerializeToString()))
        assert await goaway(c) == (1, NO_ERROR, b"max_age")
        await closed(c)                               # the grace period ended the call
    run(body, max_connection_age_ms=100, max_connection_age_grace_ms=200)


# ---- message size ----------------------------------------------------------------------------
def test_a_length_prefix_allocates_nothing_until_the_bytes_arrive():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        tracemalloc.start()
        try:
            c.frame(HEADERS, END_HEADERS, 3, request_headers())
            c.frame(DATA, 0, 3, b"\x00" + (2_000_000_000).to_bytes(4, "big") + b"x" * 1000)
            conn = server_conn(server)
            while 3 not in conn._streams or conn._streams[3].app.body is None:
                await asyncio.sleep(0.005)
            call = conn._streams[3].app
            assert len(call.body) == 1000 and call.size == 2_000_000_000
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, peak
        c.frame(DATA, END_STREAM, 3, b"y" * 100)
        _, _, trailers = await c.response(3)
        assert trailers[b"grpc-status"] == b"13"
        assert trailers[b"grpc-message"] == b"truncated gRPC message"
        await call_ok(c, 5)
        c.close()
    run(body)


def test_max_message_size():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, END_HEADERS, 1, request_headers())
        c.frame(DATA, 0, 1, b"\x00" + (1001).to_bytes(4, "big"))   # the prefix alone
        _, _, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"8"
        assert trailers[b"grpc-message"] == b"Received message larger than max (1001 vs. 1000)"
        assert await reset_code(c, 1) == NO_ERROR        # stop sending the rest
        await call_ok(c, 3)
        c.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
            infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(echo_request("m", "big", n=1000))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await infer(echo_request("m", "small"))).id == "small"
    run(body, max_message_size=1000)


def test_a_compressed_message_is_inflated_only_up_to_the_limit():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        bomb = gzip.compress(b"\0" * (50 << 20))                   # 50 MiB from ~50 KB
        assert len(bomb) < 100_000
        c.frame(HEADERS, END_HEADERS, 1, request_headers(extra=((b"grpc-encoding", b"gzip"),)))
        c.frame(DATA, END_STREAM, 1, grpc_message(bomb, compressed=True))
        _, _, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"8"
        assert trailers[b"grpc-message"] == (b"Received message larger than max (more than "
                                             b"1048576 once decompressed vs. 1048576)")
        assert await reset_code(c, 1) == NO_ERROR
        await call_ok(c, 3)
        c.close()
    run(body, max_message_size=1 << 20)


# ---- flags and the grpc.aio equivalents --------------------------------------------------------
def test_flags_map_to_limits_and_are_forwarded():
    import argparse

    from services.frontend.main import add_frontend_args, frontend_argv, settings_from_args
    p = argparse.ArgumentParser()
    add_frontend_args(p)
    args = p.parse_args(["--grpc-max-message-size", "1234", "--grpc-keepalive-time", "5000",
                         "--grpc-keepalive-permit-without-calls", "1",
                         "--grpc-http2-max-concurrent-streams", "7",
                         "--grpc-http2-max-ping-strikes", "0", "--grpc-idle-timeout-secs", "0"])
    limits = settings_from_args(args, "ipc:///x").grpc_limits
    assert (limits.max_message_size, limits.keepalive_time_ms, limits.keepalive_permit_without_calls,
            limits.max_concurrent_streams, limits.max_ping_strikes, limits.idle_timeout_s) == \
        (1234, 5000, True, 7, 0, 0.0)
    assert settings_from_args(p.parse_args([]), "ipc:///x").grpc_limits == GrpcLimits()
    again = p.parse_args(frontend_argv(args))
    assert settings_from_args(again, "ipc:///x").grpc_limits == limits
    with pytest.raises(SystemExit):
        p.parse_args(["--grpc-http2-max-ping-strikes", "-1"])
    # Triton's flag names, units and defaults
    names = {a.option_strings[0]: a.default for a in add_grpc_limit_args(argparse.ArgumentParser())}
    assert {k: names[k] for k in ("--grpc-keepalive-time", "--grpc-keepalive-timeout",
                                  "--grpc-keepalive-permit-without-calls",
                                  "--grpc-http2-max-pings-without-data",
                                  "--grpc-http2-min-recv-ping-interval-without-data",
                                  "--grpc-http2-max-ping-strikes")} == {
        "--grpc-keepalive-time": 7200000, "--grpc-keepalive-timeout": 20000,
        "--grpc-keepalive-permit-without-calls": False, "--grpc-http2-max-pings-without-data": 2,
        "--grpc-http2-min-recv-ping-interval-without-data": 300000,
        "--grpc-http2-max-ping-strikes": 2}


def test_aio_server_gets_the_same_limits():
    options = dict(server_options(GrpcLimits(max_message_size=1000, max_concurrent_streams=7,
                                             keepalive_permit_without_calls=True,
                                             max_connection_age_ms=5)))
    assert options["grpc.max_receive_message_length"] == 1000
    assert options["grpc.max_concurrent_streams"] == 7
    assert options["grpc.keepalive_time_ms"] == 7200000
    assert options["grpc.keepalive_timeout_ms"] == 20000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 2
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 300000
    assert options["grpc.http2.max_ping_strikes"] == 2
    assert options["grpc.max_connection_age_ms"] == 5
    assert options["grpc.absolute_max_metadata_size"] == 16384

    async def main():
        dp = StrictDataPlane()
        settings = FrontendSettings(scheduler_addr="", host="127.0.0.1", grpc_port=0,
                                    grpc_impl="aio", grpc_limits=GrpcLimits(max_message_size=1000))
        server = await start_grpc(dp, settings)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
                infer = ch.unary_unary(INFER,
                                       request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelInferResponse.FromString)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await infer(echo_request("m", "big", n=1000))
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert (await infer(echo_request("m", "small"))).id == "small"
        finally:
            await server.stop(None)
    asyncio.run(asyncio.wait_for(main(), 20))


def test_limits_are_checked():
    with pytest.raises(ValueError):
        GrpcLimits(max_concurrent_streams=0)
    with pytest.raises(ValueError):
        GrpcLimits(max_header_list_size=100)
    with pytest.raises(ValueError):
        GrpcLimits(keepalive_time_ms=-1)
    assert encode_literal_headers([]) == b""
