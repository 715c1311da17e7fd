"""Start and stop Trireme on Triton's fixed QA ports (HTTP 8000, gRPC 8001, metrics 8002).

Triton's QA tests hard-code localhost:8000 and localhost:8001, so the server cannot move to
free ports: `ports_in_use()` says which of the three something already listens on (the
runner stops then). `TriremeServer` runs `python -m services.cli serve` from the repository
root in its own session (process group), its stdout and stderr into one log file (the
SERVER_LOG of the QA tests), and waits for readiness as Triton's util.sh run_server does
(GET /v2/health/ready == 200), except that it stops waiting as soon as every model of the
repository index has settled (READY or UNAVAILABLE) and the server still says not ready:
a tritonserver with its default --exit-on-error would have exited there. `stop()` sends
SIGTERM to the serve process, then SIGKILL to its process group after a grace period, and
checks that no process of the group is left.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST = "localhost"
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
STOP_GRACE_S = 40.0


def ports_in_use(ports=(HTTP_PORT, GRPC_PORT, METRICS_PORT)) -> list[int]:
    """The ports among `ports` that something listens on (IPv4 or IPv6 loopback) or that
    cannot be bound on all interfaces."""
    taken = []
    for port in ports:
        busy = False
        for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                try:
                    if s.connect_ex((addr, port)) == 0:
                        busy = True
                except OSError:
                    pass
        if not busy:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    busy = True
        if busy:
            taken.append(port)
    return taken


def _http(method: str, path: str, body: bytes | None = None, timeout: float = 2.0):
    """(status, parsed JSON or None); (0, None) when nothing answers."""
    req = urllib.request.Request(f"http://{HOST}:{HTTP_PORT}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, data = e.code, e.read()
    except (OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(data) if data else None
    except ValueError:
        return status, None


def repository_index() -> list[dict]:
    status, body = _http("POST", "/v2/repository/index", b"{}")
    return body if status == 200 and isinstance(body, list) else []


class TriremeServer:
    def __init__(self, repository: Path, log_path: Path, extra_args: tuple[str, ...] = ()):
        self.repository = repository
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.not_ready: list[dict] = []   # index entries not READY when waiting ended
        self.startup_s = 0.0

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "services.cli", "serve",
                "--model-repository", str(self.repository),
                "--http-port", str(HTTP_PORT), "--grpc-port", str(GRPC_PORT),
                "--metrics-port", str(METRICS_PORT), *self.extra_args]

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float) -> bool:
        """Start and wait for readiness; True when ready. False when the process exited,
        when the models settled without the server becoming ready, or at the deadline.
        Whichever: the server may still be running (see alive())."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        settled_since = None
        while time.monotonic() < deadline:
            if not self.alive():
                break
            status, _ = _http("GET", "/v2/health/ready")
            if status == 200:
                self.ready = True
                break
            if status:   # up, not ready: ready never comes once every model has settled
                index = repository_index()
                if index and all(m.get("state") in ("READY", "UNAVAILABLE") for m in index):
                    settled_since = settled_since or time.monotonic()
                    if time.monotonic() - settled_since > 2.0:
                        break
                else:
                    settled_since = None
            time.sleep(0.25)
        self.startup_s = time.monotonic() - t0
        if self.alive():
            self.not_ready = [m for m in repository_index() if m.get("state") != "READY"]
        return self.ready

    def live(self) -> bool:
        return _http("GET", "/v2/health/live")[0] == 200

    def stop(self) -> str:
        """Stop the server and every process of its group; '' when it went cleanly, else
        what had to be done."""
        if self.proc is None:
            return ""
        note = ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                note = f"serve process still running {STOP_GRACE_S:.0f} s after SIGTERM; killed"
        pgid = self.proc.pid
        for _ in range(50):   # the group outlives its leader while workers exit
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            try:
                os.killpg(pgid, signal.SIGKILL)
                note = note or "processes of the server's group left after it exited; killed"
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self.proc = None
        return note

    def wait_ports_free(self, timeout_s: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while True:
            taken = ports_in_use()
            if not taken or time.monotonic() > deadline:
                return taken
            time.sleep(0.2)
