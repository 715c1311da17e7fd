"""The native gRPC server's limits (grpc/limits.py) on streams, headers and message size,
with raw HTTP/2 frames; the flags that set them and their grpc.aio equivalents.

The helpers, and how each test goes, are in h2_raw.py. Floods: test_h2_floods.py; timers,
flow control and frame rules: test_h2_timeouts.py.
"""
from __future__ import annotations

import asyncio
import gzip
import tracemalloc

import grpc
import pytest

from protos import grpc_service_pb2 as pb
from services.frontend.grpc import h2
from services.frontend.grpc.aio_server import server_options
from services.frontend.grpc.h2_frames import encode_literal_headers, frame_header
from services.frontend.grpc.limits import GrpcLimits, add_grpc_limit_args
from services.frontend.grpc.methods import start_grpc
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.h2_raw import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    NO_ERROR,
    REFUSED_STREAM,
    SETTINGS,
    call_ok,
    closed,
    closed_then_served,
    goaway,
    reset_code,
    run,
    served,
    server_conn,
    until,
)
from tests.unit.frontend.test_grpc_codec import echo_request
from tests.unit.frontend.test_grpc_native import (
    INFER,
    RawClient,
    StrictDataPlane,
    decode_response,
    grpc_message,
    request_headers,
)


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
        assert len(conn.receiver._header_block) <= 16384            # never held beyond it
        await closed_then_served(c, server.trireme_port)
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
        await closed_then_served(c, server.trireme_port)
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
