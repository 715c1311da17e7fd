"""A frontend whose scheduler never came (a cluster piece started alone, or left behind when
its scheduler died at start) under large requests: every one is answered at once (HTTP
503, gRPC UNAVAILABLE), and none stays in memory after its answer.

It used to be otherwise: calls queued for a scheduler never reached, so every request hung
with its body until its client gave up, and an answered error kept its request in a
reference cycle (future -> error -> traceback -> frames -> request) that only the cyclic
GC frees, which an idle frontend hardly runs: a CI orphan sat at 15 GB."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from conftest import ROOT, _get, free_port, shm_segments, wait_until
from tritonclient.utils import InferenceServerException

MIB = 1 << 20
RSS_BOUND = 64 * MIB          # as test_http_attacks: below one request's body
BODY = 32 * MIB
PARALLEL, ROUNDS = 8, 3       # 256 MiB at once, 768 MiB a protocol over the rounds
ANSWER_S = 20.0


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    http, grpc_, nobody = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("no_scheduler") / "frontend.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "frontend", "--scheduler",
             f"stream://127.0.0.1:{nobody}", "--http-port", str(http), "--grpc-port", str(grpc_),
             "--host", "127.0.0.1"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is not None or
                   _get(f"http://127.0.0.1:{http}/v2/health/live") == 200, 60, "frontend start")
        assert proc.poll() is None, log.read_text()
        yield proc, http, grpc_
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert shm_segments({proc.pid}) == []


def _http_infer(port: int) -> int:
    """One binary-tensor infer of BODY bytes; the status answered."""
    head = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, BODY // 4], "datatype": "FP32",
                                   "parameters": {"binary_data_size": BODY}}]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as s:
        s.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\n"
                  b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
                  % (len(head), len(head) + BODY) + head)
        s.sendall(bytes(BODY))
        return int(s.recv(64).split()[1])


def _grpc_infer(port: int) -> str:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        data = np.zeros((1, BODY // 4), np.float32)
        inp = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        inp.set_data_from_numpy(data)
        client.infer("add_sub", [inp], client_timeout=ANSWER_S)
        return "answered"
    except InferenceServerException as e:
        return str(e.status())
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_large_requests_without_a_scheduler_are_answered_and_freed(frontend, protocol):
    proc, http, grpc_ = frontend
    me = psutil.Process(proc.pid)
    before = me.memory_info().rss
    call, port, want = ((_http_infer, http, 503) if protocol == "http" else
                        (_grpc_infer, grpc_, "StatusCode.UNAVAILABLE"))
    for _ in range(ROUNDS):
        answers: list = []
        threads = [threading.Thread(target=lambda out=answers: out.append(call(port)))
                   for _ in range(PARALLEL)]
        for t in threads:
            t.start()
        wait_until(lambda: _get(f"http://127.0.0.1:{http}/v2/health/live") == 200, 10,
                   "a health probe answered during the flood")
        for t in threads:
            t.join(ANSWER_S + 10)
        assert answers == [want] * PARALLEL   # each answered (a hang raises in its thread)
        # what the answered requests held is gone, with no collection to wait for
        wait_until(lambda: me.memory_info().rss < before + RSS_BOUND, 10,
                   f"RSS back within {RSS_BOUND // MIB} MiB of {before // MIB} MiB "
                   f"(now {me.memory_info().rss // MIB} MiB)")
    assert _get(f"http://127.0.0.1:{http}/v2/health/ready") != 200
