"""/dev/shm unusable (missing, full, read-only): tensors fall back to inline frames with a
warning; no crash, no failed request. (Missing or unwritable is found at start, by the
shared-memory domain probe; full, at an allocation.)"""
from __future__ import annotations

import models
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server


def test_large_tensors_travel_inline_when_shared_memory_is_unusable(tmp_path):
    repo = tmp_path / "models"
    models.identity(repo / "identity_fp32", "fp32")
    models.write_config(repo / "identity_fp32", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    with start_server(repo, env={"TRIREME_SHM_DIR": str(tmp_path / "no-such-dir")}) as srv:
        x = np.random.default_rng(1).random((1, 1 << 20), dtype=np.float32)   # 4 MiB
        for mod, url in ((httpclient, srv.http_url), (grpcclient, srv.grpc_url)):
            client = mod.InferenceServerClient(url)
            inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
        log = srv.log()
        assert "shared memory is not usable here" in log
        assert "every tensor travels inline" in log and "every output travels inline" in log
        assert "Traceback" not in log
