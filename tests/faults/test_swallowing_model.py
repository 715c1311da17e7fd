"""Fault injection: a Python model that hangs and swallows everything Python can raise in
it, the SystemExit of the worker's SIGTERM handler included:

    while True:
        try:
            time.sleep(0.05)
        except BaseException:
            pass

No handler around the model's code can stop such a model, so the worker's own shutdown
does not depend on it: TERM_GRACE_S after a SIGTERM the worker ends itself (its guard
thread), and whoever stops it (the scheduler, a worker host) SIGKILLs it at the same
time. An unload still gives the requests in flight --model-unload-timeout-secs, and a
server's shutdown --exit-timeout-secs: what becomes short is the time from the decision
to stop a worker to the worker being gone.

"swallow" hangs in execute() when IN[0] > 0 (after writing its pid to <model dir>/hanging);
"stuck_finalize" answers at once and hangs in finalize(); "clean" answers at once and
writes its pid to <model dir>/finalized in finalize(). Every wait polls with a deadline.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import alive, shm_segments, start_server, wait_until
from models_python import python_model
from tritonclient.utils import InferenceServerException

from services.common.procutil import TERM_GRACE_S

SWALLOW = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "hanging")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] > 0:
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                while True:
                    try:
                        time.sleep(0.05)
                    except BaseException:
                        pass
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
'''
STUCK_FINALIZE = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "finalizing")

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]

    def finalize(self):
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
        while True:
            try:
                time.sleep(0.05)
            except BaseException:
                pass
'''
CLEAN = '''
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "finalized")

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]

    def finalize(self):
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))
'''
CONFIG = '''
backend: "python"
max_batch_size: 0
input [{ name: "IN", data_type: TYPE_FP32, dims: [-1] }]
output [{ name: "OUT", data_type: TYPE_FP32, dims: [-1] }]
instance_group [{ kind: KIND_CPU, count: 1 }]
'''
UNLOAD_TIMEOUT_S = 1
EXIT_TIMEOUT_S = 1
GONE_WITHIN_S = 8.0    # a whole server with a swallowing worker: far below the old 10-30 s
MARGIN_S = 1.5         # process start-up and reaping on a busy 2-core machine


def repository(tmp_path_factory, name: str) -> Path:
    root = tmp_path_factory.mktemp(name) / "models"
    python_model(root, "swallow", SWALLOW, CONFIG)
    python_model(root, "stuck_finalize", STUCK_FINALIZE, CONFIG)
    python_model(root, "clean", CLEAN, CONFIG)
    return root


def infer(client, model: str, value: float, n: int = 4) -> np.ndarray:
    x = np.full(n, value, np.float32)
    inp = httpclient.InferInput("IN", [n], "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUT")


class Hung:
    """A request that hangs "swallow" (256 KiB: its input travels in shared memory), sent
    from a thread; returns once the model executes it. ``result``: its one outcome."""

    def __init__(self, srv, model: str = "swallow", n: int = 1 << 16) -> None:
        marker = srv.repo / model / "hanging"
        marker.unlink(missing_ok=True)
        self.result: dict = {}
        self.answers = 0
        self.thread = threading.Thread(target=self._send, args=(srv, model, n), daemon=True)
        self.thread.start()
        wait_until(lambda: marker.exists() or not self.thread.is_alive(), 60,
                   f"the request to {model} to execute")
        assert self.thread.is_alive(), self.result
        self.pid = int(wait_until(lambda: marker.read_text(), 10, "the marker's pid"))

    def _send(self, srv, model: str, n: int) -> None:
        c = httpclient.InferenceServerClient(srv.http_url, network_timeout=120)
        try:
            self.result["value"] = infer(c, model, 1.0, n)
        except InferenceServerException as e:
            self.result["error"] = e
        except Exception as e:   # noqa: BLE001 - a closed connection: allowed where it says
            self.result["broken"] = e
        finally:
            self.answers += 1
            self.result["at"] = time.monotonic()
            c.close()

    def outcome(self, timeout: float) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"no answer within {timeout} s"
        assert self.answers == 1
        return self.result


def gone(pid: int) -> bool:
    return not alive([pid])


def worker_of(srv, model: str) -> int:
    (pid, _), = wait_until(lambda: srv.workers(model), 30, f"{model}'s worker")
    return pid


# ------------------------------------------------------------------- unload, one server
@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    root = repository(tmp_path_factory, "swallow_explicit")
    with start_server(root, "--model-control-mode", "explicit", "--load-model", "swallow",
                      "--load-model", "stuck_finalize", "--load-model", "clean",
                      "--model-unload-timeout-secs", str(UNLOAD_TIMEOUT_S)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(explicit):
    c = httpclient.InferenceServerClient(explicit.http_url, network_timeout=60)
    yield c
    c.close()


def test_unload_of_a_model_swallowing_in_execute(explicit, client):
    """The request in flight gets the unload timeout, then the instance is killed: the
    unload returns and the worker is gone within the timeout + the grace, the request is
    answered once with the unload timeout's text, and the other models still serve."""
    np.testing.assert_array_equal(infer(client, "swallow", 0.0), np.zeros(4, np.float32))
    hung = Hung(explicit)
    t0 = time.monotonic()
    client.unload_model("swallow")
    took = time.monotonic() - t0
    assert UNLOAD_TIMEOUT_S <= took <= UNLOAD_TIMEOUT_S + TERM_GRACE_S + MARGIN_S, took
    wait_until(lambda: gone(hung.pid), UNLOAD_TIMEOUT_S + TERM_GRACE_S + MARGIN_S - took,
               "the swallowing worker to be gone")
    result = hung.outcome(5)
    assert "error" in result, result
    e = result["error"]
    assert e.status() == "503", e
    assert e.message() == ("model instance 'swallow_0_0' of model 'swallow' was still executing "
                           f"when the unload timeout of {UNLOAD_TIMEOUT_S} s ended and was stopped")
    assert not client.is_model_ready("swallow")
    wait_until(lambda: not shm_segments({hung.pid}), 10, "the killed worker's segments to go")
    np.testing.assert_array_equal(infer(client, "clean", 2.0), np.full(4, 2.0, np.float32))
    client.load_model("swallow")   # and it loads and serves again
    np.testing.assert_array_equal(infer(client, "swallow", 0.0), np.zeros(4, np.float32))


def test_unload_of_a_model_swallowing_in_finalize(explicit, client):
    """An idle instance whose finalize() hangs and swallows the SIGTERM: the unload returns
    TERM_GRACE_S after its SIGTERM, with the worker gone."""
    np.testing.assert_array_equal(infer(client, "stuck_finalize", 3.0), np.full(4, 3.0, np.float32))
    pid = worker_of(explicit, "stuck_finalize")
    marker = explicit.repo / "stuck_finalize" / "finalizing"
    marker.unlink(missing_ok=True)
    t0 = time.monotonic()
    client.unload_model("stuck_finalize")
    took = time.monotonic() - t0
    assert marker.exists(), "finalize() ran (and hung)"
    assert took <= TERM_GRACE_S + MARGIN_S, took
    wait_until(lambda: gone(pid), MARGIN_S, "the worker to be gone")
    assert not client.is_model_ready("stuck_finalize")
    wait_until(lambda: not shm_segments({pid}), 10, "its segments to go")
    np.testing.assert_array_equal(infer(client, "clean", 2.0), np.full(4, 2.0, np.float32))


def test_sigterm_to_a_worker_swallowing_in_execute(explicit, client):
    """A SIGTERM that reaches the worker itself (a container's or a service manager's stop
    signals every process) while its model swallows everything: the worker ends itself
    TERM_GRACE_S later; its request fails once as a worker exit; the instance restarts."""
    if not client.is_model_ready("swallow"):
        client.load_model("swallow")
    hung = Hung(explicit)
    t0 = time.monotonic()
    os.kill(hung.pid, signal.SIGTERM)
    wait_until(lambda: gone(hung.pid), TERM_GRACE_S + MARGIN_S, "the worker to end itself")
    took = time.monotonic() - t0
    assert took >= TERM_GRACE_S - 0.5, f"{took}: the model swallowed the SIGTERM, yet it ended"
    result = hung.outcome(10)
    assert "error" in result, result
    assert result["error"].status() == "500", result["error"]
    assert "exited unexpectedly" in result["error"].message(), result["error"].message()
    wait_until(lambda: not shm_segments({hung.pid}), 10, "its segments to go")
    wait_until(lambda: client.is_model_ready("swallow"), 60, "swallow to be back")
    np.testing.assert_array_equal(infer(client, "swallow", 0.0), np.zeros(4, np.float32))


def test_a_worker_that_does_not_hang_exits_cleanly_on_sigterm(explicit, client):
    """No regression: SIGTERM to an idle worker runs finalize() and ends it at once (not by
    the guard); an unload does the same."""
    np.testing.assert_array_equal(infer(client, "clean", 1.0), np.ones(4, np.float32))
    marker = explicit.repo / "clean" / "finalized"
    pid = worker_of(explicit, "clean")
    marker.unlink(missing_ok=True)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: gone(pid), TERM_GRACE_S, "the clean worker to exit")
    assert time.monotonic() - t0 < TERM_GRACE_S / 2
    assert marker.read_text() == str(pid), "finalize() ran"
    assert f"worker clean_0_0 (pid {pid}) exited with code 0" in explicit.log(), \
        explicit.log()[-4000:]
    wait_until(lambda: client.is_model_ready("clean"), 60, "clean to be back")
    np.testing.assert_array_equal(infer(client, "clean", 1.0), np.ones(4, np.float32))
    pid = worker_of(explicit, "clean")
    marker.unlink()
    t0 = time.monotonic()
    client.unload_model("clean")
    assert time.monotonic() - t0 < TERM_GRACE_S / 2
    assert marker.read_text() == str(pid)
    assert gone(pid)


# ------------------------------------------------------------------- the server's SIGTERM
def stopped(srv, within: float) -> tuple[int | None, float]:
    t0 = time.monotonic()
    try:
        code = srv.proc.wait(within)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - t0


def test_sigterm_to_the_server_with_a_model_swallowing_in_execute(tmp_path_factory):
    """SIGTERM to `trireme serve`: the request in flight gets --exit-timeout-secs, then its
    instance is killed; every process is gone well within GONE_WITHIN_S, the client has
    its answer, nothing is left in /dev/shm."""
    root = repository(tmp_path_factory, "swallow_serve")
    with start_server(root, "--exit-timeout-secs", str(EXIT_TIMEOUT_S)) as srv:
        hung = Hung(srv)
        family = srv.family()
        srv.proc.send_signal(signal.SIGTERM)
        code, took = stopped(srv, GONE_WITHIN_S)
        assert code == 0, (code, took, srv.log()[-4000:])
        assert took <= EXIT_TIMEOUT_S + MARGIN_S, (took, srv.log()[-4000:])
        wait_until(lambda: not alive(family), GONE_WITHIN_S - took, "every child to exit")
        result = hung.outcome(5)
        assert "error" in result or "broken" in result, result
        if "error" in result:
            assert result["error"].status() == "503", result["error"]
            assert "exit timeout" in result["error"].message(), result["error"].message()
        assert not shm_segments(family), shm_segments(family)


def test_sigterm_to_every_process_with_a_model_swallowing_in_execute(tmp_path_factory):
    """SIGTERM to every process of the server at once (systemd's control-group stop, a
    container runtime signalling the group), with the default exit timeout (30 s): the
    swallowing worker ends itself TERM_GRACE_S later, and then nothing waits for it."""
    root = repository(tmp_path_factory, "swallow_group")
    with start_server(root) as srv:
        hung = Hung(srv)
        family = srv.family()
        assert hung.pid in family
        t0 = time.monotonic()
        for pid in family:
            try:
                psutil.Process(pid).send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        code, _ = stopped(srv, GONE_WITHIN_S)
        took = time.monotonic() - t0
        assert code == 0, (code, took, srv.log()[-4000:])
        assert took <= TERM_GRACE_S + MARGIN_S + 1, (took, srv.log()[-4000:])
        wait_until(lambda: not alive(family), GONE_WITHIN_S - took, "every child to exit")
        result = hung.outcome(5)
        assert "value" not in result, result   # an error or a closed connection, not a hang
        assert not shm_segments(family), shm_segments(family)
