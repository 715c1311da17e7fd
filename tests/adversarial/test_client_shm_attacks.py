"""Attacks through client shared memory (--allow-client-shm=true):

- a client shrinks its object to nothing under a registered region the worker has already
  mapped: reading it would SIGBUS the worker; the request gets a clear 400 and the worker
  lives (same pid);
- keys that reach outside /dev/shm or name Trireme's own segments are refused at
  registration, so no request can read another request's tensors;
- a flood of registrations of one small object and requests with bounds far outside it:
  each answered with Triton's text, the frontend's memory stays bounded;
and meanwhile a well-behaved client keeps being served.
"""
from __future__ import annotations

import os
import uuid

import models
import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from conftest import start_server
from tritonclient.utils import InferenceServerException

A = np.arange(16, dtype=np.float32).reshape(1, 16)
RSS_GROWTH_LIMIT = 64 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm_attacks") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", "max_batch_size: 8\n"
                        "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    with start_server(root, "--allow-client-shm=true") as srv:
        yield srv


def _inputs(region: str | None):
    out = []
    for name in ("INPUT0", "INPUT1"):
        t = httpclient.InferInput(name, [1, 16], "FP32")
        if region is None:
            t.set_data_from_numpy(A)
        else:
            t.set_shared_memory(region, 64)
        out.append(t)
    return out


def _served(c) -> None:
    """The well-behaved client: inputs on the wire, exact outputs."""
    r = c.infer("add_sub", _inputs(None))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + A)


def _worker_pids(srv) -> set[int]:
    return {pid for pid in srv.family() if "worker" in " ".join(psutil.Process(pid).cmdline())}


def test_object_shrunk_under_a_mapped_region(server):
    c = httpclient.InferenceServerClient(server.http_url)
    key = f"/tt_shrink_{uuid.uuid4().hex[:8]}"
    h = shm.create_shared_memory_region("shrink", key, 4096)
    try:
        shm.set_shared_memory_region(h, [A])
        c.register_system_shared_memory("shrink", key, 4096)
        r = c.infer("add_sub", _inputs("shrink"))            # the worker maps it now
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), A + A)
        workers = _worker_pids(server)
        assert workers
        os.truncate("/dev/shm/" + key.lstrip("/"), 0)
        with pytest.raises(InferenceServerException,
                           match=f"shared memory region '{key}' holds 0 bytes, fewer than the "
                                 f"64 its registration promised") as e:
            c.infer("add_sub", _inputs("shrink"))
        assert e.value.status() == "400"
        assert _worker_pids(server) == workers               # no SIGBUS, no restart
        _served(c)
        c.unregister_system_shared_memory("shrink")
    finally:
        shm.destroy_shared_memory_region(h)
        c.close()


@pytest.mark.parametrize("key,text", [
    ("/../../etc/passwd", "Unable to open shared memory region: '/../../etc/passwd'"),
    ("/..", "Unable to open shared memory region: '/..'"),
    ("trireme-1-out-0", "as the key contains the reserved prefix 'trireme-'"),
    ("/" * 3, "invalid shm key '///'"),
])
def test_keys_outside_the_clients_own_objects(server, key, text):
    c = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException, match=text.replace(".", "\\.")):
        c.register_system_shared_memory("evil", key, 64)
    assert c.get_system_shared_memory_status() == []
    _served(c)
    c.close()


def test_registration_and_bounds_flood(server):
    frontend = server.frontend()
    c = httpclient.InferenceServerClient(server.http_url)
    good = httpclient.InferenceServerClient(server.http_url)
    key = f"/tt_flood_{uuid.uuid4().hex[:8]}"
    h = shm.create_shared_memory_region("flood", key, 4096)
    try:
        rss0 = frontend.memory_info().rss
        for i in range(300):
            c.register_system_shared_memory(f"r{i}", key, 4096)
        for i in range(0, 300, 3):
            t = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            t.set_shared_memory(f"r{i}", 64, offset=2**62)
            with pytest.raises(InferenceServerException,
                               match=f"Invalid offset for shared memory region: 'r{i}'"):
                c.infer("add_sub", [t, _inputs(None)[1]])
            if i % 30 == 0:
                _served(good)
        assert len(c.get_system_shared_memory_status()) == 300
        c.unregister_system_shared_memory()
        assert c.get_system_shared_memory_status() == []
        assert frontend.memory_info().rss - rss0 < RSS_GROWTH_LIMIT
        _served(good)
    finally:
        shm.destroy_shared_memory_region(h)
        c.close()
        good.close()
