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
  their own status (404 unknown model, 400 request checks; Triton's 500 for TritonJson's
  type errors is 400 here, the client's mistake: docs/compat.md);
- /generate runs decoupled models too, and answers "generate expects ..." with status 200
  unless exactly one response (or error) came;
- "id" is the request id and also a request parameter; duplicate keys are read once each
  from their first value and fail as duplicate inputs;
- a parse error of the body is 500 (400 here, as above).

The models: "mock_llm" (decoupled; Triton's generate_models/mock_llm config, our code),
"mock_llm_nd" (the same, not decoupled), "echo" (optional inputs of several datatypes and
dims, echoed with their shapes and the request's parameters), "echo_batch" (the same,
max_batch_size 8), "errs" (answers an error with the code it is given).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import start_server
from generate_support import (
    HTTP_IMPLS,
    JSON,
    ONE_RESPONSE,
    SSE,
    error,
    generate,
    post,
    sse,
    text,
    write_repository,
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return write_repository(tmp_path_factory.mktemp("generate") / "models")


@pytest.fixture(scope="module", params=HTTP_IMPLS)
def srv(repo, request):
    with start_server(repo, "--http-impl", request.param) as s:
        yield s


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
    """TritonJson's type errors (Triton: 500; the client's mistake: 400, as /infer)."""
    for doc, want in INVALID_TYPES:
        assert generate(srv, "mock_llm", doc, route) == (400, JSON, error(want))


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
    assert generate(srv, "mock_llm", doc) == (400, JSON, error(
        "Unable to parse JSON bytes array: attempt to access JSON non-string as string"))


def test_parameters(srv):
    one = text("mock_llm", "hello world")
    doc = {"PROMPT": ["hello world"], "STREAM": True, "parameters": {"REPETITION": 3}}
    assert generate(srv, "mock_llm", doc, "generate_stream") == (200, SSE, sse(one, one, one))
    doc["parameters"] = 1
    assert generate(srv, "mock_llm", doc) == (400, JSON, error(
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
