"""One rule for the outputs of a request that names none, whatever the backend: every output
of the model's CONFIG (Triton's InferenceRequest::Normalize), not every output of the model
file. Each model here has more outputs in its file than its config.pbtxt lists.

One server serves the module. It runs with TRITONSERVER_DELAY_SCHEDULER=2, which holds only
the dynamic batcher of `batched` (the one model with one) until two requests are queued,
once: the test that uses it sends two at a time, so they run as one batch. TensorRT cannot
run here (its tests skip without a GPU), so it has no case.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib.util

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests import models
from tests.conftest import start_server

# model -> (framework it needs, input names, the config's one output, an output the file
# has and the config leaves out, rows x width of the inputs, expected output)
CASES = {
    "onnx": (None, ("INPUT0", "INPUT1"), "OUTPUT0", "OUTPUT1", 4, lambda a, b: a + b),
    "torch": ("torch", ("INPUT__0", "INPUT__1"), "OUTPUT__0", "OUTPUT__1", 4,
              lambda a, b: a + b),
    "tf": ("tensorflow", ("INPUT0", "INPUT1"), "OUTPUT1", "OUTPUT0", 16,
           lambda a, b: (a > b).astype(np.int32)),
    "openvino": ("openvino", ("INPUT0", "INPUT1"), "OUTPUT1", "OUTPUT0", 4,
                 lambda a, b: a - b),
}
HAVE = {name: framework is None or importlib.util.find_spec(framework) is not None
        for name, (framework, *_) in CASES.items()}
PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


def _config(backend: str, inputs: tuple[str, ...], outputs: dict[str, str], width: int,
            extra: str = "") -> str:
    io = "".join(f'input [{{ name: "{n}", data_type: TYPE_FP32, dims: [{width}] }}]\n'
                 for n in inputs)
    io += "".join(f'output [{{ name: "{n}", data_type: {t}, dims: [{width}] }}]\n'
                  for n, t in outputs.items())
    return f'backend: "{backend}"\nmax_batch_size: 8\n{extra}{io}'


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("output_rule") / "models"
    models.add_sub(root / "onnx", size=4)
    models.write_config(root / "onnx", _config("onnxruntime", CASES["onnx"][1], {
        "OUTPUT0": "TYPE_FP32"}, 4, _param("intra_op_thread_count", "1")))
    models.sum_diff_prod(root / "batched", size=4)
    models.write_config(root / "batched", _config("onnxruntime", ("A", "B"), {
        "SUM": "TYPE_FP32", "DIFF": "TYPE_FP32"}, 4,
        "dynamic_batching { }\n" + _param("intra_op_thread_count", "1")))
    if HAVE["torch"]:
        from tests import models_torch
        models_torch.save_script(models_torch.AddSub(), root / "torch")
        models.write_config(root / "torch", _config("pytorch", CASES["torch"][1], {
            "OUTPUT__0": "TYPE_FP32"}, 4, _param("INTRA_OP_THREAD_COUNT", "1")))
    if HAVE["tf"]:
        from tests import models_tf
        models_tf.savedmodel(root / "tf")   # serving_default: OUTPUT0 FP32, OUTPUT1 INT32
        models.write_config(root / "tf", _config("tensorflow", CASES["tf"][1], {
            "OUTPUT1": "TYPE_INT32"}, 16, _param("TF_NUM_INTRA_THREADS", "1")))
    if HAVE["openvino"]:
        from tests import models_openvino
        models_openvino.add_sub(root / "openvino", size=4)
        models.write_config(root / "openvino", _config("openvino", CASES["openvino"][1], {
            "OUTPUT1": "TYPE_FP32"}, 4, _param("INFERENCE_NUM_THREADS", "1")))
    return root


@pytest.fixture(scope="module")
def server(repo):
    # Strict readiness (the default): ready once every model of the repository loaded.
    with start_server(repo, env={"TRITONSERVER_DELAY_SCHEDULER": "2"}) as srv:
        yield srv


def _inputs(names: tuple[str, ...], width: int, seed: int) -> dict[str, np.ndarray]:
    """Small whole numbers: every backend computes them exactly (OpenVINO's CPU plugin may
    run FP32 models in BF16)."""
    rng = np.random.default_rng(seed)
    return {n: rng.integers(-8, 8, (2, width)).astype(np.float32) for n in names}


def infer(srv, protocol: str, model: str, arrays: dict[str, np.ndarray], outputs=None):
    """One request on its own connection: (output names of the response, the result)."""
    mod = PROTOCOLS[protocol]
    c = mod.InferenceServerClient(srv.http_url if protocol == "http" else srv.grpc_url)
    try:
        ins = []
        for name, a in arrays.items():
            ins.append(mod.InferInput(name, list(a.shape), "FP32"))
            ins[-1].set_data_from_numpy(a)
        outs = [mod.InferRequestedOutput(n) for n in outputs] if outputs is not None else None
        r = c.infer(model, ins, outputs=outs)
    finally:
        c.close()
    response = r.get_response()
    names = [o["name"] for o in response["outputs"]] if protocol == "http" \
        else [o.name for o in response.outputs]
    return names, r


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", CASES)
def test_no_output_named_means_the_configs(server, model, protocol):
    if not HAVE[model]:
        pytest.skip(f"needs {CASES[model][0]}")
    _, inputs, output, _, width, expected = CASES[model]
    arrays = _inputs(inputs, width, seed=len(model))
    names, r = infer(server, protocol, model, arrays)
    assert names == [output]   # not the file's other output
    want = expected(*arrays.values())
    got = r.as_numpy(output)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("model", CASES)
def test_the_configs_output_by_name(server, model, protocol):
    if not HAVE[model]:
        pytest.skip(f"needs {CASES[model][0]}")
    _, inputs, output, _, width, expected = CASES[model]
    arrays = _inputs(inputs, width, seed=len(model) + 1)
    names, r = infer(server, protocol, model, arrays, [output])
    assert names == [output]
    np.testing.assert_array_equal(r.as_numpy(output), expected(*arrays.values()))


def test_one_batch_with_and_without_outputs_named(server):
    """Two requests in one execution: the one that names none gets the config's SUM and
    DIFF (not the file's PROD), the one that names DIFF gets DIFF only."""
    arrays = _inputs(("A", "B"), 4, seed=7)
    a, b = arrays["A"][:1], arrays["B"][:1]   # one row each: the batch has 2
    with cf.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(infer, server, "http", "batched", {"A": a, "B": b})
        named = pool.submit(infer, server, "grpc", "batched", {"A": b, "B": a}, ["DIFF"])
        (plain_names, plain_r), (named_names, named_r) = plain.result(), named.result()
    assert sorted(plain_names) == ["DIFF", "SUM"]
    np.testing.assert_array_equal(plain_r.as_numpy("SUM"), a + b)
    np.testing.assert_array_equal(plain_r.as_numpy("DIFF"), a - b)
    assert named_names == ["DIFF"]
    np.testing.assert_array_equal(named_r.as_numpy("DIFF"), b - a)
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        stats = c.get_inference_statistics("batched")["model_stats"][0]["batch_stats"]
    finally:
        c.close()
    assert {s["batch_size"]: int(s["compute_infer"]["count"]) for s in stats} == {2: 1}
