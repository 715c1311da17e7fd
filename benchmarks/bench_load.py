"""Serving benchmark, the measurements (see serving.py).

In-process onnxruntime (the ceiling), batch-1 latency loops with the tritonclient sync
clients, the 4 MiB gRPC round trip, and the wrk (HTTP) and h2load (gRPC) load runs with
the parsing of their output.
"""
from __future__ import annotations

import itertools
import os
import re
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from bench_server import CpuMeter, Server, counter_delta


def pct(samples_ns: list[int]) -> tuple[float, float, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.mean())



# --------------------------------------------------------------------------- in-process ORT

def ort_ceiling(model_file: Path, threads: int, batch: int, n: int, width: int) -> tuple:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((batch, width), dtype=np.float32)
    feed = {"INPUT0": x}
    for _ in range(max(50, n // 10)):
        sess.run(None, feed)
    lat = []
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter_ns()
        sess.run(None, feed)
        lat.append(time.perf_counter_ns() - s)
    wall = time.perf_counter() - t0
    p50, p99, _ = pct(lat)
    return p50, p99, n * batch / wall


# --------------------------------------------------------------------------- python clients

def expected(model: str, x: np.ndarray, model_file: Path) -> np.ndarray:
    import onnxruntime as ort
    sess = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    return sess.run(None, {"INPUT0": x})[0]


def client_latency(srv: Server, proto: str, url: str, model: str, x: np.ndarray,
                   want: np.ndarray, warmup: int, n: int) -> tuple[float, float, float, dict]:
    if proto == "http":
        import tritonclient.http as tc
    else:
        import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)
    inp = tc.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = [tc.InferRequestedOutput("OUTPUT0")]
    r = client.infer(model, [inp], outputs=out)
    got = r.as_numpy("OUTPUT0")
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"{proto} {model}: wrong output")
    for _ in range(warmup):
        client.infer(model, [inp], outputs=out)
    lat = []
    before = srv.counters(model)
    meter = CpuMeter({**srv.processes(), "client": os.getpid()})
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter_ns()
        client.infer(model, [inp], outputs=out)
        lat.append(time.perf_counter_ns() - s)
    rate = n / (time.perf_counter() - t0)
    cpu = meter.percent(meter.sample(), rate)
    delta = counter_delta(before, srv.counters(model))
    client.close()
    return (*pct(lat), delta, cpu)


def client_ready_latency(proto: str, url: str, warmup: int, n: int) -> tuple:
    """is_server_ready() round trips: the client + protocol + frontend floor, with no
    scheduler or worker on the path."""
    if proto == "http":
        import tritonclient.http as tc
    else:
        import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)
    for _ in range(warmup):
        assert client.is_server_ready()
    lat = []
    for _ in range(n):
        s = time.perf_counter_ns()
        client.is_server_ready()
        lat.append(time.perf_counter_ns() - s)
    client.close()
    return pct(lat)


def grpc_big_round_trip(srv: Server, url: str, nbytes: int, conc: int, per_thread: int,
                        warmup: int, until=None) -> tuple[float, float, float, float, dict]:
    """per_thread requests per client, or with until, requests until until() is true."""
    """4 MiB FP32 tensors through the identity model; returns (MiB/s, p50, p99, mean) ms."""
    import tritonclient.grpc as tc
    n = nbytes // 4
    barrier = threading.Barrier(conc + 1)
    lat: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            client = tc.InferenceServerClient(url)
            x = np.random.default_rng(i).random((1, n), dtype=np.float32)
            inp = tc.InferInput("INPUT0", [1, n], "FP32")
            inp.set_data_from_numpy(x)
            out = [tc.InferRequestedOutput("OUTPUT0")]
            got = client.infer("identity", [inp], outputs=out).as_numpy("OUTPUT0")
            if not np.array_equal(got, x):
                raise AssertionError("identity round trip changed the tensor")
            for _ in range(warmup):
                client.infer("identity", [inp], outputs=out)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()
            return
        try:
            barrier.wait()
            mine = []
            for _ in (itertools.count() if until else range(per_thread)):
                if until and until():
                    break
                s = time.perf_counter_ns()
                client.infer("identity", [inp], outputs=out).as_numpy("OUTPUT0")
                mine.append(time.perf_counter_ns() - s)
            with lock:
                lat.extend(mine)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    meter = None
    try:
        barrier.wait()
        meter = CpuMeter({**srv.processes(), "client": os.getpid()})
    except threading.BrokenBarrierError:
        pass
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    cpu = meter.percent(meter.sample(), len(lat) / wall) if meter else {}
    p50, p99, mean = pct(lat) if lat else (0.0, 0.0, 0.0)
    return len(lat) * nbytes / (1 << 20) / wall, p50, p99, mean, cpu


# --------------------------------------------------------------------------- load generators

WRK_POST = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
"""
WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d non2xx=%d connect=%d read=%d write=%d timeout=%d " ..
    "p50_us=%d p99_us=%d\\n",
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def http_json_body(model: str, x: np.ndarray) -> str:
    data = ",".join(f"{v:.6g}" for v in x.ravel())
    return (f'{{"inputs":[{{"name":"INPUT0","shape":[{x.shape[0]},{x.shape[1]}],'
            f'"datatype":"FP32","data":[{data}]}}]}}')


def run_wrk(srv: Server, model: str | None, x: np.ndarray | None, tmp: Path, duration: int,
            conns: int = 64, threads: int = 2, meter_pids: dict | None = None,
            warmup_s: float = 2.0, snapshot=None) -> dict:
    """POST a JSON infer body to /v2/models/<model>/infer, or with model None GET
    /v2/health/ready (the frontend alone: no scheduler or worker on the path).
    warmup_s: the warm-up run before the measured one (0: none); snapshot: a callable read
    just before and just after the measured run, returned as "snapshot": (before, after)."""
    lua = tmp / f"wrk-{model or 'ready'}.lua"
    if model:
        lua.write_text(WRK_POST % http_json_body(model, x) + WRK_DONE)
        url = f"http://{srv.http}/v2/models/{model}/infer"
    else:
        lua.write_text(WRK_DONE)
        url = f"http://{srv.http}/v2/health/ready"
    return wrk_measure(srv, lua, url, duration, conns, threads, model=model,
                       meter_pids=meter_pids, warmup_s=warmup_s, snapshot=snapshot)


def wrk_measure(srv: Server, lua: Path, url: str, duration: int, conns: int, threads: int,
                model: str | None = None, meter_pids: dict | None = None,
                warmup_s: float = 2.0, snapshot=None) -> dict:
    """wrk with the script ``lua`` (which ends with WRK_DONE) against ``url``: a warm-up
    run, then the measured one with the server's CPU metered; its figures parsed."""
    # A short warm-up so every connection is open and the caches are hot.
    if warmup_s > 0:
        subprocess.run(["wrk", "-t", str(threads), "-c", str(conns), "-d", f"{warmup_s:g}s",
                        "-s", str(lua), url], capture_output=True, text=True, timeout=60)
    snap0 = snapshot() if snapshot else None
    before = srv.counters(model) if model else {}
    meter = CpuMeter(meter_pids or srv.processes())
    cmd = ["wrk", "-t", str(threads), "-c", str(conns), "-d", f"{duration}s", "--latency",
           "-s", str(lua), url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    meter.add("wrk", p.pid)
    time.sleep(max(0.0, duration - 0.5))
    used = meter.sample()
    out, _ = p.communicate(timeout=duration + 60)
    delta = counter_delta(before, srv.counters(model)) if model else {}
    snap1 = snapshot() if snapshot else None
    m = re.search(r"^BENCH (.*)$", out, re.M)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m or not rps:
        raise RuntimeError(f"could not parse wrk output:\n{out}")
    vals = {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    vals["non2xx_line"] = int(non2xx.group(1)) if non2xx else 0
    return {"rps": float(rps.group(1)), **vals, "server": delta,
            "cpu_pct": meter.percent(used, float(rps.group(1))),
            "cmd": " ".join(cmd), "raw": out,
            **({"snapshot": (snap0, snap1)} if snapshot else {})}


def grpc_body(model: str, x: np.ndarray) -> bytes:
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    t = req.inputs.add()
    t.name, t.datatype = "INPUT0", "FP32"
    t.shape.extend(x.shape)
    req.raw_input_contents.append(np.ascontiguousarray(x, dtype=np.float32).tobytes())
    msg = req.SerializeToString()
    return b"\x00" + struct.pack(">I", len(msg)) + msg


def check_grpc_body(srv: Server, body: bytes, want: np.ndarray) -> None:
    """Send exactly the bytes h2load will send through a real gRPC stack: grpc-status is in
    the trailers, which h2load does not read, so an invalid body would still count as 2xx."""
    import grpc
    from tritonclient.grpc import service_pb2
    with grpc.insecure_channel(srv.grpc) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                              request_serializer=None, response_deserializer=None)
        raw = call(body[5:], timeout=10)
    resp = service_pb2.ModelInferResponse.FromString(raw)
    got = np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(want.shape)
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise AssertionError("pre-encoded gRPC request returned a wrong output")


def check_grpc_ready(srv: Server) -> None:
    import grpc
    from tritonclient.grpc import service_pb2
    with grpc.insecure_channel(srv.grpc) as ch:
        call = ch.unary_unary("/inference.GRPCInferenceService/ServerReady",
                              request_serializer=None, response_deserializer=None)
        if not service_pb2.ServerReadyResponse.FromString(call(b"", timeout=10)).ready:
            raise AssertionError("ServerReady answered ready=false")


def run_h2load(srv: Server, model: str | None, x: np.ndarray | None, want: np.ndarray | None,
               tmp: Path, duration: int, conns: int = 64, meter_pids: dict | None = None) -> dict:
    """A pre-encoded ModelInferRequest to ModelInfer, or with model None an empty
    ServerReadyRequest to ServerReady (the frontend alone)."""
    if model:
        body = grpc_body(model, x)
        check_grpc_body(srv, body, want)
        method = "ModelInfer"
    else:
        body = b"\x00" + struct.pack(">I", 0)
        check_grpc_ready(srv)
        method = "ServerReady"
    path = tmp / f"grpc-{model or 'ready'}.bin"
    path.write_bytes(body)
    url = f"http://{srv.grpc}/inference.GRPCInferenceService/{method}"
    base = ["h2load", "-t", "1", "-c", str(conns), "-m", "1", "-d", str(path),
            "-H", "content-type: application/grpc", "-H", "te: trailers"]
    before = srv.counters(model) if model else {}
    meter = CpuMeter(meter_pids or srv.processes())
    cmd = [*base, "-D", str(duration), "--warm-up-time", "2", url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    meter.add("h2load", p.pid)
    time.sleep(2 + max(0.0, duration - 0.5))
    used = meter.sample()
    out, _ = p.communicate(timeout=duration + 60)
    delta = counter_delta(before, srv.counters(model)) if model else {}
    fin = re.search(r"finished in ([\d.]+)s, ([\d.]+) req/s", out)
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                    r"(\d+) failed, (\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    mean = re.search(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)", out)
    if not (fin and req and codes):
        raise RuntimeError(f"could not parse h2load output:\n{out}")
    return {"rps": float(fin.group(2)), "done": int(req.group(3)),
            "succeeded": int(req.group(4)), "failed": int(req.group(5)),
            "errored": int(req.group(6)), "s2xx": int(codes.group(1)),
            "non2xx": sum(int(codes.group(i)) for i in (2, 3, 4)),
            "mean_req": mean.group(3) if mean else "", "server": delta,
            "cpu_pct": meter.percent(used, float(fin.group(2))), "cmd": " ".join(cmd),
            "raw": out}
