"""benchmarks/client_shm.py's parts: the client regions it makes (each destroyed on every
exit path) and one measured round trip per path (shm over gRPC/HTTP, wire)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import pct
from bench_server import CpuMeter, Server, counter_delta, log
from vs_triton_runs import Sample

PREFIX = f"trireme_bench_cshm_{os.getpid()}_"   # every /dev/shm object this script makes


# --------------------------------------------------------------------------- regions

class Regions:
    """Every client region this process creates: destroy_all() unregisters and destroys
    them all (called on every exit path), then unlinks anything with PREFIX left in
    /dev/shm (a handle lost to an exception)."""

    def __init__(self) -> None:
        self.live: dict[str, tuple] = {}   # key -> (handle, [clients it is registered with])

    def create(self, name: str, nbytes: int):
        import tritonclient.utils.shared_memory as shm
        key = f"/{PREFIX}{name}"
        handle = shm.create_shared_memory_region(name, key, nbytes, create_only=True)
        self.live[key] = (handle, [])
        return key, handle

    def register(self, client, name: str, key: str, nbytes: int) -> None:
        client.register_system_shared_memory(name, key, nbytes)
        self.live[key][1].append((client, name))

    def destroy(self, key: str) -> None:
        import tritonclient.utils.shared_memory as shm
        handle, regs = self.live.pop(key)
        for client, name in regs:
            with contextlib.suppress(Exception):   # best effort: the server may be gone
                client.unregister_system_shared_memory(name)
        shm.destroy_shared_memory_region(handle)

    def destroy_all(self) -> list[str]:
        """Destroy every region; the /dev/shm names that had to be unlinked by hand."""
        for key in list(self.live):
            with contextlib.suppress(Exception):   # keep going: unlinked below
                self.destroy(key)
        self.live.clear()
        swept = []
        for p in Path("/dev/shm").glob(PREFIX + "*"):
            with contextlib.suppress(OSError):
                p.unlink()
                swept.append(p.name)
        return swept


REGIONS = Regions()


def dev_shm() -> set[str]:
    with contextlib.suppress(OSError):
        return {p.name for p in Path("/dev/shm").iterdir()}
    return set()



def model_stats(srv: Server, model: str) -> dict[str, float]:
    """The statistics extension's cumulative counts and ns for one model (all versions)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(f"http://{srv.http}/v2/models/{model}/stats", timeout=5) as r:
            body = json.loads(r.read())
        for ms in body.get("model_stats", []):
            for k, v in ms.get("inference_stats", {}).items():
                out[f"{k}_count"] = out.get(f"{k}_count", 0) + int(v.get("count", 0))
                out[f"{k}_ns"] = out.get(f"{k}_ns", 0) + int(v.get("ns", 0))
    return out


def stats_per_request(before: dict, after: dict) -> dict[str, float]:
    """µs per request of queue, compute_input, compute_infer, compute_output."""
    d = counter_delta(before, after)
    n = d.get("success_count", 0)
    if not n:
        return {}
    return {k: round(d.get(f"{k}_ns", 0) / n / 1e3, 1)
            for k in ("queue", "compute_input", "compute_infer", "compute_output")}


# --------------------------------------------------------------------------- one run

@dataclass
class Request:
    """One path's request for one server, model and size: `send()` does a round trip,
    `check()` verifies the answer byte for byte (raises when wrong; returns a note on a
    right answer sent wrongly, '' when all is well), `close()` releases what it holds."""
    send: Callable[[], object]
    check: Callable[[], str]
    close: Callable[[], None]


def _wire_bytes(result) -> int:
    """Tensor bytes that came back in the response itself (none when the output went to
    shared memory)."""
    if hasattr(result, "get_response") and hasattr(result.get_response(), "raw_output_contents"):
        return sum(len(c) for c in result.get_response().raw_output_contents)   # gRPC
    o = result.get_output("OUTPUT0") or {}                                        # HTTP
    return int(o.get("parameters", {}).get("binary_data_size", 0)) + len(o.get("data", []))


def make_request(srv: Server, who: str, path: str, model: str, x: np.ndarray,
                 tag: str) -> Request:
    if path.endswith("http"):
        import tritonclient.http as tc
        client = tc.InferenceServerClient(srv.http, connection_timeout=120, network_timeout=120)
    else:
        import tritonclient.grpc as tc
        client = tc.InferenceServerClient(srv.grpc)
    shape, nbytes = list(x.shape), x.nbytes
    inp = tc.InferInput("INPUT0", shape, "FP32")
    out = (tc.InferRequestedOutput("OUTPUT0", binary_data=True) if path.endswith("http")
           else tc.InferRequestedOutput("OUTPUT0"))
    keys: list[str] = []

    def close() -> None:
        for k in keys:
            REGIONS.destroy(k)
        client.close()

    if path.startswith("shm"):
        import tritonclient.utils.shared_memory as shm
        try:
            kin, hin = REGIONS.create(f"{tag}_in", nbytes)
            keys.append(kin)
            kout, hout = REGIONS.create(f"{tag}_out", nbytes)
            keys.append(kout)
            shm.set_shared_memory_region(hin, [x])   # once, before the timed loop
            REGIONS.register(client, f"{tag}_in", kin, nbytes)
            REGIONS.register(client, f"{tag}_out", kout, nbytes)
        except BaseException:
            close()
            raise
        inp.set_shared_memory(f"{tag}_in", nbytes)
        out.set_shared_memory(f"{tag}_out", nbytes)

        def check() -> str:
            r = client.infer(model, [inp], outputs=[out])
            got = bytes(hout._mpsm_handle.buf[:nbytes])
            if got != x.tobytes():
                raise AssertionError(f"{who} {path} {model}: output region differs")
            wire = _wire_bytes(r)
            return (f"the response also carried {wire} tensor bytes, although the output "
                    "went to shared memory" if wire else "")
    else:
        inp.set_data_from_numpy(x, **({"binary_data": True} if path == "http" else {}))

        def check() -> str:
            r = client.infer(model, [inp], outputs=[out])
            got = r.as_numpy("OUTPUT0")
            if got is None or got.tobytes() != x.tobytes():
                raise AssertionError(f"{who} {path} {model}: wrong OUTPUT0")
            return ""

    return Request(lambda: client.infer(model, [inp], outputs=[out]), check, close)


def c1_run(srv: Server, who: str, path: str, model: str, x: np.ndarray, tag: str,
           seconds: float, min_requests: int = 10) -> Sample:
    """Sequential round trips for `seconds` (at least min_requests) after a check and a
    warm-up. Value: p50 ms."""
    req = make_request(srv, who, path, model, x, tag)
    try:
        problem = req.check()
        if problem:
            log(f"{who} {path} {model} {x.nbytes} B: {problem}")
        end = time.perf_counter() + min(1.0, seconds / 4)
        while time.perf_counter() < end:
            req.send()
        before, stats0 = srv.counters(model), model_stats(srv, model)
        meter = CpuMeter({**srv.processes(), "client": os.getpid()})
        lat: list[int] = []
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end or len(lat) < min_requests:
            s = time.perf_counter_ns()
            req.send()
            lat.append(time.perf_counter_ns() - s)
        rate = len(lat) / (time.perf_counter() - t0)
        cpu = meter.percent(meter.sample(), rate)
        delta = counter_delta(before, srv.counters(model))
        per_req = stats_per_request(stats0, model_stats(srv, model))
    finally:
        req.close()
    p50, p99, mean = pct(lat)
    per = [v.get("us_per_req") for k, v in cpu.items() if k not in ("machine", "client")]
    server_us = sum(per) if per and None not in per else None
    bad = delta.get("nv_inference_request_failure", 0)
    return Sample(p50, bad == 0 and not problem, f"{len(lat)} req, p99 {p99:.3f} ms"
                  + (f", {bad:.0f} server failures" if bad else "")
                  + (f", ERR: {problem}" if problem else ""),
                  server_us, cpu.get("machine", {}).get("other", 0.0),
                  {"p99_ms": p99, "mean_ms": mean, "n": len(lat), "server_time_us": per_req,
                   "cpu": cpu})


