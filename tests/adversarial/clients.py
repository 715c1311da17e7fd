"""What the adversarial tests share: the well-behaved client that must keep getting exact
answers while an attacker does its worst, and the watch on what the server holds meanwhile
(its frontend's RSS, a worker's, its /dev/shm segments) and gives back afterwards."""
from __future__ import annotations

import threading
import time

import models
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import shm_segments, wait_until

MIB = 1 << 20
N = MIB                           # FP32 elements: 4 MiB a request
ANSWER_S = 30.0
SLACK = 64 * MIB                  # as the other adversarial tests: the allocator's noise
SETTLE_S = 40.0                   # idle segments go after 10 s + a 5 s tick or two
QUIET_S = 2.0                     # no progress this long: a slow client is stuck


def identity_model(root) -> None:
    """The identity model the memory tests send to: FP32 [-1], batching, one instance: the
    warm-up opens what traffic keeps for good (each frontend's direct connection to the
    worker, the worker's first output segment), so a burst adds nothing."""
    models.identity(root / "identity", "fp32")
    models.write_config(root / "identity",
                        'max_batch_size: 8\n'
                        'input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
                        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }]\n'
                        'instance_group [{ kind: KIND_CPU, count: 1 }]\n')


class IdentityClient:
    """tritonclient on connections of its own, to the ``identity`` model: every answer must
    equal its (random) 4 MiB input."""

    def __init__(self, srv):
        self.srv = srv
        self.grpc = grpcclient.InferenceServerClient(srv.grpc_url)
        self.http = httpclient.InferenceServerClient(srv.http_url, network_timeout=ANSWER_S)
        rng = np.random.default_rng(7)
        self.data = [rng.standard_normal((1, N)).astype(np.float32) for _ in range(3)]
        self.calls = 0

    def infer(self, mod) -> None:
        data = self.data[self.calls % len(self.data)]
        self.calls += 1
        inp = mod.InferInput("INPUT0", list(data.shape), "FP32")
        if mod is grpcclient:
            inp.set_data_from_numpy(data)
            out = self.grpc.infer("identity", [inp], client_timeout=ANSWER_S)
        else:
            inp.set_data_from_numpy(data, binary_data=True)
            out = self.http.infer("identity", [inp], outputs=[
                httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)])
        assert np.array_equal(out.as_numpy("OUTPUT0"), data)

    def close(self) -> None:
        self.grpc.close()
        self.http.close()


class Watch:
    """The RSS of the frontend (and of ``others``: a worker), sampled every 50 ms in a
    thread from the baseline until the slow client has left; the server's /dev/shm
    segments at the baseline."""

    def __init__(self, srv, others: dict[str, psutil.Process] | None = None):
        self.srv = srv
        self.fe = srv.frontend()
        self.procs = {"frontend": self.fe, **(others or {})}
        self.peak = dict.fromkeys(self.procs, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> dict[str, int]:
        return {k: p.memory_info().rss for k, p in self.procs.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, v in self.rss().items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(0.05)

    def __enter__(self) -> Watch:
        self.base = self.rss()
        self.shm = len(shm_segments(self.srv.family()))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def growth(self, what: str = "frontend") -> int:
        return self.peak[what] - self.base[what]

    def figures(self) -> str:
        return "; ".join(f"{k}: baseline {self.base[k] / MIB:.0f} MiB, peak growth "
                         f"{self.growth(k) / MIB:.0f} MiB" for k in self.procs)

    def given_back(self) -> str:
        """Wait until the frontend's RSS is back within SLACK of its baseline and the
        server's /dev/shm segments are back to their count; the figures then."""
        def back() -> bool:
            return (self.fe.memory_info().rss <= self.base["frontend"] + SLACK
                    and len(shm_segments(self.srv.family())) <= self.shm)
        t0 = time.monotonic()
        try:
            wait_until(back, SETTLE_S, "what the slow client held to be given back", interval=0.25)
        except TimeoutError:
            pytest.fail(f"not given back within {SETTLE_S:.0f} s: frontend RSS "
                        f"{self.fe.memory_info().rss / MIB:.0f} MiB, /dev/shm "
                        f"{sorted(shm_segments(self.srv.family()))} vs {self.shm} segments; "
                        f"{self.figures()}")
        now = self.rss()
        return (f"given back within {time.monotonic() - t0:.1f} s: "
                + ", ".join(f"{k} {now[k] / MIB:.0f} MiB" for k in now))


def quiet(progress, what: str, timeout: float = ANSWER_S) -> int:
    """Wait until ``progress()`` has not changed for QUIET_S; its value then."""
    last = [progress(), time.monotonic()]

    def still() -> bool:
        v = progress()
        if v != last[0]:
            last[:] = [v, time.monotonic()]
        return time.monotonic() - last[1] >= QUIET_S
    wait_until(still, timeout, what, interval=0.1)
    return last[0]


def worker_process(srv, model: str) -> psutil.Process:
    for pid in srv.family():
        try:
            p = psutil.Process(pid)
            if f"({model} v1)" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no worker of {model}")
