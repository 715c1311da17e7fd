"""Fault injection: a model instance's worker dies (SIGKILL) while the server runs.

The scheduler must fail what that worker held (an error, never a hang), keep every other
model serving, restart the instance, and leave nothing of the dead process in /dev/shm.

Models (one CPU instance each):
- "victim":    identity FP32 [-1, -1]; a 4 MiB request makes its output arena exist.
- "bystander": add_sub; must keep serving while "victim" is down.
- "fragile":   identity FP32; its model file is corrupted before its worker is killed,
               so the restart fails.
- "slow":      FP32 [-1, 256] -> 400 chained 256x256 MatMuls with the identity matrix
               (output == input), one intra-op thread: ~1 ms per row, so a 4096-row
               request runs for seconds and can be killed mid-execution.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import models
import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import shm_segments, start_server, wait_until
from tritonclient.utils import InferenceServerException

ONE_CPU = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
RESTART_DEADLINE_S = 30.0
SLOW_WIDTH = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults") / "models"
    models.identity(root / "victim", "fp32")
    models.write_config(root / "victim", f"max_batch_size: 8\n{ONE_CPU}")
    models.add_sub(root / "bystander")
    models.write_config(root / "bystander", f"max_batch_size: 8\n{ONE_CPU}")
    models.identity(root / "fragile", "fp32")
    models.write_config(root / "fragile", f"max_batch_size: 8\n{ONE_CPU}")
    models.slow(root / "slow", SLOW_WIDTH)
    models.write_config(root / "slow", models.slow_config(SLOW_WIDTH))
    with start_server(root) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    yield c
    c.close()


def worker_pid(server, model: str) -> int:
    """pid of the model's one worker."""
    found = server.workers(model)
    assert len(found) == 1, f"workers of {model}: {found}"
    return found[0][0]


def identity(client, x: np.ndarray, model: str = "victim") -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUTPUT0")


def add_sub(client) -> None:
    a = np.full((1, 16), 2, np.float32)
    b = np.ones((1, 16), np.float32)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"),
              httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    res = client.infer("bystander", inputs)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)


def kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _dead(pid), 10, f"pid {pid} to die")


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:     # already reaped (also between two checks)
        return True


def test_killed_worker_is_restarted_others_keep_serving(server, client):
    big = np.random.default_rng(0).random((1, 1 << 20), dtype=np.float32)   # 4 MiB
    np.testing.assert_array_equal(identity(client, big), big)
    add_sub(client)
    pid = worker_pid(server, "victim")
    assert shm_segments({pid}), "a 4 MiB output should live in the worker's arena"

    kill_and_reap(pid)
    add_sub(client)   # the other model is not affected

    def victim_back():
        try:
            x = np.arange(8, dtype=np.float32).reshape(1, 8)
            return np.array_equal(identity(client, x), x)
        except InferenceServerException:
            return False
    wait_until(victim_back, RESTART_DEADLINE_S, "the killed instance to serve again")
    new_pid = worker_pid(server, "victim")
    assert new_pid != pid
    np.testing.assert_array_equal(identity(client, big), big)
    add_sub(client)
    # the supervisor unlinked what the dead worker owned
    wait_until(lambda: not shm_segments({pid}), 10, "the dead worker's segments to go")
    assert "exited with code -9" in server.log()
    assert client.is_server_ready()


def test_request_in_flight_gets_an_error(server, client):
    pid = worker_pid(server, "slow")
    x = np.ones((1, SLOW_WIDTH), np.float32)
    np.testing.assert_array_equal(identity(client, x, "slow"), x)

    big = np.ones((4096, SLOW_WIDTH), np.float32)     # seconds of work, 4 MiB in shm
    result: dict = {}

    def send():
        t0 = time.monotonic()
        try:
            c = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
            try:
                result["value"] = identity(c, big, "slow")
            finally:
                c.close()
        except InferenceServerException as e:
            result["error"] = e
        result["elapsed"] = time.monotonic() - t0

    proc = psutil.Process(pid)
    cpu0 = sum(proc.cpu_times()[:2])
    t = threading.Thread(target=send, daemon=True)
    t.start()
    # executing: the worker burns CPU (it is idle otherwise)
    wait_until(lambda: sum(proc.cpu_times()[:2]) - cpu0 > 0.3, 30, "the slow request to run")
    assert t.is_alive(), f"finished before the kill: {result}"
    kill_and_reap(pid)
    t.join(30)
    assert not t.is_alive(), "the request in flight hung after its worker died"
    assert "error" in result, result
    e = result["error"]
    assert e.status() == "500"
    assert e.message() == ("model instance 'slow_0_0' of model 'slow' exited unexpectedly "
                           "(exit code -9); the request was not completed")
    # and the instance comes back
    wait_until(lambda: _try(lambda: identity(client, x, "slow")), RESTART_DEADLINE_S,
               "'slow' to serve again")
    assert worker_pid(server, "slow") != pid
    wait_until(lambda: not shm_segments({pid}), 10, "the dead worker's segments to go")


def _try(fn) -> bool:
    try:
        fn()
        return True
    except InferenceServerException:
        return False


def test_frontend_unmaps_dead_worker_segments(server, client):
    """A frontend maps each worker's output segment to read results in place. When that
    worker dies the name is unlinked, but the pages stay allocated in /dev/shm for as long
    as any process keeps them mapped."""
    big = np.random.default_rng(1).random((1, 1 << 20), dtype=np.float32)
    np.testing.assert_array_equal(identity(client, big), big)
    pid = worker_pid(server, "victim")
    (fe,) = server.frontend_pids()

    def mapped_from(p: int) -> list[str]:
        with open(f"/proc/{fe}/maps") as f:
            return [line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                    for line in f if f"/dev/shm/trireme-{p}-" in line]
    assert mapped_from(pid), "the frontend reads the worker's output segment in place"
    kill_and_reap(pid)
    wait_until(lambda: _try(lambda: identity(client, np.ones((1, 4), np.float32))),
               RESTART_DEADLINE_S, "'victim' to serve again")
    wait_until(lambda: not shm_segments({pid}), 10, "the dead worker's segments to go")
    # The frontend unmaps it too, so the memory is really given back.
    wait_until(lambda: not mapped_from(pid), 10, "the frontend to unmap the dead worker's segment")


def test_failed_restart_makes_the_model_unavailable(server, client):
    """The instance cannot come back (its model file is now corrupt): the model must stop
    looking healthy and requests must fail fast instead of waiting for an instance that
    will never exist."""
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(identity(client, x, "fragile"), x)
    (server.repo / "fragile" / "1" / "model.onnx").write_bytes(b"not an onnx model" * 64)
    pid = worker_pid(server, "fragile")
    kill_and_reap(pid)
    wait_until(lambda: "restart of fragile_0_0 failed" in server.log(), RESTART_DEADLINE_S,
               "the restart attempt to fail")
    ready = client.is_model_ready("fragile")
    idx = [e for e in client.get_model_repository_index() if e["name"] == "fragile"]
    add_sub(client)   # the rest of the server is fine either way
    assert not ready
    assert idx and idx[0]["state"] == "UNAVAILABLE" and idx[0].get("reason"), idx
    quick = httpclient.InferenceServerClient(server.http_url, network_timeout=5)
    try:
        with pytest.raises(InferenceServerException) as ei:
            identity(quick, x, "fragile")
    finally:
        quick.close()
    assert ei.value.status() in ("404", "503"), ei.value
