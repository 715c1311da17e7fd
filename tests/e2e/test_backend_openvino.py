"""The OpenVINO backend end to end: IR models built at test time, served by one server
(TRITONSERVER_DELAY_SCHEDULER=4: a dynamic-batching model holds its first requests until four
are queued, so the first use of each is a burst of four that runs as one batch).

Served results are compared with the same model file compiled in this process. A few load
rules that the server cannot reach on this machine (KIND_GPU needs a GPU before a worker
is started) or that need auto-complete off are checked on the backend object directly.
"""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino",
                    reason='OpenVINO is not installed (pip install "trireme[openvino]")')

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.common.config import autocomplete, parse_pbtxt
from services.common.errors import Code, TriremeError
from services.workers.backends.openvino import OpenVINOBackend
from tests import models
from tests import models_openvino as mo
from tests.conftest import start_server, wait_models

ONE_THREAD = 'parameters { key: "INFERENCE_NUM_THREADS" value { string_value: "1" } }\n'
GOOD = ("add_sub", "mlp", "types", "padded", "fixed", "strings")
BROKEN = ("broken", "mismatch", "bad_param")
WIDTH = 32


def static_batch(extra: str) -> str:
    """max_batch_size 4 with IO given, so auto-complete adds no dynamic batching: a request
    runs as the batch it is."""
    return ('backend: "openvino"\nmax_batch_size: 4\n' + ONE_THREAD + extra +
            'parameters { key: "SKIP_OV_DYNAMIC_BATCHSIZE" value { string_value: "YES" } }\n'
            f'input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [{WIDTH}] }}]\n'
            f'output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [{WIDTH}] }}]\n')


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("openvino") / "models"
    mo.add_sub(root / "add_sub")                  # no config.pbtxt: auto-complete
    mo.types(root / "types")                      # no config.pbtxt, no batch dimension
    mo.strings(root / "strings")                  # no config.pbtxt, string tensors
    mo.mlp(root / "mlp", WIDTH)                   # static batch 1 in the file
    models.write_config(root / "mlp", (
        'backend: "openvino"\nmax_batch_size: 8\ndynamic_batching { }\n' + ONE_THREAD +
        'parameters { key: "NUM_STREAMS" value { string_value: "1" } }\n'
        'parameters { key: "PERFORMANCE_HINT" value { string_value: "latency" } }\n'
        f'input [{{ name: "INPUT0", data_type: TYPE_FP32, dims: [{WIDTH}] }}]\n'
        f'output [{{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [{WIDTH}] }}]\n'))
    padding = 'parameters { key: "ENABLE_BATCH_PADDING" value { string_value: "yes" } }\n'
    for name, extra in (("padded", padding), ("fixed", "")):
        mo.mlp(root / name, WIDTH)
        models.write_config(root / name, static_batch(extra))
    mo.broken(root / "broken")
    mo.add_sub(root / "mismatch")
    models.write_config(root / "mismatch", 'max_batch_size: 8\n'
                        'input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [8] }]\n')
    mo.add_sub(root / "bad_param")
    models.write_config(root / "bad_param",
                        'parameters { key: "NUM_STREAMS" value { string_value: "Many" } }\n')
    return root


@pytest.fixture(scope="module")
def server(repo):
    # Broken models keep strict readiness false: wait for live, then for every model.
    with start_server(repo, "--exit-on-error", "false", ready=False,
                      env={"TRITONSERVER_DELAY_SCHEDULER": "4"}) as srv:
        wait_models(srv, GOOD, BROKEN, "models to load", 60)
        yield srv


@pytest.fixture(scope="module")
def http(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield c
    c.close()


def infer(srv, model: str, inputs: dict[str, np.ndarray],
          protocol=httpclient) -> dict[str, np.ndarray]:
    c = protocol.InferenceServerClient(srv.http_url if protocol is httpclient else srv.grpc_url)
    try:
        ins = []
        for name, arr in inputs.items():
            ins.append(protocol.InferInput(name, list(arr.shape), _datatype(arr)))
            ins[-1].set_data_from_numpy(arr)
        res = c.infer(model, ins)
        names = [o["name"] for o in (res.get_response()["outputs"] if protocol is httpclient
                                     else res.get_response(as_json=True)["outputs"])]
        return {n: res.as_numpy(n) for n in names}
    finally:
        c.close()


def _datatype(arr: np.ndarray) -> str:
    return {"float32": "FP32", "float16": "FP16", "int64": "INT64", "bool": "BOOL",
            "object": "BYTES"}[arr.dtype.name]


def burst(srv, model: str, batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Send the requests at once (the delay hook releases them together as one batch)."""
    with cf.ThreadPoolExecutor(len(batches)) as pool:
        return list(pool.map(lambda b: infer(srv, model, b), batches))


def batch_counts(http, model: str) -> dict[int, int]:
    st = http.get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"]: int(b["compute_infer"]["count"]) for b in st.get("batch_stats", [])}


def per_row(path: Path, x: np.ndarray) -> np.ndarray:
    """The static-batch-1 file run row by row in this process."""
    return np.concatenate([mo.run(path, {"INPUT0": x[i:i + 1]})["OUTPUT0"] for i in range(len(x))])


# ------------------------------------------------------------------------- served
def test_auto_completed_config(http):
    cfg = http.get_model_config("add_sub")
    assert cfg["backend"] == "openvino" and cfg["default_model_filename"] == "model.xml"
    assert cfg["max_batch_size"] == 4
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == \
        [("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == \
        [("OUTPUT0", "TYPE_FP32", [16]), ("OUTPUT1", "TYPE_FP32", [16])]
    cfg = http.get_model_config("types")   # no dynamic first dimension: no batching
    assert cfg["max_batch_size"] == 0 and "dynamic_batching" not in cfg
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == \
        [("I64", "TYPE_INT64", [4]), ("H", "TYPE_FP16", [2, 3])]
    assert [(o["name"], o["data_type"]) for o in cfg["output"]] == \
        [("TWICE", "TYPE_INT64"), ("POSITIVE", "TYPE_BOOL"), ("PLUS1", "TYPE_FP16")]


def test_add_sub_dynamic_batch(server, repo, http):
    rng = np.random.default_rng(1)
    batches = [{"INPUT0": rng.random((1, 16), dtype=np.float32),
                "INPUT1": rng.random((1, 16), dtype=np.float32)} for _ in range(4)]
    for got, b in zip(burst(server, "add_sub", batches), batches):
        want = mo.run(repo / "add_sub" / "1" / "model.xml", b)
        for name in ("OUTPUT0", "OUTPUT1"):
            np.testing.assert_array_equal(got[name], want[name])
    assert batch_counts(http, "add_sub") == {4: 1}


def test_static_batch_file_served_with_any_batch(server, repo, http):
    """The file fixes the batch at 1; with max_batch_size 8 the backend makes it dynamic."""
    rng = np.random.default_rng(2)
    batches = [{"INPUT0": rng.standard_normal((n, WIDTH), dtype=np.float32)} for n in (1, 2, 2, 3)]
    path = repo / "mlp" / "1" / "model.xml"
    for got, b in zip(burst(server, "mlp", batches), batches):
        np.testing.assert_allclose(got["OUTPUT0"], per_row(path, b["INPUT0"]), rtol=1e-5, atol=1e-6)
    assert batch_counts(http, "mlp") == {8: 1}
    x = rng.standard_normal((5, WIDTH), dtype=np.float32)   # one request, over gRPC
    got = infer(server, "mlp", {"INPUT0": x}, grpcclient)["OUTPUT0"]
    np.testing.assert_allclose(got, per_row(path, x), rtol=1e-5, atol=1e-6)


def test_integer_bool_fp16_exact(server, repo):
    inputs = {"I64": np.array([-3, 0, 7, 2**40], np.int64),
              "H": np.arange(6, dtype=np.float16).reshape(2, 3) / 4}
    got = infer(server, "types", inputs)
    want = mo.run(repo / "types" / "1" / "model.xml", inputs)
    assert set(got) == {"TWICE", "POSITIVE", "PLUS1"}
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name], value)


def _static_batch_tolerance() -> dict[str, float]:
    """A batch of 4 against rows of 1: where OpenVINO's CPU plugin computes in bfloat16 by
    default (CPUs with avx512_bf16 or AMX, unless the model sets a precision: Triton's
    backend only has HINT_BF16 to ask for it), the two shapes take different kernels and
    round differently, by up to bfloat16's 3 significant digits through the MLP's layers."""
    import openvino as ov
    if ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT") == ov.Type.bf16:
        return {"rtol": 5e-2, "atol": 2e-2}
    return {"rtol": 1e-5, "atol": 1e-6}


def test_static_batch_padding(server, repo):
    """SKIP_OV_DYNAMIC_BATCHSIZE keeps Triton's static batch of max_batch_size (4):
    ENABLE_BATCH_PADDING pads a smaller batch; without it the batch fails with Triton's text."""
    tol = _static_batch_tolerance()
    x = np.random.default_rng(3).standard_normal((3, WIDTH), dtype=np.float32)
    got = infer(server, "padded", {"INPUT0": x})["OUTPUT0"]
    np.testing.assert_allclose(got, per_row(repo / "padded" / "1" / "model.xml", x), **tol)
    x4 = np.concatenate([x, x[:1]])
    np.testing.assert_allclose(infer(server, "fixed", {"INPUT0": x4})["OUTPUT0"],
                               per_row(repo / "fixed" / "1" / "model.xml", x4), **tol)
    with pytest.raises(InferenceServerException) as e:
        infer(server, "fixed", {"INPUT0": x[:2]})
    assert e.value.status() == "500"
    assert e.value.message() == (
        "expected requests with batch size '4', got '2'... this error can be avoided by setting "
        "'ENABLE_BATCH_PADDING' parameter in model configuration to 'YES' at a performance cost.")


def _upper(items: list[bytes]) -> list[bytes]:
    """What the strings model computes: ASCII a-z upper-cased, every other byte kept."""
    return [bytes(c - 32 if 97 <= c <= 122 else c for c in b) for b in items]


def test_strings_auto_completed_and_dynamically_batched(server, repo, http):
    """OpenVINO string tensors are BYTES (TYPE_STRING); four requests run as one batch."""
    cfg = http.get_model_config("strings")
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == \
        [("TEXT", "TYPE_STRING", [2])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == \
        [("UPPER", "TYPE_STRING", [2]), ("LENGTH", "TYPE_INT32", [2])]
    words = [["abc", "Déjà vu"], ["", "x" * 300], ["mIxEd 123", "ünï"], ["a b", "z"]]
    batches = [{"TEXT": np.array([[w.encode() for w in pair]], dtype=object)} for pair in words]
    path = repo / "strings" / "1" / "model.xml"
    for got, b in zip(burst(server, "strings", batches), batches):
        # OpenVINO in this process hands strings back decoded: encode them to compare.
        want = mo.run(path, {"TEXT": b["TEXT"].astype(np.bytes_)})
        assert got["UPPER"].tolist() == [[s.encode() for s in want["UPPER"][0]]]
        np.testing.assert_array_equal(got["LENGTH"], want["LENGTH"])
    assert batch_counts(http, "strings") == {4: 1}


@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_string_bytes_exact(server, protocol):
    """Bytes OpenVINO's own Python conversion loses (trailing NULs, invalid UTF-8) arrive
    and return intact."""
    items = [b"ab\x00", b"\x00\x00", b"\xff\xfeq", b"", b"tail\x00\x00", b"ok"]
    x = np.array(items, dtype=object).reshape(3, 2)
    got = infer(server, "strings", {"TEXT": x}, protocol)
    assert got["UPPER"].reshape(-1).tolist() == _upper(items)
    assert got["LENGTH"].tolist() == [[3, 2], [3, 0], [6, 2]]


def test_bad_models_unavailable_beside_good(http):
    idx = {e["name"]: e for e in http.get_model_repository_index()}
    assert {n: idx[n]["state"] for n in (*GOOD, *BROKEN)} == \
        {**{n: "READY" for n in GOOD}, **{n: "UNAVAILABLE" for n in BROKEN}}
    assert idx["broken"]["reason"].startswith(
        'openvino error in reading model : Unable to read the model: "'), idx["broken"]["reason"]
    assert idx["broken"]["reason"].split('"')[1].endswith("/broken/1/model.xml")
    assert idx["mismatch"]["reason"] == (
        "model 'mismatch', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,16]) but "
        "the model configuration specifies 2 dimensions (an initial batch dimension because "
        "max_batch_size > 0 followed by the explicit tensor shape, making complete shape [-1,8])")
    assert idx["bad_param"]["reason"] == \
        "expected the parameter 'NUM_STREAMS' to be either AUTO/NUMA/<int_value>, got many"


# ---------------------------------------------------------------- backend object
def backend(root: Path, name: str, pbtxt: str = "", *, kind: str = "KIND_CPU",
            auto: bool = True) -> OpenVINOBackend:
    cfg = autocomplete(parse_pbtxt(pbtxt), root / name, name)
    return OpenVINOBackend(cfg, m.LoadModel(name, 1, str(root / name), cfg.SerializeToString(),
                                            f"{name}_0", kind=kind, autocomplete=auto))


def test_kind_gpu_refused(tmp_path):
    mo.add_sub(tmp_path / "add_sub")
    with pytest.raises(TriremeError) as e:
        backend(tmp_path, "add_sub", kind="KIND_GPU")
    assert (e.value.code, e.value.message) == (
        Code.INVALID_ARG,
        "unable to load model 'add_sub', Triton openVINO backend supports only CPU device")


def test_read_only_inputs_used_in_place(tmp_path):
    """Worker inputs may be read-only views on shared memory: they run, and stay as they were."""
    mo.add_sub(tmp_path / "add_sub")
    b = backend(tmp_path, "add_sub")
    raw = np.arange(32, dtype=np.float32).tobytes()
    x = np.frombuffer(raw, np.float32).reshape(2, 16)
    assert not x.flags.writeable
    out = b.execute({"INPUT0": x, "INPUT1": x}, ["OUTPUT1"])
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"], np.zeros((2, 16), np.float32))
    assert x.tobytes() == raw
    b.close()


def test_strings_padded_to_a_static_batch(tmp_path):
    mo.strings(tmp_path / "strings")
    b = backend(tmp_path, "strings", 'max_batch_size: 4\n'
                'parameters { key: "SKIP_OV_DYNAMIC_BATCHSIZE" value { string_value: "YES" } }\n'
                'parameters { key: "ENABLE_BATCH_PADDING" value { string_value: "YES" } }\n')
    x = np.array([[b"q\x00", b"Rs"]], dtype=object)
    out = b.execute({"TEXT": x}, ["UPPER", "LENGTH"])
    assert out["UPPER"].tolist() == [[b"Q\x00", b"RS"]]
    assert out["LENGTH"].tolist() == [[2, 2]]
    b.close()


def test_string_tensor_with_another_config_type_fails_the_load(tmp_path):
    mo.strings(tmp_path / "strings")
    with pytest.raises(TriremeError) as e:
        backend(tmp_path, "strings", 'max_batch_size: 4\n'
                'input [{ name: "TEXT", data_type: TYPE_FP32, dims: [2] }]\n'
                'output [{ name: "UPPER", data_type: TYPE_STRING, dims: [2] }]\n', auto=False)
    assert (e.value.code, e.value.message) == (
        Code.INVALID_ARG, "unable to load model 'strings', configuration expects datatype "
                          "TYPE_FP32 for input 'TEXT', model provides TYPE_STRING")


def test_config_types_converted_without_auto_complete(tmp_path):
    """Triton's backend turns each configured data type into the tensor type (a conversion
    OpenVINO inserts), and rejects a tensor the model does not have."""
    mo.add_sub(tmp_path / "add_sub")
    io = ('max_batch_size: 4\n'
          'input [{ name: "INPUT0", data_type: TYPE_FP64, dims: [16] },'
          '       { name: "INPUT1", data_type: TYPE_FP64, dims: [16] }]\n'
          'output [{ name: "OUTPUT0", data_type: TYPE_FP64, dims: [16] }]\n')
    b = backend(tmp_path, "add_sub", io, auto=False)
    assert b.config.input[0].data_type == mc.TYPE_FP64
    a = np.linspace(0, 1, 48).reshape(3, 16)
    out = b.execute({"INPUT0": a, "INPUT1": a}, ["OUTPUT0"])["OUTPUT0"]
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, 2 * a, rtol=1e-6)
    b.close()
    with pytest.raises(TriremeError) as e:
        backend(tmp_path, "add_sub", io.replace('"INPUT1"', '"INPUT9"'), auto=False)
    assert (e.value.code, e.value.message) == (
        Code.INVALID_ARG, "unexpected inference input 'INPUT9', allowed inputs are: INPUT0, INPUT1")
