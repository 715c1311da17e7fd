#!/usr/bin/env python
"""Trireme vs real Triton 2.51 on the same Python-backend models, side by side in one run.

    python benchmarks/vs_triton.py [--quick] [--duration S] [--repeats 3] [--only 1,2,3,4]
                                   [--frontends N] [--trireme-arg=--in-process-frontend]
                                   [--profile [--profile-python]]
                                   [--json out.json] [--keep]

One temp model repository (vs_triton_models.py: Triton's add_sub example, an identity with
dynamic batching, a 4 MiB identity, a `scale` model and the ensemble add_sub -> scale; all
`backend: "python"`, one KIND_CPU instance each) is served by both servers at once on
different free ports: Triton through ../shared/tools/triton.sh (tritonserver 2.51, CPU, its
Python backend stub on the system numpy) and Trireme as `python -m services.cli serve`.
Only one is measured at a time. Each measurement runs Triton, Trireme, Triton, Trireme,
Triton, Trireme (--repeats pairs, `--duration` seconds each) and reports the median per
server and their ratio, oriented so that > 1 means Trireme is better (throughput:
Trireme / Triton; latency: Triton / Trireme):

  1. add_sub           c1 HTTP p50 (tritonclient.http), c1 gRPC p50 (tritonclient.grpc),
                       sequential requests; in-process execute() as the ceiling
  2. identity_batched  [1,16] FP32, dynamic batching: c64 HTTP (wrk -t2, JSON body),
                       c64 gRPC (h2load -c64 -m1, a pre-encoded ModelInferRequest)
  3. identity          4 MiB FP32, c4 gRPC (4 threads, one tritonclient.grpc client each), MiB/s
  4. add_sub_scale     ensemble: c1 gRPC p50, c16 gRPC throughput (h2load -c16 -m1)

The load generators and the server handling are bench_load's and bench_server's (as in
serving.py); every answer is checked before a run, every load run against the server's own
success/failure counters. --profile: for each measurement whose target is missed, one more
Trireme run while py-spy --native records its processes (top frames per process; waiting in
epoll/poll/futex left out; --profile-python: Python frames only, without pausing them). Exits 0 with a
message when triton.sh is absent. Needs wrk and h2load (apt-get install wrk nghttp2-client).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, log, machine_info, wait_quiet
from vs_triton_models import ENSEMBLE, WIDTH, add_sub_inputs, build_repository, in_process_add_sub
from vs_triton_runs import (
    TRITON_SH,
    Sample,
    TritonServer,
    big_c4,
    c1_latency,
    format_profile,
    h2load_run,
    profile_trireme,
    server_version,
    wait_models_ready,
    wrk_c64,
)

READY_TIMEOUT_S = 120.0
CONTENDED_PCT = 20.0


@dataclass
class Measure:
    scenario: str
    label: str
    unit: str
    latency: bool                 # lower is better; ratio = Triton / Trireme
    target: float                 # the target as a minimum ratio (> 1: Trireme better)
    target_text: str
    run: Callable[[Server, int], Sample]
    workers: tuple[str, ...]      # Trireme workers on the path (profiled with --profile)
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {"Triton": [], "Trireme": []})

    def median(self, who: str) -> float:
        return statistics.median(s.value for s in self.samples[who])

    def ratio(self) -> float:
        t, r = self.median("Triton"), self.median("Trireme")
        return t / r if self.latency else r / t

    def met(self) -> bool:
        return self.ratio() >= self.target and all(
            s.ok for v in self.samples.values() for s in v)


def measures(tmp: Path, only: set[str]) -> list[Measure]:
    a, b = add_sub_inputs()
    x = np.random.default_rng(2).random((1, WIDTH), dtype=np.float32)
    add_sub = {"INPUT0": a, "INPUT1": b}
    out: list[Measure] = []
    if "1" in only:
        for proto, name in (("http", "HTTP"), ("grpc", "gRPC")):
            out.append(Measure(
                "1 add_sub", f"c1 {name} p50 (tritonclient.{proto})", "ms", True, 1.0,
                "p50 ≤ Triton's", lambda s, d, p=proto: c1_latency(
                    s, p, "add_sub", add_sub, {"OUTPUT0": a + b, "OUTPUT1": a - b}, d),
                ("add_sub",)))
    if "2" in only:
        out.append(Measure("2 identity [1,16], dynamic batching", "c64 HTTP (wrk -t2, JSON)",
                           "infer/s", False, 1.2, "≥ 1.2× Triton",
                           lambda s, d: wrk_c64(s, "identity_batched", x, tmp, d),
                           ("identity_batched",)))
        out.append(Measure("2 identity [1,16], dynamic batching", "c64 gRPC (h2load -c64 -m1)",
                           "infer/s", False, 1.2, "≥ 1.2× Triton",
                           lambda s, d: h2load_run(s, "identity_batched", x, x, tmp, d, 64),
                           ("identity_batched",)))
    if "3" in only:
        out.append(Measure("3 identity 4 MiB FP32", "c4 gRPC (4 × tritonclient.grpc)", "MiB/s",
                           False, 1.5, "≥ 1.5× Triton", big_c4, ("identity",)))
    if "4" in only:
        out.append(Measure("4 ensemble add_sub → scale", "c1 gRPC p50 (tritonclient.grpc)",
                           "ms", True, 1.25, "p50 ≤ 0.8× Triton's (ratio ≥ 1.25)",
                           lambda s, d: c1_latency(s, "grpc", ENSEMBLE, add_sub,
                                                   {"OUTPUT0": 2 * (a + b)}, d),
                           ("add_sub", "scale")))
        out.append(Measure("4 ensemble add_sub → scale", "c16 gRPC (h2load -c16 -m1)",
                           "infer/s", False, 1.5, "≥ 1.5× Triton",
                           lambda s, d: h2load_run(s, ENSEMBLE, add_sub, 2 * (a + b), tmp, d, 16),
                           ("add_sub", "scale")))
    return out


# --------------------------------------------------------------------------- tables

def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    return f"{v:.3f}" if unit == "ms" else f"{v:,.0f}"


def results_table(ms: list[Measure]) -> str:
    out = ["| scenario | measurement | Triton runs | Trireme runs | Triton median | "
           "Trireme median | ratio | target | met? |",
           "|---|---|---|---|---:|---:|---:|---|---|"]
    for m in ms:
        runs = {w: ", ".join(_fmt(s.value, m.unit) + ("*" if s.other_pct > CONTENDED_PCT else "")
                             + ("" if s.ok else " (ERR)") for s in m.samples[w])
                for w in m.samples}
        out.append(f"| {m.scenario} | {m.label} ({m.unit}) | {runs['Triton']} | "
                   f"{runs['Trireme']} | {_fmt(m.median('Triton'), m.unit)} | "
                   f"{_fmt(m.median('Trireme'), m.unit)} | **{m.ratio():.2f}** | "
                   f"{m.target_text} | {'met' if m.met() else '**MISS**'} |")
    return "\n".join(out)


def _median_sample(samples: list[Sample]) -> Sample:
    return sorted(samples, key=lambda s: s.value)[len(samples) // 2]


def detail_table(ms: list[Measure]) -> str:
    out = ["| measurement | server CPU µs/req Triton / Trireme (median runs) | Triton median run | "
           "Trireme median run |", "|---|---|---|---|"]
    for m in ms:
        t, r = _median_sample(m.samples["Triton"]), _median_sample(m.samples["Trireme"])
        cpu = f"{_fmt(t.server_us, 'us')} / {_fmt(r.server_us, 'us')}"
        out.append(f"| {m.scenario.split()[0]}: {m.label} | {cpu} | {t.note} | {r.note} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=None, help="seconds per measurement (5)")
    ap.add_argument("--quick", action="store_true", help="2 s per measurement")
    ap.add_argument("--repeats", type=int, default=3, help="Triton/Trireme pairs (3)")
    ap.add_argument("--only", default="1,2,3,4", help="scenarios, e.g. 1,4")
    ap.add_argument("--frontends", type=int, default=1, help="trireme serve --frontends (1)")
    ap.add_argument("--trireme-arg", action="append", default=[], metavar="FLAG",
                    help="one more `trireme serve` flag (repeatable), e.g. "
                         "--trireme-arg=--in-process-frontend")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy the Trireme processes during each measurement that misses")
    ap.add_argument("--profile-python", action="store_true",
                    help="profile Python frames only (py-spy --nonblocking) instead of --native")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each run wait up to this many seconds for the machine to go "
                         "idle (12x this in all; 0: don't wait)")
    ap.add_argument("--triton-sh", type=Path, default=TRITON_SH, help="triton.sh to run")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (server logs)")
    args = ap.parse_args()

    if not args.triton_sh.is_file():
        print(f"SKIPPED: {args.triton_sh} not found; this benchmark needs real Triton "
              "(../shared/tools/triton.sh, tritonserver 2.51). Nothing was measured.")
        return 0
    missing = [t for t in ("wrk", "h2load") if shutil.which(t) is None]
    if missing:
        print(f"SKIPPED: {', '.join(missing)} not on PATH (apt-get install wrk nghttp2-client).")
        return 0
    duration = args.duration or (2 if args.quick else 5)
    only = set(args.only.split(","))

    cmd = "python benchmarks/vs_triton.py " + " ".join(sys.argv[1:])
    print(f"# Trireme vs Triton 2.51, Python-backend models\n\ncommand: `{cmd.strip()}`  \n"
          f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    info = machine_info(args.frontends)
    tmp = Path(tempfile.mkdtemp(prefix="trireme-vs-triton-"))
    repo = build_repository(tmp)
    ms = measures(tmp, only)
    servers: dict[str, Server] = {}
    budget = [args.quiet_wait * 12]
    ceiling = None
    profiles: list[tuple[str, dict]] = []
    t_start = time.monotonic()

    def quiet() -> None:
        if args.quiet_wait > 0 and budget[0] > 0:
            t = time.monotonic()
            wait_quiet(min(args.quiet_wait, budget[0]))
            budget[0] -= time.monotonic() - t

    try:
        servers["Triton"] = TritonServer(repo, tmp / "triton.log", args.triton_sh)
        servers["Trireme"] = Server(repo, args.frontends, tmp / "trireme.log",
                                    extra=args.trireme_arg)
        for who, srv in servers.items():
            log(f"starting {who}: {' '.join(srv.cmd)}")
            srv.start()
            wait_models_ready(srv, READY_TIMEOUT_S)
            log(f"{who} ready; processes: {srv.processes()}")
        info["servers"] = {w: server_version(s) for w, s in servers.items()}
        info["commands"] = {w: " ".join(s.cmd) for w, s in servers.items()}

        if "1" in only:
            quiet()
            log("add_sub: in-process execute()")
            ceiling = in_process_add_sub(repo, duration)

        for m in ms:
            for rep in range(args.repeats):
                for who in ("Triton", "Trireme"):
                    quiet()
                    s = m.run(servers[who], duration)
                    m.samples[who].append(s)
                    log(f"{m.scenario}: {m.label} [{who} {rep + 1}/{args.repeats}] "
                        f"{_fmt(s.value, m.unit)} {m.unit}; {s.note}"
                        + (f"; other processes {s.other_pct:.0f}%" if s.other_pct > 5 else ""))

        if args.profile:
            for m in ms:
                if m.met():
                    continue
                quiet()
                log(f"profile: {m.scenario}: {m.label}")
                profiles.append((f"{m.scenario}: {m.label}", profile_trireme(
                    servers["Trireme"], m.workers, lambda d, m=m: m.run(servers["Trireme"], d),
                    max(duration, 5), tmp, f"{m.scenario.split()[0]}-{len(profiles)}",
                    native=not args.profile_python)))
    except BaseException:
        for who, srv in servers.items():
            log(f"{who} log tail:\n{srv.tail()}")
        raise
    finally:
        for who, srv in servers.items():
            srv.stop()
            log(f"{who} stopped (exit code {srv.proc.returncode if srv.proc else None})")
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("| machine | |\n|---|---|")
    for k, v in info.items():
        if isinstance(v, dict):
            v = "; ".join(f"{a}: `{b}`" if k == "commands" else f"{a}: {b}"
                          for a, b in v.items())
        print(f"| {k} | {v} |")
    print(f"\n## Results ({args.repeats} runs per server, alternating Triton, Trireme; "
          f"{duration} s each)\n")
    print("Ratio: > 1 means Trireme is better: Trireme / Triton for throughput, "
          "Triton / Trireme for p50 latency; computed from the medians. "
          f"`*`: another process used > {CONTENDED_PCT:.0f}% of a core during that run.\n")
    print(results_table(ms))
    if ceiling:
        p50, p99, rate, n = ceiling
        print(f"\nReference, not a server: add_sub `execute()` called in this process "
              f"(Trireme's pb_utils, one request per call, {n:,} calls): p50 **{p50 * 1000:.1f} µs**, "
              f"p99 {p99 * 1000:.1f} µs, {rate:,.0f} calls/s.")
    print("\n### Per run (the median run of each server)\n")
    print(detail_table(ms))
    print(f"\n(total {time.monotonic() - t_start:.0f} s; server CPU: user+sys of every process "
          "of that server, from /proc, per request)")
    for title, prof in profiles:
        print("\n" + format_profile(title, prof))
    if args.json:
        args.json.write_text(json.dumps({
            "command": cmd, "machine": info, "ceiling": ceiling,
            "measures": [{"scenario": m.scenario, "label": m.label, "unit": m.unit,
                          "ratio": m.ratio(), "met": m.met(),
                          "samples": {w: [asdict(s) for s in v] for w, v in m.samples.items()}}
                         for m in ms],
            "profiles": profiles}, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
