#!/usr/bin/env python
"""Life of a request: CPU µs per stage of one add_sub request (HTTP, gRPC) and of one
two-step ensemble request, each stage timed in this process with the real functions.

    python benchmarks/request_budget.py [--n 4000] [--repeats 5] [--hop-n 4000]
                                        [--server [--server-repeats 3] [--duration 5]]
                                        [--triton-trace] [--json out.json]

In-process part (always): the frontend, the scheduler and the workers are built as the
processes build them, but wired to fake transports, so each stage is called on the bytes
the stage before it produced: tritonclient's HTTP body (binary tensors) and gRPC
ModelInferRequest for Triton's add_sub model (two FP32 [16] inputs, two outputs), the
InferRequest the DataPlane encodes, the ExecuteBatch the scheduler encodes, the results
and BatchDone the worker encodes. Each stage: µs per call over --n calls, the median of
--repeats, on this thread's CPU clock (time.thread_time_ns: the machine is shared, and
preemption must not count; --wall: time.perf_counter_ns). Socket syscalls and the
wake-up of the receiving process are not in these: the hop rows measure them between two processes (the stream
transport on uvloop at both ends, and uvloop <-> the worker's BlockingConnection): the
CPU of both processes (getrusage) per one-way message.

--server: real `trireme serve` (defaults) and real Triton 2.51 (../shared/tools/triton.sh)
on vs_triton_models' repository, c1 with the official clients (vs_triton_runs.c1_latency:
its CPU meter reads /proc of every server process), alternating Triton, Trireme; server
CPU µs per request per process, medians. --triton-trace: one more Triton started with
--trace-config level=TIMESTAMPS rate=1, the same c1 loads, and the median gaps between
its trace timestamps (wall time, not CPU) for the coarse stages.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server import ROOT, Server, log  # noqa: E402
from vs_triton_models import ENSEMBLE, WIDTH, add_sub_inputs, build_repository  # noqa: E402

sys.path.insert(0, str(ROOT))
import uvloop  # noqa: E402

from protos import model_config_pb2 as mc  # noqa: E402
from services.common import messages as m  # noqa: E402
from services.common import shm, transport_stream  # noqa: E402
from services.common.config import parse_pbtxt  # noqa: E402
from services.common.procutil import tune_gc  # noqa: E402
from services.dataplane.client import DataPlane  # noqa: E402
from services.dataplane.outbox import Outbox  # noqa: E402
from services.dataplane.validation import validate_infer  # noqa: E402
from services.frontend.grpc import codec as grpc_codec  # noqa: E402
from services.frontend.grpc.methods import rpc_methods  # noqa: E402
from services.frontend.grpc.native import NativeGrpcServer  # noqa: E402
from services.frontend.http import codec as http_codec  # noqa: E402
from services.frontend.http.engine import NativeHttpServer  # noqa: E402
from services.frontend.http.message import Reply  # noqa: E402
from services.frontend.http.routes import Handlers  # noqa: E402
from services.frontend.settings import FrontendSettings  # noqa: E402
from services.scheduler.main import Scheduler, SchedulerSettings  # noqa: E402
from services.workers.backends.base import create_backend  # noqa: E402
from services.workers.main import Worker  # noqa: E402
from services.workers.python import backend as py_backend  # noqa: E402

A, B = add_sub_inputs()
SERVICE = "/inference.GRPCInferenceService/ModelInfer"


# ============================================================================ timing
# The clock of the in-process stages: this thread's CPU time (other processes on the
# shared 2 cores preempt us; CPU time does not count that), or with --wall perf_counter_ns.
CLOCK = time.thread_time_ns


def per_call(fn, n: int, repeats: int) -> float:
    """µs per fn() call: the median of `repeats` timings of n calls (after n // 5 warm-up)."""
    for _ in range(max(1, n // 5)):
        fn()
    runs = []
    for _ in range(repeats):
        t = CLOCK()
        for _ in range(n):
            fn()
        runs.append((CLOCK() - t) / n / 1e3)
    return statistics.median(runs)


def in_loop(loop, fn, n: int, repeats: int) -> float:
    """per_call() run inside `loop` (for functions that need a running loop)."""
    async def run() -> float:
        return per_call(fn, n, repeats)
    t = loop.run_until_complete(run())
    loop.run_until_complete(asyncio.sleep(0))     # what the calls scheduled
    return t


def per_request_async(loop, one, n: int, repeats: int) -> float:
    """µs per `await one()` run back to back on `loop` (median of repeats)."""
    async def run(k: int) -> float:
        t = CLOCK()
        for _ in range(k):
            await one()
        return (CLOCK() - t) / k / 1e3
    loop.run_until_complete(run(max(1, n // 5)))
    return statistics.median(loop.run_until_complete(run(n)) for _ in range(repeats))


def segmented(one_pass, n: int, repeats: int, out: dict) -> None:
    """one_pass(timed) appends ns per named segment; out[name] = µs, median of repeats."""
    for _ in range(max(1, n // 5)):
        one_pass()
    runs: list[dict] = []
    for _ in range(repeats):
        timed: dict = {}
        for _ in range(n):
            one_pass(timed)
        runs.append({k: sum(v) / len(v) / 1e3 for k, v in timed.items()})
    for k in runs[0]:
        out[k] = statistics.median(r[k] for r in runs)


def framed(parts) -> bytes:
    """The bytes transport_stream puts on the wire for one message."""
    return b"".join(bytes(p) if not isinstance(p, bytes) else p
                    for p in transport_stream.frame(parts))


def split(data: bytes) -> list:
    """What BlockingConnection.recv returns for one framed message."""
    return transport_stream._split(memoryview(bytearray(data))[4:])


class FakeTransport(asyncio.Transport):
    """An asyncio transport that hands each write to `on_write` (no syscall)."""

    def __init__(self, on_write=None) -> None:
        super().__init__()
        self.on_write = on_write

    def write(self, data) -> None:
        if self.on_write is not None:
            self.on_write(data)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


class FakeBlocking:
    """The worker's BlockingConnection.send without the socket: frames and joins."""

    def __init__(self) -> None:
        self.last = b""

    def send(self, parts) -> None:
        self.last = framed(parts)

    def close(self) -> None:
        pass


def peer(listener, identity: bytes, on_write=None):
    """A connected peer of a transport_stream.Listener that was never started."""
    p = transport_stream._PeerProtocol(listener)
    p.connection_made(FakeTransport(on_write))
    p.data_received(framed([identity]))
    return p


# ============================================================================ the pieces
class Rig:
    """One scheduler, one worker per model (add_sub, scale), one DataPlane, on fakes."""

    def __init__(self, loop, tmp: Path) -> None:
        self.loop = loop
        self.tmp = tmp
        repo = build_repository(tmp)
        self.repo = repo
        self.domain = shm.domain()
        # ---- scheduler
        s = self.sched = Scheduler(SchedulerSettings(
            [repo], f"unix://{tmp}/f.sock", f"unix://{tmp}/w.sock", allow_metrics=False))
        s.step_addr = f"unix://{tmp}/steps.sock"
        pids = itertools.count(1_000_000)

        async def spawn(inst, config, model_dir, autocomplete):
            inst.pid, inst.shm_domain, inst.loaded = next(pids), self.domain, True
            s._by_pid[inst.pid] = inst
            s._workers[inst.worker_id] = inst
            return mc.ModelConfig.FromString(config)

        s.models.spawn_instance = spawn
        s.fsock = transport_stream.Listener(f"unix://{tmp}/f.sock", s._on_frontend, s._frontend_lost)
        s.wsock = transport_stream.Listener(f"unix://{tmp}/w.sock", s._on_worker)
        s.ssock = transport_stream.Listener(s.step_addr, s._on_step_results)
        for name in ("add_sub", "scale", ENSEMBLE):
            loop.run_until_complete(s.models.load(name))
        s.ready = True
        self.to_frontend = b""
        self.to_worker: dict[str, bytes] = {}

        def keep_front(d):
            self.to_frontend = bytes(d)
        self.front_peer = peer(s.fsock, b"frontend-1", keep_front)
        self.worker_peer = {}
        for name in ("add_sub", "scale"):
            inst = s.models.lookup(name).instances[0]

            def keep(d, name=name):
                self.to_worker[name] = bytes(d)
            self.worker_peer[name] = peer(s.wsock, inst.worker_id.encode(), keep)
        # ---- data plane (the frontend's half)
        self.result_addr = f"unix://{tmp}/results.sock"
        self.front_peer.data_received(framed(m.encode(m.FrontendHello(os.getpid(), self.domain,
                                                                       self.result_addr))))
        dp = self.dp = DataPlane(FrontendSettings(f"unix://{tmp}/f.sock", self.result_addr))
        dp._scheduler_lost, dp._scheduler_ready = False, True
        self.sent = b""                              # the frontend's last message to the scheduler
        self.on_sent = None
        conn = transport_stream.Connection(dp.settings.scheduler_addr, dp._on_message)
        conn._transport = FakeTransport(self._frontend_wrote)
        dp._sched = conn
        dp._loop = self.loop                         # (what start() sets)
        dp._outbox = Outbox(dp._send_parts, dp._deliver, self.result_addr, self.loop)
        for name in ("add_sub", ENSEMBLE):
            self.front_peer.data_received(framed(m.encode(m.GetModelInfo(next(dp._ids), name))))
            info, _ = m.decode(split(self.to_frontend))
            dp._models[name] = info
        results = transport_stream.Listener(self.result_addr, dp._on_result)
        self.results_peer = peer(results, b"worker-1")
        # ---- workers
        self.workers = {n: self._worker(n) for n in ("add_sub", "scale")}

    def _frontend_wrote(self, data) -> None:
        self.sent = bytes(data)
        if self.on_sent is not None:
            self.on_sent(self.sent)

    def _worker(self, name: str) -> Worker:
        cfg = parse_pbtxt((self.repo / name / "config.pbtxt").read_text())
        inst = self.sched.models.lookup(name).instances[0]
        w = Worker.__new__(Worker)
        w.worker_id, w.scheduler_addr = inst.worker_id, f"unix://{self.tmp}/w.sock"
        w.sock = FakeBlocking()
        w.pushers, w.unreachable, w.lent, w.orphans = {self.result_addr: FakeBlocking()}, {}, {}, {}
        w.segments, w.regions = shm.SegmentMap(), None
        w.arena, w.shm_ok, w.domain = shm.Arena("out"), True, self.domain
        w.housekeeper = shm.Housekeeper(w.arena, w.segments)
        w.inline_threshold = shm.DEFAULT_INLINE_THRESHOLD
        w.backend = create_backend(cfg, m.LoadModel(name, 1, str(self.repo / name), cfg.SerializeToString(),
                                                    f"{name}_0", step_addr=self.sched.step_addr))
        w.batch_io, w.sequence_io = None, None
        w.config_outputs = [o.name for o in w.backend.config.output]
        w.lock, w.model, w.step_addr, w.running = threading.Lock(), name, self.sched.step_addr, True
        w._finals, w._streaming, w._first_at = set(), set(), {}
        return w

    # one message through one process's handler -----------------------------------------
    def scheduler_gets_request(self, data: bytes) -> None:
        self.front_peer.data_received(data)

    def scheduler_gets_batch_done(self, model: str, data: bytes) -> None:
        self.worker_peer[model].data_received(data)

    def worker_runs(self, model: str, data: bytes) -> tuple[bytes, bytes]:
        """(result message to the frontend or b"", BatchDone) for one ExecuteBatch."""
        w = self.workers[model]
        msg, frames = m.decode(split(data), for_worker=True)
        w.execute(msg, frames)
        return w.pushers[self.result_addr].last, w.sock.last


# ============================================================================ client bytes
def http_request_bytes(model: str = "add_sub") -> bytes:
    """What tritonclient.http sends for add_sub: binary inputs, two binary outputs."""
    import tritonclient.http as th
    ins = []
    for name, arr in (("INPUT0", A), ("INPUT1", B)):
        i = th.InferInput(name, list(arr.shape), "FP32")
        i.set_data_from_numpy(arr)
        ins.append(i)
    outs = [th.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
    body, json_size = th.InferenceServerClient.generate_request_body(ins, outputs=outs)
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
            "User-Agent: python/gevent-http-client-1.5.3\r\nAccept-Encoding: identity\r\n"
            f"Inference-Header-Content-Length: {json_size}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def grpc_message(model: str) -> bytes:
    """tritonclient.grpc's ModelInferRequest for add_sub (or the ensemble), serialized."""
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, arr in (("INPUT0", A), ("INPUT1", B)):
        t = req.inputs.add()
        t.name, t.datatype = name, "FP32"
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    for name in (("OUTPUT0", "OUTPUT1") if model == "add_sub" else ("OUTPUT0",)):
        req.outputs.add().name = name
    return req.SerializeToString()


class H2Client:
    """The frames a gRPC client writes: preface, SETTINGS, a large connection window, then
    per call HEADERS (HPACK, one encoder for the connection, as a client keeps) and DATA."""

    def __init__(self) -> None:
        from hpack import Encoder
        self.enc = Encoder()
        self.sid = -1

    @staticmethod
    def frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload

    def preface(self) -> bytes:
        return (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + self.frame(4, 0, 0, b"")
                + self.frame(8, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))

    def call(self, message: bytes, model: str) -> tuple[int, bytes]:
        self.sid += 2
        block = self.enc.encode([
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE),
            (":authority", "127.0.0.1:8001"), ("content-type", "application/grpc"),
            ("te", "trailers"), ("grpc-accept-encoding", "identity,deflate,gzip"),
            ("user-agent", "grpc-python/1.66.0 grpc-c/43.0.0 (linux; chttp2)")])
        body = b"\x00" + struct.pack(">I", len(message)) + message
        return self.sid, self.frame(1, 4, self.sid, block) + self.frame(0, 1, self.sid, body)


def ended(data: bytes, sid: int) -> bool:
    """Whether ``data`` (server frames) holds stream ``sid``'s trailers (END_STREAM)."""
    pos = 0
    while pos + 9 <= len(data):
        n = int.from_bytes(data[pos:pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        s = int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF
        if s == sid and flags & 1 and kind in (0, 1):
            return True
        pos += 9 + n
    return False


# ============================================================================ stages
def frontend_stages(rig: Rig, n: int, repeats: int) -> dict[str, float]:
    """Every frontend stage of one add_sub request, HTTP and gRPC, in isolation and whole."""
    loop, dp = rig.loop, rig.dp
    out: dict[str, float] = {}
    settings = FrontendSettings(dp.settings.scheduler_addr)
    info = dp._models["add_sub"]

    req_http = http_request_bytes()
    head_len = req_http.index(b"\r\n\r\n") + 4
    body = req_http[head_len:]
    hlen = int(req_http.split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0])
    core, binary = http_codec.decode_infer_request("add_sub", "", memoryview(body), hlen)
    out["http.decode"] = per_call(lambda: http_codec.decode_infer_request(
        "add_sub", "", memoryview(body), hlen), n, repeats)
    out["validate"] = per_call(lambda: validate_infer(info, core), n, repeats)

    # --- DataPlane._send_request (validation, input placement, InferRequest) and the flush
    def send_request():
        fut = loop.create_future()
        req_id = dp._send_request(core, info, 1, fut)
        dp._pending.pop(req_id, None)
        dp._inflight.pop(req_id, None)
        dp._outbox.drop()
    out["dp.send_request"] = in_loop(loop, send_request, n, repeats)
    dp._outbox.drop()

    def flush():
        fut = loop.create_future()
        req_id = dp._send_request(core, info, 1, fut)
        dp._outbox._flush_requests()
        dp._pending.pop(req_id, None)
        dp._inflight.pop(req_id, None)
    out["dp.send_request+flush"] = in_loop(loop, flush, n, repeats)
    loop.run_until_complete(asyncio.sleep(0))            # the scheduled (empty) flushes
    request_bytes = rig.sent

    # --- the result coming back: worker's bytes through the results listener into a future
    rig.scheduler_gets_request(request_bytes)
    result_bytes, done0 = rig.worker_runs("add_sub", rig.to_worker["add_sub"])
    rig.scheduler_gets_batch_done("add_sub", done0)
    res_msg, res_frames = m.decode(split(result_bytes))
    rid = res_msg.req_id

    def on_result():
        fut = loop.create_future()
        dp._pending[rid] = fut
        dp._inflight[rid] = []
        rig.results_peer.data_received(result_bytes)
    out["dp.on_result"] = in_loop(loop, on_result, n, repeats)
    out["dp.response"] = per_call(lambda: dp._response(core, 1, res_msg, res_frames, info), n, repeats)
    resp = dp._response(core, 1, res_msg, res_frames, info)
    out["http.encode"] = per_call(lambda: http_codec.encode_infer_response(resp, core, binary), n, repeats)
    payload, json_len = http_codec.encode_infer_response(resp, core, binary)
    gmsg = grpc_message("add_sub")
    greq = grpc_codec.decode_infer_request(gmsg)
    out["grpc.decode"] = per_call(lambda: grpc_codec.decode_infer_request(gmsg), n, repeats)
    out["grpc.request_from_proto"] = per_call(lambda: grpc_codec.request_from_proto(*greq), n, repeats)
    gcore = grpc_codec.request_from_proto(*greq)
    gresp = dp._response(gcore, 1, res_msg, res_frames, info)
    out["grpc.encode"] = per_call(lambda: grpc_codec.encode_infer_response(gresp), n, repeats)
    canned_grpc = grpc_codec.encode_infer_response(gresp)

    # --- the HTTP/1.1 engine alone: parse, task, answer write (a canned answer)
    canned = Reply(200, payload, "application/octet-stream",
                   {"Inference-Header-Content-Length": str(json_len)})

    async def stub(request):
        await request.read()
        return canned

    def http_conn(handle):
        server = NativeHttpServer(handle, settings.http_max_input_size, settings=settings)
        conn = server.protocol()
        box: list = [None]

        def wrote(d):
            if box[0] is not None and not box[0].done():
                box[0].set_result(d)
        conn.connection_made(FakeTransport(wrote))
        return conn, box

    async def make_http(handle):
        return http_conn(handle)

    conn, box = loop.run_until_complete(make_http(stub))

    async def http_one():
        box[0] = loop.create_future()
        conn.data_received(req_http)
        await box[0]
    out["http.engine"] = per_request_async(loop, http_one, n, repeats)

    # --- Handlers (routes + codec) over a data plane that answers at once
    class Instant:
        trace_on = False

        async def infer(self, req, endpoint="HTTP end point"):
            return dp._response(req, 1, res_msg, res_frames, info)

        def release(self, resp):
            pass

        def __getattr__(self, name):
            return getattr(dp, name)

    handlers = Handlers(Instant(), settings)
    conn2, box2 = loop.run_until_complete(make_http(handlers.dispatch))

    async def http_handlers_one():
        box2[0] = loop.create_future()
        conn2.data_received(req_http)
        await box2[0]
    out["http.engine+handlers"] = per_request_async(loop, http_handlers_one, n, repeats)

    # --- the whole frontend: engine, handlers, DataPlane; the scheduler answers at once
    def answer_with_result(sent):
        msg, _ = m.decode(split(sent))
        reqs = msg.requests if isinstance(msg, m.InferRequests) else [msg]
        for r in reqs:
            res_msg.req_id = r.req_id
            loop.call_soon(rig.results_peer.data_received, framed(m.encode(res_msg, res_frames)))

    # (answer_with_result decodes and encodes what the scheduler and worker would: timed
    # alone below and subtracted)
    rig.on_sent = answer_with_result
    full_handlers = Handlers(dp, settings)
    conn3, box3 = loop.run_until_complete(make_http(full_handlers.dispatch))

    async def http_full_one():
        box3[0] = loop.create_future()
        conn3.data_received(req_http)
        await box3[0]
    out["http.frontend_whole_raw"] = per_request_async(loop, http_full_one, n, repeats)
    out["fake_answer"] = per_call(lambda: answer_with_result(request_bytes), n, repeats)
    loop.run_until_complete(asyncio.sleep(0.01))
    dp._pending.clear()
    dp._inflight.clear()

    # --- gRPC: HTTP/2 engine alone (canned answer), then the whole frontend
    def grpc_conn(methods):
        server = NativeGrpcServer(methods)
        conn = server._connection()
        box: list = [None, 0]

        def wrote(d):
            f = box[0]
            if f is not None and not f.done() and ended(bytes(d), box[1]):
                f.set_result(None)
        conn.connection_made(FakeTransport(wrote))
        client = H2Client()
        conn.data_received(client.preface())
        return conn, box, client

    from types import SimpleNamespace

    async def grpc_stub(request, context):
        return canned_grpc

    stub_methods = {SERVICE: SimpleNamespace(streaming=False, handler=grpc_stub,
                                             deserialize=lambda b: b, serialize=lambda b: b)}

    async def make_grpc(methods):
        return grpc_conn(methods)

    def grpc_runner(methods, model="add_sub"):
        gc, gbox, client = loop.run_until_complete(make_grpc(methods))
        msg = grpc_message(model)
        calls = iter([client.call(msg, model) for _ in range(n * (repeats + 1) + 8)])

        async def one():
            sid, frames = next(calls)
            gbox[0], gbox[1] = loop.create_future(), sid
            gc.data_received(frames)
            await gbox[0]
        return one
    out["grpc.engine"] = per_request_async(loop, grpc_runner(stub_methods), n, repeats)
    out["grpc.frontend_whole_raw"] = per_request_async(
        loop, grpc_runner(rpc_methods(dp, settings)), n, repeats)
    loop.run_until_complete(asyncio.sleep(0.01))
    rig.on_sent = None
    dp._pending.clear()
    dp._inflight.clear()
    out["http.frontend_whole"] = out["http.frontend_whole_raw"] - out["fake_answer"]
    out["grpc.frontend_whole"] = out["grpc.frontend_whole_raw"] - out["fake_answer"]
    rig.request_bytes = request_bytes
    return out


def scheduler_worker_stages(rig: Rig, n: int, repeats: int) -> dict[str, float]:
    """The scheduler and worker stages of add_sub and of the ensemble, on real bytes."""
    out: dict[str, float] = {}
    loop, dp, sched = rig.loop, rig.dp, rig.sched
    req_bytes = rig.request_bytes
    info_e = dp._models[ENSEMBLE]
    from services.dataplane.types import CoreRequest, InputTensor
    ecore = CoreRequest(ENSEMBLE, "", "", [InputTensor("INPUT0", "FP32", [WIDTH], A.tobytes()),
                                           InputTensor("INPUT1", "FP32", [WIDTH], B.tobytes())],
                        None, {})
    async def send_ensemble() -> None:
        dp._send_request(ecore, info_e, 1, loop.create_future())
        dp._outbox._flush_requests()
    loop.run_until_complete(send_ensemble())
    ens_bytes = rig.sent
    dp._pending.clear()
    dp._inflight.clear()
    loop.run_until_complete(asyncio.sleep(0))

    # --- scheduler: frontend socket bytes -> ExecuteBatch bytes to the worker
    parts = split(req_bytes)
    out["sched.decode"] = per_call(lambda: m.decode(parts), n, repeats)
    msg, frames = m.decode(parts)
    rig.scheduler_gets_request(req_bytes)
    batch_bytes = rig.to_worker["add_sub"]
    _, done_bytes = rig.worker_runs("add_sub", batch_bytes)
    done = m.decode(split(done_bytes))[0]
    rig.scheduler_gets_batch_done("add_sub", done_bytes)
    inst = sched.models.lookup("add_sub").instances[0]

    def sched_pass(timed: dict | None = None) -> None:
        """The request in (-> ExecuteBatch out), then its BatchDone in (the instance idle
        again, statistics recorded); the BatchDone's bytes are made between the two."""
        t0 = CLOCK()
        rig.scheduler_gets_request(req_bytes)
        t1 = CLOCK()
        done.batch_id = next(iter(inst.inflight))
        data = framed(m.encode(done))
        t2 = CLOCK()
        rig.scheduler_gets_batch_done("add_sub", data)
        t3 = CLOCK()
        if timed is not None:
            timed.setdefault("sched.request", []).append(t1 - t0)
            timed.setdefault("sched.batch_done", []).append(t3 - t2)
    segmented(sched_pass, n, repeats, out)
    assert not inst.inflight
    xb = m.decode(split(batch_bytes))[0]
    xframes = split(batch_bytes)[2:]
    out["sched.encode_batch"] = per_call(lambda: framed(m.encode(xb, xframes)), n, repeats)
    dparts = split(done_bytes)
    out["sched.decode_batch_done"] = per_call(lambda: m.decode(dparts), n, repeats)

    # --- worker: ExecuteBatch bytes -> results and BatchDone
    w = rig.workers["add_sub"]
    bparts = split(batch_bytes)
    out["worker.decode"] = per_call(lambda: m.decode(bparts, for_worker=True), n, repeats)
    bmsg, bframes = m.decode(bparts, for_worker=True)
    item = bmsg.items[0]
    out["worker.arrays"] = per_call(lambda: {r.name: w._array(r, bframes) for r in item.inputs}, n, repeats)
    tensors = {r.name: w._array(r, bframes) for r in item.inputs}
    be = w.backend
    out["worker.pb_request"] = per_call(lambda: py_backend._request(be.name, item, tensors), n, repeats)
    pbreq = py_backend._request(be.name, item, tensors)
    out["worker.model_execute"] = per_call(lambda: be.model.execute([pbreq]), n, repeats)
    noreply = lambda *a: None  # noqa: E731
    out["worker.execute_requests"] = per_call(
        lambda: be.execute_requests([item], [tensors], noreply), n, repeats)
    answers = be.execute_requests([item], [tensors], noreply)
    from services.workers.main import _chosen
    chosen = _chosen(item, answers[0])
    out["worker.add_result"] = per_call(lambda: w._add_result({}, item, chosen), n, repeats)
    replies: dict = {}
    w._add_result(replies, item, chosen)
    results, rframes = replies[item.reply_to]
    pusher = w.pushers[rig.result_addr]
    out["worker.push_result"] = per_call(lambda: pusher.send(m.encode(results[0], rframes)), n, repeats)
    out["worker.batch_done"] = per_call(lambda: framed(m.encode(done)), n, repeats)
    out["worker.whole"] = per_call(lambda: rig.worker_runs("add_sub", batch_bytes), n, repeats)

    # --- ensemble: request -> add_sub batch -> its BatchDone (step results) -> scale batch
    #     -> its BatchDone -> the answer to the frontend; scheduler stages timed apart
    def ens_pass(timed: dict | None = None):
        t0 = CLOCK()
        rig.scheduler_gets_request(ens_bytes)
        t1 = CLOCK()
        _, done1 = rig.worker_runs("add_sub", rig.to_worker["add_sub"])
        t2 = CLOCK()
        rig.scheduler_gets_batch_done("add_sub", done1)
        t3 = CLOCK()
        _, done2 = rig.worker_runs("scale", rig.to_worker["scale"])
        t4 = CLOCK()
        rig.scheduler_gets_batch_done("scale", done2)
        t5 = CLOCK()
        if timed is not None:
            for k, v in (("ens.sched_request", t1 - t0), ("ens.worker_add_sub", t2 - t1),
                         ("ens.sched_step1_done", t3 - t2), ("ens.worker_scale", t4 - t3),
                         ("ens.sched_step2_done", t5 - t4)):
                timed.setdefault(k, []).append(v)
    segmented(ens_pass, n, repeats, out)
    answer = m.decode(split(rig.to_frontend))[0]
    assert isinstance(answer, m.InferResult) and answer.error is None, answer
    return out


# ============================================================================ hops
def _echo(address: str, mode: str, ready, conn) -> None:
    """The far end of a hop: echoes every message; at the end sends its CPU seconds."""
    if mode == "blocking":     # a worker: BlockingConnection
        from services.common.transport_stream import BlockingConnection
        ready.wait()
        c = BlockingConnection(address, b"echo")
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        while True:
            try:
                parts = c.recv()
            except EOFError:
                break
            if bytes(parts[0]) == b"stop":
                break
            c.send(parts)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        conn.send((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime))
        return
    uvloop.install()

    async def main():
        done = asyncio.get_running_loop().create_future()
        box = {}

        def handler(parts):
            if bytes(parts[0]) == b"stop":
                done.set_result(None)
            else:
                box["c"].send(parts)
        ready.wait()
        c = transport_stream.Connection(address, handler, b"echo")
        box["c"] = c
        c.start()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        await done
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        conn.send((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime))
    asyncio.run(main())


def hop(mode: str, payload: list, n: int, tmp: Path) -> dict[str, float]:
    """Round trips of `payload` between this process's uvloop Listener and an echo in
    another process (`mode`: asyncio Connection on uvloop, or BlockingConnection)."""
    address = f"unix://{tmp}/hop-{mode}.sock"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(address, mode, ready, child), daemon=True)
    proc.start()
    loop = uvloop.new_event_loop()
    box: dict[str, Any] = {}

    def handler(identity, parts):
        f = box.get("f")
        if f is not None and not f.done():
            f.set_result(None)

    async def run():
        lst = transport_stream.Listener(address, handler)
        await lst.start()
        ready.set()
        while b"echo" not in lst._peers:
            await asyncio.sleep(0.01)
        lat = []
        for i in range(n + n // 10):
            if i == n // 10:
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
            box["f"] = loop.create_future()
            s = time.perf_counter_ns()
            lst.send(b"echo", payload)
            await box["f"]
            if i >= n // 10:
                lat.append(time.perf_counter_ns() - s)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        lst.send(b"echo", [b"stop", b""])
        await asyncio.sleep(0.05)
        lst.close()
        return lat, wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    lat, wall, mine = loop.run_until_complete(run())
    theirs = parent.recv() if parent.poll(10) else float("nan")
    proc.join(5)
    loop.close()
    # (the echo's CPU counts its warm-up tenth too: scaled to the measured share)
    theirs *= n / (n + n // 10)
    return {"rtt_p50_us": statistics.median(lat) / 1e3,
            "cpu_us_per_hop": (mine + theirs) / (2 * n) * 1e6,
            "this_us_per_rt": mine / n * 1e6, "echo_us_per_rt": theirs / n * 1e6,
            "wall_us_per_rt": wall / n * 1e6}


# ============================================================================ real servers
def server_totals(repeats: int, duration: float, tmp: Path) -> dict:
    from vs_triton_runs import TRITON_SH, TritonServer, c1_latency, wait_models_ready
    a, b = A, B
    add_sub = {"INPUT0": a, "INPUT1": b}
    cases = [("add_sub c1 HTTP", "http", "add_sub", add_sub, {"OUTPUT0": a + b, "OUTPUT1": a - b}),
             ("add_sub c1 gRPC", "grpc", "add_sub", add_sub, {"OUTPUT0": a + b, "OUTPUT1": a - b}),
             ("ensemble c1 gRPC", "grpc", ENSEMBLE, add_sub, {"OUTPUT0": 2 * (a + b)})]
    repo = build_repository(tmp / "srv")
    servers: dict[str, Any] = {"Trireme": Server(repo, 1, tmp / "trireme.log")}
    if TRITON_SH.is_file():
        servers = {"Triton": TritonServer(repo, tmp / "triton.log"), **servers}
    res: dict = {c[0]: {w: [] for w in servers} for c in cases}
    try:
        for who, srv in servers.items():
            log(f"starting {who}")
            srv.start()
            wait_models_ready(srv, 120)
        for rep in range(repeats):
            for label, proto, model, ins, want in cases:
                for who, srv in servers.items():
                    load = os.getloadavg()[0]
                    s = c1_latency(srv, proto, model, ins, want, duration)
                    per = {k: v.get("us_per_req") for k, v in s.extra["cpu"].items()
                           if k not in ("machine", "client")}
                    res[label][who].append({"p50_ms": s.value, "server_us": s.server_us,
                                            "per_process": per, "n": s.extra["n"],
                                            "load1": load, "other_pct": s.other_pct})
                    log(f"{label} [{who} {rep + 1}/{repeats}] p50 {s.value:.3f} ms, "
                        f"server {s.server_us:.0f} µs/req {per} (load {load:.2f})")
    finally:
        for srv in servers.values():
            srv.stop()
    return res


def triton_trace(duration: float, tmp: Path) -> dict:
    """Triton with every request traced (TIMESTAMPS): median gaps per coarse stage, µs."""
    from vs_triton_runs import TRITON_SH, TritonServer, c1_latency, wait_models_ready
    if not TRITON_SH.is_file():
        return {}
    repo = build_repository(tmp / "trace")
    out: dict = {}
    a, b = A, B
    for label, proto, model, want in (("add_sub c1 HTTP", "http", "add_sub", {"OUTPUT0": a + b}),
                                      ("add_sub c1 gRPC", "grpc", "add_sub", {"OUTPUT0": a + b}),
                                      ("ensemble c1 gRPC", "grpc", ENSEMBLE, {"OUTPUT0": 2 * (a + b)})):
        path = tmp / f"trace-{proto}-{model}.json"
        srv = TritonServer(repo, tmp / "triton-trace.log")
        srv.cmd += ["--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                    "--trace-config", "rate=1", "--trace-config", "count=-1",
                    "--trace-config", "triton,log-frequency=0"]
        srv.start()
        try:
            wait_models_ready(srv, 120)
            c1_latency(srv, proto, model, {"INPUT0": a, "INPUT1": b}, want, duration)
        finally:
            srv.stop()
        out[label] = _trace_gaps(path)
    return out


def _trace_gaps(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        traces = json.loads(path.read_text())
        by_id: dict[int, dict] = {}
        for t in traces:
            d = by_id.setdefault(t["id"], {"model": None, "parent": None, "ts": {}})
            if "model_name" in t:
                d["model"], d["parent"] = t["model_name"], t.get("parent_id")
            for s in t.get("timestamps", []):
                d["ts"][s["name"]] = int(s["ns"])
        gaps: dict[str, list] = {}
        pairs = (("request_start→queue_start", "REQUEST_START", "QUEUE_START"),
                 ("queue_start→compute_start", "QUEUE_START", "COMPUTE_START"),
                 ("compute_start→input_end", "COMPUTE_START", "COMPUTE_INPUT_END"),
                 ("input_end→output_start (execute)", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
                 ("output_start→compute_end", "COMPUTE_OUTPUT_START", "COMPUTE_END"),
                 ("compute_end→request_end", "COMPUTE_END", "REQUEST_END"),
                 ("request_start→request_end", "REQUEST_START", "REQUEST_END"),
                 ("http/grpc recv", "HTTP_RECV_START", "HTTP_RECV_END"),
                 ("grpc wait-read", "GRPC_WAITREAD_START", "GRPC_WAITREAD_END"),
                 ("http/grpc send", "HTTP_SEND_START", "HTTP_SEND_END"),
                 ("grpc send", "GRPC_SEND_START", "GRPC_SEND_END"))
        for d in by_id.values():
            tag = d["model"] if d["parent"] in (None, 0) else f"step {d['model']}"
            for name, a, b in pairs:
                if a in d["ts"] and b in d["ts"]:
                    gaps.setdefault(f"{tag}: {name}", []).append((d["ts"][b] - d["ts"][a]) / 1e3)
        return {k: round(statistics.median(v), 1) for k, v in gaps.items() if len(v) > 10}
    return {}


# ============================================================================ output
def _med(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _proc(runs: list[dict], prefix: str) -> float | None:
    """Median over runs of the CPU µs/req of the processes whose label starts with prefix."""
    vals = []
    for r in runs:
        v = [x for k, x in r["per_process"].items() if k.startswith(prefix) and x is not None]
        if v:
            vals.append(sum(v))
    return statistics.median(vals) if vals else None


def _f(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def tables(res: dict) -> str:
    """The three budget tables in Markdown (from main()'s result dict)."""
    st, hops = dict(res["stages"]), res["hops"]
    e2e, trace = res.get("e2e") or {}, res.get("trace") or {}
    st["http.glue"] = (st["http.engine+handlers"] - st["http.engine"] - st["http.decode"]
                       - st["http.encode"] - st["dp.response"])
    st["dp.place"] = st["dp.send_request"] - st["validate"]
    st["dp.flush"] = st["dp.send_request+flush"] - st["dp.send_request"]
    st["worker.pb_objects"] = st["worker.execute_requests"] - st["worker.model_execute"]
    ha, hb = hops["asyncio"]["cpu_us_per_hop"], hops["blocking"]["cpu_us_per_hop"]
    out: list[str] = []

    def table(title: str, kind: str, rows: list, whole: dict[str, float], e2e_key: str,
              hops_n: int) -> None:
        runs = e2e.get(e2e_key, {})
        tri, trr = runs.get("Triton", []), runs.get("Trireme", [])
        tr = trace.get(e2e_key, {})
        out.append(f"#### {title}\n")
        out.append("| # | process | stage | function | µs | Triton |")
        out.append("|---:|---|---|---|---:|---|")
        total = 0.0
        top = ENSEMBLE if e2e_key.startswith("ensemble") else "add_sub"
        for i, (proc, stage, fn, val, triton) in enumerate(rows, 1):
            total += val if val is not None else 0.0
            cell = "—"
            if triton:
                got = [(k.format(m=top).split(": ", 1)[1], tr.get(k.format(m=top))) for k in triton]
                got = [(k, v) for k, v in got if v is not None]
                if got:
                    cell = "; ".join(f"{v:.0f} wall ({k})" for k, v in got)
            out.append(f"| {i} | {proc} | {stage} | {fn} | {_f(val)} | {cell} |")
        out.append(f"| | | **sum of the stages** | | **{_f(total)}** | |")
        out.append("")
        lines = []
        for proc, (inc, parts) in whole.items():
            lines.append(f"{proc} measured whole in this process {_f(inc)} µs "
                         f"(its rows above without hops: {_f(parts)})")
        if lines:
            out.append("Cross-check: " + "; ".join(lines) + ".")
        if trr:
            srv = _med(trr, "server_us")
            parts = {p: _proc(trr, p) for p in ("frontend", "scheduler", "worker")}
            out.append(f"\nReal `trireme serve`, {kind}, c1, server CPU per request (median of "
                       f"{len(trr)} runs): **{_f(srv)} µs** = frontend {_f(parts['frontend'])} + "
                       f"scheduler {_f(parts['scheduler'])} + workers {_f(parts['worker'])}; "
                       f"p50 {_med(trr, 'p50_ms'):.3f} ms. Stages above: {_f(total)} µs; "
                       f"**unaccounted: {_f(srv - total)} µs ({100 * (srv - total) / srv:.0f} %)**.")
        if tri:
            t = _med(tri, "server_us")
            out.append(f"Triton 2.51, same runs: **{_f(t)} µs** = tritonserver "
                       f"{_f(_proc(tri, 'tritonserver'))} + stub(s) {_f(_proc(tri, 'stub'))}; "
                       f"p50 {_med(tri, 'p50_ms'):.3f} ms.")
        if tr:
            out.append("Triton's trace (every request traced, wall µs, medians): "
                       + "; ".join(f"{k} {v}" for k, v in tr.items()) + ".")
        out.append("")

    def trace_of(key: str, *names: str) -> str | None:
        tr = trace.get(key, {})
        got = [f"{tr[n]:.0f} wall" for n in names if n in tr]
        return " + ".join(got) if got else None

    http_front_in = ("frontend", "HTTP/1.1 parse, request task, answer head + write call",
                     "http/connection.py `Connection.data_received` → httptools `on_*` → `_serve` → `_send`")
    common_in = [
        ("frontend", "validation", "dataplane/validation.py `validate_infer`", st["validate"],
         ("{m}: request_start→queue_start",)),
        ("frontend", "input placement (2 × 64 B: inline frames) + `InferRequest`",
         "dataplane/client.py `DataPlane._send_request`", st["dp.place"], None),
        ("frontend", "InferRequest encode + framing",
         "dataplane/outbox.py `Outbox._flush_requests` → messages.py `encode` → transport_stream.py `_write`",
         st["dp.flush"], None),
    ]
    sched_rows = [
        ("frontend→scheduler", "socket write + wake-up + read (CPU of both ends)",
         "transport_stream: uvloop ↔ uvloop, measured across 2 processes", ha, None),
        ("scheduler", "receive, decode, queue, dispatch, ExecuteBatch encode + write call",
         "transport_stream `_PeerProtocol.data_received` → `Scheduler._on_frontend` → `_infer` → "
         "dispatch.py `VersionQueue.enqueue` → `pump` → `_dispatch` → worker_side.py `_send_batch`",
         st["sched.request"], ("{m}: queue_start→compute_start",)),
        ("scheduler→worker", "socket write + wake-up + read",
         "transport_stream: uvloop → `BlockingConnection.recv`, across 2 processes", hb,
         ("{m}: compute_start→input_end",)),
    ]
    worker_rows = [
        ("worker", "ExecuteBatch decode", "messages.py `decode(for_worker=True)`",
         st["worker.decode"], None),
        ("worker", "inputs as arrays (in place)", "workers/main.py `Worker._array` × 2",
         st["worker.arrays"], None),
        ("worker", "pb_utils request objects, cancel flag, response sender",
         "python/backend.py `execute_requests` (`_request`, `Cancels.track`, "
         "`InferenceResponseSender`) without the model", st["worker.pb_objects"], None),
        ("worker", "model `execute()` (add_sub's own code)", "`TritonPythonModel.execute`",
         st["worker.model_execute"], ("{m}: input_end→output_start (execute)",)),
        ("worker", "output placement (inline frames) + `InferResult`",
         "workers/main.py `Worker._add_result` (`_to_wire`)", st["worker.add_result"],
         ("{m}: output_start→compute_end",)),
        ("worker", "result encode + framing", "results.py `ResultSender._push` → `encode`",
         st["worker.push_result"], None),
        ("worker", "BatchDone encode + framing", "workers/main.py `Worker.execute` → `encode`",
         st["worker.batch_done"], None),
        ("worker→frontend", "socket write + wake-up + read",
         "`BlockingConnection.send` → uvloop, across 2 processes", hb, None),
        ("worker→scheduler", "BatchDone: socket write + wake-up + read (off the critical path)",
         "`BlockingConnection.send` → uvloop, across 2 processes", hb, None),
        ("scheduler", "BatchDone: decode, statistics, instance idle, pump",
         "worker_side.py `WorkerSide._on_worker` → stats.py `executed` → dispatch.py `batch_done`",
         st["sched.batch_done"], None),
    ]
    result_rows = [
        ("frontend", "result receive + decode, future resolved",
         "transport_stream `_Assembler.feed` → `DataPlane._on_result` → `decode` → `_deliver`",
         st["dp.on_result"], None),
        ("frontend", "`CoreResponse` from the result's frames", "dataplane/client.py `DataPlane._response`",
         st["dp.response"], ("{m}: compute_end→request_end",)),
    ]
    sock_row = ("frontend", "client socket read + answer write (syscalls; estimated as one hop)",
                "uvloop, the kernel", ha, ("{m}: http/grpc recv", "{m}: http/grpc send", "{m}: grpc send"))
    fe_http = ["http.engine", "http.glue", "http.decode", "validate", "dp.place", "dp.flush",
               "dp.on_result", "dp.response", "http.encode"]
    rows_http = [(*http_front_in, st["http.engine"], None),
                 ("frontend", "route + `infer` handler around the codec",
                  "http/routes.py `Handlers._route` → `Handlers.infer`", st["http.glue"], None),
                 ("frontend", "body decode (JSON header + binary tensors)",
                  "http/codec.py `decode_infer_request`", st["http.decode"], None),
                 *common_in, *sched_rows, *worker_rows, *result_rows,
                 ("frontend", "response encode (JSON header + binary outputs)",
                  "http/codec.py `encode_infer_response`", st["http.encode"], None),
                 ("frontend", "event-loop turns, task wake-ups, awaits (the whole frontend "
                  "measured in this process minus its rows)", "asyncio/uvloop",
                  st["http.frontend_whole"] - sum(st[k] for k in fe_http), None),
                 sock_row]
    table("(a) add_sub, one unary HTTP request (tritonclient.http, binary tensors)", "HTTP",
          rows_http, {"frontend": (st["http.frontend_whole"], sum(st[k] for k in fe_http)),
                      "worker": (st["worker.whole"], sum(st[k] for k in (
                          "worker.decode", "worker.arrays", "worker.execute_requests",
                          "worker.add_result", "worker.push_result", "worker.batch_done")))},
          "add_sub c1 HTTP", 4)
    fe_grpc = ["grpc.engine", "grpc.decode", "grpc.request_from_proto", "validate", "dp.place",
               "dp.flush", "dp.on_result", "dp.response", "grpc.encode"]
    grpc_front = [
        ("frontend", "HTTP/2 frames, HPACK, call object, task, HEADERS/DATA/trailers write call",
         "grpc/h2_receive.py `H2Receiver.data_received` → native.py `_open_stream` → `_Call.data` "
         "→ `_Gate` → `_Call._unary` → `_send` / `_finish`", st["grpc.engine"], None),
        ("frontend", "ModelInferRequest parse", "grpc/codec.py `decode_infer_request`",
         st["grpc.decode"], None),
        ("frontend", "CoreRequest from the protobuf", "grpc/codec.py `request_from_proto`",
         st["grpc.request_from_proto"], None),
        *common_in]
    grpc_back = [*result_rows,
                 ("frontend", "ModelInferResponse encode", "grpc/codec.py `encode_infer_response`",
                  st["grpc.encode"], None),
                 ("frontend", "event-loop turns, task wake-ups, `ModelInfer` handler (the whole "
                  "frontend measured in this process minus its rows)", "asyncio/uvloop, grpc/methods.py",
                  st["grpc.frontend_whole"] - sum(st[k] for k in fe_grpc), None),
                 sock_row]
    table("(b) add_sub, one unary gRPC request (tritonclient.grpc)", "gRPC",
          [*grpc_front, *sched_rows, *worker_rows, *grpc_back],
          {"frontend": (st["grpc.frontend_whole"], sum(st[k] for k in fe_grpc))},
          "add_sub c1 gRPC", 4)
    ens = [
        *grpc_front[:3],
        *common_in,
        sched_rows[0],
        ("scheduler", "ensemble request: decode, EnsembleQueue, step 1 queued and dispatched, "
         "ExecuteBatch to add_sub", "`Scheduler._on_frontend` → ensemble.py `EnsembleQueue` → "
         "`Scheduler._submit_step` → `_infer_one` → `VersionQueue` → `_send_batch`",
         st["ens.sched_request"], ("{m}: request_start→queue_start",
                                   "step add_sub: request_start→queue_start",
                                   "step add_sub: queue_start→compute_start")),
        sched_rows[2],
        ("worker add_sub", "the whole worker stage (rows of table (a)), results inside BatchDone",
         "workers/main.py `Worker.execute` (results for the step socket: `BatchDone.results`)",
         st["ens.worker_add_sub"], ("step add_sub: compute_start→input_end",
                                    "step add_sub: input_end→output_start (execute)",
                                    "step add_sub: output_start→compute_end")),
        ("add_sub→scheduler", "BatchDone + step results: socket write + wake-up + read", "", hb, None),
        ("scheduler", "step 1 done: decode, statistics, step 2 queued and dispatched to scale",
         "`WorkerSide._on_worker` → `_step_answered` → `EnsembleQueue.step_result` → `_submit_step`",
         st["ens.sched_step1_done"], ("step add_sub: compute_end→request_end",
                                      "step scale: request_start→queue_start",
                                      "step scale: queue_start→compute_start")),
        ("scheduler→scale", "socket write + wake-up + read", "", hb, None),
        ("worker scale", "the whole worker stage, results inside BatchDone", "`Worker.execute`",
         st["ens.worker_scale"], ("step scale: compute_start→input_end",
                                  "step scale: input_end→output_start (execute)",
                                  "step scale: output_start→compute_end")),
        ("scale→scheduler", "BatchDone + step results: socket write + wake-up + read", "", hb, None),
        ("scheduler", "step 2 done: the answer assembled and sent to the frontend",
         "`_step_answered` → `EnsembleQueue.step_result` → `Scheduler._respond` → `_send_frontend`",
         st["ens.sched_step2_done"], ("step scale: compute_end→request_end",)),
        ("scheduler→frontend", "socket write + wake-up + read", "", ha, None),
        *grpc_back]
    table("(c) ensemble add_sub → scale, one unary gRPC request", "gRPC", ens, {},
          "ensemble c1 gRPC", 6)
    h = hops
    out.append(f"Hops (one message of {res.get('hop_bytes', '?')} bytes each way, p50 round trip): "
               f"uvloop ↔ uvloop {h['asyncio']['rtt_p50_us']:.0f} µs wall, "
               f"{h['asyncio']['cpu_us_per_hop']:.1f} µs CPU per one-way hop (both processes); "
               f"uvloop ↔ BlockingConnection {h['blocking']['rtt_p50_us']:.0f} µs wall, "
               f"{h['blocking']['cpu_us_per_hop']:.1f} µs CPU per hop.")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hop-n", type=int, default=4000, help="round trips per hop row")
    ap.add_argument("--server", action="store_true", help="also real servers, c1")
    ap.add_argument("--server-repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--triton-trace", action="store_true")
    ap.add_argument("--skip-stages", action="store_true")
    ap.add_argument("--wall", action="store_true",
                    help="time the in-process stages with perf_counter_ns, not thread CPU time")
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    ap.add_argument("--from-json", type=Path, help="print the tables of an earlier --json")
    args = ap.parse_args()
    global CLOCK
    if args.wall:
        CLOCK = time.perf_counter_ns
    if args.from_json:
        print(tables(json.loads(args.from_json.read_text())))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="trireme-budget-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit,
                              "command": "python benchmarks/request_budget.py " + " ".join(sys.argv[1:]),
                              "clock": CLOCK.__name__}
    try:
        if not args.skip_stages:
            result["load_before_stages"] = os.getloadavg()
            loop = uvloop.new_event_loop()
            asyncio.set_event_loop(loop)
            rig = Rig(loop, tmp)
            tune_gc()   # as every Trireme process does after start-up (procutil.tune_gc)
            st = frontend_stages(rig, args.n, args.repeats)
            st.update(scheduler_worker_stages(rig, args.n, args.repeats))
            result["stages"] = st
            rig.dp._segments.close()
            result["load_before_hops"] = os.getloadavg()
            req = split(rig.request_bytes)
            result["hop_bytes"] = len(rig.request_bytes)
            result["hops"] = {mode: hop(mode, [bytes(p) for p in req], args.hop_n, tmp)
                              for mode in ("asyncio", "blocking")}
        if args.server:
            result["e2e"] = server_totals(args.server_repeats, args.duration, tmp)
        if args.triton_trace:
            result["trace"] = triton_trace(args.duration, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(f"command: `{result['command']}`  \ndate: {result['date']}, commit {result['commit']}, "
          f"load average before the stages {result.get('load_before_stages')}\n")
    if "stages" in result:
        print(tables(result))
    else:
        print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
