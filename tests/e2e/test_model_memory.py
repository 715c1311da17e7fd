"""Memory-aware serving (services/scheduler/memory.py): --model-load-on-demand loads the
model an inference request names, --model-memory-budget keeps the models' instances within
a byte budget by evicting the least recently used idle ones, a pinned model stays.

Each model holds BALLAST_MB of its own (touched, so resident) beside what every Python
worker holds, so that a model's size is mostly its own. The size one model measures
(trireme_model_resident_bytes) sets the budgets: the budget of the shifting working set
holds five models and the pinned one.
"""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import ROOT, free_port, start_server, wait_until
from models_python import python_model
from tritonclient.utils import InferenceServerException

BALLAST_MB = 64
MODELS = [f"m{i:02d}" for i in range(20)]
PHASES = [MODELS[0:5], MODELS[5:10], MODELS[10:15], MODELS[15:20], MODELS[0:5]]

MODEL = f'''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.ballast = np.ones({BALLAST_MB} * 2**18, np.float32)   # resident: written
        self.offset = np.float32(float(args["model_name"][1:]) if args["model_name"][1:].isdigit()
                                 else -1.0)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + self.offset)])
            for r in requests]
'''

SLOW = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''


def config(name: str, pinned: bool = False) -> str:
    pin = ('parameters { key: "trireme.pinned" value { string_value: "true" } }\n'
           if pinned else "")
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'instance_group [ { count: 1 kind: KIND_CPU } ]\n' + pin)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("memory") / "models"
    for name in MODELS:
        python_model(root, name, MODEL, config(name))
    python_model(root, "pinned", MODEL, config("pinned", pinned=True))
    python_model(root, "slow", SLOW, config("slow"))
    return root


def infer(client: httpclient.InferenceServerClient, model: str) -> np.ndarray:
    x = np.arange(4, dtype=np.float32)
    i = httpclient.InferInput("INPUT0", [4], "FP32")
    i.set_data_from_numpy(x)
    return client.infer(model, [i]).as_numpy("OUTPUT0")


def expected(model: str) -> np.ndarray:
    return np.arange(4, dtype=np.float32) + float(model[1:])


def metrics(srv) -> str:
    with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
        return r.read().decode()


def resident(srv) -> dict[str, int]:
    """trireme_model_resident_bytes by model."""
    out: dict[str, int] = {}
    for model, n in re.findall(r'trireme_model_resident_bytes\{model="([^"]+)",version="\d+"\} (\d+)',
                               metrics(srv)):
        out[model] = out.get(model, 0) + int(n)
    return out


def counter(srv, family: str, model: str) -> int:
    m = re.search(rf'{family}\{{model="{model}"\}} (\d+)', metrics(srv))
    return int(m.group(1)) if m else 0


def workers_pss(srv) -> int:
    """The proportional set size of the server's model workers, together."""
    total = 0
    for p in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            if "services.workers" in " ".join(p.cmdline()):
                total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


@pytest.fixture(scope="module")
def on_demand(repo):
    """An on-demand server without a budget, and what one model measures alone on it."""
    with start_server(repo, "--model-control-mode", "explicit", "--model-load-on-demand", "true",
                      "--model-load-on-demand-timeout-secs", "1") as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        np.testing.assert_array_equal(infer(client, "m03"), expected("m03"))
        size = resident(srv)["m03"]
        client.close()
        yield srv, size


@pytest.fixture(scope="module")
def model_size(on_demand) -> int:
    size = on_demand[1]
    assert size > BALLAST_MB * 2**20, size   # the ballast is in what was measured
    return size


def test_load_on_demand(on_demand):
    srv, _ = on_demand
    client = httpclient.InferenceServerClient(srv.http_url)
    # A model that is not loaded is unknown to metadata (as in Triton) but an inference
    # request loads it: the index says it is READY afterwards
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("m04")
    assert e.value.status() == "404"
    assert "Request for unknown model: 'm04' is not found" in e.value.message()
    np.testing.assert_array_equal(infer(client, "m04"), expected("m04"))
    index = {r["name"]: r for r in client.get_model_repository_index()}
    assert index["m04"]["state"] == "READY"
    # Concurrent first requests share one load
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(infer(
        httpclient.InferenceServerClient(srv.http_url), "m05"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 4
    for r in results:
        np.testing.assert_array_equal(r, expected("m05"))
    assert counter(srv, "trireme_model_loads_total", "m05") == 1
    # A load longer than the timeout: 503 with the reason, and the load goes on
    with pytest.raises(InferenceServerException) as e:
        infer(client, "slow")
    assert e.value.status() == "503"
    assert e.value.message() == "'slow' is loading on demand and was not ready within 1 s"
    wait_until(lambda: client.is_model_ready("slow"), 30, "the slow model's load to end")
    np.testing.assert_array_equal(infer(client, "slow"), np.arange(4, dtype=np.float32))
    # A model the repository does not hold is still unknown
    with pytest.raises(InferenceServerException) as e:
        infer(client, "nope")
    assert e.value.message() == "Request for unknown model: 'nope' is not found"
    client.close()


@pytest.mark.timeout(400)
def test_a_shifting_working_set_within_a_budget(repo, model_size):
    """20 models, a budget that holds five and the pinned one: each phase asks for five
    others at c4; every request is answered with its model's output, the models measured
    stay within the budget, the least recently used idle ones are evicted, the pinned one
    never."""
    budget = int(6.5 * model_size)
    with start_server(repo, "--model-control-mode", "explicit", "--load-model", "pinned",
                      "--model-load-on-demand", "true", "--model-memory-budget", str(budget)) as srv:
        failures: list[str] = []
        peak_pss = 0
        for phase in PHASES:
            def drive(models: list[str]) -> None:
                client = httpclient.InferenceServerClient(srv.http_url)
                for _ in range(3):
                    for name in models:
                        try:
                            got = infer(client, name)
                            if not np.array_equal(got, expected(name)):
                                failures.append(f"{name}: {got}")
                        except InferenceServerException as e:
                            failures.append(f"{name}: {e}")
                client.close()
            threads = [threading.Thread(target=drive, args=(phase[i:] + phase[:i],))
                       for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(240)
                assert not t.is_alive()
            held = resident(srv)
            assert sum(held.values()) <= budget, (held, budget)
            assert set(phase) <= set(held), (phase, held, failures[:5])
            assert "pinned" in held
            peak_pss = max(peak_pss, workers_pss(srv))
        assert failures == []
        # Bounded: the workers hold what the budget allows (PSS is what the budget counts;
        # a tenth more for what moved since each worker measured itself)
        assert peak_pss <= budget * 1.1, (peak_pss, budget)
        client = httpclient.InferenceServerClient(srv.http_url)
        index = {r["name"]: r for r in client.get_model_repository_index()}
        evicted = [n for n in MODELS[5:20] if index[n].get("reason", "").startswith(
            "unloaded: evicted")]
        assert evicted, index
        assert index["m10"] == {"name": "m10", "version": "1", "state": "UNAVAILABLE",
                                "reason": "unloaded: evicted to fit the model memory budget "
                                          "(least recently used)"}
        assert index["pinned"]["state"] == "READY"
        assert counter(srv, "trireme_model_evictions_total", "pinned") == 0
        assert counter(srv, "trireme_model_evictions_total", "m00") == 1
        assert counter(srv, "trireme_model_loads_total", "m00") == 2
        assert "evicting 'm00'" in srv.log()
        client.close()


def test_no_room_while_the_budget_is_pinned(repo, model_size):
    """Nothing can be evicted (the budget is held by a pinned model): the request fails
    UNAVAILABLE at the timeout, naming what holds the budget; the server serves on."""
    budget = int(1.5 * model_size)
    with start_server(repo, "--model-control-mode", "explicit", "--load-model", "pinned",
                      "--model-load-on-demand", "true", "--model-memory-budget", str(budget),
                      "--model-load-on-demand-timeout-secs", "1") as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        with pytest.raises(InferenceServerException) as e:
            infer(client, "m01")
        assert e.value.status() == "503"
        assert e.value.message() == (f"failed to load 'm01': the model memory budget of {budget} "
                                     "bytes is held by models in use or pinned (pinned)")
        np.testing.assert_array_equal(infer(client, "pinned"), np.arange(4, dtype=np.float32) - 1)
        client.close()


@pytest.mark.parametrize("flag", [["--model-memory-budget", "1G"],
                                  ["--model-load-on-demand", "true"]])
def test_explicit_mode_only(repo, flag):
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model-repository", str(repo),
           "--http-port", str(free_port()), "--grpc-port", str(free_port()),
           "--metrics-port", str(free_port()), *flag]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == f"error: {flag[0]} needs --model-control-mode=explicit"


def test_budget_flag_text(repo):
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model-repository", str(repo),
           "--model-memory-budget", "lots"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert ("argument --model-memory-budget: expected a number of bytes >= 0 (suffixes K, M, G, "
            "Ki, Mi, Gi), got 'lots'") in r.stderr
