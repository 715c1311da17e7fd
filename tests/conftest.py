"""Fixtures that start a real Trireme (scheduler + workers + frontends) on free ports."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import models

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0


_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel handed out
    (bind to 0) can be taken again by any outgoing connection before the server binds it."""
    high = _ephemeral_low() - 1
    for _ in range(200):
        port = random.randint(max(1024, high - 12000), high)
        if port in _GIVEN:   # handed out earlier in this run: maybe not bound yet
            continue
        _GIVEN.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:   # (a crowded range: the kernel's choice, as before)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments(pids: set[int] | None = None) -> list[str]:
    names = [n for n in os.listdir("/dev/shm") if n.startswith("trireme-")]
    if pids is None:
        return names
    return [n for n in names if int(n.split("-")[1]) in pids]


def alive(pids) -> list[int]:
    """The processes of ``pids`` still running (zombies count as gone)."""
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@dataclass
class Server:
    proc: subprocess.Popen
    repo: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def family(self) -> set[int]:
        """pids of the server and every process it started."""
        for _ in range(5):   # a child may exit while the tree is walked: walk again
            try:
                p = psutil.Process(self.proc.pid)
                return {p.pid, *(c.pid for c in p.children(recursive=True))}
            except psutil.NoSuchProcess:
                if not psutil.pid_exists(self.proc.pid):
                    return set()
        return {self.proc.pid}

    def workers(self, model: str) -> list[tuple[int, str]]:
        """(pid, instance name) of each worker titled 'trireme worker <instance> (<model> vN)'."""
        found = []
        for pid in self.family():
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
            except psutil.NoSuchProcess:
                continue
            if cmd.startswith("trireme worker ") and f"({model} v" in cmd:
                found.append((pid, cmd.split()[2]))
        return found

    def frontend_pids(self) -> list[int]:
        """The frontend processes the server started, in pid order."""
        out = []
        for pid in self.family():
            try:
                cmd = " ".join(psutil.Process(pid).cmdline())
            except psutil.NoSuchProcess:
                continue
            if "trireme frontend" in cmd or "services.frontend.main" in cmd:
                out.append(pid)
        return sorted(out)

    def frontend(self) -> psutil.Process:
        """The (first) frontend process."""
        pids = self.frontend_pids()
        assert pids, "no frontend process"
        return psutil.Process(pids[0])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _get(url: str, context: ssl.SSLContext | None = None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_until(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_settled(srv: Server, client, settled, what: str, timeout: float = 60.0):
    """wait_until(settled); past the deadline, fail with the repository index and the tail
    of the server log, which say which model did not load and why."""
    try:
        return wait_until(settled, timeout, what)
    except TimeoutError as e:
        raise AssertionError(f"{client.get_model_repository_index()}\n{srv.log()[-4000:]}") from e


def wait_models(srv: Server, ready, unavailable=(), what: str = "models to load or fail",
                timeout: float = 90.0) -> None:
    """Wait until the repository index shows every model of ``ready`` READY and every one of
    ``unavailable`` UNAVAILABLE (a server started with ready=False and models that must fail)."""
    import tritonclient.http as httpclient
    c = httpclient.InferenceServerClient(srv.http_url)

    def settled():
        states = {e["name"]: e.get("state") for e in c.get_model_repository_index()}
        return all(states.get(n) == "READY" for n in ready) and \
            all(states.get(n) == "UNAVAILABLE" for n in unavailable)
    try:
        wait_settled(srv, c, settled, what, timeout)
    finally:
        c.close()


def stop_server(srv: Server, timeout: float = 30.0) -> int:
    """SIGTERM, wait, and check that nothing is left: no process, no /dev/shm segment."""
    family = srv.family()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(timeout)
    except subprocess.TimeoutExpired as e:
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        srv.proc.wait()
        raise AssertionError(f"server did not stop within {timeout} s\n{srv.log()[-4000:]}") from e
    wait_until(lambda: not [p for p in family if psutil.pid_exists(p) and
                            psutil.Process(p).status() != psutil.STATUS_ZOMBIE],
               10, "child processes to exit")
    leaked = shm_segments(family)
    assert not leaked, f"leaked shared-memory segments: {leaked}"
    return code


@contextlib.contextmanager
def start_server(repo: Path, *extra: str, ready: bool = True, frontends: int = 1,
                 env: dict[str, str] | None = None, https: ssl.SSLContext | None = None):
    """Run `trireme serve` on free ports; yields a Server, stops it and checks for leaks.
    ``https``: the server serves HTTPS (--http-use-ssl), probe it with this client context."""
    http, grpc_, metrics = free_port(), free_port(), free_port()
    log_path = repo.parent / f"server-{http}.log"
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model-repository", str(repo),
           "--http-port", str(http), "--grpc-port", str(grpc_), "--metrics-port", str(metrics),
           "--host", "127.0.0.1", "--frontends", str(frontends), *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    srv = Server(proc, repo, http, grpc_, metrics, log_path)
    try:
        want = "/v2/health/ready" if ready else "/v2/health/live"
        try:
            wait_until(lambda: proc.poll() is not None or
                       _get(f"{'https' if https else 'http'}://{srv.http_url}{want}", https) == 200,
                       START_TIMEOUT_S, "server start")
        except TimeoutError as e:
            raise AssertionError(f"server not {want}:\n{srv.log()[-4000:]}") from e
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{srv.log()[-4000:]}")
        yield srv
    finally:
        if proc.poll() is None:
            stop_server(srv)


@pytest.fixture(scope="session")
def standard_repo(tmp_path_factory) -> Path:
    return models.standard_repository(tmp_path_factory.mktemp("repo") / "models")


@pytest.fixture(scope="session")
def server(standard_repo):
    with start_server(standard_repo) as srv:
        yield srv
