"""What benchmarks/request_budget.py measures across processes: the hop between two
processes (a message written, the receiver woken, read: the CPU of both ends), and the
totals of real `trireme serve` and real Triton 2.51 (server CPU per request at c1, and
Triton's trace timestamps)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server import ROOT, Server, log  # noqa: E402
from vs_triton_models import ENSEMBLE, add_sub_inputs, build_repository  # noqa: E402

sys.path.insert(0, str(ROOT))
import uvloop  # noqa: E402

from services.common import transport_stream  # noqa: E402

A, B = add_sub_inputs()
SERVICE = "/inference.GRPCInferenceService/ModelInfer"

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


