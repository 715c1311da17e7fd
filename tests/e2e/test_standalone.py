"""The pieces run alone, as in separate containers: `trireme scheduler` and `trireme frontend`
joined by TCP addresses (tcp:// is ZeroMQ, stream:// plain framed sockets), with shared memory
off (every tensor inline)."""
from __future__ import annotations

import signal
import subprocess
import sys

import models
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import ROOT, _get, free_port, shm_segments, wait_until


@pytest.mark.parametrize("wire", ["tcp", "stream"])
def test_scheduler_and_frontend_over_tcp_without_shm(tmp_path, wire):
    repo = tmp_path / "models"
    models.identity(repo / "identity_fp32", "fp32")
    models.write_config(repo / "identity_fp32", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    fport, wport, rport, http, grpc_, metrics = (free_port() for _ in range(6))
    log = open(tmp_path / "pieces.log", "wb")
    # The frontend starts first: it keeps trying until the scheduler is there.
    front = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "frontend", "--scheduler", f"{wire}://127.0.0.1:{fport}",
         "--result-addr", f"{wire}://127.0.0.1:{rport}", "--http-port", str(http),
         "--grpc-port", str(grpc_), "--host", "127.0.0.1", "--no-shm"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    sched = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "scheduler", "--model-repository", str(repo),
         "--frontend-addr", f"{wire}://127.0.0.1:{fport}", "--worker-addr", f"{wire}://127.0.0.1:{wport}",
         "--metrics-port", str(metrics), "--host", "127.0.0.1", "--no-shm",
         "--local-workers", "true"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    pids = {sched.pid, front.pid}
    try:
        wait_until(lambda: _get(f"http://127.0.0.1:{http}/v2/health/ready") == 200, 60, "ready")
        pids |= {c.pid for c in psutil.Process(sched.pid).children(recursive=True)}
        # 1 MiB: above the inline threshold
        big = np.random.default_rng(0).random((1, 1 << 18), dtype=np.float32)
        for client_mod, url in ((httpclient, f"127.0.0.1:{http}"), (grpcclient, f"127.0.0.1:{grpc_}")):
            client = client_mod.InferenceServerClient(url)
            inp = client_mod.InferInput("INPUT0", list(big.shape), "FP32")
            inp.set_data_from_numpy(big)
            out = client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, big)
        assert shm_segments(pids) == []      # nothing went through /dev/shm
    finally:
        for p in (front, sched):
            p.send_signal(signal.SIGTERM)
        assert front.wait(30) == 0
        assert sched.wait(30) == 0
        log.close()
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in pids), 10, "children to exit")
