"""`trireme serve --in-process-frontend`: the one frontend runs on the scheduler's event
loop, so requests skip a process hop. What a user notices: one process fewer, the same
answers over HTTP and gRPC (and through BLS, which still enters at the scheduler's socket),
a refused --frontends 2, and a server that exits, rather than serving nothing, when its
frontend cannot bind its port. The ensemble and BLS suites run in this mode too
(test_ensemble.py, test_bls_pipelines.py)."""
from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, free_port, start_server
from models_python import ADD_SUB, ADD_SUB_CONFIG, BLS, io_config, python_model

A = np.arange(4, dtype=np.float32)
B = np.full(4, 2, dtype=np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("in_process") / "models"
    python_model(root, "add_sub", ADD_SUB, ADD_SUB_CONFIG.format(name="add_sub", batching=""))
    python_model(root, "bls", BLS, io_config(
        "bls", [("MODEL_NAME", "TYPE_STRING", "[ 1 ]"), ("INPUT0", "TYPE_FP32", "[ 4 ]"),
                ("INPUT1", "TYPE_FP32", "[ 4 ]")],
        [("OUTPUT0", "TYPE_FP32", "[ 4 ]"), ("OUTPUT1", "TYPE_FP32", "[ 4 ]")]))
    with start_server(root, "--in-process-frontend") as srv:
        yield srv


def _inputs(mod, with_name: bool = False):
    out = []
    if with_name:
        name = mod.InferInput("MODEL_NAME", [1], "BYTES")
        name.set_data_from_numpy(np.array([b"add_sub"], dtype=np.object_))
        out.append(name)
    for n, arr in (("INPUT0", A), ("INPUT1", B)):
        i = mod.InferInput(n, [4], "FP32")
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


def test_no_frontend_process(server):
    assert server.frontend_pids() == []


@pytest.mark.parametrize("mod,port", [(httpclient, "http_url"), (grpcclient, "grpc_url")])
def test_answers_as_a_frontend_process_does(server, mod, port):
    client = mod.InferenceServerClient(getattr(server, port))
    for _ in range(50):
        r = client.infer("add_sub", _inputs(mod))
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), A - B)
    r = client.infer("bls", _inputs(mod, with_name=True))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + B)


def test_a_bad_request_is_answered_and_the_next_served(server):
    client = httpclient.InferenceServerClient(server.http_url)
    bad = httpclient.InferInput("INPUT0", [5], "FP32")
    bad.set_data_from_numpy(np.zeros(5, np.float32))
    with pytest.raises(Exception, match="unexpected shape for input 'INPUT0'"):
        client.infer("add_sub", [bad, _inputs(httpclient)[1]])
    assert client.infer("add_sub", _inputs(httpclient)).as_numpy("OUTPUT0").tolist() == [2, 3, 4, 5]


def _serve(repo, *extra: str, timeout: float = 60):
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model-repository", str(repo),
           "--metrics-port", str(free_port()), "--host", "127.0.0.1", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_more_than_one_frontend_is_refused(tmp_path):
    (tmp_path / "models").mkdir()
    r = _serve(tmp_path / "models", "--http-port", str(free_port()), "--grpc-port",
               str(free_port()), "--in-process-frontend", "--frontends", "2")
    assert r.returncode == 2
    assert "--in-process-frontend runs one frontend: leave --frontends at 1" in r.stderr


def test_a_frontend_that_cannot_bind_stops_the_server(tmp_path):
    (tmp_path / "models").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve(tmp_path / "models", "--http-port", str(port),
                   "--grpc-port", str(free_port()), "--in-process-frontend")
    assert r.returncode == 1
    # (told before anything starts, in Triton's words: serve checks its ports first)
    assert f"failed to start HTTP service: Unavailable - Socket '127.0.0.1:{port}' already " \
        "in use" in r.stderr, r.stderr
