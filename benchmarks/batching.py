#!/usr/bin/env python
"""Trireme dynamic-batching benchmark: throughput and latency with the batcher off and on.

    python benchmarks/batching.py [--quick] [--duration S] [--queue-delay-us US]
                                  [--concurrency 1,8,64] [--plot docs/batching.png]
                                  [--json results.json]

What it does (see docs/benchmarks.md for the latest numbers and how to read them):
  * builds ONE model repository in a temp dir with four copies of the same model file,
    tests/models.py's 3 x 1024 MatMul+Add+Relu MLP (FP32, intra_op_thread_count 2,
    max_batch_size 64), one per configuration:
      mlp_off_x1   no dynamic_batching,             instance_group [{ KIND_CPU, count: 1 }]
      mlp_on_x1    dynamic_batching { } (see below), instance_group [{ KIND_CPU, count: 1 }]
      mlp_off_x2   no dynamic_batching,             instance_group [{ KIND_CPU, count: 2 }]
      mlp_on_x2    dynamic_batching { } (see below), instance_group [{ KIND_CPU, count: 2 }]
    "on" is `dynamic_batching { }`: preferred_batch_size defaults to [max_batch_size] = [64]
    and max_queue_delay_microseconds to 0 (Triton's defaults: a batch is whatever is queued
    when an instance is free, never waiting for more); --queue-delay-us N adds
    `max_queue_delay_microseconds: N`. Every config writes its input and output out: without
    them auto-complete (Triton's onnxruntime rules) would add `dynamic_batching { }` to the
    "off" models too; the server's GET .../config is checked against what was meant;
  * starts `python -m services.cli serve` once on free ports with that repository (scheduler
    + one worker per instance, 6 workers in all, + --frontends N frontends), so the four
    configurations share the server and are measured one after the other (idle models cost
    no CPU); stops it with SIGTERM at the end;
  * checks each model's answer over HTTP against onnxruntime, then for each configuration
    and each concurrency (1, 8, 64 by default) runs wrk with a batch-1 JSON body
    (-t2, or -t1 at concurrency 1: wrk needs a connection per thread; a 2 s warm-up, 1 s with
    --quick, then --duration s, default 8 s, 3 s with --quick) and reports throughput
    (infer/s = requests/s, each request one row) and wrk's p50/p99 latency; errors are
    wrk's non-2xx + socket errors and the scheduler's nv_inference_request_failure delta
    (must be 0), and the scheduler's nv_inference_request_success delta is checked against
    wrk's request count (it may exceed it by the requests in flight at either end);
  * reads the statistics extension (GET /v2/models/<m>/stats) just before and just after
    each measured run and, from the difference: the mean executed batch size
    (inference_count / execution_count) and, for the largest batch size executed, the
    worker's compute_infer time per row (batch_stats compute_infer ns / count / batch size;
    compute_infer is the worker's own onnxruntime run, without the input/output copies),
    and the same over all batch sizes (all compute_infer ns / all rows); "n/a" where the
    endpoint does not answer. The mean batch is also computed from the Prometheus counters
    (nv_inference_count / nv_inference_exec_count) as a cross-check;
  * then 200 (40 with --quick) sequential batch-64 requests (tritonclient.http, binary data)
    to mlp_off_x1, so that every execution is exactly 64 rows: the worker's compute_infer per
    row at batch 64 without depending on how the batcher groups batch-1 requests (at
    concurrency 64 it rarely, if ever, finds all 64 queued at once), in 4 rounds with as
    many in-process onnxruntime batch-64 runs between them (the worker idle meanwhile):
    the batch-64 target compares the two, taken in the same minutes;
  * in-process onnxruntime on the same model file with the same thread count (2) at batch
    sizes 1, 8 and 64 (and at any other "largest batch" seen), run while the server is not
    running: time per batch and per row, the ceiling. The ratio table divides the worker's
    compute_infer per row by the in-process time per row at the same batch size (issue
    target at batch 64, from the batch-64 requests: within 1.3x). With 2 instances the two
    workers' 2+2 intra-op threads share the 2 cores, so their per-row compute time is
    expected to be higher;
  * CPU taken by other processes during each run (from /proc; runs are flagged
    **contended** above 20% of a core); before each step it waits up to --quiet-wait s
    for the machine to go idle (0 with --quick unless given);
  * draws --plot (default docs/batching.png): throughput and p99 latency vs concurrency,
    one line per configuration, log-x (log-y for latency); the throughput panel also gives
    the in-process rows/s at batch 1, 8 and 64 as text.

Needs `wrk` on PATH (apt-get install wrk) and matplotlib (pip install -e '.[bench]').

Code: this file (arguments, the run, the printed report), batching_runs.py (configurations,
repository, server checks, statistics, batch-64 probe, in-process timing), batching_plot.py
(tables and plot), with bench_server.py (model config text, `trireme serve`, counters, /proc
CPU accounting) and bench_load.py (onnxruntime ceiling, wrk runner) from this folder.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching_plot import fmt, load_table, ort_table, plot, ratio_rows, ratio_table
from batching_runs import (
    CONFIGS,
    ORT_BATCHES,
    PROBE_BATCH,
    TARGET_RATIO,
    THREADS,
    WIDTH,
    Run,
    build_repository,
    check_answer,
    check_config,
    get_stats,
    measure_ort,
    probe_batch,
    stats_delta,
    stats_summary,
)
from bench_load import expected, run_wrk
from bench_server import MAX_BATCH, ROOT, Server, log, machine_info, wait_quiet


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 s load runs, 1 s warm-ups")
    ap.add_argument("--duration", type=int, default=None, help="seconds per load run (8)")
    ap.add_argument("--concurrency", default="1,8,64", help="wrk connections, comma-separated")
    ap.add_argument("--queue-delay-us", type=int, default=0,
                    help="max_queue_delay_microseconds of the batching configurations (0)")
    ap.add_argument("--frontends", type=int, default=1, help="trireme serve --frontends")
    ap.add_argument("--threads", type=int, default=None,
                    help=f"intra_op_thread_count of every MLP copy ({THREADS})")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "batching.png",
                    help="PNG to write (default docs/batching.png)")
    ap.add_argument("--no-plot", action="store_true", help="write no PNG")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="before each measurement wait up to this many seconds for other "
                         "processes to stop using the CPU (4x this in all; default 20, "
                         "0 with --quick)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()
    threads = args.threads or THREADS

    duration = args.duration or (3 if args.quick else 8)
    warmup = 1.0 if args.quick else 2.0
    conc = [int(c) for c in args.concurrency.split(",")]
    quiet_wait = args.quiet_wait if args.quiet_wait is not None else (0 if args.quick else 20)
    if shutil.which("wrk") is None:
        print("wrk not on PATH (apt-get install wrk)", file=sys.stderr)
        return 2

    info = machine_info(args.frontends)
    hdr = ["# Trireme dynamic-batching benchmark", "",
           f"command: `{' '.join(['python benchmarks/batching.py', *sys.argv[1:]])}`",
           "", "| machine | |", "|---|---|"]
    hdr += [f"| {k} | {v} |" for k, v in info.items()]
    print("\n".join(hdr) + "\n", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="trireme-batching-"))
    wait_budget = [quiet_wait * 4]
    busy: list[float] = []

    def quiet() -> None:
        if quiet_wait > 0 and wait_budget[0] > 0:
            t = time.monotonic()
            busy.append(wait_quiet(min(quiet_wait, wait_budget[0])))
            wait_budget[0] -= time.monotonic() - t

    t_start = time.monotonic()
    runs: list[Run] = []
    ort: dict[int, dict] = {}
    srv = None
    stats_seen = False
    probe = None
    try:
        repo, texts = build_repository(tmp, args.queue_delay_us, threads)
        mfile = repo / CONFIGS[0].name / "1" / "model.onnx"
        x = np.random.default_rng(1).random((1, WIDTH), dtype=np.float32)
        want = expected("mlp", x, mfile)

        for bs in ORT_BATCHES:
            quiet()
            log(f"in-process onnxruntime, batch {bs}, intra_op {threads}")
            ort[bs] = measure_ort(mfile, bs, args.quick, threads)

        srv = Server(repo, args.frontends, tmp / "server.log")
        log(f"starting: {' '.join(srv.cmd)}")
        t0 = time.monotonic()
        srv.start()
        log(f"ready after {time.monotonic() - t0:.1f} s; processes: {srv.processes()}")
        for c in CONFIGS:
            check_config(srv, c)
            check_answer(srv, c.name, x, want)
        if get_stats(srv, CONFIGS[0].name) is None:
            log("GET /v2/models/<m>/stats does not answer: stats columns will read n/a")

        for c in CONFIGS:
            for n in conc:
                quiet()
                th = min(2, n)
                log(f"{c.name}: wrk -t{th} -c{n} -d{duration}s")
                r = run_wrk(srv, c.name, x, tmp, duration, conns=n, threads=th,
                            warmup_s=warmup, snapshot=lambda m=c.name: get_stats(srv, m))
                d = r["server"]
                okc = d.get("nv_inference_request_success", 0.0)
                bad = d.get("nv_inference_request_failure", 0.0)
                errs = (max(r["non2xx"], r["non2xx_line"]) + r["connect"] + r["read"]
                        + r["write"] + r["timeout"])
                ex = d.get("nv_inference_exec_count", 0.0)
                st = stats_delta(*r["snapshot"])
                stats_seen |= st is not None
                run = Run(c.name, c.label, n, th, r["rps"], r["p50_us"] / 1e3,
                          r["p99_us"] / 1e3, r["requests"], errs, okc, bad,
                          r["requests"] <= okc <= r["requests"] + 2 * n,
                          d.get("nv_inference_count", 0.0) / ex if ex else None, st,
                          r["cpu_pct"].get("machine", {}).get("other", 0.0),
                          {k: v for k, v in r.items() if k not in ("raw", "snapshot")})
                runs.append(run)
                s = stats_summary(st)
                log(f"  {run.throughput:,.0f} infer/s, p50 {run.p50_ms:.2f} ms, p99 "
                    f"{run.p99_ms:.2f} ms, errors {errs}+{bad:.0f}, mean batch "
                    f"{fmt(s.get('mean_batch'), '.2f')} (metrics "
                    f"{fmt(run.metrics_mean_batch, '.2f')})")
                if srv.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {srv.proc.returncode}")

        quiet()
        n_probe = 40 if args.quick else 200
        log(f"{CONFIGS[0].name}: {n_probe} sequential batch-{PROBE_BATCH} requests")
        probe = probe_batch(srv, CONFIGS[0].name, PROBE_BATCH, n_probe, mfile,
                            threads=threads)
    except BaseException:
        if srv is not None:
            log("server log tail:\n" + srv.tail())
        raise
    finally:
        if srv is not None:
            t0 = time.monotonic()
            srv.stop()
            log(f"server stopped (exit code {srv.proc.returncode if srv.proc else None}, "
                f"{time.monotonic() - t0:.1f} s)")
            if args.keep:
                log(f"kept {tmp}")

    try:
        # The in-process time at every other "largest batch" the workers executed.
        extra = sorted({stats_summary(r.stats).get("largest") for r in runs} - set(ort) - {None})
        for bs in extra:
            quiet()
            log(f"in-process onnxruntime, batch {bs} (a largest batch seen in a run)")
            ort[bs] = measure_ort(mfile, bs, True, threads)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    ratios = ratio_rows(runs, ort)
    db = (f"dynamic_batching {{ max_queue_delay_microseconds: {args.queue_delay_us} }}"
          if args.queue_delay_us else "dynamic_batching { }")
    print("## Load runs (HTTP, wrk, JSON body, batch-1 requests)\n")
    print(load_table(runs))
    print(f"\n(one server, four models; batching on = `{db}`, preferred_batch_size "
          f"[{MAX_BATCH}] by default; max_batch_size {MAX_BATCH}; intra_op_thread_count "
          f"{threads}; {duration} s per run after a {warmup:g} s warm-up. Errors: wrk non-2xx "
          "+ socket errors + the scheduler's failure counter. Stats columns: the difference of "
          "GET /v2/models/<m>/stats around the measured run"
          + ("" if stats_seen else "; the endpoint did not answer (n/a)") + ".)\n")
    print(f"## In-process onnxruntime (intra_op {threads}, same model file; server stopped)\n")
    print(ort_table(ort))
    print("\n## Worker compute_infer per row vs in-process, at the largest batch of each run\n")
    if probe:
        base = probe["inprocess_us_per_row"]   # measured between the probe's rounds
        probe["ratio"] = probe["worker_us_per_row"] / base
        ratios.insert(0, {"model": probe["model"], "concurrency": 1, "batch": PROBE_BATCH,
                          "executions": probe["executions"],
                          "label": f"{CONFIGS[0].label}: direct batch-{PROBE_BATCH} requests",
                          "worker_us_per_row": probe["worker_us_per_row"],
                          "inprocess_us_per_row": base, "ratio": probe["ratio"]})
    if ratios:
        print(ratio_table(ratios))
        if probe and "ratio" in probe:
            print(f"\nbatch {PROBE_BATCH}, issue target: worker compute_infer "
                  f"{probe['worker_us_per_row']:.1f} µs/row (from {probe['executions']} "
                  f"sequential batch-{PROBE_BATCH} requests to {probe['model']}; client "
                  f"{probe['client_ms_per_request']:.2f} ms per request) / in-process "
                  f"{probe['inprocess_us_per_row']:.1f} µs/row (run between the requests) = "
                  f"{probe['ratio']:.2f}× "
                  f"(target ≤ {TARGET_RATIO}×: "
                  f"{'met' if probe['ratio'] <= TARGET_RATIO else '**MISSED**'})")
        print("\n(rows from load runs use the largest batch each run executed, often only a "
              "few times: see the executions column)")
    else:
        print("n/a (no statistics: GET /v2/models/<m>/stats did not answer)")
    bad = [r for r in runs if not r.ok]
    print(f"\n(total {time.monotonic() - t_start:.0f} s; "
          + (f"**{len(bad)} run(s) with errors or count mismatches**" if bad else
             "0 errors in every run") + ")\n")

    if not args.no_plot:
        title = (f"Trireme, 3x1024 MLP (intra_op {threads}), HTTP JSON batch-1, wrk; "
                 f"{info['nproc']} CPUs; {duration} s per point; batching on = {db}")
        plot(runs, ort, conc, args.plot, title)
        log(f"wrote {args.plot}")
    if args.json:
        results = {"machine": info, "args": vars(args) | {"json": str(args.json),
                                                           "plot": str(args.plot)},
                   "duration_s": duration, "warmup_s": warmup, "configs": texts,
                   "runs": [asdict(r) | {"ok": r.ok, "stats_summary": stats_summary(r.stats)}
                            for r in runs],
                   "inprocess": {str(k): v for k, v in sorted(ort.items())},
                   "probe": probe, "ratios": ratios, "busy_before": busy}
        args.json.write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
