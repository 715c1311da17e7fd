"""Attacks on the gRPC port of a real `trireme serve`: one test per attack.

Measured on main before the limits (grpc/limits.py): a 14-byte stream whose length prefix
declares 2,000,000,000 bytes made the frontend allocate and zero 2 GB; 100,000 open streams
+107 MiB; a HEADERS frame followed by 50 MB of CONTINUATION was held whole; 2M PINGs from a
client that never reads +185 MiB. Each test here sends the attack on its own connection and
checks three things:

(a) the frontend's RSS, sampled every few milliseconds from before the attack until after
    it, never grows by more than RSS_GROWTH_LIMIT. 64 MiB: what the limits allow one
    connection to hold is about 3 MiB (a 1 MiB frame being received, 1 MiB of our output
    before it stops reading, a 16 KiB header block, 100 streams), so the bound leaves room
    for allocator noise and the neighbour's own traffic while sitting far below each
    measured growth (+107 MiB to +2 GB);
(b) a well-behaved `tritonclient.grpc` client on another connection gets correct answers
    before, during and after the attack (every call has a timeout: a timeout is a failure);
(c) the attacker gets the answer the rule prescribes (RST_STREAM / GOAWAY code,
    last-stream-id, debug data).

Deterministic: no sleeps; every wait polls with a deadline.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
from hpack import Decoder

from services.frontend.grpc.h2_frames import PREFACE, encode_literal_headers, frame_header

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0, 1, 3, 4, 6, 7, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 7, 8, 11
RSS_GROWTH_LIMIT = 64 << 20
CALL_TIMEOUT_S = 10.0
ATTACK_DEADLINE_S = 8.0
INFER = b"/inference.GRPCInferenceService/ModelInfer"


# ---- the well-behaved neighbour and the memory watch --------------------------------------
class Neighbour:
    """tritonclient.grpc calling add_sub in a loop on its own connection, checking each
    answer, until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = 0
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = grpcclient.InferenceServerClient(self.url)
        rng = np.random.default_rng(0)
        try:
            while not self._stop.is_set():
                a = rng.random((1, 16), dtype=np.float32)
                b = rng.random((1, 16), dtype=np.float32)
                inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"),
                          grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(b)
                try:
                    r = client.infer("add_sub", inputs, client_timeout=CALL_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - any failure is what this test reports
                    self.problems.append(f"{type(e).__name__}: {e}")
                    return
                if not (np.allclose(r.as_numpy("OUTPUT0"), a + b)
                        and np.allclose(r.as_numpy("OUTPUT1"), a - b)):
                    self.problems.append("wrong result")
                    return
                self.done += 1
        finally:
            client.close()

    def wait_for(self, n: int, what: str) -> None:
        deadline = time.monotonic() + 30
        while self.done < n and not self.problems:
            assert time.monotonic() < deadline, f"neighbour stalled {what} ({self.done} calls)"
            time.sleep(0.005)
        assert not self.problems, self.problems

    def __enter__(self) -> Neighbour:
        self._thread.start()
        self.wait_for(50, "warming up")           # model, arenas and caches warm
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(CALL_TIMEOUT_S + 5)


class RssWatch:
    """The largest RSS of ``proc`` while the block runs, sampled every 2 ms."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.start = self.peak = proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.sample()

    def sample(self) -> int:
        rss = self.proc.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss - self.start

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def check(self) -> None:
        growth = self.peak - self.start
        assert growth < RSS_GROWTH_LIMIT, f"frontend RSS grew by {growth / 2**20:.1f} MiB"


def attack(srv, body) -> None:
    """Run ``body(attacker, during)`` with a neighbour served meanwhile and the RSS watched;
    ``during()``, called by the body while its attack is on, waits for the neighbour to get
    more answers."""
    fe = srv.frontend()
    with Neighbour(srv.grpc_url) as neighbour, RssWatch(fe) as rss:
        before = neighbour.done

        def during() -> None:
            neighbour.wait_for(neighbour.done + 10, "during the attack")
        with Attacker(srv.grpc_port) as attacker:
            body(attacker, during)
        neighbour.wait_for(neighbour.done + 20, "after the attack")
        assert neighbour.done >= before + 30
    print(f"RSS +{(rss.peak - rss.start) / 2**20:.1f} MiB at most; neighbour calls during "
          f"and after: {neighbour.done - before}")
    rss.check()
    assert not neighbour.problems, neighbour.problems


# ---- the attacker: raw HTTP/2 over a blocking socket ----------------------------------------
class Attacker:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = bytearray()
        self.eof = False
        self.send(PREFACE + frame_header(0, SETTINGS, 0, 0))

    def __enter__(self) -> Attacker:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def flood(self, data: bytes, deadline_s: float = ATTACK_DEADLINE_S) -> int:
        """Send ``data`` without reading, as far as the server takes it; the bytes sent.
        Stops early when the server closes its side (it may go on reading and dropping)."""
        view = memoryview(data)
        sent = 0
        deadline = time.monotonic() + deadline_s
        self.sock.settimeout(0.2)
        try:
            while sent < len(data) and time.monotonic() < deadline:
                try:
                    sent += self.sock.send(view[sent:sent + (1 << 20)])
                except TimeoutError:
                    continue
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.sock.settimeout(5)
        return sent

    def _fill(self, n: int, deadline: float) -> bool:
        while len(self.buf) < n:
            if self.eof or time.monotonic() > deadline:
                return False
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.eof = True
                return False
            self.buf += chunk
        return True

    def frames(self, timeout: float = 10.0):
        """The server's frames, (type, flags, stream id, payload), until it closes."""
        deadline = time.monotonic() + timeout
        self.sock.settimeout(0.5)
        while self._fill(9, deadline):
            length = int.from_bytes(self.buf[:3], "big")
            if not self._fill(9 + length, deadline):
                break
            head, payload = bytes(self.buf[:9]), bytes(self.buf[9:9 + length])
            del self.buf[:9 + length]
            yield head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload
        assert self.eof or time.monotonic() <= deadline, "no answer before the deadline"

    def goaway(self) -> tuple[int, int, bytes]:
        """(last-stream-id, code, debug data) of the server's GOAWAY; the server then closes."""
        found = None
        for ftype, _, _, payload in self.frames():
            if ftype == GOAWAY and found is None:
                found = (int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big"),
                         payload[8:])
        assert self.eof, "the server did not close the connection"
        assert found is not None, "no GOAWAY before the server closed"
        return found


def request_headers() -> bytes:
    return encode_literal_headers([
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", INFER),
        (b":authority", b"attacker"), (b"content-type", b"application/grpc"),
        (b"te", b"trailers")])


def add_sub_request() -> bytes:
    """A valid ModelInfer for add_sub, length-prefixed."""
    from tritonclient.grpc import service_pb2 as pb
    req = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        t = req.inputs.add()
        t.name, t.datatype = name, "FP32"
        t.shape.extend([1, 16])
        req.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    body = req.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


# ---- the attacks ---------------------------------------------------------------------------
def test_grpc_length_prefix_of_2gb(server):
    """20 streams whose 5-byte prefix declares 2,000,000,000 bytes and which then send
    little: nothing is allocated for what did not arrive (before: +2.0 GB each). One prefix
    beyond the 2 GiB limit is refused at once; the held streams, ended, get INTERNAL."""
    fe = server.frontend()

    def body(a: Attacker, during) -> None:
        headers = request_headers()
        rss0 = fe.memory_info().rss
        for i in range(20):
            sid = 1 + 2 * i
            a.send(frame_header(len(headers), HEADERS, END_HEADERS, sid) + headers
                   + frame_header(14, DATA, 0, sid) + b"\x00" + (2_000_000_000).to_bytes(4, "big")
                   + b"123456789" + frame_header(0, SETTINGS, 0, 0))
            # the SETTINGS ACK says the server has handled the DATA before it
            acks = 0
            for ftype, flags, _, _ in a.frames():
                if ftype == SETTINGS and flags & ACK:
                    acks += 1
                    if acks == (2 if i == 0 else 1):   # the first ACK answers our preface
                        break
            growth = fe.memory_info().rss - rss0   # stop at once if a prefix allocates
            assert growth < RSS_GROWTH_LIMIT, f"+{growth / 2**20:.0f} MiB after {i + 1} streams"
        during()                                   # 20 streams held open meanwhile
        a.send(frame_header(len(headers), HEADERS, END_HEADERS, 41) + headers
               + frame_header(5, DATA, 0, 41) + b"\x00\xff\xff\xff\xff")
        for i in range(20):
            a.send(frame_header(0, DATA, END_STREAM, 1 + 2 * i))
        statuses: dict[int, tuple[bytes, bytes]] = {}
        reset = {}
        dec = Decoder()
        for ftype, _, sid, payload in a.frames():
            if ftype == HEADERS:
                h = dict(dec.decode(payload, raw=True))
                statuses[sid] = (h[b"grpc-status"], h.get(b"grpc-message", b""))
            elif ftype == RST_STREAM:
                reset[sid] = int.from_bytes(payload, "big")
            if len(statuses) == 21 and 41 in reset:
                break
        assert statuses[41] == (b"8", b"Received message larger than max "
                                      b"(4294967295 vs. 2147483647)")
        assert reset[41] == 0                              # NO_ERROR: stop sending
        for i in range(20):
            assert statuses[1 + 2 * i] == (b"13", b"truncated gRPC message")
    attack(server, body)


def test_h2_100000_open_streams(server):
    """HEADERS opening 100,000 streams at once: 100 are opened (SETTINGS_MAX_CONCURRENT_STREAMS),
    the next ones refused with REFUSED_STREAM, and the flood of refusals ends the
    connection with GOAWAY ENHANCE_YOUR_CALM naming stream 199, the last one opened."""
    def body(a: Attacker, during) -> None:
        headers = request_headers()
        one = bytearray()
        for i in range(100_000):
            one += frame_header(len(headers), HEADERS, END_HEADERS, 1 + 2 * i) + headers
        a.flood(bytes(one))
        during()
        refused = []
        goaway = None
        for ftype, _, sid, payload in a.frames():
            if ftype == RST_STREAM:
                refused.append((sid, int.from_bytes(payload, "big")))
            elif ftype == GOAWAY:
                goaway = (int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big"))
        assert refused[0] == (201, REFUSED_STREAM)
        assert all(code == REFUSED_STREAM for _, code in refused)
        assert 100 <= len(refused) <= 2000
        assert goaway == (199, ENHANCE_YOUR_CALM)
    attack(server, body)


def test_h2_50mb_of_continuation(server):
    """A HEADERS frame without END_HEADERS followed by 50 MB of CONTINUATION: the block is
    cut at 16 KiB (SETTINGS_MAX_HEADER_LIST_SIZE) with GOAWAY ENHANCE_YOUR_CALM."""
    def body(a: Attacker, during) -> None:
        headers = request_headers()
        piece = b"\x00" * 16384
        cont = frame_header(len(piece), CONTINUATION, 0, 1) + piece
        a.send(frame_header(len(headers), HEADERS, 0, 1) + headers)
        sent = a.flood(cont * (50_000_000 // len(piece)))
        assert sent > 16384
        during()
        assert a.goaway() == (0, ENHANCE_YOUR_CALM, b"")
    attack(server, body)


def test_h2_ping_flood_from_a_client_that_never_reads(server):
    """2,000,000 PINGs (34 MB) without reading a byte: grpc core's ping policy (Triton's
    --grpc-http2-max-ping-strikes 2) answers the fourth with GOAWAY ENHANCE_YOUR_CALM
    "too_many_pings"; the rest is read and dropped, nothing is answered or held."""
    def body(a: Attacker, during) -> None:
        pings = b"".join(frame_header(8, PING, 0, 0) + i.to_bytes(8, "big") for i in range(4096))
        total = 0
        for _ in range(2_000_000 // 4096):
            sent = a.flood(pings, deadline_s=1.0)
            total += sent
            if sent < len(pings):
                break                              # the server closed: stop flooding
        during()
        acks, goaway = 0, None
        for ftype, flags, _, payload in a.frames():
            if ftype == PING:
                assert flags == ACK
                acks += 1
            elif ftype == GOAWAY:
                goaway = (int.from_bytes(payload[:4], "big"), int.from_bytes(payload[4:8], "big"),
                          payload[8:])
        assert acks == 3
        assert goaway == (0, ENHANCE_YOUR_CALM, b"too_many_pings")
    attack(server, body)


def test_h2_rapid_reset(server):
    """CVE-2023-44487: valid add_sub calls each reset (RST_STREAM CANCEL) right after it is
    sent, 10,000 times. The budget of resets before an answer (2 × 100 streams, earned back
    by answered calls) runs out: GOAWAY ENHANCE_YOUR_CALM, and nothing is left running."""
    def body(a: Attacker, during) -> None:
        headers = request_headers()
        msg = add_sub_request()
        burst = bytearray()
        for i in range(10_000):
            sid = 1 + 2 * i
            burst += frame_header(len(headers), HEADERS, END_HEADERS, sid) + headers
            burst += frame_header(len(msg), DATA, END_STREAM, sid) + msg
            burst += frame_header(4, RST_STREAM, 0, sid) + CANCEL.to_bytes(4, "big")
        a.flood(bytes(burst))
        during()
        last, code, _ = a.goaway()
        assert code == ENHANCE_YOUR_CALM
        assert 399 <= last < 2 * 10_000          # the 200th reset, plus any answered on the way
    attack(server, body)
    deadline = time.monotonic() + 10           # the cancelled calls leave nothing queued
    while (pending := _pending(server)) != 0:
        assert time.monotonic() < deadline, f"{pending} requests still pending"
        time.sleep(0.01)


def _pending(srv) -> float:
    with urllib.request.urlopen(srv.metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("nv_inference_pending_request_count") and 'model="add_sub"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no nv_inference_pending_request_count for add_sub")


def test_attacks_left_the_server_healthy(server):
    """After all of the above, a fresh client is served and the frontend lives on."""
    fe = server.frontend()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_server_ready(client_timeout=CALL_TIMEOUT_S)
    finally:
        client.close()
    with contextlib.suppress(psutil.NoSuchProcess):
        assert fe.is_running()
