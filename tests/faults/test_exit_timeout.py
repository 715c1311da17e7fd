"""Shutdown with a model that hangs in execute() (time.sleep(600)).

--exit-timeout-secs bounds the whole shutdown: the scheduler lets work in flight finish
until then, kills the instances still executing (their requests fail UNAVAILABLE, naming
the timeout), and stops everything else; the server exits within the timeout + 1 s, with
no child left and nothing in /dev/shm. The worker no longer swallows SIGTERM inside a
model's execute(), so a kill -9 of the scheduler (its children get SIGTERM through
PR_SET_PDEATHSIG) leaves no orphan either; a worker stuck in native code, where no Python
signal handler can run, ends itself TERM_GRACE_S after that SIGTERM.

Two ways to hang: "hang" sleeps in Python (time.sleep(600)); "deadlock" locks a pthread
mutex twice through ctypes, which no signal interrupts.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import threading
import time

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import alive, shm_segments, start_server, wait_until
from models_python import HANG, python_model
from tritonclient.utils import InferenceServerException

from services.common.procutil import TERM_GRACE_S

DEADLOCK = '''
import ctypes
import os


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "hanging")

    def execute(self, requests):
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(128)   # zeroed: PTHREAD_MUTEX_INITIALIZER
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)             # never returns
        return []
'''
HANG_CONFIG = '''
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_FP32, dims: [-1] }]
output [{ name: "OUT", data_type: TYPE_FP32, dims: [-1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
'''
BIG = 1 << 20   # FP32 elements: 4 MiB, in shared memory on both sides
EXIT_TIMEOUT_S = 3


def repository(tmp_path_factory, name: str):
    root = tmp_path_factory.mktemp(name) / "models"
    python_model(root, "hang", HANG, HANG_CONFIG)
    python_model(root, "deadlock", DEADLOCK, HANG_CONFIG)
    models.identity(root / "identity", "fp32")
    models.write_config(root / "identity", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    return root


def traffic(srv) -> None:
    """A 4 MiB identity request (segments on both sides) and a quick one to "hang"."""
    x = np.random.default_rng(0).random((1, BIG), dtype=np.float32)
    with httpclient.InferenceServerClient(srv.http_url) as c:
        inp = httpclient.InferInput("INPUT0", [1, BIG], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("identity", [inp]).as_numpy("OUTPUT0"), x)
        inp = httpclient.InferInput("IN", [4], "FP32")
        inp.set_data_from_numpy(np.zeros(4, np.float32))
        c.infer("hang", [inp])


def hang(srv, model: str = "hang") -> tuple[threading.Thread, dict, int]:
    """A 4 MiB request that hangs ``model``; returns once it executes (and the worker's pid)."""
    marker = srv.repo / model / "hanging"
    marker.unlink(missing_ok=True)
    result: dict = {}

    def send():
        c = httpclient.InferenceServerClient(srv.http_url, network_timeout=900)
        try:
            inp = httpclient.InferInput("IN", [BIG], "FP32")
            inp.set_data_from_numpy(np.ones(BIG, np.float32))
            result["value"] = c.infer(model, [inp])
        except InferenceServerException as e:
            result["error"] = e
        except Exception as e:   # noqa: BLE001 - a cut connection: reported by the test
            result["broken"] = e
        finally:
            result["at"] = time.monotonic()
            c.close()
    t = threading.Thread(target=send, daemon=True)
    t.start()
    wait_until(lambda: marker.exists() or not t.is_alive(), 60, "the request to hang")
    assert t.is_alive(), result
    pid = int(wait_until(lambda: marker.read_text(), 10, "the marker's pid"))
    return t, result, pid


@pytest.mark.parametrize("model", ["hang", "deadlock"])
def test_exit_timeout_bounds_shutdown_with_a_hung_model(tmp_path_factory, model):
    root = repository(tmp_path_factory, "exit_hung")
    with start_server(root, "--exit-timeout-secs", str(EXIT_TIMEOUT_S)) as srv:
        traffic(srv)
        t, result, worker = hang(srv, model)
        family = srv.family()
        assert worker in family
        assert shm_segments(family), "segments exist: the hung request's input, the outputs"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            code = srv.proc.wait(EXIT_TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        assert code == 0, (code, took, srv.log()[-4000:])
        assert took <= EXIT_TIMEOUT_S + 1, (took, srv.log()[-4000:])
        # the hung request was answered, with the error naming the timeout
        t.join(5)
        assert not t.is_alive(), "the hung request got no answer"
        assert "error" in result, result
        e = result["error"]
        assert e.status() == "503", e
        assert e.message() == (f"model instance '{model}_0_0' of model '{model}' was still executing "
                               f"when the exit timeout of {EXIT_TIMEOUT_S} s ended and was "
                               f"stopped: the server is shutting down")
        assert EXIT_TIMEOUT_S - 0.5 <= result["at"] - t0 <= EXIT_TIMEOUT_S + 1, result["at"] - t0
        # nothing left: no process, no segment, no run directory
        assert not alive(family), (alive(family), srv.log()[-4000:])
        assert not shm_segments(family), shm_segments(family)
        assert not glob.glob(os.path.join(tempfile.gettempdir(), f"trireme-{srv.proc.pid}-*"))


@pytest.mark.parametrize("model", ["hang", "deadlock"])
def test_killed_scheduler_leaves_no_hung_worker(tmp_path_factory, model):
    """kill -9 of `trireme serve` while a model hangs in execute(): every child gets SIGTERM
    from the kernel (PR_SET_PDEATHSIG) and the hung worker obeys it too: at once when it
    hangs in Python, TERM_GRACE_S later when it is stuck in native code."""
    root = repository(tmp_path_factory, "kill_hung")
    with start_server(root) as srv:
        traffic(srv)
        t, result, worker = hang(srv, model)
        family = srv.family()
        children = family - {srv.proc.pid}
        t0 = time.monotonic()
        srv.proc.kill()
        srv.proc.wait(10)
        within = 5 if model == "hang" else TERM_GRACE_S + 5
        wait_until(lambda: not alive(children), within, "every child, the hung worker too, to exit")
        if model == "hang":   # it obeyed the SIGTERM: the guard had nothing to do
            assert time.monotonic() - t0 < TERM_GRACE_S + 1
            assert "after SIGTERM" not in srv.log(), srv.log()[-4000:]
        else:
            wait_until(lambda: "after SIGTERM" in srv.log(), 5, "the guard's word")
        wait_until(lambda: not shm_segments(family), 10, "their segments to go")
        t.join(10)
        assert not t.is_alive(), "the hung request's connection outlived the server"


def test_a_grpc_call_in_flight_at_exit_gets_the_exit_timeout_error(tmp_path_factory):
    """gRPC, like HTTP: a call held by a hung model at SIGTERM is answered with the exit
    timeout's error, not cut when the frontend stops listening."""
    root = repository(tmp_path_factory, "exit_grpc")
    with start_server(root, "--exit-timeout-secs", str(EXIT_TIMEOUT_S)) as srv:
        marker = srv.repo / "hang" / "hanging"
        result: dict = {}

        def send():
            c = grpcclient.InferenceServerClient(srv.grpc_url)
            try:
                inp = grpcclient.InferInput("IN", [4], "FP32")
                inp.set_data_from_numpy(np.ones(4, np.float32))
                result["value"] = c.infer("hang", [inp], client_timeout=60)
            except InferenceServerException as e:
                result["error"] = e
            finally:
                result["at"] = time.monotonic()
                c.close()
        t = threading.Thread(target=send, daemon=True)
        t.start()
        wait_until(lambda: marker.exists() or not t.is_alive(), 60, "the request to hang")
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(EXIT_TIMEOUT_S + 10) == 0
        t.join(5)
        assert not t.is_alive() and "error" in result, result
        e = result["error"]
        assert e.status() == "StatusCode.UNAVAILABLE", e
        assert e.message() == ("model instance 'hang_0_0' of model 'hang' was still executing "
                               f"when the exit timeout of {EXIT_TIMEOUT_S} s ended and was "
                               "stopped: the server is shutting down")
        assert result["at"] - t0 <= EXIT_TIMEOUT_S + 1, result["at"] - t0
