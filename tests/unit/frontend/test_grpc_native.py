"""The native gRPC server (grpc_native over h2_connection) at the HTTP/2 level: flow control,
messages split across frames and reads, compression, bad clients, graceful stop.

A raw HTTP/2 client written here (frames by hand, HPACK by the `hpack` package) checks what a
grpc library would hide; the real grpc.aio client checks interoperability. Both run against
the service over a fake data plane (no scheduler, no workers).
"""
from __future__ import annotations

import asyncio
import gc
import zlib

import grpc
import numpy as np
import pytest
from hpack import Decoder

from protos import grpc_service_pb2 as pb
from services.common.errors import Code, TriremeError
from services.frontend.grpc import native
from services.frontend.grpc.h2_frames import PREFACE, encode_literal_headers, frame_header
from services.frontend.grpc.methods import start_grpc
from services.frontend.settings import FrontendSettings
from tests.unit.frontend.test_grpc_codec import FakeDataPlane, echo_request

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
INFER = "/inference.GRPCInferenceService/ModelInfer"


class StrictDataPlane(FakeDataPlane):
    """Knows only model 'm' (and 'slow')."""

    async def infer(self, req, endpoint: str = ""):
        if req.model not in ("m", "slow"):
            raise TriremeError(Code.NOT_FOUND,
                               f"Request for unknown model: '{req.model}' is not found")
        return await super().infer(req, endpoint)


def run(body):
    async def main():
        dp = StrictDataPlane()
        server = await start_grpc(dp, FrontendSettings(scheduler_addr="", host="127.0.0.1",
                                                       grpc_port=0))
        try:
            await asyncio.wait_for(body(server, dp), 20)
        finally:
            await server.stop(None)
    asyncio.run(main())


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + len(payload).to_bytes(4, "big") + payload


def request_headers(path: str = INFER, content_type: bytes = b"application/grpc",
                    extra: tuple = ()) -> bytes:
    return encode_literal_headers([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
        (b":authority", b"test"), (b"content-type", content_type), (b"te", b"trailers"),
        *extra])


class RawClient:
    """Just enough HTTP/2 to drive one connection by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = Decoder()
        self.streams: dict[int, tuple[dict, bytearray, dict]] = {}
        self.done: dict[int, tuple[dict, bytes, dict]] = {}

    @classmethod
    async def connect(cls, port: int, settings: dict[int, int] | None = None) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        c = cls(reader, writer)
        settings = settings or {4: 2**31 - 1}     # INITIAL_WINDOW_SIZE: never wait for credit
        payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big")
                           for k, v in settings.items())
        c.send(PREFACE + frame_header(len(payload), SETTINGS, 0, 0) + payload)
        c.frame(WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65_535).to_bytes(4, "big"))
        return c

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def frame(self, ftype: int, flags: int, sid: int, payload: bytes = b"") -> None:
        self.send(frame_header(len(payload), ftype, flags, sid) + payload)

    async def read_frame(self) -> tuple[int, int, int, bytes]:
        head = await self.reader.readexactly(9)
        length = int.from_bytes(head[:3], "big")
        payload = await self.reader.readexactly(length)
        return head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF, payload

    async def response(self, sid: int, on_data=None) -> tuple[dict, bytes, dict]:
        """Headers, body bytes and trailers of stream ``sid``; frames of other streams are
        kept for their turn, SETTINGS acked on the way; ``on_data(n)`` sees the size of
        every DATA frame of ``sid``."""
        while sid not in self.done:
            ftype, flags, fsid, payload = await self.read_frame()
            if ftype == SETTINGS and not flags & 1:
                self.frame(SETTINGS, 1, 0)
            if fsid == 0:
                continue
            headers, body, _ = self.streams.setdefault(fsid, ({}, bytearray(), {}))
            if ftype == HEADERS:
                block = dict(self.decoder.decode(payload, raw=True))
                if flags & 1:                  # END_STREAM: trailers (or Trailers-Only)
                    self.done[fsid] = (headers or block, bytes(body), block)
                else:
                    headers.update(block)
            elif ftype == DATA:
                body += payload
                if on_data and fsid == sid:
                    on_data(len(payload))
                if flags & 1:
                    self.done[fsid] = (headers, bytes(body), {})
            elif ftype == RST_STREAM:
                raise AssertionError(f"stream {fsid} reset: {payload.hex()}")
        return self.done.pop(sid)

    def close(self) -> None:
        self.writer.close()


def decode_response(body: bytes) -> pb.ModelInferResponse:
    assert body[0] == 0
    assert int.from_bytes(body[1:5], "big") == len(body) - 5
    return pb.ModelInferResponse.FromString(body[5:])


def test_server_never_sends_beyond_the_clients_window():
    """The client opens streams with a 1,000-byte window and grants 1,000 more each time it
    is used up; every DATA frame must fit in the credit given so far."""
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port, {4: 1000})   # INITIAL_WINDOW_SIZE
        c.frame(HEADERS, 4, 1, request_headers())
        c.frame(DATA, 1, 1, grpc_message(echo_request("m", "w", n=5000).SerializeToString()))
        state = {"received": 0, "credit": 1000}

        def on_data(n: int) -> None:
            state["received"] += n
            assert state["received"] <= state["credit"], state
            if state["received"] == state["credit"]:
                state["credit"] += 1000
                c.frame(WINDOW_UPDATE, 0, 1, (1000).to_bytes(4, "big"))
        headers, data, trailers = await c.response(1, on_data)
        assert headers[b":status"] == b"200"
        assert trailers[b"grpc-status"] == b"0"
        resp = decode_response(data)
        assert resp.id == "w"
        assert resp.raw_output_contents[0] == np.arange(1, 5001, dtype="<i4").tobytes()
        assert state["credit"] > 20_000                  # it really had to wait for credit
        c.close()
    run(body)


def test_message_split_across_frames_and_a_split_prefix():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        msg = grpc_message(echo_request("m", "split", n=20_000).SerializeToString())
        c.frame(HEADERS, 4, 1, request_headers())
        c.frame(DATA, 0, 1, msg[:3])                     # half of the 5-byte prefix
        for i in range(3, len(msg), 7000):
            c.frame(DATA, 0, 1, msg[i:i + 7000])
        c.frame(DATA, 1, 1, b"")                         # END_STREAM alone
        # A second call on the same connection: one large frame, written in small pieces.
        msg2 = grpc_message(echo_request("m", "pieces", n=50_000).SerializeToString())
        raw = frame_header(len(msg2), DATA, 1, 3) + msg2
        c.frame(HEADERS, 4, 3, request_headers())
        for i in range(0, len(raw), 4096):
            c.send(raw[i:i + 4096])
            await c.writer.drain()
        _, data, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"0"
        assert decode_response(data).raw_output_contents[0] == np.arange(
            1, 20_001, dtype="<i4").tobytes()
        _, data, trailers = await c.response(3)
        assert trailers[b"grpc-status"] == b"0"
        assert decode_response(data).raw_output_contents[0] == np.arange(
            1, 50_001, dtype="<i4").tobytes()
        c.close()
    run(body)


def test_ping_is_answered_and_unknown_routes_are_refused():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(PING, 0, 0, b"12345678")
        while True:
            ftype, flags, _, payload = await c.read_frame()
            if ftype == PING:
                assert flags == 1 and payload == b"12345678"
                break
        c.frame(HEADERS, 5, 1, request_headers("/inference.GRPCInferenceService/Nope"))
        _, _, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"12"
        assert trailers[b"grpc-message"] == b"Method not found!"
        c.frame(HEADERS, 5, 3, request_headers(content_type=b"application/json"))
        headers, _, _ = await c.response(3)
        assert headers[b":status"] == b"415"
        c.frame(HEADERS, 4, 5, request_headers())                 # an undecodable message
        c.frame(DATA, 1, 5, grpc_message(b"\xff\xff\xff"))
        _, _, trailers = await c.response(5)
        assert trailers[b"grpc-status"] == b"3"    # INVALID_ARGUMENT: the client's fault
        assert trailers[b"grpc-message"].startswith(b"malformed ModelInferRequest: ")
        c.close()
    run(body)


def test_error_text_is_percent_encoded():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, 4, 1, request_headers())
        c.frame(DATA, 1, 1, grpc_message(echo_request("nope", "").SerializeToString()))
        _, _, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"5"
        assert trailers[b"grpc-message"] == b"Request for unknown model: 'nope' is not found"
        c.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
            infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(echo_request("nöpe 100%\n", ""))
            assert info.value.details() == "Request for unknown model: 'nöpe 100%\n' is not found"
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, 4, 1, request_headers())
        c.frame(DATA, 1, 1, grpc_message(echo_request("é%", "").SerializeToString()))
        _, _, trailers = await c.response(1)
        assert trailers[b"grpc-message"] == b"Request for unknown model: '%C3%A9%25' is not found"
        c.close()
    run(body)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_requests(encoding):
    async def body(server, dp):
        raw = echo_request("m", "z", n=1000).SerializeToString()
        c = await RawClient.connect(server.trireme_port)
        packed = zlib.compress(raw) if encoding == "deflate" else _gzip(raw)
        c.frame(HEADERS, 4, 1, request_headers(extra=((b"grpc-encoding", encoding.encode()),)))
        c.frame(DATA, 1, 1, grpc_message(packed, compressed=True))
        _, data, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"0"
        assert decode_response(data).id == "z"
        c.close()
        algo = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}[encoding]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}",
                                             compression=algo) as ch:
            infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
            resp = await infer(echo_request("m", "zz", n=1000))
            assert resp.raw_output_contents[0] == np.arange(1, 1001, dtype="<i4").tobytes()
    run(body)


def _gzip(data: bytes) -> bytes:
    z = zlib.compressobj(wbits=31)
    return z.compress(data) + z.flush()


def test_not_http2_is_closed_and_the_server_keeps_serving():
    async def body(server, dp):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.trireme_port)
        writer.write(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.read()                                 # until the server closes it
        assert reader.at_eof()
        writer.close()
        c = await RawClient.connect(server.trireme_port)
        c.send(frame_header(2**21, DATA, 0, 1))             # larger than we accept
        while True:
            ftype, _, _, payload = await c.read_frame()
            if ftype == GOAWAY:
                assert int.from_bytes(payload[4:8], "big") == 6   # FRAME_SIZE_ERROR
                break
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
            live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                  request_serializer=pb.ServerLiveRequest.SerializeToString,
                                  response_deserializer=pb.ServerLiveResponse.FromString)
            assert (await live(pb.ServerLiveRequest())).live
    run(body)


def test_deadline_cancels_the_call():
    async def body(server, dp):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
            infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(echo_request("slow", "late"), timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await dp.slow_cancelled.wait()        # the client's RST_STREAM cancelled the call
            while server.calls:                   # its done-callbacks run on the next turn
                await asyncio.sleep(0)
    run(body)


def test_a_cancelled_call_leaves_no_reference_cycle():
    """A call ended by its client (deadline, cancel), unary or streaming, is freed when it
    ends, without the cyclic GC: an idle frontend hardly runs it (procutil.GC_THRESHOLDS),
    and each call that waited for it held its request's body (2 MiB a call, unbounded)."""
    async def body(server, dp):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
            infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
            stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                      request_serializer=pb.ModelInferRequest.SerializeToString,
                                      response_deserializer=pb.ModelStreamInferResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await infer(echo_request("slow", "late"), timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await dp.slow_cancelled.wait()
            dp.slow_cancelled.clear()
            call = stream()
            await call.write(echo_request("slow", "late"))
            await dp.slow_entered.wait()
            call.cancel()
            await dp.slow_cancelled.wait()
            while server.calls:                   # its done-callbacks run on the next turn
                await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert [o for o in gc.get_objects() if type(o) is native._Call] == []

    gc.collect()
    gc.disable()
    try:
        run(body)
    finally:
        gc.enable()


def test_graceful_stop_finishes_open_calls_and_refuses_new_connections():
    async def test():
        dp = FakeDataPlane()
        server = await start_grpc(dp, FrontendSettings(scheduler_addr="", host="127.0.0.1",
                                                       grpc_port=0))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.trireme_port}") as ch:
            infer = ch.unary_unary(INFER, request_serializer=pb.ModelInferRequest.SerializeToString,
                                   response_deserializer=pb.ModelInferResponse.FromString)
            call = asyncio.ensure_future(infer(echo_request("slow", "held")))
            while not server.calls:
                await asyncio.sleep(0.005)
            stopping = asyncio.ensure_future(server.stop(10))
            while server._server.is_serving():
                await asyncio.sleep(0.005)
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", server.trireme_port)
            dp.gate.set()
            resp = await asyncio.wait_for(call, 10)
            assert resp.id == "held"
            await asyncio.wait_for(stopping, 10)

    async def main():
        await asyncio.wait_for(test(), 20)
    asyncio.run(main())


@pytest.mark.parametrize("seed", range(6))
def test_any_cut_of_the_byte_stream_gives_the_same_answers(seed):
    """Three calls on one connection, their frames (HEADERS, then DATA frames of random
    sizes) written as one byte stream cut at random points: every answer is exact."""
    rng = np.random.default_rng(seed)

    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        stream = bytearray()
        sizes = {1: 3, 3: 12_000, 5: 90_000}
        for sid, n in sizes.items():
            msg = grpc_message(echo_request("m", str(sid), n=n).SerializeToString())
            stream += frame_header(len(request_headers()), HEADERS, 4, sid) + request_headers()
            pos = 0
            while pos < len(msg):
                step = int(rng.integers(1, 40_000))
                chunk = msg[pos:pos + step]
                pos += len(chunk)
                stream += frame_header(len(chunk), DATA, 1 if pos == len(msg) else 0, sid) + chunk
        pos = 0
        while pos < len(stream):
            step = int(rng.choice([1, 5, 9, 10, 100, 4096, 70_000]))
            c.send(bytes(stream[pos:pos + step]))
            await c.writer.drain()
            pos += step
        for sid, n in sizes.items():
            _, data, trailers = await c.response(sid)
            assert trailers[b"grpc-status"] == b"0"
            resp = decode_response(data)
            assert resp.id == str(sid)
            assert resp.raw_output_contents[0] == np.arange(1, n + 1, dtype="<i4").tobytes()
        c.close()
    run(body)


def test_oversized_message_is_refused_and_the_client_asked_to_stop():
    async def body(server, dp):
        c = await RawClient.connect(server.trireme_port)
        c.frame(HEADERS, 4, 1, request_headers())
        c.frame(DATA, 0, 1, b"\x00" + (2**31).to_bytes(4, "big") + b"x" * 100)
        _, _, trailers = await c.response(1)
        assert trailers[b"grpc-status"] == b"8"
        assert trailers[b"grpc-message"] == (b"Received message larger than max "
                                             b"(2147483648 vs. 2147483647)")
        while True:
            ftype, _, sid, payload = await c.read_frame()
            if ftype == RST_STREAM:
                assert (sid, payload) == (1, b"\x00\x00\x00\x00")   # NO_ERROR: stop sending
                break
        c.frame(DATA, 0, 1, b"y" * 1000)                 # late data is ignored
        c.frame(HEADERS, 4, 3, request_headers())        # the connection still serves
        c.frame(DATA, 1, 3, grpc_message(echo_request("m", "after").SerializeToString()))
        _, data, trailers = await c.response(3)
        assert trailers[b"grpc-status"] == b"0"
        assert decode_response(data).id == "after"
        c.close()
    run(body)
