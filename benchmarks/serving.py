#!/usr/bin/env python
"""Trireme serving benchmark: latency, throughput and a py-spy profile in one run.

    python benchmarks/serving.py [--quick] [--frontends N] [--only tiny|mlp]
                                 [--profile] [--profile-native] [--json results.json]

What it does (see docs/benchmarks.md for the latest numbers and how to read them):
  * builds a model repository in a temp dir with tests/models.py:
      tiny      16->16 MatMul+Add+Relu, FP32, intra_op_thread_count 1
      mlp       3 x 1024 MatMul+Add+Relu, FP32, intra_op_thread_count 2
      identity  FP32 [batch, n] -> same (4 MiB round trip), intra_op_thread_count 1
    every model: max_batch_size 64, instance_group [{ kind: KIND_CPU, count: 1 }],
    no dynamic_batching (no batching window);
  * starts `python -m services.cli serve` on free ports (the full multi-process path:
    scheduler + one worker per instance + N frontends) and stops it with SIGTERM at the end;
  * in-process onnxruntime on the same model file with the same thread count (the ceiling);
  * batch-1 latency at concurrency 1 with the official tritonclient.http / tritonclient.grpc
    sync clients (binary tensor data, the clients' default), plus is_server_ready() as the
    client + protocol + frontend floor;
  * throughput at concurrency 64: wrk (-t2 -c64, JSON body) for HTTP, h2load (-c64 -m1, a
    pre-encoded ModelInferRequest) for gRPC; every run is checked for errors on the client
    side and against the scheduler's nv_inference_request_success/failure counters; the
    same tools against /v2/health/ready and ServerReady give the frontend-only ceiling;
  * 4 MiB FP32 round trip over gRPC at concurrency 4 (identity model, one client per thread;
    MiB/s counts the request payload once);
  * CPU per request for each process (all threads, from /proc), and how much CPU other
    processes on the machine took meanwhile (runs are flagged **contended** above 20%);
    before each step it waits up to --quiet-wait seconds for the machine to go idle;
  * --profile: one extra HTTP and gRPC load run at concurrency 64 on `tiny` while py-spy
    records the scheduler, the frontend(s) and the tiny worker (--nonblocking, --format raw);
    prints the top leaf frames (own time) per process with their callers;
    --profile-native: the same with py-spy --native (C frames: syscalls, uvloop, libzmq,
    grpc core), which pauses the processes per sample and so slows them down.

Needs `wrk` and `h2load` on PATH (apt-get install wrk nghttp2-client) and py-spy for
--profile. Rows whose tool is missing are reported as skipped.

Code, in this folder: serving.py (this: arguments, the run, the result tables),
bench_server.py (model repository, `trireme serve`, /proc CPU accounting, the machine),
bench_load.py (onnxruntime ceiling, client latency loops, wrk/h2load, 4 MiB) and
bench_profile.py (py-spy recording and summary).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import (
    client_latency,
    client_ready_latency,
    expected,
    grpc_big_round_trip,
    ort_ceiling,
    run_h2load,
    run_wrk,
)
from bench_profile import print_profile, profile_run
from bench_server import MODEL_THREADS, Server, build_repository, log, machine_info, wait_quiet

MODEL_WIDTH = {"tiny": 16, "mlp": 1024}
_PROTO = {"http": "HTTP", "grpc": "gRPC"}

# Targets from the issue (2-core machine, full multi-process path).
TARGET_LAT_P50_MS = 0.45
TARGET_HTTP_C64 = 7000.0
TARGET_GRPC_C64 = 8500.0
TARGET_GRPC_4MIB = 420.0


# --------------------------------------------------------------------------- results

@dataclass
class Row:
    model: str
    path: str                     # e.g. "HTTP c1 (tritonclient.http)"
    p50_ms: float | None = None
    p99_ms: float | None = None
    throughput: float | None = None
    unit: str = "infer/s"
    target: str = ""
    met: bool | None = None       # None: no target
    note: str = ""
    extra: dict = field(default_factory=dict)


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    return f"{v:,.{digits}f}"


def table(rows: list[Row]) -> str:
    out = ["| model | path | p50 ms | p99 ms | throughput | target | met? | notes |",
           "|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        thr = "—" if r.throughput is None else f"{r.throughput:,.0f} {r.unit}"
        met = {None: "", True: "yes", False: "**MISS**"}[r.met]
        out.append(f"| {r.model} | {r.path} | {fmt(r.p50_ms)} | {fmt(r.p99_ms)} | {thr} | "
                   f"{r.target} | {met} | {r.note} |")
    return "\n".join(out)


def cpu_table(rows: list[Row]) -> str:
    """CPU microseconds per request by process (from /proc, all threads), and % of a core."""
    roles = ["frontend", "scheduler", "worker", "client/loadgen"]

    def role(label: str) -> str:
        if label.startswith("frontend"):
            return "frontend"
        if label.startswith("worker"):
            return "worker"
        if label == "scheduler":
            return "scheduler"
        return "client/loadgen"

    out = ["| model | path | " + " | ".join(f"{r} µs/req (% core)" for r in roles)
           + " | server µs/req | all µs/req | other processes % (steal %) |",
           "|---|---|" + "---:|" * (len(roles) + 3)]
    for r in rows:
        cpu = r.extra.get("cpu_pct")
        if not cpu:
            continue
        acc = {k: [0.0, 0.0] for k in roles}
        mach = cpu.get("machine", {})
        for label, v in cpu.items():
            if label == "machine" or v.get("us_per_req") is None:
                continue
            a = acc[role(label)]
            a[0] += v["us_per_req"]
            a[1] += v["cpu"]
        server = sum(acc[k][0] for k in roles[:3])
        out.append(f"| {r.model} | {r.path} | " + " | ".join(
            f"{acc[k][0]:,.0f} ({acc[k][1]:.0f}%)" for k in roles)
            + f" | {server:,.0f} | {server + acc[roles[3]][0]:,.0f} | "
            f"{mach.get('other', 0):.0f}% ({mach.get('steal', 0):.0f}%)"
            f"{' **contended**' if mach.get('other', 0) > 20 else ''} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, 3 s load runs")
    ap.add_argument("--frontends", type=int, default=1, help="trireme serve --frontends")
    ap.add_argument("--only", choices=["tiny", "mlp"], help="benchmark one model only")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy every server process under HTTP and gRPC load (tiny)")
    ap.add_argument("--profile-native", action="store_true",
                    help="also profile with py-spy --native (C frames; pauses the server)")
    ap.add_argument("--profile-rate", type=int, default=200, help="py-spy samples/s")
    ap.add_argument("--duration", type=int, default=None, help="seconds per load run (10)")
    ap.add_argument("--requests", type=int, default=None, help="latency requests (2000)")
    ap.add_argument("--json", type=Path, help="also write every result here")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each measurement wait up to this many seconds for other "
                         "processes to stop using the CPU (4x this in all; 0: don't wait)")
    ap.add_argument("--server-cpus", default="",
                    help="run the server under `taskset -c CPUS` (experiments; default: unpinned)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, profiles)")
    ap.add_argument("--transport", choices=["stream", "zmq"], default="stream",
                    help="trireme serve --transport (between the server's processes)")
    args = ap.parse_args()

    n_lat = args.requests or (300 if args.quick else 2000)
    warm = max(50, n_lat // 10)
    duration = args.duration or (3 if args.quick else 10)
    models_run = [args.only] if args.only else ["tiny", "mlp"]
    have = {t: shutil.which(t) is not None for t in ("wrk", "h2load", "py-spy")}

    info = machine_info(args.frontends)
    hdr = ["# Trireme serving benchmark", "",
           f"command: `python benchmarks/serving.py {' '.join(sys.argv[1:])}`".replace("  ", " "),
           "", "| machine | |", "|---|---|"]
    hdr += [f"| {k} | {v} |" for k, v in info.items()]
    print("\n".join(hdr) + "\n", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="trireme-bench-"))
    rows: list[Row] = []
    results: dict = {"machine": info, "args": vars(args) | {"json": str(args.json)},
                     "rows": [], "profiles": {}}
    srv = None
    t_start = time.monotonic()

    wait_budget = [args.quiet_wait * 4]    # all the waiting in one run, at most

    def quiet() -> None:
        if args.quiet_wait > 0 and wait_budget[0] > 0:
            t = time.monotonic()
            results.setdefault("busy_before", []).append(
                wait_quiet(min(args.quiet_wait, wait_budget[0])))
            wait_budget[0] -= time.monotonic() - t
    try:
        repo = build_repository(tmp, [*models_run, "identity"])
        srv = Server(repo, args.frontends, tmp / "server.log", args.server_cpus,
                     ["--transport", args.transport])
        log(f"starting: {' '.join(srv.cmd)}")
        srv.start()
        log(f"ready; processes: {srv.processes()}")

        for model in models_run:
            width = MODEL_WIDTH[model]
            threads = MODEL_THREADS[model]
            mfile = repo / model / "1" / "model.onnx"
            x = np.random.default_rng(1).random((1, width), dtype=np.float32)
            want = expected(model, x, mfile)
            tnote = f"intra_op {threads}"

            quiet()
            log(f"{model}: in-process onnxruntime")
            n_ort = n_lat * (5 if model == "tiny" else 1)
            p50, p99, thr = ort_ceiling(mfile, threads, 1, n_ort, width)
            rows.append(Row(model, "in-process onnxruntime, batch 1", p50, p99, thr,
                            note=f"{tnote}; sequential; ceiling"))
            if model == "mlp":
                p50, p99, thr = ort_ceiling(mfile, threads, 64, max(100, n_lat // 10), width)
                rows.append(Row(model, "in-process onnxruntime, batch 64", p50, p99, thr,
                                note=f"{tnote}; infer/s = 64 x calls/s"))

            for proto, url in (("http", srv.http), ("grpc", srv.grpc)):
                if model == models_run[0]:
                    quiet()
                    log(f"{proto} is_server_ready latency, {n_lat} requests")
                    p50, p99, mean = client_ready_latency(proto, url, warm, n_lat)
                    rows.append(Row("(none)", f"{_PROTO[proto]} c1 is_server_ready "
                                    f"(tritonclient.{proto})", p50, p99, 1000.0 / mean,
                                    unit="req/s", note="floor: client + protocol + frontend; "
                                    "no scheduler/worker hop"))
                quiet()
                log(f"{model}: {proto} latency, {n_lat} requests")
                p50, p99, mean, delta, cpu = client_latency(srv, proto, url, model, x, want,
                                                            warm, n_lat)
                tgt = model == "tiny"
                rows.append(Row(model, f"{_PROTO[proto]} c1 (tritonclient.{proto}), batch 1",
                                p50, p99, 1000.0 / mean,
                                target=f"p50 ≤ {TARGET_LAT_P50_MS} ms" if tgt else "",
                                met=(p50 <= TARGET_LAT_P50_MS) if tgt else None,
                                note=f"{n_lat} req; mean {mean:.3f} ms{_server_note(delta)}",
                                extra={"cpu_pct": cpu, "server": delta}))

            tgt = model == "tiny"
            if have["wrk"]:
                quiet()
                log(f"{model}: wrk -t2 -c64 -d{duration}s")
                r = run_wrk(srv, model, x, tmp, duration)
                errs = r["non2xx"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
                bad = r["server"].get("nv_inference_request_failure", 0)
                ok = errs == 0 and r["non2xx_line"] == 0 and bad == 0
                rows.append(Row(model, "HTTP c64 (wrk -t2, JSON body)", r["p50_us"] / 1e3,
                                r["p99_us"] / 1e3, r["rps"],
                                target=f"≥ {TARGET_HTTP_C64:,.0f} infer/s" if tgt else "",
                                met=(r["rps"] >= TARGET_HTTP_C64 and ok) if tgt else None,
                                note=(f"{r['requests']} req, 0 errors" if ok else
                                      f"ERRORS: non2xx {r['non2xx']}, socket {errs - r['non2xx']},"
                                      f" server failures {bad:.0f}") +
                                f"{_server_note(r['server'])}",
                                extra={k: v for k, v in r.items() if k != "raw"}))
            else:
                rows.append(Row(model, "HTTP c64 (wrk)", note="skipped: wrk not on PATH"))

            if have["h2load"]:
                quiet()
                log(f"{model}: h2load -c64 -m1 -D{duration}")
                r = run_h2load(srv, model, x, want, tmp, duration)
                bad = r["server"].get("nv_inference_request_failure", 0)
                okc = r["server"].get("nv_inference_request_success", 0)
                ok = (r["failed"] == 0 and r["errored"] == 0 and r["non2xx"] == 0 and bad == 0
                      and okc >= r["s2xx"] * 0.99)
                rows.append(Row(model, "gRPC c64 (h2load -c64 -m1)", None, None, r["rps"],
                                target=f"≥ {TARGET_GRPC_C64:,.0f} infer/s" if tgt else "",
                                met=(r["rps"] >= TARGET_GRPC_C64 and ok) if tgt else None,
                                note=(f"{r['s2xx']} req 2xx, server ok {okc:.0f}, 0 failures; "
                                      if ok else
                                      f"ERRORS: failed {r['failed']} errored {r['errored']} "
                                      f"non2xx {r['non2xx']} server failures {bad:.0f} "
                                      f"server ok {okc:.0f}; ") +
                                f"mean {r['mean_req']}{_server_note(r['server'])}",
                                extra={k: v for k, v in r.items() if k != "raw"}))
            else:
                rows.append(Row(model, "gRPC c64 (h2load)", note="skipped: h2load not on PATH"))

        # The frontend alone at concurrency 64: the ceiling of the protocol layer.
        fdur = max(3, duration // 2)
        if have["wrk"]:
            quiet()
            log(f"frontend ceiling: wrk GET /v2/health/ready -d{fdur}s")
            r = run_wrk(srv, None, None, tmp, fdur)
            errs = r["non2xx"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
            rows.append(Row("(none)", "HTTP c64 GET /v2/health/ready (wrk -t2)",
                            r["p50_us"] / 1e3, r["p99_us"] / 1e3, r["rps"], unit="req/s",
                            note=("frontend-only ceiling" if errs == 0 else f"ERRORS {errs}"),
                            extra={k: v for k, v in r.items() if k != "raw"}))
        if have["h2load"]:
            quiet()
            log(f"frontend ceiling: h2load ServerReady -D{fdur}")
            r = run_h2load(srv, None, None, None, tmp, fdur)
            ok = r["failed"] == 0 and r["errored"] == 0 and r["non2xx"] == 0
            rows.append(Row("(none)", "gRPC c64 ServerReady (h2load -c64 -m1)", None, None,
                            r["rps"], unit="req/s",
                            note=(f"frontend-only ceiling; mean {r['mean_req']}" if ok else
                                  f"ERRORS failed {r['failed']} errored {r['errored']}"),
                            extra={k: v for k, v in r.items() if k != "raw"}))

        quiet()
        log("identity: 4 MiB gRPC round trip, concurrency 4")
        per = 8 if args.quick else 40
        mibs, p50, p99, mean, cpu = grpc_big_round_trip(srv, srv.grpc, 4 << 20, 4, per, 2)
        rows.append(Row("identity", "gRPC c4, 4 MiB FP32 (tritonclient.grpc)", p50, p99, mibs,
                        unit="MiB/s", target=f"≥ {TARGET_GRPC_4MIB:.0f} MiB/s",
                        met=mibs >= TARGET_GRPC_4MIB,
                        note=f"{4 * per} req; request bytes counted once",
                        extra={"cpu_pct": cpu}))

        prof_text = ""
        if args.profile:
            if not have["py-spy"]:
                prof_text = "py-spy not on PATH: no profile"
            elif "tiny" not in models_run:
                prof_text = "profiles use the tiny model: run without --only mlp"
            else:
                x = np.random.default_rng(1).random((1, 16), dtype=np.float32)
                want = expected("tiny", x, repo / "tiny" / "1" / "model.onnx")
                parts = []
                for native in ([False, True] if args.profile_native else [False]):
                    for kind, tool in (("http", "wrk"), ("grpc", "h2load"), ("4mib", "")):
                        if tool and not have[tool]:
                            continue
                        if kind == "4mib" and native:
                            continue
                        quiet()
                        log(f"profile: py-spy{' --native' if native else ''} on every server "
                            f"process under {kind} load")
                        prof = profile_run(srv, kind, "identity" if kind == "4mib" else "tiny",
                                           x, want, tmp, duration,
                                           args.profile_rate if not native else 100, native)
                        results["profiles"][kind + ("-native" if native else "")] = prof
                        parts.append(print_profile(prof, kind))
                prof_text = "\n\n".join(parts)
    except BaseException:
        if srv is not None:
            log("server log tail:\n" + srv.tail())
        raise
    finally:
        if srv is not None:
            srv.stop()
            log(f"server stopped (exit code {srv.proc.returncode if srv.proc else None})")
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    for r in rows:
        other = r.extra.get("cpu_pct", {}).get("machine", {}).get("other", 0)
        if other > 20:
            r.note += f"; **contended: other processes used {other:.0f}% of a core**"
    print("## Results\n")
    print(table(rows))
    print(f"\n(total {time.monotonic() - t_start:.0f} s; throughput rows: p50/p99 are the load "
          "generator's per-request latency at concurrency 64, h2load reports only a mean; "
          "'worker µs/req' are the worker's own compute_input/infer/output counters)\n")
    print("### CPU per request by process (user+sys of all threads, from /proc)\n")
    print(cpu_table(rows))
    print("\n(2 cores = 200% in all. At concurrency 64 the machine is saturated when the % "
          "column sums to ~200; then throughput ≈ 2,000,000 / 'all µs/req'.)\n")
    if prof_text:
        print("## Profile\n")
        print(prof_text)
    results["rows"] = [asdict(r) for r in rows]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


def _server_note(d: dict) -> str:
    """Worker-side time per request from the scheduler's counters (Triton's compute_*)."""
    n = d.get("nv_inference_request_success", 0)
    if not n:
        return ""
    g = lambda k: d.get(f"nv_inference_compute_{k}_duration_us", 0) / n  # noqa: E731
    return (f"; worker µs/req in {g('input'):.0f} / infer {g('infer'):.0f} / out {g('output'):.0f}"
            f"; batch {d.get('nv_inference_count', 0) / max(1, d.get('nv_inference_exec_count', 1)):.2f}"
            + (f"; {d['nv_inference_request_cancelled']:.0f} cancelled when the load generator "
               "stopped" if d.get("nv_inference_request_cancelled") else ""))


if __name__ == "__main__":
    sys.exit(main())
