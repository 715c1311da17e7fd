#!/usr/bin/env python
"""Trireme backends benchmark: one computation served by every backend, beside each framework
in process.

    python benchmarks/backends.py [--quick] [--width 256] [--layers 2] [--json results.json]
                                  [--only onnxruntime,pytorch,tensorflow,openvino,python]

What it does (see docs/benchmarks.md for the latest numbers):
  * one set of weights; per backend two models in ONE repository: mlp_<backend>, L x (W x W
    MatMul + bias + ReLU) FP32 [-1, W] (W 256, L 2), and identity_<backend>, FP32 [-1, 16]:
    model.onnx, TorchScript model.pt (nn.Linear + ReLU), SavedModel, OpenVINO IR (opset API),
    Python model.py (numpy, weights from .npy files read in initialize). Every config:
    max_batch_size 64, inputs/outputs written out (so no dynamic_batching is added), one
    KIND_CPU instance, one intra-op thread (OPENBLAS_NUM_THREADS=1 for numpy);
  * in process, in a fresh spawned process per framework (thread settings are per process),
    on the same file with one thread: ORT session.run, torch.jit.load + inference_mode, the
    SavedModel's serving_default signature, an OpenVINO infer request, for python the numpy
    computation itself: batch-1 p50/p99 and batch-64 rows/s;
  * `python -m services.cli serve` once with the whole repository; every served answer
    (batch 1 and 64, HTTP and gRPC) checked against the same framework in process; then
    per backend batch-1 p50/p99 at concurrency 1 (tritonclient.http / .grpc, binary data)
    and batch-64 rows/s from 1 and 2 threads, one client each, with the CPU per request of
    client, frontend, scheduler and worker (/proc) and the CPU other processes used;
  * the issue's target: python identity batch-1 p50 <= 1.2x the onnxruntime identity's;
  * afterwards the RSS of every server process and the framework libraries each maps.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# numpy's OpenBLAS reads this when it loads: set before numpy is imported here, so that the
# spawned in-process runs and the server (the python backend's numpy) inherit it too.
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import pct
from bench_server import CpuMeter, Server, log, machine_info, models, wait_quiet

BACKENDS = ("onnxruntime", "pytorch", "tensorflow", "openvino", "python")
THREAD_PARAM = {"onnxruntime": "intra_op_thread_count", "pytorch": "INTRA_OP_THREAD_COUNT",
                "tensorflow": "TF_NUM_INTRA_THREADS", "openvino": "INFERENCE_NUM_THREADS"}
FILES = {"onnxruntime": "model.onnx", "pytorch": "model.pt", "tensorflow": "model.savedmodel",
         "openvino": "model.xml", "python": "model.py"}
# What each framework maps into a process that imports it (as tests/e2e/test_mixed_repository.py).
LIBRARIES = {"onnxruntime": "onnxruntime_pybind11", "pytorch": "libtorch_cpu",
             "tensorflow": "libtensorflow_framework", "openvino": "libopenvino.so"}
ID_WIDTH, BATCH, TARGET = 16, 64, 1.2

PY_MLP = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """The MLP in numpy; weights.npy [L, W, W] and biases.npy [L, W] beside this file."""

    def initialize(self, args):
        d = f"{args['model_repository']}/{args['model_version']}"
        self.layers = list(zip(np.load(f"{d}/weights.npy"), np.load(f"{d}/biases.npy")))

    def execute(self, requests):
        responses = []
        for request in requests:
            h = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            for w, b in self.layers:
                h = np.maximum(h @ w + b, 0)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", h)]))
        return responses
'''


def io_names(backend: str) -> tuple[str, str]:
    # TorchScript keeps no tensor names: Triton's INPUT__<i>/OUTPUT__<i> convention.
    return ("INPUT__0", "OUTPUT__0") if backend == "pytorch" else ("INPUT0", "OUTPUT0")


def config(name: str, backend: str, width: int) -> str:
    i, o = io_names(backend)
    param = THREAD_PARAM.get(backend)
    return (f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: {BATCH}\n'
            f'input [{{ name: "{i}", data_type: TYPE_FP32, dims: [ {width} ] }}]\n'
            f'output [{{ name: "{o}", data_type: TYPE_FP32, dims: [ {width} ] }}]\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n'
            + (f'parameters {{ key: "{param}" value {{ string_value: "1" }} }}\n' if param else ""))


def numpy_mlp(x: np.ndarray, layers: list) -> np.ndarray:
    for w, b in layers:
        x = np.maximum(x @ w + b, 0)
    return x


# --------------------------------------------------------------------------- model files

def build(backend: str, d: Path, layers: list | None, width: int) -> Path:
    """<d>/1/<model file> computing `layers` (None: the identity) on FP32 [-1, width]."""
    path = d / "1" / FILES[backend]
    path.parent.mkdir(parents=True, exist_ok=True)
    if backend == "onnxruntime":
        # As tests/models.py (mlp, identity) with these weights and a fixed width: the
        # onnxruntime backend, as Triton's, wants outputs' dims to match the config exactly.
        from onnx import TensorProto, helper
        nodes, inits, prev = [], [], "INPUT0"
        if not layers:
            nodes.append(helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"]))
        for k, (w, b) in enumerate(layers or []):
            inits += [helper.make_tensor(f"w{k}", TensorProto.FLOAT, w.shape, w.ravel()),
                      helper.make_tensor(f"b{k}", TensorProto.FLOAT, b.shape, b)]
            out = "OUTPUT0" if k == len(layers) - 1 else f"h{k}"
            nodes += [helper.make_node("MatMul", [prev, f"w{k}"], [f"mm{k}"]),
                      helper.make_node("Add", [f"mm{k}", f"b{k}"], [f"a{k}"]),
                      helper.make_node("Relu", [f"a{k}"], [out])]
            prev = out
        vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", width])
              for n in ("INPUT0", "OUTPUT0")]
        models._save(helper.make_graph(nodes, "m", vi[:1], vi[1:], initializer=inits), path)
    elif backend == "pytorch":
        import models_torch
        import torch
        mods = []
        for w, b in layers or []:
            lin = torch.nn.Linear(width, width)
            lin.weight.data, lin.bias.data = torch.from_numpy(w.T.copy()), torch.from_numpy(b)
            mods += [lin, torch.nn.ReLU()]
        models_torch.save_script(torch.nn.Sequential(*mods) if mods else models_torch.Identity(), d)
    elif backend == "tensorflow":
        import tensorflow as tf
        m = tf.Module()
        m.layers = [(tf.Variable(w), tf.Variable(b)) for w, b in layers or []]

        @tf.function(input_signature=[tf.TensorSpec([None, width], tf.float32)])
        def serve(INPUT0):
            h = INPUT0
            for w, b in m.layers:
                h = tf.nn.relu(tf.matmul(h, w) + b)
            return {"OUTPUT0": tf.identity(h)}
        tf.saved_model.save(m, str(path), signatures={"serving_default": serve})
    elif backend == "openvino":
        import openvino as ov
        import openvino.opset16 as ops
        x = ops.parameter([-1, width], np.float32, name="INPUT0")
        node = x if layers else ops.identity(x)
        for w, b in layers or []:
            node = ops.relu(ops.add(ops.matmul(node, ops.constant(w), False, False),
                                    ops.constant(b)))
        node.output(0).get_tensor().set_names({"OUTPUT0"})
        ov.save_model(ov.Model([node], [x], "m"), str(path), compress_to_fp16=False)
    else:
        import models_python
        path.write_text((PY_MLP if layers else models_python.IDENTITY).lstrip())
        if layers:
            np.save(path.parent / "weights.npy", np.stack([w for w, _ in layers]))
            np.save(path.parent / "biases.npy", np.stack([b for _, b in layers]))
    return path


def load(backend: str, path: Path) -> Callable[[np.ndarray], np.ndarray]:
    """The model file run in this process on one thread: x -> output as numpy."""
    if backend == "onnxruntime":
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return lambda x: sess.run(None, {"INPUT0": x})[0]
    if backend == "pytorch":
        import torch
        torch.set_num_threads(1)
        module = torch.jit.load(str(path))

        def run(x):
            with torch.inference_mode():
                return module(torch.from_numpy(x)).numpy()
        return run
    if backend == "tensorflow":
        import tensorflow as tf
        sig = tf.saved_model.load(str(path)).signatures["serving_default"]
        return lambda x: sig(INPUT0=tf.constant(x))["OUTPUT0"].numpy()
    if backend == "openvino":
        import openvino as ov
        req = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_NUM_THREADS": 1}) \
            .create_infer_request()
        return lambda x: req.infer([x])[0]
    if (path.parent / "weights.npy").exists():
        layers = list(zip(*(np.load(path.parent / f) for f in ("weights.npy", "biases.npy"))))
        return lambda x: numpy_mlp(x, layers)
    return lambda x: x.copy()   # identity: nothing to compute; the copy stands for the output


# --------------------------------------------------------------------------- timing

def latency(call: Callable, warmup: int, n: int, pids: dict | None = None) -> dict:
    """Batch-1 p50/p99 of n calls; with pids, the CPU µs per call of each process."""
    for _ in range(warmup):
        call()
    lat = []
    meter = CpuMeter(pids or {})
    for _ in range(n):
        t = time.perf_counter_ns()
        call()
        lat.append(time.perf_counter_ns() - t)
    p50, p99, _ = pct(lat)
    return {"p50_ms": p50, "p99_ms": p99, "n": n,
            "cpu_us": {k: 1e6 * v["cpu"] / n for k, v in meter.sample().items()}}


def throughput(calls: list[Callable], seconds: float, pids: dict | None = None) -> dict:
    """calls back to back for `seconds` after 3 warm-up calls each: calls[0] in this thread,
    the others in threads of their own (a tritonclient.http client must stay in the thread
    that first used it: it runs on gevent)."""
    counts, errors, state = [0] * len(calls), [], {}

    def go() -> None:
        state["meter"], state["t0"] = CpuMeter(pids or {}), time.perf_counter()
    barrier = threading.Barrier(len(calls), action=go)

    def loop(k: int) -> None:
        try:
            for _ in range(3):
                calls[k]()
            barrier.wait()
            while time.perf_counter() - state["t0"] < seconds:
                calls[k]()
                counts[k] += 1
        except threading.BrokenBarrierError:
            pass   # another thread failed: its error is raised
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(1, len(calls))]
    for t in threads:
        t.start()
    loop(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall, done = time.perf_counter() - state["t0"], sum(counts)
    return {"rows_per_s": done * BATCH / wall,
            "cpu_us": {k: 1e6 * v["cpu"] / done for k, v in state["meter"].sample().items()}}


def inprocess(backend: str, repo: Path, layers: list, width: int, xs: dict, warmup: int, n: int,
              seconds: float) -> dict:
    """Spawned, one per backend: writes the backend's two models into repo, then runs each
    model file in process. Returns timings and the outputs for xs (to check the server)."""
    if backend == "tensorflow":   # settable only before TensorFlow's first op (the build)
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
    out: dict = {}
    for kind, (lay, w) in {"mlp": (layers, width), "identity": (None, ID_WIDTH)}.items():
        name = f"{kind}_{backend}"
        path = build(backend, repo / name, lay, w)
        models.write_config(repo / name, config(name, backend, w))
        f = load(backend, path)
        x1, x64 = xs[kind]
        out[kind] = {"b1": latency(lambda: f(x1), warmup, n),
                     "out1": f(x1), "out64": f(x64)}
        if kind == "mlp":
            out[kind]["b64"] = throughput([lambda: f(x64)], seconds)
    return out


def caller(tc, c, model: str, backend: str, x: np.ndarray) -> Callable[[], np.ndarray]:
    """call() sends x to model with client c (module tc) and returns the output as numpy."""
    i, o = io_names(backend)
    inp = tc.InferInput(i, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    outs = [tc.InferRequestedOutput(o)]
    return lambda: c.infer(model, [inp], outputs=outs).as_numpy(o)


def served(srv: Server, backend: str, xs: dict, ref: dict, warmup: int, n: int,
           seconds: float) -> dict:
    res: dict = {"mlp": {}, "identity": {}}
    procs = srv.processes()
    meter = CpuMeter({**procs, "client": os.getpid()})
    for proto, url in (("http", srv.http), ("grpc", srv.grpc)):
        tc = importlib.import_module(f"tritonclient.{proto}")
        clients = [tc.InferenceServerClient(url) for _ in range(2)]
        for kind in ("mlp", "identity"):
            model = f"{kind}_{backend}"
            # The processes on this model's path (the benchmark starts one frontend).
            pids = {"client": os.getpid(), "frontend": procs["frontend"],
                    "scheduler": procs["scheduler"], "worker": procs[f"worker[{model}]"]}
            one = caller(tc, clients[0], model, backend, xs[kind][0])
            big = [caller(tc, c, model, backend, xs[kind][1]) for c in clients]
            for call, want in ((one, ref[kind]["out1"]), (big[0], ref[kind]["out64"])):
                got = call()
                if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-5):
                    raise AssertionError(f"{proto} {model}: the served output differs from "
                                         f"{backend} in process")
            res[kind][proto] = latency(one, warmup, n, pids)
            if kind == "mlp":
                for conc in (1, 2):
                    res[kind][f"{proto}_c{conc}"] = throughput(big[:conc], seconds, pids)
        for c in clients:
            c.close()
    res["other_cpu_pct"] = meter.percent(meter.sample())["machine"]["other"]
    return res


def memory(srv: Server) -> dict:
    """label -> (RSS MiB, frameworks whose libraries the process maps)."""
    import psutil
    out = {}
    for label, pid in srv.processes().items():
        maps = Path(f"/proc/{pid}/maps").read_text()
        out[label] = {"rss_mib": psutil.Process(pid).memory_info().rss / 2**20,
                      "maps": [fw for fw, lib in LIBRARIES.items() if lib in maps]}
    return out


# --------------------------------------------------------------------------- report

def _ms(d: dict) -> str:
    return f"{d['p50_ms']:.3f} / {d['p99_ms']:.3f}"


def latency_table(kind: str, only: list[str], inproc: dict, srv: dict) -> str:
    rows = ["| backend | in-process p50 / p99 ms | HTTP p50 / p99 ms | gRPC p50 / p99 ms | "
            "HTTP − in-process p50 | gRPC − in-process p50 |", "|---|---:|---:|---:|---:|---:|"]
    for b in only:
        i, s = inproc[b][kind]["b1"], srv[b][kind]
        rows.append(f"| {b} | {_ms(i)} | {_ms(s['http'])} | {_ms(s['grpc'])} | "
                    f"{s['http']['p50_ms'] - i['p50_ms']:.3f} | "
                    f"{s['grpc']['p50_ms'] - i['p50_ms']:.3f} |")
    return "\n".join(rows)


def throughput_table(only: list[str], inproc: dict, srv: dict) -> str:
    rows = ["| backend | in-process rows/s | HTTP c1 | HTTP c2 | gRPC c1 | gRPC c2 | "
            "best served / in-process | other processes, % of a core |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in only:
        s, base = srv[b]["mlp"], inproc[b]["mlp"]["b64"]["rows_per_s"]
        vals = [s[k]["rows_per_s"] for k in ("http_c1", "http_c2", "grpc_c1", "grpc_c2")]
        other = srv[b]["other_cpu_pct"]
        rows.append(f"| {b} | {base:,.0f} | " + " | ".join(f"{v:,.0f}" for v in vals)
                    + f" | {max(vals) / base:.2f}× | {other:.0f}"
                    + (" **contended**" if other > 20 else "") + " |")
    return "\n".join(rows)


def cpu_table(only: list[str], inproc: dict, srv: dict) -> str:
    rows = ["| backend | MLP run | client | frontend | scheduler | worker | in-process time "
            "per call |", "|---|---|---:|---:|---:|---:|---:|"]
    for b in only:
        s, i = srv[b]["mlp"], inproc[b]["mlp"]
        for run, keys, own in (("batch 1", ("http", "grpc"), 1e3 * i["b1"]["p50_ms"]),
                               (f"batch {BATCH}, c1", ("http_c1", "grpc_c1"),
                                1e6 * BATCH / i["b64"]["rows_per_s"])):
            cells = [" / ".join(f"{s[k]['cpu_us'][p]:,.0f}" for k in keys)
                     for p in ("client", "frontend", "scheduler", "worker")]
            rows.append(f"| {b} | {run} | " + " | ".join(cells) + f" | {own:,.0f} |")
    return "\n".join(rows)


def identity_ratio(srv: dict) -> list[dict]:
    out = []
    for proto in ("http", "grpc"):
        py, onnx = (srv[b]["identity"][proto]["p50_ms"] for b in ("python", "onnxruntime"))
        out.append({"proto": proto, "python_ms": py, "onnx_ms": onnx, "ratio": py / onnx,
                    "pass": py / onnx <= TARGET})
    return out


def versions() -> dict:
    out = {}
    for p in ("torch", "tensorflow-cpu", "tensorflow", "openvino"):
        with contextlib.suppress(PackageNotFoundError):
            out[p] = version(p)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300 latency requests, 2 s runs")
    ap.add_argument("--width", type=int, default=256, help="MLP width W (256)")
    ap.add_argument("--layers", type=int, default=2, help="MLP layers L (2)")
    ap.add_argument("--only", default=",".join(BACKENDS), help="backends, comma-separated")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    only = args.only.split(",")
    if unknown := set(only) - set(BACKENDS):
        ap.error(f"unknown backend(s) {sorted(unknown)}; choose from {','.join(BACKENDS)}")
    warmup, n, seconds = (50, 300, 2.0) if args.quick else (200, 2000, 5.0)
    # Other engineers' test suites share these 2 cores: wait (up to 30 s) for a quiet moment.
    quiet_wait = 0 if args.quick else 30
    width = args.width

    info = machine_info(1) | versions()
    print(f"# Trireme backends benchmark\n\ncommand: `python benchmarks/backends.py "
          f"{' '.join(sys.argv[1:])}`\n\n| machine | |\n|---|---|", flush=True)
    print("\n".join(f"| {k} | {v} |" for k, v in info.items()) + "\n", flush=True)

    rng = np.random.default_rng(0)
    layers = [((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
               (0.1 * rng.standard_normal(width)).astype(np.float32)) for _ in range(args.layers)]
    xs = {"mlp": tuple(rng.standard_normal((b, width)).astype(np.float32) for b in (1, BATCH)),
          "identity": tuple(rng.standard_normal((b, ID_WIDTH)).astype(np.float32)
                            for b in (1, BATCH))}
    tmp = Path(tempfile.mkdtemp(prefix="trireme-backends-"))
    repo = tmp / "models"
    t_start = time.monotonic()
    inproc, results, mem, srv = {}, {}, {}, None
    try:
        ctx = multiprocessing.get_context("spawn")
        for b in only:
            if quiet_wait:
                wait_quiet(quiet_wait)
            log(f"{b}: building the models, then in process")
            with ctx.Pool(1) as pool:
                inproc[b] = pool.apply(inprocess, (b, repo, layers, width, xs, warmup, n, seconds))
            want = numpy_mlp(xs["mlp"][1], layers)   # the same computation in every framework
            if not np.allclose(inproc[b]["mlp"]["out64"], want, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{b} in process does not compute the numpy MLP")

        srv = Server(repo, 1, tmp / "server.log")
        log(f"starting: {' '.join(srv.cmd)}")
        srv.start()
        import tritonclient.http as httpclient
        c = httpclient.InferenceServerClient(srv.http)
        for b in only:
            for kind in ("mlp", "identity"):
                cfg = c.get_model_config(f"{kind}_{b}")
                if "dynamic_batching" in cfg or cfg["instance_group"][0]["count"] != 1:
                    raise AssertionError(f"{kind}_{b}: unexpected config {cfg}")
        c.close()
        for b in only:
            if quiet_wait:
                wait_quiet(quiet_wait)
            log(f"{b}: served")
            results[b] = served(srv, b, xs, inproc[b], warmup, n, seconds)
            r = results[b]["mlp"]
            log(f"  mlp b1 p50 HTTP {r['http']['p50_ms']:.3f} ms, gRPC {r['grpc']['p50_ms']:.3f}"
                f" ms; b64 HTTP c1 {r['http_c1']['rows_per_s']:,.0f} rows/s")
        mem = memory(srv)
    except BaseException:
        if srv is not None:
            log("server log tail:\n" + srv.tail())
        raise
    finally:
        if srv is not None:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    mlp = f"{args.layers} × {width}×{width} MLP"
    print(f"## Batch-1 latency, concurrency 1: {mlp}\n")
    print(latency_table("mlp", only, inproc, results))
    print(f"\n## Batch-1 latency, concurrency 1: identity FP32 [1, {ID_WIDTH}]\n")
    print(latency_table("identity", only, inproc, results))
    print(f"\n## Batch-{BATCH} throughput, {mlp} (rows/s; cN = N threads, one client each)\n")
    print(throughput_table(only, inproc, results))
    print("\n## CPU per MLP request by process, µs (all threads, from /proc; HTTP / gRPC)\n")
    print(cpu_table(only, inproc, results))
    ratios = identity_ratio(results) if {"python", "onnxruntime"} <= set(only) else []
    if ratios:
        print(f"\n## Issue target: python identity round trip ≤ {TARGET}× the onnxruntime "
              "identity's (batch-1 p50)\n")
        print("| protocol | python ms | onnxruntime ms | ratio | result |\n"
              "|---|---:|---:|---:|---|")
        for r in ratios:
            print(f"| {r['proto']} | {r['python_ms']:.3f} | {r['onnx_ms']:.3f} | "
                  f"{r['ratio']:.2f}× | {'PASS' if r['pass'] else '**FAIL**'} |")
    print("\n## Server processes after the runs\n")
    print("| process | RSS MiB | framework libraries mapped |\n|---|---:|---|")
    for label, m in mem.items():
        print(f"| {label} | {m['rss_mib']:,.0f} | {', '.join(m['maps']) or 'none'} |")
    print(f"\n({n} latency requests after {warmup} warm-up; {seconds:g} s per throughput run; "
          f"total {time.monotonic() - t_start:.0f} s)")

    if args.json:
        strip = {b: {k: {kk: vv for kk, vv in v.items() if not kk.startswith("out")}
                     for k, v in d.items()} for b, d in inproc.items()}
        args.json.write_text(json.dumps(
            {"machine": info, "args": vars(args) | {"json": str(args.json)}, "inprocess": strip,
             "served": results, "identity_ratio": ratios, "memory": mem}, indent=1))
        log(f"wrote {args.json}")
    return 0 if all(r["pass"] for r in ratios) else 1


if __name__ == "__main__":
    sys.exit(main())
