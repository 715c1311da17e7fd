"""The Redis response cache against a real redis-server (started here on a free port; the
tests fail, not skip, without one: CI installs it): two replicas of one server share their
entries; Redis killed while requests run fails none of them and is used again once it is
back; a Redis that does not answer at start-up stops the server with Triton's text; keys
are namespaced by the repository.

Repository: Triton's add_sub (Python, FP32 [4]) with `response_cache { enable: true }`.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient
from conftest import ROOT, free_port, start_server, wait_until
from tritonclient.utils import InferenceServerException

from tests.models_python import ADD_SUB, io_config, python_model

F4 = ("TYPE_FP32", "[ 4 ]")


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.answers, 10, "redis-server to answer")

    def answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def keys(self) -> list[bytes]:
        return redis.Redis(port=self.port).keys("*")


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("redis") / "models"
    python_model(root, "add_sub", ADD_SUB, io_config(
        "add_sub", [("INPUT0", *F4), ("INPUT1", *F4)], [("OUTPUT0", *F4), ("OUTPUT1", *F4)],
        extra="response_cache { enable: true }"))
    return root


def _flags(port: int) -> list[str]:
    return ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}",
            "--cache-config", "redis,socket_timeout=500", "--cache-config", "redis,connect_timeout=500"]


@pytest.fixture(scope="module")
def replicas(repo, redis_server):
    with start_server(repo, *_flags(redis_server.port)) as a, \
            start_server(repo, *_flags(redis_server.port)) as b:
        yield a, b


def add_sub(server, seed: float) -> None:
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=30)
    try:
        a = np.arange(4, dtype=np.float32) + seed
        b = np.full(4, 0.5, np.float32)
        inputs = [httpclient.InferInput("INPUT0", [4], "FP32"), httpclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        res = c.infer("add_sub", inputs)
        np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
    finally:
        c.close()


def counts(server) -> tuple[int, int, int]:
    """(executions, cache hits, cache misses) of add_sub."""
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        (s,) = c.get_inference_statistics("add_sub")["model_stats"]
    finally:
        c.close()
    inf = s["inference_stats"]
    return (int(s.get("execution_count", 0)), int(inf["cache_hit"].get("count", 0)),
            int(inf["cache_miss"].get("count", 0)))


def test_replicas_share_one_redis(replicas, redis_server):
    a, b = replicas
    a0, b0 = counts(a), counts(b)
    add_sub(a, seed=1.0)   # a miss on A: executed there, its answer inserted
    wait_until(lambda: counts(a)[2] == a0[2] + 1, 10, "A's insertion")
    add_sub(b, seed=1.0)   # a hit on B: never executed there
    add_sub(b, seed=1.0)
    assert counts(b)[:2] == (b0[0], b0[1] + 2)
    assert counts(a)[0] == a0[0] + 1
    keys = redis_server.keys()
    assert keys and all(k.startswith(b"trireme:") for k in keys), keys
    assert len({k.split(b":")[1] for k in keys}) == 1   # one namespace: the same repository


def test_redis_lost_while_serving_fails_no_request(replicas, redis_server):
    a, _ = replicas
    errors: list[object] = []
    done = threading.Event()
    sent = [0]

    def load(offset: float) -> None:
        i = 0
        while not done.is_set():
            i += 1
            try:
                add_sub(a, seed=offset + i % 7)   # repeats: hits while Redis is there
                sent[0] += 1
            except (InferenceServerException, AssertionError) as e:
                errors.append(e)

    threads = [threading.Thread(target=load, args=(100.0 * k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sent[0] >= 20, 30, "requests before Redis goes")
        redis_server.stop()
        n = sent[0]
        wait_until(lambda: sent[0] >= n + 20, 30, "requests while Redis is gone")
        redis_server.start()
        n = sent[0]
        wait_until(lambda: sent[0] >= n + 20, 30, "requests after Redis is back")
    finally:
        done.set()
        for t in threads:
            t.join(30)
    assert errors == [], errors[:3]
    # back in use: a new answer is inserted and then found
    hits = counts(a)[1]
    add_sub(a, seed=5000.0)
    wait_until(lambda: any(redis_server.keys()), 10, "an insertion into the new Redis")
    add_sub(a, seed=5000.0)
    assert counts(a)[1] == hits + 1
    assert "Failed to retrieve key: " in a.log_path.read_text()


def test_redis_unreachable_at_start_up_stops_the_server(repo):
    port = free_port()   # nothing listens there
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model-repository",
                        str(repo), "--http-port", "0", *_flags(port)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r
    last = r.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: creating server: Internal - Failed to initialize RedisCache: "), \
        r.stderr
    assert str(port) in last, last


@pytest.mark.parametrize("settings, text", [
    (["redis,host=127.0.0.1"],
     "Failed to initialize RedisCache, didn't specify address. Must at a minimum specify "
     "'host' and 'port' in the configuration - e.g. tritonserver --cache-config redis,host=redis "
     "--cache-config redis,port=6379 --model-repository=/models ..."),
    (["redis,host=127.0.0.1", "redis,port=1", "redis,sni=example.com"],
     "Failed to initialize RedisCache: the sni setting is not supported here"),
])
def test_bad_redis_settings_are_refused(repo, settings, text):
    flags = [a for s in settings for a in ("--cache-config", s)]
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--model-repository",
                        str(repo), "--http-port", "0", *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r
    assert r.stderr.rstrip("\n").splitlines()[-1] == \
        f"error: creating server: Invalid argument - {text}", r.stderr
