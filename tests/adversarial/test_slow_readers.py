"""Clients that send and never read their answers: a gRPC ModelStreamInfer of 4 MiB
requests, a hundred unary ModelInfer calls on one HTTP/2 connection, a decoupled model's
stream of a thousand large responses, HTTP/1.1 requests pipelined on one socket, and a
generate_stream whose events are never read. What a user notices: while such a client sits
there the frontend holds a bounded amount (the server runs with small bounds, 8 MiB of
answers a stream and 32 MiB a connection, so the figures are clear), another client on its
own connection keeps getting exact answers, and once the slow client leaves, the frontend
gives back what it held (RSS, /dev/shm segments).

It used to be otherwise for gRPC: a stream that sent 200 requests of 4 MiB and never read
took a frontend from 58 to 966 MiB in 15 s (every request was taken and run, every answer
queued for a client that gave the server no flow-control credit). Now a stream takes no new
request while --grpc-max-pending-stream-bytes of its answers wait, nor a connection while
--grpc-max-pending-connection-bytes do (docs/security.md, "What one client can make the
frontend hold").

Each test starts its own server, so that its baseline (taken after a few good calls have
settled the arena and the allocator) owes nothing to the test before it. No sleeps: a slow
client has stopped when it has made no progress for QUIET_S (its requests are no longer
taken, its model no longer produces); RSS is sampled every 50 ms from the baseline until the
slow client has left, and its return is polled with a deadline. The decoupled cases also
watch their model's worker, whose output arena holds what the frontend does not take; that
is reported (pytest -s), not asserted."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from models_python import python_model

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pbg
from tests.adversarial.clients import (
    ANSWER_S,
    MIB,
    QUIET_S,
    SLACK,
    IdentityClient,
    N,
    Watch,
    identity_model,
    quiet,
    worker_process,
)
from tests.unit.frontend.h2_raw import DATA, END_STREAM, HEADERS, RST_STREAM
from tests.unit.frontend.test_grpc_native import decode_response, grpc_message
from tests.unit.frontend.test_h2_backpressure import NonReader

STREAM_BOUND = 8 * MIB                   # --grpc-max-pending-stream-bytes
CONN_BOUND = 32 * MIB                    # --grpc-max-pending-connection-bytes
RECV_WINDOW = 16 * MIB                   # GrpcLimits.recv_window: what a client may still send
DEFAULT_WINDOW = 65_535                  # RFC 9113's initial window
BOUNDS = ("--grpc-max-pending-stream-bytes", str(STREAM_BOUND),
          "--grpc-max-pending-connection-bytes", str(CONN_BOUND))
HOLD_S = 3.0                             # then the good client is served this long
# grpc python shares a connection between channels with the same arguments: a local
# subchannel pool keeps each of these channels on a connection of its own
OWN_CONNECTION = [("grpc.max_send_message_length", -1),
                  ("grpc.max_receive_message_length", -1),
                  ("grpc.use_local_subchannel_pool", 1)]
BURST_SIZE = 128 << 10                   # bytes a decoupled response
BURST_COUNT = 1000                       # responses to the stream that is never read

BURST = '''
import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: N responses of SIZE bytes (response i filled with i % 251), sent from a
    thread after execute returned, then the final flag alone; it stops early once its
    request is cancelled. OUT (UINT8) or TEXT (one string), whichever its config has. How
    many it has sent so far is in the file "sent_<tag>" of its model folder (parameter
    "tag")."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.text = config["output"][0]["name"] == "TEXT"
        self.dir = args["model_repository"]
        self.threads = []

    def execute(self, requests):
        for request in requests:
            n, size = (int(pb_utils.get_input_tensor_by_name(request, k).as_numpy().flatten()[0])
                       for k in ("N", "SIZE"))
            tag = json.loads(request.parameters()).get("tag", "none")
            t = threading.Thread(target=self.respond,
                                 args=(n, size, tag, request.get_response_sender()))
            t.start()
            self.threads.append(t)
        return None

    def respond(self, n, size, tag, sender):
        path = os.path.join(self.dir, f"sent_{tag}")
        for i in range(n):
            if sender.is_cancelled():
                break
            if self.text:
                out = pb_utils.Tensor("TEXT", np.array([b"x" * size], dtype=object))
            else:
                out = pb_utils.Tensor("OUT", np.full(size, i % 251, np.uint8))
            sender.send(pb_utils.InferenceResponse([out]))
            with open(path, "w") as f:
                f.write(str(i + 1))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for t in self.threads:
            t.join()
'''


def _burst_config(name: str, output: str) -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            'model_transaction_policy { decoupled: true }\n'
            'input [{ name: "N" data_type: TYPE_INT32 dims: [ 1 ] },\n'
            '       { name: "SIZE" data_type: TYPE_INT32 dims: [ 1 ] }]\n'
            f'output [{output}]\ninstance_group [{{ kind: KIND_CPU, count: 1 }}]\n')


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slow_readers") / "models"
    identity_model(root)
    python_model(root, "burst", BURST, _burst_config(
        "burst", '{ name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] }'))
    python_model(root, "burst_text", BURST, _burst_config(
        "burst_text", '{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }'))
    return root


@pytest.fixture
def server(repo):
    with start_server(repo, *BOUNDS) as srv:
        yield srv


def _infer_request(data: np.ndarray, rid: str = "") -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="identity", id=rid)
    t = r.inputs.add()
    t.name, t.datatype = "INPUT0", "FP32"
    t.shape.extend(data.shape)
    r.raw_input_contents.append(data.tobytes())
    return r


def _burst_request(count: int, tag: str) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="burst")
    for name, value in (("N", count), ("SIZE", BURST_SIZE)):
        t = r.inputs.add()
        t.name, t.datatype = name, "INT32"
        t.shape.append(1)
        r.raw_input_contents.append(np.array([value], np.int32).tobytes())
    r.parameters["tag"].string_param = tag
    return r


def _generate_body(count: int, tag: str) -> bytes:
    return json.dumps({"N": count, "SIZE": BURST_SIZE, "parameters": {"tag": tag}}).encode()


def _progress(repo: Path, model: str, tag: str):
    """How many responses the model has sent for ``tag`` (a fresh count)."""
    path = repo / model / f"sent_{tag}"
    path.unlink(missing_ok=True)

    def made() -> int:
        try:
            return int(path.read_text() or 0)
        except (OSError, ValueError):
            return 0
    return made


# ---- the well-behaved client ---------------------------------------------------------------

class GoodClient(IdentityClient):
    """The identity client, and decoupled streams and generate_streams read to their end."""

    def burst(self, count: int = 8) -> None:
        """A decoupled stream of ``count`` responses, read to its end."""
        with grpc.insecure_channel(self.srv.grpc_url, options=OWN_CONNECTION) as ch:
            got = list(pbg.GRPCInferenceServiceStub(ch).ModelStreamInfer(
                iter([_burst_request(count, "good")]), timeout=ANSWER_S))
        assert [r.error_message for r in got] == [""] * count
        assert [r.infer_response.raw_output_contents[0] for r in got] == \
            [bytes([i % 251]) * BURST_SIZE for i in range(count)]

    def generate_stream(self, count: int = 8) -> None:
        """A generate_stream of ``count`` events, read to its end."""
        conn = http.client.HTTPConnection("127.0.0.1", self.srv.http_port, timeout=ANSWER_S)
        try:
            conn.request("POST", "/v2/models/burst_text/generate_stream",
                         body=_generate_body(count, "good"))
            r = conn.getresponse()
            assert r.status == 200
            events = r.read().split(b"\n\n")[:-1]
        finally:
            conn.close()
        assert [json.loads(e.removeprefix(b"data: "))["TEXT"] for e in events] == \
            ["x" * BURST_SIZE] * count

    def hold(self, also=None) -> int:
        """Calls, gRPC and HTTP in turn (each followed by ``also()``), for HOLD_S; how many."""
        n = 0
        deadline = time.monotonic() + HOLD_S
        while n < 2 or time.monotonic() < deadline:
            self.infer(grpcclient if n % 2 == 0 else httpclient)
            if also is not None:
                also()
            n += 1
        return n


def warmed_up(srv, *also) -> GoodClient:
    """A good client whose first calls (and ``also``'s) have settled the frontend's arena
    and allocator, and created the output arenas of the models they call."""
    good = GoodClient(srv)
    for _ in range(3):
        good.infer(grpcclient)
        good.infer(httpclient)
        for f in also:
            f(good)
    return good


# ---- what the server holds -----------------------------------------------------------------

def report(case: str, w: Watch, after: str, extra: str) -> None:
    print(f"\n{case}: {w.figures()}; {extra}; {after}")   # (shown with -s)


# ---- 1. a gRPC stream that never reads -------------------------------------------------------

def test_a_stream_that_never_reads_holds_a_bounded_amount(server):
    """200 requests of 4 MiB on a ModelStreamInfer whose answers are never read: the stream
    takes a few, then no more (its window stays shut); the frontend holds its answers
    queued, produced and running (3 x the stream bound) and a receive window of requests."""
    srv = server
    good = warmed_up(srv)
    req = _infer_request(np.ones((1, N), np.float32))
    pulled, release = [0], threading.Event()

    def requests():
        for _ in range(200):
            pulled[0] += 1
            yield req
        release.wait(2 * ANSWER_S)    # (the stream stays open: no half-close)

    ch = grpc.insecure_channel(srv.grpc_url, options=OWN_CONNECTION)
    try:
        with Watch(srv) as w:
            call = pbg.GRPCInferenceServiceStub(ch).ModelStreamInfer(requests(), timeout=120)
            try:     # (never read)
                sent = quiet(lambda: pulled[0], "the stream to take no more requests")
                served = good.hold()
            finally:
                call.cancel()
                release.set()
    finally:
        ch.close()
    bound = 3 * STREAM_BOUND + RECV_WINDOW + SLACK
    assert w.growth() < bound, f"{w.figures()}; bound {bound // MIB} MiB; {sent} requests sent"
    assert sent < 50, f"the stream took {sent} of 200 requests: {w.figures()}"
    after = w.given_back()
    report("stream", w, after, f"requests sent {sent} of 200, good calls {served}")
    good.infer(grpcclient)
    good.close()


# ---- 2. unary calls on a connection that never reads -----------------------------------------

UNARY_CALLS = 100
UNARY_N = 1 << 18                        # FP32 elements: 1 MiB requests and answers
FRAME = 16 << 10                         # DATA frames within any peer's SETTINGS_MAX_FRAME_SIZE
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"


async def _send_calls(client: NonReader, messages: list[bytes], state: dict, credit) -> bool:
    """Open a ModelInfer stream per message and send it, in frames, as the server's credit
    allows (``await credit()`` waits for more: False if none came); False once the credit
    stopped (``state``: the call and offset to go on from), True once every call is sent."""
    while state["i"] < len(messages):
        i, sid = state["i"], 1 + 2 * state["i"]
        msg = messages[i]
        if state["off"] == 0:
            client.open(sid, INFER_PATH)
        while state["off"] < len(msg):
            while min(client.conn_credit, client.credit[sid]) <= 0:
                if not await credit():
                    return False
            off = state["off"]
            n = min(len(msg) - off, FRAME, client.conn_credit, client.credit[sid])
            client.c.frame(DATA, END_STREAM if off + n == len(msg) else 0, sid, msg[off:off + n])
            client.conn_credit -= n
            client.credit[sid] -= n
            state["off"] = off + n
            await client.c.writer.drain()
        state["i"], state["off"] = i + 1, 0
    return True


async def _answers(client: NonReader, sids: list[int]) -> dict[int, tuple[bytes, dict]]:
    """Every answer (body, trailers) of ``sids``, from the frames of the connection in
    order (another task reads them)."""
    bodies: dict[int, bytearray] = {sid: bytearray() for sid in sids}
    done: dict[int, tuple[bytes, dict]] = {}
    i = 0
    deadline = time.monotonic() + ANSWER_S
    while len(done) < len(sids):
        if i >= len(client.frames):
            assert time.monotonic() < deadline, f"only {len(done)} of {len(sids)} answers came"
            await asyncio.sleep(0.01)
            continue
        ftype, flags, sid, payload = client.frames[i]
        i += 1
        assert ftype != RST_STREAM, f"stream {sid} reset"
        if ftype == HEADERS:
            block = dict(client.c.decoder.decode(payload, raw=True))
            if flags & END_STREAM and sid in bodies:
                done[sid] = (bytes(bodies[sid]), block)
        elif ftype == DATA and sid in bodies:
            bodies[sid] += payload
    return done


async def _resume(client: NonReader, messages: list[bytes], state: dict) -> dict:
    """The client reads again: a task takes the frames, the rest of the calls go out;
    every answer."""
    client.read_again()

    async def pump() -> None:
        while True:
            await client._read(ANSWER_S)

    async def credit() -> bool:
        await asyncio.sleep(0.005)
        return True
    reader = asyncio.create_task(pump())
    try:
        await asyncio.wait_for(_send_calls(client, messages, state, credit), ANSWER_S)
        return await _answers(client, [1 + 2 * i for i in range(len(messages))])
    finally:
        reader.cancel()


def test_unary_calls_on_a_connection_that_never_reads_hold_a_bounded_amount(server):
    """100 ModelInfer calls of 1 MiB on one connection that respects the server's windows
    and never opens its own (NonReader): calls run while their answers fit the connection
    bound, the others wait with their requests, then the server gives no more credit; once
    the client reads, every call is answered exactly."""
    srv = server
    good = warmed_up(srv)
    rng = np.random.default_rng(3)
    data = [rng.standard_normal((1, UNARY_N)).astype(np.float32) for _ in range(4)]
    messages = [grpc_message(_infer_request(data[i % 4], f"u{i}").SerializeToString())
                for i in range(UNARY_CALLS)]
    state = {"i": 0, "off": 0}
    # one event loop, run while the raw client acts (tritonclient.http's greenlets must stay
    # on this thread); in between, nothing reads its socket
    loop = asyncio.new_event_loop()
    client = None
    try:
        with Watch(srv) as w:
            client = loop.run_until_complete(NonReader.connect(srv.grpc_port, RECV_WINDOW))
            # it sends while credit comes, reading only the server's frames
            all_sent = loop.run_until_complete(
                _send_calls(client, messages, state, lambda: client._read(QUIET_S)))
            sent = state["i"] + (not all_sent)   # calls whose request went, at least in part
            answered = sum(1 for t, f, _, _ in client.frames if t == HEADERS and not f & END_STREAM)
            served = good.hold()
            stalled = w.growth()
            got = loop.run_until_complete(_resume(client, messages, state))
    finally:
        if client is not None:
            client.c.close()
        loop.close()
    # The connection's gate starts a call only while the answers waiting, the requests of
    # the calls running and one answer of the largest size for each stay within CONN_BOUND
    # (the first calls, before any answer gave the size, by their requests alone): at most
    # CONN_BOUND of answers. The calls waiting at the gate hold their requests, and the
    # connection's receive window stays shut only once CONN_BOUND of them wait: at most
    # CONN_BOUND + RECV_WINDOW of requests.
    per_call = len(messages[0])
    assert answered <= CONN_BOUND // per_call + 1, \
        f"{answered} calls answered for a client that reads nothing: {w.figures()}"
    assert sent <= (2 * CONN_BOUND + RECV_WINDOW) // per_call + 1, \
        f"{sent} of {UNARY_CALLS} calls taken: {w.figures()}"
    bound = CONN_BOUND + CONN_BOUND + RECV_WINDOW + SLACK
    assert w.growth() < bound, f"{w.figures()}; bound {bound // MIB} MiB; {sent} calls sent"
    for i in range(UNARY_CALLS):
        body, trailers = got[1 + 2 * i]
        assert trailers.get(b"grpc-status") == b"0", (i, trailers)
        resp = decode_response(body)
        assert resp.id == f"u{i}" and resp.raw_output_contents[0] == data[i % 4].tobytes(), i
    after = w.given_back()
    report("unary", w, after, f"calls sent before the stall {sent} of {UNARY_CALLS}, "
           f"answered then {answered}, peak growth until it read again {stalled / MIB:.0f} "
           f"MiB, good calls {served}")
    good.infer(grpcclient)
    good.close()


# ---- 3. a decoupled model's stream that is never read ----------------------------------------

def test_a_decoupled_stream_never_read_holds_a_bounded_amount(server, repo):
    """One request for 1,000 responses of 128 KiB on a stream that is never read: the
    frontend takes no more of them than the stream bound lets it hold; the model goes on,
    and what the frontend does not take waits in its worker's output arena."""
    srv = server
    good = warmed_up(srv, GoodClient.burst)
    made = _progress(repo, "burst", "slow")
    release = threading.Event()

    def requests():
        yield _burst_request(BURST_COUNT, "slow")
        release.wait(2 * ANSWER_S)

    ch = grpc.insecure_channel(srv.grpc_url, options=OWN_CONNECTION)
    try:
        with Watch(srv, {"worker": worker_process(srv, "burst")}) as w:
            call = pbg.GRPCInferenceServiceStub(ch).ModelStreamInfer(requests(), timeout=120)
            try:     # (never read)
                wait_until(made, ANSWER_S, "the model's first response")
                count = quiet(made, "the model to stop producing", timeout=60)
                served = good.hold(good.burst)
            finally:
                call.cancel()
                release.set()
    finally:
        ch.close()
    bound = 3 * STREAM_BOUND + SLACK
    assert w.growth() < bound, f"{w.figures()}; bound {bound // MIB} MiB; {count} responses made"
    after = w.given_back()
    report("decoupled", w, after, f"responses made {count} of {BURST_COUNT} "
           f"({count * BURST_SIZE / MIB:.0f} MiB), good calls {served}")
    good.burst()
    good.close()


# ---- 4. HTTP/1.1 requests pipelined on a socket that is never read ---------------------------

def _http_request(body: bytes) -> bytes:
    head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, N], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(body)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return (b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
            b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
            % (len(head), len(head) + len(body)) + head + body)


def _send_until_stuck(s: socket.socket, data: bytes, copies: int) -> int:
    """Send ``copies`` of ``data`` until the peer takes nothing for QUIET_S; bytes sent."""
    s.settimeout(QUIET_S)
    sent = 0
    view = memoryview(data)
    try:
        for _ in range(copies):
            off = 0
            while off < len(view):
                n = s.send(view[off:off + MIB])
                off += n
                sent += n
    except TimeoutError:
        pass
    return sent


def test_pipelined_http_requests_never_read_hold_a_bounded_amount(server):
    """200 binary-tensor infers of 4 MiB pipelined on one socket that is never read: the
    server reads no further while an answer waits, so it holds about one request and one
    answer (the socket buffers hold a few more)."""
    srv = server
    good = warmed_up(srv)
    one = _http_request(np.ones(N, np.float32).tobytes())
    with Watch(srv) as w:
        s = socket.create_connection(("127.0.0.1", srv.http_port))
        try:
            sent = _send_until_stuck(s, one, 200)
            served = good.hold()
        finally:
            s.close()
    bound = SLACK + 2 * 4 * MIB
    assert w.growth() < bound, f"{w.figures()}; bound {bound // MIB} MiB"
    assert sent < 200 * len(one)
    after = w.given_back()
    report("http pipelined", w, after, f"requests sent {sent / len(one):.1f} of 200, "
           f"good calls {served}")
    good.close()


# ---- 5. a generate_stream whose events are never read ----------------------------------------

def test_a_generate_stream_never_read_holds_a_bounded_amount(server, repo):
    """generate_stream (server-sent events) of 1,000 events of 128 KiB, never read: the
    frontend writes an event only once the transport has drained the one before."""
    srv = server
    good = warmed_up(srv, GoodClient.generate_stream)
    made = _progress(repo, "burst_text", "sse")
    body = _generate_body(BURST_COUNT, "sse")
    with Watch(srv, {"worker": worker_process(srv, "burst_text")}) as w:
        s = socket.create_connection(("127.0.0.1", srv.http_port))
        try:
            s.sendall(b"POST /v2/models/burst_text/generate_stream HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                      % len(body) + body)
            wait_until(made, ANSWER_S, "the model's first response")
            count = quiet(made, "the model to stop producing", timeout=60)
            served = good.hold(good.generate_stream)
        finally:
            s.close()
    bound = SLACK + 2 * BURST_SIZE
    assert w.growth() < bound, f"{w.figures()}; bound {bound // MIB} MiB; {count} events made"
    after = w.given_back()
    report("generate_stream", w, after, f"events made {count} of {BURST_COUNT} "
           f"({count * BURST_SIZE / MIB:.0f} MiB), good calls {served}")
    good.close()
