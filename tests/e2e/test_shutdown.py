"""Shutdown of `trireme serve` on SIGINT / SIGTERM after real traffic (shared-memory
segments exist on both sides): exit code 0, every child gone, nothing of any of its
processes left in /dev/shm, and the run directory with the ipc sockets removed."""
from __future__ import annotations

import glob
import http.client
import os
import signal
import subprocess
import tempfile
import threading

import models
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import alive, shm_segments, start_server, wait_until
from models_python import python_model

ONE_CPU = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
BIG = 1 << 20   # FP32 elements: a 4 MiB tensor, far above the 128 KiB inline threshold


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("shutdown") / "models"
    models.identity(root / "identity", "fp32")
    models.write_config(root / "identity", f"max_batch_size: 8\n{ONE_CPU}")
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", f"max_batch_size: 8\n{ONE_CPU}")
    models.slow(root / "slow")
    models.write_config(root / "slow", models.slow_config())
    return root


def run_dirs(pid: int, since: float = 0.0) -> list[str]:
    """The run directories of `trireme serve` process ``pid`` made at ``since`` or later
    (an earlier process with the same pid may have left one behind: pids are reused)."""
    return [d for d in glob.glob(os.path.join(tempfile.gettempdir(), f"trireme-{pid}-*"))
            if os.stat(d).st_mtime >= since]


def traffic(srv, n_small: int = 4) -> None:
    x = np.random.default_rng(0).random((1, BIG), dtype=np.float32)
    with httpclient.InferenceServerClient(srv.http_url) as c:
        inp = httpclient.InferInput("INPUT0", [1, BIG], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("identity", [inp]).as_numpy("OUTPUT0"), x)
        for i in range(n_small):
            a = np.full((1, 16), i, np.float32)
            ins = [httpclient.InferInput("INPUT0", [1, 16], "FP32"),
                   httpclient.InferInput("INPUT1", [1, 16], "FP32")]
            ins[0].set_data_from_numpy(a)
            ins[1].set_data_from_numpy(a)
            np.testing.assert_array_equal(c.infer("add_sub", ins).as_numpy("OUTPUT0"), a + a)
    g = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        inp = grpcclient.InferInput("INPUT0", [1, BIG], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(g.infer("identity", [inp]).as_numpy("OUTPUT0"), x)
    finally:
        g.close()


def signal_and_check(srv, sig: int, family: set[int] | None = None, *, traceback_ok: bool = False) -> None:
    family = family or srv.family()
    assert len(family) >= 4, family     # serve, frontend(s), workers
    since = psutil.Process(srv.proc.pid).create_time() - 1.0
    assert run_dirs(srv.proc.pid, since), "the run directory holds the ipc sockets while serving"
    assert glob.glob(os.path.join(run_dirs(srv.proc.pid, since)[0], "*.sock"))
    srv.proc.send_signal(sig)
    try:
        code = srv.proc.wait(30)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"no exit 30 s after {signal.Signals(sig).name}\n{srv.log()[-4000:]}") from e
    assert code == 0, srv.log()[-4000:]
    # the scheduler reaps what it started before it exits: no orphan outlives it
    assert not alive(family - {srv.proc.pid}), (alive(family), srv.log()[-4000:])
    assert not shm_segments(family), shm_segments(family)
    assert not run_dirs(srv.proc.pid, since), run_dirs(srv.proc.pid, since)
    if not traceback_ok:
        assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_shutdown_is_clean(repo, sig):
    with start_server(repo) as srv:
        traffic(srv)
        # segments exist on both sides: the frontend's input arena, the worker's output arena
        assert len(shm_segments(srv.family())) >= 2, shm_segments(srv.family())
        signal_and_check(srv, sig)


def frontends_of(srv) -> list[int]:
    pids = []
    for pid in srv.family():
        try:
            if "frontend" in " ".join(psutil.Process(pid).cmdline()):
                pids.append(pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def test_two_frontends(repo):
    with start_server(repo, frontends=2) as srv:
        fes = frontends_of(srv)
        assert len(fes) == 2, fes

        def listening(pid: int) -> bool:   # readiness comes from whichever frontend is up first
            ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
            return {srv.http_port, srv.grpc_port} <= ports
        wait_until(lambda: all(listening(p) for p in fes), 60, "both frontends to listen")
        # SO_REUSEPORT spreads connections over both frontends: hold 16 connections open,
        # each with a request answered, and see which process accepted each.
        body = b'{"inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'
        conns = []
        try:
            for _ in range(16):
                conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=30)
                conn.request("POST", "/v2/models/identity/infer", body,
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                assert r.status == 200, r.read()
                r.read()
                conns.append(conn)
            served = {}
            for pid in fes:
                n = sum(1 for c in psutil.Process(pid).net_connections("tcp")
                        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == srv.http_port)
                served[pid] = n
            assert sum(served.values()) == 16, served
            assert all(served.values()), f"one frontend took every connection: {served}"
        finally:
            for conn in conns:
                conn.close()
        for _ in range(3):
            traffic(srv, n_small=2)
        signal_and_check(srv, signal.SIGTERM)


_LOADS_FOR_A_MINUTE = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(60)

    def execute(self, requests):
        return []
"""


def test_shutdown_while_loading(tmp_path_factory):
    """SIGTERM as soon as the server is live, while its workers are still being started."""
    root = tmp_path_factory.mktemp("loading") / "models"
    for i in range(3):
        models.add_sub(root / f"m{i}")
        models.write_config(root / f"m{i}", "max_batch_size: 8\n"
                            "instance_group [{ kind: KIND_CPU, count: 2 }]\n")
    # A model whose load lasts as long as the test needs: the server is stopped while its
    # worker is inside initialize(), however fast the others load.
    python_model(root, "loading", _LOADS_FOR_A_MINUTE, ONE_CPU)
    with start_server(root, ready=False) as srv:
        family: set[int] = set()

        def loading():   # the slow model's worker is in its initialize()
            family.update(srv.family())
            for pid in family - {srv.proc.pid}:
                try:
                    cmd = " ".join(psutil.Process(pid).cmdline())
                except psutil.NoSuchProcess:
                    continue
                if "(loading v1)" in cmd:
                    return True
            return False
        wait_until(loading, 30, "a worker to be loading", interval=0.005)
        # A worker killed by SIGTERM in the middle of its model load can print a traceback
        # (services/workers/main.py closes its socket inside the signal handler; see report).
        signal_and_check(srv, signal.SIGTERM, family, traceback_ok=True)


def test_shutdown_waits_for_request_in_flight(repo):
    """Like tritonserver, in-flight requests finish before the server goes away."""
    with start_server(repo) as srv:
        (wpid,) = [p for p in srv.family() if "(slow v1)" in " ".join(psutil.Process(p).cmdline())]
        worker = psutil.Process(wpid)
        x = np.random.default_rng(1).random((2048, 256), dtype=np.float32)   # ~2 s of work
        result: dict = {}

        def send():
            try:
                with httpclient.InferenceServerClient(srv.http_url, network_timeout=60) as c:
                    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
                    inp.set_data_from_numpy(x)
                    result["out"] = c.infer("slow", [inp]).as_numpy("OUTPUT0")
            except Exception as e:   # noqa: BLE001 - reported below
                result["error"] = e
        cpu0 = sum(worker.cpu_times()[:2])
        t = threading.Thread(target=send, daemon=True)
        t.start()
        wait_until(lambda: sum(worker.cpu_times()[:2]) - cpu0 > 0.2, 30, "the request to run")
        assert t.is_alive(), result
        signal_and_check(srv, signal.SIGTERM)
        t.join(30)
        assert "error" not in result, result["error"]
        np.testing.assert_allclose(result["out"], x, rtol=1e-5)
