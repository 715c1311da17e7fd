"""Zero-downtime reload at c8: a model changed in the repository (poll mode) or loaded again
with a new config (explicit mode) keeps answering on its old instances until the new ones
are READY, then switches; a reload that fails leaves the old one serving. Eight clients send
back to back throughout, and no request fails.

Model `counter` (Python, FP32 [1]): OUT = IN + STEP, STEP written into its model.py, so an
answer says which instances gave it.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from conftest import start_server, wait_until

from tests.models_python import io_config, python_model

SOURCE = '''
import triton_python_backend_utils as pb_utils

STEP = {step}


class TritonPythonModel:
    def initialize(self, args):
        {init}

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + STEP)])
            for r in requests]
'''
IO = [("IN", "TYPE_FP32", "[ 1 ]")], [("OUT", "TYPE_FP32", "[ 1 ]")]


def write(repo: Path, step: float, init: str = "pass") -> None:
    (repo / "counter" / "1" / "model.py").write_text(SOURCE.format(step=step, init=init))


class Clients:
    """Eight threads sending `counter` requests back to back; each answer's STEP is kept,
    each failure too."""

    def __init__(self, server, n: int = 8) -> None:
        self.server = server
        self.steps: list[float] = []
        self.failures: list[object] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        c = httpclient.InferenceServerClient(self.server.http_url, network_timeout=30)
        x = np.array([float(k)], np.float32)
        inp = httpclient.InferInput("IN", [1], "FP32")
        inp.set_data_from_numpy(x)
        try:
            while not self.stop.is_set():
                try:
                    self.steps.append(float(c.infer("counter", [inp]).as_numpy("OUT")[0] - k))
                except Exception as e:   # noqa: BLE001 - any failure is what is counted
                    self.failures.append(e)
        finally:
            c.close()

    def answered(self) -> int:
        return len(self.steps)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def test_a_poll_mode_reload_and_a_failed_one_under_load(tmp_path):
    repo = tmp_path / "models"
    python_model(repo, "counter", "", io_config("counter", *IO))
    write(repo, 1.0)
    with start_server(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.3") as srv:
        clients = Clients(srv)
        try:
            wait_until(lambda: clients.answered() >= 50, 30, "answers from the first instances")
            write(repo, 2.0)   # changed: the next poll loads it beside the old one
            wait_until(lambda: clients.steps[-20:] == [2.0] * 20, 60, "the new instances' answers")
            n = clients.answered()
            write(repo, 3.0, 'raise RuntimeError("the new version cannot start")')
            wait_until(lambda: "the new version cannot start" in srv.log(), 60, "the failed reload")
            wait_until(lambda: clients.answered() >= n + 50, 30, "answers after the failed reload")
        finally:
            clients.finish()
        assert clients.failures == [], clients.failures[:3]
        assert set(clients.steps) == {1.0, 2.0}
        assert clients.steps[-50:] == [2.0] * 50   # the old (good) version serves on


def test_an_explicit_reload_with_a_new_config_under_load(tmp_path):
    repo = tmp_path / "models"
    python_model(repo, "counter", "", io_config("counter", *IO))
    write(repo, 1.0)
    config = {"name": "counter", "backend": "python", "max_batch_size": 0,
              "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
              "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}
    with start_server(repo, "--model-control-mode", "explicit", "--load-model", "counter") as srv:
        c = httpclient.InferenceServerClient(srv.http_url, network_timeout=60)
        clients = Clients(srv)
        try:
            wait_until(lambda: clients.answered() >= 50, 30, "answers before the reload")
            for count in (2, 1):
                n = clients.answered()
                c.load_model("counter", config=json.dumps(
                    {**config, "instance_group": [{"kind": "KIND_CPU", "count": count}]}))
                wait_until(lambda n=n: clients.answered() >= n + 50, 30, "answers after it")
                wait_until(lambda k=count: len(srv.workers("counter")) == k, 30,
                           f"{count} instance(s)")
        finally:
            clients.finish()
            c.close()
        assert clients.failures == [], clients.failures[:3]
        assert set(clients.steps) == {1.0}
