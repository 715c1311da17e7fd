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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server import ROOT  # noqa: E402
from vs_triton_models import ENSEMBLE, WIDTH, add_sub_inputs  # noqa: E402

sys.path.insert(0, str(ROOT))
import uvloop  # noqa: E402

from services.common import messages as m  # noqa: E402
from services.common.procutil import tune_gc  # noqa: E402
from services.dataplane.validation import validate_infer  # noqa: E402
from services.frontend.grpc import codec as grpc_codec  # noqa: E402
from services.frontend.grpc.methods import rpc_methods  # noqa: E402
from services.frontend.grpc.native import NativeGrpcServer  # noqa: E402
from services.frontend.http import codec as http_codec  # noqa: E402
from services.frontend.http.engine import NativeHttpServer  # noqa: E402
from services.frontend.http.message import Reply  # noqa: E402
from services.frontend.http.routes import Handlers  # noqa: E402
from services.frontend.settings import FrontendSettings  # noqa: E402
from services.workers.python import backend as py_backend  # noqa: E402

A, B = add_sub_inputs()
SERVICE = "/inference.GRPCInferenceService/ModelInfer"
import budget_rig as br  # noqa: E402
from budget_processes import hop, server_totals, triton_trace  # noqa: E402
from budget_rig import (  # noqa: E402
    FakeTransport,
    H2Client,
    Rig,
    ended,
    framed,
    grpc_message,
    http_request_bytes,
    in_loop,
    per_call,
    per_request_async,
    segmented,
    split,
)
from budget_tables import tables  # noqa: E402


# ============================================================================ stages
def frontend_stages(rig: Rig, n: int, repeats: int) -> dict[str, float]:
    """Every frontend stage of one add_sub request, HTTP and gRPC, in isolation and whole."""
    loop, dp = rig.loop, rig.dp
    out: dict[str, float] = {}
    settings = FrontendSettings(dp.settings.scheduler_addr)
    info = dp.models.infos["add_sub"]

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
    info_e = dp.models.infos[ENSEMBLE]
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
        t0 = br.CLOCK()
        rig.scheduler_gets_request(req_bytes)
        t1 = br.CLOCK()
        done.batch_id = next(iter(inst.inflight))
        data = framed(m.encode(done))
        t2 = br.CLOCK()
        rig.scheduler_gets_batch_done("add_sub", data)
        t3 = br.CLOCK()
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
    pusher = w.results.pushers[rig.result_addr]
    out["worker.push_result"] = per_call(lambda: pusher.send(m.encode(results[0], rframes)), n, repeats)
    out["worker.batch_done"] = per_call(lambda: framed(m.encode(done)), n, repeats)
    out["worker.whole"] = per_call(lambda: rig.worker_runs("add_sub", batch_bytes), n, repeats)

    # --- ensemble: request -> add_sub batch -> its BatchDone (step results) -> scale batch
    #     -> its BatchDone -> the answer to the frontend; scheduler stages timed apart
    def ens_pass(timed: dict | None = None):
        t0 = br.CLOCK()
        rig.scheduler_gets_request(ens_bytes)
        t1 = br.CLOCK()
        _, done1 = rig.worker_runs("add_sub", rig.to_worker["add_sub"])
        t2 = br.CLOCK()
        rig.scheduler_gets_batch_done("add_sub", done1)
        t3 = br.CLOCK()
        _, done2 = rig.worker_runs("scale", rig.to_worker["scale"])
        t4 = br.CLOCK()
        rig.scheduler_gets_batch_done("scale", done2)
        t5 = br.CLOCK()
        if timed is not None:
            for k, v in (("ens.sched_request", t1 - t0), ("ens.worker_add_sub", t2 - t1),
                         ("ens.sched_step1_done", t3 - t2), ("ens.worker_scale", t4 - t3),
                         ("ens.sched_step2_done", t5 - t4)):
                timed.setdefault(k, []).append(v)
    segmented(ens_pass, n, repeats, out)
    answer = m.decode(split(rig.to_frontend))[0]
    assert isinstance(answer, m.InferResult) and answer.error is None, answer
    return out


# ============================================================================ output
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
    if args.wall:
        br.CLOCK = time.perf_counter_ns
    if args.from_json:
        print(tables(json.loads(args.from_json.read_text())))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="trireme-budget-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit,
                              "command": "python benchmarks/request_budget.py " + " ".join(sys.argv[1:]),
                              "clock": br.CLOCK.__name__}
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
