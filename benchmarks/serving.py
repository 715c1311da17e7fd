#!/usr/bin/env python
"""Trireme serving benchmark: latency, throughput and a py-spy profile in one run.

    python benchmarks/serving.py [--quick] [--frontends N] [--only tiny|mlp]
                                 [--profile] [--profile-native] [--json results.json]

What it does (see docs/benchmarks.md for the latest numbers and how to read them):
  * builds a model repository in a temp dir with tests/models.py:
      tiny      16->16 MatMul+Add+Relu, FP32, intra_op_thread_count 1
      mlp       3 x 1024 MatMul+Add+Relu, FP32, intra_op_thread_count 2
      identity  FP32 [batch, n] -> same (4 MiB round trip), intra_op_thread_count 1
    every model: max_batch_size 64, instance_group [{ kind: KIND_CPU, count: 1 }],
    no dynamic_batching (no batching window);
  * starts `python -m services.cli serve` on free ports (the full multi-process path:
    scheduler + one worker per instance + N frontends) and stops it with SIGTERM at the end;
  * in-process onnxruntime on the same model file with the same thread count (the ceiling);
  * batch-1 latency at concurrency 1 with the official tritonclient.http / tritonclient.grpc
    sync clients (binary tensor data, the clients' default), plus is_server_ready() as the
    client + protocol + frontend floor;
  * throughput at concurrency 64: wrk (-t2 -c64, JSON body) for HTTP, h2load (-c64 -m1, a
    pre-encoded ModelInferRequest) for gRPC; every run is checked for errors on the client
    side and against the scheduler's nv_inference_request_success/failure counters; the
    same tools against /v2/health/ready and ServerReady give the frontend-only ceiling;
  * 4 MiB FP32 round trip over gRPC at concurrency 4 (identity model, one client per thread;
    MiB/s counts the request payload once);
  * CPU per request for each process (all threads, from /proc), and how much CPU other
    processes on the machine took meanwhile (runs are flagged **contended** above 20%);
    before each step it waits up to --quiet-wait seconds for the machine to go idle;
  * --profile: one extra HTTP and gRPC load run at concurrency 64 on `tiny` while py-spy
    records the scheduler, the frontend(s) and the tiny worker (--nonblocking, --format raw);
    prints the top leaf frames (own time) per process with their callers;
    --profile-native: the same with py-spy --native (C frames: syscalls, uvloop, libzmq,
    grpc core), which pauses the processes per sample and so slows them down.

Needs `wrk` and `h2load` on PATH (apt-get install wrk nghttp2-client) and py-spy for
--profile. Rows whose tool is missing are reported as skipped.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import models  # noqa: E402  (tests/models.py)

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
MODEL_THREADS = {"tiny": 1, "mlp": 2, "identity": 1}
MODEL_WIDTH = {"tiny": 16, "mlp": 1024}
MAX_BATCH = 64
_PROTO = {"http": "HTTP", "grpc": "gRPC"}

# Targets from the issue (2-core machine, full multi-process path).
TARGET_LAT_P50_MS = 0.45
TARGET_HTTP_C64 = 7000.0
TARGET_GRPC_C64 = 8500.0
TARGET_GRPC_4MIB = 420.0


# --------------------------------------------------------------------------- results

@dataclass
class Row:
    model: str
    path: str                     # e.g. "HTTP c1 (tritonclient.http)"
    p50_ms: float | None = None
    p99_ms: float | None = None
    throughput: float | None = None
    unit: str = "infer/s"
    target: str = ""
    met: bool | None = None       # None: no target
    note: str = ""
    extra: dict = field(default_factory=dict)


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    return f"{v:,.{digits}f}"


def table(rows: list[Row]) -> str:
    out = ["| model | path | p50 ms | p99 ms | throughput | target | met? | notes |",
           "|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        thr = "—" if r.throughput is None else f"{r.throughput:,.0f} {r.unit}"
        met = {None: "", True: "yes", False: "**MISS**"}[r.met]
        out.append(f"| {r.model} | {r.path} | {fmt(r.p50_ms)} | {fmt(r.p99_ms)} | {thr} | "
                   f"{r.target} | {met} | {r.note} |")
    return "\n".join(out)


def cpu_table(rows: list[Row]) -> str:
    """CPU microseconds per request by process (from /proc, all threads), and % of a core."""
    roles = ["frontend", "scheduler", "worker", "client/loadgen"]

    def role(label: str) -> str:
        if label.startswith("frontend"):
            return "frontend"
        if label.startswith("worker"):
            return "worker"
        if label == "scheduler":
            return "scheduler"
        return "client/loadgen"

    out = ["| model | path | " + " | ".join(f"{r} µs/req (% core)" for r in roles)
           + " | server µs/req | all µs/req | other processes % (steal %) |",
           "|---|---|" + "---:|" * (len(roles) + 3)]
    for r in rows:
        cpu = r.extra.get("cpu_pct")
        if not cpu:
            continue
        acc = {k: [0.0, 0.0] for k in roles}
        mach = cpu.get("machine", {})
        for label, v in cpu.items():
            if label == "machine" or v.get("us_per_req") is None:
                continue
            a = acc[role(label)]
            a[0] += v["us_per_req"]
            a[1] += v["cpu"]
        server = sum(acc[k][0] for k in roles[:3])
        out.append(f"| {r.model} | {r.path} | " + " | ".join(
            f"{acc[k][0]:,.0f} ({acc[k][1]:.0f}%)" for k in roles)
            + f" | {server:,.0f} | {server + acc[roles[3]][0]:,.0f} | "
            f"{mach.get('other', 0):.0f}% ({mach.get('steal', 0):.0f}%)"
            f"{' **contended**' if mach.get('other', 0) > 20 else ''} |")
    return "\n".join(out)


def pct(samples_ns: list[int]) -> tuple[float, float, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.mean())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- machine

def _cmd_version(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (r.stdout or r.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "not found"


def machine_info(frontends: int) -> dict:
    import onnxruntime
    import tritonclient
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    try:
        from importlib.metadata import version
        tc_version = version("tritonclient")
    except Exception:
        tc_version = getattr(tritonclient, "__version__", "?")
    commit = _cmd_version(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "services"],
                           capture_output=True, text=True).stdout.strip()
    return {
        "nproc": os.cpu_count(), "sched_affinity": len(os.sched_getaffinity(0)),
        "cpu": cpu, "memory": mem, "kernel": platform.release(),
        "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__, "tritonclient": tc_version,
        "wrk": _cmd_version(["wrk", "-v"]), "h2load": _cmd_version(["h2load", "--version"]),
        "py-spy": _cmd_version(["py-spy", "--version"]),
        "git": commit + (" (services/ modified)" if dirty else ""), "frontends": frontends,
        **_pipe_info(),
    }


# --------------------------------------------------------------------------- repository

def build_repository(root: Path, which: list[str]) -> Path:
    repo = root / "models"
    for name in which:
        d = repo / name
        if name == "tiny":
            models.tiny(d)
        elif name == "mlp":
            models.mlp(d, width=1024, layers=3)
        elif name == "identity":
            models.identity(d, "fp32")
        models.write_config(d, (
            f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {MAX_BATCH}\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n'
            f'parameters {{ key: "intra_op_thread_count" value {{ string_value: '
            f'"{MODEL_THREADS[name]}" }} }}\n'))
    return repo


# --------------------------------------------------------------------------- server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Server:
    def __init__(self, repo: Path, frontends: int, log_path: Path, cpus: str = "") -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.cmd = [*(["taskset", "-c", cpus] if cpus else []), sys.executable, "-m", "services.cli", "serve", "--model-repository", str(repo),
                    "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                    "--metrics-port", str(self.metrics_port), "--host", "127.0.0.1",
                    "--frontends", str(frontends)]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            if http_status(f"http://{self.http}/v2/health/ready") == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def processes(self) -> dict[str, int]:
        """label -> pid for the scheduler, each frontend and each worker."""
        import psutil
        out = {"scheduler": self.proc.pid}
        nf = 0
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(c.cmdline())
                if "frontend" in cmd:
                    out[f"frontend{nf}" if nf else "frontend"] = c.pid
                    nf += 1
                elif "worker" in cmd:
                    m = re.search(r"\((\w+) v\d+\)", cmd)
                    out[f"worker[{m.group(1) if m else c.pid}]"] = c.pid
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log("server did not stop after SIGTERM; killing it")
            self.proc.kill()
            self.proc.wait()

    def counters(self, model: str) -> dict[str, float]:
        """The scheduler's Prometheus counters for one model (summed over versions)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out: dict[str, float] = collections.defaultdict(float)
        for line in text.splitlines():
            m = re.match(r'(nv_inference_\w+?)(_total)?\{([^}]*)\} (\S+)', line)
            if m and m.group(2) and f'model="{model}"' in m.group(3):
                out[m.group(1)] += float(m.group(4))
        return dict(out)


def counter_delta(before: dict, after: dict) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (f + [0] * 8)[:8]
    tck = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tck, steal / tck


def wait_quiet(max_s: float, threshold: float = 15.0) -> float:
    """Wait (up to max_s) until the machine is nearly idle: other engineers' test runs on
    the same 2 cores would otherwise be measured too. Returns the last busy % seen."""
    deadline = time.monotonic() + max_s
    first = True
    while True:
        b0, _ = machine_cpu()
        time.sleep(1.0)
        busy = 100 * (machine_cpu()[0] - b0)
        if busy < threshold or time.monotonic() >= deadline:
            if busy >= threshold:
                log(f"machine still busy ({busy:.0f}% of one core used by other processes); "
                    "measuring anyway")
            return busy
        if first:
            log(f"waiting for the machine to go quiet ({busy:.0f}% busy; up to {max_s:.0f} s)")
            first = False


class CpuMeter:
    """CPU used by each server process (and the load generator) during a run, with the
    system-time share and a per-thread breakdown by thread name (/proc/<pid>/task/*/comm),
    which also covers threads py-spy cannot see (libzmq I/O threads, grpc core threads)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids: dict[str, int] = {}
        self.start: dict[str, dict] = {}
        self.t0 = time.monotonic()
        self.t1 = self.t0
        self.m0 = machine_cpu()
        self.m1 = self.m0
        for label, pid in pids.items():
            self.add(label, pid)

    @staticmethod
    def _read(pid: int) -> dict:
        """{'user': s, 'sys': s, 'threads': {tid: (comm, user+sys)}} from /proc."""
        tck = os.sysconf("SC_CLK_TCK")
        out = {"user": 0.0, "sys": 0.0, "threads": {}}
        with contextlib.suppress(OSError):
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out["user"], out["sys"] = int(f[11]) / tck, int(f[12]) / tck
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    comm = (task / "comm").read_text().strip()
                    tf = (task / "stat").read_text().rsplit(")", 1)[1].split()
                    out["threads"][task.name] = (comm, (int(tf[11]) + int(tf[12])) / tck)
        return out

    def add(self, label: str, pid: int) -> None:
        self.pids[label] = pid
        self.start[label] = self._read(pid)

    def sample(self) -> dict[str, dict]:
        """label -> {'cpu', 'sys', 'threads': {name: s}} in CPU seconds since the start (call
        while the processes still exist)."""
        self.t1 = time.monotonic()
        self.m1 = machine_cpu()
        res = {}
        for label, pid in self.pids.items():
            a, b = self.start[label], self._read(pid)
            threads: dict[str, float] = collections.defaultdict(float)
            for tid, (comm, t) in b["threads"].items():
                prev = a["threads"].get(tid, (comm, 0.0))[1]
                name = "main" if tid == str(pid) else re.sub(r"\d+$", "#", comm)
                threads[name] += t - prev
            res[label] = {"cpu": b["user"] + b["sys"] - a["user"] - a["sys"],
                          "sys": b["sys"] - a["sys"], "threads": dict(threads)}
        return res

    def percent(self, used: dict[str, dict], rate: float = 0.0) -> dict[str, dict]:
        """% of one core per process; with rate (requests/s during the window) also the CPU
        microseconds each request cost that process."""
        wall = max(1e-9, self.t1 - self.t0)
        n = rate * wall
        ours = sum(v["cpu"] for v in used.values())
        busy = self.m1[0] - self.m0[0]
        machine = {"machine": {"cpu": round(100 * busy / wall, 1),
                               "other": round(100 * max(0.0, busy - ours) / wall, 1),
                               "steal": round(100 * (self.m1[1] - self.m0[1]) / wall, 1)}}
        return machine | {k: {"cpu": round(100 * v["cpu"] / wall, 1), "sys": round(100 * v["sys"] / wall, 1),
                    "us_per_req": round(1e6 * v["cpu"] / n, 1) if n else None,
                    "threads": {n: round(100 * t / wall, 1) for n, t in
                                sorted(v["threads"].items(), key=lambda kv: -kv[1])
                                if 100 * t / wall >= 1}}
                for k, v in used.items()}


# --------------------------------------------------------------------------- in-process ORT

def ort_ceiling(model_file: Path, threads: int, batch: int, n: int, width: int) -> tuple:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((batch, width), dtype=np.float32)
    feed = {"INPUT0": x}
    for _ in range(max(50, n // 10)):
        sess.run(None, feed)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter_ns()
        sess.run(None, feed)
        lat.append(time.perf_counter_ns() - s)
    wall = time.perf_counter() - t0
    p50, p99, _ = pct(lat)
    return p50, p99, n * batch / wall


# --------------------------------------------------------------------------- python clients

def expected(model: str, x: np.ndarray, model_file: Path) -> np.ndarray:
    import onnxruntime as ort
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    return sess.run(None, {"INPUT0": x})[0]


def client_latency(srv: "Server", proto: str, url: str, model: str, x: np.ndarray,
                   want: np.ndarray, warmup: int, n: int) -> tuple[float, float, float, dict]:
    if proto == "http":
        import tritonclient.http as tc
    else:
        import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)
    inp = tc.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = [tc.InferRequestedOutput("OUTPUT0")]
    r = client.infer(model, [inp], outputs=out)
    got = r.as_numpy("OUTPUT0")
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{proto} {model}: wrong output")
    for _ in range(warmup):
        client.infer(model, [inp], outputs=out)
    lat = []
    before = srv.counters(model)
    meter = CpuMeter({**srv.processes(), "client": os.getpid()})
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter_ns()
        client.infer(model, [inp], outputs=out)
        lat.append(time.perf_counter_ns() - s)
    rate = n / (time.perf_counter() - t0)
    cpu = meter.percent(meter.sample(), rate)
    delta = counter_delta(before, srv.counters(model))
    client.close()
    return (*pct(lat), delta, cpu)


def client_ready_latency(proto: str, url: str, warmup: int, n: int) -> tuple:
    """is_server_ready() round trips: the client + protocol + frontend floor, with no
    scheduler or worker on the path."""
    if proto == "http":
        import tritonclient.http as tc
    else:
        import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)
    for _ in range(warmup):
        assert client.is_server_ready()
    lat = []
    for _ in range(n):
        s = time.perf_counter_ns()
        client.is_server_ready()
        lat.append(time.perf_counter_ns() - s)
    client.close()
    return pct(lat)


def pipe_round_trip_us(cpus: tuple[int, int] | None = None, n: int = 20000) -> float:
    """Two processes ping-ponging a byte over pipes: the cost of two wake-ups on this machine
    (a few us on bare metal; on VMs whose idle vCPUs halt, a cross-CPU wake-up can cost tens
    of us). cpus pins (parent, child)."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    old = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:
        try:
            if cpus:
                os.sched_setaffinity(0, {cpus[1]})
            for _ in range(n):
                os.read(r1, 1)
                os.write(w2, b"x")
        finally:
            os._exit(0)
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    t = time.perf_counter()
    for _ in range(n):
        os.write(w1, b"x")
        os.read(r2, 1)
    dt = time.perf_counter() - t
    os.waitpid(pid, 0)
    os.sched_setaffinity(0, old)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    return round(dt / n * 1e6, 1)


def _pipe_info() -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    out = {"pipe round trip, 2 processes, unpinned (us)": pipe_round_trip_us()}
    out["pipe round trip, same CPU (us)"] = pipe_round_trip_us((cpus[0], cpus[0]))
    if len(cpus) > 1:
        out["pipe round trip, across CPUs (us)"] = pipe_round_trip_us((cpus[0], cpus[1]))
    return out


def grpc_big_round_trip(srv: "Server", url: str, nbytes: int, conc: int, per_thread: int,
                        warmup: int, until=None) -> tuple[float, float, float, float, dict]:
    """per_thread requests per client, or with until, requests until until() is true."""
    """4 MiB FP32 tensors through the identity model; returns (MiB/s, p50, p99, mean) ms."""
    import tritonclient.grpc as tc
    n = nbytes // 4
    barrier = threading.Barrier(conc + 1)
    lat: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            client = tc.InferenceServerClient(url)
            x = np.random.default_rng(i).random((1, n), dtype=np.float32)
            inp = tc.InferInput("INPUT0", [1, n], "FP32")
            inp.set_data_from_numpy(x)
            out = [tc.InferRequestedOutput("OUTPUT0")]
            got = client.infer("identity", [inp], outputs=out).as_numpy("OUTPUT0")
            if not np.array_equal(got, x):
                raise AssertionError("identity round trip changed the tensor")
            for _ in range(warmup):
                client.infer("identity", [inp], outputs=out)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()
            return
        try:
            barrier.wait()
            mine = []
            for _ in (itertools.count() if until else range(per_thread)):
                if until and until():
                    break
                s = time.perf_counter_ns()
                client.infer("identity", [inp], outputs=out).as_numpy("OUTPUT0")
                mine.append(time.perf_counter_ns() - s)
            with lock:
                lat.extend(mine)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    meter = None
    try:
        barrier.wait()
        meter = CpuMeter({**srv.processes(), "client": os.getpid()})
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    cpu = meter.percent(meter.sample(), len(lat) / wall) if meter else {}
    p50, p99, mean = pct(lat) if lat else (0.0, 0.0, 0.0)
    return len(lat) * nbytes / (1 << 20) / wall, p50, p99, mean, cpu


# --------------------------------------------------------------------------- load generators

WRK_POST = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
"""
WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d non2xx=%d connect=%d read=%d write=%d timeout=%d p50_us=%d p99_us=%d\\n",
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def http_json_body(model: str, x: np.ndarray) -> str:
    data = ",".join(f"{v:.6g}" for v in x.ravel())
    return ('{"inputs":[{"name":"INPUT0","shape":[%d,%d],"datatype":"FP32","data":[%s]}]}'
            % (x.shape[0], x.shape[1], data))


def run_wrk(srv: Server, model: str | None, x: np.ndarray | None, tmp: Path, duration: int,
            conns: int = 64, threads: int = 2, meter_pids: dict | None = None) -> dict:
    """POST a JSON infer body to /v2/models/<model>/infer, or with model None GET
    /v2/health/ready (the frontend alone: no scheduler or worker on the path)."""
    lua = tmp / f"wrk-{model or 'ready'}.lua"
    if model:
        lua.write_text(WRK_POST % http_json_body(model, x) + WRK_DONE)
        url = f"http://{srv.http}/v2/models/{model}/infer"
    else:
        lua.write_text(WRK_DONE)
        url = f"http://{srv.http}/v2/health/ready"
    # A short warm-up so every connection is open and the caches are hot.
    subprocess.run(["wrk", "-t", str(threads), "-c", str(conns), "-d", "2s", "-s", str(lua), url],
                   capture_output=True, text=True, timeout=60)
    before = srv.counters(model) if model else {}
    meter = CpuMeter(meter_pids or srv.processes())
    cmd = ["wrk", "-t", str(threads), "-c", str(conns), "-d", f"{duration}s", "--latency",
           "-s", str(lua), url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    meter.add("wrk", p.pid)
    time.sleep(max(0.0, duration - 0.5))
    used = meter.sample()
    out, _ = p.communicate(timeout=duration + 60)
    delta = counter_delta(before, srv.counters(model)) if model else {}
    m = re.search(r"^BENCH (.*)$", out, re.M)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m or not rps:
        raise RuntimeError(f"could not parse wrk output:\n{out}")
    vals = {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    vals["non2xx_line"] = int(non2xx.group(1)) if non2xx else 0
    return {"rps": float(rps.group(1)), **vals, "server": delta,
            "cpu_pct": meter.percent(used, float(rps.group(1))),
            "cmd": " ".join(cmd), "raw": out}


def grpc_body(model: str, x: np.ndarray) -> bytes:
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add()
    t.name, t.datatype = "INPUT0", "FP32"
    t.shape.extend(x.shape)
    req.raw_input_contents.append(np.ascontiguousarray(x, dtype=np.float32).tobytes())
    msg = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def check_grpc_body(srv: Server, body: bytes, want: np.ndarray) -> None:
    """Send exactly the bytes h2load will send through a real gRPC stack: grpc-status is in
    the trailers, which h2load does not read, so an invalid body would still count as 2xx."""
    import grpc
    from tritonclient.grpc import service_pb2
    with grpc.insecure_channel(srv.grpc) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=None, response_deserializer=None)
        raw = call(body[5:], timeout=10)
    resp = service_pb2.ModelInferResponse.FromString(raw)
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(want.shape)
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise AssertionError("pre-encoded gRPC request returned a wrong output")


def check_grpc_ready(srv: Server) -> None:
    import grpc
    from tritonclient.grpc import service_pb2
    with grpc.insecure_channel(srv.grpc) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ServerReady",
                              request_serializer=None, response_deserializer=None)
        if not service_pb2.ServerReadyResponse.FromString(call(b"", timeout=10)).ready:
            raise AssertionError("ServerReady answered ready=false")


def run_h2load(srv: Server, model: str | None, x: np.ndarray | None, want: np.ndarray | None,
               tmp: Path, duration: int, conns: int = 64, meter_pids: dict | None = None) -> dict:
    """A pre-encoded ModelInferRequest to ModelInfer, or with model None an empty
    ServerReadyRequest to ServerReady (the frontend alone)."""
    if model:
        body = grpc_body(model, x)
        check_grpc_body(srv, body, want)
        method = "ModelInfer"
    else:
        body = b"\x00" + struct.pack(">I", 0)
        check_grpc_ready(srv)
        method = "ServerReady"
    path = tmp / f"grpc-{model or 'ready'}.bin"
    path.write_bytes(body)
    url = f"http://{srv.grpc}/inference.GRPCInferenceService/{method}"
    base = ["h2load", "-t", "1", "-c", str(conns), "-m", "1", "-d", str(path),
            "-H", "content-type: application/grpc", "-H", "te: trailers"]
    before = srv.counters(model) if model else {}
    meter = CpuMeter(meter_pids or srv.processes())
    cmd = [*base, "-D", str(duration), "--warm-up-time", "2", url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    meter.add("h2load", p.pid)
    time.sleep(2 + max(0.0, duration - 0.5))
    used = meter.sample()
    out, _ = p.communicate(timeout=duration + 60)
    delta = counter_delta(before, srv.counters(model)) if model else {}
    fin = re.search(r"finished in ([\d.]+)s, ([\d.]+) req/s", out)
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                    r"(\d+) failed, (\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    mean = re.search(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)", out)
    if not (fin and req and codes):
        raise RuntimeError(f"could not parse h2load output:\n{out}")
    return {"rps": float(fin.group(2)), "done": int(req.group(3)),
            "succeeded": int(req.group(4)), "failed": int(req.group(5)),
            "errored": int(req.group(6)), "s2xx": int(codes.group(1)),
            "non2xx": sum(int(codes.group(i)) for i in (2, 3, 4)),
            "mean_req": mean.group(3) if mean else "", "server": delta,
            "cpu_pct": meter.percent(used, float(fin.group(2))), "cmd": " ".join(cmd),
            "raw": out}


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


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, 3 s load runs")
    ap.add_argument("--frontends", type=int, default=1, help="trireme serve --frontends")
    ap.add_argument("--only", choices=["tiny", "mlp"], help="benchmark one model only")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy every server process under HTTP and gRPC load (tiny)")
    ap.add_argument("--profile-native", action="store_true",
                    help="also profile with py-spy --native (C frames; pauses the server)")
    ap.add_argument("--profile-rate", type=int, default=200, help="py-spy samples/s")
    ap.add_argument("--duration", type=int, default=None, help="seconds per load run (10)")
    ap.add_argument("--requests", type=int, default=None, help="latency requests (2000)")
    ap.add_argument("--json", type=Path, help="also write every result here")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each measurement wait up to this many seconds for other "
                         "processes to stop using the CPU (4x this in all; 0: don't wait)")
    ap.add_argument("--server-cpus", default="",
                    help="run the server under `taskset -c CPUS` (experiments; default: unpinned)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, profiles)")
    args = ap.parse_args()

    n_lat = args.requests or (300 if args.quick else 2000)
    warm = max(50, n_lat // 10)
    duration = args.duration or (3 if args.quick else 10)
    models_run = [args.only] if args.only else ["tiny", "mlp"]
    have = {t: shutil.which(t) is not None for t in ("wrk", "h2load", "py-spy")}

    info = machine_info(args.frontends)
    hdr = ["# Trireme serving benchmark", "",
           f"command: `python benchmarks/serving.py {' '.join(sys.argv[1:])}`".replace("  ", " "),
           "", "| machine | |", "|---|---|"]
    hdr += [f"| {k} | {v} |" for k, v in info.items()]
    print("\n".join(hdr) + "\n", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="trireme-bench-"))
    rows: list[Row] = []
    results: dict = {"machine": info, "args": vars(args) | {"json": str(args.json)},
                     "rows": [], "profiles": {}}
    srv = None
    t_start = time.monotonic()

    wait_budget = [args.quiet_wait * 4]    # all the waiting in one run, at most

    def quiet() -> None:
        if args.quiet_wait > 0 and wait_budget[0] > 0:
            t = time.monotonic()
            results.setdefault("busy_before", []).append(
                wait_quiet(min(args.quiet_wait, wait_budget[0])))
            wait_budget[0] -= time.monotonic() - t
    try:
        repo = build_repository(tmp, [*models_run, "identity"])
        srv = Server(repo, args.frontends, tmp / "server.log", args.server_cpus)
        log(f"starting: {' '.join(srv.cmd)}")
        srv.start()
        log(f"ready; processes: {srv.processes()}")

        for model in models_run:
            width = MODEL_WIDTH[model]
            threads = MODEL_THREADS[model]
            mfile = repo / model / "1" / "model.onnx"
            x = np.random.default_rng(1).random((1, width), dtype=np.float32)
            want = expected(model, x, mfile)
            tnote = f"intra_op {threads}"

            quiet()
            log(f"{model}: in-process onnxruntime")
            n_ort = n_lat * (5 if model == "tiny" else 1)
            p50, p99, thr = ort_ceiling(mfile, threads, 1, n_ort, width)
            rows.append(Row(model, "in-process onnxruntime, batch 1", p50, p99, thr,
                            note=f"{tnote}; sequential; ceiling"))
            if model == "mlp":
                p50, p99, thr = ort_ceiling(mfile, threads, 64, max(100, n_lat // 10), width)
                rows.append(Row(model, "in-process onnxruntime, batch 64", p50, p99, thr,
                                note=f"{tnote}; infer/s = 64 x calls/s"))

            for proto, url in (("http", srv.http), ("grpc", srv.grpc)):
                if model == models_run[0]:
                    quiet()
                    log(f"{proto} is_server_ready latency, {n_lat} requests")
                    p50, p99, mean = client_ready_latency(proto, url, warm, n_lat)
                    rows.append(Row("(none)", f"{_PROTO[proto]} c1 is_server_ready "
                                    f"(tritonclient.{proto})", p50, p99, 1000.0 / mean,
                                    unit="req/s", note="floor: client + protocol + frontend; "
                                    "no scheduler/worker hop"))
                quiet()
                log(f"{model}: {proto} latency, {n_lat} requests")
                p50, p99, mean, delta, cpu = client_latency(srv, proto, url, model, x, want,
                                                            warm, n_lat)
                tgt = model == "tiny"
                rows.append(Row(model, f"{_PROTO[proto]} c1 (tritonclient.{proto}), batch 1",
                                p50, p99, 1000.0 / mean,
                                target=f"p50 ≤ {TARGET_LAT_P50_MS} ms" if tgt else "",
                                met=(p50 <= TARGET_LAT_P50_MS) if tgt else None,
                                note=f"{n_lat} req; mean {mean:.3f} ms{_server_note(delta)}",
                                extra={"cpu_pct": cpu, "server": delta}))

            tgt = model == "tiny"
            if have["wrk"]:
                quiet()
                log(f"{model}: wrk -t2 -c64 -d{duration}s")
                r = run_wrk(srv, model, x, tmp, duration)
                errs = r["non2xx"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
                bad = r["server"].get("nv_inference_request_failure", 0)
                ok = errs == 0 and r["non2xx_line"] == 0 and bad == 0
                rows.append(Row(model, "HTTP c64 (wrk -t2, JSON body)", r["p50_us"] / 1e3,
                                r["p99_us"] / 1e3, r["rps"],
                                target=f"≥ {TARGET_HTTP_C64:,.0f} infer/s" if tgt else "",
                                met=(r["rps"] >= TARGET_HTTP_C64 and ok) if tgt else None,
                                note=(f"{r['requests']} req, 0 errors" if ok else
                                      f"ERRORS: non2xx {r['non2xx']}, socket {errs - r['non2xx']},"
                                      f" server failures {bad:.0f}") +
                                f"{_server_note(r['server'])}",
                                extra={k: v for k, v in r.items() if k != "raw"}))
            else:
                rows.append(Row(model, "HTTP c64 (wrk)", note="skipped: wrk not on PATH"))

            if have["h2load"]:
                quiet()
                log(f"{model}: h2load -c64 -m1 -D{duration}")
                r = run_h2load(srv, model, x, want, tmp, duration)
                bad = r["server"].get("nv_inference_request_failure", 0)
                okc = r["server"].get("nv_inference_request_success", 0)
                ok = (r["failed"] == 0 and r["errored"] == 0 and r["non2xx"] == 0 and bad == 0
                      and okc >= r["s2xx"] * 0.99)
                rows.append(Row(model, "gRPC c64 (h2load -c64 -m1)", None, None, r["rps"],
                                target=f"≥ {TARGET_GRPC_C64:,.0f} infer/s" if tgt else "",
                                met=(r["rps"] >= TARGET_GRPC_C64 and ok) if tgt else None,
                                note=(f"{r['s2xx']} req 2xx, server ok {okc:.0f}, 0 failures; "
                                      if ok else
                                      f"ERRORS: failed {r['failed']} errored {r['errored']} "
                                      f"non2xx {r['non2xx']} server failures {bad:.0f} "
                                      f"server ok {okc:.0f}; ") +
                                f"mean {r['mean_req']}{_server_note(r['server'])}",
                                extra={k: v for k, v in r.items() if k != "raw"}))
            else:
                rows.append(Row(model, "gRPC c64 (h2load)", note="skipped: h2load not on PATH"))

        # The frontend alone at concurrency 64: the ceiling of the protocol layer.
        fdur = max(3, duration // 2)
        if have["wrk"]:
            quiet()
            log(f"frontend ceiling: wrk GET /v2/health/ready -d{fdur}s")
            r = run_wrk(srv, None, None, tmp, fdur)
            errs = r["non2xx"] + r["connect"] + r["read"] + r["write"] + r["timeout"]
            rows.append(Row("(none)", "HTTP c64 GET /v2/health/ready (wrk -t2)",
                            r["p50_us"] / 1e3, r["p99_us"] / 1e3, r["rps"], unit="req/s",
                            note=("frontend-only ceiling" if errs == 0 else f"ERRORS {errs}"),
                            extra={k: v for k, v in r.items() if k != "raw"}))
        if have["h2load"]:
            quiet()
            log(f"frontend ceiling: h2load ServerReady -D{fdur}")
            r = run_h2load(srv, None, None, None, tmp, fdur)
            ok = r["failed"] == 0 and r["errored"] == 0 and r["non2xx"] == 0
            rows.append(Row("(none)", "gRPC c64 ServerReady (h2load -c64 -m1)", None, None,
                            r["rps"], unit="req/s",
                            note=(f"frontend-only ceiling; mean {r['mean_req']}" if ok else
                                  f"ERRORS failed {r['failed']} errored {r['errored']}"),
                            extra={k: v for k, v in r.items() if k != "raw"}))

        quiet()
        log("identity: 4 MiB gRPC round trip, concurrency 4")
        per = 8 if args.quick else 40
        mibs, p50, p99, mean, cpu = grpc_big_round_trip(srv, srv.grpc, 4 << 20, 4, per, 2)
        rows.append(Row("identity", "gRPC c4, 4 MiB FP32 (tritonclient.grpc)", p50, p99, mibs,
                        unit="MiB/s", target=f"≥ {TARGET_GRPC_4MIB:.0f} MiB/s",
                        met=mibs >= TARGET_GRPC_4MIB,
                        note=f"{4 * per} req; request bytes counted once",
                        extra={"cpu_pct": cpu}))

        prof_text = ""
        if args.profile:
            if not have["py-spy"]:
                prof_text = "py-spy not on PATH: no profile"
            elif "tiny" not in models_run:
                prof_text = "profiles use the tiny model: run without --only mlp"
            else:
                x = np.random.default_rng(1).random((1, 16), dtype=np.float32)
                want = expected("tiny", x, repo / "tiny" / "1" / "model.onnx")
                parts = []
                for native in ([False, True] if args.profile_native else [False]):
                    for kind, tool in (("http", "wrk"), ("grpc", "h2load"), ("4mib", "")):
                        if tool and not have[tool]:
                            continue
                        if kind == "4mib" and native:
                            continue
                        quiet()
                        log(f"profile: py-spy{' --native' if native else ''} on every server "
                            f"process under {kind} load")
                        prof = profile_run(srv, kind, "identity" if kind == "4mib" else "tiny",
                                           x, want, tmp, duration,
                                           args.profile_rate if not native else 100, native)
                        results["profiles"][kind + ("-native" if native else "")] = prof
                        parts.append(print_profile(prof, kind))
                prof_text = "\n\n".join(parts)
    except BaseException:
        if srv is not None:
            log("server log tail:\n" + srv.tail())
        raise
    finally:
        if srv is not None:
            srv.stop()
            log(f"server stopped (exit code {srv.proc.returncode if srv.proc else None})")
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    for r in rows:
        other = r.extra.get("cpu_pct", {}).get("machine", {}).get("other", 0)
        if other > 20:
            r.note += f"; **contended: other processes used {other:.0f}% of a core**"
    print("## Results\n")
    print(table(rows))
    print(f"\n(total {time.monotonic() - t_start:.0f} s; throughput rows: p50/p99 are the load "
          "generator's per-request latency at concurrency 64, h2load reports only a mean; "
          "'worker µs/req' are the worker's own compute_input/infer/output counters)\n")
    print("### CPU per request by process (user+sys of all threads, from /proc)\n")
    print(cpu_table(rows))
    print("\n(2 cores = 200% in all. At concurrency 64 the machine is saturated when the % "
          "column sums to ~200; then throughput ≈ 2,000,000 / 'all µs/req'.)\n")
    if prof_text:
        print("## Profile\n")
        print(prof_text)
    results["rows"] = [asdict(r) for r in rows]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {args.json}")
    return 0


def _server_note(d: dict) -> str:
    """Worker-side time per request from the scheduler's counters (Triton's compute_*)."""
    n = d.get("nv_inference_request_success", 0)
    if not n:
        return ""
    g = lambda k: d.get(f"nv_inference_compute_{k}_duration_us", 0) / n  # noqa: E731
    return (f"; worker µs/req in {g('input'):.0f} / infer {g('infer'):.0f} / out {g('output'):.0f}"
            f"; batch {d.get('nv_inference_count', 0) / max(1, d.get('nv_inference_exec_count', 1)):.2f}")


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


if __name__ == "__main__":
    sys.exit(main())
