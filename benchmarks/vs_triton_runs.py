"""Trireme vs Triton 2.51, the servers and one measurement each (see vs_triton.py).

`TritonServer` is bench_server.Server with the command of ../shared/tools/triton.sh (same
free ports, same readiness wait, same SIGTERM stop, same Prometheus counters: Triton has
the names Trireme copies). Each measurement takes one server and returns a `Sample`; the
load generators are bench_load's (wrk, h2load, the 4 MiB round trip), the latency loop
runs for a duration instead of a request count and takes any number of inputs.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import bench_load
import numpy as np
from bench_load import grpc_big_round_trip, pct, run_h2load, run_wrk
from bench_profile import pyspy_record, summarize_raw
from bench_server import ROOT, CpuMeter, Server, counter_delta, log, wait_until

TRITON_SH = ROOT.parent / "shared" / "tools" / "triton.sh"
MODELS = ("add_sub", "identity_batched", "identity", "scale", "add_sub_scale")
LOAD_TOOLS = ("client", "wrk", "h2load")


class TritonServer(Server):
    """tritonserver 2.51 through triton.sh (which execs it: the pid is tritonserver's)."""

    def __init__(self, repo: Path, log_path: Path, triton_sh: Path = TRITON_SH) -> None:
        super().__init__(repo, 1, log_path)
        self.cmd = [str(triton_sh), "--model-repository", str(repo),
                    "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                    "--metrics-port", str(self.metrics_port)]

    def processes(self) -> dict[str, int]:
        """tritonserver and one Python-backend stub per model instance, by model."""
        import psutil
        out = {"tritonserver": self.proc.pid}
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                m = re.search(r"/([^/\s]+)/\d+/model\.py", " ".join(c.cmdline()))
                out[f"stub[{m.group(1) if m else c.pid}]"] = c.pid
        return out


def wait_models_ready(srv: Server, timeout: float, names: tuple[str, ...] | list[str] = MODELS
                      ) -> None:
    def ready() -> bool:
        for m in names:
            try:
                with urllib.request.urlopen(f"http://{srv.http}/v2/models/{m}/ready",
                                            timeout=2) as r:
                    if r.status != 200:
                        return False
            except OSError:
                return False
        return True
    wait_until(ready, timeout, f"models ready: {', '.join(names)}", interval=0.2)


def server_version(srv: Server) -> str:
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(f"http://{srv.http}/v2", timeout=5) as r:
            meta = json.loads(r.read())
            return f"{meta.get('name')} {meta.get('version')}"
    return "?"


# --------------------------------------------------------------------------- one sample

@dataclass
class Sample:
    value: float                  # ms (p50) or infer/s or MiB/s
    ok: bool = True
    note: str = ""
    server_us: float | None = None   # server CPU per request, all its processes
    other_pct: float = 0.0        # CPU other processes used meanwhile (% of a core)
    extra: dict = field(default_factory=dict)


def _cpu_summary(cpu: dict) -> tuple[float | None, float]:
    """(server µs per request: every process but the load generator, other processes %)."""
    per = [v.get("us_per_req") for k, v in cpu.items()
           if k != "machine" and not k.startswith(LOAD_TOOLS)]
    server = sum(per) if per and None not in per else None
    return server, cpu.get("machine", {}).get("other", 0.0)


def _client(proto: str, srv: Server):
    if proto == "http":
        import tritonclient.http as tc
        return tc, tc.InferenceServerClient(srv.http)
    import tritonclient.grpc as tc
    return tc, tc.InferenceServerClient(srv.grpc)


def c1_latency(srv: Server, proto: str, model: str, inputs: dict[str, np.ndarray],
               want: dict[str, np.ndarray], seconds: float) -> Sample:
    """Sequential requests with the official sync client (binary tensors, its default) for
    `seconds` after a warm-up; every output checked once first. Value: p50 ms."""
    tc, client = _client(proto, srv)
    try:
        ins = []
        for name, arr in inputs.items():
            i = tc.InferInput(name, list(arr.shape), "FP32")
            i.set_data_from_numpy(arr)
            ins.append(i)
        outs = [tc.InferRequestedOutput(n) for n in want]
        r = client.infer(model, ins, outputs=outs)
        for n, w in want.items():
            if not np.allclose(r.as_numpy(n), w, rtol=1e-6):
                raise AssertionError(f"{proto} {model}: wrong {n}")
        end = time.perf_counter() + min(1.0, seconds / 4)
        while time.perf_counter() < end:
            client.infer(model, ins, outputs=outs)
        before = srv.counters(model)
        meter = CpuMeter({**srv.processes(), "client": os.getpid()})
        lat = []
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            s = time.perf_counter_ns()
            client.infer(model, ins, outputs=outs)
            lat.append(time.perf_counter_ns() - s)
        rate = len(lat) / (time.perf_counter() - t0)
        cpu = meter.percent(meter.sample(), rate)
        delta = counter_delta(before, srv.counters(model))
    finally:
        client.close()
    p50, p99, mean = pct(lat)
    server, other = _cpu_summary(cpu)
    bad = delta.get("nv_inference_request_failure", 0)
    return Sample(p50, bad == 0, f"{len(lat)} req, p99 {p99:.3f} ms, {rate:,.0f}/s"
                  + (f", {bad:.0f} server failures" if bad else ""),
                  server, other, {"p99_ms": p99, "mean_ms": mean, "n": len(lat), "cpu": cpu})


def _batch(delta: dict) -> str:
    n, e = delta.get("nv_inference_count", 0), delta.get("nv_inference_exec_count", 0)
    return f", mean batch {n / e:.1f}" if e else ""


def wrk_c64(srv: Server, model: str, x: np.ndarray, tmp: Path, seconds: int) -> Sample:
    """bench_load.run_wrk: wrk -t2 -c64 posting a JSON body (2 s warm-up run first)."""
    r = run_wrk(srv, model, x, tmp, seconds, conns=64, threads=2,
                meter_pids=srv.processes())
    errs = r["non2xx"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
    bad = r["server"].get("nv_inference_request_failure", 0)
    ok = errs == 0 and r["non2xx_line"] == 0 and bad == 0
    server, other = _cpu_summary(r["cpu_pct"])
    note = (f"{r['requests']} req, 0 errors" if ok else
            f"ERRORS: non2xx {r['non2xx']}, socket {errs - r['non2xx']}, server failures {bad:.0f}")
    return Sample(r["rps"], ok, note + _batch(r["server"]), server, other,
                  {"cmd": r["cmd"], "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3,
                   "cpu": r["cpu_pct"], "server": r["server"]})


def grpc_body_inputs(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    """A pre-encoded ModelInferRequest with several inputs (bench_load.grpc_body has one)."""
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, arr in inputs.items():
        t = req.inputs.add()
        t.name, t.datatype = name, "FP32"
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    msg = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def h2load_run(srv: Server, model: str, x: np.ndarray | dict, want: np.ndarray, tmp: Path,
               seconds: int, conns: int) -> Sample:
    """bench_load.run_h2load: h2load -t1 -cN -m1 posting a pre-encoded ModelInferRequest
    (checked first through a real gRPC channel; 2 s warm-up). A dict x means several inputs:
    the body is then grpc_body_inputs'."""
    patch = (mock.patch.object(bench_load, "grpc_body", grpc_body_inputs)
             if isinstance(x, dict) else contextlib.nullcontext())
    with patch:
        r = run_h2load(srv, model, x, want, tmp, seconds, conns=conns,
                       meter_pids=srv.processes())
    bad = r["server"].get("nv_inference_request_failure", 0)
    okc = r["server"].get("nv_inference_request_success", 0)
    ok = (r["failed"] == 0 and r["errored"] == 0 and r["non2xx"] == 0 and bad == 0
          and okc >= r["s2xx"] * 0.99)
    server, other = _cpu_summary(r["cpu_pct"])
    note = (f"{r['s2xx']} req 2xx, server ok {okc:.0f}" if ok else
            f"ERRORS: failed {r['failed']} errored {r['errored']} non2xx {r['non2xx']} "
            f"server failures {bad:.0f} server ok {okc:.0f}")
    return Sample(r["rps"], ok, note + f", mean {r['mean_req']}" + _batch(r["server"]), server,
                  other, {"cmd": r["cmd"], "cpu": r["cpu_pct"], "server": r["server"]})


def big_c4(srv: Server, seconds: float) -> Sample:
    """bench_load.grpc_big_round_trip: 4 threads, one tritonclient.grpc client each, 4 MiB
    FP32 through `identity` (checked first) for `seconds`; MiB/s counts the request once."""
    end = [0.0]
    # The deadline starts when every client has warmed up (the until() callback's first call).
    def until() -> bool:
        if not end[0]:
            end[0] = time.monotonic() + seconds
        return time.monotonic() >= end[0]
    mibs, p50, p99, mean, cpu = grpc_big_round_trip(srv, srv.grpc, 4 << 20, 4, 0, 2, until=until)
    server, other = _cpu_summary(cpu)
    return Sample(mibs, True, f"p50 {p50:.1f} ms, p99 {p99:.1f} ms", server, other, {"cpu": cpu})


# --------------------------------------------------------------------------- py-spy

def profile_trireme(srv: Server, workers: tuple[str, ...], run, seconds: int, tmp: Path,
                    tag: str, native: bool = True, rate: int = 100) -> dict:
    """py-spy on the scheduler, the frontends and the scenario's workers while
    run(seconds + 3) loads the server; per process: CPU % of a core during the run, and the
    top leaf frames (own time) with their callers. native (py-spy --native: C frames too, and
    samples blocked in epoll/poll/futex/recv can be told apart and left out) pauses the
    process per sample; without it (--nonblocking) waiting shows as the frame that waits."""
    pids = {k: v for k, v in srv.processes().items()
            if not k.startswith("worker[") or k.removeprefix("worker[").rstrip("]") in workers}
    procs = pyspy_record(pids, seconds, tmp, tag, rate, native)
    time.sleep(0.3)
    sample = run(seconds + 3)
    out = {"value": sample.value, "cpu": sample.extra.get("cpu", {}), "processes": {},
           "native": native}
    for label, (p, path) in procs.items():
        text, _ = p.communicate(timeout=120)
        s = summarize_raw(path, top=6)
        if not s["samples"]:
            s["error"] = (text or "").strip()[-300:]
        out["processes"][label] = s
    log(f"profile {tag}: {sample.value:,.1f} while recorded")
    return out


def format_profile(title: str, prof: dict) -> str:
    how = "py-spy --native, waiting samples left out" if prof["native"] else "py-spy"
    lines = [f"#### {title} (Trireme under {how}: {prof['value']:,.2f})", ""]
    cpu = prof["cpu"]
    if cpu:
        lines.append("CPU % of a core during the run: " + ", ".join(
            f"{k} {v['cpu']:.0f}" for k, v in cpu.items() if k != "machine" and v["cpu"] >= 1)
            + f"; other processes {cpu.get('machine', {}).get('other', 0):.0f}")
        lines.append("")
    for label, s in prof["processes"].items():
        busy = s.get("busy", 0)
        if not busy:
            lines.append(f"- {label}: no busy samples {s.get('error', '')}".rstrip())
            continue
        top = "; ".join(f"`{f}` {100 * c / busy:.0f}%" + (f" ← `{via}`" if via else "")
                        for f, c, via in s["own"][:5])
        lines.append(f"- {label} ({busy} busy samples): {top}")
        lines.append("  inclusive: " + "; ".join(
            f"`{f}` {100 * c / busy:.0f}%" for f, c in s["inclusive"][:6]))
    return "\n".join(lines)
