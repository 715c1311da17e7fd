#!/usr/bin/env python
"""Life of a request, the remainder: py-spy on a live `trireme serve` at c1.

    python benchmarks/request_profile.py [--protos grpc,http] [--duration 20] [--rate 500]
                                         [--mode native|nonblocking] [--json out.json]
    python benchmarks/request_profile.py --from-json out.json      # the tables again

request_budget.py times each stage of one add_sub request in one process; the stages sum
to under half of the real server's CPU per request. This script samples the real server
instead: `trireme serve` on request_budget's repository (vs_triton_models), add_sub driven
at concurrency 1 with the official sync tritonclient (vs_triton_runs.c1_latency: its
/proc meter gives each process's CPU µs per request over the same run), while
`py-spy record --rate R --format raw` samples the frontend, the scheduler and the add_sub
worker at the same time.

--mode native (default): `--native --idle`: py-spy stops the process for each sample and
unwinds the C frames too (uvloop, libuv, libc syscalls). Every sample of every thread is
kept; a sample counts as idle when its leaf is a blocking wait (epoll_pwait under libuv's
poll, a blocking recv/read, a lock or condition wait), so the kernel CPU of a wait that
returns data (epoll_pwait's own work, the recv that copies the message) is counted idle.
--mode nonblocking: py-spy reads the process without stopping it and without C frames;
it drops the samples of threads the OS shows as not running, so idle = expected - kept.

Each busy sample goes to one category:
  (1) event loop: no frame of our code between the loop and the leaf (uvloop / libuv /
      asyncio machinery, callbacks dispatch, task steps), or a leaf in uvloop / libuv /
      asyncio called from our code (transport writes, call_soon, task creation);
  (2) syscall: the leaf is a libc system-call wrapper (write, writev, read, send, recv,
      poll(0), getpid, futex wake, ...): the kernel's work shows as that frame;
  (3) our Python, by the budget table's row: the innermost frame of ours that maps to a row
      (helpers shared by several rows, such as messages.encode, fall through to their
      caller); C code called from it (protobuf, msgspec, numpy, the interpreter's own
      functions) counts with it;
  (4) interpreter: GC (a gc_collect frame anywhere in the stack), and samples with no
      frame of ours and no event loop (imports, thread start-up, bare interpreter frames).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_server import ROOT, Server, log  # noqa: E402
from vs_triton_models import add_sub_inputs, build_repository  # noqa: E402

PROCS = ("frontend", "scheduler", "worker[add_sub]")

# ============================================================================ stage maps
# (file suffix, function-name regex, row label). The innermost frame of ours that matches
# names the row; a frame of ours that matches nothing (a shared helper) falls through.
FE_COMMON = [
    ("dataplane/validation.py", r".*", "4 validation"),
    ("dataplane/client.py", r"DataPlane\.(infer|_send_request|_place\w*|_input\w*)",
     "5 input placement + InferRequest (DataPlane.infer)"),
    ("dataplane/outbox.py", r".*", "6 InferRequest encode + framing (outbox)"),
    ("dataplane/client.py", r"DataPlane\.(_on_result|_on_message|_deliver)",
     "20 result receive + decode, future resolved"),
    ("common/transport_stream.py", r"(_PeerProtocol|_Assembler|Listener)\..*|_split",
     "20 result receive + decode, future resolved"),
    ("dataplane/client.py", r"DataPlane\._response", "21 CoreResponse from the frames"),
]
STAGES = {
    "grpc": [
        ("grpc/codec.py", r"decode_infer_request", "2 ModelInferRequest parse"),
        ("grpc/codec.py", r"request_from_proto|params_from_proto|_as_bytes_view|_check_shm\w*",
         "3 CoreRequest from the protobuf"),
        ("grpc/codec.py", r"encode_infer_response|_infer_response_parts\S*",
         "22 ModelInferResponse encode"),
        ("grpc/methods.py", r".*", "23 (its Python part) ModelInfer handler, _guard"),
        ("grpc/h2_receive.py", r".*", "1 HTTP/2 engine: receive, HPACK"),
        ("grpc/h2_frames.py", r".*", "1 HTTP/2 engine: receive, HPACK"),
        ("grpc/h2_guards.py", r".*", "1 HTTP/2 engine: receive, HPACK"),
        ("grpc/native.py", r".*", "1 HTTP/2 engine: call object, task, _send/_finish"),
        ("grpc/h2.py", r".*", "1 HTTP/2 engine: HEADERS/DATA/trailers, _flush"),
        ("hpack/", r".*", "1 HTTP/2 engine: receive, HPACK"),
        *FE_COMMON,
    ],
    "http": [
        ("http/codec.py", r"decode\w*|_decode\w*|_parse\w*|_inputs?\w*", "3 body decode"),
        ("http/codec.py", r"encode\w*|_encode\w*|_outputs?\w*", "22 response encode"),
        ("http/routes.py", r".*", "2 route + infer handler"),
        ("http/connection.py", r".*", "1 HTTP/1.1 engine (connection, httptools callbacks)"),
        ("http/engine.py", r".*", "1 HTTP/1.1 engine (connection, httptools callbacks)"),
        ("http/message.py", r".*", "1 HTTP/1.1 engine (connection, httptools callbacks)"),
        ("http/wire.py", r".*", "1 HTTP/1.1 engine (connection, httptools callbacks)"),
        ("http/json_body.py", r".*", "3 body decode"),
        ("http/params.py", r".*", "3 body decode"),
        *FE_COMMON,
    ],
    "scheduler": [
        ("scheduler/worker_side.py", r"Workers\.send_batch|Workers\.send",
         "8 request: dispatch, ExecuteBatch encode + write call"),
        ("scheduler/stats.py", r".*", "19 BatchDone: decode, statistics, idle, pump"),
        ("scheduler/dispatch.py", r"\w+\.batch_done", "19 BatchDone: decode, statistics, idle, pump"),
        ("scheduler/worker_side.py", r".*", "19 BatchDone: decode, statistics, idle, pump"),
        ("scheduler/dispatch.py", r".*", "8 request: decode, queue, dispatch"),
        ("scheduler/batcher.py", r".*", "8 request: decode, queue, dispatch"),
        ("scheduler/main.py", r"Scheduler\.(_on_frontend|_infer\w*|_submit\w*)",
         "8 request: decode, queue, dispatch"),
        ("scheduler/namespaces.py", r".*", "8 request: decode, queue, dispatch"),
        ("scheduler/entries.py", r".*", "8 request: decode, queue, dispatch"),
        ("common/transport_stream.py", r"(_PeerProtocol|_Assembler)\..*|_split",
         "8/19 receive framing (either message)"),
    ],
    "worker": [
        ("model.py", r"TritonPythonModel\.execute", "13 model execute() (with its pb_utils calls)"),
        ("workers/main.py", r"Worker\._array", "11 inputs as arrays"),
        ("workers/main.py", r"Worker\._add_result\S*|_to_wire", "14 output placement + InferResult"),
        ("workers/results.py", r".*", "15 result encode + framing"),
        ("workers/python/backend.py", r".*", "12 pb_utils request objects, cancel, sender"),
        ("workers/python/cancel.py", r".*", "12 pb_utils request objects, cancel, sender"),
        ("workers/main.py", r"Worker\.(execute|_run_requests|_handler_table\S*)",
         "16 Worker.execute around the stages, BatchDone encode"),
        ("workers/main.py", r"Worker\.run", "10 ExecuteBatch decode (Worker.run loop)"),
        ("common/transport_stream.py", r"BlockingConnection\.\w+|_split",
         "9/17/18 hops, Python side (BlockingConnection framing)"),
    ],
}

# Blocking waits: a sample whose leaf is one of these (with the stack's context) is idle.
_WAIT_LEAF = re.compile(r"^(epoll_wait|epoll_pwait2?|select|pselect6?|nanosleep|clock_nanosleep|"
                        r"pthread_cond_(timed)?wait|sem_(timed)?wait|accept4?|"
                        r"__futex_abstimed_wait\w*|futex_wait\w*) ")
_BLOCKING_CALL = re.compile(r"^(BlockingConnection\.recv|_exit_if_stuck_after_term\S*guard|"
                            r"lock_PyThread_acquire_lock|PyThread_acquire_lock_timed|"
                            r"Condition\.wait|Event\.wait|time_sleep|select_poll_poll) ")
_SYSCALL = re.compile(r"^(read|write|writev|readv|send|sendmsg|sendto|recv|recvmsg|recvfrom|"
                      r"poll|ppoll|epoll_ctl|getpid|futex|syscall|close|ioctl|fcntl|"
                      r"__libc_\w+|__send|__recv\w*|__write|__read|mmap|munmap|madvise|"
                      r"clock_gettime|gettimeofday|sched_yield) \(lib(c|pthread)")
_LOOP_FILE = re.compile(r"\((loop\.c|core\.c|linux\.c|stream\.c|poll\.c|loop-watcher\.c|"
                        r"uv-common\.c|queue\.h|handle\.c|_asynciomodule\.c|"
                        r"asyncio/\w+\.py|uvloop/)")
_LOOP_ROOT = re.compile(r"^(uv_run|Loop__run|run_forever|_run_once) ")
_GC = re.compile(r"^(gc_collect\w*|collect_generation\w*|_PyGC_Collect|gc_collect_main|"
                 r"deduce_unreachable|move_unreachable|subtract_refs|visit_\w+|"
                 r"_PyObject_GC_Link|gc_collect_with_callback|collect) ")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _ours(frame: str) -> tuple[str, str] | None:
    """(file relative to the repository, function) for a frame of our code, else None."""
    m = _FRAME.match(frame)
    if not m:
        return None
    f = m.group("file")
    if "services/" in f:
        return "services/" + f.split("services/", 1)[1], m.group("func")
    if f.endswith("/model.py") or f == "model.py":
        return "model.py", m.group("func")
    return None


def _stage(frames: list[str], rules: list) -> str | None:
    """The row of the innermost frame of ours that a rule matches; '? func (file)' if none.
    Frames at or above the event loop's run (main(), cli.py's serve) are not counted."""
    roots = [i for i, f in enumerate(frames) if _LOOP_ROOT.match(f)]
    first = None
    for fr in reversed(frames[roots[-1] + 1:] if roots else frames):
        o = _ours(fr)
        if o is None:
            continue
        first = first or o
        for suffix, pat, label in rules:
            if o[0].endswith(suffix) and re.fullmatch(pat, o[1]):
                return label
    if first is None:
        return None
    return f"? {first[1]} ({first[0]})"


def classify(frames: list[str], rules: list) -> tuple[str, str]:
    """(category, detail) for one stack (root first)."""
    leaf = frames[-1]
    if _WAIT_LEAF.match(leaf):
        return "5 idle", leaf.split(" (")[0]
    if (re.match(r"^(recv|read|poll|0x[0-9a-f]+) \(libc", leaf)
            and any(_BLOCKING_CALL.match(f) for f in frames[-12:])
            and not any(f.startswith("BlockingConnection._peer_closed ") for f in frames[-8:])):
        return "5 idle", leaf.split(" (")[0]
    if any(_GC.match(f) for f in frames):
        return "4 interpreter", "GC"
    stage = _stage(frames, rules)
    if _SYSCALL.match(leaf):
        caller = next((o[1] for o in map(_ours, reversed(frames)) if o), "the loop")
        if stage is None:
            caller = "the loop"
        row = f" [row {stage.split()[0]}]" if stage and not stage.startswith("?") else ""
        return "2 syscall", f"{leaf.split(' (')[0]} ← {caller}{row}"
    in_loop = any(_LOOP_ROOT.match(f) for f in frames)
    if _LOOP_FILE.search(leaf) or (in_loop and stage is None):
        return "1 event loop", ("called from our code" if stage else "the loop itself")
    if stage:
        return "3 our Python", stage
    return "4 interpreter", "other (no frame of ours, outside the loop)"


def aggregate(path: Path, proto: str, label: str) -> dict:
    """{category: {detail: samples}}, plus totals, from one py-spy raw file."""
    key = "worker" if label.startswith("worker") else label
    rules = STAGES[proto if key == "frontend" else key]
    cats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    threads: set[str] = set()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f.strip() for f in stack.split(";") if f]
        threads.update(f for f in frames if f.startswith("thread "))
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        cat, detail = classify(frames, rules)
        cats[cat][detail] += int(n)
        total += int(n)
    return {"samples": total, "threads": len(threads),
            "categories": {c: dict(v.most_common()) for c, v in sorted(cats.items())}}


# ============================================================================ the run
def wait_for_quiet(limit: float = 1.5, patience: float = 300.0) -> list[float]:
    """Wait (up to `patience` s) for the 1-min load average to drop to `limit`."""
    end = time.monotonic() + patience
    while os.getloadavg()[0] > limit and time.monotonic() < end:
        log(f"load average {os.getloadavg()}: waiting")
        time.sleep(20)
    return list(os.getloadavg())


def profiled_run(srv: Server, proto: str, duration: int, rate: int, mode: str, tmp: Path,
                 baseline: float) -> dict:
    from vs_triton_runs import c1_latency
    a, b = add_sub_inputs()
    ins, want = {"INPUT0": a, "INPUT1": b}, {"OUTPUT0": a + b, "OUTPUT1": a - b}
    pids = {k: v for k, v in srv.processes().items() if k in PROCS}
    out: dict[str, Any] = {"proto": proto, "pids": pids, "load_before": wait_for_quiet()}
    if baseline:
        s = c1_latency(srv, proto, "add_sub", ins, want, baseline)
        out["baseline"] = {"p50_ms": s.value, "n": s.extra["n"], "server_us": s.server_us,
                           "us_per_req": {k: v.get("us_per_req") for k, v in s.extra["cpu"].items()},
                           "cpu_pct": {k: v.get("cpu") for k, v in s.extra["cpu"].items()},
                           "sys_pct": {k: v.get("sys") for k, v in s.extra["cpu"].items()}}
        log(f"{proto} unprofiled: p50 {s.value:.3f} ms, {out['baseline']['us_per_req']}")
    res: dict[str, Any] = {}

    def load() -> None:
        res["s"] = c1_latency(srv, proto, "add_sub", ins, want, duration + 3)

    t = threading.Thread(target=load)
    t.start()
    time.sleep(2.0)          # c1_latency's check + 1 s warm-up, then py-spy inside the window
    flags = ["--threads", *(["--native", "--idle"] if mode == "native" else ["--nonblocking"])]
    spies = {}
    for label, pid in pids.items():
        path = tmp / f"pyspy-{proto}-{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.txt"
        cmd = ["py-spy", "record", "--pid", str(pid), "-d", str(duration), "-r", str(rate),
               *flags, "--format", "raw", "-o", str(path)]
        spies[label] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True), path)
    out["command"] = " ".join(cmd[:3] + ["PID"] + cmd[4:-1] + ["OUT"])
    t.join()
    s = res["s"]
    out["profiled"] = {"p50_ms": s.value, "n": s.extra["n"], "server_us": s.server_us,
                       "rate_rps": s.extra["n"] / (duration + 3),
                       "us_per_req": {k: v.get("us_per_req") for k, v in s.extra["cpu"].items()},
                       "cpu_pct": {k: v.get("cpu") for k, v in s.extra["cpu"].items()},
                       "sys_pct": {k: v.get("sys") for k, v in s.extra["cpu"].items()}}
    out["processes"] = {}
    for label, (p, path) in spies.items():
        text, _ = p.communicate(timeout=120)
        agg = aggregate(path, proto, label) if path.is_file() else {"samples": 0, "categories": {}}
        agg["pyspy_says"] = (text or "").strip().splitlines()[-2:] if text else []
        out["processes"][label] = agg
    log(f"{proto} profiled: p50 {s.value:.3f} ms, {out['profiled']['us_per_req']}")
    return out


# ============================================================================ tables
def tables(res: dict) -> str:
    lines = [f"command: `{res['command']}`; py-spy: `{res.get('pyspy_command', '')}`  ",
             f"date: {res['date']}, commit {res['commit']}, load average before "
             f"{res.get('load_before')}", ""]
    rate, dur, mode = res["rate"], res["duration"], res["mode"]
    for run in res["runs"]:
        pr, base = run["profiled"], run.get("baseline", {})
        lines.append(f"#### add_sub c1 {run['proto']}: {pr['n']} requests in {dur + 3} s while "
                     f"profiled ({pr['rate_rps']:.0f}/s, p50 {pr['p50_ms']:.3f} ms; unprofiled "
                     f"just before: p50 {base.get('p50_ms', float('nan')):.3f} ms); load before "
                     f"{run['load_before']}")
        lines.append("")
        for label, agg in run["processes"].items():
            cpu_us = pr["us_per_req"].get(label)
            base_us = base.get("us_per_req", {}).get(label)
            cats = agg["categories"]
            idle = sum(cats.get("5 idle", {}).values())
            busy = sum(sum(v.values()) for c, v in cats.items() if c != "5 idle")
            expected = rate * dur * max(1, agg.get("threads", 1))
            if mode != "native":
                idle = max(0, expected - busy)
            sampled_s = busy / rate
            cpu_s = (pr["cpu_pct"].get(label) or 0) / 100 * (dur + 3)
            lines.append(f"**{label}**: /proc: {cpu_us} µs CPU per request while profiled, "
                         f"{_pct(pr, label)} % of it system time; unprofiled just before "
                         f"{base_us} µs, {_pct(base, label)} % system. py-spy: {busy} busy "
                         f"samples of {busy + idle} ({agg.get('threads')} thread(s)); busy samples "
                         f"÷ rate = {sampled_s:.2f} s against /proc's {cpu_s * dur / (dur + 3):.2f} s "
                         f"of CPU over the same {dur} s.")
            lines.append("")
            lines.append("| category | detail | share of busy samples | ± (1 s.e.) | µs / request "
                         "(× profiled CPU) | µs / request (× unprofiled CPU) |")
            lines.append("|---|---|---:|---:|---:|---:|")
            for cat in ("1 event loop", "2 syscall", "3 our Python", "4 interpreter"):
                d = cats.get(cat, {})
                n = sum(d.values())
                if not busy:
                    continue
                share = n / busy
                se = math.sqrt(share * (1 - share) / busy)
                us = f"{share * cpu_us:.1f}" if cpu_us else "—"
                ub = f"{share * base_us:.1f}" if base_us else "—"
                lines.append(f"| **({cat[0]}) {cat[2:]}** | | **{100 * share:.1f} %** | "
                             f"{100 * se:.1f} | **{us}** | **{ub}** |")
                rows = sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))
                if cat == "3 our Python":
                    rows = sorted(d.items(), key=lambda kv: _rowkey(kv[0]))
                shown, rest = rows[:12], rows[12:]
                for det, k in shown:
                    us = f"{k / busy * cpu_us:.1f}" if cpu_us else "—"
                    ub = f"{k / busy * base_us:.1f}" if base_us else "—"
                    lines.append(f"| | {det} | {100 * k / busy:.1f} % | | {us} | {ub} |")
                if rest:
                    k = sum(v for _, v in rest)
                    us = f"{k / busy * cpu_us:.1f}" if cpu_us else "—"
                    ub = f"{k / busy * base_us:.1f}" if base_us else "—"
                    lines.append(f"| | {len(rest)} more | {100 * k / busy:.1f} % | | {us} | {ub} |")
            lines.append(f"| (5) idle | of all samples | {100 * idle / max(1, busy + idle):.1f} % "
                         f"| | — | — |")
            lines.append("")
    return "\n".join(lines)


def _pct(run: dict, label: str) -> str:
    """System time as % of the process's CPU in one run."""
    cpu, sys_ = run.get("cpu_pct", {}).get(label), run.get("sys_pct", {}).get(label)
    return f"{100 * sys_ / cpu:.0f}" if cpu and sys_ is not None else "?"


def _rowkey(label: str) -> tuple:
    m = re.match(r"(\d+)", label)
    return (0, int(m.group(1)), label) if m else (1, 0, label)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protos", default="grpc,http")
    ap.add_argument("--duration", type=int, default=20, help="py-spy seconds per protocol")
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    ap.add_argument("--mode", choices=("native", "nonblocking"), default="native")
    ap.add_argument("--baseline", type=float, default=5.0,
                    help="seconds of unprofiled c1 before each profiled run (0: none)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path)
    ap.add_argument("--keep", type=Path, help="copy the raw py-spy files here")
    args = ap.parse_args()
    if args.from_json:
        print(tables(json.loads(args.from_json.read_text())))
        return 0
    if not shutil.which("py-spy"):
        print("py-spy not found", file=sys.stderr)
        return 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit,
                           "command": "python benchmarks/request_profile.py " + " ".join(sys.argv[1:]),
                           "rate": args.rate, "duration": args.duration, "mode": args.mode,
                           "uptime": subprocess.run(["uptime"], capture_output=True,
                                                    text=True).stdout.strip(),
                           "load_before": wait_for_quiet(), "runs": []}
    tmp = Path(tempfile.mkdtemp(prefix="trireme-profile-"))
    from vs_triton_runs import wait_models_ready
    srv = Server(build_repository(tmp / "repo"), 1, tmp / "trireme.log")
    try:
        srv.start()
        wait_models_ready(srv, 120)
        for proto in args.protos.split(","):
            run = profiled_run(srv, proto, args.duration, args.rate, args.mode, tmp, args.baseline)
            res["pyspy_command"] = run.pop("command")
            res["runs"].append(run)
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                for f in tmp.glob(f"pyspy-{proto}-*.txt"):
                    shutil.copy(f, args.keep / f.name)
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    print(tables(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
