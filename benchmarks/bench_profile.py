"""Serving benchmark, the py-spy profile (see serving.py).

Records every server process with py-spy (raw collapsed stacks) while a load runs, and
summarizes each recording: own time by leaf frame with its caller, and inclusive time.
"""
from __future__ import annotations

import collections
import contextlib
import re
import subprocess
import time
from pathlib import Path

import numpy as np
from bench_load import grpc_big_round_trip, run_h2load, run_wrk
from bench_server import ROOT, Server

# --------------------------------------------------------------------------- py-spy

def pyspy_record(pids: dict[str, int], duration: int, tmp: Path, tag: str,
                 rate: int, native: bool) -> dict[str, subprocess.Popen]:
    procs = {}
    # --native needs to stop the process for each sample (no --nonblocking): it slows the
    # server down, but shows the C frames (syscalls, uvloop, libzmq, grpc core).
    mode = ["--native"] if native else ["--nonblocking"]
    for label, pid in pids.items():
        out = tmp / f"pyspy-{tag}-{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.txt"
        procs[label] = (subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "-d", str(duration), "-r", str(rate),
             *mode, "--format", "raw", "-o", str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
    return procs


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _short(frame: str) -> str:
    """'run (onnxruntime/capi/onnxruntime_inference_session.py:220)' -> func (file, no line)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    for marker in ("site-packages/", "lib/python3", str(ROOT) + "/"):
        if marker in f:
            f = f.split(marker, 1)[1]
    f = re.sub(r"^\.\d+/", "", f)
    return f"{m.group('func')} ({f})"


# Leaves that mean "blocked, waiting for work" (py-spy --native cannot tell idle threads).
_WAITING = re.compile(r"^(epoll_wait|epoll_pwait|epoll_pwait2|poll|ppoll|select|pselect6?|"
                      r"nanosleep|clock_nanosleep|pthread_cond_(timed)?wait|"
                      r"__futex_abstimed_wait_common\w*|futex_wait|sem_wait|accept4?) ")
_GENERIC = re.compile(r"^(<module>|_run_module_as_main|_run_code|run|main|run_forever|"
                      r"run_until_complete|_run_once|_run|_asyncio_run|cmd_serve|serve|"
                      r"Runner\.run|Loop__\w+|uv_\w+|uv__\w+|Handle__run|Py_X?DECREF|"
                      r"Thread\.(run|_bootstrap\w*)|0x[0-9a-f]+) ")


def _is_native_noise(f: str) -> bool:
    return f.startswith("0x") or "(libc.so" in f or "(libpthread" in f


def summarize_raw(path: Path, top: int = 15) -> dict:
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    via: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = waiting = 0
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            n = int(n)
            frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ")
                      and not f.startswith("thread ")]
            if not frames:
                continue
            total += n
            if _WAITING.match(frames[-1]):
                waiting += n
                continue
            leaf = frames[-1]
            own[leaf] += n
            caller = next((f for f in reversed(frames[:-1])
                           if f != leaf and not _is_native_noise(f)), "")
            via[leaf][caller] += n
            for f in set(frames):
                incl[f] += n
    busy = total - waiting
    return {"samples": total, "waiting": waiting, "busy": busy,
            "own": [(f, c, via[f].most_common(1)[0][0] if via[f] else "")
                    for f, c in own.most_common(top)],
            "inclusive": [(f, c) for f, c in incl.most_common(80)
                          if not _GENERIC.match(f) and c < 0.95 * busy][:10]}


def profile_run(srv: Server, kind: str, model: str, x: np.ndarray, want: np.ndarray,
                tmp: Path, duration: int, rate: int, native: bool) -> dict:
    pids = {k: v for k, v in srv.processes().items()
            if not k.startswith("worker[") or k == f"worker[{model}]"}
    procs = pyspy_record(pids, duration + 1, tmp, kind + ("-native" if native else ""), rate,
                         native)
    time.sleep(0.5)
    # The load runs a little longer than the recording so every sample is under load.
    metered = {**pids, **{f"py-spy[{k}]": p.pid for k, (p, _) in procs.items()}}
    if kind == "http":
        res = run_wrk(srv, model, x, tmp, duration + 2, meter_pids=metered)
    elif kind == "grpc":
        res = run_h2load(srv, model, x, want, tmp, duration + 1, meter_pids=metered)
    else:  # "4mib": the identity model, 4 MiB tensors, 4 gRPC clients, until py-spy is done
        mibs, _, _, _, cpu = grpc_big_round_trip(
            srv, srv.grpc, 4 << 20, 4, 0, 2,
            until=lambda: all(p.poll() is not None for p, _ in procs.values()))
        res = {"rps": mibs, "cpu_pct": cpu}
    out = {"load_rps": res["rps"], "cpu_pct": res["cpu_pct"], "rate": rate,
           "seconds": duration, "native": native, "processes": {}, "kind": kind}
    for label, (p, path) in procs.items():
        text, _ = p.communicate(timeout=60)
        s = summarize_raw(path)
        if not s["samples"]:
            s["error"] = (text or "").strip()[-500:]
        s["pid"] = pids[label]
        out["processes"][label] = s
    return out


# Leaf frames that are really C code below the last Python frame (seen with --native).
_C_BELOW = {
    "Runner.run (asyncio/runners.py)": "event loop in C (uvloop): epoll, socket I/O, callbacks",
    "Thread.run (threading.py)": "a C thread (grpc core poller / executor)",
}


def print_profile(prof: dict, kind: str) -> str:
    native = prof.get("native")
    what = ("4 MiB FP32 gRPC round trips at concurrency 4 on `identity`" if kind == "4mib"
            else f"{kind.upper()} load at concurrency 64 on `tiny`")
    unit = "MiB/s" if kind == "4mib" else "infer/s"
    lines = [f"### py-spy{' --native' if native else ''}: {what} "
             f"({prof['seconds']} s at {prof['rate']} Hz, "
             f"{'blocking: the server is paused per sample' if native else 'non-idle samples'};"
             f" {prof['load_rps']:,.0f} {unit} while profiled)", ""]
    cpu = prof.get("cpu_pct", {})
    if cpu:
        lines.append("CPU during the run, % of one core (system share; per thread name): "
                     + _cpu_detail(cpu))
    lines.append("")
    for label, s in prof["processes"].items():
        n, busy = s["samples"], s.get("busy", s["samples"])
        head = f"#### {label} (pid {s['pid']}): {n} samples"
        if s.get("waiting"):
            head += (f", {100 * s['waiting'] / n:.0f}% blocked in epoll/poll/futex "
                     f"(left out below; % are of the {busy} busy samples)")
        lines.append(head)
        if not busy:
            lines.append(f"no samples: {s.get('error', '')}")
            lines.append("")
            continue
        lines.append("")
        lines.append("| own % | leaf frame (function (file)) | called from |")
        lines.append("|---:|---|---|")
        for f, c, caller in s["own"]:
            why = "" if native or f not in _C_BELOW else f" ({_C_BELOW[f]})"
            lines.append(f"| {100 * c / busy:.1f} | `{f}`{why} | {caller and f'`{caller}`'} |")
        lines.append("")
        lines.append("inclusive (top 10, roots left out): " + "; ".join(
            f"`{f}` {100 * c / busy:.0f}%" for f, c in s["inclusive"]))
        lines.append("")
    return "\n".join(lines)


def _cpu_detail(cpu: dict) -> str:
    """'frontend 89% (sys 30%; main 70, ZMQbg/IO/# 15)' per process."""
    mach = cpu.get("machine", {})
    head = (f"other processes {mach.get('other', 0):.0f}%, steal {mach.get('steal', 0):.0f}%; "
            if mach else "")
    cpu = {k: v for k, v in cpu.items() if k != "machine"}
    return head + "; ".join(
        f"{k} {v['cpu']:.0f}% (sys {v['sys']:.0f}%"
        + (": " + ", ".join(f"{n} {t:.0f}" for n, t in v["threads"].items())
           if len(v["threads"]) > 1 else "") + ")"
        for k, v in cpu.items() if v["cpu"] >= 1)
