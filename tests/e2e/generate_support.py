"""What the generate tests share (test_generate.py: Triton's generate_endpoint_test.py
cases; test_generate_wire.py: the stream on the wire and the body's mapping): the
models, the servers (both HTTP implementations) and request helpers. See
test_generate.py for what was asked of real Triton and how."""
from __future__ import annotations

import http.client
import json
from pathlib import Path

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


def write_repository(root: Path) -> Path:
    for name, decoupled in (("mock_llm", "true"), ("mock_llm_nd", "false")):
        python_model(root, name, MOCK_LLM,
                     f'name: "{name}"\n' + MOCK_LLM_CONFIG.format(decoupled=decoupled))
    python_model(root, "echo", ECHO, echo_config("echo", 0))
    python_model(root, "echo_batch", ECHO, echo_config("echo_batch", 8))
    python_model(root, "errs", ERRS, ERRS_CONFIG)
    return root


HTTP_IMPLS = ["native", "aiohttp"]


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
