"""Header forwarding end to end (--http-header-forward-pattern, --grpc-header-forward-pattern):
a real `trireme serve` and the official tritonclient; a Python model answers with its
request.parameters() string, so the test sees what the model sees.

What Triton does (checked side by side with Triton 2.51; the reserved-name refusal is main's):
HTTP keeps a name's case; the pattern is "(?i)" + the flag, matched anywhere in the name
("(?-i)" turns case back on); a forwarded header replaces a request parameter of the same
name; a reserved name fails the request; generate is not forwarded; a gRPC stream's
metadata reaches each of its requests.
"""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server
from models_python import io_config, python_model
from tritonclient.utils import InferenceServerException

from services.cli import build_parser

PARAMS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "PARAMS", np.array([r.parameters()], dtype=object))]) for r in requests]
'''

# HTTP: case-sensitive "My_" (the "(?-i)" Triton's docs show), and the names the tests below
# send to collide and to be refused. gRPC: upper-case "MY_", which metadata (always lower
# case) matches only because the pattern is case-insensitive.
HTTP_PATTERN = "(?-i)My_|^coll$|^priority$|^triton_"
GRPC_PATTERN = "MY_|^coll$|^sequence_id$"


@pytest.fixture(scope="module", params=["native", "aio"])
def server(request, tmp_path_factory):
    """The native servers, and grpc.aio with aiohttp (they hand headers over differently)."""
    repo = tmp_path_factory.mktemp("forward") / "models"
    python_model(repo, "params", PARAMS, io_config(
        "params", [("INPUT0", "TYPE_INT32", "[ 1 ]")], [("PARAMS", "TYPE_STRING", "[ 1 ]")]))
    impls = (["--grpc-impl", "aio", "--http-impl", "aiohttp"] if request.param == "aio"
             else [])
    with start_server(repo, "--http-header-forward-pattern", HTTP_PATTERN,
                      f"--grpc-header-forward-pattern={GRPC_PATTERN}", *impls) as srv:
        yield srv


def _inputs(module):
    i = module.InferInput("INPUT0", [1], "INT32")
    i.set_data_from_numpy(np.array([7], dtype=np.int32))
    return [i]


def _params(result) -> dict:
    return json.loads(result.as_numpy("PARAMS")[0])


def test_http_forwards_matching_headers_in_their_case(server):
    with httpclient.InferenceServerClient(server.http_url) as c:
        r = c.infer("params", _inputs(httpclient), parameters={"p": 1, "coll": "body"},
                    headers={"My_Header": "v1", "my_lower": "no", "Other": "no", "coll": "hdr"})
    assert _params(r) == {"p": 1, "coll": "hdr", "My_Header": "v1"}


def test_http_without_matching_headers_keeps_the_request_parameters(server):
    with httpclient.InferenceServerClient(server.http_url) as c:
        r = c.infer("params", _inputs(httpclient), parameters={"p": "x"})
    assert _params(r) == {"p": "x"}


def test_http_reserved_header_fails_the_request(server):
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "INT32", "data": [1]}]}
    for name in ("priority", "triton_x"):
        r = requests.post(f"http://{server.http_url}/v2/models/params/infer", json=body,
                          headers={name: "1"}, timeout=30)
        assert (r.status_code, r.json()) == (400, {
            "error": f"Header '{name}' is reserved for Triton usage and cannot be forwarded."})


def test_http_generate_does_not_forward(server):
    r = requests.post(f"http://{server.http_url}/v2/models/params/generate",
                      json={"INPUT0": 1}, headers={"My_Header": "v1"}, timeout=30)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["PARAMS"]) == {}


def test_grpc_unary_forwards_matching_metadata(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        r = c.infer("params", _inputs(grpcclient), parameters={"coll": "body", "q": True},
                    headers={"my_header": "v1", "other": "no", "coll": "hdr"})
    assert _params(r) == {"coll": "hdr", "q": True, "my_header": "v1"}


def test_grpc_reserved_metadata_fails_the_request(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        with pytest.raises(InferenceServerException) as e:
            c.infer("params", _inputs(grpcclient), headers={"sequence_id": "5"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert e.value.message() == ("Header 'sequence_id' is reserved for Triton usage and "
                                 "cannot be forwarded.")


def test_grpc_stream_metadata_reaches_every_request(server):
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put((result, error)),
                       headers={"my_stream": "s1"})
        try:
            for i in range(2):
                c.async_stream_infer("params", _inputs(grpcclient), parameters={"i": i})
            answers = [got.get(timeout=30) for _ in range(2)]
        finally:
            c.stop_stream()
    assert [e for _, e in answers] == [None, None]
    assert sorted((_params(r) for r, _ in answers), key=lambda p: p["i"]) == [
        {"i": 0, "my_stream": "s1"}, {"i": 1, "my_stream": "s1"}]


def test_grpc_stream_reserved_metadata_fails_each_request_not_the_stream(server):
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put((result, error)),
                       headers={"sequence_id": "5"})
        try:
            for _ in range(2):
                c.async_stream_infer("params", _inputs(grpcclient))
            answers = [got.get(timeout=30) for _ in range(2)]
        finally:
            c.stop_stream()
    assert [r for r, _ in answers] == [None, None]
    assert {e.message() for _, e in answers} == {
        "Header 'sequence_id' is reserved for Triton usage and cannot be forwarded."}


def test_a_pattern_python_cannot_read_stops_the_server_at_the_command_line(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model-repository", "/tmp",
                                   "--http-header-forward-pattern", "("])
    assert ("argument --http-header-forward-pattern: invalid regular expression '(': "
            in capsys.readouterr().err)
