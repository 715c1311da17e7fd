#!/usr/bin/env python
"""The response cache: a hit against a miss and against the same model uncached, side by
side in one run.

    python benchmarks/cache.py [--duration S] [--repeats 3]

One temp repository: Triton's add_sub (`add_sub`, FP32 [16], one KIND_CPU instance), the
same model with `response_cache { enable: true }` (`add_sub_cached`), and add_sub that
computes for 2 ms first (`slow_cached`, time.sleep: a model whose execution is worth
caching), served by one `trireme serve --cache-config local,size=64MiB`. Each row runs
`--repeats` times, alternating, and reports the median:

  c1 gRPC p50 (tritonclient.grpc, sequential): the uncached model; the cached model with
      new inputs on every request (each a miss: lookup, execution, insertion); the cached
      model with one input (each a hit after the first); the same two for slow_cached
  c16 gRPC throughput (h2load -c16 -m1, one pre-encoded request): the uncached model; the
      cached model (hits)

The peer column is empty on purpose: the Triton 2.51 build on these machines has no cache
library ("unable to find 'libtritoncache_local.so' for cache"), so it cannot serve a cache.
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, free_port, log, machine_info, wait_quiet
from vs_triton_models import WIDTH, _python_config, _write
from vs_triton_runs import h2load_run

from tests.models_python import ADD_SUB

CACHE_BYTES = 64 << 20
_fresh = itertools.count(1)   # inputs never sent before, over every run (each a miss)


def build(root: Path) -> Path:
    repo = root / "models"
    w = str(WIDTH)
    cached = "response_cache { enable: true }\n"
    slow = ADD_SUB.replace("    def execute(self, requests):",
                           "    def execute(self, requests):\n        __import__('time').sleep(0.002)")
    assert slow != ADD_SUB
    for name, extra, source in (("add_sub", "", ADD_SUB), ("add_sub_cached", cached, ADD_SUB),
                                ("slow_cached", cached, slow)):
        _write(repo, name, _python_config(name, 0, {"INPUT0": w, "INPUT1": w},
                                          {"OUTPUT0": w, "OUTPUT1": w}, extra), source)
    return repo


def c1(srv: Server, model: str, seconds: float, vary: bool) -> float:
    """p50 ms of sequential requests; ``vary``: new inputs every request."""
    import tritonclient.grpc as tc
    c = tc.InferenceServerClient(srv.grpc)
    try:
        a = np.random.default_rng(1).random(WIDTH, dtype=np.float32)
        b = np.ones(WIDTH, np.float32)
        ins = [tc.InferInput("INPUT0", [WIDTH], "FP32"), tc.InferInput("INPUT1", [WIDTH], "FP32")]
        ins[1].set_data_from_numpy(b)
        lat: list[int] = []
        i = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            i = next(_fresh) if vary else i + 1
            ins[0].set_data_from_numpy(a + i if vary else a)
            t = time.perf_counter_ns()
            r = c.infer(model, ins)
            lat.append(time.perf_counter_ns() - t)
            if len(lat) == 1:
                np.testing.assert_allclose(r.as_numpy("OUTPUT0"), (a + i if vary else a) + b)
    finally:
        c.close()
    return statistics.median(lat[len(lat) // 10:]) / 1e6


def start_redis() -> tuple[subprocess.Popen, int] | None:
    """A redis-server of this run's own on a free port, and the port (None: not installed)."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                         text=True).stdout.strip() != "PONG":
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not answer")
        time.sleep(0.05)
    return proc, port


def rows(srv: Server, x: dict, want: np.ndarray, tmp: Path, seconds: float) -> dict:
    """label -> a measurement of ``srv``."""
    return {
        "c1 p50 ms, uncached": lambda: c1(srv, "add_sub", seconds, False),
        "c1 p50 ms, cached model, every request a miss": lambda: c1(srv, "add_sub_cached", seconds, True),
        "c1 p50 ms, cached model, hits": lambda: c1(srv, "add_sub_cached", seconds, False),
        "c1 p50 ms, 2 ms model, every request a miss": lambda: c1(srv, "slow_cached", seconds, True),
        "c1 p50 ms, 2 ms model, hits": lambda: c1(srv, "slow_cached", seconds, False),
        "c16 req/s, uncached": lambda: h2load_run(srv, "add_sub", x, want, tmp, int(seconds), 16).value,
        "c16 req/s, cached model, hits": lambda: h2load_run(
            srv, "add_sub_cached", x, want, tmp, int(seconds), 16).value,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="trireme-cache-"))
    repo = build(tmp)
    redis = start_redis()
    servers = {"local": Server(repo, 1, tmp / "local.log",
                               extra=["--cache-config", f"local,size={CACHE_BYTES}"])}
    if redis is not None:
        servers["Redis"] = Server(repo, 1, tmp / "redis.log", extra=[
            "--cache-config", "redis,host=127.0.0.1", "--cache-config",
            f"redis,port={redis[1]}", "--cache-config", "redis,pool_size=8"])
    a = np.random.default_rng(1).random(WIDTH, dtype=np.float32)
    x = {"INPUT0": a, "INPUT1": np.ones(WIDTH, np.float32)}
    runs: dict[str, dict[str, list[float]]] = {}
    try:
        for srv in servers.values():
            srv.start()
        wait_quiet(60)
        for _ in range(args.repeats):
            for name, srv in servers.items():
                for label, fn in rows(srv, x, a + 1, tmp, args.duration).items():
                    runs.setdefault(label, {}).setdefault(name, []).append(fn())
                    log(f"{name}: {label}: {runs[label][name][-1]:.3f}")
    finally:
        for srv in servers.values():
            srv.stop()
        if redis is not None:
            redis[0].kill()
    med = {k: {n: statistics.median(v) for n, v in byname.items()} for k, byname in runs.items()}
    print("\n" + "\n".join(f"- {k}: {v}" for k, v in machine_info(1).items()) + "\n")
    names = list(servers)
    print("| measure | " + " | ".join(f"{n} cache (median; runs)" for n in names) + " | Triton 2.51 |")
    print("|---|" + "---:|" * len(names) + "---|")
    for k in runs:
        cells = [f"{med[k][n]:,.3f} ({', '.join(f'{r:,.3f}' for r in runs[k][n])})" for n in names]
        print(f"| {k} | " + " | ".join(cells) + " | no cache library |")
    for n in names:
        hit = med["c1 p50 ms, cached model, hits"][n]
        miss = med["c1 p50 ms, cached model, every request a miss"][n]
        slow = med["c1 p50 ms, 2 ms model, hits"][n] / med["c1 p50 ms, 2 ms model, every request a miss"][n]
        c16 = med["c16 req/s, cached model, hits"][n] / med["c16 req/s, uncached"][n]
        print(f"\n{n}: hit / miss latency {hit / miss:.2f} (2 ms model: {slow:.2f}); c16 hits / "
              f"uncached throughput {c16:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
