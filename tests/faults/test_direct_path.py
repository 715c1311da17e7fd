"""The direct path: requests to a version whose scheduler has nothing to decide per request
go from the frontend straight to an instance's worker (services/dataplane/direct.py,
services/workers/direct.py, services/scheduler/routes.py).

What a user can notice, checked here:
- the frontend really talks to the worker (a direct connection exists), and not with
  --direct-path false;
- statistics and metrics are the same on both paths, and exact right after a response;
- a worker killed with direct requests in flight fails each of them once, and the
  instance comes back;
- reloads while direct traffic runs lose nothing; an unload answers every request once;
- a cancelled (timed-out) direct request leaves the instance and the server serving;
- a request carrying a stale epoch is refused unrun by the worker and resent through the
  scheduler, so it still succeeds.

Two servers on one repository (explicit model control, so each loads only what it uses):
  direct   (the default): add_sub, failer, sleeper, reloadable
  scheduled (--direct-path false): add_sub, failer
Models (Python, one CPU instance each, no batching: every one qualifies for the path):
  add_sub     Triton's examples/add_sub, FP32 [4]
  failer      raises in execute() for every request
  sleeper     SECONDS FP32 [1] -> OUT: sleeps SECONDS, appends its pid to <model dir>/started
              when an execution begins
  reloadable  add_sub again, reloaded and unloaded by the reload test
"""
from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from direct_checks import (
    FAILER,
    SLEEPER,
    answers,
    assert_same_statistics,
    deltas,
    kill_while_queued,
    own_dataplane,
    snapshot,
    started,
    worker,
)
from tritonclient.utils import InferenceServerException
from unix_sockets import direct_sockets

from tests.models_python import ADD_SUB, io_config, python_model

RESTART_DEADLINE_S = 30.0

ADD_SUB_IO = ([("INPUT0", "TYPE_FP32", "[ 4 ]"), ("INPUT1", "TYPE_FP32", "[ 4 ]")],
              [("OUTPUT0", "TYPE_FP32", "[ 4 ]"), ("OUTPUT1", "TYPE_FP32", "[ 4 ]")])


# ---- servers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("direct") / "models"
    for name in ("add_sub", "reloadable"):
        python_model(root, name, ADD_SUB, io_config(name, *ADD_SUB_IO))
    python_model(root, "failer", FAILER, io_config(
        "failer", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    python_model(root, "sleeper", SLEEPER, io_config(
        "sleeper", [("SECONDS", "TYPE_FP32", "[ 1 ]")], [("OUT", "TYPE_FP32", "[ 1 ]")]))
    return root


def _loads(*names: str) -> list[str]:
    return ["--model-control-mode", "explicit",
            *(a for n in names for a in ("--load-model", n))]


@pytest.fixture(scope="module")
def direct(repo):
    with start_server(repo, *_loads("add_sub", "failer", "sleeper", "reloadable")) as srv:
        yield srv


@pytest.fixture(scope="module")
def scheduled(repo):
    with start_server(repo, "--direct-path", "false", *_loads("add_sub", "failer")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(direct):
    c = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
    yield c
    c.close()


# ---- helpers ------------------------------------------------------------------------------

def add_sub_inputs(module, a: np.ndarray, b: np.ndarray) -> list:
    inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def add_sub(c, module=httpclient, model: str = "add_sub", seed: int = 0) -> None:
    """One add_sub request; its answer checked."""
    a = np.arange(4, dtype=np.float32) + seed
    b = np.full(4, 0.5, np.float32)
    res = c.infer(model, add_sub_inputs(module, a, b))
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)


def sleep_request(c, seconds: float, module=httpclient, **kw):
    x = np.array([seconds], np.float32)
    inp = module.InferInput("SECONDS", [1], "FP32")
    inp.set_data_from_numpy(x)
    out = c.infer("sleeper", [inp], **kw).as_numpy("OUT")
    np.testing.assert_array_equal(out, x)


# ---- 1. the path is used ------------------------------------------------------------------

def test_requests_go_straight_to_the_worker(direct, scheduled, client):
    add_sub(client)
    pid, _ = worker(direct, "add_sub")
    socks = direct_sockets(pid)
    assert len(socks["listening"]) == 1, socks
    assert socks["connected"], f"no direct connection on the worker: {socks}"

    off = httpclient.InferenceServerClient(scheduled.http_url, network_timeout=60)
    try:
        add_sub(off)
    finally:
        off.close()
    pid, _ = worker(scheduled, "add_sub")
    socks = direct_sockets(pid)
    assert len(socks["listening"]) == 1, socks   # it listens, but nobody connects
    assert socks["connected"] == [], socks


# ---- 2. statistics and metrics are the same on both paths ---------------------------------

def _sequence(server) -> None:
    h = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for i in range(20):
            add_sub(h, seed=i)
        for i in range(5):
            add_sub(g, grpcclient, seed=i)
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([1], np.int32))
        for _ in range(3):
            with pytest.raises(InferenceServerException) as e:
                h.infer("failer", [x])
            assert e.value.status() == "500", e.value
            assert "this model always fails" in e.value.message(), e.value
    finally:
        h.close()
        g.close()


MODELS = ("add_sub", "failer")


def _expected(s: dict) -> bool:
    """What the sequence must leave: 25 successes of add_sub, 3 failures of failer."""
    return (s["add_sub"]["success"][0], s["add_sub"]["inference_count"],
            s["failer"]["fail"][0]) == (25, 25, 3)


def test_statistics_and_metrics_match_the_scheduled_path(direct, scheduled):
    before = snapshot(direct, MODELS)
    _sequence(direct)
    # exact right after the last response: the scheduler flushes its workers first
    d_stats, d_metrics = deltas(before, snapshot(direct, MODELS))
    assert _expected(d_stats), d_stats

    before = snapshot(scheduled, MODELS)
    _sequence(scheduled)
    # (the scheduled path: a worker reports a batch just after answering it)
    wait_until(lambda: _expected(deltas(before, snapshot(scheduled, MODELS))[0]), 10,
               "the scheduled path's statistics")
    s_stats, s_metrics = deltas(before, snapshot(scheduled, MODELS))

    assert_same_statistics(d_stats, s_stats)
    assert d_stats["add_sub"]["execution_count"] == 25
    assert d_stats["add_sub"]["fail"] == (0, 0) and d_stats["failer"]["success"] == (0, 0)

    assert d_metrics == s_metrics
    key = 'model="add_sub",version="1"'
    assert d_metrics[f"nv_inference_request_success{{{key}}}"] == 25
    assert d_metrics[f"nv_inference_count{{{key}}}"] == 25
    assert d_metrics[f"nv_inference_exec_count{{{key}}}"] == 25
    assert d_metrics['nv_inference_request_failure{model="failer",version="1",reason="BACKEND"}'] \
        == 3


# ---- 3. kill -9 with direct requests in flight --------------------------------------------

@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to see queued requests")
def test_killed_worker_fails_each_direct_request_once(direct, repo, client):
    sleep_request(client, 0)   # its route is known and connected
    pid, instance = worker(direct, "sleeper")

    n0 = started(repo)
    got = kill_while_queued(direct, repo, pid, lambda c: sleep_request(c, 5), 4)
    # The scheduler's text for what it dispatched there, exit code included: it tells the
    # frontends when the worker exits (their connection closing says only that it did)
    text = (f"model instance '{instance}' of model 'sleeper' exited unexpectedly "
            "(exit code -9); the request was not completed")
    for e in got:
        assert isinstance(e, InferenceServerException), got
        assert (e.status(), e.message()) == ("500", text)

    wait_until(lambda: answers(lambda: sleep_request(client, 0)), RESTART_DEADLINE_S,
               "'sleeper' to serve again")
    assert worker(direct, "sleeper")[0] != pid
    for _ in range(3):
        sleep_request(client, 0)
    assert started(repo) > n0 + 1   # the restarted instance ran them


# ---- 4. reload and unload under direct traffic --------------------------------------------

def _config(count: int) -> str:
    def io(items):
        return [{"name": n, "data_type": t, "dims": [4]} for n, t, _ in items]
    return json.dumps({"name": "reloadable", "backend": "python", "max_batch_size": 0,
                       "input": io(ADD_SUB_IO[0]), "output": io(ADD_SUB_IO[1]),
                       "instance_group": [{"kind": "KIND_CPU", "count": count}]})


class Traffic:
    """A thread sending 'reloadable' requests back to back. Each answer is kept with the
    phase the test was in when its request was sent and when it was answered: "ok", or the
    error's (status, message)."""

    def __init__(self, server) -> None:
        self.server = server
        self.phase = 0
        self.answers: list[tuple[int, int, object]] = []   # (sent in, answered in, answer)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        c = httpclient.InferenceServerClient(self.server.http_url, network_timeout=30)
        i = 0
        try:
            while not self.stop.is_set():
                sent = self.phase
                i += 1
                try:
                    add_sub(c, model="reloadable", seed=i)
                    answer: object = "ok"
                except InferenceServerException as e:
                    answer = (e.status(), e.message())
                except Exception as e:   # noqa: BLE001 - a wrong answer, a timeout: recorded
                    answer = repr(e)
                self.answers.append((sent, self.phase, answer))
        finally:
            c.close()

    def count(self, phase: int, ok: bool = True) -> int:
        """Requests sent and answered in ``phase``, successful (or not)."""
        return sum(1 for s, a, answer in list(self.answers)
                   if s == a == phase and (answer == "ok") == ok)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "a request hung"


UNLOADED = ("404", "Request for unknown model: 'reloadable' has no available versions")


def test_reload_and_unload_under_direct_traffic(direct):
    c = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
    traffic = Traffic(direct)
    try:
        wait_until(lambda: traffic.count(0) >= 10, 30, "traffic before the reloads")
        assert len(direct.workers("reloadable")) == 1
        for phase, count in ((1, 2), (2, 1)):
            c.load_model("reloadable", config=_config(count))
            traffic.phase = phase
            wait_until(lambda p=phase: traffic.count(p) >= 10, 30, f"traffic after reload {phase}")
            wait_until(lambda n=count: len(direct.workers("reloadable")) == n, 30,
                       f"{count} instance(s) of 'reloadable'")
        failures = [a for a in list(traffic.answers) if a[2] != "ok"]
        assert not failures, failures
        for pid, _ in direct.workers("reloadable"):
            assert direct_sockets(pid)["connected"], "the reloaded instance is not used directly"

        traffic.phase = 3   # answered from here on: correct, or the model is gone
        c.unload_model("reloadable")
        traffic.phase = 4   # sent from here on: the model is gone
        wait_until(lambda: traffic.count(4, ok=False) >= 5, 30, "requests after the unload")
    finally:
        traffic.finish()
        c.close()
    # every request answered before the unload began succeeded, the reloads' included
    before = [a for a in traffic.answers if a[1] < 3]
    assert all(a[2] == "ok" for a in before), [a for a in before if a[2] != "ok"]
    assert {a[0] for a in before} == {0, 1, 2}
    during = [a for a in traffic.answers if a[1] >= 3 and a[0] < 4]
    assert all(a[2] in ("ok", UNLOADED) for a in during), during
    after = [a for a in traffic.answers if a[0] == 4]
    assert after and all(a[2] == UNLOADED for a in after), after


# ---- 5. cancellation ----------------------------------------------------------------------

def test_cancelled_direct_request(direct, repo, client):
    wait_until(lambda: answers(lambda: sleep_request(client, 0)), RESTART_DEADLINE_S,
               "'sleeper' to serve")
    pid, _ = worker(direct, "sleeper")
    g = grpcclient.InferenceServerClient(direct.grpc_url)
    try:
        n0 = started(repo)
        with pytest.raises(InferenceServerException) as e:
            sleep_request(g, 2, grpcclient, client_timeout=0.3)
        assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED", e.value
        wait_until(lambda: started(repo) == n0 + 1, 10, "the request to reach the instance")
        sleep_request(g, 0, grpcclient)
        sleep_request(client, 0)
        assert g.is_server_ready() and g.is_model_ready("sleeper")
        assert worker(direct, "sleeper")[0] == pid   # the same instance serves on
        assert direct_sockets(pid)["connected"]
    finally:
        g.close()


# ---- 6. a stale epoch goes through the scheduler ------------------------------------------

def test_stale_epoch_is_resent_through_the_scheduler(direct):
    from services.dataplane.types import CoreRequest, InputTensor

    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 2, np.float32)

    async def main():
        async with own_dataplane(direct, "test") as dp:
            info = await dp.models.info("add_sub")
            assert dp.models.get("add_sub") is info   # the cached one: requests use it
            assert info.routes, "add_sub has no route"
            info.routes[0].epoch += 1000
            resent = []
            resend = dp._direct._resend

            def counting(msg, frames):
                resent.append(msg.req_id)
                resend(msg, frames)
            dp._direct._resend = counting
            req = CoreRequest("add_sub", inputs=[
                InputTensor("INPUT0", "FP32", [4], a.tobytes()),
                InputTensor("INPUT1", "FP32", [4], b.tobytes())])
            resp = await asyncio.wait_for(dp.infer(req), 30)
            out = {o.name: np.frombuffer(bytes(o.data), np.float32) for o in resp.outputs}
            dp.release(resp)
            return out, resent

    out, resent = asyncio.run(main())
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert len(resent) == 1, resent
