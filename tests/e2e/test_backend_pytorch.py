"""The PyTorch backend: TorchScript models bound and run as Triton's pytorch_backend does,
exported programs (model.pt2) with auto-complete, and Triton's load and execution errors.

One server serves the end-to-end tests. It runs with TRITONSERVER_DELAY_SCHEDULER=4, which
holds only the dynamic batchers (add_sub, exported) until four requests are queued, once:
each of those two models is used by one test that sends four requests at a time. Load-time
checks run the backend in this process, where each case costs a function call, not a worker.
"""
from __future__ import annotations

import concurrent.futures as cf

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the pytorch backend needs torch (trireme[torch])")

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

from services.common import config as cfgmod  # noqa: E402
from services.common.errors import Code, TriremeError  # noqa: E402
from services.common.messages import LoadModel  # noqa: E402
from services.workers.backends.pytorch import PyTorchBackend  # noqa: E402
from tests import models_torch as mt  # noqa: E402
from tests.conftest import start_server, wait_models  # noqa: E402
from tests.models import write_config  # noqa: E402

# Warnings the backend's worker does not show: TorchScript's deprecation, and the read-only
# input warning that its module filters (pytest resets filters).
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning")]
io = mt.io
ONE_THREAD = 'parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "1" } }\n'
ADD_SUB_IO = "".join(io(kind, f"{kind.upper()}__{i}", "TYPE_FP32", "[16]")
                     for kind in ("input", "output") for i in (0, 1))
DTYPES_IO = "input [{}]\noutput [{}]\n".format(*(", ".join(
    f'{{ name: "{kind}__{i}", data_type: {t}, dims: [3] }}' for i, (t, _) in enumerate(mt.DTYPES))
    for kind in ("INPUT", "OUTPUT")))
GOOD = ("add_sub", "named", "dtypes", "checked", "in_place", "exported")
BIG = 65536   # FP32 elements: 256 KiB, above the inline threshold, so inputs go by shared memory


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch") / "models"
    mt.save_script(mt.AddSub(), root / "add_sub")
    write_config(root / "add_sub",
                 f"max_batch_size: 8\ndynamic_batching {{ }}\n{ONE_THREAD}{ADD_SUB_IO}")
    # forward(self, x, y) with the config listing y first: bound by name, not by order
    mt.save_script(mt.Named(), root / "named")
    write_config(root / "named", "max_batch_size: 4\n" + io("input", "y", "TYPE_FP32", "[3]")
                 + io("input", "x", "TYPE_FP32", "[3]") + io("output", "out", "TYPE_FP32", "[3]"))
    mt.save_script(mt.Dtypes(), root / "dtypes")
    write_config(root / "dtypes", f"max_batch_size: 0\n{DTYPES_IO}")
    mt.save_script(mt.Checked(), root / "checked")
    write_config(root / "checked", "max_batch_size: 0\n" + io("input", "INPUT__0", "TYPE_FP32", "[4]")
                 + io("output", "OUTPUT__0", "TYPE_FP32", "[4]"))
    mt.save_script(mt.InPlace(), root / "in_place")
    write_config(root / "in_place", "max_batch_size: 0\n" + io("input", "INPUT__0", "TYPE_FP32", f"[{BIG}]")
                 + io("output", "OUTPUT__0", "TYPE_FP32", f"[{BIG}]"))
    mt.save_exported(root / "exported")          # no config: completed from the signature
    mt.corrupt(root / "corrupt")
    write_config(root / "corrupt", f"max_batch_size: 8\n{ADD_SUB_IO}")
    return root


@pytest.fixture(scope="module")
def server(repo):
    # Strict readiness: the corrupt model keeps /v2/health/ready false, so wait for live
    # and then for every model to settle.
    with start_server(repo, "--exit-on-error", "false", ready=False,
                      env={"TRITONSERVER_DELAY_SCHEDULER": "4"}) as srv:
        wait_models(srv, GOOD, ["corrupt"], "the pytorch models to load or fail", 60)
        yield srv


@pytest.fixture(scope="module")
def http(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield c
    c.close()


def infer(url: str, model: str, arrays: dict[str, np.ndarray], outputs=None, mod=httpclient):
    """One request on its own connection (tests send several at once)."""
    c = mod.InferenceServerClient(url)
    try:
        ins = []
        for name, a in arrays.items():
            ins.append(mod.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype)))
            ins[-1].set_data_from_numpy(a)
        outs = [mod.InferRequestedOutput(n) for n in outputs] if outputs else None
        return c.infer(model, ins, outputs=outs)
    finally:
        c.close()


def run_file(repo, model: str, *arrays):
    """The served model file, run by torch in this process."""
    module = torch.jit.load(str(repo / model / "1" / "model.pt"))
    with torch.no_grad():
        return module(*(torch.from_numpy(a) for a in arrays))


def batch_counts(url: str, model: str) -> dict[int, int]:
    c = httpclient.InferenceServerClient(url)
    st = c.get_inference_statistics(model)["model_stats"][0]
    c.close()
    return {b["batch_size"]: int(b["compute_infer"]["count"]) for b in st["batch_stats"]}


# ------------------------------------------------------------------------- end to end
def test_add_sub_dynamic_batch(server, repo):
    """INPUT__i/OUTPUT__i bind by index; requests of 1+2+1+3 rows run as one batch of 7,
    one of them over gRPC asking for OUTPUT__1 only."""
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((n, 16), np.float32), rng.standard_normal((n, 16), np.float32))
            for n in (1, 2, 1, 3)]

    def one(i):
        a, b = data[i]
        if i == 3:
            return infer(server.grpc_url, "add_sub", {"INPUT__0": a, "INPUT__1": b}, ["OUTPUT__1"],
                         mod=grpcclient)
        return infer(server.http_url, "add_sub", {"INPUT__0": a, "INPUT__1": b})
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for i, ((a, b), r) in enumerate(zip(data, results)):
        want_sum, want_diff = run_file(repo, "add_sub", a, b)
        if i == 3:
            assert r.as_numpy("OUTPUT__0") is None
        else:
            np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), want_sum.numpy())
        np.testing.assert_array_equal(r.as_numpy("OUTPUT__1"), want_diff.numpy())
    assert batch_counts(server.http_url, "add_sub") == {7: 1}


def test_inputs_bind_by_forward_argument_name(server, repo):
    x, y = np.array([[1, 2, 3]], np.float32), np.array([[10, 20, 30]], np.float32)
    out = infer(server.grpc_url, "named", {"x": x, "y": y}, mod=grpcclient).as_numpy("out")
    np.testing.assert_array_equal(out, run_file(repo, "named", x, y).numpy())
    np.testing.assert_array_equal(out, [[-8, -16, -24]])     # 2x - y, not 2y - x


def _np(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def test_dtypes(server, repo):
    inputs = [torch.tensor([True, False, True]) if dtype == torch.bool else
              torch.tensor([1.5, -2, 7]).to(dtype) for _, dtype in mt.DTYPES]
    r = infer(server.http_url, "dtypes", {f"INPUT__{i}": _np(t) for i, t in enumerate(inputs)})
    want = torch.jit.load(str(repo / "dtypes" / "1" / "model.pt"))(*inputs)
    for i, w in enumerate(want):
        got = r.as_numpy(f"OUTPUT__{i}")
        assert got.dtype == _np(w).dtype, (i, got.dtype, w.dtype)
        np.testing.assert_array_equal(got, _np(w))


def test_execution_error_fails_that_request_only(server, repo):
    with pytest.raises(InferenceServerException) as ei:
        infer(server.http_url, "checked", {"INPUT__0": np.array([4, -1, 9, 16], np.float32)})
    assert ei.value.status() == "500"
    assert ei.value.message().startswith("PyTorch execute failure: ")
    assert "INPUT__0 must be non-negative" in ei.value.message()
    x = np.array([4, 1, 9, 16], np.float32)
    out = infer(server.http_url, "checked", {"INPUT__0": x}).as_numpy("OUTPUT__0")
    np.testing.assert_array_equal(out, run_file(repo, "checked", x).numpy())


def test_model_that_writes_its_input_never_writes_shared_memory(server, repo):
    """The worker maps the frontend's memory read-only: writing there would kill it."""
    x = np.arange(BIG, dtype=np.float32)
    for _ in range(2):   # the worker is still there for the second request
        out = infer(server.http_url, "in_place", {"INPUT__0": x}).as_numpy("OUTPUT__0")
        np.testing.assert_array_equal(out, run_file(repo, "in_place", x.copy()).numpy())


def test_exported_program_autocompletes_and_batches(server, http, repo):
    cfg = http.get_model_config("exported")
    assert cfg["platform"] == "torch_aoti" and cfg["backend"] == "pytorch"
    assert cfg["default_model_filename"] == "model.pt2"
    assert cfg["max_batch_size"] == 4 and cfg["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == \
        [("x", "TYPE_FP32", [16]), ("y", "TYPE_FP32", [16])]
    assert [(o["name"], o["data_type"]) for o in cfg["output"]] == \
        [("OUTPUT__0", "TYPE_FP32"), ("OUTPUT__1", "TYPE_FP32")]
    data = [(np.full((1, 16), i, np.float32), np.arange(16, dtype=np.float32)[None]) for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda xy: infer(server.http_url, "exported", {"x": xy[0], "y": xy[1]}),
                                data))
    module = torch.export.load(str(repo / "exported" / "1" / "model.pt2")).module()
    for (x, y), r in zip(data, results):
        want = module(torch.from_numpy(x), torch.from_numpy(y))
        np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), want[0].detach().numpy())
        np.testing.assert_array_equal(r.as_numpy("OUTPUT__1"), want[1].detach().numpy())
    assert batch_counts(server.http_url, "exported") == {4: 1}


def test_corrupt_model_is_unavailable_beside_good_ones(http):
    idx = {e["name"]: e for e in http.get_model_repository_index()}
    assert idx["corrupt"]["state"] == "UNAVAILABLE"
    assert idx["corrupt"]["reason"].startswith("failed to load model 'corrupt': ")
    assert "zip archive" in idx["corrupt"]["reason"]
    assert not http.is_model_ready("corrupt")
    assert all(idx[name]["state"] == "READY" for name in GOOD)


# ------------------------------------------------------------------------- in process
def backend(tmp_path, make, config: str, *, name="m", kind="KIND_CPU") -> PyTorchBackend:
    """The backend for the model `make(model_dir)` writes, configured the way the scheduler
    hands it to a worker."""
    d = tmp_path / name
    make(d)
    write_config(d, config)
    cfg = cfgmod.autocomplete(cfgmod.parse_pbtxt(config), d, name, has_gpu=kind == "KIND_GPU")
    return PyTorchBackend(cfg, LoadModel(name, 1, str(d), b"", f"{name}_0", kind=kind))


def script(module):
    return lambda model_dir: mt.save_script(module, model_dir)


@pytest.mark.parametrize("make,config,error", [
    (script(mt.AddSub()), "",
     "unable to load model 'm', configuration expects 0 inputs, model provides 2"),
    (script(mt.AddSub()), ADD_SUB_IO + io("input", "INPUT__2", "TYPE_FP32", "[16]"),
     "unable to load model 'm', configuration expects 3 inputs, model provides 2"),
    (script(mt.AddSub()), ADD_SUB_IO.replace("INPUT__1", "INPUT__5"),
     "unable to load model 'm', input 'INPUT__5' refers to argument 5 of forward(), which takes "
     "2 inputs"),
    (script(mt.AddSub()), ADD_SUB_IO.replace("TYPE_FP32", "TYPE_UINT32", 1),
     "unsupported datatype TYPE_UINT32 for input 'INPUT__0' for model 'm'"),
    (script(mt.AddSub()), ADD_SUB_IO.replace("TYPE_FP32", "TYPE_UINT64").replace(
        "TYPE_UINT64", "TYPE_FP32", 3),
     "unsupported datatype TYPE_UINT64 for output 'OUTPUT__1' for model 'm'"),
    (script(mt.AddSub()), ADD_SUB_IO.split("output")[0],
     "model configuration must contain at least one output, none were specified."),
    (script(mt.Upper()), "max_batch_size: 4\n" + io("input", "WORDS", "TYPE_STRING", "[-1]")
     + io("output", "UPPER", "TYPE_STRING", "[-1]"),
     "Triton only supports 1 dimensional List of String as input for 'WORDS' for model 'm'"),
    (script(mt.IntArg()), io("input", "x", "TYPE_FP32", "[2]")
     + io("input", "n", "TYPE_INT64", "[1]") + io("output", "y", "TYPE_FP32", "[2]"),
     "An input of type 'int' was detected in the model. Only a single input of type "
     "Dict(str, Tensor) or input(s) of type Tensor are supported."),
    (script(mt.AddSub()),
     ADD_SUB_IO + 'parameters { key: "INFERENCE_MODE" value { string_value: "maybe" } }',
     "failed to convert 'maybe' to boolean"),
    (mt.save_exported, io("input", "x", "TYPE_INT32", "[16]") + io("input", "y", "TYPE_FP32", "[16]"),
     "unable to load model 'm', configuration expects datatype TYPE_INT32 for input 'x', model "
     "provides TYPE_FP32"),
    (mt.aoti_lookalike, "", "failed to load model 'm': it is an AOTInductor package, which this "
     "backend does not run yet; save the program with torch.export.save instead"),
], ids=["no-config", "count", "index", "input-type", "output-type", "no-output", "string-dims",
        "int-arg", "bool-param", "exported-type", "aoti-package"])
def test_load_errors(tmp_path, make, config, error):
    with pytest.raises(TriremeError) as ei:
        backend(tmp_path, make, config)
    assert ei.value.code == Code.INVALID_ARG
    assert ei.value.message == error


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_kind_gpu_without_cuda_is_unavailable(tmp_path):
    with pytest.raises(TriremeError) as ei:
        backend(tmp_path, script(mt.AddSub()), ADD_SUB_IO + "instance_group [{ kind: KIND_GPU }]",
                kind="KIND_GPU")
    assert ei.value.code == Code.UNAVAILABLE
    assert ei.value.message.startswith("model 'm' asks for KIND_GPU but PyTorch cannot use CUDA")


def test_read_only_inputs_are_not_copied_unless_the_model_writes_them(tmp_path):
    x = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), np.float32)   # read-only
    cfg = io("input", "INPUT__0", "TYPE_FP32", "[4]") + io("output", "OUTPUT__0", "TYPE_FP32", "[4]")
    b = backend(tmp_path, script(mt.Identity()), cfg, name="identity")
    out = b.execute({"INPUT__0": x}, ["OUTPUT__0"])
    assert np.shares_memory(out["OUTPUT__0"], x)
    b = backend(tmp_path, script(mt.InPlace()), cfg, name="in_place")
    out = b.execute({"INPUT__0": x}, ["OUTPUT__0"])
    np.testing.assert_array_equal(out["OUTPUT__0"], [1, 3, 5, 7])
    np.testing.assert_array_equal(x, [0, 1, 2, 3])


@pytest.mark.parametrize("param,want", [("", [True, False]), ("false", [False, False])])
def test_inference_mode_parameter(tmp_path, param, want):
    cfg = io("input", "INPUT__0", "TYPE_BOOL", "[2]") + io("output", "OUTPUT__0", "TYPE_BOOL", "[2]")
    if param:
        cfg += f'parameters {{ key: "INFERENCE_MODE" value {{ string_value: "{param}" }} }}'
    b = backend(tmp_path, script(mt.Modes()), cfg)
    out = b.execute({"INPUT__0": np.zeros(2, bool)}, ["OUTPUT__0"])
    assert out["OUTPUT__0"].tolist() == want   # [input is an inference tensor, grad enabled]


def test_dict_input_and_list_of_strings(tmp_path):
    b = backend(tmp_path, script(mt.DictInput()),
                'input [{ name: "a", data_type: TYPE_FP32, dims: [2] }, { name: "b", data_type: '
                'TYPE_FP32, dims: [2] }]\n' + io("output", "out", "TYPE_FP32", "[2]"))
    out = b.execute({"a": np.array([1, 2], np.float32), "b": np.array([3, 4], np.float32)},
                    ["out"])
    np.testing.assert_array_equal(out["out"], [3, 8])
    b = backend(tmp_path, script(mt.Upper()), io("input", "WORDS", "TYPE_STRING", "[-1]")
                + io("output", "UPPER", "TYPE_STRING", "[-1]"), name="strings")
    words = np.array([b"trireme", b"oars"], dtype=object)
    assert b.execute({"WORDS": words}, ["UPPER"])["UPPER"].tolist() == [b"TRIREME", b"OARS"]


@pytest.mark.parametrize("outputs,error", [
    (io("output", "OUTPUT__0", "TYPE_FP32", "[2]") + io("output", "OUTPUT__2", "TYPE_FP32", "[2]"),
     "The output OUTPUT__2 in the model configuration refers to an output index which doesn't "
     "exist. This model has 2 outputs"),
    (io("output", "OUTPUT__0", "TYPE_INT32", "[2]"),
     "configuration expects datatype TYPE_INT32 for output 'OUTPUT__0', model provides TYPE_FP32"),
], ids=["missing-index", "dtype"])
def test_output_errors_at_execute(tmp_path, outputs, error):
    cfg = io("input", "INPUT__0", "TYPE_FP32", "[2]") + io("input", "INPUT__1", "TYPE_FP32", "[2]")
    b = backend(tmp_path, script(mt.AddSub()), cfg + outputs)
    with pytest.raises(TriremeError) as ei:
        b.execute({"INPUT__0": np.ones(2, np.float32), "INPUT__1": np.ones(2, np.float32)},
                  ["OUTPUT__0"])
    assert (ei.value.code, ei.value.message) == (Code.INVALID_ARG, error)


@pytest.mark.parametrize("names", [("B", "A"), ("y", "INPUT__0")], ids=["no-convention", "mixed"])
def test_inputs_fall_back_to_config_order(tmp_path, names):
    """Names that are neither all forward() arguments nor all <name>__<index> bind in config
    order (Triton's STRICT_CONFIG_ORDERING): the first config input is x."""
    cfg = "".join(io("input", n, "TYPE_FP32", "[2]") for n in names)
    cfg += io("output", "OUTPUT__1", "TYPE_FP32", "[2]")
    b = backend(tmp_path, script(mt.AddSub()), cfg)
    out = b.execute({names[0]: np.array([5, 6], np.float32), names[1]: np.ones(2, np.float32)},
                    ["OUTPUT__1"])
    np.testing.assert_array_equal(out["OUTPUT__1"], [4, 5])    # x - y
