"""Ensembles end to end: ONNX and Python steps, a chain and an ensemble of an ensemble,
tensors above the inline threshold between steps, a failing step, load failures that end
UNAVAILABLE (never LOADING), composing models loaded with the ensemble in explicit mode,
statistics for the ensemble and its steps. The last tests pin Triton 2.51's answers, asked
of it with the same models and requests: the sequence parameters of an answer, an optional
input or an output left out, an ensemble's statistics, a Python model's failures counted."""
from __future__ import annotations

import json
import queue
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_until
from models import add_sub, scale, write_config
from models_python import ADD_SUB, ADD_SUB_CONFIG, IDENTITY, RAISER, REPEAT, io_config, python_model
from tritonclient.utils import InferenceServerException

DOUBLE = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)]) for r in requests]
'''

# Z = X + Y, where Y is an optional input: without it, execute() raises (AttributeError)
OPTIONAL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Z", (
            pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            + pb_utils.get_input_tensor_by_name(r, "Y").as_numpy()))]) for r in requests]
'''

# OUT = IN; its config declares OTHER too, which it never sends
LEAVES_OUT = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
'''

A = np.arange(4, dtype=np.float32).reshape(1, 4)
B = np.ones((1, 4), dtype=np.float32)


OPTIONAL_ENSEMBLES = {"py_optional": "opt_chain", "py_optional_batched": "opt_scheduled"}


def ensemble(root, name: str, steps: str, inputs: str, outputs: str, max_batch: int = 8,
             extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    write_config(root / name, f'''name: "{name}"
platform: "ensemble"
max_batch_size: {max_batch}
input [ {inputs} ]
output [ {outputs} ]
ensemble_scheduling {{ {extra} step [ {steps} ] }}
''')


def fp32(name: str, dims: str = "4") -> str:
    return f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ {dims} ] }}'


def repository(root):
    add_sub(root / "onnx_add_sub", size=4)
    write_config(root / "onnx_add_sub", "max_batch_size: 8\n"
                 "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
    scale(root / "onnx_scale", ["batch", "n"], factor=2.0)
    write_config(root / "onnx_scale", f"max_batch_size: 8\ninput [ {fp32('INPUT0', '-1')} ]\n"
                 f"output [ {fp32('OUTPUT0', '-1')} ]\ninstance_group [{{ kind: KIND_CPU }}]\n")
    python_model(root, "py_add_sub", ADD_SUB, ADD_SUB_CONFIG.format(
        name="py_add_sub", batching="max_batch_size: 8"))
    python_model(root, "py_identity", IDENTITY, io_config(
        "py_identity", [("INPUT0", "TYPE_FP32", "[ -1 ]")], [("OUTPUT0", "TYPE_FP32", "[ -1 ]")],
        max_batch_size=8))
    python_model(root, "raiser", RAISER, io_config(
        "raiser", [("X", "TYPE_FP32", "[ -1 ]")], [("Y", "TYPE_FP32", "[ -1 ]")], max_batch_size=8))
    # add_sub -> scale(sum): (A + B) * 2, and A - B passed through
    ensemble(root, "chain", '''
        { model_name: "onnx_add_sub" model_version: -1
          input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
          output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "DIFF" } },
        { model_name: "onnx_scale" model_version: -1
          input_map { key: "INPUT0" value: "sum" } output_map { key: "OUTPUT0" value: "SCALED" } }''',
             f"{fp32('A')}, {fp32('B')}", f"{fp32('SCALED')}, {fp32('DIFF')}")
    # the same with Python steps (Triton's add_sub example, then an identity)
    ensemble(root, "py_chain", '''
        { model_name: "py_add_sub" model_version: -1
          input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
          output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "DIFF" } },
        { model_name: "py_identity" model_version: -1
          input_map { key: "INPUT0" value: "sum" } output_map { key: "OUTPUT0" value: "SUM" } }''',
             f"{fp32('A')}, {fp32('B')}", f"{fp32('SUM')}, {fp32('DIFF')}")
    # an ensemble whose step is an ensemble: chain, then scale again
    ensemble(root, "nested", '''
        { model_name: "chain" model_version: -1
          input_map { key: "A" value: "X" } input_map { key: "B" value: "Y" }
          output_map { key: "SCALED" value: "s" } output_map { key: "DIFF" value: "D" } },
        { model_name: "onnx_scale" model_version: -1
          input_map { key: "INPUT0" value: "s" } output_map { key: "OUTPUT0" value: "S4" } }''',
             f"{fp32('X')}, {fp32('Y')}", f"{fp32('S4')}, {fp32('D')}")
    # big tensors between steps (1 MiB: shared memory)
    ensemble(root, "big", '''
        { model_name: "py_identity" model_version: -1
          input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "mid" } },
        { model_name: "onnx_scale" model_version: -1
          input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } }''',
             fp32("IN", "-1"), fp32("OUT", "-1"))
    # a decoupled step (one response per element) feeding a plain one: the ensemble streams
    python_model(root, "repeat", REPEAT, io_config(
        "repeat", [("IN", "TYPE_INT32", "[ -1 ]")], [("OUT", "TYPE_INT32", "[ 1 ]")],
        extra="model_transaction_policy { decoupled: true }"))
    python_model(root, "py_double", DOUBLE, io_config(
        "py_double", [("X", "TYPE_INT32", "[ 1 ]")], [("Y", "TYPE_INT32", "[ 1 ]")]))
    ensemble(root, "streamed", '''
        { model_name: "repeat" model_version: -1
          input_map { key: "IN" value: "VALUES" } output_map { key: "OUT" value: "one" } },
        { model_name: "py_double" model_version: -1
          input_map { key: "X" value: "one" } output_map { key: "Y" value: "TWICE" } }''',
             '{ name: "VALUES" data_type: TYPE_INT32 dims: [ -1 ] }',
             '{ name: "TWICE" data_type: TYPE_INT32 dims: [ 1 ] }', max_batch=0)
    ensemble(root, "failing", '''
        { model_name: "raiser" model_version: -1
          input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } }''',
             fp32("IN", "-1"), fp32("OUT", "-1"))
    # an optional input, on both ensemble paths: a step without a batcher runs in a chain
    # (the frontend), one with a dynamic batcher through the scheduler's ensemble queue
    for step, extra in (("py_optional", ""), ("py_optional_batched", "dynamic_batching { }")):
        python_model(root, step, OPTIONAL, io_config(
            step, [("X", "TYPE_INT32", "[ 1 ]"), ("Y", "TYPE_INT32", "[ 1 ]")],
            [("Z", "TYPE_INT32", "[ 1 ]")], max_batch_size=8, extra=extra).replace(
            'name: "Y" data_type: TYPE_INT32 dims: [ 1 ]', 'name: "Y" data_type: TYPE_INT32 '
            'dims: [ 1 ] optional: true'))
        ensemble(root, OPTIONAL_ENSEMBLES[step], f'''
            {{ model_name: "{step}" model_version: -1 input_map {{ key: "X" value: "A" }}
              input_map {{ key: "Y" value: "B" }} output_map {{ key: "Z" value: "C" }} }}''',
                 '{ name: "A" data_type: TYPE_INT32 dims: [ 1 ] }, '
                 '{ name: "B" data_type: TYPE_INT32 dims: [ 1 ] optional: true }',
                 '{ name: "C" data_type: TYPE_INT32 dims: [ 1 ] }')
    python_model(root, "py_leaves_out", LEAVES_OUT, io_config(
        "py_leaves_out", [("IN", "TYPE_FP32", "[ -1 ]")],
        [("OUT", "TYPE_FP32", "[ -1 ]"), ("OTHER", "TYPE_FP32", "[ -1 ]")], max_batch_size=8))
    ensemble(root, "leaves_out", '''
        { model_name: "py_leaves_out" model_version: -1 input_map { key: "IN" value: "X" }
          output_map { key: "OUT" value: "Y" } output_map { key: "OTHER" value: "Z" } }''',
             fp32("X", "-1"), f"{fp32('Y', '-1')}, {fp32('Z', '-1')}")
    ensemble(root, "missing_step", '''
        { model_name: "no_such_model" model_version: -1
          input_map { key: "X" value: "IN" } output_map { key: "Y" value: "OUT" } }''',
             fp32("IN", "-1"), fp32("OUT", "-1"))
    ensemble(root, "bad_map", '''
        { model_name: "onnx_scale" model_version: -1
          input_map { key: "NOT_AN_INPUT" value: "IN" } output_map { key: "OUTPUT0" value: "OUT" } }''',
             fp32("IN", "-1"), fp32("OUT", "-1"))
    return root


@pytest.fixture(scope="module", params=["frontend-process", "in-process-frontend"])
def server(tmp_path_factory, request):
    """Every test twice: with the frontend in its own process, and on the scheduler's loop
    (--in-process-frontend), where the frontend's messages skip the socket."""
    root = repository(tmp_path_factory.mktemp("ensemble") / "models")
    extra = ["--in-process-frontend"] if request.param == "in-process-frontend" else []
    with start_server(root, *extra, "--exit-on-error", "false", ready=False) as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        wait_until(lambda: {e["name"] for e in client.get_model_repository_index()
                            if e.get("state") in ("READY", "UNAVAILABLE")} >= {
            "chain", "py_chain", "nested", "big", "failing", "missing_step", "bad_map", "streamed",
            "opt_chain", "opt_scheduled", "leaves_out"},
            60, "every model to load or fail")
        yield srv


def _infer(mod, url: str, model: str, named: dict[str, np.ndarray]):
    client = mod.InferenceServerClient(url)
    inputs = []
    for name, arr in named.items():
        inp = mod.InferInput(name, list(arr.shape), "FP32")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return client.infer(model, inputs)


@pytest.mark.parametrize("mod,port", [(httpclient, "http_url"), (grpcclient, "grpc_url")])
def test_two_step_chains(server, mod, port):
    url = getattr(server, port)
    r = _infer(mod, url, "chain", {"A": A, "B": B})
    np.testing.assert_array_equal(r.as_numpy("SCALED"), (A + B) * 2)
    np.testing.assert_array_equal(r.as_numpy("DIFF"), A - B)
    r = _infer(mod, url, "py_chain", {"A": A, "B": B})
    np.testing.assert_array_equal(r.as_numpy("SUM"), A + B)
    np.testing.assert_array_equal(r.as_numpy("DIFF"), A - B)


def test_an_ensemble_of_an_ensemble(server):
    r = _infer(grpcclient, server.grpc_url, "nested", {"X": A, "Y": B})
    np.testing.assert_array_equal(r.as_numpy("S4"), (A + B) * 4)
    np.testing.assert_array_equal(r.as_numpy("D"), A - B)


def test_large_tensors_between_steps(server):
    x = np.random.default_rng(3).random((1, 1 << 18), dtype=np.float32)   # 1 MiB
    for mod, port in ((httpclient, "http_url"), (grpcclient, "grpc_url")):
        r = _infer(mod, getattr(server, port), "big", {"IN": x})
        np.testing.assert_array_equal(r.as_numpy("OUT"), x * 2)


def test_a_failing_step_fails_the_request_naming_the_ensemble(server):
    with pytest.raises(InferenceServerException) as e:
        _infer(httpclient, server.http_url, "failing", {"IN": np.array([[-1.0]], np.float32)})
    assert e.value.message().startswith("in ensemble 'failing', Failed to process the request(s) "
                                        "for model 'raiser_0_0', message: ")
    assert "negative input" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        _infer(grpcclient, server.grpc_url, "failing", {"IN": np.array([[100.0]], np.float32)})
    assert e.value.message() == "in ensemble 'failing', one hundred is not allowed"
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    # and the ensemble still serves
    r = _infer(httpclient, server.http_url, "failing", {"IN": np.array([[3.0]], np.float32)})
    assert r.as_numpy("OUT").tolist() == [[3.0]]


def test_load_failures_end_unavailable_with_their_reason(server):
    index = {e["name"]: e for e in httpclient.InferenceServerClient(
        server.http_url).get_model_repository_index()}
    assert index["missing_step"]["state"] == "UNAVAILABLE"
    assert "no_such_model" in index["missing_step"]["reason"]
    assert index["bad_map"]["state"] == "UNAVAILABLE"
    assert index["bad_map"]["reason"] == (
        "in ensemble bad_map, ensemble tensor IN is mapping to non-existing input NOT_AN_INPUT "
        "in model onnx_scale")


def test_statistics_count_the_ensemble_and_its_steps(server):
    client = httpclient.InferenceServerClient(server.http_url)

    def success(model: str) -> int:
        return client.get_inference_statistics(model)["model_stats"][0]["inference_stats"][
            "success"]["count"]

    before = {m: success(m) for m in ("chain", "onnx_add_sub", "onnx_scale")}
    _infer(httpclient, server.http_url, "chain", {"A": A, "B": B})
    after = {m: success(m) for m in ("chain", "onnx_add_sub", "onnx_scale")}
    assert {m: after[m] - before[m] for m in after} == {"chain": 1, "onnx_add_sub": 1, "onnx_scale": 1}


def test_explicit_mode_loads_the_composing_models(tmp_path):
    root = repository(tmp_path / "models")
    with start_server(root, "--model-control-mode", "explicit") as srv:
        client = httpclient.InferenceServerClient(srv.http_url)
        assert not client.is_model_ready("onnx_add_sub")
        client.load_model("chain")
        assert client.is_model_ready("chain")
        assert client.is_model_ready("onnx_add_sub") and client.is_model_ready("onnx_scale")
        r = _infer(httpclient, srv.http_url, "chain", {"A": A, "B": B})
        np.testing.assert_array_equal(r.as_numpy("SCALED"), (A + B) * 2)
        with pytest.raises(InferenceServerException) as e:
            client.load_model("missing_step")
        assert "no_such_model" in e.value.message()
        states = {x["name"]: x.get("state") for x in client.get_model_repository_index()}
        assert states["missing_step"] == "UNAVAILABLE"


def test_unload_dependents_unloads_the_steps_loaded_for_the_ensemble(tmp_path):
    """Triton's cascading unload: an ensemble's composing models go with it unless another
    loaded ensemble uses them or they were loaded by name; nested ensembles cascade."""
    root = repository(tmp_path / "models")
    with start_server(root, "--model-control-mode", "explicit") as srv:
        h = httpclient.InferenceServerClient(srv.http_url)
        g = grpcclient.InferenceServerClient(srv.grpc_url)

        def ready() -> set[str]:
            return {x["name"] for x in h.get_model_repository_index() if x.get("state") == "READY"}

        h.load_model("nested")   # chain (onnx_add_sub, onnx_scale) and onnx_scale
        h.load_model("big")      # py_identity and onnx_scale
        assert ready() == {"nested", "chain", "onnx_add_sub", "onnx_scale", "big", "py_identity"}
        h.unload_model("nested", unload_dependents=True)
        assert ready() == {"onnx_scale", "big", "py_identity"}   # onnx_scale: big uses it
        g.unload_model("big", unload_dependents=True)
        assert ready() == set()

        h.load_model("onnx_add_sub")   # by name: it stays
        h.load_model("chain")
        h.unload_model("chain", unload_dependents=True)
        assert ready() == {"onnx_add_sub"}
        h.load_model("big")
        g.unload_model("big")          # no cascade asked for: its steps stay
        assert ready() == {"onnx_add_sub", "py_identity", "onnx_scale"}
        h.close()
        g.close()


def test_a_decoupled_step_streams_through_the_ensemble(server):
    """repeat answers once per element of VALUES; each answer runs py_double on its own
    and comes back as one response of the (now decoupled) ensemble, then the final flag."""
    config = httpclient.InferenceServerClient(server.http_url).get_model_config("streamed")
    assert config["model_transaction_policy"]["decoupled"] is True
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inp = grpcclient.InferInput("VALUES", [3], "INT32")
    inp.set_data_from_numpy(np.array([7, 8, 9], np.int32))
    seen = []
    try:
        client.async_stream_infer("streamed", [inp], enable_empty_final_response=True)
        while not seen or not seen[-1][0].get_response().parameters[
                "triton_final_response"].bool_param:
            seen.append(got.get(timeout=30))
            assert seen[-1][1] is None, seen[-1][1]
    finally:
        client.stop_stream()
    values = sorted(int(r.as_numpy("TWICE")[0]) for r, _ in seen if r.as_numpy("TWICE") is not None)
    assert values == [14, 16, 18]
    # The final flag comes with the last answer when no step still runs then, else alone
    # (as Triton's FinishEnsemble does): 3 answers, plus perhaps the bare flag.
    assert len(seen) in (3, 4)


# ---- Triton 2.51's answers, asked of it with the same models and requests ------------------

def _ints(mod, named: dict[str, list[list[int]]]) -> list:
    inputs = []
    for name, rows in named.items():
        inp = mod.InferInput(name, [len(rows), len(rows[0])], "INT32")
        inp.set_data_from_numpy(np.array(rows, np.int32))
        inputs.append(inp)
    return inputs


def _stat(server, model: str) -> dict:
    client = httpclient.InferenceServerClient(server.http_url)
    return client.get_inference_statistics(model)["model_stats"][0]


def _counts(stat: dict) -> dict:
    """The counts of one model_stats entry (durations differ from run to run)."""
    return {"inference_count": stat["inference_count"],
            "execution_count": stat["execution_count"],
            **{k: v["count"] for k, v in stat["inference_stats"].items()},
            **{f"batch_{b['batch_size']}": b["compute_infer"]["count"]
               for b in stat["batch_stats"]}}


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


SEQUENCE_CASES = [   # request parameters -> what the answer carries (Triton: the same for both)
    ({}, {"sequence_id": 0, "sequence_start": False, "sequence_end": False}),
    ({"sequence_id": 5, "sequence_start": True},
     {"sequence_id": 5, "sequence_start": True, "sequence_end": False}),
    ({"sequence_id": "abc", "sequence_end": True},
     {"sequence_id": "abc", "sequence_start": False, "sequence_end": True}),
]


@pytest.mark.parametrize("model", ["opt_chain", "opt_scheduled"])
@pytest.mark.parametrize("sent,answered", SEQUENCE_CASES)
def test_answers_carry_the_sequence_parameters(server, model, sent, answered):
    """Triton's ensemble answers carry sequence_id, sequence_start and sequence_end, the
    request's or their defaults, over HTTP (JSON) and gRPC (int64 / string / bool), on both
    ensemble paths."""
    body = json.dumps({"parameters": sent, "inputs": [
        {"name": n, "datatype": "INT32", "shape": [1, 1], "data": [v]} for n, v in (("A", 1), ("B", 2))]})
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer",
                                 data=body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        doc = json.loads(r.read())
    assert doc["parameters"] == answered
    assert doc["outputs"][0]["data"] == [3]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = client.infer(model, _ints(grpcclient, {"A": [[1]], "B": [[2]]}), **sent).get_response()
    params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in got.parameters.items()}
    assert params == answered
    assert type(params["sequence_id"]) is type(answered["sequence_id"])
    assert got.parameters["sequence_id"].WhichOneof("parameter_choice") == (
        "string_param" if isinstance(answered["sequence_id"], str) else "int64_param")


def test_an_output_a_step_leaves_out_is_left_out(server):
    """Triton: an output a step does not send is there without data: the answer leaves it
    out, and an answer left with no output is an empty one (200, no parameters either)."""
    def post(outputs: list[str]) -> dict:
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        if outputs:
            body["outputs"] = [{"name": n} for n in outputs]
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/leaves_out/infer",
                                     data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    assert post(["Z"]) == {"model_name": "leaves_out", "model_version": "1", "outputs": []}
    doc = post([])
    assert [o["name"] for o in doc["outputs"]] == ["Y"] and doc["outputs"][0]["data"] == [1, 2]
    assert doc["parameters"] == SEQUENCE_CASES[0][1]


# Triton's key sets of a model_stats entry and of a batch_stats entry (2.51, an ensemble)
STAT_KEYS = {"name", "version", "last_inference", "inference_count", "execution_count",
             "inference_stats", "response_stats", "batch_stats", "memory_usage"}
BATCH_KEYS = {"batch_size", "compute_input", "compute_infer", "compute_output"}


@pytest.mark.parametrize("model", ["opt_chain", "opt_scheduled"])
def test_ensemble_statistics_are_tritons(server, model):
    """Triton counts each answered ensemble request as one execution of its batch size
    (execution_count, batch_stats, queue and compute records), as any model's."""
    before = _counts(_stat(server, model))
    client = httpclient.InferenceServerClient(server.http_url)
    for rows in ([[1]], [[2]], [[3], [4]]):
        client.infer(model, _ints(httpclient, {"A": rows, "B": rows}))
    stat = _stat(server, model)
    assert set(stat) == STAT_KEYS and all(set(b) == BATCH_KEYS for b in stat["batch_stats"])
    d = _delta(_counts(stat), before)
    assert d == {"inference_count": 4, "execution_count": 3, "success": 3, "queue": 3,
                 "compute_input": 3, "compute_infer": 3, "compute_output": 3,
                 "batch_1": 2, "batch_2": 1}


@pytest.mark.parametrize("step", ["py_optional", "py_optional_batched"])
def test_a_python_model_that_raises_counts_a_failure(server, step):
    """A missing optional input makes the model raise: the request fails with the Python
    backend's text (500) and counts in "fail" (and its execution), on the direct path
    (py_optional) and through the dynamic batcher (py_optional_batched), as in Triton."""
    before = _counts(_stat(server, step))
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer(step, _ints(httpclient, {"X": [[1]]}))
    assert e.value.status() == "500"
    assert e.value.message().startswith(
        f"Failed to process the request(s) for model '{step}_0_0', message: AttributeError: "
        "'NoneType' object has no attribute 'as_numpy'")
    assert _delta(_counts(_stat(server, step)), before) == {
        "fail": 1, "execution_count": 1, "batch_1": 1}


@pytest.mark.parametrize("step", ["py_optional", "py_optional_batched"])
def test_a_missing_optional_input_reaches_the_step(server, step):
    """Triton runs a step whose input is an optional ensemble input the request left out,
    without that input: here the step raises, the ensemble fails with its error, and both
    count the failure. (Before: the step never ran, "unexpected deadlock ...".)"""
    model = OPTIONAL_ENSEMBLES[step]
    before = {m: _counts(_stat(server, m)) for m in (model, step)}
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as e:
        client.infer(model, _ints(httpclient, {"A": [[1]]}))
    assert e.value.status() == "500"
    assert e.value.message().startswith(
        f"in ensemble '{model}', Failed to process the request(s) for model '{step}_0_0', "
        "message: AttributeError: 'NoneType' object has no attribute 'as_numpy'")
    assert _delta(_counts(_stat(server, model)), before[model]) == {"fail": 1}
    assert _delta(_counts(_stat(server, step)), before[step]) == {
        "fail": 1, "execution_count": 1, "batch_1": 1}
    r = client.infer(model, _ints(httpclient, {"A": [[1]], "B": [[41]]}))
    assert r.as_numpy("C").tolist() == [[42]]


@pytest.mark.xfail(strict=True, reason="Triton 2.51 counts a response the model returns with "
                   "an error (InferenceResponse(error=...)) as a success; Trireme's worker "
                   "reports it as a failed request (services/workers: BatchDone.failed)")
def test_an_error_response_counts_as_a_success(server):
    before = _counts(_stat(server, "raiser"))
    with pytest.raises(InferenceServerException) as e:
        _infer(httpclient, server.http_url, "raiser", {"X": np.array([[100.0]], np.float32)})
    assert (e.value.status(), e.value.message()) == ("400", "one hundred is not allowed")
    assert _delta(_counts(_stat(server, "raiser")), before) == {
        "inference_count": 1, "execution_count": 1, "success": 1, "queue": 1,
        "compute_input": 1, "compute_infer": 1, "compute_output": 1, "batch_1": 1}


def _key_paths(x, path: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(x, dict):
        for k, v in x.items():
            out |= {f"{path}.{k}"} | _key_paths(v, f"{path}.{k}")
    elif isinstance(x, list):
        for v in x:
            out |= _key_paths(v, path + "[]")
    return out


# Triton 2.51's /v2/models/<ensemble>/config for the same ensemble (every key, at any depth);
# Trireme has one more, ensemble_scheduling.max_inflight_requests (Triton main's proto)
TRITON_CONFIG_KEYS = {
    ".backend", ".batch_input", ".batch_output", ".cc_model_filenames", ".default_model_filename",
    ".ensemble_scheduling", ".ensemble_scheduling.step", ".ensemble_scheduling.step[].input_map",
    ".ensemble_scheduling.step[].input_map.X", ".ensemble_scheduling.step[].input_map.Y",
    ".ensemble_scheduling.step[].model_name", ".ensemble_scheduling.step[].model_namespace",
    ".ensemble_scheduling.step[].model_version", ".ensemble_scheduling.step[].output_map",
    ".ensemble_scheduling.step[].output_map.Z", ".input", ".input[].allow_ragged_batch",
    ".input[].data_type", ".input[].dims", ".input[].format", ".input[].is_non_linear_format_io",
    ".input[].is_shape_tensor", ".input[].name", ".input[].optional", ".instance_group",
    ".max_batch_size", ".metric_tags", ".model_transaction_policy",
    ".model_transaction_policy.decoupled", ".model_warmup", ".name", ".output",
    ".output[].data_type", ".output[].dims", ".output[].is_non_linear_format_io",
    ".output[].is_shape_tensor", ".output[].label_filename", ".output[].name", ".parameters",
    ".platform", ".runtime", ".version_policy", ".version_policy.latest",
    ".version_policy.latest.num_versions"}


def test_ensemble_config_has_tritons_keys(server):
    config = httpclient.InferenceServerClient(server.http_url).get_model_config("opt_chain")
    assert _key_paths(config) == TRITON_CONFIG_KEYS | {".ensemble_scheduling.max_inflight_requests"}
    assert config["input"][1]["optional"] is True
