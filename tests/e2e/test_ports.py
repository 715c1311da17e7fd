"""A second server, or a stray `trireme frontend`, cannot take a running server's ports by
accident: the server's frontends accept on sockets it bound and handed down
(services/frontend/listen.py), a second server probes with a plain bind, and a frontend run
alone shares a port only when told (--reuse-port). A second server stops within seconds
with Triton's text and exit code 1, a stray frontend with the same words; the first server
answers every request."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
from conftest import ROOT, free_port, start_server, wait_until

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

    answers_every_request(server)


def answers_every_request(server) -> None:
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


@pytest.mark.parametrize("service", ["GRPC", "HTTP"])
def test_a_stray_frontend_on_a_taken_port_stops(server, service):
    ports = {"HTTP": free_port(), "GRPC": free_port()}
    ports[service] = server.http_port if service == "HTTP" else server.grpc_port
    r = subprocess.run([sys.executable, "-m", "services.cli", "frontend", "--scheduler",
                        f"stream://127.0.0.1:{free_port()}", "--host", "127.0.0.1",
                        "--http-port", str(ports["HTTP"]), "--grpc-port", str(ports["GRPC"])],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r
    assert (f"failed to start {service} service: Unavailable - Socket '127.0.0.1:{ports[service]}' "
            "already in use") in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    answers_every_request(server)


def test_frontends_run_alone_share_a_port_pair_when_told(tmp_path):
    """Two `trireme frontend`s with --reuse-port on one port pair both start (the compose
    topology's frontends); the scheduler they name need not be up for that."""
    http, grpc_ = free_port(), free_port()
    cmd = [sys.executable, "-m", "services.cli", "frontend", "--scheduler",
           f"stream://127.0.0.1:{free_port()}", "--host", "127.0.0.1", "--http-port", str(http),
           "--grpc-port", str(grpc_), "--reuse-port", "true"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            def listening(p=p) -> bool:
                return p.poll() is None and sum(
                    1 for c in psutil.Process(p.pid).net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port in (http, grpc_)) == 2
            wait_until(listening, 60, "the frontend to listen on both ports")
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
