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
import glob
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from tritonclient.utils import InferenceServerException
from unix_sockets import direct_path_of, direct_sockets, queued_bytes

from tests.models_python import ADD_SUB, io_config, python_model

RESTART_DEADLINE_S = 30.0

FAILER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        raise RuntimeError("this model always fails")
'''

SLEEPER = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "started")

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy()
            with open(self.marker, "a") as f:
                f.write(f"{os.getpid()}\\n")
            time.sleep(float(seconds[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", seconds)]))
        return responses
'''

ADD_SUB_IO = ([("INPUT0", "TYPE_FP32", "[ 4 ]"), ("INPUT1", "TYPE_FP32", "[ 4 ]")],
              [("OUTPUT0", "TYPE_FP32", "[ 4 ]"), ("OUTPUT1", "TYPE_FP32", "[ 4 ]")])

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")
BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")
COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure",
            "nv_inference_count", "nv_inference_exec_count")


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

def worker(server, model: str) -> tuple[int, str]:
    """(pid, instance name) of the one worker titled 'trireme worker <instance> (<model> vN)'."""
    found = server.workers(model)
    assert len(found) == 1, f"workers of {model}: {found}"
    return found[0]


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


def started(repo: Path) -> int:
    """How many executions of 'sleeper' have begun."""
    try:
        return len((repo / "sleeper" / "started").read_text().splitlines())
    except FileNotFoundError:
        return 0


def kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _dead(pid), 10, f"pid {pid} to die")


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _try(fn) -> bool:
    try:
        fn()
        return True
    except InferenceServerException:
        return False


def canon(stat: dict) -> dict:
    def num(d: dict, key: str) -> int:
        return int(d.get(key, 0))

    def dur(d: dict) -> tuple[int, int]:
        return num(d, "count"), num(d, "ns")

    infer = stat.get("inference_stats", {})
    return {"inference_count": num(stat, "inference_count"),
            "execution_count": num(stat, "execution_count"),
            **{k: dur(infer.get(k, {})) for k in DURATIONS},
            "batch_stats": {num(b, "batch_size"): {k: dur(b.get(k, {})) for k in BATCH_DURATIONS}
                            for b in stat.get("batch_stats", [])}}


def stats(c, model: str) -> dict:
    (s,) = c.get_inference_statistics(model, "1")["model_stats"]
    return canon(s)


def delta(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    for k in DURATIONS:
        out[k] = (after[k][0] - before[k][0], after[k][1] - before[k][1])
    out["batch_stats"] = {}
    for bs, b in after["batch_stats"].items():
        prev = before["batch_stats"].get(bs, {})
        d = {k: (b[k][0] - prev.get(k, (0, 0))[0], b[k][1] - prev.get(k, (0, 0))[1])
             for k in BATCH_DURATIONS}
        if any(n for n, _ in d.values()):
            out["batch_stats"][bs] = d
    return out


def scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if name.split("{")[0] in COUNTERS and ('model="add_sub"' in name or
                                                  'model="failer"' in name):
                out[name] = float(value)
    return out


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


def _snapshot(server) -> tuple[dict, dict]:
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    try:
        return {m: stats(c, m) for m in ("add_sub", "failer")}, scrape(server)
    finally:
        c.close()


def _deltas(before, after) -> tuple[dict, dict]:
    s = {m: delta(before[0][m], after[0][m]) for m in before[0]}
    names = set(before[1]) | set(after[1])
    return s, {n: after[1].get(n, 0.0) - before[1].get(n, 0.0) for n in names}


def _expected(s: dict) -> bool:
    """What the sequence must leave: 25 successes of add_sub, 3 failures of failer."""
    return (s["add_sub"]["success"][0], s["add_sub"]["inference_count"],
            s["failer"]["fail"][0]) == (25, 25, 3)


def test_statistics_and_metrics_match_the_scheduled_path(direct, scheduled):
    before = _snapshot(direct)
    _sequence(direct)
    # exact right after the last response: the scheduler flushes its workers first
    d_stats, d_metrics = _deltas(before, _snapshot(direct))
    assert _expected(d_stats), d_stats

    before = _snapshot(scheduled)
    _sequence(scheduled)
    # (the scheduled path: a worker reports a batch just after answering it)
    wait_until(lambda: _expected(_deltas(before, _snapshot(scheduled))[0]), 10,
               "the scheduled path's statistics")
    s_stats, s_metrics = _deltas(before, _snapshot(scheduled))

    for model in ("add_sub", "failer"):
        d, s = d_stats[model], s_stats[model]
        assert (d["inference_count"], d["execution_count"]) == \
            (s["inference_count"], s["execution_count"]), (model, d, s)
        for k in DURATIONS:
            assert d[k][0] == s[k][0], (model, k, d[k], s[k])
            for got in (d, s):
                assert (got[k][1] > 0) == (got[k][0] > 0), (model, k, got[k])
        assert {bs: {k: n for k, (n, _) in b.items()} for bs, b in d["batch_stats"].items()} == \
            {bs: {k: n for k, (n, _) in b.items()} for bs, b in s["batch_stats"].items()}, \
            (model, d["batch_stats"], s["batch_stats"])
        for got in (d, s):
            for b in got["batch_stats"].values():
                for k, (n, ns) in b.items():
                    assert (ns > 0) == (n > 0), (model, k, got["batch_stats"])
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
    path = direct_path_of(pid)
    results: list[list] = []

    def send() -> None:
        got: list = []
        results.append(got)
        c = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
        try:
            sleep_request(c, 5)
            got.append("ok")
        except InferenceServerException as e:
            got.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=send, daemon=True) for _ in range(4)]
    n0 = started(repo)
    threads[0].start()
    wait_until(lambda: started(repo) > n0, 10, "the first request to run")
    # The worker runs it on its one loop: the others wait unread on its direct connection,
    # each adding to what is queued there.
    queued = queued_bytes(path)
    assert queued == 0
    for t in threads[1:]:
        t.start()
        wait_until(lambda q=queued: queued_bytes(path) > q, 10, "a request queued at the worker")
        queued = queued_bytes(path)
    assert started(repo) == n0 + 1 and all(t.is_alive() for t in threads), results
    kill_and_reap(pid)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a request hung after its worker died"
    # The scheduler's text for what it dispatched there, exit code included: it tells the
    # frontends when the worker exits (their connection closing says only that it did)
    text = (f"model instance '{instance}' of model 'sleeper' exited unexpectedly "
            "(exit code -9); the request was not completed")
    assert len(results) == 4 and all(len(r) == 1 for r in results), results
    for (e,) in results:
        assert isinstance(e, InferenceServerException), results
        assert (e.status(), e.message()) == ("500", text)

    wait_until(lambda: _try(lambda: sleep_request(client, 0)), RESTART_DEADLINE_S,
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
    wait_until(lambda: _try(lambda: sleep_request(client, 0)), RESTART_DEADLINE_S,
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
    from services.dataplane.client import DataPlane
    from services.dataplane.settings import DataPlaneSettings
    from services.dataplane.types import CoreRequest, InputTensor

    (run_dir,) = glob.glob(os.path.join(tempfile.gettempdir(), f"trireme-{direct.proc.pid}-*"))
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 2, np.float32)

    async def main():
        dp = DataPlane(DataPlaneSettings(f"unix://{run_dir}/frontends.sock",
                                         result_addr=f"unix://{run_dir}/results-test.sock",
                                         use_shm=False))
        await dp.start()
        try:
            # the scheduler's answer to our hello (a repository change: it drops the cache)
            deadline = time.monotonic() + 10
            while not dp.ready():
                assert time.monotonic() < deadline, "the scheduler never answered"
                await asyncio.sleep(0.01)
            info = await dp._info("add_sub")
            assert dp._models.get("add_sub") is info   # the cached one: requests use it
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
        finally:
            dp.close()

    out, resent = asyncio.run(main())
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert len(resent) == 1, resent
