"""Microbenchmark of the HTTP frontend's per-request CPU: this tree against a baseline.

    python benchmarks/http_codec_micro.py [--baseline REF] [--rounds N] [--batches N]
                                          [--only codec|handler|server] [--server]

Cases, for the two bodies of benchmarks/serving.py (`tiny`: FP32 [1,16] JSON in and out;
`mlp`: FP32 [1,1024] JSON in and out):
  * decode    http_codec.decode_infer_request on the wrk body
  * encode    http_codec.encode_infer_response, output as a memoryview (as a ZeroMQ frame)
  * validate  validation.validate_infer against the model's ModelInfo
  * handler   what start_http serves (http_server.make_runner; before it existed, an
              AppRunner over make_app) with a stub data plane (validate_infer, then a fixed
              FP32 output): aiohttp's RequestHandler on 64 connections (wrk's concurrency)
              is fed the request bytes and writes into a fake transport, in this process.
              CPU time per request: aiohttp's parsing and response building and our
              handler, without the kernel's socket work and without ZeroMQ.
  * server    (--server) the same app in a server process of its own on a loopback port, a
              client process keeping 64 keep-alive connections busy: the server's CPU time
              per request, socket reads and writes included. Noisier: the client competes
              for the same cores.

The baseline is `git archive REF services` unpacked in a temporary folder. Each round runs
the baseline and this tree in fresh processes, alternating; the table shows per-case
medians over the rounds (µs per call). CPU time, not wall time, so a busy machine moves the
numbers less, but run it more than once on a shared one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESPONSES: dict[str, str] = {}   # model -> last response of the handler case, Date removed
WIDTH = {"tiny": 16, "mlp": 1024}
CONNS = 64


def json_body(width: int) -> bytes:
    """benchmarks/bench_load.http_json_body on serving.py's input."""
    import numpy as np
    x = np.random.default_rng(1).random((1, width), dtype=np.float32)
    data = ",".join(f"{v:.6g}" for v in x.ravel())
    return (f'{{"inputs":[{{"name":"INPUT0","shape":[1,{width}],'
            f'"datatype":"FP32","data":[{data}]}}]}}').encode()


def output_bytes(width: int) -> bytes:
    """A ReLU layer's output: non-negative FP32, about half of it zeros."""
    import numpy as np
    y = np.random.default_rng(2).standard_normal((1, width), dtype=np.float32)
    return np.maximum(y, 0).tobytes()


def model_info(model: str):
    from services.common.messages import IOSpec, ModelInfo
    w = WIDTH[model]
    return ModelInfo(0, model, versions={1: "READY"}, max_batch_size=64,
                     inputs=[IOSpec("INPUT0", "FP32", [-1, w])],
                     outputs=[IOSpec("OUTPUT0", "FP32", [-1, w])])


class StubDataPlane:
    """What http_server calls for an infer request, without a scheduler: validation, then
    a fixed OUTPUT0 of the input's shape."""

    def __init__(self) -> None:
        from services.dataplane import types, validation
        self.validate, self.types = validation.validate_infer, types
        self.infos = {m: model_info(m) for m in WIDTH}
        self.outputs = {m: output_bytes(w) for m, w in WIDTH.items()}
        self.count = 0

    async def infer(self, req, endpoint: str = "HTTP end point"):
        self.validate(self.infos[req.model], req)
        self.count += 1
        t = req.inputs[0]
        return self.types.CoreResponse(
            req.model, "1", req.id, [self.types.OutputTensor(
                "OUTPUT0", "FP32", list(t.shape), memoryview(self.outputs[req.model]))])

    def release(self, resp) -> None:
        pass


def http_runner():
    """(runner, data plane): the runner start_http serves, over a StubDataPlane (call it
    on the running loop); http_server.make_runner, or what start_http built before it."""
    from aiohttp import web

    from services.frontend.http import aiohttp_server as http_server
    from services.frontend.settings import FrontendSettings
    dp = StubDataPlane()
    if hasattr(http_server, "make_runner"):
        return http_server.make_runner(dp, FrontendSettings("")), dp
    return web.AppRunner(http_server.make_app(dp, FrontendSettings("")), access_log=None,
                         handle_signals=False), dp


# ---- codec cases (in this process) ------------------------------------------------------

def time_call(fn, target_s: float = 0.2, repeat: int = 7) -> float:
    """Median over `repeat` timings of µs per call (each timing ~target_s)."""
    n = 1
    while True:
        t = timeit.timeit(fn, number=n)
        if t >= 0.02:
            break
        n *= 4
    n = max(1, int(n * target_s / t))
    return statistics.median(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6


def codec_cases() -> dict[str, float]:
    from services.dataplane.types import CoreResponse, OutputTensor
    from services.dataplane.validation import validate_infer
    from services.frontend.http import codec
    out = {}
    for model, w in WIDTH.items():
        body = json_body(w)
        req, binary = codec.decode_infer_request(model, "", body)
        assert req.inputs[0].data is not None
        out[f"decode {model}"] = time_call(lambda: codec.decode_infer_request(model, "", body))
        info = model_info(model)
        out[f"validate {model}"] = time_call(lambda: validate_infer(info, req))
        data = memoryview(output_bytes(w))
        resp = CoreResponse(model, "1", "", [OutputTensor("OUTPUT0", "FP32", [1, w], data)])
        out[f"encode {model}"] = time_call(
            lambda: codec.encode_infer_response(resp, req, binary))
    return out


# ---- handler case, in process (no sockets) ----------------------------------------------

class _Transport(asyncio.Transport):
    """Takes what aiohttp writes; each write is one whole response here (headers and a
    Content-Length body go out in one call)."""

    def __init__(self, state: dict) -> None:
        super().__init__()
        self.state, self.closing = state, False

    def write(self, data) -> None:
        st = self.state
        st["last"] = data
        st["pending"] -= 1
        if st["pending"] == 0:
            st["done"].set_result(None)

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def inproc_cases(batches: int, repeat: int = 5) -> dict[str, float]:
    """CPU per request of the whole app: aiohttp's RequestHandler fed the request bytes on
    64 connections at a time, responses taken by a fake transport (no syscalls)."""
    import uvloop

    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        runner, _ = http_runner()
        await runner.setup()
        out = {}
        for model, w in WIDTH.items():
            body = json_body(w)
            request = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                       f"\r\n").encode() + body
            state: dict = {}
            conns = []
            for _ in range(CONNS):
                proto = runner.server()
                proto.connection_made(_Transport(state))
                conns.append(proto)

            async def go(n: int) -> None:
                for _ in range(n):
                    state["pending"], state["done"] = CONNS, loop.create_future()
                    for proto in conns:
                        proto.data_received(request)
                    await state["done"]

            await go(max(1, batches // 5))
            if not state["last"].startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{model}: {state['last'][:300]!r}")
            samples = []
            for _ in range(repeat):
                t0 = time.process_time_ns()
                await go(batches)
                samples.append((time.process_time_ns() - t0) / 1e3 / (batches * CONNS))
            out[f"handler {model}"] = statistics.median(samples)
            RESPONSES[model] = re.sub(rb"\r\nDate: [^\r]*", b"", state["last"]).hex()
            for proto in conns:
                proto.connection_lost(None)
        await runner.cleanup()
        return out

    return uvloop.run(main())


# ---- server case (server process + client) ----------------------------------------------

def serve() -> None:
    """--serve: the app on an ephemeral port; prints the port, then on each stdin line
    prints this process's CPU time (ns) and the number of infer calls served."""
    import uvloop
    from aiohttp import web

    async def main() -> None:
        runner, dp = http_runner()
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        print(port, flush=True)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_stdin() -> None:
            line = sys.stdin.readline()
            if not line:
                loop.remove_reader(sys.stdin.fileno())
                done.set_result(None)
                return
            print(time.process_time_ns(), dp.count, flush=True)

        loop.add_reader(sys.stdin.fileno(), on_stdin)
        await done
        await runner.cleanup()

    uvloop.run(main())


class _Client(asyncio.Protocol):
    """Sends one request, waits for the whole response (Content-Length), sends the next."""

    def __init__(self, request: bytes, state: dict) -> None:
        self.request, self.state, self.buf = request, state, b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while True:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                break
            head = buf[:head_end].lower()
            i = head.find(b"content-length:")
            j = head.find(b"\r\n", i)
            length = int(head[i + 15:j if j >= 0 else len(head)]) if i >= 0 else 0
            end = head_end + 4 + length
            if len(buf) < end:
                break
            if not head.startswith(b"http/1.1 200"):
                self.state["errors"] += 1
            buf = buf[end:]
            self.state["done"] += 1
            if self.state["done"] < self.state["stop"]:
                self.transport.write(self.request)
            elif not self.state["finished"].done():
                self.state["finished"].set_result(None)
        self.buf = buf


def server_cases(requests: int) -> dict[str, float]:
    import uvloop
    env = dict(os.environ, PYTHONPATH=str(Path.cwd()))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(proc.stdout.readline())

        def server_cpu() -> tuple[int, int]:
            proc.stdin.write("\n")
            proc.stdin.flush()
            ns, count = proc.stdout.readline().split()
            return int(ns), int(count)

        async def load(model: str, n: int) -> int:
            body = json_body(WIDTH[model])
            request = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                       f"\r\n").encode() + body
            loop = asyncio.get_running_loop()
            state = {"done": 0, "stop": n, "errors": 0, "finished": loop.create_future()}
            conns = [await loop.create_connection(lambda: _Client(request, state),
                                                  "127.0.0.1", port) for _ in range(CONNS)]
            await state["finished"]
            for transport, _ in conns:
                transport.close()
            if state["errors"]:
                raise RuntimeError(f"{state['errors']} non-200 answers for {model}")
            return state["done"]

        out = {}
        for model in WIDTH:
            uvloop.run(load(model, requests // 5))          # warm-up
            cpu0, n0 = server_cpu()
            uvloop.run(load(model, requests))
            cpu1, n1 = server_cpu()
            out[f"server {model}"] = (cpu1 - cpu0) / 1e3 / (n1 - n0)
        return out
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def worker(only: str | None, server: bool, batches: int) -> None:
    """--worker: one round in this process's tree (PYTHONPATH), JSON on stdout."""
    import services
    out: dict[str, float] = {}
    if only in (None, "codec"):
        out.update(codec_cases())
    if only in (None, "handler"):
        out.update(inproc_cases(batches))
    if only == "server" or (only is None and server):
        out.update(server_cases(batches * CONNS))
    print(json.dumps({"tree": str(Path(services.__file__).parent.parent), "cases": out,
                      "responses": RESPONSES}))


def run_round(tree: Path, only: str | None, server: bool, batches: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--batches",
           str(batches)] + (["--only", only] if only else []) + (["--server"] if server else [])
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"worker failed in {tree}:\n{res.stderr}")
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    if Path(doc["tree"]).resolve() != tree.resolve():
        raise RuntimeError(f"worker imported services from {doc['tree']}, not {tree}")
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD", help="git ref to compare with (HEAD)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per tree (3)")
    ap.add_argument("--batches", type=int, default=100,
                    help="batches of 64 requests per model and timing in the handler case, "
                         "x64 requests in the server case (100)")
    ap.add_argument("--only", choices=["codec", "handler", "server"])
    ap.add_argument("--server", action="store_true", help="also run the server case")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve()
    if args.worker:
        return worker(args.only, args.server, args.batches)

    with tempfile.TemporaryDirectory(prefix="http-micro-") as tmp:
        base = Path(tmp)
        archive = subprocess.run(["git", "archive", args.baseline, "services"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(base, filter="data")
        results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
        responses: dict[str, dict[str, str]] = {}
        for r in range(args.rounds):
            for label, tree in (("before", base), ("after", ROOT)):
                doc = run_round(tree, args.only, args.server, args.batches)
                for case, us in doc["cases"].items():
                    results[label].setdefault(case, []).append(us)
                responses[label] = doc["responses"]
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    print(f"µs per call, median of {args.rounds} rounds (baseline {args.baseline} -> "
          f"working tree)")
    print(f"| {'case':<16} | {'before':>8} | {'after':>8} | {'change':>7} |")
    print(f"|{'-' * 18}|{'-' * 9}:|{'-' * 9}:|{'-' * 8}:|")
    for case in results["before"]:
        b = statistics.median(results["before"][case])
        a = statistics.median(results["after"][case])
        print(f"| {case:<16} | {b:8.1f} | {a:8.1f} | {(a - b) / b * 100:+6.0f}% |")
    if responses["before"]:
        same = responses["before"] == responses["after"]
        print(f"handler responses (status, headers but Date, body) identical: "
              f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
