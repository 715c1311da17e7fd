"""`trireme perf` against wrk (HTTP) and h2load (gRPC): is the Python load generator the
bottleneck? The same `trireme serve` (the ONNX identity model, 1x16 FP32, one instance),
the same concurrency (c64 by default), in the same run, alternating the tools each round.

For each run: the throughput the tool measured, the server's own count of successes per
second over the same run (its Prometheus counters), the client's CPU (% of one core and
µs per request: wrk and h2load from /proc, `trireme perf` as it reports itself: every load
process and its profiler), the server's CPU per request (all its processes, /proc), and
how busy the whole machine was (other engineers' processes included: it is shared).
`trireme perf` runs with perf_analyzer's rules (-p windows until 3 agree within -s %).

    python benchmarks/perf_vs_tools.py [--rounds 2] [--duration 8] [--conns 64]
                                       [--frontends 1] [--protocols http,grpc]
                                       [--impls lean,tritonclient] [--http-format binary]

`trireme perf` runs once per load path (--load-impl): lean (its default: requests encoded
once, its own HTTP/1.1 and HTTP/2 connections on uvloop) and tritonclient (the official
client, its path for shared memory, streaming and sequence models). The request is the
same on both sides, to the byte: over HTTP wrk posts the very request trireme perf sends
(its random data, its headers, its body: binary tensors both ways, perf_analyzer's default,
or with --http-format json JSON tensors both ways; the server's cost per request differs
with the format, so the tools must not differ in it), over gRPC h2load sends the
ModelInferRequest tritonclient.grpc would, which is what trireme perf sends.

Results, 2026-11-28, commit d328524 with the lean path (uncommitted working tree), the
2-core AMD EPYC box shared with other engineers' processes, client and server on the same
two cores: `python benchmarks/perf_vs_tools.py --rounds 3 --duration 8`

| c64 | tool | infer/s (median) | vs native | p50/p99 ms | client µs/req | server µs/req | runs |
|---|---|---:|---:|---|---:|---:|---|
| http | wrk | 15788 |  | 3.88/7.40 | 12 | 73 | 16398, 15788, 15510 |
| http | perf, lean (1 proc) | 15348 | -2.8 % | 4.01/7.79 | 16 | 73 | 15348, 15394, 12956 |
| http | perf, tritonclient (2 proc) | 7284 | -53.9 % | 8.18/17.14 | 138 | 127 | 7958, 7284, 7003 |
| grpc | h2load | 14089 |  | - | 15 | 89 | 12229, 14317, 14089 |
| grpc | perf, lean (1 proc) | 13766 | -2.3 % | 4.35/9.42 | 19 | 91 | 13881, 13165, 13766 |
| grpc | perf, tritonclient (2 proc) | 7355 | -47.8 % | 8.29/16.40 | 118 | 108 | 7355, 6682, 7921 |

trireme perf's client CPU includes its profiler process. Single runs move by ±15 % with
the other tenants' load: earlier runs the same day gave gRPC lean +5.2 %, -2.1 % and
-14.6 % (alternated h2load / lean pairs on a quiet machine, 5 s each, ×4: 14988/14845,
15712/15037, 15505/14309, 15074/15523 calls/s), and, while wrk still posted its own
shorter JSON body, HTTP lean +4.8 % (binary tensors), -4.4 % and -19.8 % (JSON tensors,
tritonclient's longer encoding: the server's CPU per request differed by 5-15 %): hence
the same bytes on both sides now.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import WRK_DONE, run_h2load, wrk_measure
from bench_server import (
    ROOT,
    CpuMeter,
    Server,
    build_repository,
    counter_delta,
    log,
    machine_info,
    wait_quiet,
)

MODEL = "identity"
WIDTH = 16
SUCCESS = "nv_inference_request_success"


def run_perf(srv: Server, protocol: str, conns: int, duration: int, tmp: Path,
             impl: str = "lean", http_format: str = "binary") -> dict:
    """`trireme perf --load-impl impl` at c``conns``; windows of a third of ``duration`` each;
    over HTTP, tensors in ``http_format`` both ways."""
    url = srv.http if protocol == "http" else srv.grpc
    out_csv = tmp / f"perf-{protocol}-{time.monotonic_ns()}.csv"
    window_ms = max(500, duration * 1000 // 3)
    cmd = [sys.executable, "-m", "services.cli", "perf", "-m", MODEL, "-i", protocol, "-u", url,
           "--concurrency-range", str(conns), "--shape", f"INPUT0:{WIDTH}", "-p",
           str(window_ms), "-s", "15", "--max-trials", "8", "--load-impl", impl,
           "-f", str(out_csv)]
    if protocol == "http" and http_format == "json":
        cmd += ["--input-tensor-format", "json", "--output-tensor-format", "json"]
    before = srv.counters(MODEL)
    meter = CpuMeter(srv.processes())
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    used = meter.sample()
    delta = counter_delta(before, srv.counters(MODEL))
    if p.returncode != 0:
        raise RuntimeError(f"trireme perf exited {p.returncode}:\n{p.stderr[-2000:]}")
    out = p.stdout
    rows = out_csv.read_text().splitlines()
    ips = float(rows[1].split(",")[1])
    cpu = re.search(r"Client CPU: (\d+) usec per request \(([\d.]+)% of a core, (\d+) load", out)
    client_n = int(re.findall(r"    Request count: (\d+)", out)[-1])
    server_n = int(re.findall(r"Successful request count: (\d+)", out)[-1])
    p50 = int(re.findall(r"p50 latency: (\d+) usec", out)[-1])
    p99 = int(re.findall(r"p99 latency: (\d+) usec", out)[-1])
    server_cpu = sum(v["cpu"] for v in used.values())
    machine = meter.percent(used)["machine"]["cpu"]
    return {"machine_pct": machine, "rps": ips, "server_share": server_n / client_n if client_n else None,
            "client_pct": float(cpu.group(2)) if cpu else None,
            "client_us": float(cpu.group(1)) if cpu else None,
            "processes": int(cpu.group(3)) if cpu else None,
            "server_us": 1e6 * server_cpu / delta.get(SUCCESS, 1) if delta.get(SUCCESS) else None,
            "p50_ms": p50 / 1000, "p99_ms": p99 / 1000, "wall_s": wall,
            "cmd": " ".join(cmd[1:]).replace(str(out_csv), "perf.csv")}


def perf_request(srv: Server, http_format: str) -> bytes:
    """The HTTP request `trireme perf` sends in run_perf, to the byte: its random data, its
    encoder (services.perf.lean_http, tritonclient.http's body)."""
    sys.path.insert(0, str(ROOT))
    from services.perf import inputs
    from services.perf.flags import SslSettings
    from services.perf.lean_http import http_request
    from services.perf.model import ModelInfo, Tensor
    from services.perf.worker_core import WorkerSpec
    io = ([Tensor("INPUT0", "FP32", [-1])], [Tensor("OUTPUT0", "FP32", [-1])])
    model = ModelInfo(MODEL, "1", 64, *io, "none")
    (stream,) = inputs.load(model, ["random"], {"INPUT0": [WIDTH]}, 128, None)
    (request,) = inputs.batch(stream, 1, True)
    spec = WorkerSpec(index=0, processes=1, protocol="http", url=srv.http, ssl=SslSettings(),
                      headers={}, model=MODEL, version="", inputs=io[0], outputs=io[1],
                      requests=[request], streams=[], sequence=None,
                      input_json=http_format == "json", output_json=http_format == "json")
    return http_request(spec, request)


def run_wrk_request(srv: Server, request: bytes, tmp: Path, duration: int, conns: int,
                    threads: int = 2) -> dict:
    """wrk posting exactly ``request`` (its headers but Host and Content-Length, which wrk
    writes, and its body), as run_wrk does with its own JSON body."""
    head, body = request.split(b"\r\n\r\n", 1)
    line, *fields = head.decode("latin-1").split("\r\n")
    lua = ['wrk.method = "POST"', f'wrk.path = "{line.split()[1]}"']
    for f in fields:
        k, v = f.split(": ", 1)
        if k.lower() not in ("host", "content-length"):
            lua.append(f'wrk.headers["{k}"] = "{v}"')
    lua.append('wrk.body = "' + "".join(f"\\{b}" for b in body) + '"')
    script = tmp / "wrk-perf-request.lua"
    script.write_text("\n".join(lua) + "\n" + WRK_DONE)
    url = f"http://{srv.http}{line.split()[1]}"
    return wrk_measure(srv, script, url, duration, conns, threads)


def run_tool(srv: Server, protocol: str, conns: int, duration: int, tmp: Path,
             http_format: str = "binary") -> dict:
    x = np.random.default_rng(1).random((1, WIDTH), dtype=np.float32)
    before = srv.counters(MODEL)
    t0 = time.monotonic()
    if protocol == "http":
        r = run_wrk_request(srv, perf_request(srv, http_format), tmp, duration, conns)
        tool, bad = "wrk", r["non2xx"] + r["non2xx_line"]
        p50, p99 = r["p50_us"] / 1000, r["p99_us"] / 1000
    else:
        r = run_h2load(srv, MODEL, x, x, tmp, duration, conns=conns)
        tool, bad = "h2load", r["failed"] + r["errored"] + r["non2xx"]
        p50 = p99 = None
    wall = time.monotonic() - t0
    if bad:
        raise RuntimeError(f"{tool}: {bad} requests failed:\n{r['raw'][-2000:]}")
    cpu = r["cpu_pct"]
    server_us = sum(v["us_per_req"] or 0.0 for k, v in cpu.items()
                    if k not in ("machine", tool))
    delta = counter_delta(before, srv.counters(MODEL))
    return {"machine_pct": cpu["machine"]["cpu"], "rps": r["rps"], "client_pct": cpu[tool]["cpu"],
            "client_us": cpu[tool]["us_per_req"], "processes": None,
            "server_us": server_us or None, "p50_ms": p50, "p99_ms": p99, "wall_s": wall,
            "served": delta.get(SUCCESS, 0.0), "cmd": r["cmd"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=int, default=8, help="seconds of load per wrk/h2load run")
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--frontends", type=int, default=1)
    ap.add_argument("--protocols", default="http,grpc")
    ap.add_argument("--impls", default="lean,tritonclient",
                    help="trireme perf's load paths to run (--load-impl values)")
    ap.add_argument("--http-format", choices=["json", "binary"], default="binary",
                    help="the HTTP tensors, both ways, of trireme perf's request (which wrk "
                         "sends too): binary (perf_analyzer's default) or json")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each run, wait up to this long for the machine to go quiet")
    args = ap.parse_args()
    protocols = [p for p in args.protocols.split(",") if p]
    impls = [i for i in args.impls.split(",") if i]
    tools = [(p, t) for p in protocols for t in ("tool", *impls)
             if not (t == "tool" and shutil.which("wrk" if p == "http" else "h2load") is None)]

    info = machine_info(args.frontends)
    print(f"command: `python benchmarks/perf_vs_tools.py {' '.join(sys.argv[1:])}`".strip())
    print(f"machine: {info.get('cpu', '?')}, {info.get('nproc', '?')} cores, "
          f"Python {info.get('python', '?')}\n")
    results: dict[tuple[str, str], list[dict]] = {k: [] for k in tools}
    tmp = Path(tempfile.mkdtemp(prefix="trireme-perf-vs-tools-"))
    srv = Server(build_repository(tmp, [MODEL]), args.frontends, tmp / "server.log")
    try:
        srv.start()
        for rnd in range(args.rounds):
            order = tools if rnd % 2 == 0 else tools[::-1]
            for protocol, kind in order:
                if args.quiet_wait > 0:
                    wait_quiet(args.quiet_wait)
                log(f"round {rnd + 1}/{args.rounds}: {protocol} {kind}")
                try:
                    if kind == "tool":
                        r = run_tool(srv, protocol, args.conns, args.duration, tmp,
                                     args.http_format)
                    else:
                        r = run_perf(srv, protocol, args.conns, args.duration, tmp, kind,
                                     args.http_format)
                except RuntimeError as e:   # (a level that never stabilised: shown, not fatal)
                    r = {"rps": None, "failed": str(e).splitlines()[0]}
                results[(protocol, kind)].append(r)
                log(f"  {results[(protocol, kind)][-1]}")
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def med(rs: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def fmt(v: float | None, spec: str = ".0f") -> str:
        return "-" if v is None else format(v, spec)

    print(f"| protocol | tool | c | infer/s (median of {args.rounds}) | vs the native tool | "
          "p50 / p99 ms | client CPU, % of a core | client CPU µs/request | server CPU "
          "µs/request | machine busy, % of a core | runs (infer/s) |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for protocol in protocols:
        native = med(results.get((protocol, "tool"), []), "rps")
        for kind in ("tool", *impls):
            rs = results.get((protocol, kind))
            if not rs:
                continue
            procs = med(rs, "processes")
            name = ("wrk" if protocol == "http" else "h2load") if kind == "tool" else \
                f"trireme perf, {kind} ({fmt(procs)} proc)"
            rps = med(rs, "rps")
            vs = f"{100 * (rps / native - 1):+.1f} %" if kind != "tool" and rps and native else ""
            runs = ", ".join("failed" if r.get("failed") else f"{r['rps']:.0f}" for r in rs)
            print(f"| {protocol} | {name} | {args.conns} | {fmt(rps)} | {vs} | "
                  f"{fmt(med(rs, 'p50_ms'), '.2f')} / {fmt(med(rs, 'p99_ms'), '.2f')} | "
                  f"{fmt(med(rs, 'client_pct'))} | {fmt(med(rs, 'client_us'))} | "
                  f"{fmt(med(rs, 'server_us'))} | {fmt(med(rs, 'machine_pct'))} | {runs} |")
    print("\ncommands:")
    for (protocol, kind), rs in results.items():
        cmds = [r["cmd"] for r in rs if "cmd" in r]
        if cmds:
            print(f"  {protocol} {kind}: {cmds[0]}")
        for r in rs:
            if r.get("failed"):
                print(f"  {protocol} {kind}: a run failed: {r['failed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
