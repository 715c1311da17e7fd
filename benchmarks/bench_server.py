"""Serving benchmark, the server and the machine (see serving.py).

Builds the model repository, starts and stops `trireme serve` on free ports, reads its
Prometheus counters, and accounts CPU time per process from /proc; also describes the
machine (versions, pipe wake-up cost) and waits for it to go quiet before a measurement.
"""
from __future__ import annotations

import collections
import contextlib
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import models  # noqa: E402  (tests/models.py)
from conftest import _get as http_status  # noqa: E402  (tests/conftest.py)
from conftest import free_port, wait_until  # noqa: E402  (tests/conftest.py)

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
MODEL_THREADS = {"tiny": 1, "mlp": 2, "identity": 1}
MAX_BATCH = 64


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
    except Exception:  # noqa: BLE001 - any failure: fall back to the module's own version
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
        models.write_config(d, model_config(name, MODEL_THREADS[name]))
    return repo


def model_config(name: str, threads: int, instances: int = 1,
                 dynamic_batching: str | None = None, max_batch: int = MAX_BATCH,
                 extra: str = "") -> str:
    """config.pbtxt text: onnxruntime, max_batch_size, instance_group KIND_CPU x instances,
    intra_op_thread_count; dynamic_batching (the block's body, "" for `dynamic_batching { }`)
    when not None; then `extra` (e.g. input/output blocks) as is.

    Note: without input and output blocks the server auto-completes the config with
    Triton's onnxruntime rules, which add `dynamic_batching { }` when max_batch_size > 1 and
    no scheduler is given; to measure a model without dynamic batching, pass its input and
    output in `extra`."""
    text = (f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch}\n'
            f'instance_group [{{ kind: KIND_CPU, count: {instances} }}]\n'
            f'parameters {{ key: "intra_op_thread_count" value {{ string_value: '
            f'"{threads}" }} }}\n')
    if dynamic_batching is not None:
        text += f"dynamic_batching {{ {dynamic_batching} }}\n".replace("{  }", "{ }")
    return text + extra


# --------------------------------------------------------------------------- server

class Server:
    def __init__(self, repo: Path, frontends: int, log_path: Path, cpus: str = "",
                 extra: Sequence[str] = ()) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.cmd = [*(["taskset", "-c", cpus] if cpus else []),
                    sys.executable, "-m", "services.cli", "serve", "--model-repository", str(repo),
                    "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                    "--metrics-port", str(self.metrics_port), "--host", "127.0.0.1",
                    "--frontends", str(frontends), *extra]
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
        try:
            wait_until(lambda: self.proc.poll() is not None or
                       http_status(f"http://{self.http}/v2/health/ready") == 200,
                       START_TIMEOUT_S, "server start", interval=0.1)
        except TimeoutError:
            raise RuntimeError(
                f"server not ready after {START_TIMEOUT_S:.0f} s:\n{self.tail()}") from None
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")

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
                    label = f"worker[{m.group(1) if m else c.pid}]"
                    if label in out:   # a model's second instance: both must be metered
                        label = f"{label}#{c.pid}"
                    out[label] = c.pid
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
            m = re.match(r'(nv_inference_\w+)\{([^}]*)\} (\S+)', line)   # Triton's bare names
            if m and f'model="{model}"' in m.group(2):
                name = m.group(1)
                if name == "nv_inference_request_failure" and 'reason="CANCELED"' in m.group(2):
                    # The load generator stopped with requests in flight: not a server error.
                    name = "nv_inference_request_cancelled"
                out[name] += float(m.group(3))
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
