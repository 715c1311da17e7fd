"""`trireme perf` (perf_analyzer's interface) end to end: `python -m services.cli perf` run as
a subprocess against a real `trireme serve`, as a user's script would run perf_analyzer.

One server of its own, so every request it counts is one of ours:
  add_sub          ONNX, max_batch_size 8 (auto-completed dynamic batching)
  cached           the same with the response cache on
  simple_sequence  Triton's simple_sequence example (a sequence model)
  repeat           Python, decoupled: one response per element of IN, then the final flag
(and, for --ssl-*, a second server that asks every client for a certificate).
Windows are short (-p 300) and the stability percentage wide where a test is not about
stability: the machine running the tests is shared, and what is tested is the tool's
behaviour, not the server's steadiness.
"""
from __future__ import annotations

import csv
import json
import os
import re
import socket
import ssl
import subprocess
import sys

import models
import models_python
import models_sequence
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import trustme
from conftest import ROOT, start_server

from services.perf import lean_h2, lean_http
from services.perf.flags import SslSettings
from services.perf.model import Tensor
from services.perf.worker_core import WorkerSpec

PA_CSV_HEADER = ["Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv",
                 "Server Queue", "Server Compute Input", "Server Compute Infer",
                 "Server Compute Output", "Client Recv", "p50 latency", "p90 latency",
                 "p95 latency", "p99 latency"]
FAST = ["-p", "300", "-s", "1000", "--max-trials", "6"]
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\n'
                        'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'
                        'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n')
    models.add_sub(root / "cached")
    models.write_config(root / "cached", 'name: "cached"\nbackend: "onnxruntime"\n'
                        'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'
                        'response_cache { enable: true }\n')
    models_sequence.simple_sequence(root / "simple_sequence")
    models_python.python_model(root, "repeat", models_python.REPEAT, models_python.io_config(
        "repeat", [("IN", "TYPE_INT32", "[ -1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    with start_server(root, "--allow-client-shm", "true", "--cache-config",
                      "local,size=1048576") as s:
        yield s


def perf(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "perf", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def ints(pattern: str, text: str) -> list[int]:
    return [int(v) for v in re.findall(pattern, text)]


def perf_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("perf-")}


def test_http_sweep_prints_levels_summary_and_csv(srv, tmp_path):
    out_csv = tmp_path / "perf.csv"
    r = perf("-m", "add_sub", "-u", srv.http_url, "--concurrency-range", "1:2", *FAST,
             "-f", str(out_csv))
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout
    assert "*** Measurement Settings ***" in out
    assert "Request concurrency: 1" in out and "Request concurrency: 2" in out
    assert out.count("  Client: ") == 2 and out.count("  Server: ") == 2
    assert all(n > 0 for n in ints(r"    Request count: (\d+)", out))
    assert len(ints(r"    Request count: (\d+)", out)) == 2
    for line in ("Throughput: ", "Avg latency: ", "p50 latency: ", "p90 latency: ",
                 "p95 latency: ", "p99 latency: ", "Avg HTTP time: ", "Client CPU: ",
                 "Successful request count: ", "compute infer "):
        assert line in out, line
    assert "Inferences/Second vs. Client Average Batch Latency" in out
    assert re.search(r"^Concurrency: 1, throughput: [\d.e+]+ infer/sec, latency \d+ usec$", out, re.M)
    assert re.search(r"^Concurrency: 2, throughput: [\d.e+]+ infer/sec, latency \d+ usec$", out, re.M)
    rows = list(csv.reader(out_csv.open()))
    assert rows[0] == PA_CSV_HEADER
    assert sorted(int(row[0]) for row in rows[1:]) == [1, 2]
    ips = [float(row[1]) for row in rows[1:]]
    assert ips == sorted(ips) and ips[0] > 0   # (perf_analyzer's order: by throughput)


@pytest.mark.parametrize("protocol,impl", [("grpc", "auto"), ("http", "auto"),
                                           ("grpc", "tritonclient")])
def test_server_breakdown_is_the_statistics_delta(srv, protocol, impl):
    """--request-count: one window around exactly N requests; what it prints for the server
    is the statistics extension's delta over the run, to the microsecond. On the lean path
    (the default here) and on tritonclient's."""
    c = grpcclient.InferenceServerClient(srv.grpc_url)

    def stats():
        s = c.get_inference_statistics("add_sub", "1", as_json=True)["model_stats"][0]
        return {k: int(v.get("count", 0)) for k, v in s["inference_stats"].items()} | \
            {k + "_ns": int(v.get("ns", 0)) for k, v in s["inference_stats"].items()} | \
            {"inference_count": int(s.get("inference_count", 0)),
             "execution_count": int(s.get("execution_count", 0))}
    try:
        before = stats()
        url = srv.grpc_url if protocol == "grpc" else srv.http_url
        r = perf("-m", "add_sub", "-x", "1", "-i", protocol, "-u", url, "--concurrency-range",
                 "4", "--request-count", "40", "-p", "300", "--load-impl", impl)
        assert r.returncode == 0, r.stderr + r.stdout
        after = stats()
    finally:
        c.close()
    d = {k: after[k] - before[k] for k in after}
    out = r.stdout
    lean = impl == "auto"
    assert ("Load generator: 1 process, lean" in out) == lean, out
    assert d["success"] == 40
    assert ints(r"    Request count: (\d+)", out) == [40]
    assert ints(r"Successful request count: (\d+)", out) == [40]
    assert ints(r"Inference count: (\d+)", out) == [d["inference_count"]]
    assert ints(r"Execution count: (\d+)", out) == [d["execution_count"]]
    got = re.search(r"Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec "
                    r"\+ compute input (\d+) usec \+ compute infer (\d+) usec \+ compute output "
                    r"(\d+) usec\)", out)
    assert got, out

    def avg(name):
        return d[name + "_ns"] // (d[name] * 1000) if d[name] else 0
    total, queue = avg("success"), avg("queue")
    compute = (d["compute_input_ns"] + d["compute_infer_ns"] + d["compute_output_ns"]) // \
        (d["compute_input"] * 1000)
    assert [int(v) for v in got.groups()] == [
        total, max(0, total - queue - compute), queue, avg("compute_input"),
        avg("compute_infer"), avg("compute_output")]


def test_a_level_that_cannot_stabilise_exits_2(srv):
    r = perf("-m", "add_sub", "-u", srv.http_url, "-p", "300", "--stability-percentage",
             "0.0001", "--max-trials", "2")
    assert r.returncode == 2, r.stderr + r.stdout
    assert "Failed to obtain stable measurement within 2 measurement windows for " \
           "concurrency 1" in r.stderr
    assert "Inferences/Second vs." not in r.stdout


def test_unknown_model_is_a_clear_error(srv):
    r = perf("-m", "no_such_model", "-u", srv.http_url)
    assert r.returncode == 99
    assert "error: failed to get model metadata" in r.stderr and "no_such_model" in r.stderr


@pytest.mark.parametrize("flag", [["--shared-memory", "cuda"], ["--profile-export-file", "x.json"],
                                  ["--fixed-schedule"], ["--service-kind", "torchserve"]])
def test_a_refused_flag_is_named(flag):
    r = perf("-m", "add_sub", "-u", "127.0.0.1:1", *flag)   # (refused before any connection)
    assert r.returncode == 99
    assert f"{flag[0]}" in r.stderr and "not supported by trireme perf" in r.stderr


def test_request_rate_over_grpc_with_shared_memory(srv):
    before = perf_segments()
    r = perf("-m", "add_sub", "-i", "grpc", "-u", srv.grpc_url, "--request-rate-range", "150",
             "--shared-memory", "system", "-b", "2", *FAST)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "Request Rate: 150 inference requests per second" in r.stdout
    assert re.search(r"^Request Rate: 150, throughput: [\d.]+ infer/sec", r.stdout, re.M)
    assert ints(r"    Request count: (\d+)", r.stdout)[0] > 0
    assert "Avg gRPC time: " in r.stdout
    assert perf_segments() <= before   # (every region unregistered and unlinked)


def test_response_cache_hits_and_misses(srv, tmp_path):
    out_csv = tmp_path / "cache.csv"
    r = perf("-m", "cached", "-u", srv.http_url, "--input-data", "zero", *FAST, "-f", str(out_csv))
    assert r.returncode == 0, r.stderr + r.stdout
    assert ints(r"Cache hit count: (\d+)", r.stdout)[0] > 0   # (the same zeros every time)
    assert "Average Cache Hit Latency: " in r.stdout and "cache hit/miss " in r.stdout
    header = next(csv.reader(out_csv.open()))
    assert header[header.index("Server Compute Output") + 1:header.index("Client Recv")] == \
        ["Server Cache Hit", "Server Cache Miss"]


def test_sequence_model(srv):
    r = perf("-m", "simple_sequence", "-u", srv.http_url, "--concurrency-range", "2",
             "--sequence-length", "4", "--sequence-id-range", "100:200", *FAST)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "Using asynchronous calls for inference" in r.stdout   # (a sequence model's default)
    assert ints(r"Sequence count: (\d+)", r.stdout)[0] > 0


def test_decoupled_model_over_a_grpc_stream(srv):
    r = perf("-m", "repeat", "-i", "grpc", "-u", srv.grpc_url, "--streaming", "--shape", "IN:3",
             *FAST)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "Detected decoupled model" in r.stdout
    requests = ints(r"    Request count: (\d+)", r.stdout)[0]
    assert requests > 0
    ips = float(re.search(r"    Throughput: ([\d.e+]+) infer/sec", r.stdout).group(1))
    rps = float(re.search(r"Response Throughput: ([\d.e+]+) infer/sec", r.stdout).group(1))
    assert rps == pytest.approx(3 * ips, rel=1e-3)   # (3 responses to each request)
    plain = perf("-m", "repeat", "-u", srv.http_url, "--shape", "IN:3")
    assert plain.returncode == 99 and "--streaming" in plain.stderr


def test_mutual_tls_over_https_and_grpc(tmp_path):
    """--ssl-https-* with -u https://... and --ssl-grpc-*, against a server that asks every
    client for a certificate (--{http,grpc}-use-ssl-mutual)."""
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("perf.client")
    pem = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "client_cert",
                                                       "client_key")}
    for name, blob in (("ca", ca.cert_pem), ("cert", server.cert_chain_pems[0]),
                       ("key", server.private_key_pem), ("client_cert", client.cert_chain_pems[0]),
                       ("client_key", client.private_key_pem)):
        blob.write_to_path(str(pem[name]))
    flags = []
    for p in ("grpc", "http"):
        flags += [f"--{p}-use-ssl-mutual", "true", f"--{p}-server-cert", str(pem["cert"]),
                  f"--{p}-server-key", str(pem["key"]), f"--{p}-root-cert", str(pem["ca"])]
    probe = ssl.create_default_context(cafile=str(pem["ca"]))
    probe.load_cert_chain(str(pem["client_cert"]), str(pem["client_key"]))
    repo = tmp_path / "models"
    models.add_sub(repo / "add_sub")
    models.write_config(repo / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\n'
                        'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n')
    with start_server(repo, *flags, https=probe) as s:
        r = perf("-m", "add_sub", "-u", f"https://{s.http_url}", "--ssl-https-ca-certificates-file",
                 str(pem["ca"]), "--ssl-https-client-certificate-file", str(pem["client_cert"]),
                 "--ssl-https-private-key-file", str(pem["client_key"]), *FAST)
        assert r.returncode == 0, r.stderr + r.stdout
        assert ints(r"    Request count: (\d+)", r.stdout)[0] > 0
        g = perf("-m", "add_sub", "-i", "grpc", "-u", s.grpc_url, "--ssl-grpc-use-ssl",
                 "--ssl-grpc-root-certifications-file", str(pem["ca"]),
                 "--ssl-grpc-private-key-file", str(pem["client_key"]),
                 "--ssl-grpc-certificate-chain-file", str(pem["client_cert"]), *FAST)
        assert g.returncode == 0, g.stderr + g.stdout
        assert ints(r"    Request count: (\d+)", g.stdout)[0] > 0
        no_cert = perf("-m", "add_sub", "-u", f"https://{s.http_url}",
                       "--ssl-https-ca-certificates-file", str(pem["ca"]), *FAST)
        assert no_cert.returncode == 99   # (the server asks for a client certificate)


# ---- the lean path (requests encoded once, our own HTTP/1.1 and HTTP/2 connections)

def lean_spec(protocol: str, url: str, **kw) -> tuple[WorkerSpec, dict, dict]:
    """add_sub's request as trireme perf makes it, and the outputs it must answer."""
    rng = np.random.default_rng(7)
    a, b = (rng.random((1, 16), dtype=np.float32) for _ in range(2))
    io = [Tensor(f"INPUT{i}", "FP32", [-1, 16]) for i in (0, 1)]
    outs = [Tensor(f"OUTPUT{i}", "FP32", [-1, 16]) for i in (0, 1)]
    spec = WorkerSpec(index=0, processes=1, protocol=protocol, url=url, ssl=SslSettings(),
                      headers={}, model="add_sub", version="1", inputs=io, outputs=outs,
                      requests=[{"INPUT0": a, "INPUT1": b}], streams=[], sequence=None,
                      lean=True, **kw)
    return spec, spec.requests[0], {"OUTPUT0": a + b, "OUTPUT1": a - b}


@pytest.mark.parametrize("output_json", [False, True])
def test_one_lean_http_response_exactly(srv, output_json):
    """The pre-encoded request's bytes on a keep-alive connection: every output exact, twice."""
    spec, sample, want = lean_spec("http", srv.http_url, output_json=output_json)
    raw = lean_http.http_request(spec, sample)
    got: list = []
    parser = lean_http.ResponseParser(lambda *r: got.append(r), keep_body=True)
    with socket.create_connection(("127.0.0.1", int(srv.http_url.rsplit(":", 1)[1]))) as sock:
        for n in (1, 2):
            sock.sendall(raw)
            while len(got) < n:
                data = sock.recv(65536)
                assert data, "the server closed the connection"
                parser.feed(data)
    for status, body, close in got:
        assert (status, close) == (200, False)
        header, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))
        blob, outputs = body[end:], {}
        for o in header["outputs"]:
            if output_json:
                outputs[o["name"]] = np.array(o["data"], np.float32).reshape(o["shape"])
            else:
                n = o["parameters"]["binary_data_size"]
                outputs[o["name"]] = np.frombuffer(blob[:n], np.float32).reshape(o["shape"])
                blob = blob[n:]
        assert outputs.keys() == want.keys()
        for k, v in want.items():
            assert np.array_equal(outputs[k], v), k


def test_one_lean_grpc_response_exactly(srv):
    """The pre-serialised ModelInferRequest, as bytes through a gRPC stack: outputs exact."""
    import grpc
    from tritonclient.grpc import service_pb2  # type: ignore[import-untyped]
    spec, sample, want = lean_spec("grpc", srv.grpc_url)
    msg = lean_h2.grpc_message(spec, sample)
    with grpc.insecure_channel(srv.grpc_url) as ch:
        call = ch.unary_unary(lean_h2.METHOD.decode())
        resp = service_pb2.ModelInferResponse.FromString(call(msg[5:], timeout=30))
    got = {o.name: np.frombuffer(raw, np.float32).reshape(list(o.shape))
           for o, raw in zip(resp.outputs, resp.raw_output_contents)}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert np.array_equal(got[k], v), k


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_lean_request_rate(srv, protocol):
    url = srv.grpc_url if protocol == "grpc" else srv.http_url
    r = perf("-m", "add_sub", "-i", protocol, "-u", url, "--request-rate-range", "200",
             "--request-distribution", "poisson", *FAST)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "Load generator: 1 process, lean" in r.stdout
    assert ints(r"    Request count: (\d+)", r.stdout)[0] > 0
    assert re.search(r"^Request Rate: 200, throughput: [\d.]+ infer/sec", r.stdout, re.M)


def test_lean_errors_end_the_run_with_the_servers_text(srv):
    r = perf("-m", "add_sub", "-u", srv.http_url, "--shape", "INPUT0:3", "--shape", "INPUT1:3",
             *FAST)
    assert r.returncode == 99, r.stderr + r.stdout
    assert "Thread [0] had error: [400]" in r.stderr
    g = perf("-m", "add_sub", "-i", "grpc", "-u", srv.grpc_url, "--shape", "INPUT0:3",
             "--shape", "INPUT1:3", *FAST)
    assert g.returncode == 99, g.stderr + g.stdout
    assert "Thread [0] had error: [StatusCode.INVALID_ARGUMENT]" in g.stderr


def test_load_impl_lean_refuses_what_it_does_not_cover(srv):
    r = perf("-m", "add_sub", "-u", srv.http_url, "--shared-memory", "system",
             "--load-impl", "lean")
    assert r.returncode == 99
    assert "--load-impl lean does not cover --shared-memory system" in r.stderr
