#!/usr/bin/env python
"""Soak: as many requests as the time allows at concurrency 64, then what was left behind.

    python benchmarks/soak.py [--minutes 10] [--window 60] [--frontends 2] [--json out.json]

One `trireme serve` (tiny and identity models, as serving.py builds them) under windows of
load that alternate: HTTP JSON on `tiny` (wrk -c64), gRPC on `tiny` (h2load -c64), and
4 MiB FP32 through `identity` over gRPC (4 clients; tensors through shared memory). After
each window it samples every server process: RSS, open fds, threads; and /dev/shm segments
named trireme-*. The table reports, per process, the values after the first cycle of the
three kinds of load (warm) and at the end, and the growth between them; and the requests served, failed (the
scheduler's own counters) and errors seen by the load generators.

What "no leak" means here: after the warm-up window, RSS grows by less than a few MiB per
process over the whole run, fds and /dev/shm segments do not grow, and 0 requests fail.
Needs wrk and h2load (apt-get install wrk nghttp2-client). Not a test: the figures go in
docs/benchmarks.md with the command.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import expected, grpc_big_round_trip, run_h2load, run_wrk
from bench_server import Server, build_repository, log, machine_info

BIG = 4 * 1024 * 1024


def shm_segments() -> tuple[int, int]:
    """(count, bytes) of Trireme's segments in /dev/shm."""
    n = size = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith("trireme-"):
            try:
                size += os.stat(f"/dev/shm/{name}").st_size
                n += 1
            except OSError:
                pass
    return n, size


def sample(srv: Server) -> dict:
    out: dict = {}
    for label, pid in srv.processes().items():
        try:
            p = psutil.Process(pid)
            out[label] = {"rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads()}
        except psutil.Error:
            out[label] = None   # gone: reported as such
    out["/dev/shm"] = dict(zip(("segments", "bytes"), shm_segments()))
    return out


def run(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="trireme-soak-"))
    repo = build_repository(tmp, ["tiny", "identity"])
    srv = Server(repo, args.frontends, tmp / "server.log")
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    want = expected("tiny", x, repo / "tiny" / "1" / "model.onnx")
    before_shm = shm_segments()
    srv.start()
    samples: list[dict] = [sample(srv)]
    totals = {"http": 0, "grpc": 0, "client_errors": 0}
    deadline = time.monotonic() + args.minutes * 60
    kinds = ("http", "grpc", "big")
    i = 0
    try:
        while time.monotonic() < deadline:
            kind = kinds[i % 3]
            left = max(5, min(args.window, int(deadline - time.monotonic())))
            if kind == "http":
                r = run_wrk(srv, "tiny", x, tmp, left, warmup_s=0)
                totals["http"] += r["requests"]
                totals["client_errors"] += sum(r[k] for k in ("non2xx", "connect", "read",
                                                              "write", "timeout"))
            elif kind == "grpc":
                r = run_h2load(srv, "tiny", x, want, tmp, left)
                totals["grpc"] += r["succeeded"]
                totals["client_errors"] += r["failed"] + r["errored"] + r["non2xx"]
            else:
                stop_at = time.monotonic() + left
                grpc_big_round_trip(srv, srv.grpc, BIG, 4, 0, 1,   # raises on a wrong answer
                                    until=lambda: time.monotonic() > stop_at)
            samples.append(sample(srv))
            log(f"window {i} ({kind}, {left} s) done; frontend RSS "
                f"{(samples[-1].get('frontend') or {}).get('rss', 0) / 2**20:.1f} MiB")
            i += 1
        counters = srv.counters("tiny")
        big = srv.counters("identity")
    finally:
        srv.stop()
    after_shm = shm_segments()
    return {"machine": machine_info(args.frontends), "args": vars(args), "samples": samples,
            "totals": totals, "tiny": counters, "identity": big,
            "shm_before": before_shm, "shm_after_stop": after_shm, "windows": i}


def table(res: dict) -> str:
    # warm: after the first cycle of the three kinds of load (every arena and cache exists)
    warm, end = res["samples"][min(3, len(res["samples"]) - 1)], res["samples"][-1]
    mid = res["samples"][len(res["samples"]) // 2]   # the second half: every path long in use
    rows = ["| process | RSS warm MiB | RSS end MiB | growth MiB | growth, second half MiB | "
            "fds warm → end | threads warm → end |",
            "|---|---:|---:|---:|---:|---|---|"]
    for label, w in warm.items():
        if label == "/dev/shm":
            continue
        e = end.get(label)
        if w is None or e is None:
            rows.append(f"| {label} | — | — | — | process gone | |")
            continue
        m = mid.get(label) or w
        rows.append(f"| {label} | {w['rss'] / 2**20:.1f} | {e['rss'] / 2**20:.1f} | "
                    f"{(e['rss'] - w['rss']) / 2**20:+.1f} | {(e['rss'] - m['rss']) / 2**20:+.1f} | "
                    f"{w['fds']} → {e['fds']} | {w['threads']} → {e['threads']} |")
    ws, es = warm["/dev/shm"], end["/dev/shm"]
    ms = mid["/dev/shm"]
    rows.append(f"| /dev/shm trireme-* | {ws['bytes'] / 2**20:.1f} | {es['bytes'] / 2**20:.1f} | "
                f"{(es['bytes'] - ws['bytes']) / 2**20:+.1f} | "
                f"{(es['bytes'] - ms['bytes']) / 2**20:+.1f} | {ws['segments']} → "
                f"{es['segments']} segments | |")
    t, c, b = res["totals"], res["tiny"], res["identity"]
    ok = c.get("nv_inference_request_success", 0) + b.get("nv_inference_request_success", 0)
    failed = c.get("nv_inference_request_failure", 0) + b.get("nv_inference_request_failure", 0)
    rows += ["", f"{res['windows']} windows; server counted {ok:,.0f} successful and "
             f"{failed:,.0f} failed requests ({c.get('nv_inference_request_cancelled', 0):,.0f} "
             "cancelled because a load generator stopped with them in flight); load generators: "
             f"HTTP {t['http']:,}, gRPC {t['grpc']:,} ok, {t['client_errors']} errors; 4 MiB "
             f"round trips {b.get('nv_inference_request_success', 0):,.0f}. "
             f"/dev/shm after stop: {res['shm_after_stop'][0]} segments "
             f"(before start: {res['shm_before'][0]})."]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--window", type=int, default=60, help="seconds per load window")
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run(args)
    print(f"# Trireme soak\n\ncommand: `python benchmarks/soak.py --minutes {args.minutes:g} "
          f"--window {args.window} --frontends {args.frontends}`\n")
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
