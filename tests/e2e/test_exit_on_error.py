"""A model that fails to load at start-up, as Triton 2.51 answers it (asked on the same
repository): with --exit-on-error (the default) the server stops, exit code 1, "error:
creating server: Internal - failed to load all models" last on stderr, no process left;
with --exit-on-error=false the others serve, the failed ones are UNAVAILABLE in the index
with their reasons, not ready, and the server is not ready under --strict-readiness (the
default) but is without it.

Repository: `good` (a Python identity), `broken` (a config.pbtxt that does not parse),
`failinit` (a Python model whose initialize() raises).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import ROOT, start_server, wait_until
from tritonclient.utils import InferenceServerException

from tests.models_python import IDENTITY, io_config, python_model

FAILS_INIT = '''
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("boom")

    def execute(self, requests):
        return []
'''

F1 = [("INPUT0", "TYPE_FP32", "[ 1 ]")], [("OUTPUT0", "TYPE_FP32", "[ 1 ]")]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exit") / "models"
    python_model(root, "good", IDENTITY, io_config("good", *F1))
    python_model(root, "failinit", FAILS_INIT, io_config("failinit", *F1))
    python_model(root, "broken", IDENTITY, None)
    (root / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: [ 1\n')
    return root


def _session(sid: int) -> list[int]:
    """The processes still in session ``sid`` (zombies count as gone)."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def test_a_failed_load_stops_the_server_by_default(repo):
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--model-repository",
                             str(repo), "--http-port", "0", "--grpc-port", "0", "--metrics-port",
                             "0"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert err.rstrip("\n").splitlines()[-1] == \
        "error: creating server: Internal - failed to load all models", err[-2000:]
    assert "failed to load 'failinit': initialize of model 'failinit' failed: " \
        "ValueError: boom" in err
    assert _session(proc.pid) == []   # every worker and frontend stopped with it
    # Triton's start-up log: what loads, what failed (once), and the model table
    assert "loading: good:1" in err and "successfully loaded 'good'" in err
    assert err.count("failed to load 'failinit'") == 1, err
    table = err[err.index("| Model "):]
    assert "| good     | 1       | READY" in table and "| failinit | 1       | UNAVAILABLE: " \
        "initialize of model 'failinit' failed: ValueError: boom" in table, table


def test_without_exit_on_error_the_others_serve(repo):
    with start_server(repo, "--exit-on-error", "false", ready=False) as srv:
        c = httpclient.InferenceServerClient(srv.http_url)
        try:
            wait_until(lambda: _settled(c), 60, "every model to load or fail")
            x = httpclient.InferInput("INPUT0", [1], "FP32")
            x.set_data_from_numpy(np.array([3], np.float32))
            np.testing.assert_array_equal(c.infer("good", [x]).as_numpy("OUTPUT0"), [3])
            assert c.is_server_live() and not c.is_server_ready()   # strict readiness
            assert c.is_model_ready("good")
            assert not c.is_model_ready("failinit") and not c.is_model_ready("broken")
            index = {e["name"]: e for e in c.get_model_repository_index()}
            assert index["good"]["state"] == "READY"
            assert index["failinit"]["state"] == "UNAVAILABLE"
            assert index["failinit"]["reason"].startswith(
                "initialize of model 'failinit' failed: ValueError: boom")
            assert index["broken"]["state"] == "UNAVAILABLE"
            assert index["broken"]["reason"].startswith(
                f"failed to read text proto from {repo / 'broken' / 'config.pbtxt'}")
            with pytest.raises(InferenceServerException) as e:
                c.infer("failinit", [x])
            assert e.value.status() == "404", e.value
        finally:
            c.close()


def _settled(c) -> bool:
    """Every model of the index READY or UNAVAILABLE (none LOADING)."""
    states = {e["name"]: e.get("state") for e in c.get_model_repository_index()}
    return len(states) == 3 and set(states.values()) <= {"READY", "UNAVAILABLE"}


def test_without_strict_readiness_the_server_is_ready(repo):
    with start_server(repo, "--exit-on-error", "false", "--strict-readiness", "false") as srv:
        c = httpclient.InferenceServerClient(srv.http_url)
        try:
            assert c.is_server_ready() and not c.is_model_ready("failinit")
        finally:
            c.close()
