"""Fault injection: a Python model hangs in execute() (time.sleep(600)).

Without the execution watchdog (Triton has none, so it is off by default) a hung request
waits until its model is unloaded: the unload waits --model-unload-timeout-secs for it,
then kills the instance, and the request fails UNAVAILABLE naming that timeout. With the
watchdog (--model-execution-timeout-secs, or the model's `execution_timeout_secs` config
parameter, which overrides the flag), an instance that stays in one execution longer
than the limit is killed and restarted: its request fails UNAVAILABLE naming the limit,
the model is not ready until the instance is back, then serves again.

The model hangs when the first element of its input is positive, and answers at once
otherwise; before it hangs it creates the file "hanging" in its model folder, which is
how a test knows the request is executing (no sleeps: every wait polls with a deadline).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import shm_segments, start_server, wait_until
from models_python import HANG, python_model
from tritonclient.utils import InferenceServerException


def hang_config(param: str | None = None) -> str:
    extra = ("" if param is None else
             f'parameters {{ key: "execution_timeout_secs" value {{ string_value: "{param}" }} }}\n')
    return ('backend: "python"\nmax_batch_size: 0\n'
            'input [{ name: "IN", data_type: TYPE_FP32, dims: [-1] }]\n'
            'output [{ name: "OUT", data_type: TYPE_FP32, dims: [-1] }]\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n' + extra)


def watchdog_text(model: str, limit: str) -> str:
    return (f"model instance '{model}_0_0' of model '{model}' exceeded the execution timeout "
            f"of {limit} s and was restarted")


RESTART_DEADLINE_S = 60.0


def hang_model(root: Path, name: str, param: str | None = None) -> None:
    python_model(root, name, HANG, hang_config(param))


def infer(client, model: str, value: float, n: int = 4) -> np.ndarray:
    x = np.full(n, value, np.float32)
    inp = httpclient.InferInput("IN", [n], "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp]).as_numpy("OUT")


class Hung:
    """A request that hangs its model, sent from a thread; `result` is filled on answer."""

    def __init__(self, server, model: str, n: int = 4) -> None:
        self.marker = server.repo / model / "hanging"
        self.marker.unlink(missing_ok=True)
        self.result: dict = {}
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._send, args=(server, model, n), daemon=True)
        self.thread.start()
        wait_until(lambda: self.marker.exists() or not self.thread.is_alive(), 60,
                   f"the request to {model} to start executing")
        assert self.thread.is_alive(), self.result
        self.pid = int(wait_until(lambda: self.marker.read_text(), 10, "the marker's pid"))

    def _send(self, server, model: str, n: int) -> None:
        c = httpclient.InferenceServerClient(server.http_url, network_timeout=900)
        try:
            self.result["value"] = infer(c, model, 1.0, n)
        except InferenceServerException as e:
            self.result["error"] = e
        except Exception as e:   # noqa: BLE001 - a connection cut: reported by the test
            self.result["broken"] = e
        finally:
            self.result["elapsed"] = time.monotonic() - self.t0
            c.close()

    def answer(self, timeout: float) -> InferenceServerException:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"no answer within {timeout} s"
        assert "error" in self.result, self.result
        return self.result["error"]


def index_state(client, model: str) -> tuple[str, str]:
    (e,) = [e for e in client.get_model_repository_index() if e["name"] == model]
    return e.get("state", ""), e.get("reason", "")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------- watchdog off (explicit mode)
@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    root = tmp_path_factory.mktemp("hung_explicit") / "models"
    hang_model(root, "hang")
    hang_model(root, "hang_param", "1")        # the parameter turns the watchdog on alone
    hang_model(root, "bad_param", "soon")
    with start_server(root, "--model-control-mode", "explicit", "--load-model", "hang",
                      "--load-model", "hang_param", "--model-unload-timeout-secs", "2",
                      "--exit-timeout-secs", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def client_x(explicit):
    c = httpclient.InferenceServerClient(explicit.http_url, network_timeout=120)
    yield c
    c.close()


def test_unload_of_a_hung_model_is_bounded(explicit, client_x):
    """Watchdog off: the request hangs until the model is unloaded; the unload waits
    --model-unload-timeout-secs (2) for it, then kills the instance: it returns within
    2 + 1 s and the hung request fails UNAVAILABLE naming the unload timeout."""
    np.testing.assert_array_equal(infer(client_x, "hang", 0.0), np.zeros(4, np.float32))
    hung = Hung(explicit, "hang")
    t0 = time.monotonic()
    client_x.unload_model("hang")
    took = time.monotonic() - t0
    assert 2.0 <= took <= 3.0, took
    e = hung.answer(5)
    assert e.status() == "503", e
    assert e.message() == ("model instance 'hang_0_0' of model 'hang' was still executing when "
                           "the unload timeout of 2 s ended and was stopped")
    wait_until(lambda: gone(hung.pid), 5, "the hung worker to be gone")
    assert not client_x.is_model_ready("hang")
    assert index_state(client_x, "hang") == ("UNAVAILABLE", "unloaded")
    wait_until(lambda: not shm_segments({hung.pid}), 10, "the killed worker's segments to go")
    # and it loads and serves again
    client_x.load_model("hang")
    np.testing.assert_array_equal(infer(client_x, "hang", 0.0), np.zeros(4, np.float32))


def test_model_parameter_turns_the_watchdog_on(explicit, client_x):
    """No server flag; the model's execution_timeout_secs "1" applies to it alone."""
    np.testing.assert_array_equal(infer(client_x, "hang_param", 0.0), np.zeros(4, np.float32))
    hung = Hung(explicit, "hang_param")
    e = hung.answer(1 + 5)
    assert e.status() == "503", e
    assert e.message() == watchdog_text("hang_param", "1")
    assert hung.result["elapsed"] <= 1 + 1, hung.result["elapsed"]
    assert not client_x.is_model_ready("hang_param")
    wait_until(lambda: client_x.is_model_ready("hang_param"), RESTART_DEADLINE_S,
               "hang_param to be ready again")
    np.testing.assert_array_equal(infer(client_x, "hang_param", 0.0), np.zeros(4, np.float32))
    assert gone(hung.pid)


def test_invalid_parameter_fails_the_load(explicit, client_x):
    with pytest.raises(InferenceServerException) as ei:
        client_x.load_model("bad_param")
    assert ("parameter 'execution_timeout_secs' must be a number of seconds >= 0 (0: no "
            "limit), got 'soon'") in ei.value.message(), ei.value.message()
    assert index_state(client_x, "bad_param")[0] == "UNAVAILABLE"


# --------------------------------------------------------------- watchdog on (server flag)
@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    root = tmp_path_factory.mktemp("hung_watched") / "models"
    hang_model(root, "hang")
    hang_model(root, "hang_off", "0")          # opts out of the server's limit
    with start_server(root, "--model-execution-timeout-secs", "2",
                      "--exit-timeout-secs", "2") as srv:
        yield srv


@pytest.fixture(scope="module")
def client_w(watched):
    c = httpclient.InferenceServerClient(watched.http_url, network_timeout=120)
    yield c
    c.close()


def test_watchdog_kills_and_restarts_a_hung_instance(watched, client_w):
    np.testing.assert_array_equal(infer(client_w, "hang", 0.0), np.zeros(4, np.float32))
    hung = Hung(watched, "hang", n=1 << 16)    # 256 KiB: the input is in shared memory
    e = hung.answer(2 + 5)
    assert e.status() == "503", e
    assert e.message() == watchdog_text("hang", "2")
    assert 2 <= hung.result["elapsed"] <= 2 + 1, hung.result["elapsed"]
    # not ready while it has no live instance, and it says why
    assert not client_w.is_model_ready("hang")
    state, reason = index_state(client_w, "hang")
    assert (state, reason) == ("LOADING", watchdog_text("hang", "2"))
    with pytest.raises(InferenceServerException) as ei:   # turned away, not queued
        infer(client_w, "hang", 0.0)
    assert ei.value.status() in ("404", "503"), ei.value   # Triton's "no available versions"
    # back: READY, serving, a new worker; the killed one left nothing behind
    wait_until(lambda: client_w.is_model_ready("hang"), RESTART_DEADLINE_S, "hang to be ready again")
    assert index_state(client_w, "hang")[0] == "READY"
    np.testing.assert_array_equal(infer(client_w, "hang", 0.0), np.zeros(4, np.float32))
    assert gone(hung.pid)
    wait_until(lambda: not shm_segments({hung.pid}), 10, "the killed worker's segments to go")
    assert "exceeded the execution timeout of 2 s" in watched.log()
    # and it is watched again after the restart
    again = Hung(watched, "hang")
    assert again.pid != hung.pid
    assert again.answer(2 + 5).message() == watchdog_text("hang", "2")
    wait_until(lambda: client_w.is_model_ready("hang"), RESTART_DEADLINE_S, "hang to be ready again")


def test_model_parameter_zero_opts_out(watched, client_w):
    """execution_timeout_secs "0" overrides the server's 2 s: while "hang" is caught by the
    watchdog, "hang_off", hung since before, keeps running (and is ready)."""
    wait_until(lambda: client_w.is_model_ready("hang"), RESTART_DEADLINE_S, "hang to be ready")
    off = Hung(watched, "hang_off")
    caught = Hung(watched, "hang")
    assert caught.answer(2 + 5).message() == watchdog_text("hang", "2")
    # hang_off has now run longer than 2 s too
    assert time.monotonic() - off.t0 > 2
    assert off.thread.is_alive(), off.result
    assert not gone(off.pid)
    assert client_w.is_model_ready("hang_off")
    os.kill(off.pid, signal.SIGKILL)      # end it: its request fails (the crash path)
    assert off.answer(30).status() == "500"
