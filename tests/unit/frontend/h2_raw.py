"""Raw HTTP/2 frames against the native gRPC server: the shared helpers of test_h2_*.py.

Each test breaks one rule on one connection and checks the exact answer (RST_STREAM or
GOAWAY, its error code and last-stream-id), then that a well-behaved client is served: on
the same connection after a stream error, on a new one after a connection error. The server
is the real NativeGrpcServer over a fake data plane (no scheduler, no workers); the limits
are passed in small so that each rule trips in a few frames.
"""
from __future__ import annotations

import asyncio

import grpc

from protos import grpc_service_pb2 as pb
from services.frontend.grpc import h2
from services.frontend.grpc.h2_frames import frame_header
from services.frontend.grpc.limits import GrpcLimits
from services.frontend.grpc.methods import rpc_methods
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


async def closed_then_served(c: RawClient, port: int) -> None:
    """After a connection error: the server closes ``c``, and a new connection is served."""
    await closed(c)
    await served(port)


def headers_frame(sid: int) -> bytes:
    """A HEADERS frame opening a ModelInfer call on stream ``sid`` (no END_STREAM)."""
    return frame_header(len(request_headers()), HEADERS, END_HEADERS, sid) + request_headers()
