"""The lean gRPC path: the message and header block made once, and the HTTP/2 connection
over a fake transport (settings, frames split anywhere, errors, flow control, GOAWAY)."""
from __future__ import annotations

import asyncio
import gzip

import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2  # type: ignore[import-untyped]

from services.perf import lean_h2 as h
from services.perf.flags import SslSettings
from services.perf.model import Tensor
from services.perf.worker_core import WorkerSpec


def spec(**kw) -> WorkerSpec:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    base = dict(index=0, processes=1, protocol="grpc", url="127.0.0.1:1", ssl=SslSettings(),
                headers={}, model="m", version="", inputs=[Tensor("X", "FP32", [-1, 4])],
                outputs=[Tensor("Y", "FP32", [-1, 4])], requests=[{"X": x}], streams=[],
                sequence=None, lean=True)
    base.update(kw)
    return WorkerSpec(**base)   # type: ignore[arg-type]


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 3], "big")
        sid = int.from_bytes(data[pos + 5:pos + 9], "big")
        out.append((data[pos + 3], data[pos + 4], sid, data[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return out


def test_the_message_is_tritonclients_model_infer_request():
    s = spec(version="3", parameters={"k": 1})
    msg = h.grpc_message(s, s.requests[0])
    assert msg[0] == 0 and int.from_bytes(msg[1:5], "big") == len(msg) - 5
    req = service_pb2.ModelInferRequest.FromString(msg[5:])
    assert (req.model_name, req.model_version) == ("m", "3")
    assert [(t.name, t.datatype, list(t.shape)) for t in req.inputs] == [("X", "FP32", [1, 4])]
    assert req.raw_input_contents[0] == np.arange(4, dtype=np.float32).tobytes()
    assert req.parameters["k"].int64_param == 1
    z = h.grpc_message(spec(grpc_compression="gzip"), s.requests[0])
    assert z[0] == 1 and service_pb2.ModelInferRequest.FromString(
        gzip.decompress(z[5:])).raw_input_contents == req.raw_input_contents


def test_the_header_block_is_a_grpc_clients_with_metadata():
    block = h.request_block(spec(headers={"X-Tenant": "a"}, grpc_compression="deflate"),
                            "127.0.0.1", 8001)
    got = dict(hpack.Decoder().decode(block, raw=True))
    assert got[b":path"] == b"/inference.GRPCInferenceService/ModelInfer"
    assert got[b":authority"] == b"127.0.0.1:8001" and got[b":scheme"] == b"http"
    assert got[b"content-type"] == b"application/grpc" and got[b"te"] == b"trailers"
    assert got[b"x-tenant"] == b"a" and got[b"grpc-encoding"] == b"deflate"


class FakeTransport:
    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def take(self) -> list[tuple[int, int, int, bytes]]:
        got, self.out = frames(self.out), b""
        return got


class Server:
    """The server's side of the frames: settings, and responses from an HPACK encoder
    (indexing into its dynamic table unless told the client's table size)."""

    def __init__(self, table_size: int | None = None) -> None:
        self.enc = hpack.Encoder()
        if table_size is not None:
            self.enc.header_table_size = table_size

    @staticmethod
    def settings(**kv: int) -> bytes:
        ids = {"streams": h.S_MAX_CONCURRENT_STREAMS, "window": h.S_INITIAL_WINDOW_SIZE,
               "frame": h.S_MAX_FRAME_SIZE}
        return h.frame(h.SETTINGS, 0, 0, b"".join(
            ids[k].to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in kv.items()))

    def ok(self, sid: int, body: bytes = b"\x00\x00\x00\x00\x02hi") -> bytes:
        return (h.frame(h.HEADERS, h.END_HEADERS, sid, self.enc.encode(
                    [(":status", "200"), ("content-type", "application/grpc")]))
                + h.frame(h.DATA, 0, sid, body)
                + h.frame(h.HEADERS, h.END_HEADERS | h.END_STREAM, sid, self.enc.encode(
                    [("grpc-status", "0"), ("grpc-message", "")])))

    def error(self, sid: int, code: int, message: str) -> bytes:
        return h.frame(h.HEADERS, h.END_HEADERS | h.END_STREAM, sid, self.enc.encode(
            [(":status", "200"), ("content-type", "application/grpc"),
             ("grpc-status", str(code)), ("grpc-message", message)]))


def connect(loop: asyncio.AbstractEventLoop, **settings: int
            ) -> tuple[h.H2Connection, list, list, FakeTransport]:
    done: list = []
    failed: list = []
    messages = [b"\x00\x00\x00\x00\x03abc", b"\x00" + (30).to_bytes(4, "big") + b"z" * 30]
    conn = h.H2Connection(messages, h.literal_block([(b":path", b"/p")]),
                          lambda c, *a: done.append(a), lambda c, *a: failed.append(a), loop)
    t = FakeTransport()
    conn.connection_made(t)
    assert t.out.startswith(h.PREFACE)
    t.out = t.out[len(h.PREFACE):]
    (st, _, _, payload), (wu, _, _, grow) = t.take()
    assert st == h.SETTINGS and wu == h.WINDOW_UPDATE
    ours = {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
            for i in range(0, len(payload), 6)}
    assert ours[h.S_HEADER_TABLE_SIZE] == 0 and ours[h.S_ENABLE_PUSH] == 0
    assert int.from_bytes(grow, "big") == h.MAX_WINDOW - h.DEFAULT_WINDOW
    assert not conn.ready.done() and not conn.open
    conn.data_received(Server.settings(**settings))
    assert t.take() == [(h.SETTINGS, h.ACK, 0, b"")]
    assert conn.ready.done() and conn.open
    return conn, done, failed, t


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_a_call_is_two_frames_and_its_response_split_anywhere_ends_it_once(loop):
    srv = Server(table_size=0)
    resp = srv.ok(1)
    for cut in range(1, len(resp)):
        conn, done, failed, t = connect(loop, streams=7)
        assert conn.capacity == 7
        conn.send(0, 42)
        (hd, hflags, hsid, block), (dt, dflags, dsid, payload) = t.take()
        assert (hd, hflags, hsid, block) == (h.HEADERS, h.END_HEADERS, 1, conn.block)
        assert (dt, dflags, dsid, payload) == (h.DATA, h.END_STREAM, 1, b"\x00\x00\x00\x00\x03abc")
        conn.data_received(resp[:cut])
        conn.data_received(resp[cut:])
        assert [d[0] for d in done] == [42] and not failed and conn.in_flight == 0
    conn.send(0, 43)
    assert t.take()[0][2] == 3   # (the next stream id)


def test_header_blocks_decode_with_or_without_the_servers_dynamic_table(loop):
    for srv in (Server(), Server(table_size=0)):
        conn, done, failed, t = connect(loop)
        for i in range(5):
            conn.send(0, i)
            conn.data_received(srv.ok(1 + 2 * i))
        conn.send(0, 9)
        conn.data_received(srv.error(11, 3, "bad%20input"))
        assert [d[0] for d in done] == [0, 1, 2, 3, 4]
        assert failed == [(9, "[StatusCode.INVALID_ARGUMENT] bad input")]


def test_a_status_other_than_200_a_reset_and_a_lost_connection_fail_the_call(loop):
    srv = Server(table_size=0)
    conn, done, failed, t = connect(loop)
    conn.send(0, 1)
    conn.data_received(h.frame(h.HEADERS, h.END_HEADERS | h.END_STREAM, 1,
                               srv.enc.encode([(":status", "503")])))
    conn.send(0, 2)
    conn.data_received(h.frame(h.RST_STREAM, 0, 3, (8).to_bytes(4, "big")))
    conn.send(0, 3)
    conn.connection_lost(None)
    assert failed == [
        (1, "[StatusCode.UNKNOWN] HTTP status 503"),
        (2, "[StatusCode.INTERNAL] the server reset the stream (HTTP/2 error code 8)"),
        (3, "[StatusCode.UNAVAILABLE] the server closed the connection")]
    assert not done and not conn.open


def test_goaway_fails_the_streams_it_did_not_take_and_closes_for_new_ones(loop):
    srv = Server(table_size=0)
    conn, done, failed, t = connect(loop)
    conn.send(0, "a")
    conn.send(0, "b")
    conn.data_received(h.frame(h.GOAWAY, 0, 0, (1).to_bytes(4, "big") + (0).to_bytes(4, "big")))
    assert not conn.open and [f[0] for f in failed] == ["b"]
    conn.data_received(srv.ok(1))   # (the stream it took still ends)
    assert [d[0] for d in done] == ["a"]


def test_ping_is_answered_and_push_is_refused(loop):
    conn, done, failed, t = connect(loop)
    t.take()
    conn.data_received(h.frame(h.PING, 0, 0, b"12345678"))
    assert t.take() == [(h.PING, h.ACK, 0, b"12345678")]
    conn.send(0, 5)
    conn.data_received(h.frame(h.PUSH_PROMISE, h.END_HEADERS, 1, b"\x00\x00\x00\x02"))
    assert failed and "PUSH_PROMISE" in failed[0][1] and t.closed


def test_a_request_larger_than_the_servers_window_waits_for_its_window_updates(loop):
    conn, done, failed, t = connect(loop, window=10)
    t.take()
    conn.send(1, 0)   # (35 bytes: 5 of prefix, 30 of message)
    (hd, _, _, _), (dt, flags, sid, payload) = t.take()
    assert hd == h.HEADERS and (dt, flags, sid, len(payload)) == (h.DATA, 0, 1, 10)
    conn.send(0, 1)   # (behind it: queued, in order)
    assert [f[0] for f in t.take()] == [h.HEADERS]
    conn.data_received(h.frame(h.WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    (dt, flags, sid, rest), (dt2, flags2, sid2, small) = t.take()[:2]
    assert (dt, flags, sid) == (h.DATA, h.END_STREAM, 1) and payload + rest == conn.messages[1]
    assert (dt2, flags2, sid2, small) == (h.DATA, h.END_STREAM, 3, conn.messages[0])
    # (and no frame exceeds the server's SETTINGS_MAX_FRAME_SIZE)
    conn.data_received(Server.settings(frame=16))
    assert t.take() == [(h.SETTINGS, h.ACK, 0, b"")]
    conn.send(1, 2)
    assert [(f[0], f[2], len(f[3])) for f in t.take()] == [(h.HEADERS, 5, 10), (h.DATA, 5, 10)]
    conn.data_received(h.frame(h.WINDOW_UPDATE, 0, 5, (100).to_bytes(4, "big")))
    assert [(f[0], f[1], len(f[3])) for f in t.take()] == [(h.DATA, 0, 16),
                                                           (h.DATA, h.END_STREAM, 9)]


def test_a_large_response_frame_across_reads_is_counted_not_kept(loop):
    srv = Server(table_size=0)
    conn, done, failed, t = connect(loop)
    conn.send(0, 7)
    big = b"\x00" + (100_000).to_bytes(4, "big") + bytes(100_000)
    resp = srv.ok(1, big)
    for i in range(0, len(resp), 4096):
        conn.data_received(resp[i:i + 4096])
    assert [d[0] for d in done] == [7] and not failed
    assert conn.consumed == len(big)
