"""What /metrics costs per request: the same load against `trireme serve` with the default
metrics (counters), with every opt-in family on (histogram_latencies and summary_latencies),
and with --allow-metrics false, alternating, medians of the rounds.

Two measurements:
  1. the recording itself, in process: VersionStats.executed() for batches of one request
     plus the folding a scrape does, ns per request (stable, no noise from the machine);
  2. served: h2load gRPC ModelInfer, c16, to the ONNX identity model (1x16 FP32), while
     /metrics is scraped every --scrape-s seconds; throughput and the scheduler's CPU time
     per request (where the metrics are recorded and rendered).

    python benchmarks/metrics_cost.py [--rounds 3] [--duration 10] [--conns 16]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import run_h2load
from bench_server import Server, build_repository, log, machine_info, wait_quiet

CONFIGS: dict[str, list[str]] = {
    "metrics off (--allow-metrics false)": ["--allow-metrics", "false"],
    "default (counters)": [],
    "histograms + summaries": ["--metrics-config", "histogram_latencies=true",
                               "--metrics-config", "summary_latencies=true"],
}
MODEL = "identity"
WIDTH = 16


def hot_path_ns(settings: list[str], n: int = 100_000, scrape_every: int = 20_000) -> float:
    """ns per request of VersionStats.executed() (one request per batch, as at c16 on the
    identity model) plus the fold a scrape does, every ``scrape_every`` requests; less the
    same loop building the same arguments without the call."""
    from services.scheduler.metrics_config import MetricsOptions
    from services.scheduler.stats import StatsRegistry
    enabled = "--allow-metrics" not in settings
    opts = MetricsOptions.parse([v for v in settings if "=" in v], enabled=enabled, cpu=False, gpu=False)
    s = StatsRegistry(opts).fresh(MODEL, 1, None)
    lat = s.latency
    now = time.monotonic_ns()
    t0 = time.perf_counter_ns()
    for i in range(n):
        s.executed(1, [(now - 80_000, now - 60_000)], 0, (5_000, 20_000, 3_000), now)
        if lat is not None and i % scrape_every == 0:
            lat.fold()
    if lat is not None:
        lat.fold()
        if lat.summaries is not None:
            for sm in lat.summaries.values():
                sm.quantiles([q for q, _ in opts.quantiles], now)
    t1 = time.perf_counter_ns()
    for i in range(n):
        args = (1, [(now - 80_000, now - 60_000)], 0, (5_000, 20_000, 3_000), now)
        if lat is not None and i % scrape_every == 0:
            pass
    t2 = time.perf_counter_ns()
    del args
    return ((t1 - t0) - (t2 - t1)) / n


def hot_paths(repeats: int = 7) -> dict[str, float]:
    """The best of ``repeats`` runs of each config, the configs alternating."""
    best = {name: float("inf") for name in CONFIGS}
    for _ in range(repeats):
        for name, flags in CONFIGS.items():
            best[name] = min(best[name], hot_path_ns(flags))
    return best


def scraper(port: int, every_s: float, stop: threading.Event) -> None:
    while not stop.wait(every_s):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                r.read()
        except OSError:
            pass   # --allow-metrics false: nothing listens


def served_run(repo: Path, tmp: Path, extra: list[str], duration: int, conns: int,
               scrape_s: float) -> dict:
    srv = Server(repo, 1, tmp / f"server-{time.monotonic_ns()}.log", extra=extra)
    srv.start()
    stop = threading.Event()
    t = threading.Thread(target=scraper, args=(srv.metrics_port, scrape_s, stop), daemon=True)
    try:
        x = np.random.default_rng(1).random((1, WIDTH), dtype=np.float32)
        t.start()
        r = run_h2load(srv, MODEL, x, x, tmp, duration, conns=conns)
        if r["failed"] or r["errored"] or r["non2xx"]:
            raise RuntimeError(f"requests failed: {r['raw'][-2000:]}")
        cpu = r["cpu_pct"]
        server_us = sum(v["us_per_req"] or 0.0 for k, v in cpu.items()
                        if k not in ("machine", "h2load"))
        return {"rps": r["rps"], "sched_us": cpu["scheduler"]["us_per_req"],
                "server_us": round(server_us, 1), "machine": cpu["machine"]["cpu"],
                "other": cpu["machine"]["other"]}
    finally:
        stop.set()
        t.join(10)
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=10, help="seconds of load per run")
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--scrape-s", type=float, default=5.0, help="scrape /metrics this often")
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="before each run, wait up to this long for the machine to go quiet")
    ap.add_argument("--skip-served", action="store_true", help="only the in-process measurement")
    ap.add_argument("--only", default="", help="comma-separated indexes of the configs to serve "
                                               "(0 off, 1 default, 2 histograms + summaries)")
    args = ap.parse_args()

    info = machine_info(1)
    print(f"command: `python benchmarks/metrics_cost.py {' '.join(sys.argv[1:])}`".strip())
    print(f"machine: {info.get('cpu', '?')}, {info.get('nproc', '?')} cores, "
          f"Python {info.get('python', '?')}\n")

    log("in-process: VersionStats.executed() + fold, ns per request")
    hot = hot_paths()

    served: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    if args.only:
        names = [names[int(i)] for i in args.only.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="trireme-metrics-cost-"))
    try:
        if not args.skip_served:
            repo = build_repository(tmp, [MODEL])
            for rnd in range(args.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)]   # rotate
                for name in order:
                    if args.quiet_wait > 0:
                        wait_quiet(args.quiet_wait)
                    log(f"round {rnd + 1}/{args.rounds}: {name}")
                    served[name].append(served_run(repo, tmp, CONFIGS[name], args.duration,
                                                   args.conns, args.scrape_s))
                    log(f"  {served[name][-1]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base = names[0]   # the deltas are against the first config served

    def med(name: str, key: str) -> float | None:
        vals = [r[key] for r in served[name] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    vs = "vs off" if base.startswith("metrics off") else "vs first"
    print(f"| metrics | recording, ns/request (in process) | gRPC c{args.conns} infer/s "
          f"(median of {args.rounds}) | {vs} | scheduler CPU µs/request | server CPU µs/request "
          f"(all processes) | {vs} | runs (infer/s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    rps0, srv0 = med(base, "rps"), med(base, "server_us")
    for name in CONFIGS:
        rps, us, srv = med(name, "rps"), med(name, "sched_us"), med(name, "server_us")
        d_rps = f"{100 * (rps / rps0 - 1):+.1f} %" if rps and rps0 and name != base else ""
        d_srv = f"{100 * (srv / srv0 - 1):+.1f} %" if srv and srv0 and name != base else ""
        runs = ", ".join(f"{r['rps']:.0f}" for r in served[name])
        print(f"| {name} | {hot[name]:.0f} | {f'{rps:.0f}' if rps else '-'} | {d_rps} | "
              f"{f'{us:.1f}' if us is not None else '-'} | {f'{srv:.1f}' if srv else '-'} | "
              f"{d_srv} | {runs} |")
    busy = [r["other"] for rs in served.values() for r in rs]
    if busy:
        print(f"\nother processes used {min(busy):.0f}-{max(busy):.0f} % of one core during the runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
