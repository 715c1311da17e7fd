"""The generate extension end to end: POST /v2/models/{m}/generate and /generate_stream on a
real `trireme serve` with Python models, over both HTTP servers (--http-impl native and
aiohttp).

The cases are the requests Triton's qa/L0_http/generate_endpoint_test.py (v2.51.0) sends,
in our own code, and the mapping rules around them. Every expected status, Content-Type
and body below is what a real Triton 2.51 (../shared/tools/triton.sh) answered to the same
request on the same models (`curl -s -i -X POST localhost:<port>/v2/models/<m>/<route>
-d '<the body below>'`); where Triton's test checks a substring or only that a request
fails, these check the whole answer. What Triton answered that is
surprising, and kept:
- an error that comes back as a response (the model's) is 400 whatever its code (Triton
  reads the code of an error it has freed); errors found before the request runs keep
  their own status (404 unknown model, 400 request checks, 500 TritonJson's type errors);
- /generate runs decoupled models too, and answers "generate expects ..." with status 200
  unless exactly one response (or error) came;
- "id" is the request id and also a request parameter; duplicate keys are read once each
  from their first value and fail as duplicate inputs;
- a parse error of the body is 500.

The models: "mock_llm" (decoupled; Triton's generate_models/mock_llm config, our code),
"mock_llm_nd" (the same, not decoupled), "echo" (optional inputs of several datatypes and
dims, echoed with their shapes and the request's parameters), "echo_batch" (the same,
max_batch_size 8), "errs" (answers an error with the code it is given).
"""
from __future__ import annotations

import http.client
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import start_server, wait_until
from models_python import python_model

SSE = "text/event-stream; charset=utf-8"
JSON = "application/json"
ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream "
                "for model that generates various number of responses")
WAIT_S = 30

MOCK_LLM = '''
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """What Triton's qa mock_llm does. Decoupled: STREAM true sends PROMPT as TEXT
    REPETITION times (a parameter, default 1), then a bare final flag, or with FAIL_LAST an
    error carrying it; STREAM false one response with the final flag; OUTPUT_0_DIM makes
    TEXT empty. GATE (a parameter): copy i > 0 waits for the file gate_<GATE>_<i> in the
    model's folder; a request cancelled meanwhile is logged to the file "cancelled".
    Not decoupled: STREAM true is an error, else PROMPT repeated REPETITION times."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)
        self.dir = args["model_repository"]

    def execute(self, requests):
        if not self.decoupled:
            return [self.one(r) for r in requests]
        for r in requests:
            self.stream(r)
        return None

    def one(self, request):
        params = json.loads(request.parameters())
        prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
        if pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().flatten()[0]:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError("STREAM only supported in decoupled mode"))
        text = np.repeat(prompt, params.get("REPETITION", 1), axis=1)
        return pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)])

    def gate(self, sender, tag, i):
        path = os.path.join(self.dir, f"gate_{tag}_{i}")
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            if sender.is_cancelled():
                with open(os.path.join(self.dir, "cancelled"), "a") as f:
                    f.write(f"{tag}\\n")
                return False
            time.sleep(0.005)
        return True

    def stream(self, request):
        params = json.loads(request.parameters())
        sender = request.get_response_sender()
        prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
        text = np.array([], dtype=object) if params.get("OUTPUT_0_DIM") else prompt
        response = pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)])
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if not pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().flatten()[0]:
            sender.send(response, flags=final)
            return
        tag = params.get("GATE")
        for i in range(params.get("REPETITION", 1)):
            if tag is not None and i > 0 and not self.gate(sender, tag, i):
                break
            if sender.is_cancelled():
                break
            sender.send(response)
        last = None
        if params.get("FAIL_LAST", False):
            last = pb_utils.InferenceResponse(error=pb_utils.TritonError("An Error Occurred"))
        sender.send(last, flags=final)
'''

MOCK_LLM_CONFIG = '''
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: {decoupled} }}
input [
  {{ name: "PROMPT" data_type: TYPE_STRING dims: [ 1, 1 ] }},
  {{ name: "STREAM" data_type: TYPE_BOOL dims: [ 1, 1 ] }},
  {{ name: "input_ids" data_type: TYPE_INT32 dims: [ 1, -1 ] optional: true }}
]
output [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1, -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''

ECHO = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Each input given comes back as OUT_<name>, its shape as SHAPE_<name>; PARAMS is
    request.parameters()."""

    def execute(self, requests):
        out = []
        for r in requests:
            tensors = []
            for n in ["S", "B", "I", "F", "M", "U", "D", "H"]:
                t = pb_utils.get_input_tensor_by_name(r, n)
                if t is not None:
                    a = t.as_numpy()
                    tensors.append(pb_utils.Tensor("OUT_" + n, a))
                    tensors.append(pb_utils.Tensor("SHAPE_" + n, np.array(a.shape, np.int64)))
            tensors.append(pb_utils.Tensor("PARAMS", np.array([r.parameters()], dtype=object)))
            out.append(pb_utils.InferenceResponse(tensors))
        return out
'''

ECHO_IO = [("S", "TYPE_STRING", "[ -1 ]"), ("B", "TYPE_BOOL", "[ 1 ]"),
           ("I", "TYPE_INT32", "[ -1 ]"), ("F", "TYPE_FP32", "[ 2 ]"),
           ("M", "TYPE_INT64", "[ 2, -1 ]"), ("U", "TYPE_UINT8", "[ -1, -1 ]"),
           ("D", "TYPE_FP64", "[ 1 ]"), ("H", "TYPE_FP16", "[ 1 ]")]


def echo_config(name: str, max_batch_size: int) -> str:
    inputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} optional: true }}'
                        for n, t, d in ECHO_IO)
    outputs = [f'  {{ name: "OUT_{n}" data_type: {t} dims: {d} }}' for n, t, d in ECHO_IO]
    outputs += [f'  {{ name: "SHAPE_{n}" data_type: TYPE_INT64 dims: [ -1 ] }}'
                for n, _, _ in ECHO_IO]
    outputs.append('  { name: "PARAMS" data_type: TYPE_STRING dims: [ 1 ] }')
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
            f'input [\n{inputs}\n]\noutput [\n' + ",\n".join(outputs) + '\n]\n'
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n')


ERRS = '''
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers the error "failed: <code>" with the code named by the parameter "code"."""

    def execute(self, requests):
        out = []
        for r in requests:
            code = json.loads(r.parameters()).get("code", "INTERNAL")
            out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "failed: " + code, getattr(pb_utils.TritonError, code))))
        return out
'''

ERRS_CONFIG = '''
name: "errs"
backend: "python"
max_batch_size: 0
input [ { name: "S" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "O" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [{ kind: KIND_CPU, count: 1 }]
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generate") / "models"
    for name, decoupled in (("mock_llm", "true"), ("mock_llm_nd", "false")):
        python_model(root, name, MOCK_LLM,
                     f'name: "{name}"\n' + MOCK_LLM_CONFIG.format(decoupled=decoupled))
    python_model(root, "echo", ECHO, echo_config("echo", 0))
    python_model(root, "echo_batch", ECHO, echo_config("echo_batch", 8))
    python_model(root, "errs", ERRS, ERRS_CONFIG)
    return root


@pytest.fixture(scope="module", params=["native", "aiohttp"])
def srv(repo, request):
    with start_server(repo, "--http-impl", request.param) as s:
        yield s


def post(srv, model: str, route: str, body: str | bytes,
         headers: dict | None = None, method: str = "POST") -> tuple[int, str, bytes]:
    """One request -> (status, Content-Type, body); http.client undoes chunking."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=60)
    try:
        data = body.encode() if isinstance(body, str) else body
        conn.request(method, f"/v2/models/{model}/{route}",
                     body=data if method == "POST" else None, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def generate(srv, model: str, doc: dict | str, route: str = "generate") -> tuple[int, str, bytes]:
    return post(srv, model, route, doc if isinstance(doc, str) else json.dumps(doc))


def events(body: bytes) -> list[dict]:
    """An SSE body -> its events' JSON; each event must be exactly b"data: <json>\\n\\n"."""
    assert body.endswith(b"\n\n") or body == b"", body
    parts = body.split(b"\n\n")[:-1]
    assert all(p.startswith(b"data: ") and b"\n" not in p for p in parts), body
    return [json.loads(p[6:]) for p in parts]


def text(model: str, value, **extra) -> bytes:
    doc = {"TEXT": value, **extra, "model_name": model, "model_version": "1"}
    return json.dumps(doc, separators=(",", ":")).encode()


def error(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


def sse(*docs: bytes) -> bytes:
    return b"".join(b"data: " + d + b"\n\n" for d in docs)


# ---- Triton's generate_endpoint_test.py, answer for answer --------------------------------

def test_generate(srv):
    for model in ("mock_llm", "mock_llm_nd", "mock_llm/versions/1"):
        name = model.split("/")[0]
        assert generate(srv, model, {"PROMPT": "hello world", "STREAM": False}) == \
            (200, JSON, text(name, "hello world"))
    # Never compressed (Triton 2.51: "[FIXME] compression"), whatever the client accepts.
    body = b'{"PROMPT": "hello world", "STREAM": false}'
    for route, want in (("generate", text("mock_llm", "hello world")),
                        ("generate_stream", sse(text("mock_llm", "hello world")))):
        assert post(srv, "mock_llm", route, body, {"Accept-Encoding": "gzip"})[2] == want


def test_generate_with_all_inputs(srv):
    doc = {"PROMPT": "hello world", "STREAM": False, "input_ids": [100, 200]}
    assert generate(srv, "mock_llm", doc) == (200, JSON, text("mock_llm", "hello world"))


def test_request_id(srv):
    """The id comes back when given and not empty ("TEXT" < "id" < "model_name": keys in
    byte order, as Triton's std::map writes them)."""
    doc = {"PROMPT": "hello world", "id": "42", "STREAM": False}
    assert generate(srv, "mock_llm", doc) == (200, JSON, text("mock_llm", "hello world", id="42"))
    for doc in ({"PROMPT": "hello world", "STREAM": False},
                {"PROMPT": "hello world", "id": "", "STREAM": False}):
        assert generate(srv, "mock_llm", doc) == (200, JSON, text("mock_llm", "hello world"))


def test_generate_stream(srv):
    doc = {"PROMPT": ["hello world"], "STREAM": True, "REPETITION": 3}
    one = text("mock_llm", "hello world")
    assert generate(srv, "mock_llm", doc, "generate_stream") == (200, SSE, sse(one, one, one))
    # A non-decoupled model's one response is one event.
    doc = {"PROMPT": "hello world", "STREAM": False, "id": "42"}
    assert generate(srv, "mock_llm_nd", doc, "generate_stream") == \
        (200, SSE, sse(text("mock_llm_nd", "hello world", id="42")))


MISSING = [
    ({}, 0, "[]", "['PROMPT','STREAM']"),
    ({"abc": 123}, 0, "[]", "['PROMPT','STREAM']"),
    ({"PROMPT": "hello"}, 1, "['PROMPT']", "['STREAM']"),
    ({"STREAM": False}, 1, "['STREAM']", "['PROMPT']"),
    ({"STREAM": False, "other": "param"}, 1, "['STREAM']", "['PROMPT']"),
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_missing_inputs(srv, route):
    """Refused before the request runs: a plain JSON error on both routes."""
    for doc, n, got, missing in MISSING:
        want = (f"[request id: <id_unknown>] expected number of inputs between 2 and 3 but got "
                f"{n} inputs for model 'mock_llm'. Got input(s) {got}, but missing required "
                f"input(s) {missing}. Please provide all required input(s).")
        assert generate(srv, "mock_llm", doc, route) == (400, JSON, error(want))


INVALID_TYPES = [
    ({"PROMPT": 123, "STREAM": False},
     "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    ({"PROMPT": "hello", "STREAM": "false"},
     "Unable to parse 'data': attempt to access JSON non-boolean as boolean"),
    ({"PROMPT": True, "STREAM": 123},        # members in order: PROMPT fails first
     "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    ({"STREAM": 123, "PROMPT": True},
     "Unable to parse 'data': attempt to access JSON non-boolean as boolean"),
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_invalid_input_types(srv, route):
    """TritonJson's type errors are INTERNAL: 500."""
    for doc, want in INVALID_TYPES:
        assert generate(srv, "mock_llm", doc, route) == (500, JSON, error(want))


DUPLICATES = [
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate"}', "PROMPT"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": false}', "STREAM"),
    ('{"PROMPT": "hello", "STREAM": false, "PROMPT": "duplicate", "STREAM": true}', "PROMPT"),
    ('{"PROMPT": "hello", "STREAM": false, "STREAM": true, "PROMPT": "duplicate"}', "STREAM"),
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_duplicate_inputs(srv, route):
    for body, name in DUPLICATES:
        want = f"[request id: <id_unknown>] input '{name}' already exists in request"
        assert generate(srv, "mock_llm", body, route) == (400, JSON, error(want))


def test_generate_stream_response_error(srv):
    """An error as the first response sets the status (400) of an SSE answer; after a
    good one it is an event of a 200 answer."""
    doc = {"PROMPT": ["hello world"], "STREAM": True, "REPETITION": 0, "FAIL_LAST": True}
    assert generate(srv, "mock_llm", doc, "generate_stream") == \
        (400, SSE, sse(error("An Error Occurred")))
    doc["REPETITION"] = 1
    assert generate(srv, "mock_llm", doc, "generate_stream") == \
        (200, SSE, sse(text("mock_llm", "hello world"), error("An Error Occurred")))
    # /generate: the error alone (400), or one response too many (200, Triton's text).
    assert generate(srv, "mock_llm", doc) == (200, JSON, error(ONE_RESPONSE))
    doc["REPETITION"] = 0
    assert generate(srv, "mock_llm", doc) == (400, JSON, error("An Error Occurred"))


def test_race_condition(srv):
    """Many requests at once, plain and streamed, each answered in full."""
    plain = {"PROMPT": "hello", "STREAM": False, "param": "segfault"}
    streamed = {"PROMPT": "hello", "STREAM": True, "REPETITION": 3, "param": "segfault"}
    one = text("mock_llm", "hello")

    def call(doc):
        return generate(srv, "mock_llm", doc, "generate_stream")

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(call, [plain, streamed] * 50))
    assert answers == [(200, SSE, sse(one)), (200, SSE, sse(one, one, one))] * 50


def test_one_response(srv):
    """A decoupled model's one response and its bare final flag, or one response with the
    flag: the same answers on both routes."""
    one = text("mock_llm", "hello world")
    for stream in (True, False):
        doc = {"PROMPT": "hello world", "STREAM": stream}
        assert generate(srv, "mock_llm", doc, "generate_stream") == (200, SSE, sse(one))
        assert generate(srv, "mock_llm", doc) == (200, JSON, one)


def test_zero_and_many_responses(srv):
    doc = {"PROMPT": "hello world", "STREAM": True, "REPETITION": 0}
    assert generate(srv, "mock_llm", doc, "generate_stream") == (200, SSE, b"")
    assert generate(srv, "mock_llm", doc) == (200, JSON, error(ONE_RESPONSE))
    doc["REPETITION"] = 2
    assert generate(srv, "mock_llm", doc) == (200, JSON, error(ONE_RESPONSE))


def test_complex_schema(srv):
    doc = {"PROMPT": "hello world", "STREAM": True,
           "PARAMS": {"PARAM_0": 0, "PARAM_1": True, "PARAM_2": 123.123}}
    assert generate(srv, "mock_llm", doc) == (400, JSON, error(
        "parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', or 'string'."))
    doc = {"PROMPT": {"USER": "hello world", "BOT": "world hello"}, "STREAM": True}
    assert generate(srv, "mock_llm", doc) == (500, JSON, error(
        "Unable to parse JSON bytes array: attempt to access JSON non-string as string"))


def test_parameters(srv):
    one = text("mock_llm", "hello world")
    doc = {"PROMPT": ["hello world"], "STREAM": True, "parameters": {"REPETITION": 3}}
    assert generate(srv, "mock_llm", doc, "generate_stream") == (200, SSE, sse(one, one, one))
    doc["parameters"] = 1
    assert generate(srv, "mock_llm", doc) == (500, JSON, error(
        "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as "
        "object"))
    doc["parameters"] = {"nested": {"twice": 1}}
    assert generate(srv, "mock_llm", doc) == (400, JSON, error(
        "Converting keyword: 'parameters': parameter 'nested' has invalid type. It should be "
        "either 'int', 'bool', or 'string'."))


def test_0_dimension_output(srv):
    doc = {"PROMPT": "hello world", "STREAM": False, "REPETITION": 0, "OUTPUT_0_DIM": True}
    assert generate(srv, "mock_llm", doc) == (200, JSON, text("mock_llm", []))
    assert generate(srv, "mock_llm", doc, "generate_stream") == \
        (200, SSE, sse(text("mock_llm", [])))


# ---- streaming on the wire ----------------------------------------------------------------

class Raw:
    """A client socket that reads an HTTP/1.1 answer as it comes, chunk by chunk."""

    def __init__(self, srv) -> None:
        self.sock = socket.create_connection(("127.0.0.1", srv.http_port), timeout=WAIT_S)
        self.buf = b""

    def send(self, path: str, body: bytes, version: str = "1.1") -> None:
        self.sock.sendall(f"POST {path} HTTP/{version}\r\nHost: t\r\nContent-Length: "
                          f"{len(body)}\r\n\r\n".encode() + body)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def until(self, mark: bytes) -> bytes:
        while mark not in self.buf:
            assert self._fill(), f"connection closed before {mark!r}: {self.buf!r}"
        head, _, self.buf = self.buf.partition(mark)
        return head

    def head(self) -> tuple[int, dict[str, str]]:
        lines = self.until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        return int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, v in
                                          (line.split(":", 1) for line in lines[1:])}

    def chunk(self) -> bytes:
        size = int(self.until(b"\r\n"), 16)
        while len(self.buf) < size + 2:
            assert self._fill(), "connection closed mid-chunk"
        data, self.buf = self.buf[:size], self.buf[size + 2:]
        return data

    def rest(self) -> bytes:
        while self._fill():
            pass
        return self.buf

    def close(self) -> None:
        self.sock.close()


def stream_doc(tag: str, n: int = 3) -> bytes:
    return json.dumps({"PROMPT": ["hello world"], "STREAM": True, "REPETITION": n,
                       "parameters": {"GATE": tag}}).encode()


def test_each_response_is_one_chunk_sent_when_it_comes(srv):
    """Triton's test_streaming, without its clock: copy i leaves the model only once the
    test has read copy i-1 (the model waits for a file per copy), so each event reaches
    the client as it is made. On the wire: chunked, one event per chunk, then the last
    chunk, and the connection serves its next request."""
    tag = f"wire-{srv.http_port}"
    raw = Raw(srv)
    try:
        raw.send("/v2/models/mock_llm/generate_stream", stream_doc(tag))
        status, headers = raw.head()
        assert (status, headers["content-type"], headers["transfer-encoding"]) == \
            (200, SSE, "chunked")
        assert "content-length" not in headers
        for i in range(3):
            assert raw.chunk() == sse(text("mock_llm", "hello world"))
            if i < 2:
                (srv.repo / "mock_llm" / f"gate_{tag}_{i + 1}").touch()
        assert raw.chunk() == b""
        raw.send("/v2/models/mock_llm/generate", b'{"PROMPT": "again", "STREAM": false}')
        status, headers = raw.head()
        assert status == 200 and int(headers["content-length"]) == len(text("mock_llm", "again"))
    finally:
        raw.close()


def test_http10_stream_is_the_events_then_close(srv):
    raw = Raw(srv)
    try:
        body = json.dumps({"PROMPT": ["x"], "STREAM": True, "REPETITION": 2}).encode()
        raw.send("/v2/models/mock_llm/generate_stream", body, version="1.0")
        status, headers = raw.head()
        assert status == 200 and "transfer-encoding" not in headers
        assert raw.rest() == sse(text("mock_llm", "x"), text("mock_llm", "x"))
    finally:
        raw.close()


def test_close_connection_during_streaming(srv):
    """A client that leaves mid-stream cancels its request (the model, waiting to send its
    next response, sees is_cancelled()) and the server goes on serving."""
    tag = f"gone-{srv.http_port}"
    raw = Raw(srv)
    raw.send("/v2/models/mock_llm/generate_stream", stream_doc(tag))
    assert raw.head()[0] == 200
    assert raw.chunk() == sse(text("mock_llm", "hello world"))
    raw.close()
    log = srv.repo / "mock_llm" / "cancelled"
    wait_until(lambda: log.exists() and tag in log.read_text().split(), WAIT_S,
               "the model to see its request cancelled")
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=WAIT_S)
    conn.request("GET", "/v2/health/live")
    assert conn.getresponse().status == 200
    conn.close()
    assert generate(srv, "mock_llm", {"PROMPT": "after", "STREAM": False}) == \
        (200, JSON, text("mock_llm", "after"))


# ---- the request's mapping onto inputs and parameters --------------------------------------

def echoed(srv, doc: dict, model: str = "echo") -> dict:
    status, ctype, body = generate(srv, model, doc)
    assert (status, ctype) == (200, JSON), body
    return json.loads(body)


ECHO_BODIES = [
    # (request, the answer's keys other than PARAMS, model_name and model_version)
    ({"I": 5}, {"OUT_I": 5, "SHAPE_I": 1}),
    ({"I": []}, {"OUT_I": [], "SHAPE_I": 0}),
    ({"I": [[1], [2]]}, {"OUT_I": [1, 2], "SHAPE_I": 2}),
    ({"I": -3000000000}, {"OUT_I": 1294967296, "SHAPE_I": 1}),
    ({"U": 300}, {"OUT_U": 44, "SHAPE_U": [1, 1]}),
    ({"U": [[300]]}, {"OUT_U": 44, "SHAPE_U": [1, 1]}),
    ({"B": [[True]]}, {"OUT_B": True, "SHAPE_B": 1}),
    ({"M": [1, 2]}, {"OUT_M": [1, 2], "SHAPE_M": [2, 1]}),
    ({"D": 0.1}, {"OUT_D": 0.1, "SHAPE_D": 1}),
    ({"F": [0.1, 3]}, {"OUT_F": [0.10000000149011612, 3.0], "SHAPE_F": 2}),
    ({"S": ["a", "b", "c"], "B": True, "I": [1, 2, 3], "F": [1.5, 2], "M": [1, 2, 3, 4],
      "U": [[1], [2]]},
     {"OUT_B": True, "OUT_F": [1.5, 2.0], "OUT_I": [1, 2, 3], "OUT_M": [1, 2, 3, 4],
      "OUT_S": ["a", "b", "c"], "OUT_U": [1, 2], "SHAPE_B": 1, "SHAPE_F": 2, "SHAPE_I": 3,
      "SHAPE_M": [2, 2], "SHAPE_S": 3, "SHAPE_U": [1, 2]}),
]


def test_values_shapes_and_outputs(srv):
    """A scalar is one element, an array its top level's count; the shape is the model's
    with the innermost variable dimension taking the rest; integers wrap as C casts them;
    a one-element output is a scalar, others a flat list."""
    for doc, want in ECHO_BODIES:
        got = echoed(srv, doc)
        assert got.pop("PARAMS") == "{}"
        assert got == {**want, "model_name": "echo", "model_version": "1"}, doc
    # A batching model's shape has its batch dimension, 1 here.
    got = echoed(srv, {"S": ["a", "b"], "M": [1, 2, 3, 4]}, "echo_batch")
    assert (got["SHAPE_S"], got["SHAPE_M"]) == ([1, 2], [1, 2, 2])


def test_keys_become_parameters(srv):
    """Keys that are not inputs are parameters, "id" too; an integer beyond int64 is a
    double; in "parameters", an input's name is an input."""
    got = echoed(srv, {"S": "hi", "id": "7"})
    assert json.loads(got["PARAMS"]) == {"id": "7"} and got["id"] == "7"
    got = echoed(srv, {"S": "x", "parameters": {"a": 1, "b": "s", "c": True, "d": 1.5,
                                           "e": 18446744073709551615, "i": 2.0}, "I": 4})
    params = json.loads(got["PARAMS"])
    assert params == {"a": 1, "b": "s", "c": True, "d": 1.5, "e": 18446744073709551615.0,
                      "i": 2.0}
    assert type(params["e"]) is float and got["OUT_I"] == 4
    got = echoed(srv, {"S": "x", "parameters": {"I": 4}})
    assert (got["OUT_I"], got["PARAMS"]) == (4, "{}")


ECHO_ERRORS = [
    ('{"F": [1]}', 400, "The schema can not convert input 'F' to tensor with proper shape"),
    ('{"F": [1,2,3]}', 400, "The schema can not convert input 'F' to tensor with proper shape"),
    ('{"M": [1,2,3]}', 400, "The schema can not convert input 'M' to tensor with proper shape"),
    ('{"H": 1.0}', 400, "receiving FP16 data via JSON is not supported. Please use the binary "
                        "data format for input H"),
    ('{"I": 1.5}', 500, "Unable to parse 'data': attempt to access JSON non-signed-integer as "
                        "signed-integer"),
    ('{"U": -1}', 500, "Unable to parse 'data': attempt to access JSON non-unsigned-integer as "
                       "unsigned-integer"),
    ('{"D": "1"}', 500, "Unable to parse 'data': attempt to access JSON non-number as double"),
    ('{"I": [[1,2],[3]]}', 500, "Unable to parse 'data': Shape does not match true shape of "
                                "'data' field"),
    ('{"I": [[],[]]}', 500, "Unable to parse 'data': Shape does not match true shape of 'data' "
                            "field"),
    ('{"S": [["a","b"],["c"]]}', 400, "[request id: <id_unknown>] unexpected number of string "
                                      "elements 3 for inference input 'S' for model 'echo', "
                                      "expecting 2"),
    ('{"S": "x", "parameters": {"S": "y"}}', 400, "Converting keyword: 'parameters': [request "
                                                  "id: <id_unknown>] input 'S' already exists "
                                                  "in request"),
    ('{"S": "x", "parameters": {"n": null}}', 400, "Converting keyword: 'parameters': parameter "
                                                   "'n' has invalid type. It should be either "
                                                   "'int', 'bool', or 'string'."),
    ('{"S": "x", "parameters": [1]}', 500, "Expected JSON object for keyword: 'parameters': "
                                           "attempt to access JSON non-object as object"),
    ('{"S": "x", "zz": null}', 400, "parameter 'zz' has invalid type. It should be either "
                                    "'int', 'bool', or 'string'."),
    ('{"id": 42, "S": "x"}', 500, "Unable to parse 'id': attempt to access JSON non-string as "
                                  "string"),
    ('[1]', 500, "attempt to get members for non-object"),
    ('', 500, "failed to parse the request JSON buffer: The document is empty. at 0"),
]


def test_mapping_errors(srv):
    for body, status, want in ECHO_ERRORS:
        assert generate(srv, "echo", body) == (status, JSON, error(want)), body


def test_errors_before_the_request_runs(srv):
    for route in ("generate", "generate_stream"):
        assert generate(srv, "nope", "{}", route) == \
            (404, JSON, error("Request for unknown model: 'nope' is not found"))
        assert generate(srv, "echo/versions/2", "{}", route) == \
            (404, JSON, error("Request for unknown model: 'echo' version 2 is not found"))
        assert post(srv, "echo", route, '{"S": "x"}', {"Content-Encoding": "gzip"}) == \
            (400, JSON, error("Unsupported content-encoding, only 'identity' is supported."))
        assert post(srv, "echo", route, b"", method="GET") == \
            (405, JSON, error("Method Not Allowed"))


@pytest.mark.parametrize("code", ["INTERNAL", "NOT_FOUND", "UNAVAILABLE", "INVALID_ARG"])
def test_model_errors_are_400(srv, code):
    """Triton 2.51 answers 400 for an error response whatever its code (its /infer: 500,
    404, 503, 400)."""
    doc = {"S": "x", "code": code}
    assert generate(srv, "errs", doc) == (400, JSON, error(f"failed: {code}"))
    assert generate(srv, "errs", doc, "generate_stream") == \
        (400, SSE, sse(error(f"failed: {code}")))


def test_keep_alive_across_answers(srv):
    """Keep-alive: several generate answers on one connection, plain and streamed."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.http_port, timeout=WAIT_S)
    try:
        for i, route in enumerate(["generate", "generate_stream"] * 3):
            body = json.dumps({"PROMPT": f"p{i}", "STREAM": False}).encode()
            conn.request("POST", f"/v2/models/mock_llm/{route}", body=body)
            r = conn.getresponse()
            want = text("mock_llm", f"p{i}")
            assert (r.status, r.read()) == (200, want if route == "generate" else sse(want))
    finally:
        conn.close()
