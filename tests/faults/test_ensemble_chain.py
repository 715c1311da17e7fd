"""Ensembles a frontend runs over its steps' routes (services/dataplane/chain.py): steps that
can only run one after another, each going straight to its model's worker.

What a user can notice, checked here:
- answers, error texts, statistics and metrics are those of the scheduler's ensemble
  (--direct-path false), and only the steps leading to the requested outputs run;
- a step's worker killed with chained requests in flight fails each of them once, in the
  ensemble's words, and the instance comes back;
- a cancelled (timed-out) chained request counts as a failure once its step is done, and
  the instance serves on;
- a step refused for a stale epoch is resent through the scheduler alone: the steps
  before it do not run again.

Two servers on one repository (explicit model control):
  direct    (the default): chain, fail_chain, slow_chain and their steps
  scheduled (--direct-path false): chain, fail_chain and their steps
Models (Python, one CPU instance each, no batching):
  add_sub     Triton's examples/add_sub, FP32 [4]
  scale       OUT = 2 * IN, FP32 [4]
  failer      raises in execute() for every request
  passer      OUT = IN, FP32 [1]
  sleeper     sleeps SECONDS, appends its pid to <model dir>/started when it begins
Ensembles:
  chain       add_sub (OUTPUT0 -> sum, OUTPUT1 -> DIFF) -> scale (sum -> SCALED)
  fail_chain  failer
  slow_chain  passer -> sleeper
"""
from __future__ import annotations

import asyncio
import shutil
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
    stats,
    worker,
)
from tritonclient.utils import InferenceServerException
from unix_sockets import direct_sockets

from tests.models_python import ADD_SUB, SCALE, io_config, python_model

RESTART_DEADLINE_S = 30.0

PASSER = SCALE.replace("2 * ", "")

F4, F1 = ("TYPE_FP32", "[ 4 ]"), ("TYPE_FP32", "[ 1 ]")


def _ensemble(root: Path, name: str, inputs: list[tuple[str, str, str]],
              outputs: list[tuple[str, str, str]], steps: list[tuple[str, dict, dict]]) -> None:
    def io(kind: str, items) -> str:
        return "".join(f'{kind} {{ name: "{n}" data_type: {t} dims: {d} }}\n' for n, t, d in items)

    def maps(kind: str, m: dict) -> str:
        return " ".join(f'{kind} {{ key: "{k}" value: "{v}" }}' for k, v in m.items())

    body = ", ".join(f'{{ model_name: "{model}" model_version: -1 {maps("input_map", i)} '
                     f'{maps("output_map", o)} }}' for model, i, o in steps)
    d = root / name
    (d / "1").mkdir(parents=True)
    (d / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 0\n{io("input", inputs)}'
        f'{io("output", outputs)}ensemble_scheduling {{ step [ {body} ] }}\n')


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chain") / "models"
    python_model(root, "add_sub", ADD_SUB, io_config(
        "add_sub", [("INPUT0", *F4), ("INPUT1", *F4)], [("OUTPUT0", *F4), ("OUTPUT1", *F4)]))
    python_model(root, "scale", SCALE, io_config("scale", [("IN", *F4)], [("OUT", *F4)]))
    python_model(root, "failer", FAILER, io_config(
        "failer", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    python_model(root, "passer", PASSER, io_config("passer", [("IN", *F1)], [("OUT", *F1)]))
    python_model(root, "sleeper", SLEEPER, io_config(
        "sleeper", [("SECONDS", *F1)], [("OUT", *F1)]))
    _ensemble(root, "chain", [("A", *F4), ("B", *F4)], [("SCALED", *F4), ("DIFF", *F4)], [
        ("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "sum", "OUTPUT1": "DIFF"}),
        ("scale", {"IN": "sum"}, {"OUT": "SCALED"})])
    _ensemble(root, "fail_chain", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")],
              [("failer", {"X": "X"}, {"Y": "Y"})])
    _ensemble(root, "slow_chain", [("SECONDS", *F1)], [("OUT", *F1)], [
        ("passer", {"IN": "SECONDS"}, {"OUT": "mid"}),
        ("sleeper", {"SECONDS": "mid"}, {"OUT": "OUT"})])
    return root


def _loads(*names: str) -> list[str]:
    return ["--model-control-mode", "explicit",
            *(a for n in names for a in ("--load-model", n))]


@pytest.fixture(scope="module")
def direct(repo):
    with start_server(repo, *_loads("chain", "fail_chain", "slow_chain")) as srv:
        yield srv


@pytest.fixture(scope="module")
def scheduled(repo):
    with start_server(repo, "--direct-path", "false", *_loads("chain", "fail_chain")) as srv:
        yield srv


# ---- requests -----------------------------------------------------------------------------

def chain_request(c, module=httpclient, seed: int = 0, only_diff: bool = False) -> None:
    """One request to 'chain'; its answer checked exactly."""
    a = np.arange(4, dtype=np.float32) + seed
    b = np.full(4, 0.5, np.float32)
    inputs = [module.InferInput("A", [4], "FP32"), module.InferInput("B", [4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    outputs = [module.InferRequestedOutput("DIFF")] if only_diff else None
    res = c.infer("chain", inputs, outputs=outputs)
    np.testing.assert_array_equal(res.as_numpy("DIFF"), a - b)
    if only_diff:
        assert res.as_numpy("SCALED") is None
    else:
        np.testing.assert_array_equal(res.as_numpy("SCALED"), 2 * (a + b))


def fail_request(c) -> tuple[str, str]:
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException) as e:
        c.infer("fail_chain", [x])
    return e.value.status(), e.value.message()


def slow_request(c, seconds: float, module=httpclient, **kw) -> None:
    x = np.array([seconds], np.float32)
    inp = module.InferInput("SECONDS", [1], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("slow_chain", [inp], **kw).as_numpy("OUT"), x)


MODELS = ("chain", "add_sub", "scale", "fail_chain", "failer")


# ---- 1. the same answers, errors and statistics as the scheduler's ensemble ---------------

def _sequence(server) -> list[tuple[str, str]]:
    h = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for i in range(10):
            chain_request(h, seed=i)
        for i in range(5):
            chain_request(g, grpcclient, seed=i)
        for i in range(2):
            chain_request(h, seed=i, only_diff=True)
        return [fail_request(h) for _ in range(3)]
    finally:
        h.close()
        g.close()


def _expected(s: dict) -> bool:
    return (s["chain"]["success"][0], s["scale"]["execution_count"],
            s["fail_chain"]["fail"][0]) == (17, 15, 3)


def test_chain_answers_as_the_scheduled_ensemble(direct, scheduled):
    errors = {}
    results = {}
    for name, server in (("direct", direct), ("scheduled", scheduled)):
        h = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        try:   # (a frontend learns the steps' routes with its first request)
            chain_request(h)
            fail_request(h)
        finally:
            h.close()
        before = snapshot(server, MODELS)
        errors[name] = _sequence(server)
        # exact right after the last response on the chain: the scheduler asks its
        # frontends and workers first (the scheduled path: a worker reports just after)
        wait_until(lambda s=server, b=before: _expected(deltas(b, snapshot(s, MODELS))[0]), 10,
                   f"the {name} statistics")
        results[name] = deltas(before, snapshot(server, MODELS))
        if name == "direct":
            assert _expected(results[name][0]), results[name][0]
            pid, _ = worker(server, "scale")   # the frontend sent it the steps itself
            assert direct_sockets(pid)["connected"], "no direct connection to the step"

    # Triton's text: the step's error (the Python traceback included) after the prefix
    assert errors["direct"] == errors["scheduled"], errors
    status, text = errors["direct"][0]
    assert status == "500" and text.startswith(
        "in ensemble 'fail_chain', Failed to process the request(s) for model 'failer_0_0', "
        "message: RuntimeError: this model always fails\n"), text

    (d_stats, d_metrics), (s_stats, s_metrics) = results["direct"], results["scheduled"]
    assert_same_statistics(d_stats, s_stats, ensembles=("chain", "fail_chain"))
    # only the steps leading to the requested outputs ran: DIFF alone skips scale
    assert (d_stats["add_sub"]["execution_count"], d_stats["scale"]["execution_count"]) == (17, 15)
    # an answered ensemble request is one execution of its batch size (Triton's RequestTracker)
    assert d_stats["chain"]["inference_count"] == 17 and d_stats["chain"]["execution_count"] == 17
    assert d_metrics == s_metrics
    assert d_metrics['nv_inference_request_success{model="chain",version="1"}'] == 17
    assert d_metrics['nv_inference_request_failure{model="fail_chain",version="1",'
                     'reason="OTHER"}'] == 3


# ---- 2. kill -9 of a step's worker with chained requests in flight ------------------------

@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to see queued requests")
def test_killed_step_worker_fails_each_chained_request_once(direct, repo):
    c = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
    try:
        wait_until(lambda: answers(lambda: slow_request(c, 0)), RESTART_DEADLINE_S,
                   "'slow_chain' to serve")
        slow_request(c, 0)   # its steps' routes are known and connected
    finally:
        c.close()
    pid, instance = worker(direct, "sleeper")

    got = kill_while_queued(direct, repo, pid, lambda c: slow_request(c, 5), 3)
    text = (f"in ensemble 'slow_chain', model instance '{instance}' of model 'sleeper' exited "
            "unexpectedly (exit code -9); the request was not completed")
    for e in got:
        assert isinstance(e, InferenceServerException), got
        assert (e.status(), e.message()) == ("500", text)

    c = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
    try:
        wait_until(lambda: answers(lambda: slow_request(c, 0)), RESTART_DEADLINE_S,
                   "'slow_chain' to serve again")
        assert worker(direct, "sleeper")[0] != pid
        for _ in range(3):
            slow_request(c, 0)
    finally:
        c.close()


# ---- 3. cancellation ----------------------------------------------------------------------

def test_cancelled_chained_request(direct, repo):
    h = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
    g = grpcclient.InferenceServerClient(direct.grpc_url)
    try:
        wait_until(lambda: answers(lambda: slow_request(h, 0)), RESTART_DEADLINE_S,
                   "'slow_chain' to serve")
        slow_request(h, 0)
        pid, _ = worker(direct, "sleeper")
        failed = stats(h, "slow_chain")["fail"][0]
        n0 = started(repo)
        with pytest.raises(InferenceServerException) as e:
            slow_request(g, 2, grpcclient, client_timeout=0.3)
        assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED", e.value
        wait_until(lambda: started(repo) == n0 + 1, 10, "the step to reach its instance")
        # answered CANCELLED once its step is done: a failure of the ensemble
        wait_until(lambda: stats(h, "slow_chain")["fail"][0] == failed + 1, 10,
                   "the cancelled request's failure")
        slow_request(g, 0, grpcclient)
        slow_request(h, 0)
        assert worker(direct, "sleeper")[0] == pid   # the same instance serves on
        assert stats(h, "slow_chain")["fail"][0] == failed + 1
    finally:
        g.close()
        h.close()


# ---- 4. a stale step goes through the scheduler, alone ------------------------------------

def test_stale_step_is_resent_alone(direct):
    from services.dataplane.types import CoreRequest, InputTensor

    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 2, np.float32)
    c = httpclient.InferenceServerClient(direct.http_url, network_timeout=60)
    before = {m: stats(c, m) for m in ("add_sub", "scale")}

    async def main():
        async with own_dataplane(direct, "chain") as dp:
            infos = {m: await dp.models.info(m) for m in ("chain", "add_sub", "scale")}
            assert infos["chain"].chain and infos["scale"].routes
            for route in infos["scale"].routes:
                route.epoch += 1000
            resent = []
            resend = dp._direct._resend

            def counting(msg, frames):
                resent.append(msg.model)
                resend(msg, frames)
            dp._direct._resend = counting
            req = CoreRequest("chain", inputs=[InputTensor("A", "FP32", [4], a.tobytes()),
                                               InputTensor("B", "FP32", [4], b.tobytes())])
            resp = await asyncio.wait_for(dp.infer(req), 30)
            out = {o.name: np.frombuffer(bytes(o.data), np.float32) for o in resp.outputs}
            dp.release(resp)
            return out, resent

    try:
        out, resent = asyncio.run(main())
        np.testing.assert_array_equal(out["SCALED"], 2 * (a + b))
        np.testing.assert_array_equal(out["DIFF"], a - b)
        assert resent == ["scale"], resent
        after = {m: stats(c, m) for m in ("add_sub", "scale")}
        assert [after[m]["execution_count"] - before[m]["execution_count"]
                for m in ("add_sub", "scale")] == [1, 1]
    finally:
        c.close()
