"""Clients that give up on 4 MiB requests, wave after wave: gRPC unary calls past their
deadline (10 ms, shorter than the service time) or cancelled a couple of ms after sending,
ModelStreamInfer streams cancelled mid-stream, HTTP clients that hang up mid-body or right
after the last body byte. What a user notices, besides a well-behaved client getting exact
answers throughout: once traffic stops, the frontend gives back what the abandoned requests
held (RSS, /dev/shm segments, fds) and still answers.

It used to be otherwise: a cancelled ModelInfer kept its request in a reference cycle
through the cancelled task's traceback, freed only by the cyclic GC that an idle frontend
hardly runs, and a race left input blocks of the frontend's arena held forever. 200
deadline-exceeded 4 MiB calls a wave took a frontend from 66 to 418, 707 and 944 MiB over
three waves, and its /dev/shm segments grew wave after wave.

All the chaos of all the waves goes over one gRPC channel, so the connection must survive
it (the rapid-reset budget refills as time passes): a GOAWAY shows as UNAVAILABLE codes and
fails the test."""
from __future__ import annotations

import collections
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import shm_segments, start_server, wait_until

from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pbg
from tests.adversarial.clients import ANSWER_S, MIB, IdentityClient, N, identity_model

RSS_BOUND = 64 * MIB              # as the other adversarial tests: below 16 requests' bodies
WAVES = 5
DEADLINE_CALLS, CANCELLED_CALLS, STREAMS, HTTP_CUT, HTTP_CLOSED = 60, 40, 8, 20, 20
STREAM_REQUESTS = 3
SETTLE_S = 40.0                   # idle segments go after IDLE_S 10 s + a 5 s tick or two
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1),
                   ("grpc.max_receive_message_length", -1)]
# what an abandoned call may end with; UNAVAILABLE would be a lost connection (GOAWAY)
GAVE_UP = {"DEADLINE_EXCEEDED", "CANCELLED", "OK"}

VARIANTS = {"native": (), "aio": ("--grpc-impl", "aio"),
            "in-process-frontend": ("--in-process-frontend",), "frontends-2": ("--frontends", "2")}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("cancelled_calls") / "models"
    identity_model(root)
    return root


@pytest.fixture(params=list(VARIANTS))
def server(request, repo):
    with start_server(repo, *VARIANTS[request.param]) as srv:
        yield request.param, srv


def _frontends(variant: str, srv) -> list[psutil.Process]:
    """The processes that run a frontend: with --in-process-frontend, the scheduler's."""
    if variant == "in-process-frontend":
        assert srv.frontend_pids() == []
        return [psutil.Process(srv.proc.pid)]
    pids = srv.frontend_pids()
    assert len(pids) == (2 if variant == "frontends-2" else 1), pids
    return [psutil.Process(p) for p in pids]


def _chaos_request() -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="identity")
    t = r.inputs.add()
    t.name, t.datatype = "INPUT0", "FP32"
    t.shape.extend([1, N])
    r.raw_input_contents.append(np.ones(N, np.float32).tobytes())
    return r


# ---- the well-behaved client ---------------------------------------------------------------

class GoodClient(IdentityClient):
    """The identity client, over both protocols in turn."""

    def both(self) -> None:
        self.infer(grpcclient)
        self.infer(httpclient)

    def until(self, stop: threading.Event) -> int:
        """gRPC calls until ``stop`` (at least one); how many."""
        n = 0
        while not n or not stop.is_set():
            self.infer(grpcclient)
            n += 1
        return n


# ---- the clients that give up --------------------------------------------------------------

def _cancelled_stream(stub, req, read_one: bool) -> str:
    """Send STREAM_REQUESTS requests, read at most one answer, cancel with the stream open."""
    sent, release = threading.Event(), threading.Event()

    def requests():
        for _ in range(STREAM_REQUESTS):
            yield req
        sent.set()              # asked for one more: the ones before are written
        release.wait(ANSWER_S)  # keep the stream open (no half-close) until cancelled

    call = stub.ModelStreamInfer(requests(), timeout=ANSWER_S)
    try:
        if read_one:
            next(call)
        else:
            sent.wait(ANSWER_S)
            time.sleep(0.002)
        call.cancel()
        return "CANCELLED" if call.code() == grpc.StatusCode.CANCELLED else call.code().name
    except grpc.RpcError as e:
        return e.code().name
    finally:
        release.set()


def _http_hang_up(port: int, body: bytes, cut: bool) -> None:
    """A binary-tensor infer whose client closes mid-body (``cut``) or right after the
    last body byte, reading nothing."""
    head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, N], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(body)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as s:
        s.sendall(b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n"
                  b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
                  % (len(head), len(head) + len(body)) + head)
        s.sendall(memoryview(body)[:len(body) // 2] if cut else body)


def _code(fut) -> str:
    try:
        fut.result()
        return "OK"
    except grpc.FutureCancelledError:
        return "CANCELLED"
    except grpc.RpcError as e:
        return e.code().name


def _wave(srv, stub, req, good: GoodClient) -> collections.Counter:
    """One wave of every kind of abandoned call at once, the good client served meanwhile;
    the codes the abandoned gRPC calls ended with."""
    body = req.raw_input_contents[0]
    codes: collections.Counter = collections.Counter()
    stop = threading.Event()
    with ThreadPoolExecutor(2 + STREAMS + HTTP_CUT + HTTP_CLOSED) as pool:
        served = pool.submit(good.until, stop)
        others = [pool.submit(_http_hang_up, srv.http_port, body, i < HTTP_CUT)
                  for i in range(HTTP_CUT + HTTP_CLOSED)]
        streams = [pool.submit(_cancelled_stream, stub, req, i % 2 == 0) for i in range(STREAMS)]
        calls = []
        for i in range(max(DEADLINE_CALLS, CANCELLED_CALLS)):
            if i < DEADLINE_CALLS:
                calls.append(stub.ModelInfer.future(req, timeout=0.01))
            if i < CANCELLED_CALLS:
                f = stub.ModelInfer.future(req, timeout=ANSWER_S)
                time.sleep(0.002)
                f.cancel()
                calls.append(f)
        codes.update(_code(f) for f in calls)
        codes.update(s.result(ANSWER_S) for s in streams)
        for o in others:
            o.result(ANSWER_S)
        stop.set()
        assert served.result(ANSWER_S) >= 1
    return codes


class ConnectionWatch:
    """The connectivity states a channel went through: after its first READY, any other
    means its connection was lost (a GOAWAY, a close), which a retried call may hide. (The
    states are polled: a quick READY -> IDLE -> READY may go unseen; UNAVAILABLE codes
    are the other witness.)"""

    def __init__(self, channel: grpc.Channel):
        self.channel, self.states = channel, []
        channel.subscribe(self.states.append, try_to_connect=True)

    def lost(self) -> list[str]:
        seen = [s.name for s in self.states]
        after = seen[seen.index("READY"):] if "READY" in seen else []
        return after if set(after) - {"READY"} else []

    def close(self) -> None:
        self.channel.unsubscribe(self.states.append)


def test_abandoned_calls_give_back_what_they_held(server):
    variant, srv = server
    fronts = _frontends(variant, srv)
    good = GoodClient(srv)
    chaos = grpc.insecure_channel(srv.grpc_url, options=CHANNEL_OPTIONS)
    watch = ConnectionWatch(chaos)
    try:
        stub = pbg.GRPCInferenceServiceStub(chaos)
        req = _chaos_request()
        assert stub.ModelInfer(req, timeout=ANSWER_S).raw_output_contents == req.raw_input_contents
        good.both()

        def every_frontend_has_its_arena() -> bool:
            fresh = GoodClient(srv)   # new connections: SO_REUSEPORT spreads them
            try:
                fresh.both()
            finally:
                fresh.close()
            owners = {n.split("-")[1] for n in shm_segments({p.pid for p in fronts}) if "-in-" in n}
            return owners == {str(p.pid) for p in fronts}
        wait_until(every_frontend_has_its_arena, ANSWER_S, "an input segment in every frontend")
        family = srv.family()
        shm_before = len(shm_segments(family))
        fds_before = {p.pid: p.num_fds() for p in fronts}

        rss, codes = [], []   # per wave: {pid: RSS}, Counter of codes
        for _ in range(WAVES):
            codes.append(_wave(srv, stub, req, good))
            rss.append({p.pid: p.memory_info().rss for p in fronts})
            good.both()       # between the waves too
        lost = watch.lost()
        history = (f"RSS after each wave (MiB) {[{k: v // MIB for k, v in w.items()} for w in rss]}"
                   f"; codes of the abandoned gRPC calls {[dict(c) for c in codes]}")

        def state():
            return ({p.pid: p.memory_info().rss for p in fronts},
                    shm_segments(srv.family()), {p.pid: p.num_fds() for p in fronts})

        def given_back() -> bool:
            now, segs, fds = state()
            return (all(now[pid] <= rss[0][pid] + RSS_BOUND for pid in now)
                    and len(segs) <= shm_before and sum(fds.values()) <= sum(fds_before.values()))
        try:
            wait_until(given_back, SETTLE_S, "what the waves held to be given back", interval=0.5)
        except TimeoutError:
            now, segs, fds = state()
            pytest.fail(f"{variant}: not given back within {SETTLE_S:.0f} s of idle: RSS now "
                        f"{ {k: v // MIB for k, v in now.items()} } MiB, bound after wave 1 + "
                        f"{RSS_BOUND // MIB} MiB; /dev/shm {len(segs)} segments vs "
                        f"{shm_before}: {sorted(segs)}; fds {fds} vs {fds_before}; {history}")
        print(f"\n{variant}: {history}; once idle (MiB) "
              f"{ {p.pid: p.memory_info().rss // MIB for p in fronts} }")   # (shown with -s)
        gone = [dict(c) for c in codes if set(c) - GAVE_UP]
        assert not lost and not gone, \
            f"the chaos channel lost its connection (GOAWAY?): states {lost}, codes {gone}"
        assert srv.family() == family           # nothing restarted meanwhile
        good.both()                             # and it still answers
        assert stub.ModelInfer(req, timeout=ANSWER_S).raw_output_contents == req.raw_input_contents
    finally:
        watch.close()
        chaos.close()
        good.close()
