"""Dynamic-batching benchmark (see batching.py): the configurations and the measurement steps.

Builds the four-model repository, checks what the server runs and answers, reads and
differences the statistics extension, sends the direct batch-64 requests and times
in-process onnxruntime.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import http_json_body, ort_ceiling
from bench_server import MAX_BATCH, MODEL_THREADS, Server, model_config, models

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

def build_repository(root: Path, queue_delay_us: int,
                     threads: int = THREADS) -> tuple[Path, dict[str, str]]:
    repo = root / "models"
    first = repo / CONFIGS[0].name
    models.mlp(first, width=WIDTH, layers=3)
    texts = {}
    db = f"max_queue_delay_microseconds: {queue_delay_us}" if queue_delay_us else ""
    for c in CONFIGS:
        d = repo / c.name
        if d != first:
            shutil.copytree(first / "1", d / "1")
        texts[c.name] = model_config(c.name, threads, c.instances,
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



# --------------------------------------------------------------------------- measurements

def probe_batch(srv: Server, model: str, bs: int, n: int, mfile: Path,
                rounds: int = 4, threads: int = THREADS) -> dict | None:
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
    opts.intra_op_num_threads = threads
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


def measure_ort(mfile: Path, bs: int, quick: bool, threads: int = THREADS) -> dict:
    n = {1: 2000, 8: 1000}.get(bs, 200 if bs >= 32 else 500)
    if quick:
        n = max(50, n // 5)
    p50, p99, rows_s = ort_ceiling(mfile, threads, bs, n, WIDTH)
    return {"batch": bs, "calls": n, "p50_ms": p50, "p99_ms": p99, "rows_per_s": rows_s,
            "ms_per_batch": bs / rows_s * 1e3, "us_per_row": 1e6 / rows_s}

