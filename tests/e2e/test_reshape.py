"""Config `reshape` end to end with the official clients: clients send and receive `dims`,
the model sees `reshape.shape` (the batch dimension in front of both when the model batches).
The worker does it once for every backend; here ONNX Runtime (a scalar per item, a flattened
matrix, variable dimensions, batched and not, dynamic batching), a Python model and a
TorchScript model. Served results are compared with the framework run in this process on the
reshaped input; a model whose reshape does not fit its dims fails to load with Triton's text.
"""
from __future__ import annotations

import concurrent.futures as cf
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import start_server, wait_models

ONE = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
ORT_ONE_THREAD = 'parameters { key: "intra_op_thread_count" value { string_value: "1" } }\n'


def io(kind: str, name: str, dims: str, reshape: str | None, dtype: str = "TYPE_FP32") -> str:
    r = f" reshape {{ shape: [{reshape}] }}" if reshape is not None else ""
    return f'{kind} [{{ name: "{name}" data_type: {dtype} dims: [{dims}]{r} }}]\n'


PY_MODEL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """OUT = IN reversed in the layout the model sees ([batch, 6]); SEEN = that shape.
        A negative first element makes OUT one element short."""

        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                out = x[:, ::-1] if x[0, 0] >= 0 else x[:, 1:]
                seen = np.array([x.shape] * x.shape[0], dtype=np.int64)
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.ascontiguousarray(out)),
                    pb_utils.Tensor("SEEN", seen)]))
            return responses
''')

GOOD = ("scalar", "scalar_auto", "flat", "flat_batched", "flat_nobatch", "variable", "python",
        "torch")
BROKEN = ("bad_reshape",)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reshape") / "models"
    # A scalar per batch item in the file ([-1]); clients send [batch, 1] (Triton's case).
    models.scale(root / "scalar", ["batch"])
    models.write_config(root / "scalar", (
        f"max_batch_size: 8\n{ONE}{ORT_ONE_THREAD}" + io("input", "INPUT0", "1", "") +
        io("output", "OUTPUT0", "1", "")))
    models.scale(root / "scalar_auto", ["batch"])          # auto-complete writes the reshape
    models.write_config(root / "scalar_auto", f"{ONE}{ORT_ONE_THREAD}")
    for name, extra in (("flat", ""), ("flat_batched", (
            "dynamic_batching { preferred_batch_size: [4] max_queue_delay_microseconds: "
            "5000000 }\n"))):
        models.affine(root / name, ["batch", 16], 16)
        models.write_config(root / name, (
            f"max_batch_size: 4\n{ONE}{ORT_ONE_THREAD}{extra}" +
            io("input", "INPUT0", "4,4", "16") + io("output", "OUTPUT0", "2,8", "16")))
    models.affine(root / "flat_nobatch", [16], 16)
    models.write_config(root / "flat_nobatch", (
        f"max_batch_size: 0\n{ONE}{ORT_ONE_THREAD}" +
        io("input", "INPUT0", "4,4", "16") + io("output", "OUTPUT0", "8,2", "16")))
    models.scale(root / "variable", ["batch", "n", 4])
    models.write_config(root / "variable", (
        f"max_batch_size: 4\n{ONE}{ORT_ONE_THREAD}" +
        io("input", "INPUT0", "-1,2,2", "-1,4") + io("output", "OUTPUT0", "-1,2,2", "-1,4")))
    (root / "python" / "1").mkdir(parents=True)
    (root / "python" / "1" / "model.py").write_text(PY_MODEL)
    models.write_config(root / "python", (
        f'backend: "python"\nmax_batch_size: 4\n{ONE}' + io("input", "IN", "2,3", "6") +
        io("output", "OUT", "3,2", "6") + io("output", "SEEN", "2", None, "TYPE_INT64")))
    _torch_model(root / "torch")
    models.affine(root / "bad_reshape", ["batch", 16], 16)
    models.write_config(root / "bad_reshape", (
        f"max_batch_size: 4\n{ONE}" + io("input", "INPUT0", "4,4", "15") +
        io("output", "OUTPUT0", "16", None)))
    return root


def _torch_model(model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from tests import models_torch

    class Flip(torch.nn.Module):   # exact, and the layout shows: it flips the last dimension
        def forward(self, x):
            return x.flip(-1) * 2 + 1

    models_torch.save_script(Flip(), model_dir)
    models.write_config(model_dir, (
        f'backend: "pytorch"\nmax_batch_size: 4\n{ONE}' +
        io("input", "INPUT__0", "4,4", "16") + io("output", "OUTPUT__0", "2,8", "16")))


@pytest.fixture(scope="module")
def server(repo):
    with start_server(repo, "--exit-on-error", "false", ready=False) as srv:
        wait_models(srv, GOOD, BROKEN, "reshape models to load or fail")
        yield srv


@pytest.fixture
def http(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield c
    c.close()


def infer(client_mod, url: str, model: str, arr: np.ndarray, name: str = "INPUT0",
          datatype: str = "FP32"):
    c = client_mod.InferenceServerClient(url)
    try:
        inp = client_mod.InferInput(name, list(arr.shape), datatype)
        inp.set_data_from_numpy(arr)
        return c.infer(model, [inp])
    finally:
        c.close()


def ort_run(repo: Path, model: str, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(repo / model / "1" / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    return sess.run(["OUTPUT0"], {"INPUT0": x})[0]


@pytest.mark.parametrize("model", ["scalar", "scalar_auto"])
@pytest.mark.parametrize("client_mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_scalar_per_item(server, repo, model, client_mod):
    url = server.http_url if client_mod is httpclient else server.grpc_url
    x = np.array([[1.5], [-2.0], [4.25]], np.float32)           # [batch 3, 1]
    res = infer(client_mod, url, model, x)
    out = res.as_numpy("OUTPUT0")
    assert out.shape == (3, 1)
    np.testing.assert_array_equal(out, ort_run(repo, model, x.reshape(3)).reshape(3, 1))


def test_auto_complete_writes_dims_1_and_an_empty_reshape(http):
    cfg = http.get_model_config("scalar_auto")
    for t in (*cfg["input"], *cfg["output"]):
        assert (t["dims"], t["reshape"]) == ([1], {"shape": []})
    meta = http.get_model_metadata("scalar_auto")
    assert [t["shape"] for t in (*meta["inputs"], *meta["outputs"])] == [[-1, 1], [-1, 1]]


def test_a_users_reshape_is_kept(http):
    cfg = http.get_model_config("flat")
    assert (cfg["input"][0]["dims"], cfg["input"][0]["reshape"]) == ([4, 4], {"shape": [16]})
    assert (cfg["output"][0]["dims"], cfg["output"][0]["reshape"]) == ([2, 8], {"shape": [16]})
    meta = http.get_model_metadata("flat")
    assert meta["inputs"][0]["shape"] == [-1, 4, 4] and meta["outputs"][0]["shape"] == [-1, 2, 8]


@pytest.mark.parametrize("client_mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_dims_4x4_reshape_16_batched(server, repo, client_mod):
    url = server.http_url if client_mod is httpclient else server.grpc_url
    x = np.random.default_rng(1).standard_normal((2, 4, 4)).astype(np.float32)
    out = infer(client_mod, url, "flat", x).as_numpy("OUTPUT0")
    assert out.shape == (2, 2, 8)
    np.testing.assert_array_equal(out, ort_run(repo, "flat", x.reshape(2, 16)).reshape(2, 2, 8))


def test_dims_4x4_reshape_16_without_batching(server, repo):
    x = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    out = infer(httpclient, server.http_url, "flat_nobatch", x).as_numpy("OUTPUT0")
    assert out.shape == (8, 2)
    np.testing.assert_array_equal(out, ort_run(repo, "flat_nobatch", x.reshape(16)).reshape(8, 2))


def test_client_shape_is_checked_against_dims_not_reshape(server):
    x = np.zeros((1, 16), np.float32)
    with pytest.raises(InferenceServerException) as ei:
        infer(httpclient, server.http_url, "flat", x)
    assert "unexpected shape for input 'INPUT0' for model 'flat'. Expected [-1,4,4], got [1,16]" \
        in ei.value.message()


def test_variable_dimensions(server, repo):
    for n in (1, 3):
        x = np.arange(2 * n * 4, dtype=np.float32).reshape(2, n, 2, 2)
        out = infer(httpclient, server.http_url, "variable", x).as_numpy("OUTPUT0")
        assert out.shape == (2, n, 2, 2)
        np.testing.assert_array_equal(
            out, ort_run(repo, "variable", x.reshape(2, n, 4)).reshape(2, n, 2, 2))


def test_dynamic_batching_through_a_reshaped_input(server, repo, http):
    # preferred_batch_size 4 with a 5 s delay: four requests in flight run as one batch.
    xs = [np.random.default_rng(10 + i).standard_normal((1, 4, 4)).astype(np.float32)
          for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: infer(httpclient, server.http_url, "flat_batched", x)
                             .as_numpy("OUTPUT0"), xs))
    want = ort_run(repo, "flat_batched", np.concatenate(xs).reshape(4, 16)).reshape(4, 1, 2, 8)
    for out, w in zip(outs, want):
        np.testing.assert_array_equal(out, w)
    st = http.get_inference_statistics("flat_batched")["model_stats"][0]
    assert [b["batch_size"] for b in st["batch_stats"]] == [4]
    assert int(st["execution_count"]) == 1


def test_python_model_sees_the_reshape(server):
    x = np.arange(2 * 6, dtype=np.float32).reshape(2, 2, 3)
    res = infer(grpcclient, server.grpc_url, "python", x, "IN")
    assert res.as_numpy("SEEN").tolist() == [[2, 6], [2, 6]]
    np.testing.assert_array_equal(res.as_numpy("OUT"), x.reshape(2, 6)[:, ::-1].reshape(2, 3, 2))


def test_python_output_that_does_not_fit_its_reshape_fails_its_request(server):
    x = -np.ones((1, 2, 3), np.float32)
    with pytest.raises(InferenceServerException) as ei:
        infer(httpclient, server.http_url, "python", x, "IN")
    assert "output 'OUT' of model 'python' has shape [1,5], which does not fit its reshape " \
           "[6] (dims [3,2])" in ei.value.message()
    ok = infer(httpclient, server.http_url, "python", np.ones((1, 2, 3), np.float32), "IN")
    assert ok.as_numpy("OUT").shape == (1, 3, 2)


def test_torchscript_model_sees_the_reshape(server, repo):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(3).standard_normal((3, 4, 4)).astype(np.float32)
    out = infer(httpclient, server.http_url, "torch", x, "INPUT__0").as_numpy("OUTPUT__0")
    module = torch.jit.load(str(repo / "torch" / "1" / "model.pt")).eval()
    with torch.inference_mode():
        want = module(torch.from_numpy(x.reshape(3, 16))).numpy().reshape(3, 2, 8)
    assert out.shape == (3, 2, 8)
    np.testing.assert_array_equal(out, want)


def test_a_reshape_that_does_not_fit_fails_the_load(http):
    idx = {e["name"]: e for e in http.get_model_repository_index()}
    assert idx["bad_reshape"]["state"] == "UNAVAILABLE"
    assert idx["bad_reshape"]["reason"] == \
        "model input 'INPUT0' has different size for dims and reshape for bad_reshape"
