"""The lean HTTP path: the response parser (split reads, bodies across packets, keep-alive,
errors), the connection's callbacks over a fake transport, and the pre-encoded request
against the bytes tritonclient.http sends."""
from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from services.perf.flags import SslSettings
from services.perf.lean_http import (
    HttpConnection,
    ProtocolError,
    ResponseParser,
    error_text,
    http_request,
    target,
)
from services.perf.model import Tensor
from services.perf.worker_core import WorkerSpec

OK = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
      b"Inference-Header-Content-Length: 2\r\nContent-Length: 10\r\n\r\n{}01234567")
BAD = (b'HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 29\r\n'
       b'\r\n{"error":"unexpected input"}\n')


def parse(*chunks: bytes, keep: bool = False) -> list[tuple[int, bytes | None, bool]]:
    got: list[tuple[int, bytes | None, bool]] = []
    p = ResponseParser(lambda *r: got.append(r), keep_body=keep)
    for c in chunks:
        p.feed(c)
    assert p.idle
    return got


def test_one_response_in_one_read():
    assert parse(OK) == [(200, None, False)]
    assert parse(OK, keep=True) == [(200, b"{}01234567", False)]


@pytest.mark.parametrize("cut", range(1, len(OK)))
def test_a_response_split_anywhere_reads_the_same(cut):
    assert parse(OK[:cut], OK[cut:]) == [(200, None, False)]
    assert parse(OK[:cut], OK[cut:], keep=True) == [(200, b"{}01234567", False)]


def test_a_body_across_many_packets_and_byte_by_byte():
    body = bytes(range(256)) * 40
    resp = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    packets = [resp[i:i + 1000] for i in range(0, len(resp), 1000)]
    assert parse(*packets, keep=True) == [(200, body, False)]
    assert parse(*[OK[i:i + 1] for i in range(len(OK))]) == [(200, None, False)]


def test_keep_alive_responses_back_to_back_and_across_reads():
    both = OK + BAD + OK
    got = parse(both)
    assert [g[0] for g in got] == [200, 400, 200]
    assert got[1][1] == b'{"error":"unexpected input"}\n'
    cut = len(OK) + 7   # (the second response's head split)
    assert [g[0] for g in parse(both[:cut], both[cut:])] == [200, 400, 200]


def test_an_error_status_keeps_its_body_and_reads_as_tritonclients_text():
    ((status, body, close),) = parse(BAD)
    assert (status, close) == (400, False)
    assert error_text(status, body) == "[400] unexpected input"
    assert error_text(500, b"") == "[500] client received an empty response from the server."
    assert error_text(502, b"<html>").startswith("[502] an exception occurred in the client")


def test_close_interim_responses_and_empty_bodies():
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    assert parse(close) == [(200, None, True)]
    old = b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert parse(old) == [(200, None, True)]
    cont = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert parse(cont + OK) == [(200, None, False)]
    assert parse(b"HTTP/1.1 204 No Content\r\n\r\n" + OK) == [(204, b"", False),
                                                              (200, None, False)]
    assert parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi", keep=True) == \
        [(200, b"hi", False)]


@pytest.mark.parametrize("head,match", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
    (b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\n", "no Content-Length"),
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x response"),
    (b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "bad Content-Length"),
])
def test_what_the_parser_does_not_read_is_an_error(head, match):
    with pytest.raises(ProtocolError, match=match):
        parse(head)


def test_a_head_that_never_ends_is_bounded():
    p = ResponseParser(lambda *r: None)
    with pytest.raises(ProtocolError, match="over"):
        for _ in range(100):
            p.feed(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 1000)


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


def connection() -> tuple[HttpConnection, list, list, FakeTransport]:
    done: list = []
    failed: list = []
    conn = HttpConnection([b"REQ0", b"REQ1"], lambda c, *a: done.append(a),
                          lambda c, *a: failed.append(a))
    t = FakeTransport()
    conn.connection_made(t)
    return conn, done, failed, t


def test_the_connection_writes_the_prebuilt_bytes_and_reports_each_response():
    conn, done, failed, t = connection()
    conn.send(1, 7)
    assert t.written == [b"REQ1"] and conn.in_flight == 1
    conn.data_received(OK[:30])
    conn.data_received(OK[30:])
    ((token, start, end, send, recv),) = done
    assert token == 7 and end >= start and send >= 0 and recv >= 0 and not failed
    assert conn.in_flight == 0 and conn.open
    conn.send(0, 8)
    conn.data_received(BAD)
    assert failed == [(8, "[400] unexpected input")] and len(done) == 1
    assert conn.open   # (an error response keeps the connection)


def test_a_connection_closed_under_a_request_fails_it():
    conn, done, failed, t = connection()
    conn.send(0, 3)
    conn.connection_lost(None)
    assert failed == [(3, "the server closed the connection")] and not conn.open
    conn, done, failed, t = connection()
    conn.send(0, 4)
    conn.data_received(b"garbage\r\n\r\n")
    assert failed[0][0] == 4 and "not an HTTP/1.x response" in failed[0][1] and t.closed
    conn, done, failed, t = connection()
    conn.send(0, 5)
    conn.data_received(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert [d[0] for d in done] == [5] and t.closed and not conn.open
    conn.connection_lost(None)
    assert not failed   # (nothing was in flight any more)


def spec(**kw) -> WorkerSpec:
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    base = dict(index=0, processes=1, protocol="http", url="127.0.0.1:1", ssl=SslSettings(),
                headers={}, model="my model", version="", inputs=[Tensor("X", "FP32", [-1, 4])],
                outputs=[Tensor("Y", "FP32", [-1, 4])], requests=[{"X": x}], streams=[],
                sequence=None, lean=True)
    base.update(kw)
    return WorkerSpec(**base)   # type: ignore[arg-type]


def tritonclient_bytes(s: WorkerSpec) -> bytes:
    """What tritonclient.http's infer() sends for the spec's first request (a listener
    that takes the request and answers 200)."""
    import tritonclient.http as httpclient
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got: list[bytes] = []

    def serve() -> None:
        c, _ = srv.accept()
        with c:
            data = b""
            while b"\r\n\r\n" not in data:
                data += c.recv(65536)
            head = data.split(b"\r\n\r\n")[0].lower()
            n = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(data) - len(head) - 4 < n:
                data += c.recv(65536)
            got.append(data)
            answer = b'{"model_name":"m","outputs":[]}'
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
    th = threading.Thread(target=serve)
    th.start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inputs = []
        for name, arr in s.requests[0].items():
            t = httpclient.InferInput(name, list(arr.shape), "FP32")
            t.set_data_from_numpy(arr, binary_data=not s.input_json)
            inputs.append(t)
        outputs = [httpclient.InferRequestedOutput(t.name, binary_data=False)
                   for t in s.outputs] if s.output_json else None
        client.infer(s.model, inputs, model_version=s.version, outputs=outputs,
                     headers=dict(s.headers) or None, parameters=s.parameters or None)
    finally:
        th.join(10)
        client.close()
        srv.close()
    return got[0]


def split(raw: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, body = raw.split(b"\r\n\r\n", 1)
    line, *fields = head.split(b"\r\n")
    return line, dict(f.split(b": ", 1) for f in fields), body


@pytest.mark.parametrize("kw", [
    {},
    {"headers": {"X-Tenant": "a"}, "version": "2", "parameters": {"priority_hint": 3}},
    {"input_json": True, "output_json": True},
])
def test_the_request_is_the_one_tritonclient_sends(kw):
    s = spec(**kw)
    ours, theirs = split(http_request(s, s.requests[0])), split(tritonclient_bytes(s))
    assert ours[0] == theirs[0]   # (request line)
    assert ours[2] == theirs[2]   # (body: JSON header and raw bytes)
    assert ours[1].pop(b"User-Agent") == b"trireme-perf"
    theirs[1].pop(b"User-Agent")
    host = ours[1].pop(b"Host")
    assert host == b"127.0.0.1:1" and theirs[1].pop(b"Host").startswith(b"127.0.0.1:")
    assert ours[1] == theirs[1]
    if not s.input_json:
        n = int(ours[1][b"Inference-Header-Content-Length"])
        assert json.loads(ours[2][:n])["inputs"][0]["parameters"] == {"binary_data_size": 16}
        assert ours[2][n:] == np.arange(4, dtype=np.float32).tobytes()


def test_the_target_of_a_url():
    assert target("localhost:8000", False) == ("localhost", 8000, "")
    assert target("example.com/prefix/", True) == ("example.com", 443, "/prefix")
    assert target("[::1]:9", False) == ("::1", 9, "")
    s = spec(url="h:5/base")
    assert http_request(s, s.requests[0]).startswith(b"POST /base/v2/models/my%20model/infer ")
