"""A second server cannot take a running server's ports: its frontends would share them
(SO_REUSEPORT) and the two servers would take turns answering. It stops within seconds
with Triton's text and exit code 1, and the first server answers every request."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tritonclient.http as httpclient
from conftest import ROOT, free_port, start_server

from tests.models_python import IDENTITY, io_config, python_model

IO = [("INPUT0", "TYPE_FP32", "[ 1 ]")], [("OUTPUT0", "TYPE_FP32", "[ 1 ]")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("ports") / "models"
    python_model(repo, "identity", IDENTITY, io_config("identity", *IO))
    with start_server(repo) as srv:
        yield srv


@pytest.mark.parametrize("service", ["GRPC", "HTTP", "Metrics"])
def test_a_second_server_on_a_taken_port_stops(server, service):
    ports = {"HTTP": free_port(), "GRPC": free_port(), "Metrics": free_port()}
    ports[service] = {"HTTP": server.http_port, "GRPC": server.grpc_port,
                      "Metrics": server.metrics_port}[service]
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model-repository",
                        str(server.repo), "--host", "127.0.0.1", "--http-port", str(ports["HTTP"]),
                        "--grpc-port", str(ports["GRPC"]), "--metrics-port", str(ports["Metrics"])],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r
    assert (f"failed to start {service} service: Unavailable - Socket "
            f"'127.0.0.1:{ports[service]}' already in use") in r.stderr, r.stderr

    c = httpclient.InferenceServerClient(server.http_url)
    try:   # the first server answers every request (none went to a second one)
        before = c.get_inference_statistics("identity")["model_stats"][0]["inference_count"]
        x = httpclient.InferInput("INPUT0", [1], "FP32")
        x.set_data_from_numpy(np.array([1.0], np.float32))
        for _ in range(20):
            c.infer("identity", [x])
        after = c.get_inference_statistics("identity")["model_stats"][0]["inference_count"]
        assert int(after) - int(before) == 20
    finally:
        c.close()
