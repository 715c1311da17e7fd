"""A client that gives up mid-request (gRPC deadline) must not break the server: the worker
may still be reading the request's shared-memory input, so the frontend frees that block
only when the result arrives, and later requests read their own data, not a reused block."""
from __future__ import annotations

import grpc
import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import start_server
from tritonclient.utils import InferenceServerException

WIDTH = 256


def _infer(client, x, timeout=None):
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer("slow", [inp], client_timeout=timeout).as_numpy("OUTPUT0")


def test_deadline_exceeded_requests_leave_server_consistent(tmp_path):
    repo = tmp_path / "models"
    models.slow(repo / "slow", WIDTH)
    models.write_config(repo / "slow", models.slow_config(WIDTH))
    with start_server(repo) as srv:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        rng = np.random.default_rng(0)
        # 200 rows x 256 FP32 = 200 KiB: above the inline threshold, so in shared memory.
        for _ in range(3):
            x = rng.random((200, WIDTH), dtype=np.float32)
            with pytest.raises(InferenceServerException) as e:
                _infer(client, x, timeout=0.02)
            assert e.value.status() == str(grpc.StatusCode.DEADLINE_EXCEEDED)
        # The abandoned requests still run; every later request gets exactly its own data.
        for _ in range(3):
            y = rng.random((200, WIDTH), dtype=np.float32)
            np.testing.assert_array_equal(_infer(client, y), y)
        assert "Traceback" not in srv.log()
