"""Ragged batching end to end with the official clients (Triton's ragged_batching.md).

Requests whose `allow_ragged_batch` input differs in length run as ONE execution: the model
gets every request's elements as one dimension, plus batch inputs (INDEX: where each request
ends, COUNT: its element count) that the server generates and clients never send. A
BATCH_SCATTER_WITH_INPUT_SHAPE output goes back cut by each request's input shape. The
server runs with TRITONSERVER_DELAY_SCHEDULER=3, so each model's first three requests form
one batch however the client threads race; the statistics show that one batch of three.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server, wait_models, wait_until

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
ONE = ('instance_group [{ kind: KIND_CPU, count: 1 }]\n'
       'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n')
RAGGED_IN = 'input [{ name: "INPUT" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }]\n'
SUM_IO = (RAGGED_IN +
          'batch_input [{ kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" '
          'data_type: TYPE_INT32 source_input: "INPUT" },\n'
          '  { kind: BATCH_ELEMENT_COUNT target_name: "COUNT" data_type: TYPE_FP32 '
          'source_input: "INPUT" }]\n'
          'output [{ name: "SUM" data_type: TYPE_FP32 dims: [1] },\n'
          '  { name: "COUNT_OUT" data_type: TYPE_FP32 dims: [1] }]\n')
GOOD = (["ragged_sum", "ragged_scatter"] + (["ragged_torch"] if HAS_TORCH else [])
        + (["ragged_openvino"] if HAS_OPENVINO else []))
BROKEN = {
    "bad_dtype": "batch input data type must be TYPE_INT32 or TYPE_FP32 for bad_dtype",
    "bad_ragged": "unable to load model 'bad_ragged', configuration expects model provides "
                  "input with shape [-1]  for ragged input 'INPUT0', model provides [-1,-1]",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ragged") / "models"
    models.ragged_sum(root / "ragged_sum")
    models.write_config(root / "ragged_sum", f"max_batch_size: 8\n{ONE}{SUM_IO}dynamic_batching {{ }}\n")
    models.flat_identity(root / "ragged_scatter")
    models.write_config(root / "ragged_scatter", (
        f"max_batch_size: 8\n{ONE}dynamic_batching {{ }}\n"
        'input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }]\n'
        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [-1] }]\n'
        'batch_output [{ target_name: "OUTPUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
        'source_input: "INPUT0" }]\n'))
    if HAS_TORCH:
        _torch_model(root / "ragged_torch")
    if HAS_OPENVINO:
        _openvino_model(root / "ragged_openvino")
    models.ragged_sum(root / "bad_dtype")
    models.write_config(root / "bad_dtype", f"max_batch_size: 8\n{ONE}" +
                        SUM_IO.replace("TYPE_INT32", "TYPE_INT64"))
    models.identity(root / "bad_ragged", "fp32")   # INPUT0 [batch, n]: not one dimension
    models.write_config(root / "bad_ragged", (
        f"max_batch_size: 8\n{ONE}"
        'input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }]\n'
        'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [-1] }]\n'))
    with start_server(root, "--exit-on-error", "false", ready=False,
                      env={"TRITONSERVER_DELAY_SCHEDULER": "3"}) as srv:
        wait_models(srv, GOOD, BROKEN, "ragged models to load or fail")
        yield srv


def _torch_model(model_dir: Path) -> None:
    import torch

    from tests import models_torch

    class SegmentSum(torch.nn.Module):   # the same sums as models.ragged_sum
        def forward(self, x, index):
            prefix = torch.cat([torch.zeros(1, dtype=x.dtype), torch.cumsum(x, 0)])
            ends = index.long()
            starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])
            return (prefix[ends] - prefix[starts]).unsqueeze(1)

    models_torch.save_script(SegmentSum(), model_dir)
    models.write_config(model_dir, (
        'backend: "pytorch"\nmax_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'
        'dynamic_batching { }\n'
        'input [{ name: "INPUT__0" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }]\n'
        'batch_input [{ kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX__1" '
        'data_type: TYPE_INT32 source_input: "INPUT__0" }]\n'
        'output [{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [1] }]\n'))


def _openvino_model(model_dir: Path) -> None:
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([-1], np.float32, name="INPUT")   # the same sums as models.ragged_sum
    index = ops.parameter([-1], np.int32, name="INDEX")
    prefix = ops.concat([ops.constant(np.zeros(1, np.float32)), ops.cumsum(x, np.int64(0))], 0)
    before = ops.slice(index, np.array([0]), np.array([-1]), np.array([1]))
    starts = ops.concat([ops.constant(np.zeros(1, np.int32)), before], 0)
    sums = ops.subtract(ops.gather(prefix, index, np.int64(0)), ops.gather(prefix, starts, np.int64(0)))
    out = ops.unsqueeze(sums, np.int64(1))
    out.output(0).get_tensor().set_names({"SUM"})
    (model_dir / "1").mkdir(parents=True)
    ov.save_model(ov.Model([out.output(0)], [x, index], "ragged"), str(model_dir / "1" / "model.xml"))
    models.write_config(model_dir, (
        'backend: "openvino"\nmax_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n'
        f'dynamic_batching {{ }}\n{RAGGED_IN}'
        'batch_input [{ kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "INDEX" '
        'data_type: TYPE_INT32 source_input: "INPUT" }]\n'
        'output [{ name: "SUM" data_type: TYPE_FP32 dims: [1] }]\n'))


def values(n: int, seed: int) -> np.ndarray:
    """n small integers as FP32 [1, n] (sums of them are exact)."""
    return np.random.default_rng(seed).integers(-50, 50, (1, n)).astype(np.float32)


def infer(client_mod, url: str, model: str, arr: np.ndarray, name: str = "INPUT"):
    c = client_mod.InferenceServerClient(url)
    try:
        inp = client_mod.InferInput(name, list(arr.shape), "FP32")
        inp.set_data_from_numpy(arr)
        return c.infer(model, [inp])
    finally:
        c.close()


def concurrently(fn, *args_list):
    with cf.ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda args: fn(*args), args_list))


def batch_counts(srv, model: str) -> dict[int, int]:
    c = httpclient.InferenceServerClient(srv.http_url)
    try:
        st = c.get_inference_statistics(model)["model_stats"][0]
    finally:
        c.close()
    return {b["batch_size"]: int(b["compute_infer"]["count"]) for b in st.get("batch_stats", [])}


def assert_batches(srv, model: str, want: dict[int, int]) -> None:
    """A batch is counted a moment after its responses leave: wait for it."""
    try:
        wait_until(lambda: batch_counts(srv, model) == want, 10, f"batches {want}")
    except TimeoutError:
        assert batch_counts(srv, model) == want


# ------------------------------------------------------------------------------ tests
def test_three_ragged_requests_run_as_one_batch(server):
    arrays = [values(n, seed) for seed, n in enumerate((3, 4, 5))]
    results = concurrently(infer, *[(httpclient, server.http_url, "ragged_sum", a) for a in arrays])
    for arr, r in zip(arrays, results):
        assert r.as_numpy("SUM").tolist() == [[arr.sum()]]
        assert r.as_numpy("COUNT_OUT").tolist() == [[arr.size]]
    assert_batches(server, "ragged_sum", {3: 1})
    # A request alone runs the same way (its input used in place, flattened)
    arr = values(6, 9)
    r = infer(grpcclient, server.grpc_url, "ragged_sum", arr)
    assert r.as_numpy("SUM").tolist() == [[arr.sum()]]
    assert r.as_numpy("COUNT_OUT").tolist() == [[6.0]]
    assert_batches(server, "ragged_sum", {3: 1, 1: 1})


def test_batch_output_is_scattered_by_each_requests_input_shape(server):
    arrays = [values(n, 10 + n) for n in (2, 3, 4)]
    results = concurrently(infer, *[(grpcclient, server.grpc_url, "ragged_scatter", a, "INPUT0")
                                    for a in arrays])
    for arr, r in zip(arrays, results):
        out = r.as_numpy("OUTPUT0")
        assert out.shape == arr.shape   # [1, n], not the model's [total elements]
        np.testing.assert_array_equal(out, arr * 2)
    assert_batches(server, "ragged_scatter", {3: 1})


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_torchscript_model_takes_ragged_and_batch_inputs(server):
    arrays = [values(n, 20 + n) for n in (5, 1, 3)]
    results = concurrently(infer, *[(httpclient, server.http_url, "ragged_torch", a, "INPUT__0")
                                    for a in arrays])
    for arr, r in zip(arrays, results):
        assert r.as_numpy("OUTPUT__0").tolist() == [[arr.sum()]]
    assert_batches(server, "ragged_torch", {3: 1})


@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino is not installed")
def test_openvino_model_takes_ragged_and_batch_inputs(server):
    arrays = [values(n, 30 + n) for n in (2, 6, 4)]
    results = concurrently(infer, *[(grpcclient, server.grpc_url, "ragged_openvino", a)
                                    for a in arrays])
    for arr, r in zip(arrays, results):
        assert r.as_numpy("SUM").tolist() == [[arr.sum()]]
    assert_batches(server, "ragged_openvino", {3: 1})


@pytest.mark.parametrize("client_mod", [httpclient, grpcclient])
def test_batch_inputs_are_not_client_inputs(server, client_mod):
    url = server.http_url if client_mod is httpclient else server.grpc_url
    c = client_mod.InferenceServerClient(url)
    try:
        meta = c.get_model_metadata("ragged_sum")
        names = [i["name"] for i in meta["inputs"]] if client_mod is httpclient \
            else [i.name for i in meta.inputs]
        assert names == ["INPUT"]   # Triton's metadata lists the config's inputs only
        arr = values(3, 1)
        index = np.array([[3]], np.int32)

        def send(*tensors):
            ins = []
            for name, a, dt in tensors:
                ins.append(client_mod.InferInput(name, list(a.shape), dt))
                ins[-1].set_data_from_numpy(a)
            with pytest.raises(InferenceServerException) as e:
                c.infer("ragged_sum", ins)
            return e.value.message()

        assert send(("INPUT", arr, "FP32"), ("INDEX", index, "INT32")) == (
            "[request id: <id_unknown>] expected 1 inputs but got 2 inputs for model "
            "'ragged_sum'. Got input(s) ['INDEX','INPUT'], but missing required input(s) ]. "
            "Please provide all required input(s).")
        assert send(("INDEX", index, "INT32")) == \
            "unexpected inference input 'INDEX' for model 'ragged_sum'"
    finally:
        c.close()


def test_bad_batch_io_fails_the_load(server):
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        idx = {e["name"]: e for e in c.get_model_repository_index()}
        for name, reason in BROKEN.items():
            assert (idx[name]["state"], idx[name]["reason"]) == ("UNAVAILABLE", reason)
        cfg = c.get_model_config("ragged_sum")   # the config itself is served as written
        assert [b["target_name"] for b in cfg["batch_input"]] == [["INDEX"], ["COUNT"]]
    finally:
        c.close()
