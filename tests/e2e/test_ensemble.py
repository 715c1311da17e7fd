"""Ensembles end to end: ONNX and Python steps, a chain and an ensemble of an ensemble,
tensors above the inline threshold between steps, a failing step, load failures that end
UNAVAILABLE (never LOADING), composing models loaded with the ensemble in explicit mode,
statistics for the ensemble and its steps."""
from __future__ import annotations

import queue

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

A = np.arange(4, dtype=np.float32).reshape(1, 4)
B = np.ones((1, 4), dtype=np.float32)


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
            "chain", "py_chain", "nested", "big", "failing", "missing_step", "bad_map", "streamed"},
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
