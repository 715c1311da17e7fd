"""Model warmup (config `model_warmup`) end to end: each instance runs its samples while it
loads, before the model is READY, and again when it is restarted after a crash.

The Python models here append what each execute() received to `executions.jsonl` in their
model directory, so a test reads exactly which warmup executions ran, and with what.
Triton 2.51 answers every case below the same way (checked side by side with real Triton
and its qa/L0_warmup models), but for two things: its index reason starts with the code
("Invalid argument: ..."), and its statistics count warmup executions (docs/compat.md).
"""
from __future__ import annotations

import json
import os
import re
import signal
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests import models
from tests.conftest import start_server, wait_models, wait_until
from tests.models_python import python_model

RECORDER = '''
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Appends one line per execute(): per request, each input's shape, dtype and data."""

    def initialize(self, args):
        self.path = os.path.join(args["model_repository"], "executions.jsonl")

    def execute(self, requests):
        seen, responses = [], []
        for request in requests:
            inputs = {}
            for t in request.inputs():
                a = t.as_numpy()
                data = ([v.decode() for v in a.ravel()] if a.dtype == object
                        else a.tobytes().hex())
                inputs[t.name()] = [list(a.shape), str(a.dtype), data]
            seen.append(inputs)
            x = pb_utils.get_input_tensor_by_name(request, "X")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x.as_numpy())]))
        with open(self.path, "a") as f:
            f.write(json.dumps(seen, sort_keys=True) + "\\n")
        return responses
'''

FAILING = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """qa/L0_warmup/failing_infer: an error for every request."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError("An Error Occurred")) for _ in requests]
'''

DECOUPLED = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """qa/L0_warmup/decoupled: a final flag and no response for every request."""

    def execute(self, requests):
        for request in requests:
            request.get_response_sender().send(
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

X = 'input [{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] }]'
XS = ('input [{ name: "X" data_type: TYPE_FP32 dims: [ 3 ] },'
      ' { name: "S" data_type: TYPE_STRING dims: [ 2 ] }]')


def _config(inputs: str, samples: list[str], max_batch_size: int = 4, extra: str = "") -> str:
    return (f'backend: "python"\nmax_batch_size: {max_batch_size}\n{inputs}\n'
            'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }]\n'
            f'instance_group [{{ kind: KIND_CPU, count: 1 }}]\n{extra}\n'
            f'model_warmup [\n{",".join(samples)}\n]\n')


def _sample(name: str, batch_size: int, *inputs: str, count: int = 0) -> str:
    return f'{{ name: "{name}" batch_size: {batch_size} count: {count} {" ".join(inputs)} }}'


def _input(name: str, data_type: str, dims: str, data: str) -> str:
    return f'inputs {{ key: "{name}" value {{ data_type: {data_type} dims: {dims} {data} }} }}'


ZEROS = _sample("zeros", 1, _input("X", "TYPE_FP32", "[ 3 ]", "zero_data: true"),
                _input("S", "TYPE_STRING", "[ 2 ]", "zero_data: true"),
                _input("START", "TYPE_INT32", "[ 1 ]", "zero_data: true"), count=2)
RANDOM = _sample("random", 3, _input("X", "TYPE_FP32", "[ 3 ]", "random_data: true"),
                 _input("S", "TYPE_STRING", "[ 2 ]", "random_data: true"))
SKIPPED = _sample("skipped", 0, _input("X", "TYPE_FP32", "[ -1 ]", "zero_data: true"))
X_ZEROS = _input("X", "TYPE_FP32", "[ 3 ]", "zero_data: true")
FILE_DATA = np.array([1.5, -2.0, 3.25, 99.0], np.float32)   # one float more than X takes
STRINGS = [b"ab", "wörld".encode()]


def _strings(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(s)) + s for s in items)


def _executions(model_dir) -> list:
    path = model_dir / "executions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _warmup_lines(srv, model: str) -> list[str]:
    """The messages of the server log's warmup lines of ``model`` (verbose level 1)."""
    return re.findall(rf'\] "(model \'{model}\' instance \S+ is running warmup sample .*)"$',
                      srv.log(), re.MULTILINE)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup") / "models"
    python_model(root, "recorder", RECORDER, _config(XS, [ZEROS, RANDOM, SKIPPED]))
    d = python_model(root, "from_file", RECORDER, _config(XS, [_sample(
        "file", 2, _input("X", "TYPE_FP32", "[ 3 ]", 'input_data_file: "x.bin"'),
        _input("S", "TYPE_STRING", "[ 2 ]", 'input_data_file: "s.bin"'))]))
    (d / "warmup").mkdir()
    (d / "warmup" / "x.bin").write_bytes(FILE_DATA.tobytes())
    (d / "warmup" / "s.bin").write_bytes(_strings(STRINGS))
    python_model(root, "restarted", RECORDER, _config(X, [_sample("once", 2, X_ZEROS)]))
    python_model(root, "decoupled", DECOUPLED, _config(X, [_sample("decoupled sample", 1, X_ZEROS)],
                                                       0, "model_transaction_policy { decoupled: true }"))
    models.add_sub(root / "onnx_add_sub", size=4)   # a tensor backend: one execute over the batch
    pair = _sample("pair", 2, _input("INPUT0", "TYPE_FP32", "[ 4 ]", "zero_data: true"),
                   _input("INPUT1", "TYPE_FP32", "[ 4 ]", "random_data: true"))
    models.write_config(root / "onnx_add_sub", (
        'backend: "onnxruntime"\nmax_batch_size: 8\n'
        f'instance_group [{{ kind: KIND_CPU, count: 1 }}]\nmodel_warmup [{pair}]\n'))
    with start_server(root, "--log-verbose", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield c
    c.close()


def test_samples_run_in_order_count_times_as_batches_of_requests(server):
    runs = _executions(server.repo / "recorder")
    # "zeros" twice (count 2), one request each; "random" once, 3 requests; "skipped" never
    assert [len(r) for r in runs] == [1, 1, 3]
    zeros = {"X": [[1, 3], "float32", "00" * 12], "S": [[1, 2], "object", ["", ""]],
             "START": [[1, 1], "int32", "00" * 4]}   # a control input, passed as given
    assert runs[0] == runs[1] == [zeros]
    random = runs[2]
    # one random buffer per sample (Triton's): every request reads the same values
    assert random[0] == random[1] == random[2]
    assert sorted(random[0]) == ["S", "X"]
    assert random[0]["S"] == [[1, 2], "object", ["", ""]]    # random STRING data: zeros
    assert random[0]["X"][:2] == [[1, 3], "float32"]


def test_log_lines(server):
    assert _warmup_lines(server, "recorder") == [
        "model 'recorder' instance recorder_0_0 is running warmup sample 'zeros' for iteration 1",
        "model 'recorder' instance recorder_0_0 is running warmup sample 'zeros' for iteration 2",
        "model 'recorder' instance recorder_0_0 is running warmup sample 'random' for iteration 1"]
    assert _warmup_lines(server, "onnx_add_sub") == [
        "model 'onnx_add_sub' instance onnx_add_sub_0_0 is running warmup sample 'pair' for "
        "iteration 1"]
    assert _warmup_lines(server, "decoupled") == [   # its final flag ended the run
        "model 'decoupled' instance decoupled_0_0 is running warmup sample 'decoupled sample' "
        "for iteration 1"]


def test_input_data_files(server):
    runs = _executions(server.repo / "from_file")
    one = {"X": [[1, 3], "float32", FILE_DATA[:3].tobytes().hex()],   # the bytes the shape takes
           "S": [[1, 2], "object", [s.decode() for s in STRINGS]]}
    assert runs == [[one, one]]


def test_warmup_is_not_in_statistics(client):
    # Trireme's statistics count client requests only; Triton 2.51 counts warmup too
    # (docs/compat.md). The model is READY, so its warmup ran.
    for name in ("recorder", "onnx_add_sub"):
        stats = client.get_inference_statistics(name)["model_stats"][0]
        assert stats.get("inference_count", 0) == 0 and stats.get("execution_count", 0) == 0
        assert stats.get("batch_stats", []) == []


def test_restarted_instance_warms_up_again(server, client):
    model_dir = server.repo / "restarted"
    assert [len(r) for r in _executions(model_dir)] == [2]
    (pid, name), = server.workers("restarted")
    assert name == "restarted_0_0"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: len(_executions(model_dir)) == 2, 30, "the restarted instance's warmup")
    wait_until(lambda: client.is_model_ready("restarted"), 30, "the restarted instance")
    assert [len(r) for r in _executions(model_dir)] == [2, 2]
    assert len(_warmup_lines(server, "restarted")) == 2
    x = httpclient.InferInput("X", [1, 3], "FP32")
    x.set_data_from_numpy(np.ones((1, 3), np.float32))
    r = client.infer("restarted", [x])
    np.testing.assert_array_equal(r.as_numpy("Y"), np.ones((1, 3), np.float32))
    assert [len(r) for r in _executions(model_dir)] == [2, 2, 1]


# ------------------------------------------------------------------------------ failures
@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup_failures") / "models"
    python_model(root, "failing_infer", FAILING, _config(X, [_sample("zero sample", 1, X_ZEROS)], 0))
    # the first sample is fine, but no sample runs: all are checked first
    python_model(root, "variable_dims", RECORDER, _config(X, [
        _sample("fine", 1, X_ZEROS),
        _sample("wildcard", 1, _input("X", "TYPE_FP32", "[ -1 ]", "zero_data: true"))]))
    d = python_model(root, "short_file", RECORDER, _config(X, [_sample(
        "short", 1, _input("X", "TYPE_FP32", "[ 3 ]", 'input_data_file: "x.bin"'))]))
    (d / "warmup").mkdir()
    (d / "warmup" / "x.bin").write_bytes(bytes(8))
    python_model(root, "no_data", RECORDER, _config(X, [_sample(
        "none", 1, _input("X", "TYPE_FP32", "[ 3 ]", ""))]))
    python_model(root, "too_big", RECORDER, _config(X, [_sample("three", 3, X_ZEROS)], 2))
    python_model(root, "fine", RECORDER, _config(X, [_sample("fine", 1, X_ZEROS)]))
    bad = ["failing_infer", "variable_dims", "short_file", "no_data", "too_big"]
    with start_server(root, "--exit-on-error", "false", ready=False) as srv:
        wait_models(srv, ["fine"], bad)
        c = httpclient.InferenceServerClient(srv.http_url)
        index = {e["name"]: e for e in c.get_model_repository_index()}
        c.close()
        yield srv, index


@pytest.mark.parametrize("model,reason", [
    ("failing_infer", "failed to run warmup sample 'zero sample': An Error Occurred; "),
    ("variable_dims", "warmup setting expects all variable-size dimensions are specified for "
                      "input 'X'"),
    ("short_file", "[request id: <id_unknown>] warmup setting expects 12 bytes, but the data "
                   "provided from x.binonly has 8 bytes"),
    ("no_data", "[request id: <id_unknown>] warmup setting expects input 'X' to have "
                "input_data_type set"),
    ("too_big", "failed to run warmup sample 'three': batch size 3 for 'too_big_0_0', max allowed "
                "is 2; batch size 3 for 'too_big_0_0', max allowed is 2; batch size 3 for "
                "'too_big_0_0', max allowed is 2; "),
])
def test_failed_warmup_fails_the_load(failures, model, reason):
    srv, index = failures
    assert (index[model]["state"], index[model]["reason"]) == ("UNAVAILABLE", reason)


def test_nothing_runs_before_every_sample_checks_out(failures):
    srv, index = failures
    assert _executions(srv.repo / "variable_dims") == []
    assert [len(r) for r in _executions(srv.repo / "fine")] == [1]
    assert index["fine"]["state"] == "READY"


def test_failed_warmup_stops_start_up(tmp_path):
    """qa/L0_warmup: with the default --exit-on-error the server does not start."""
    root = tmp_path / "models"
    python_model(root, "failing_infer", FAILING, _config(X, [_sample("zero sample", 1, X_ZEROS)], 0))
    with pytest.raises(AssertionError, match="server exited") as e, start_server(root):
        pass
    assert "failed to run warmup sample 'zero sample': An Error Occurred;" in str(e.value)
