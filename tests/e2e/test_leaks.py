"""No leaks across load/unload cycles and client connections: file descriptors, child
processes and shared-memory segments come back to where they were."""
from __future__ import annotations

import models
import numpy as np
import psutil
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import shm_segments, start_server, wait_until

CONFIG = "max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n"


def _fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def _frontend(srv) -> int:
    for pid in srv.family():
        try:
            if "trireme frontend" in " ".join(psutil.Process(pid).cmdline()):
                return pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no frontend process")


def _infer_both(srv, x):
    for mod, url in ((httpclient, srv.http_url), (grpcclient, srv.grpc_url)):
        client = mod.InferenceServerClient(url)
        inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
        client.close()


def test_load_unload_cycles_and_connections_leak_nothing(tmp_path):
    repo = tmp_path / "models"
    models.identity(repo / "identity_fp32", "fp32")
    models.write_config(repo / "identity_fp32", CONFIG)
    with start_server(repo, "--model-control-mode", "explicit") as srv:
        admin = httpclient.InferenceServerClient(srv.http_url)
        big = np.random.default_rng(0).random((1, 1 << 18), dtype=np.float32)  # 1 MiB: shared memory

        workers: set[int] = set()

        def cycle():
            admin.load_model("identity_fp32")
            _infer_both(srv, big)
            workers.update(srv.family() - {srv.proc.pid, _frontend(srv)})
            admin.unload_model("identity_fp32")
            wait_until(lambda: len(srv.family()) == 2, 30, "the worker to exit")  # serve + frontend

        cycle()   # first use maps segments and opens the sockets that stay
        sched, front = srv.proc.pid, _frontend(srv)
        base = (_fds(sched), _fds(front))
        for _ in range(4):
            cycle()
        # Connections closed by the clients are closed by the server too.
        wait_until(lambda: _fds(sched) <= base[0] and _fds(front) <= base[1], 10,
                   f"fds back to {base} (now {(_fds(sched), _fds(front))})")
        # Every worker's output segment is gone (the frontend keeps its own input arena).
        assert len(workers) == 5
        assert shm_segments(workers) == []


MIB = 1 << 20
RSS_GROWTH_MIB = 8   # 50 cycles: what a per-cycle leak of 160 KiB would pass


def _rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_unload_gives_the_memory_back(tmp_path):
    """50 load / infer / unload cycles of a Python and an ONNX model: the scheduler's and the
    frontend's resident memory stay flat, and no worker leaves a segment in /dev/shm."""
    from models_python import IDENTITY, io_config, python_model
    repo = tmp_path / "models"
    models.identity(repo / "identity_fp32", "fp32")
    models.write_config(repo / "identity_fp32", CONFIG)
    python_model(repo, "py_identity", IDENTITY, io_config(
        "py_identity", [("INPUT0", "TYPE_FP32", "[ -1 ]")], [("OUTPUT0", "TYPE_FP32", "[ -1 ]")],
        max_batch_size=8))
    with start_server(repo, "--model-control-mode", "explicit") as srv:
        admin = httpclient.InferenceServerClient(srv.http_url)
        x = np.random.default_rng(0).random((1, 1 << 16), dtype=np.float32)  # 256 KiB: shared memory
        workers: set[int] = set()

        def cycle() -> None:
            for name in ("identity_fp32", "py_identity"):
                admin.load_model(name)
            c = grpcclient.InferenceServerClient(srv.grpc_url)
            try:
                for name in ("identity_fp32", "py_identity"):
                    inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
                    inp.set_data_from_numpy(x)
                    np.testing.assert_array_equal(c.infer(name, [inp]).as_numpy("OUTPUT0"), x)
            finally:
                c.close()
            workers.update(srv.family() - {srv.proc.pid, _frontend(srv)})
            for name in ("identity_fp32", "py_identity"):
                admin.unload_model(name)
            wait_until(lambda: len(srv.family()) == 2, 30, "the workers to exit")

        for _ in range(5):   # warm: first mappings, caches, the allocators' pools
            cycle()
        sched, front = srv.proc.pid, _frontend(srv)
        base = (_rss(sched), _rss(front))
        for _ in range(50):
            cycle()
        growth = ((_rss(sched) - base[0]) / MIB, (_rss(front) - base[1]) / MIB)
        admin.close()
        assert max(growth) < RSS_GROWTH_MIB, f"RSS growth (scheduler, frontend) MiB: {growth}"
        assert len(workers) == 110
        assert shm_segments(workers) == []
