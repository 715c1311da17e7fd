"""Attacks on the HTTP/1.1 frontend, one test each, against a
real `trireme serve` (one frontend) started with small limits so that each runs in seconds:
--http-header-timeout-secs 2, --http-body-timeout-secs 2, --http-max-connections 64.

Each test asserts three things:
(a) the frontend's RSS stays within RSS_BOUND of what it was before the attack, sampled
    every 20 ms while the attack runs;
(b) a well-behaved tritonclient.http client, on its own connection, keeps getting correct
    answers (add_sub: INPUT0 + INPUT1, INPUT0 - INPUT1) throughout, none failing;
(c) the attacker gets exactly Triton's status and text (ours where Triton has none).

RSS_BOUND, 64 MiB: every attack here sends at most a few MB, while the faults they probe
cost far more: one body byte after `Content-Length: 60000000` used to allocate 60 MB (50
connections: 3 GB); a chunk flood read whole holds all it is sent (7 MB per million
chunks, and a Python object per chunk). 64 MiB is above what the frontend's own
allocator moves under steady load (arenas, malloc caches: a few MiB) and below a single
declared-size allocation, so a bound crossed means memory that follows what a client
declared or kept sending, not noise.
"""
from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import models
import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import start_server, wait_until

MIB = 1 << 20
RSS_BOUND = 64 * MIB
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
MAX_CONNECTIONS = 64
LIMIT = 64 * MIB                     # --http-max-input-size, the default
CHUNKS_TEXT = ("Chunked request body exceeds maximum of 65536 non-empty chunks. Send fewer "
               "or larger HTTP chunks.")
NESTING_TEXT = "JSON nesting depth exceeds maximum allowed limit (100)"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("http_attacks") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    with start_server(root, "--http-header-timeout-secs", str(HEADER_TIMEOUT_S),
                      "--http-body-timeout-secs", str(BODY_TIMEOUT_S),
                      "--http-max-connections", str(MAX_CONNECTIONS)) as srv:
        yield srv


class _Watch:
    """While the attack runs: the frontend's peak RSS, and a well-behaved client in a loop
    (tritonclient.http, its own keep-alive connection; made, used and closed on its own
    thread, as gevent wants) checking every answer."""

    def __init__(self, srv) -> None:
        self.frontend = srv.frontend()
        self.url = srv.http_url
        self.ok, self.failures = 0, []
        self._ready, self._stop = threading.Event(), threading.Event()
        self._client = threading.Thread(target=self._serve, daemon=True)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self.before = self.peak = 0

    def _infer(self, client) -> None:
        a = np.random.default_rng(self.ok).random((1, 16), dtype=np.float32)
        b = np.ones((1, 16), np.float32)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"),
                  httpclient.InferInput("INPUT1", [1, 16], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = client.infer("add_sub", inputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)
        self.ok += 1

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(psutil.NoSuchProcess):
                self.peak = max(self.peak, self.frontend.memory_info().rss)

    def _serve(self) -> None:
        client = httpclient.InferenceServerClient(self.url, network_timeout=30.0)
        try:
            self._infer(client)                              # warm: metadata, arenas
            self._ready.set()
            while not self._stop.is_set():
                try:
                    self._infer(client)
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    self.failures.append(repr(e))
                self._stop.wait(0.01)
        except Exception as e:  # noqa: BLE001
            self.failures.append(repr(e))
        finally:
            client.close()

    def __enter__(self) -> _Watch:
        self._client.start()
        assert self._ready.wait(30), f"the client was not served before the attack: " \
                                     f"{self.failures}"
        self.before = self.peak = self.frontend.memory_info().rss
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        served = self.ok
        try:
            wait_until(lambda: self.ok >= served + 3 or self.failures, 10,
                       "the client's next answers")
        finally:
            self._stop.set()
            self._client.join(30)
            self._sampler.join(5)
        if exc[0] is None:
            assert not self.failures, self.failures[:3]
            assert self.ok >= served + 3, "the well-behaved client is not served after the attack"
            growth = self.peak - self.before
            print(f"frontend RSS peak growth {growth / MIB:+.1f} MiB; client answers {self.ok}")
            assert growth < RSS_BOUND, f"frontend RSS grew by {growth / MIB:.1f} MiB"


@pytest.fixture
def watch(server) -> Iterator[_Watch]:
    with _Watch(server) as w:
        yield w


def _connect(srv, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _until_closed(s: socket.socket) -> bytes:
    """What the server sends until it closes (EOF or reset); the socket's timeout bounds
    each wait."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def _one_answer(s: socket.socket) -> tuple[int, bytes]:
    """One HTTP answer: (status, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"closed before an answer: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed mid-answer"
        body += chunk
    return int(head.split()[1]), body[:length]


def _error(status_body: tuple[int, bytes]) -> tuple[int, str]:
    status, body = status_body
    return status, json.loads(body)["error"]


def _answer_then_close(s: socket.socket) -> tuple[int, str]:
    answer = _until_closed(s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Connection: close" in head, head
    return int(head.split()[1]), json.loads(body)["error"]


def _infer_head(length: int | str, *extra: str) -> bytes:
    lines = ["POST /v2/models/add_sub/infer HTTP/1.1", "Host: attacker",
             f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ---- the attacks ------------------------------------------------------------------------

def test_huge_content_length_one_byte_sent(server, watch):
    """50 connections each declare 60 MB (under the 64 MiB limit) and send one byte: the
    frontend holds 50 bytes, not 3 GB; each is answered 408 at the body timeout. A
    declared size over the limit is refused at once, in Triton's words."""
    start = time.monotonic()
    attackers = []
    for _ in range(50):
        s = _connect(server)
        s.sendall(_infer_head(60_000_000) + b"{")
        attackers.append(s)
    over = _connect(server)
    over.sendall(_infer_head(100_000_000) + b"{")
    assert _error(_one_answer(over)) == (400, (
        f"request JSON size of 100000000 bytes exceeds the maximum allowed input size of {LIMIT} "
        f"bytes. Use --http-max-input-size to increase the limit."))
    over.close()
    for s in attackers:
        assert _answer_then_close(s) == (408, f"request body not received within "
                                              f"{BODY_TIMEOUT_S} s (--http-body-timeout-secs)")
        s.close()
    assert time.monotonic() - start < BODY_TIMEOUT_S + 5


def _trickle(s: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    with contextlib.suppress(OSError):
        for byte in data:
            if stop.wait(every):
                return
            s.sendall(bytes([byte]))


@pytest.mark.parametrize("phase", ["head", "body"])
def test_slow_sender_one_byte_a_second(server, watch, phase):
    """A request head, or a body, dribbled one byte a second: 408 at the timeout, closed."""
    s = _connect(server)
    if phase == "head":
        data = _infer_head(10)[:-2] + b"X-Padding: " + b"p" * 100
        text = (f"request head not received within {HEADER_TIMEOUT_S} s "
                f"(--http-header-timeout-secs)")
    else:
        s.sendall(_infer_head(1000))
        data = b" " * 1000
        text = f"request body not received within {BODY_TIMEOUT_S} s (--http-body-timeout-secs)"
    stop = threading.Event()
    sender = threading.Thread(target=_trickle, args=(s, data, 1.0, stop), daemon=True)
    start = time.monotonic()
    sender.start()
    try:
        assert _answer_then_close(s) == (408, text)
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 4
    finally:
        stop.set()
        sender.join(5)
        s.close()


def _post(srv, body: bytes) -> tuple[int, str]:
    s = _connect(srv, 30.0)
    try:
        s.sendall(_infer_head(len(body), "Content-Type: application/json") + body)
        return _error(_one_answer(s))
    finally:
        s.close()


def test_json_nested_100k_levels(server, watch):
    """JSON nested 100,000 levels deep: 400 naming what is wrong (before: 500, a
    RecursionError). As the document, and as a tensor's data."""
    depth = 100_000
    assert _post(server, b"[" * depth + b"]" * depth) == (
        400, "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'")
    data = b"[" * depth + b"1" + b"]" * depth
    body = (b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[1,16],"data":' + data
            + b'},{"name":"INPUT1","datatype":"FP32","shape":[1,16],"data":' + data + b"}]}")
    assert _post(server, body) == (400, f"Unable to parse 'data': {NESTING_TEXT}")


def test_tensor_nested_120_levels(server, watch):
    """Triton's limit on a tensor's JSON data (HTTP_MAX_JSON_NESTING_DEPTH): 120 levels is
    refused with its text; 50 levels is served."""
    def body(depth: int) -> bytes:
        data = "[" * depth + ",".join(["1"] * 16) + "]" * depth
        return (f'{{"inputs":[{{"name":"INPUT0","datatype":"FP32","shape":[1,16],"data":{data}}},'
                f'{{"name":"INPUT1","datatype":"FP32","shape":[1,16],"data":{data}}}]}}').encode()
    assert _post(server, body(120)) == (400, f"Unable to parse 'data': {NESTING_TEXT}")
    s = _connect(server)
    s.sendall(_infer_head(len(body(50)), "Content-Type: application/json") + body(50))
    status, answer = _one_answer(s)
    s.close()
    assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [2.0] * 16


@pytest.mark.parametrize("chunks", [65_537, 1_000_000])
def test_more_than_65536_chunks(server, watch, chunks):
    """A chunked body of more than 65,536 chunks: Triton's 400 and text, reading stops (the
    million-chunk body is not read, let alone held)."""
    s = _connect(server, 30.0)
    s.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: attacker\r\n"
              b"Inference-Header-Content-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n")
    sent = 0
    with contextlib.suppress(OSError):
        batch = b"1\r\nA\r\n" * 4096
        while sent < chunks:
            n = min(4096, chunks - sent)
            s.sendall(batch[:6 * n])
            sent += n
        s.sendall(b"0\r\n\r\n")
    assert _answer_then_close(s) == (400, CHUNKS_TEXT)
    s.close()


def _chunked(body: bytes) -> bytes:
    return b"%X\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def test_chunked_body_with_a_content_length(server, watch):
    """Transfer-Encoding: chunked and a Content-Length (RFC 9112 §6.3: the chunks are the
    body; Triton takes it): 50 connections declare 60 MB, one more than the limit, each
    sends a small chunked body and a request pipelined behind it. Each is answered 200 from
    its chunks, nothing is allocated or refused for the declared length, and the
    connection closes after the answer: the request behind it is never read. (The limit
    on such a body as its chunks come: tests/unit/frontend/test_http_limits.py.)"""
    doc = {"inputs": [{"name": f"INPUT{i}", "datatype": "FP32", "shape": [1, 16],
                       "data": [float(i + 1)] * 16} for i in range(2)]}
    body = json.dumps(doc).encode()
    behind = b"GET /v2/health/ready HTTP/1.1\r\nHost: attacker\r\n\r\n"
    sockets = []
    for length in [60_000_000] * 50 + [100_000_000]:
        s = _connect(server)
        s.sendall(_infer_head(length, "Transfer-Encoding: chunked") + _chunked(body) + behind)
        sockets.append(s)
    for s in sockets:
        answer = _until_closed(s)
        head, _, rest = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in head, head
        outputs = json.loads(rest)["outputs"]        # one answer: the pipelined GET unread
        assert [o["data"] for o in outputs] == [[3.0] * 16, [-1.0] * 16]
        s.close()


def test_connection_flood_beyond_the_cap(server, watch):
    """More connections than --http-max-connections: those beyond it are answered 503 at
    once and closed; those within it and the well-behaved client are served."""
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS + 40):
            held.append(_connect(server))
        # The cap counts this frontend's open connections, the client's among them: 40 or
        # more of ours are refused, each at once (well before the header timeout).
        refused: dict[socket.socket, bytes] = {}
        deadline = time.monotonic() + HEADER_TIMEOUT_S / 2
        while len(refused) < 40 and time.monotonic() < deadline:
            ready, _, _ = select.select([s for s in held if s not in refused], [], [], 0.05)
            for s in ready:
                refused[s] = _until_closed(s)
        assert len(refused) >= 40, f"{len(refused)} connections refused"
        answers = set(refused.values())
        assert len(answers) == 1
        head, _, body = answers.pop().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable")
        assert b"Connection: close" in head
        assert json.loads(body)["error"] == (
            f"Service Unavailable: this server is at its limit of {MAX_CONNECTIONS} "
            f"connections (--http-max-connections)")
        accepted = [s for s in held if s not in refused]
        assert accepted
        accepted[0].sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: a\r\n\r\n")
        assert _one_answer(accepted[0])[0] == 200
    finally:
        for s in held:
            s.close()
    wait_until(lambda: _health(server) == 200, 10, "the held connections to be released")


def _health(srv) -> int:
    s = _connect(srv)
    try:
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        return _one_answer(s)[0]
    except (AssertionError, OSError):
        return 0
    finally:
        s.close()
