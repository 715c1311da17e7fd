"""Fault injection: the scheduler dies (SIGKILL) under a frontend that outlives it.

`trireme serve` is the scheduler, and its frontends die with it; in a deployment of separate
processes (`trireme scheduler` + `trireme frontend`, as compose runs them) a frontend stays
up. Its requests must not wait for an answer that can never come, nor its health keep
saying ready: every request waiting fails UNAVAILABLE within a bound, health says
not ready (still live), new requests fail fast, and when a scheduler is back on the same
address the frontend announces itself again and serves.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import models
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, START_TIMEOUT_S, _get, free_port, shm_segments, wait_until
from tritonclient.utils import InferenceServerException

FAIL_BOUND_S = 5.0        # pending requests fail within this after the scheduler's death
CALL_TIMEOUT_S = 60.0     # every client call has one; reaching it is a hang
WIDTH = 256


@contextlib.contextmanager
def _process(args: list[str], log_path: Path):
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Deployment:
    """One scheduler (with its workers) and one frontend, started separately."""

    def __init__(self, tmp: Path, repo: Path) -> None:
        self.tmp, self.repo = tmp, repo
        self.http_port, self.grpc_port = free_port(), free_port()
        self.metrics_port = free_port()
        self.log_path = tmp / "deployment.log"
        self.frontend_addr = f"unix://{tmp}/frontends.sock"
        self.scheduler_args = ["scheduler", "--model-repository", str(repo),
                               "--frontend-addr", self.frontend_addr,
                               "--worker-addr", f"unix://{tmp}/workers.sock",
                               "--metrics-port", str(self.metrics_port), "--host", "127.0.0.1",
                               "--local-workers", "true"]
        self.frontend_args = ["frontend", "--scheduler", self.frontend_addr,
                              "--result-addr", f"unix://{tmp}/results.sock",
                              "--http-port", str(self.http_port),
                              "--grpc-port", str(self.grpc_port), "--host", "127.0.0.1"]

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def health(self, what: str) -> int:
        return _get(f"http://{self.http_url}/v2/health/{what}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _rows(client, x: np.ndarray) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("slow", [inp]).as_numpy("OUTPUT0")


def _busy(pid: int, cpu0: float) -> bool:
    return sum(psutil.Process(pid).cpu_times()[:2]) - cpu0 > 0.3


def _worker_pids(scheduler: subprocess.Popen) -> list[int]:
    return [c.pid for c in psutil.Process(scheduler.pid).children(recursive=True)]


@pytest.fixture
def deployment(tmp_path):
    repo = tmp_path / "models"
    models.slow(repo / "slow", WIDTH)
    models.write_config(repo / "slow", models.slow_config(WIDTH))
    return Deployment(tmp_path, repo)


def test_pending_requests_fail_unavailable_when_the_scheduler_dies(deployment):
    d = deployment
    with _process(d.scheduler_args, d.log_path) as sched, \
            _process(d.frontend_args, d.log_path) as fe:
        wait_until(lambda: d.health("ready") == 200 or sched.poll() is not None
                   or fe.poll() is not None, START_TIMEOUT_S, "the deployment to be ready")
        assert sched.poll() is None and fe.poll() is None, d.log()[-4000:]
        client = httpclient.InferenceServerClient(d.http_url, network_timeout=CALL_TIMEOUT_S)
        x = np.ones((1, WIDTH), np.float32)
        np.testing.assert_array_equal(_rows(client, x), x)
        (worker,) = _worker_pids(sched)
        cpu0 = sum(psutil.Process(worker).cpu_times()[:2])

        # Requests waiting on the scheduler: one running (seconds of work), more queued
        # behind it, over HTTP and gRPC (a unary call and a stream).
        big = np.ones((4096, WIDTH), np.float32)
        outcome: dict[str, tuple[float, object]] = {}

        def call(name: str, fn) -> None:
            try:
                fn()
                outcome[name] = (time.monotonic(), "answered")
            except Exception as e:  # noqa: BLE001 - each client's error is the subject here
                outcome[name] = (time.monotonic(), e)

        def http_call() -> None:
            c = httpclient.InferenceServerClient(d.http_url, network_timeout=CALL_TIMEOUT_S)
            try:
                _rows(c, big)
            finally:
                c.close()

        def grpc_unary() -> None:
            c = grpcclient.InferenceServerClient(f"127.0.0.1:{d.grpc_port}")
            inp = grpcclient.InferInput("INPUT0", list(big.shape), "FP32")
            inp.set_data_from_numpy(big)
            try:
                c.infer("slow", [inp], client_timeout=CALL_TIMEOUT_S)
            finally:
                c.close()

        def grpc_stream() -> None:
            c = grpcclient.InferenceServerClient(f"127.0.0.1:{d.grpc_port}")
            got: list = []
            done = threading.Event()

            def callback(result, error):
                got.append(error if error is not None else result)
                done.set()
            inp = grpcclient.InferInput("INPUT0", list(big.shape), "FP32")
            inp.set_data_from_numpy(big)
            c.start_stream(callback, stream_timeout=CALL_TIMEOUT_S)
            try:
                c.async_stream_infer("slow", [inp])
                assert done.wait(CALL_TIMEOUT_S), "no response on the stream"
            finally:
                c.stop_stream(cancel_requests=True)
                c.close()
            if isinstance(got[0], Exception):
                raise got[0]

        calls = {"http-0": http_call, "http-1": http_call, "grpc": grpc_unary,
                 "stream": grpc_stream}
        threads = [threading.Thread(target=call, args=item, daemon=True) for item in calls.items()]
        threads[0].start()
        wait_until(lambda: _busy(worker, cpu0), 30, "the first request to run")
        for t in threads[1:]:
            t.start()
        time.sleep(0.5)   # the rest reach the scheduler's queue (a failure is fine either way)
        assert not outcome, f"answered before the scheduler died: {outcome}"

        os.kill(sched.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for t in threads:
            t.join(FAIL_BOUND_S + 5)
        assert not [t for t in threads if t.is_alive()], f"hung: {outcome}"
        for name, (at, result) in outcome.items():
            assert at - t0 < FAIL_BOUND_S, (f"{name} failed only after {at - t0:.1f} s", outcome)
            assert isinstance(result, InferenceServerException), (name, result)
            # (a stream carries its errors in the response's error_message, with no status)
            assert result.status() in ("503", str(grpc.StatusCode.UNAVAILABLE)) or \
                name == "stream", (name, result)
            assert "scheduler" in result.message(), (name, result)

        # Not ready (still live) while it is gone; new requests fail fast, they do not wait.
        assert d.health("ready") == 400 and d.health("live") == 200   # Triton's not-ready: 400
        quick = httpclient.InferenceServerClient(d.http_url, network_timeout=10)
        with pytest.raises(InferenceServerException) as e:
            _rows(quick, x)
        assert e.value.status() == "503", e.value
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                   != psutil.STATUS_ZOMBIE for p in [worker]),
                   10, "the dead scheduler's worker to exit")

        # A scheduler back on the same address: the frontend serves again.
        with _process(d.scheduler_args, d.log_path) as again:
            wait_until(lambda: d.health("ready") == 200 or again.poll() is not None,
                       START_TIMEOUT_S, "ready again")
            assert again.poll() is None, d.log()[-4000:]
            np.testing.assert_array_equal(_rows(quick, x), x)
            np.testing.assert_array_equal(_rows(client, x), x)
            # the restarted scheduler swept what the killed one's worker left in /dev/shm
            assert not shm_segments({sched.pid, worker})
        quick.close()
        client.close()
    assert "Traceback" not in d.log(), d.log()[-4000:]
