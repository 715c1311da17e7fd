"""The generate extension on the wire (chunks as responses come, HTTP/1.0, a client that
leaves mid-stream, keep-alive) and the mapping of a body onto model inputs and parameters,
over both HTTP servers. Expected answers are real Triton 2.51's (see test_generate.py)."""
from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path

import pytest
from conftest import start_server, wait_until
from generate_support import HTTP_IMPLS, JSON, SSE, WAIT_S, error, generate, post, sse, text, write_repository


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return write_repository(tmp_path_factory.mktemp("generate") / "models")


@pytest.fixture(scope="module", params=HTTP_IMPLS)
def srv(repo, request):
    with start_server(repo, "--http-impl", request.param) as s:
        yield s


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
    ('{"I": 1.5}', 400, "Unable to parse 'data': attempt to access JSON non-signed-integer as "
                        "signed-integer"),
    ('{"U": -1}', 400, "Unable to parse 'data': attempt to access JSON non-unsigned-integer as "
                       "unsigned-integer"),
    ('{"D": "1"}', 400, "Unable to parse 'data': attempt to access JSON non-number as double"),
    ('{"I": [[1,2],[3]]}', 400, "Unable to parse 'data': Shape does not match true shape of "
                                "'data' field"),
    ('{"I": [[],[]]}', 400, "Unable to parse 'data': Shape does not match true shape of 'data' "
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
    ('{"S": "x", "parameters": [1]}', 400, "Expected JSON object for keyword: 'parameters': "
                                           "attempt to access JSON non-object as object"),
    ('{"S": "x", "zz": null}', 400, "parameter 'zz' has invalid type. It should be either "
                                    "'int', 'bool', or 'string'."),
    ('{"id": 42, "S": "x"}', 400, "Unable to parse 'id': attempt to access JSON non-string as "
                                  "string"),
    ('[1]', 400, "attempt to get members for non-object"),
    ('', 400, "failed to parse the request JSON buffer: The document is empty. at 0"),
    # the infer path's rules (datatypes.json_to_buffer, json_body.check_nesting) and texts
    ('{"I": [1, 2.0]}', 400, "Unable to parse 'data': attempt to access JSON "
                             "non-signed-integer as signed-integer"),
    ('{"D": ' + "[" * 101 + "1" + "]" * 101 + '}', 400, "Unable to parse 'data': JSON nesting "
                                                        "depth exceeds maximum allowed limit (100)"),
    ('{"S": ' + "[" * 101 + '"a"' + "]" * 101 + '}', 400, "JSON nesting depth exceeds maximum "
                                                          "allowed limit (100)"),
    ('{"S": [["a"], 1]}', 400, "Unable to parse JSON bytes array: attempt to access JSON "
                               "non-string as string"),
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
