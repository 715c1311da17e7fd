"""Triton's trace extension on real processes, with the official tritonclient: the settings
over HTTP and gRPC (global and per model, cleared with None), and the trace files Triton
writes (--trace-config triton,file=...): exactly trace_count traces, one file per
log_frequency traces, each trace the model object and its timestamps in order, ensemble
steps as child traces with parent_id, TENSORS level, and the file itself closed at shutdown.

The layouts checked here are the ones tritonserver 2.51 writes for the same models and
requests (Python add_sub and an ensemble of two models, HTTP and gRPC).
"""
from __future__ import annotations

import json
from pathlib import Path

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, stop_server, wait_until
from models_python import ADD_SUB, ADD_SUB_CONFIG, python_model
from tritonclient.utils import InferenceServerException

WAIT_S = 30.0
HTTP_NAMES = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START",
              "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
              "INFER_RESPONSE_COMPLETE", "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]
GRPC_NAMES = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
              "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END", "GRPC_WAITREAD_START",
              "GRPC_WAITREAD_END", "INFER_RESPONSE_COMPLETE", "GRPC_SEND_START", "GRPC_SEND_END"]
# the order every trace's times are in (each pair: the first is not after the second)
ORDER = [("HTTP_RECV_START", "HTTP_RECV_END"), ("HTTP_RECV_END", "REQUEST_START"),
         ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END"), ("GRPC_WAITREAD_END", "REQUEST_START"),
         ("REQUEST_START", "QUEUE_START"), ("QUEUE_START", "COMPUTE_START"),
         ("COMPUTE_START", "COMPUTE_INPUT_END"), ("COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
         ("COMPUTE_OUTPUT_START", "COMPUTE_END"), ("COMPUTE_END", "INFER_RESPONSE_COMPLETE"),
         ("INFER_RESPONSE_COMPLETE", "REQUEST_END"), ("REQUEST_END", "HTTP_SEND_START"),
         ("REQUEST_END", "GRPC_SEND_START"), ("HTTP_SEND_START", "HTTP_SEND_END"),
         ("GRPC_SEND_START", "GRPC_SEND_END"), ("COMPUTE_END", "REQUEST_END")]
CLEAR = {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trace") / "models"
    models.add_sub(root / "add_sub", size=4, batch=False)
    models.write_config(root / "add_sub", 'name: "add_sub"\nbackend: "onnxruntime"\n'
                        'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    python_model(root, "py_add_sub", ADD_SUB, ADD_SUB_CONFIG.format(name="py_add_sub",
                                                                     batching=""))
    models.write_config(root / "chain", '''
name: "chain"
platform: "ensemble"
input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [4] },
       { name: "INPUT1", data_type: TYPE_FP32, dims: [4] }]
output [{ name: "OUT0", data_type: TYPE_FP32, dims: [4] },
        { name: "OUT1", data_type: TYPE_FP32, dims: [4] }]
ensemble_scheduling { step [
  { model_name: "add_sub", model_version: -1,
    input_map { key: "INPUT0", value: "INPUT0" } input_map { key: "INPUT1", value: "INPUT1" }
    output_map { key: "OUTPUT0", value: "s" } output_map { key: "OUTPUT1", value: "d" } },
  { model_name: "py_add_sub", model_version: -1,
    input_map { key: "INPUT0", value: "s" } input_map { key: "INPUT1", value: "d" }
    output_map { key: "OUTPUT0", value: "OUT0" } output_map { key: "OUTPUT1", value: "OUT1" } }
] }
''')
    (root / "chain" / "1").mkdir()
    return root


@pytest.fixture(scope="module")
def server(repo):
    trace_file = repo.parent / "trace.json"
    with start_server(repo, "--trace-config", f"triton,file={trace_file}",
                      "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1") as srv:
        srv.trace_file = trace_file   # type: ignore[attr-defined]
        yield srv


@pytest.fixture
def http(server):
    c = httpclient.InferenceServerClient(server.http_url)
    yield c
    for model in ("add_sub", "py_add_sub", "chain"):   # every setting back to the start-up one
        c.update_trace_settings(model_name=model, settings=CLEAR)
    c.update_trace_settings(settings=CLEAR)
    c.close()


def infer(client, module, model: str, n: int = 1, request_id: str = "") -> None:
    a = np.arange(4, dtype=np.float32)
    for _ in range(n):
        inputs = [module.InferInput("INPUT0", [4], "FP32"), module.InferInput("INPUT1", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a + 1)
        client.infer(model, inputs, request_id=request_id)


def indexed(trace_file: Path) -> dict[str, list]:
    """Every <file>.<n> written so far (each one JSON array), by name."""
    return {p.name: json.loads(p.read_text()) for p in trace_file.parent.glob(trace_file.name + ".*")}


def new_files(trace_file: Path, before: set[str], count: int) -> list[list]:
    """Wait until ``count`` more indexed files exist; their contents, oldest first."""
    def ready():
        got = {n: v for n, v in indexed(trace_file).items() if n not in before}
        return got if len(got) >= count else None
    got = wait_until(ready, WAIT_S, f"{count} new trace file(s)")
    return [got[n] for n in sorted(got, key=lambda n: int(n.rsplit(".", 1)[1]))]


def traces(entries: list[dict]) -> dict[int, list[dict]]:
    """A file's activity objects grouped by trace id, in file order."""
    out: dict[int, list[dict]] = {}
    for e in entries:
        out.setdefault(e["id"], []).append(e)
    return out


def times(entries: list[dict]) -> dict[str, int]:
    return {e["timestamps"][0]["name"]: e["timestamps"][0]["ns"]
            for e in entries if "timestamps" in e}


def check_trace(entries: list[dict], model: str, names: list[str]) -> None:
    """One trace: its model object and exactly ``names``, in Triton's file order, their
    times in the order they happen."""
    objects = [e for e in entries if "model_name" in e]
    assert objects == [{"id": entries[0]["id"], "model_name": model, "model_version": 1}]
    assert [e["timestamps"][0]["name"] for e in entries if "timestamps" in e] == names
    t = times(entries)
    for first, then in ORDER:
        if first in t and then in t:
            assert t[first] <= t[then], (first, then, t)


# ---- settings ----------------------------------------------------------------------------------

def test_settings_over_both_protocols(server, http):
    start = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1",
             "log_frequency": "0", "trace_file": str(server.trace_file), "trace_mode": "triton"}
    assert http.get_trace_settings() == start
    assert http.get_trace_settings(model_name="add_sub") == start
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        got = g.update_trace_settings(model_name="add_sub",
                                      settings={"trace_rate": "5", "trace_level": ["TENSORS"]},
                                      as_json=True)["settings"]
        assert (got["trace_rate"], got["trace_level"]) == ({"value": ["5"]}, {"value": ["TENSORS"]})
        # one place for every frontend and protocol: HTTP sees what gRPC set
        assert http.get_trace_settings(model_name="add_sub")["trace_rate"] == "5"
        assert http.get_trace_settings()["trace_rate"] == "1"
        got = http.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
        assert (got["trace_rate"], got["trace_level"]) == ("1", ["TENSORS"])
        got = g.update_trace_settings(model_name="add_sub", settings={"trace_level": None},
                                      as_json=True)["settings"]
        assert got["trace_level"] == {"value": ["TIMESTAMPS"]}
        with pytest.raises(InferenceServerException) as info:
            g.get_trace_settings(model_name="does-not-exist")
        assert info.value.message() == "Request for unknown model : does-not-exist"
        with pytest.raises(InferenceServerException) as info:
            http.update_trace_settings(settings={"trace_file": "other.json"})
        assert "trace file location can not be updated through network protocol" in str(info.value)
        with pytest.raises(InferenceServerException) as info:
            http.update_trace_settings(settings={"trace_count": "-2"})
        assert "Unable to parse 'trace_count'. Expecting value >= -1, got:-2" in str(info.value)
    finally:
        g.close()
    meta = http.get_server_metadata()["extensions"]
    assert meta.index("trace") == meta.index("logging") - 1


# ---- trace files -------------------------------------------------------------------------------

def test_exactly_trace_count_traces_of_an_onnx_model(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(settings={"trace_count": "3", "log_frequency": "0"})
    infer(http, httpclient, "add_sub", 5)
    (written,) = new_files(server.trace_file, before, 1)
    by_id = traces(written)
    assert len(by_id) == 3
    for entries in by_id.values():
        check_trace(entries, "add_sub", HTTP_NAMES)
    assert http.get_trace_settings()["trace_count"] == "0"    # what is left
    infer(http, httpclient, "add_sub", 2)                    # nothing more is traced
    http.update_trace_settings(settings={"trace_count": "1"})
    infer(http, httpclient, "add_sub", 1)
    assert len(new_files(server.trace_file, before, 2)[1]) == len(HTTP_NAMES) + 1


def test_grpc_trace_of_a_python_model(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(model_name="py_add_sub",
                               settings={"trace_count": "1", "log_frequency": "0"})
    g = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        infer(g, grpcclient, "py_add_sub", 2)
    finally:
        g.close()
    (written,) = new_files(server.trace_file, before, 1)
    (entries,) = traces(written).values()
    check_trace(entries, "py_add_sub", GRPC_NAMES)


def test_log_frequency_files(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(settings={"log_frequency": "2"})
    infer(http, httpclient, "add_sub", 4)
    first, second = new_files(server.trace_file, before, 2)
    assert len(traces(first)) == 2 and len(traces(second)) == 2
    assert max(traces(first)) < min(traces(second))          # in the order they were collected


def test_rate_traces_every_nth_request(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(settings={"trace_rate": "3", "log_frequency": "2"})
    infer(http, httpclient, "add_sub", 6)
    (written,) = new_files(server.trace_file, before, 1)
    assert len(traces(written)) == 2


def test_ensemble_steps_are_child_traces(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(settings={"log_frequency": "1"})
    infer(http, httpclient, "chain", 1, request_id="rq1")
    (written,) = new_files(server.trace_file, before, 1)
    by_id = traces(written)
    assert len(by_id) == 3
    parent = min(by_id)
    objects = [e for e in written if "model_name" in e]
    # the steps first, the last one first, then the ensemble (Triton's order)
    assert objects == [
        {"id": parent + 2, "model_name": "py_add_sub", "model_version": 1, "request_id": "rq1",
         "parent_id": parent},
        {"id": parent + 1, "model_name": "add_sub", "model_version": 1, "request_id": "rq1",
         "parent_id": parent},
        {"id": parent, "model_name": "chain", "model_version": 1, "request_id": "rq1"}]
    steps = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
             "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"]
    for child in (parent + 1, parent + 2):
        assert [e["timestamps"][0]["name"] for e in by_id[child] if "timestamps" in e] == steps
    t, first, second = times(by_id[parent]), times(by_id[parent + 1]), times(by_id[parent + 2])
    assert t["QUEUE_START"] <= first["REQUEST_START"] <= first["REQUEST_END"] <= \
        second["REQUEST_START"] <= second["REQUEST_END"] <= t["INFER_RESPONSE_COMPLETE"]


def test_tensors_level(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(model_name="add_sub",
                               settings={"trace_level": ["TENSORS"], "log_frequency": "1"})
    infer(http, httpclient, "add_sub", 1)
    (written,) = new_files(server.trace_file, before, 1)
    tensors = [(e["activity"], e["tensor"]) for e in written]
    assert tensors == [
        ("TENSOR_QUEUE_INPUT", {"name": "INPUT0", "data": "0,1,2,3", "shape": "4", "dtype": "FP32"}),
        ("TENSOR_QUEUE_INPUT", {"name": "INPUT1", "data": "1,2,3,4", "shape": "4", "dtype": "FP32"}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "OUTPUT0", "data": "1,3,5,7", "shape": "4",
                                   "dtype": "FP32"}),
        ("TENSOR_BACKEND_OUTPUT", {"name": "OUTPUT1", "data": "-1,-1,-1,-1", "shape": "4",
                                   "dtype": "FP32"})]


def test_nothing_is_traced_when_off(server, http):
    before = set(indexed(server.trace_file))
    http.update_trace_settings(settings={"trace_level": ["OFF"], "log_frequency": "1"})
    infer(http, httpclient, "add_sub", 3)
    http.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    infer(http, httpclient, "add_sub", 1)        # this one is the next file's only trace
    (written,) = new_files(server.trace_file, before, 1)
    assert len(traces(written)) == 1
    assert len(set(indexed(server.trace_file)) - before) == 1


def test_the_trace_file_holds_what_is_left_at_shutdown(repo, tmp_path):
    trace_file = tmp_path / "left.json"
    with start_server(repo, "--trace-config", f"triton,file={trace_file}",
                      "--trace-level", "TIMESTAMPS", "--trace-rate", "2") as srv:
        c = httpclient.InferenceServerClient(srv.http_url)
        try:
            assert c.get_trace_settings()["trace_rate"] == "2"
            infer(c, httpclient, "add_sub", 4)
        finally:
            c.close()
        assert stop_server(srv) == 0
    written = json.loads(trace_file.read_text())       # one JSON array, closed at exit
    by_id = traces(written)
    assert len(by_id) == 2 and not indexed(trace_file)
    for entries in by_id.values():
        check_trace(entries, "add_sub", HTTP_NAMES)


# ---- mode opentelemetry --------------------------------------------------------------------

class Collector:
    """An OTLP/HTTP collector in this process: every ExportTraceServiceRequest posted to
    /v1/traces, as protobuf (what the Python exporter sends) or JSON."""

    def __init__(self) -> None:
        import http.server
        import threading

        from google.protobuf.json_format import MessageToDict
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )
        self.requests: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if "json" in self.headers.get("Content-Type", ""):
                    doc = json.loads(body)
                else:
                    doc = MessageToDict(ExportTraceServiceRequest.FromString(body))
                outer.requests.append({"path": self.path, **doc})
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[dict]:
        return [dict(span, resource=rs["resource"], scope=ss["scope"]["name"])
                for r in self.requests for rs in r["resourceSpans"]
                for ss in rs["scopeSpans"] for span in ss["spans"]]

    def close(self) -> None:
        self.server.shutdown()


def attributes(span: dict) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}


def events(span: dict) -> list[str]:
    return [e["name"] for e in span.get("events", [])]


def hex_id(b64: str) -> str:
    import base64
    return base64.b64decode(b64).hex()


def test_opentelemetry_spans(repo):
    pytest.importorskip("opentelemetry.sdk")
    collector = Collector()
    parent_trace, parent_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    try:
        with start_server(repo, "--trace-config", "mode=opentelemetry",
                          "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=3",
                          "--trace-config", f"opentelemetry,url={collector.url}",
                          "--trace-config", "opentelemetry,resource=test.key=test.value",
                          "--trace-config", "opentelemetry,bsp_schedule_delay=50") as srv:
            c = httpclient.InferenceServerClient(srv.http_url)
            g = grpcclient.InferenceServerClient(srv.grpc_url)
            try:
                # Triton's listing: no file, no log frequency; the mode's settings, the
                # batch span processor's defaults after those given
                assert c.get_trace_settings() == {
                    "trace_level": ["TIMESTAMPS"], "trace_rate": "3", "trace_count": "-1",
                    "trace_mode": "opentelemetry", "url": collector.url,
                    "resource": "test.key=test.value", "bsp_schedule_delay": "50",
                    "bsp_max_export_batch_size": "512", "bsp_max_queue_size": "2048"}
                infer(c, httpclient, "add_sub", 3, request_id="r1")   # the third is sampled
                # a request with a context of its own is traced whatever the rate, under it
                a = np.arange(4, dtype=np.float32)
                inputs = [httpclient.InferInput("INPUT0", [4], "FP32"),
                          httpclient.InferInput("INPUT1", [4], "FP32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(a)
                c.infer("chain", inputs,
                        headers={"traceparent": f"00-{parent_trace}-{parent_span}-01"})
                ginputs = [grpcclient.InferInput("INPUT0", [4], "FP32"),
                           grpcclient.InferInput("INPUT1", [4], "FP32")]
                ginputs[0].set_data_from_numpy(a)
                ginputs[1].set_data_from_numpy(a)
                g.infer("py_add_sub", ginputs,
                        headers={"traceparent": f"00-{parent_trace}-{parent_span[::-1]}-01"})
            finally:
                c.close()
                g.close()
            # 3 + 6 + 3 spans: a root, model and compute span each (the chain: no compute
            # span of its own, its two steps a model and a compute span each)
            wait_until(lambda: len(collector.spans()) >= 12, WAIT_S, "the spans")
        spans = collector.spans()
        assert len(spans) == 12
        assert {s["scope"] for s in spans} == {"triton-server"}
        resource = {a["key"]: a["value"]["stringValue"] for a in spans[0]["resource"]["attributes"]}
        assert resource["service.name"] == "triton-inference-server"
        assert resource["test.key"] == "test.value"
        by_id = {s["spanId"]: s for s in spans}
        roots = [s for s in spans if s["name"] == "InferRequest"]
        assert len(roots) == 3 and all(s["kind"] == "SPAN_KIND_SERVER" for s in spans)
        http_root, chain_root, grpc_root = sorted(roots, key=lambda s: int(s["startTimeUnixNano"]))
        assert events(http_root) == ["HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE",
                                     "HTTP_SEND_START", "HTTP_SEND_END"]
        assert events(grpc_root) == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END",
                                     "INFER_RESPONSE_COMPLETE", "GRPC_SEND_START", "GRPC_SEND_END"]
        assert "parentSpanId" not in http_root
        for root, parent in ((chain_root, parent_span), (grpc_root, parent_span[::-1])):
            assert hex_id(root["traceId"]) == parent_trace and hex_id(root["parentSpanId"]) == parent

        def under(span: dict) -> list[dict]:
            return [s for s in spans if s.get("parentSpanId") == span["spanId"]]
        (model,) = under(http_root)
        assert model["name"] == "add_sub" and events(model) == ["REQUEST_START", "QUEUE_START",
                                                                "REQUEST_END"]
        assert attributes(model) == {"triton.model_name": "add_sub", "triton.model_version": "1",
                                     "triton.trace_id": "1", "triton.trace_parent_id": "0",
                                     "triton.request_id": "r1"}
        (compute,) = under(model)
        assert compute["name"] == "compute" and events(compute) == [
            "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
        (chain,) = under(chain_root)
        steps = sorted(under(chain), key=lambda s: int(s["startTimeUnixNano"]))
        assert [s["name"] for s in steps] == ["add_sub", "py_add_sub"]
        chain_id = attributes(chain)["triton.trace_id"]
        for step in steps:
            assert attributes(step)["triton.trace_parent_id"] == chain_id
            assert [s["name"] for s in under(step)] == ["compute"]
        assert all(s["parentSpanId"] in by_id for s in spans
                   if s["name"] != "InferRequest")
        for s in spans:   # every span within its parent's time
            p = by_id.get(s.get("parentSpanId", ""))
            if p is not None:
                assert int(p["startTimeUnixNano"]) <= int(s["startTimeUnixNano"])
                assert int(s["endTimeUnixNano"]) <= int(p["endTimeUnixNano"])
    finally:
        collector.close()
