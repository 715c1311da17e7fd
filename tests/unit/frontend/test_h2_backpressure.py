"""Backpressure on the native gRPC server: what it holds for a client that does not read is
bounded (GrpcLimits.max_pending_stream_bytes / max_pending_connection_bytes / recv_window).

The client here sends within the windows the server gives it and never gives the server
any: it reads frames off the socket (as a transport does) but its application takes no
answer, so its stream windows stay shut. The server must stop taking its requests (no more
credit, no more calls started), hold at most its bounds of answers, and serve everything
once the client reads again. The server is the real NativeGrpcServer over a fake data plane.
"""
from __future__ import annotations

import asyncio

from protos import grpc_service_pb2 as pb
from services.frontend.grpc.h2_frames import frame_header
from tests.unit.frontend.h2_raw import (
    DATA,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    HEADERS,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    call_ok,
    goaway,
    reset_code,
    run,
    served,
    server_conn,
)
from tests.unit.frontend.test_grpc_codec import echo_request
from tests.unit.frontend.test_grpc_native import RawClient, decode_response, grpc_message, request_headers

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
KIB = 1024
QUIET_S = 0.5      # no credit for this long: the server has stopped taking requests


class NonReader:
    """A raw HTTP/2 client that respects the server's windows and opens none of its own."""

    def __init__(self, c: RawClient, window: int) -> None:
        self.c = c
        self.conn_credit = 65_535        # RFC 9113's, until the server's WINDOW_UPDATE
        self.initial = window            # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.credit: dict[int, int] = {}
        self.frames: list[tuple[int, int, int, bytes]] = []   # everything else, in order

    @classmethod
    async def connect(cls, port: int, window: int) -> NonReader:
        c = await RawClient.connect(port, {4: 0})   # the server may send us no DATA
        return cls(c, window)

    def open(self, sid: int, path: str) -> None:
        self.credit[sid] = self.initial
        self.c.frame(HEADERS, END_HEADERS, sid, request_headers(path))

    async def _read(self, timeout: float) -> bool:
        try:
            ftype, flags, sid, payload = await asyncio.wait_for(self.c.read_frame(), timeout)
        except TimeoutError:
            return False
        if ftype == WINDOW_UPDATE:
            inc = int.from_bytes(payload, "big")
            if sid:
                self.credit[sid] = self.credit.get(sid, self.initial) + inc
            else:
                self.conn_credit += inc
        elif ftype == SETTINGS and not flags & 1:
            self.c.frame(SETTINGS, 1, 0)
        else:
            self.frames.append((ftype, flags, sid, payload))
        return True

    async def send(self, sid: int, message: bytes, end: bool = False) -> bool:
        """Send ``message`` on ``sid`` as credit allows; False if none comes for QUIET_S."""
        while min(self.conn_credit, self.credit[sid]) < len(message):
            if not await self._read(QUIET_S):
                return False
        self.conn_credit -= len(message)
        self.credit[sid] -= len(message)
        self.c.frame(DATA, END_STREAM if end else 0, sid, message)
        return True

    def read_again(self) -> None:
        """The application reads: every stream window opens wide (the connection's was
        from the start: RawClient.connect)."""
        self.c.send(frame_header(6, SETTINGS, 0, 0) + (4).to_bytes(2, "big")
                    + (1 << 30).to_bytes(4, "big"))

    async def messages(self, sid: int, count: int) -> list[bytes]:
        """The first ``count`` gRPC messages of stream ``sid`` (frames arrived so far first)."""
        body = bytearray()
        out: list[bytes] = []
        i = 0
        while len(out) < count:
            while i >= len(self.frames):
                assert await self._read(5.0), f"only {len(out)} of {count} answers came"
            ftype, _, fsid, payload = self.frames[i]
            i += 1
            assert ftype != RST_STREAM, f"stream {fsid} reset"
            if ftype == DATA and fsid == sid:
                body += payload
                while len(body) >= 5 and len(body) >= 5 + int.from_bytes(body[1:5], "big"):
                    n = int.from_bytes(body[1:5], "big")
                    out.append(bytes(body[:5 + n]))
                    del body[:5 + n]
        return out


def _request(rid: str, n: int) -> bytes:
    return grpc_message(echo_request("m", rid, n=n).SerializeToString())


def test_a_stream_that_never_reads_stops_being_served_and_resumes():
    """8 KiB answers, a 64 KiB bound: the server takes a bounded number of the stream's
    requests, then gives no more credit; once the client reads, every answer comes, in order."""
    async def body(server, dp):
        client = await NonReader.connect(server.trireme_port, 64 * KIB)
        client.open(1, STREAM)
        total = 60
        sent = 0
        while sent < total and await client.send(1, _request(f"r{sent}", 2 * KIB)):
            sent += 1
        assert sent < total                              # it stopped taking requests
        conn = server_conn(server)
        assert conn.queued_bytes <= 64 * KIB + 9 * KIB   # the bound, plus one answer
        assert dp.fast_seen <= 16                        # 8 answers queued, a few more held
        client.read_again()
        for i in range(sent, total):
            assert await client.send(1, _request(f"r{i}", 2 * KIB), end=i == total - 1)
        answers = await client.messages(1, total)
        ids = [decode_stream(a) for a in answers]
        assert ids == [f"r{i}" for i in range(total)]
        assert conn.queued_bytes == 0
        client.c.close()
    run(body, recv_window=64 * KIB, max_pending_stream_bytes=64 * KIB)


def decode_stream(message: bytes) -> str:
    resp = pb.ModelStreamInferResponse.FromString(message[5:])
    assert not resp.error_message, resp.error_message
    return resp.infer_response.id


def test_unary_calls_on_a_connection_that_never_reads_wait_at_its_bound():
    """32 KiB answers, a 256 KiB connection bound: calls start while their answers fit
    (eight); the others wait with their requests until the credit stops; reading serves
    them all."""
    async def body(server, dp):
        client = await NonReader.connect(server.trireme_port, 64 * KIB)
        total = 40
        sent = 0
        for i in range(total):
            sid = 1 + 2 * i
            client.open(sid, "/inference.GRPCInferenceService/ModelInfer")
            if not await client.send(sid, _request(f"u{i}", 8 * KIB), end=True):
                break
            sent += 1
        assert sent < total
        conn = server_conn(server)
        assert conn.queued_bytes <= 256 * KIB + 33 * KIB
        assert dp.fast_seen <= 10                        # the answers the bound holds
        client.read_again()
        for i in range(sent, total):
            sid = 1 + 2 * i
            if i > sent:
                client.open(sid, "/inference.GRPCInferenceService/ModelInfer")
            assert await client.send(sid, _request(f"u{i}", 8 * KIB), end=True)
        for i in range(total):
            (answer,) = await client.messages(1 + 2 * i, 1)
            assert decode_response(answer).id == f"u{i}"
        client.c.close()
    run(body, recv_window=64 * KIB, max_pending_connection_bytes=256 * KIB)


def test_an_answer_that_waits_past_the_send_timeout_is_reset():
    async def body(server, dp):
        client = await NonReader.connect(server.trireme_port, 1 << 20)
        client.open(1, "/inference.GRPCInferenceService/ModelInfer")
        assert await client.send(1, _request("stuck", 4 * KIB), end=True)
        assert await reset_code(client.c, 1) == 8        # CANCEL, once the timeout passed
        assert server_conn(server).queued_bytes == 0     # what it held is gone
        client.read_again()
        await call_ok(client.c, 3, "next")               # the connection goes on
        client.c.close()
        await served(server.trireme_port)
    run(body, send_timeout_s=0.3)


def test_data_beyond_the_window_is_a_flow_control_error():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, END_HEADERS, 1, request_headers())
        c.frame(DATA, 0, 1, bytes(64 * KIB))             # one byte past a 65,535-byte window
        assert (await goaway(c))[1] == FLOW_CONTROL_ERROR
        await served(server.trireme_port)
    run(body, recv_window=65_535)

