"""Triton's qa/L0_simple_ensemble, ported: its models rebuilt here (the two-version INT32
'simple', the six-step ensemble_add_sub_int32_int32_int32, partial_add_sub and its
ensemble) and its four checks, written in our own code."""
from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server
from models import add_sub, write_config
from models_python import python_model

I32 = '{{ name: "{}" data_type: TYPE_INT32 dims: [ 16 ] }}'
IO = (f"input [ {I32.format('INPUT0')}, {I32.format('INPUT1')} ]\n"
      f"output [ {I32.format('OUTPUT0')}, {I32.format('OUTPUT1')} ]\n")


def _step(version: int, in0: str, in1: str, out: str, value: str) -> str:
    return (f'{{ model_name: "simple" model_version: {version} input_map {{ key: "INPUT0" value: '
            f'"{in0}" }} input_map {{ key: "INPUT1" value: "{in1}" }} output_map {{ key: "{out}" '
            f'value: "{value}" }} }}')


PARTIAL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """qa/L0_simple_ensemble/models/partial_add_sub: OUTPUT0 = INPUT0 + INPUT1, and no
    OUTPUT1 although the config declares it."""

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", (a + b).astype(np.int32))]))
        return responses
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("qa_ensemble") / "models"
    add_sub(root / "simple", size=16, dtype="int32", versions=(1, 2))
    write_config(root / "simple", f'name: "simple"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
                 f"version_policy: {{ all {{}} }}\n{IO}instance_group [ {{ kind: KIND_CPU }} ]\n")
    steps = ", ".join([_step(-1, "INPUT0", "INPUT0", "OUTPUT0", "double_input0"),
                       _step(1, "INPUT1", "INPUT1", "OUTPUT0", "double_input1"),
                       _step(-1, "double_input0", "INPUT0", "OUTPUT1", "input0_val"),
                       _step(1, "double_input1", "INPUT1", "OUTPUT1", "input1_val"),
                       _step(-1, "input0_val", "INPUT1", "OUTPUT0", "OUTPUT0"),
                       _step(1, "INPUT0", "input1_val", "OUTPUT1", "OUTPUT1")])
    (root / "ensemble_add_sub_int32_int32_int32" / "1").mkdir(parents=True)
    write_config(root / "ensemble_add_sub_int32_int32_int32",
                 f'name: "ensemble_add_sub_int32_int32_int32"\nplatform: "ensemble"\n'
                 f"max_batch_size: 8\n{IO}ensemble_scheduling {{ step [ {steps} ] }}\n")
    python_model(root, "partial_add_sub", PARTIAL,
                 f'name: "partial_add_sub"\nbackend: "python"\nmax_batch_size: 8\n{IO}')
    (root / "ensemble_partial_add_sub" / "1").mkdir(parents=True)
    partial_steps = (
        '{ model_name: "simple" model_version: -1 input_map { key: "INPUT0" value: "INPUT1" } '
        'input_map { key: "INPUT1" value: "INPUT1" } output_map { key: "OUTPUT1" value: '
        '"intermediate_1" } }, { model_name: "partial_add_sub" model_version: -1 input_map { '
        'key: "INPUT0" value: "INPUT0" } input_map { key: "INPUT1" value: "intermediate_1" } '
        'output_map { key: "OUTPUT0" value: "OUTPUT0" } output_map { key: "OUTPUT1" value: '
        '"OUTPUT1" } }')
    write_config(root / "ensemble_partial_add_sub",
                 f'platform: "ensemble"\nmax_batch_size: 8\n{IO}'
                 f"ensemble_scheduling {{ step [ {partial_steps} ] }}\n")
    with start_server(root) as srv:
        yield srv


def _inputs(mod, a, b):
    inputs = [mod.InferInput("INPUT0", list(a.shape), "INT32"),
              mod.InferInput("INPUT1", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _counts(server) -> list[int]:
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("simple")
    by_version = {s["version"]: s["inference_stats"]["success"]["count"] for s in stats["model_stats"]}
    assert len(stats["model_stats"]) == 2
    return [by_version["1"], by_version["2"]]


def test_ensemble_add_sub_then_one_output(server):
    """test_ensemble_add_sub: both outputs, batch 1 and 8, and both 'simple' versions did
    the same work; test_ensemble_add_sub_one_output: asking OUTPUT0 alone runs only the
    steps that lead to it, all on version 2."""
    client = httpclient.InferenceServerClient(server.http_url)
    rng = np.random.default_rng(0)
    before = _counts(server)
    for bs in (1, 8):
        a = rng.integers(-50, 50, (bs, 16), dtype=np.int32)
        b = rng.integers(-50, 50, (bs, 16), dtype=np.int32)
        r = client.infer("ensemble_add_sub_int32_int32_int32", _inputs(httpclient, a, b))
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    mid = _counts(server)
    assert mid[0] - before[0] == mid[1] - before[1] == 6          # 3 steps x 2 requests each
    for bs in (1, 8):
        a = rng.integers(-50, 50, (bs, 16), dtype=np.int32)
        b = rng.integers(-50, 50, (bs, 16), dtype=np.int32)
        r = client.infer("ensemble_add_sub_int32_int32_int32", _inputs(httpclient, a, b),
                         outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
        assert r.as_numpy("OUTPUT1") is None
    after = _counts(server)
    assert after[0] == mid[0] and after[1] - mid[1] == 6


def test_ensemble_sequence_flags(server):
    """Each answer of a sequence sent to an ensemble carries its START/END flags."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    try:
        for i in range(3):
            client.async_stream_infer("ensemble_add_sub_int32_int32_int32", _inputs(grpcclient, a, a),
                                      outputs=[grpcclient.InferRequestedOutput("OUTPUT0")],
                                      request_id=f"77_{i}", sequence_id=77, sequence_start=i == 0,
                                      sequence_end=i == 2)
        results = [got.get(timeout=30) for _ in range(3)]
    finally:
        client.stop_stream()
    flags = [[r.get_response().parameters["sequence_start"].bool_param,
              r.get_response().parameters["sequence_end"].bool_param] for r, _ in results]
    assert flags == [[True, False], [False, False], [False, True]]


def test_ensemble_partial_add_sub(server):
    """A step that leaves an output out: the answer has the outputs there are (Triton logs
    "Composing models did not output tensor OUTPUT1")."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    r = client.infer("ensemble_partial_add_sub", _inputs(grpcclient, a, b),
                     outputs=[grpcclient.InferRequestedOutput("OUTPUT0"),
                              grpcclient.InferRequestedOutput("OUTPUT1")])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + (b - b))
    assert r.as_numpy("OUTPUT1") is None
