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

Code: this file, with bench_server.py (model config text, `trireme serve`, counters, /proc
CPU accounting) and bench_load.py (onnxruntime ceiling, wrk runner) from this folder.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import expected, http_json_body, ort_ceiling, run_wrk
from bench_server import (
    MAX_BATCH,
    MODEL_THREADS,
    ROOT,
    Server,
    log,
    machine_info,
    model_config,
    models,
    wait_quiet,
)

WIDTH = 1024
# Inputs and outputs written out: without them the server auto-completes the config with
# Triton's onnxruntime rules, which turn on `dynamic_batching { }` for any model with
# max_batch_size > 1 and no scheduler, and the "off" configurations would batch too.
IO = (f'input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [ {WIDTH} ] }}]\n'
      f'output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ {WIDTH} ] }}]\n')
THREADS = MODEL_THREADS["mlp"]          # intra_op_thread_count 2
ORT_BATCHES = (1, 8, 64)
PROBE_BATCH = 64
TARGET_RATIO = 1.3                      # worker compute_infer per row / in-process, batch 64


@dataclass
class Config:
    name: str
    label: str
    instances: int
    batching: bool


CONFIGS = [Config("mlp_off_x1", "batching off, 1 instance", 1, False),
           Config("mlp_on_x1", "batching on, 1 instance", 1, True),
           Config("mlp_off_x2", "batching off, 2 instances", 2, False),
           Config("mlp_on_x2", "batching on, 2 instances", 2, True)]


@dataclass
class Run:
    model: str
    label: str
    concurrency: int
    wrk_threads: int
    throughput: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int                    # wrk non-2xx + socket errors
    server_ok: float               # nv_inference_request_success delta
    server_fail: float             # nv_inference_request_failure delta
    count_ok: bool                 # server_ok consistent with wrk's request count
    metrics_mean_batch: float | None
    stats: dict | None             # statistics-extension delta, None when unavailable
    other_cpu_pct: float
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.server_fail == 0 and self.count_ok


# --------------------------------------------------------------------------- repository

def build_repository(root: Path, queue_delay_us: int) -> tuple[Path, dict[str, str]]:
    repo = root / "models"
    first = repo / CONFIGS[0].name
    models.mlp(first, width=WIDTH, layers=3)
    texts = {}
    db = f"max_queue_delay_microseconds: {queue_delay_us}" if queue_delay_us else ""
    for c in CONFIGS:
        d = repo / c.name
        if d != first:
            shutil.copytree(first / "1", d / "1")
        texts[c.name] = model_config(c.name, THREADS, c.instances,
                                     db if c.batching else None, MAX_BATCH, IO)
        models.write_config(d, texts[c.name])
    return repo, texts


# --------------------------------------------------------------------------- server checks

def check_answer(srv: Server, model: str, x: np.ndarray, want: np.ndarray) -> None:
    """The exact JSON body wrk sends, once, checked against onnxruntime."""
    req = urllib.request.Request(f"http://{srv.http}/v2/models/{model}/infer",
                                 data=http_json_body(model, x).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.loads(r.read())["outputs"][0]
    got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise AssertionError(f"{model}: wrong output over HTTP")


def check_config(srv: Server, c: Config) -> None:
    """The configuration the server actually runs (after auto-complete) is the one meant."""
    with urllib.request.urlopen(f"http://{srv.http}/v2/models/{c.name}/config", timeout=10) as r:
        cfg = json.loads(r.read())
    has_db = "dynamic_batching" in cfg
    count = sum(int(g.get("count", 1)) for g in cfg.get("instance_group", []))
    if has_db != c.batching or count != c.instances:
        raise AssertionError(f"{c.name}: the server runs dynamic_batching={has_db}, "
                             f"{count} instance(s); expected {c.batching}, {c.instances}")


def get_stats(srv: Server, model: str) -> dict | None:
    """model_stats[0] of GET /v2/models/<model>/stats, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{srv.http}/v2/models/{model}/stats",
                                    timeout=5) as r:
            body = json.loads(r.read())
        return body["model_stats"][0]
    except (OSError, ValueError, KeyError, IndexError, urllib.error.HTTPError):
        return None


def stats_delta(a: dict | None, b: dict | None) -> dict | None:
    """What one load run added: execution/inference counts and, per executed batch size,
    [executions, compute_infer ns]."""
    if not a or not b:
        return None
    try:
        def batches(s: dict) -> dict[int, tuple[int, int]]:
            return {int(x["batch_size"]): (int(x["compute_infer"]["count"]),
                                           int(x["compute_infer"]["ns"]))
                    for x in s.get("batch_stats", [])}
        ba, bb = batches(a), batches(b)
        out = {}
        for bs, (cnt, ns) in bb.items():
            c0, n0 = ba.get(bs, (0, 0))
            if cnt - c0 > 0:
                out[bs] = [cnt - c0, ns - n0]
        return {"execution_count": int(b["execution_count"]) - int(a["execution_count"]),
                "inference_count": int(b["inference_count"]) - int(a["inference_count"]),
                "batches": dict(sorted(out.items()))}
    except (KeyError, TypeError, ValueError):
        return None


def stats_summary(s: dict | None) -> dict:
    """mean batch, largest batch, its executions and compute_infer µs per row."""
    if not s or not s["execution_count"]:
        return {}
    bs = max(s["batches"]) if s["batches"] else None
    out = {"mean_batch": s["inference_count"] / s["execution_count"]}
    rows = sum(b * cnt for b, (cnt, _) in s["batches"].items())
    if rows:
        out["us_per_row_all"] = sum(ns for _, ns in s["batches"].values()) / rows / 1e3
    if bs:
        cnt, ns = s["batches"][bs]
        out |= {"largest": bs, "largest_execs": cnt, "us_per_row": ns / cnt / bs / 1e3}
    return out


# --------------------------------------------------------------------------- tables

def fmt(v: float | None, spec: str = ",.3f", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def load_table(runs: list[Run]) -> str:
    out = ["| configuration | model | conc. | infer/s | p50 ms | p99 ms | errors | "
           "requests (wrk / server ok) | mean batch (stats) | mean batch (metrics) | "
           "largest batch (executions) | worker compute_infer µs/row @ largest | "
           "… all batches | notes |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        s = stats_summary(r.stats)
        notes = []
        if r.wrk_threads != 2:
            notes.append(f"wrk -t{r.wrk_threads}")
        if not r.count_ok:
            notes.append("**server success count does not match wrk**")
        if r.other_cpu_pct > 20:
            notes.append(f"**contended: other processes {r.other_cpu_pct:.0f}% of a core**")
        errs = (f"{r.errors + r.server_fail:.0f}" if r.ok or not r.count_ok else
                f"**{r.errors} client, {r.server_fail:.0f} server**")
        largest = (f"{s['largest']} ({s['largest_execs']:,})" if "largest" in s else "n/a")
        out.append(
            f"| {r.label} | {r.model} | {r.concurrency} | {r.throughput:,.0f} | "
            f"{r.p50_ms:.3f} | {r.p99_ms:.3f} | {errs} | {r.requests:,} / {r.server_ok:,.0f} | "
            f"{fmt(s.get('mean_batch'), '.2f')} | {fmt(r.metrics_mean_batch, '.2f')} | "
            f"{largest} | {fmt(s.get('us_per_row'), ',.1f')} | "
            f"{fmt(s.get('us_per_row_all'), ',.1f')} | {'; '.join(notes)} |")
    return "\n".join(out)


def ort_table(ort: dict[int, dict]) -> str:
    out = ["| batch | ms per batch (mean) | p50 ms | p99 ms | µs per row | rows/s |",
           "|---:|---:|---:|---:|---:|---:|"]
    for bs, o in sorted(ort.items()):
        out.append(f"| {bs} | {o['ms_per_batch']:.3f} | {o['p50_ms']:.3f} | {o['p99_ms']:.3f} | "
                   f"{o['us_per_row']:.1f} | {o['rows_per_s']:,.0f} |")
    return "\n".join(out)


def ratio_rows(runs: list[Run], ort: dict[int, dict]) -> list[dict]:
    rows = []
    for r in runs:
        s = stats_summary(r.stats)
        if "largest" not in s or s["largest"] not in ort:
            continue
        base = ort[s["largest"]]["us_per_row"]
        rows.append({"model": r.model, "label": r.label, "concurrency": r.concurrency,
                     "batch": s["largest"], "executions": s["largest_execs"],
                     "worker_us_per_row": s["us_per_row"], "inprocess_us_per_row": base,
                     "ratio": s["us_per_row"] / base})
    return rows


def ratio_table(rows: list[dict]) -> str:
    out = ["| configuration | conc. | batch size (largest) | executions | worker µs/row | "
           "in-process µs/row | ratio | target |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tgt = ""
        if r["batch"] == 64 and r["executions"] < 20:
            tgt = "(too few executions to judge)"
        elif r["batch"] == 64:
            tgt = f"≤ {TARGET_RATIO}×: " + ("yes" if r["ratio"] <= TARGET_RATIO else "**MISS**")
        out.append(f"| {r['label']} | {r['concurrency']} | {r['batch']} | {r['executions']:,} | "
                   f"{r['worker_us_per_row']:.1f} | {r['inprocess_us_per_row']:.1f} | "
                   f"{r['ratio']:.2f}× | {tgt} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- plot

def plot(runs: list[Run], ort: dict[int, dict], conc: list[int], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"mlp_off_x1": ("tab:blue", "--", "o"), "mlp_on_x1": ("tab:blue", "-", "s"),
              "mlp_off_x2": ("tab:orange", "--", "o"), "mlp_on_x2": ("tab:orange", "-", "s")}
    for c in CONFIGS:
        rs = sorted((r for r in runs if r.model == c.name), key=lambda r: r.concurrency)
        if not rs:
            continue
        color, ls, mk = styles[c.name]
        xs = [r.concurrency for r in rs]
        a1.plot(xs, [r.throughput for r in rs], color=color, ls=ls, marker=mk, label=c.label)
        a2.plot(xs, [r.p99_ms for r in rs], color=color, ls=ls, marker=mk, label=c.label)
    # The in-process ceiling as text: as lines they would flatten the measured ones.
    ceil = [f"batch {bs}: {ort[bs]['rows_per_s']:,.0f} rows/s" for bs in ORT_BATCHES if bs in ort]
    if ceil:
        a1.text(0.02, 0.98, "in-process onnxruntime (ceiling)\n" + "\n".join(ceil),
                transform=a1.transAxes, va="top", fontsize=8, color="dimgray")
    for ax, ylabel in ((a1, "throughput (infer/s)"), (a2, "p99 latency (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (wrk connections, batch-1 requests)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    a1.set_ylim(bottom=0)
    a2.set_yscale("log")
    a1.set_title("throughput")
    a2.set_title("p99 latency")
    a1.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main

def probe_batch(srv: Server, model: str, bs: int, n: int, mfile: Path,
                rounds: int = 4) -> dict | None:
    """n sequential requests of bs rows each (tritonclient.http, binary data) to a model
    without dynamic batching: every execution is exactly bs rows, so the statistics give the
    worker's compute_infer at that batch size without depending on how the batcher groups
    batch-1 requests. In-process onnxruntime (same file, same thread count) runs between
    the rounds of requests, n runs in all, while the worker is idle: on a machine whose
    speed drifts, the ratio then compares two figures taken in the same minutes."""
    import onnxruntime as ort
    import tritonclient.http as tc
    x = np.random.default_rng(2).random((bs, WIDTH), dtype=np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    sess = ort.InferenceSession(str(mfile), opts, providers=["CPUExecutionProvider"])
    feed = {"INPUT0": x}
    client = tc.InferenceServerClient(srv.http, network_timeout=60)
    inp = tc.InferInput("INPUT0", [bs, WIDTH], "FP32")
    inp.set_data_from_numpy(x)
    out = [tc.InferRequestedOutput("OUTPUT0")]
    per_round = max(1, n // rounds)
    cnt = ns = 0
    local_ns = 0
    wall = 0.0
    try:
        for _ in range(max(3, n // 10)):
            client.infer(model, [inp], outputs=out)
            sess.run(None, feed)
        for _ in range(rounds):
            a = get_stats(srv, model)
            t0 = time.perf_counter()
            for _ in range(per_round):
                client.infer(model, [inp], outputs=out)
            wall += time.perf_counter() - t0
            d = stats_delta(a, get_stats(srv, model))
            if not d or bs not in d["batches"]:
                return None
            cnt += d["batches"][bs][0]
            ns += d["batches"][bs][1]
            t1 = time.perf_counter_ns()
            for _ in range(per_round):
                sess.run(None, feed)
            local_ns += time.perf_counter_ns() - t1
    finally:
        client.close()
    return {"model": model, "batch": bs, "requests": per_round * rounds, "executions": cnt,
            "worker_us_per_row": ns / cnt / bs / 1e3,
            "inprocess_us_per_row": local_ns / (per_round * rounds) / bs / 1e3,
            "client_ms_per_request": wall / (per_round * rounds) * 1e3}


def measure_ort(mfile: Path, bs: int, quick: bool) -> dict:
    n = {1: 2000, 8: 1000}.get(bs, 200 if bs >= 32 else 500)
    if quick:
        n = max(50, n // 5)
    p50, p99, rows_s = ort_ceiling(mfile, THREADS, bs, n, WIDTH)
    return {"batch": bs, "calls": n, "p50_ms": p50, "p99_ms": p99, "rows_per_s": rows_s,
            "ms_per_batch": bs / rows_s * 1e3, "us_per_row": 1e6 / rows_s}


def main() -> int:
    global THREADS
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
    if args.threads:
        THREADS = args.threads

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
        repo, texts = build_repository(tmp, args.queue_delay_us)
        mfile = repo / CONFIGS[0].name / "1" / "model.onnx"
        x = np.random.default_rng(1).random((1, WIDTH), dtype=np.float32)
        want = expected("mlp", x, mfile)

        for bs in ORT_BATCHES:
            quiet()
            log(f"in-process onnxruntime, batch {bs}, intra_op {THREADS}")
            ort[bs] = measure_ort(mfile, bs, args.quick)

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
        probe = probe_batch(srv, CONFIGS[0].name, PROBE_BATCH, n_probe, mfile)
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
            ort[bs] = measure_ort(mfile, bs, True)
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
          f"{THREADS}; {duration} s per run after a {warmup:g} s warm-up. Errors: wrk non-2xx "
          "+ socket errors + the scheduler's failure counter. Stats columns: the difference of "
          "GET /v2/models/<m>/stats around the measured run"
          + ("" if stats_seen else "; the endpoint did not answer (n/a)") + ".)\n")
    print(f"## In-process onnxruntime (intra_op {THREADS}, same model file; server stopped)\n")
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
        title = (f"Trireme, 3x1024 MLP (intra_op {THREADS}), HTTP JSON batch-1, wrk; "
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
