"""Triton's trace extension for requests with a stream of responses, on real processes: each
request of a gRPC ModelStreamInfer stream (a plain and a decoupled model) and HTTP generate
and generate_stream requests, each a trace of its own in the trace file, with the names in
the order tritonserver 2.51 writes them for the same Python models and requests (asked:
src/grpc/stream_infer_handler.cc, http_server.cc's GenerateRequestClass). A BLS request is
no trace of its own (Triton 2.51 writes none for it either).
"""
from __future__ import annotations

import json
import queue
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from models_python import ADD_SUB, ADD_SUB_CONFIG, BLS, REPEAT, io_config, python_model
from test_trace import GRPC_NAMES, HTTP_NAMES, ORDER, times, traces

WAIT_S = 30.0
GENERATE_NAMES = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START",
                  "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
                  "INFER_RESPONSE_COMPLETE", "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace_streams")
    repo = root / "models"
    python_model(repo, "py_add_sub", ADD_SUB, ADD_SUB_CONFIG.format(name="py_add_sub",
                                                                     batching=""))
    python_model(repo, "repeat", REPEAT, io_config(
        "repeat", [("IN", "TYPE_INT32", "[ -1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    python_model(repo, "bls", BLS, io_config(
        "bls", [("MODEL_NAME", "TYPE_STRING", "[ 1 ]"), ("INPUT0", "TYPE_FP32", "[ 4 ]"),
                ("INPUT1", "TYPE_FP32", "[ 4 ]")],
        [("OUTPUT0", "TYPE_FP32", "[ 4 ]"), ("OUTPUT1", "TYPE_FP32", "[ 4 ]")]))
    trace_file = root / "trace.json"
    with start_server(repo, "--trace-config", f"triton,file={trace_file}",
                      "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1",
                      "--trace-config", "triton,log-frequency=1") as srv:
        srv.trace_file = trace_file   # type: ignore[attr-defined]
        yield srv


def next_traces(trace_file: Path, before: set[str], count: int) -> list[list[dict]]:
    """The next ``count`` traces (log-frequency 1: a file each), oldest first."""
    def ready():
        got = {p.name: p for p in trace_file.parent.glob(trace_file.name + ".*")
               if p.name not in before}
        return got if len(got) >= count else None
    got = wait_until(ready, WAIT_S, f"{count} new trace file(s)")
    out = []
    for name in sorted(got, key=lambda n: int(n.rsplit(".", 1)[1])):
        out += list(traces(json.loads(got[name].read_text())).values())
    return out


def files(trace_file: Path) -> set[str]:
    return {p.name for p in trace_file.parent.glob(trace_file.name + ".*")}


def names(entries: list[dict]) -> list[str]:
    return [e["timestamps"][0]["name"] for e in entries if "timestamps" in e]


def check(entries: list[dict], model: str, expected: list[str], request_id: str = "",
          ordered: bool = True) -> None:
    """One trace: its model object, exactly ``expected``; ``ordered``: its times in the
    order they happen (a decoupled request's REQUEST_END is its final flag, which races
    with the sends)."""
    objects = [e for e in entries if "model_name" in e]
    obj = {"id": entries[0]["id"], "model_name": model, "model_version": 1}
    if request_id:
        obj["request_id"] = request_id
    assert objects == [obj]
    assert names(entries) == expected
    t = times(entries)
    for first, then in ORDER if ordered else ():
        if first in t and then in t and t[first] and t[then]:
            assert t[first] <= t[then], (first, then, t)


def test_each_stream_request_is_a_trace(server):
    before = files(server.trace_file)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(lambda result, error: got.put((result, error)))
    try:
        a = np.arange(4, dtype=np.float32)
        inputs = [grpcclient.InferInput("INPUT0", [4], "FP32"),
                  grpcclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a + 1)
        client.async_stream_infer("py_add_sub", inputs, request_id="s1")
        assert got.get(timeout=WAIT_S)[1] is None
        values = grpcclient.InferInput("IN", [3], "INT32")
        values.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
        client.async_stream_infer("repeat", [values], request_id="r1")
        for _ in range(3):
            assert got.get(timeout=WAIT_S)[1] is None
    finally:
        client.stop_stream()
        client.close()
    plain, decoupled = next_traces(server.trace_file, before, 2)
    check(plain, "py_add_sub", GRPC_NAMES, "s1")
    # Triton: the first response's INFER_RESPONSE_COMPLETE, a send per response written
    # (and COMPUTE_*, which a response sender's request does not carry here yet)
    check(decoupled, "repeat", ["REQUEST_START", "QUEUE_START", "GRPC_WAITREAD_START",
                                "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE",
                                *["GRPC_SEND_START", "GRPC_SEND_END"] * 3, "REQUEST_END"], "r1",
          ordered=False)
    assert plain[0]["id"] != decoupled[0]["id"]


def post(server, model: str, route: str, doc: dict) -> bytes:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{route}",
                                 json.dumps(doc).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        return r.read()


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_generate_requests_are_traced(server, route):
    before = files(server.trace_file)
    body = post(server, "py_add_sub", route, {"INPUT0": [0, 1, 2, 3], "INPUT1": [1, 2, 3, 4]})
    assert b'"OUTPUT0":[1.0,3.0,5.0,7.0]' in body
    (entries,) = next_traces(server.trace_file, before, 1)
    check(entries, "py_add_sub", GENERATE_NAMES)
    t = times(entries)
    assert (t["HTTP_SEND_START"], t["HTTP_SEND_END"]) == (0, 0)   # as Triton's evhtp


def test_generate_stream_of_a_decoupled_model(server):
    before = files(server.trace_file)
    body = post(server, "repeat", "generate_stream", {"IN": [1, 2]})
    assert body.count(b"data: ") == 2
    (entries,) = next_traces(server.trace_file, before, 1)
    # a completion per response and the bare final flag, a send per event written
    check(entries, "repeat", ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START",
                              "QUEUE_START", *["INFER_RESPONSE_COMPLETE"] * 3, "REQUEST_END",
                              *["HTTP_SEND_START", "HTTP_SEND_END"] * 2])


def test_a_bls_request_is_no_trace_of_its_own(server):
    before = files(server.trace_file)
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        a = np.arange(4, dtype=np.float32)
        inputs = [httpclient.InferInput("MODEL_NAME", [1], "BYTES"),
                  httpclient.InferInput("INPUT0", [4], "FP32"),
                  httpclient.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(np.array([b"py_add_sub"], dtype=object))
        inputs[1].set_data_from_numpy(a)
        inputs[2].set_data_from_numpy(a + 1)
        client.infer("bls", inputs, request_id="b1")
        infer_after = np.arange(4, dtype=np.float32)   # a later request: the next trace
        later = [httpclient.InferInput("INPUT0", [4], "FP32"),
                 httpclient.InferInput("INPUT1", [4], "FP32")]
        later[0].set_data_from_numpy(infer_after)
        later[1].set_data_from_numpy(infer_after)
        client.infer("py_add_sub", later)
    finally:
        client.close()
    bls, after = next_traces(server.trace_file, before, 2)
    check(bls, "bls", HTTP_NAMES, "b1")
    check(after, "py_add_sub", HTTP_NAMES)
    assert after[0]["id"] == bls[0]["id"] + 1   # no trace between them: the BLS request's
