#!/usr/bin/env python
"""Soak: as many requests as the time allows at concurrency 64, then what was left behind.

    python benchmarks/soak.py [--minutes 10] [--window 60] [--frontends 2]
                              [--cancel-fraction 0.5] [--json out.json]

One `trireme serve` (tiny and identity models, as serving.py builds them) under windows of
load that alternate: HTTP JSON on `tiny` (wrk -c64), gRPC on `tiny` (h2load -c64), 4 MiB
FP32 through `identity` over gRPC (4 clients; tensors through shared memory), and the same
4 MiB calls from clients that give up: a fraction of them (--cancel-fraction) with a
deadline shorter than the service time (5 ms), the others checked for exact answers. After
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
SHORT_DEADLINE_S = 0.005      # shorter than a 4 MiB identity round trip here (about 15 ms)


def cancelling_mix(url: str, seconds: float, fraction: float, clients: int = 4) -> dict:
    """4 MiB identity calls from ``clients`` threads until ``seconds`` pass; each call has
    the short deadline with probability ``fraction``. Counts what each kind ended with;
    a wrong answer to a call that was not cancelled raises."""
    import threading

    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    counts = {"ok": 0, "deadline_exceeded": 0, "other_errors": 0}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    errors: list[BaseException] = []

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        c = tc.InferenceServerClient(url)
        x = rng.random((1, BIG // 4), dtype=np.float32)
        inp = tc.InferInput("INPUT0", [1, BIG // 4], "FP32")
        inp.set_data_from_numpy(x)
        try:
            while time.monotonic() < stop_at:
                short = rng.random() < fraction
                try:
                    got = c.infer("identity", [inp],
                                  client_timeout=SHORT_DEADLINE_S if short else 30.0)
                except InferenceServerException as e:
                    kind = ("deadline_exceeded" if e.status() == "StatusCode.DEADLINE_EXCEEDED"
                            else "other_errors")
                    with lock:
                        counts[kind] += 1
                    continue
                if not np.array_equal(got.as_numpy("OUTPUT0"), x):
                    raise AssertionError("identity round trip changed the tensor")
                with lock:
                    counts["ok"] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return counts


SETTLE_S = 40.0     # idle after the load: arenas give back segments idle for 10 s, ticking every 5 s


def shm_segments(pids: set[int] | None = None) -> tuple[int, int]:
    """(count, bytes) of Trireme's segments in /dev/shm (of the processes ``pids`` only:
    another server on the machine does not count)."""
    n = size = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith("trireme-") and (
                pids is None or int(name.split("-")[1]) in pids):
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
    pids = set(srv.processes().values())
    out["/dev/shm"] = dict(zip(("segments", "bytes"), shm_segments(pids)))
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
    family: set[int] = set()
    totals = {"http": 0, "grpc": 0, "client_errors": 0, "cancel_ok": 0,
              "cancel_deadline_exceeded": 0, "cancel_other_errors": 0}
    deadline = time.monotonic() + args.minutes * 60
    kinds = ("http", "grpc", "big", "cancel")
    i = 0
    try:
        while time.monotonic() < deadline:
            kind = kinds[i % len(kinds)]
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
            elif kind == "big":
                stop_at = time.monotonic() + left
                grpc_big_round_trip(srv, srv.grpc, BIG, 4, 0, 1,   # raises on a wrong answer
                                    until=lambda: time.monotonic() > stop_at)
            else:
                for k, v in cancelling_mix(srv.grpc, left, args.cancel_fraction).items():
                    totals[f"cancel_{k}"] += v
            samples.append(sample(srv))
            log(f"window {i} ({kind}, {left} s) done; frontend RSS "
                f"{(samples[-1].get('frontend') or {}).get('rss', 0) / 2**20:.1f} MiB")
            i += 1
        counters = srv.counters("tiny")
        big = srv.counters("identity")
        # Then idle: what the load left behind once the server has had time to give it back.
        warm_segments = samples[min(4, len(samples) - 1)]["/dev/shm"]["segments"]
        settle = time.monotonic() + SETTLE_S
        while time.monotonic() < settle and sample(srv)["/dev/shm"]["segments"] > warm_segments:
            time.sleep(1)
        samples.append(sample(srv))
        family = set(srv.processes().values())
    finally:
        srv.stop()
    after_shm = shm_segments(family)
    return {"machine": machine_info(args.frontends), "args": vars(args), "samples": samples,
            "totals": totals, "tiny": counters, "identity": big,
            "shm_before": before_shm, "shm_after_stop": after_shm, "windows": i}


def table(res: dict) -> str:
    # warm: after the first cycle of the four kinds of load (every arena and cache exists)
    warm, end = res["samples"][min(4, len(res["samples"]) - 1)], res["samples"][-1]
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
             f"round trips {b.get('nv_inference_request_success', 0):,.0f}; clients that give up "
             f"(--cancel-fraction {res['args']['cancel_fraction']:g}): {t['cancel_ok']:,} "
             f"exact answers, {t['cancel_deadline_exceeded']:,} deadlines exceeded, "
             f"{t['cancel_other_errors']} other errors. "
             f"/dev/shm after stop: {res['shm_after_stop'][0]} segments "
             f"(before start: {res['shm_before'][0]}). \"End\" is after the load, once the "
             f"server's segments were back to the warm count or {SETTLE_S:g} s passed."]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--window", type=int, default=60, help="seconds per load window")
    ap.add_argument("--frontends", type=int, default=2)
    ap.add_argument("--cancel-fraction", type=float, default=0.5,
                    help="share of the cancelling window's calls whose deadline is 5 ms")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = run(args)
    print(f"# Trireme soak\n\ncommand: `python benchmarks/soak.py --minutes {args.minutes:g} "
          f"--window {args.window} --frontends {args.frontends} "
          f"--cancel-fraction {args.cancel_fraction:g}`\n")
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
