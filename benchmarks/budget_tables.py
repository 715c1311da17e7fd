"""The tables of benchmarks/request_budget.py: the measured stages, hops and totals as
Markdown, one table per request kind."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server import ROOT  # noqa: E402
from vs_triton_models import ENSEMBLE, add_sub_inputs  # noqa: E402

sys.path.insert(0, str(ROOT))


A, B = add_sub_inputs()
SERVICE = "/inference.GRPCInferenceService/ModelInfer"

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
         "dispatch.py `VersionQueue.enqueue` → `pump` → `_dispatch` → worker_side.py `Workers.send_batch`",
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
        ("worker", "result encode + framing", "results.py `ResultSender.push` → `encode`",
         st["worker.push_result"], None),
        ("worker", "BatchDone encode + framing", "workers/main.py `Worker.execute` → `encode`",
         st["worker.batch_done"], None),
        ("worker→frontend", "socket write + wake-up + read",
         "`BlockingConnection.send` → uvloop, across 2 processes", hb, None),
        ("worker→scheduler", "BatchDone: socket write + wake-up + read (off the critical path)",
         "`BlockingConnection.send` → uvloop, across 2 processes", hb, None),
        ("scheduler", "BatchDone: decode, statistics, instance idle, pump",
         "worker_side.py `Workers.on_message` → stats.py `executed` → dispatch.py `batch_done`",
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
         "`Scheduler._submit_step` → `_infer_one` → `VersionQueue` → `Workers.send_batch`",
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
         "`Workers.on_message` → `_step_answered` → `EnsembleQueue.step_result` → `_submit_step`",
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


