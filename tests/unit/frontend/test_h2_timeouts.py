"""The native gRPC server's timers and frame rules (grpc/limits.py, grpc/h2*.py), with raw
HTTP/2 frames: handshake, idle, keepalive and connection-age timers, flow control, and the
RFC 9113 frame rules. The helpers are in h2_raw.py.
"""
from __future__ import annotations

import asyncio

import pytest

from services.frontend.grpc.h2_frames import PREFACE, frame_header
from tests.unit.frontend.h2_raw import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_TIMEOUT,
    WAIT_S,
    WINDOW_UPDATE,
    call_ok,
    closed,
    closed_then_served,
    goaway,
    reset_code,
    run,
    until,
)
from tests.unit.frontend.test_grpc_codec import echo_request
from tests.unit.frontend.test_grpc_native import RawClient, decode_response, grpc_message, request_headers


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


# ---- flow control --------------------------------------------------------------------------
def test_connection_window_overflow_is_a_flow_control_error():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        await call_ok(c, 1)
        c.frame(WINDOW_UPDATE, 0, 0, MAX_WINDOW.to_bytes(4, "big"))
        assert await goaway(c) == (1, FLOW_CONTROL_ERROR, b"")
        await closed_then_served(c, server.trireme_port)
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
        await closed_then_served(c, server.trireme_port)
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
