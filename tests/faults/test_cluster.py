"""The compose topology without docker: a scheduler, two frontends and two worker hosts, each
started by its own command line and joined over TCP, as their containers would be. Each
piece runs in a session of its own, so kill -9 of its process group is the death of its
container (a worker host dies with its workers).

Asserted: inference through both frontends (official clients, HTTP and gRPC, a tensor in
shared memory and one sent inline by a frontend that cannot see the workers' memory), and
that killing any piece loses no client (each has a 30 s timeout and gets an answer) and
heals with no operator action within the issue's targets: a killed worker host's models are
READY again <= 10 s after it (or another host) can run them, a restarted scheduler serves
again <= 10 s, explicit-mode loads survive it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import models
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, _get, alive, free_port, shm_segments, wait_until
from tritonclient.utils import InferenceServerException

RECOVERY_TARGET_S = 10.0
CLIENT_TIMEOUT_S = 30.0
BIG = np.random.default_rng(0).random((1, 1 << 18), dtype=np.float32)   # 1 MiB: shared memory


class Piece:
    """One command line of the topology, in its own session (its 'container')."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None):
        self.name, self.argv, self.env = name, argv, env
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Piece:
        env = dict(os.environ, **(self.env or {}))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", *self.argv],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def pids(self) -> set[int]:
        if self.proc is None or self.proc.poll() is not None:
            return set()
        try:
            me = psutil.Process(self.proc.pid)
            return {self.proc.pid} | {c.pid for c in me.children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()

    def kill9(self) -> None:
        """The container dies: the piece and everything it started, at once."""
        assert self.proc is not None
        pids = self.pids()
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        wait_until(lambda: not alive(pids), 10, f"{self.name}'s processes to die")

    def stop(self) -> int | None:
        """SIGTERM; its exit code (None when it is not running: killed by the test)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Cluster:
    def __init__(self, tmp: Path, repo: Path, *scheduler_flags: str) -> None:
        self.tmp = tmp
        fport, wport, self.metrics_port = free_port(), free_port(), free_port()
        self.scheduler_addr = f"stream://127.0.0.1:{fport}"
        self.worker_addr = f"stream://127.0.0.1:{wport}"
        self.scheduler = Piece("scheduler", [
            "scheduler", "--model-repository", str(repo),
            "--frontend-addr", f"stream://0.0.0.0:{fport}", "--worker-addr", f"stream://0.0.0.0:{wport}",
            "--metrics-port", str(self.metrics_port), "--host", "127.0.0.1", *scheduler_flags], tmp)
        self.frontends: list[Piece] = []
        self.ports: list[tuple[int, int]] = []
        self.hosts: dict[str, Piece] = {}

    def add_frontend(self, env: dict | None = None) -> Piece:
        http, grpc_ = free_port(), free_port()
        i = len(self.frontends)
        piece = Piece(f"frontend{i}", ["frontend", "--scheduler", self.scheduler_addr,
                                       "--http-port", str(http), "--grpc-port", str(grpc_),
                                       "--host", "127.0.0.1"], self.tmp, env)
        self.frontends.append(piece)
        self.ports.append((http, grpc_))
        return piece.start()

    def add_host(self, name: str) -> Piece:
        piece = self.hosts[name] = Piece(name, ["workers", "--scheduler", self.worker_addr,
                                                "--name", name], self.tmp)
        return piece.start()

    def pieces(self) -> list[Piece]:
        return [self.scheduler, *self.frontends, *self.hosts.values()]

    def ready(self, i: int = 0, what: str = "health/ready") -> bool:
        return _get(f"http://127.0.0.1:{self.ports[i][0]}/v2/{what}") == 200

    def wait_ready(self, timeout: float = 60.0, what: str = "health/ready") -> float:
        t0 = time.monotonic()
        try:
            wait_until(lambda: all(self.ready(i, what) for i in range(len(self.frontends))),
                       timeout, what)
        except TimeoutError as e:
            raise AssertionError("\n".join(f"--- {p.name}\n{p.log()[-2500:]}" for p in self.pieces())) from e
        return time.monotonic() - t0

    def worker_host_of(self, model: str) -> str | None:
        """The host whose worker serves ``model`` (a worker's title names its model)."""
        for name, piece in self.hosts.items():
            for pid in piece.pids() - {piece.proc.pid}:
                try:
                    if f"({model} v" in " ".join(psutil.Process(pid).cmdline()):
                        return name
                except psutil.NoSuchProcess:
                    pass
        return None

    def close(self) -> None:
        pids = set().union(*(p.pids() for p in self.pieces()))
        codes = {p.name: p.stop() for p in [*self.frontends, self.scheduler, *self.hosts.values()]}
        wait_until(lambda: not alive(pids), 15, "every process to exit")
        assert shm_segments(pids) == []
        assert all(c in (0, None) for c in codes.values()), codes


def identity_repo(tmp: Path) -> Path:
    repo = tmp / "models"
    models.identity(repo / "identity_fp32", "fp32")
    models.write_config(repo / "identity_fp32", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    return repo


def infer(client_mod, url: str, data: np.ndarray, model: str = "identity_fp32", **kw) -> np.ndarray:
    client = client_mod.InferenceServerClient(url, **kw)
    inp = client_mod.InferInput("INPUT0", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    return client.infer(model, [inp]).as_numpy("OUTPUT0")


class Clients:
    """Clients that keep sending while a piece is killed: each request must end, with a
    result or an error, within its 30 s timeout (no hang, no silent drop)."""

    def __init__(self, cluster: Cluster, n: int = 4) -> None:
        self.cluster = cluster
        self.stop = threading.Event()
        self.ok = self.failed = 0
        self.errors: set[str] = set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        http, grpc_ = self.cluster.ports[i % len(self.cluster.ports)]
        data = np.full((1, 16), i, dtype=np.float32)
        while not self.stop.is_set():
            try:
                if i % 2:
                    out = infer(grpcclient, f"127.0.0.1:{grpc_}", data)
                else:
                    out = infer(httpclient, f"127.0.0.1:{http}", data,
                                network_timeout=CLIENT_TIMEOUT_S, connection_timeout=CLIENT_TIMEOUT_S)
                np.testing.assert_array_equal(out, data)
                with self.lock:
                    self.ok += 1
            except (InferenceServerException, ConnectionError, OSError) as e:
                with self.lock:
                    self.failed += 1
                    self.errors.add(str(e)[:120])
                time.sleep(0.05)   # a client's retry pace; not a wait for the server

    def finish(self) -> tuple[int, int]:
        self.stop.set()
        for t in self.threads:
            t.join(CLIENT_TIMEOUT_S + 10)
        assert not any(t.is_alive() for t in self.threads), "a client hung"
        return self.ok, self.failed


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, identity_repo(tmp_path))
    try:   # every piece stopped, also when one fails to start (none is left running)
        c.scheduler.start()
        c.add_frontend()
        c.add_frontend()
        c.add_host("hostA")
        c.add_host("hostB")
        c.wait_ready()
        yield c
    finally:
        c.close()


def test_both_frontends_serve_with_shared_memory_between_pieces(cluster):
    small = np.arange(16, dtype=np.float32).reshape(1, 16)
    for http, grpc_ in cluster.ports:
        for mod, url in ((httpclient, f"127.0.0.1:{http}"), (grpcclient, f"127.0.0.1:{grpc_}")):
            np.testing.assert_array_equal(infer(mod, url, small), small)
            np.testing.assert_array_equal(infer(mod, url, BIG), BIG)
    # Same /dev/shm: the probe found it, so the 1 MiB inputs went through the frontends' arenas.
    for f in cluster.frontends:
        assert shm_segments({f.proc.pid}), f"{f.name} sent everything inline"
    log = cluster.scheduler.log()
    assert "worker host hostA (CPU) joined" in log and "worker host hostB (CPU) joined" in log


def test_a_frontend_that_cannot_map_the_workers_memory_gets_inline_tensors(cluster, tmp_path):
    other_shm = tmp_path / "other-shm"     # its own /dev/shm, as in a container without shared IPC
    other_shm.mkdir()
    cluster.add_frontend(env={"TRIREME_SHM_DIR": str(other_shm)})
    cluster.wait_ready()
    http, grpc_ = cluster.ports[-1]
    for mod, url in ((httpclient, f"127.0.0.1:{http}"), (grpcclient, f"127.0.0.1:{grpc_}")):
        np.testing.assert_array_equal(infer(mod, url, BIG), BIG)
    assert sorted(os.listdir(other_shm)) == [".trireme-domain"]   # no segment was made there


def test_killed_worker_host_its_model_comes_back(cluster):
    clients = Clients(cluster)
    wait_until(lambda: clients.ok >= 20, 30, "traffic")
    first = cluster.worker_host_of("identity_fp32")     # its one instance
    other = "hostB" if first == "hostA" else "hostA"
    t0 = time.monotonic()
    cluster.hosts[first].kill9()
    # The other host takes the instance over (the model stays READY: requests wait for it).
    wait_until(lambda: cluster.worker_host_of("identity_fp32") == other, RECOVERY_TARGET_S,
               "the instance to move")
    before = clients.ok
    wait_until(lambda: clients.ok >= before + 20, RECOVERY_TARGET_S, "traffic on the other host")
    assert cluster.ready(0, "models/identity_fp32/ready")
    assert time.monotonic() - t0 <= RECOVERY_TARGET_S
    # Now no host is left: the model is not ready; the host comes back, and so does it.
    cluster.hosts[other].kill9()
    wait_until(lambda: not cluster.ready(0, "models/identity_fp32/ready"), RECOVERY_TARGET_S,
               "the model to say it is not ready")
    cluster.add_host(other)
    back = cluster.wait_ready(RECOVERY_TARGET_S, "models/identity_fp32/ready")
    ok, failed = clients.finish()
    assert ok > 40 and back <= RECOVERY_TARGET_S, (ok, failed, back)


def test_scheduler_restart_heals_without_an_operator(cluster):
    clients = Clients(cluster)
    wait_until(lambda: clients.ok >= 20, 30, "traffic")
    old_workers = set().union(*(h.pids() for h in cluster.hosts.values())) - {
        h.proc.pid for h in cluster.hosts.values()}
    cluster.scheduler.kill9()
    wait_until(lambda: not cluster.ready(0) and not cluster.ready(1), 10, "not ready")
    # The hosts stop the dead scheduler's workers: a new one starts from clean hosts.
    wait_until(lambda: not alive(old_workers), 15, "the old workers to stop")
    t0 = time.monotonic()
    cluster.scheduler.start()
    back = cluster.wait_ready(RECOVERY_TARGET_S)
    before = clients.ok
    wait_until(lambda: clients.ok >= before + 20, RECOVERY_TARGET_S, "traffic after the restart")
    ok, failed = clients.finish()
    assert time.monotonic() - t0 <= RECOVERY_TARGET_S + 2 and back <= RECOVERY_TARGET_S
    # While it restarts, models are unavailable (retryable), never "unknown".
    assert not [e for e in clients.errors if "not found" in e or "unknown" in e], clients.errors
    for http, _ in cluster.ports:
        np.testing.assert_array_equal(infer(httpclient, f"127.0.0.1:{http}", BIG), BIG)


def test_a_killed_frontend_costs_only_its_own_clients(cluster):
    cluster.frontends[0].kill9()
    small = np.ones((1, 16), dtype=np.float32)
    np.testing.assert_array_equal(infer(grpcclient, f"127.0.0.1:{cluster.ports[1][1]}", small), small)
    cluster.frontends[0].start()    # same ports, as its container's restart
    assert cluster.wait_ready(RECOVERY_TARGET_S) <= RECOVERY_TARGET_S
    np.testing.assert_array_equal(infer(httpclient, f"127.0.0.1:{cluster.ports[0][0]}", BIG), BIG)


def test_explicit_loads_survive_a_scheduler_restart(tmp_path):
    c = Cluster(tmp_path, identity_repo(tmp_path), "--model-control-mode", "explicit",
                "--model-state-file", str(tmp_path / "state" / "models.json"))
    try:
        c.scheduler.start()
        c.add_frontend()
        c.add_host("hostA")
        c.wait_ready()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{c.ports[0][0]}")
        assert not client.is_model_ready("identity_fp32")
        client.load_model("identity_fp32", config='{"max_batch_size": 4}')
        assert client.get_model_config("identity_fp32")["max_batch_size"] == 4
        c.scheduler.kill9()
        c.scheduler.start()
        c.wait_ready(RECOVERY_TARGET_S, "models/identity_fp32/ready")
        assert client.get_model_config("identity_fp32")["max_batch_size"] == 4   # its override too
        client.unload_model("identity_fp32")
        c.scheduler.kill9()
        c.scheduler.start()
        c.wait_ready()
        assert not client.is_model_ready("identity_fp32")
    finally:
        c.close()
