"""The TensorFlow backend end to end: SavedModel (auto-completed; with a config, BYTES through
a named signature), frozen GraphDef, models that fail to load beside good ones, dynamic
batching seen in the statistics; then load errors checked on the backend in this process.

One server, started with TRITONSERVER_DELAY_SCHEDULER=4: the auto-completed model holds its
first requests until four are queued, so they run as one batch whatever the client threads
race. It must stay the only model with dynamic batching (auto-complete adds it to any model
with max_batch_size > 1 whose config lacks inputs or outputs), or another model's first
request would wait for three more. TF workers are slow to start: one instance per model,
except where TensorFlow's default count on CPU (2) is what is tested.
"""
from __future__ import annotations

import concurrent.futures as cf
import shutil

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="the tensorflow extra is not installed")

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from protos import model_config_pb2 as mc
from services.common import config as cfgmod
from services.common.errors import Code, TriremeError
from services.common.messages import LoadModel
from services.workers.backends.base import create_backend
from tests import models, models_tf
from tests.conftest import start_server, wait_models

ONE_CPU = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
FP32_IN = ('input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [16] },'
           ' { name: "INPUT1", data_type: TYPE_FP32, dims: [16] }]\n')
GOOD = ("auto", "strings", "graphdef", "init_ops", "no_init_ops")
BROKEN = ("broken", "bad_input")
BROKEN_REASONS = {
    "broken": "unable to auto-complete model configuration for 'broken', failed to load model: "
              "Cannot parse file b'{repo}/broken/1/model.savedmodel/saved_model.pb': Error "
              "parsing message with type 'tensorflow.SavedModel'.",
    "bad_input": "unexpected inference input 'NOPE', allowed inputs are: INPUT0, INPUT1",
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf") / "models"
    module = models_tf.savedmodel(root / "auto")        # no config.pbtxt: auto-complete
    for name in ("strings", "bad_input"):
        shutil.copytree(root / "auto" / "1", root / name / "1")
    models.write_config(root / "strings", (   # the same SavedModel, its other signature
        f"max_batch_size: 8\n{ONE_CPU}"
        'parameters { key: "TF_SIGNATURE_DEF" value { string_value: "strings" } }\n'
        'parameters { key: "TF_NUM_INTRA_THREADS" value { string_value: "1" } }\n'
        'parameters { key: "TF_NUM_INTER_THREADS" value { string_value: "1" } }\n'
        'input [{ name: "TEXT", data_type: TYPE_STRING, dims: [2] }]\n'
        'output [{ name: "LENGTH", data_type: TYPE_INT32, dims: [2] },'
        ' { name: "UPPER", data_type: TYPE_STRING, dims: [2] }]\n'))
    models.write_config(root / "bad_input", (
        f"max_batch_size: 8\n{ONE_CPU}"
        'input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [16] },'
        ' { name: "NOPE", data_type: TYPE_FP32, dims: [16] }]\n'
        'output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [16] }]\n'))
    frozen = models_tf.graphdef(root / "graphdef")
    models.write_config(root / "graphdef", (
        f"max_batch_size: 8\n{ONE_CPU}{FP32_IN}"
        'output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [16] },'
        ' { name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }]\n'))
    models_tf.broken_savedmodel(root / "broken")
    # TF_INIT_OPS_FILE: the version folder's file wins over the model folder's (whose
    # operation does not exist, so using it would fail the load).
    variable_io = ('input [{ name: "INPUT", data_type: TYPE_INT32, dims: [1] }]\n'
                   'output [{ name: "OUTPUT", data_type: TYPE_INT32, dims: [1] }]\n')
    for name, extra in (("init_ops", param("TF_INIT_OPS_FILE", "init_ops.json")),
                        ("no_init_ops", "")):
        models_tf.variable_graphdef(root / name)
        models.write_config(root / name, f'platform: "tensorflow_graphdef"\n{ONE_CPU}'
                            f'{variable_io}{extra}')
    (root / "init_ops" / "1" / "init_ops.json").write_text('{"init_ops": ["init"]}')
    (root / "init_ops" / "init_ops.json").write_text('{"init_ops": ["no_such_op"]}')
    return root, module, frozen


@pytest.fixture(scope="module")
def server(repo):
    # Strict readiness: two models fail, so wait for live, then for every model to settle.
    with start_server(repo[0], "--exit-on-error", "false", ready=False,
                      env={"TRITONSERVER_DELAY_SCHEDULER": "4"}) as srv:
        wait_models(srv, GOOD, BROKEN, "TensorFlow models to load or fail")
        yield srv


@pytest.fixture
def http(server):
    c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    yield c
    c.close()


def fp32_inputs(mod, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((rows, 16)).astype(np.float32) for _ in range(2)]
    inputs = [mod.InferInput(f"INPUT{i}", [rows, 16], "FP32") for i in range(2)]
    for inp, a in zip(inputs, arrays):
        inp.set_data_from_numpy(a)
    return inputs, arrays


# ------------------------------------------------------------------------- SavedModel
def test_savedmodel_config_is_auto_completed(http):
    cfg = http.get_model_config("auto")
    assert (cfg["platform"], cfg["backend"]) == ("tensorflow_savedmodel", "tensorflow")
    assert cfg["default_model_filename"] == "model.savedmodel"
    assert cfg["max_batch_size"] == 4                        # Triton's default-max-batch-size
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4]
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [
        ("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [
        ("OUTPUT0", "TYPE_FP32", [16]), ("OUTPUT1", "TYPE_INT32", [16])]
    group = cfg["instance_group"][0]
    assert (group["kind"], group["count"]) == ("KIND_CPU", 2)   # TensorFlow's CPU default
    md = http.get_model_metadata("auto")
    assert md["platform"] == "tensorflow_savedmodel"
    assert [(t["name"], t["datatype"], t["shape"]) for t in md["outputs"]] == [
        ("OUTPUT0", "FP32", [-1, 16]), ("OUTPUT1", "INT32", [-1, 16])]


def test_savedmodel_dynamic_batch_matches_tensorflow(server, repo):
    """Four one-row requests, held by the delay hook, run as one batch of four; each answer
    equals the tf.function called in this process."""
    module = repo[1]

    def one(seed: int) -> None:
        c = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        try:
            inputs, (a, b) = fp32_inputs(httpclient, 1, seed)
            res = c.infer("auto", inputs)
            want = module.serve(a, b)
            np.testing.assert_allclose(res.as_numpy("OUTPUT0"), want["OUTPUT0"].numpy(),
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), want["OUTPUT1"].numpy())
        finally:
            c.close()

    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(4)))
    c = httpclient.InferenceServerClient(server.http_url)
    try:
        st = c.get_inference_statistics("auto")["model_stats"][0]
    finally:
        c.close()
    sizes = {b["batch_size"]: int(b["compute_infer"]["count"]) for b in st["batch_stats"]}
    assert max(sizes) > 1, sizes
    assert st["inference_count"] >= 4 and st["execution_count"] < st["inference_count"]


def test_savedmodel_with_config_over_grpc(server, repo):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        cfg = c.get_model_config("strings", as_json=True)["config"]
        assert cfg["max_batch_size"] == 8 and "dynamic_batching" not in cfg
        assert cfg["parameters"]["TF_SIGNATURE_DEF"] == {"string_value": "strings"}
        text = np.array([[b"one", b"two"]], dtype=object)
        inp = grpcclient.InferInput("TEXT", [1, 2], "BYTES")
        inp.set_data_from_numpy(text)
        res = c.infer("strings", [inp])
        assert [o.name for o in res.get_response().outputs] == ["LENGTH", "UPPER"]
        assert res.as_numpy("UPPER").tolist() == repo[1].strings(text)["UPPER"].numpy().tolist()
    finally:
        c.close()


def test_bytes_through_a_named_signature(http, repo):
    text = np.array([[b"abc", b"a\x00b"], [b"", "d\u00e9j\u00e0".encode()],
                     [b"\xff\xfe", b"x" * 300]], dtype=object)
    inp = httpclient.InferInput("TEXT", list(text.shape), "BYTES")
    inp.set_data_from_numpy(text)
    res = http.infer("strings", [inp])
    want = repo[1].strings(text)
    assert res.as_numpy("UPPER").tolist() == want["UPPER"].numpy().tolist()
    assert res.as_numpy("UPPER")[0].tolist() == [b"ABC", b"A\x00B"]
    np.testing.assert_array_equal(res.as_numpy("LENGTH"), want["LENGTH"].numpy())


# -------------------------------------------------------------------------- GraphDef
def test_graphdef_matches_tensorflow(http, repo):
    frozen = repo[2]
    inputs, (a, b) = fp32_inputs(httpclient, 2, seed=3)
    feeds = {"INPUT0": a, "INPUT1": b}
    res = http.infer("graphdef", inputs)
    out0, out1 = frozen(feeds, ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_allclose(res.as_numpy("OUTPUT0"), out0, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), out1)
    # one requested output: the graph is pruned to it
    res = http.infer("graphdef", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert res.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), out1)


def test_graphdef_execution_error_is_500_and_model_keeps_serving(http):
    inputs, (a, b) = fp32_inputs(httpclient, 1, seed=4)
    a[0, 3] = np.nan
    inputs[0].set_data_from_numpy(a)
    with pytest.raises(InferenceServerException) as ei:
        http.infer("graphdef", inputs)
    assert ei.value.status() == "500"
    assert ei.value.message() == ("TensorFlow error in model 'graphdef': OUTPUT0 is not finite : "
                                  "Tensor had NaN values [[{{node OUTPUT0}}]]")
    inputs, _ = fp32_inputs(httpclient, 1, seed=5)
    assert http.infer("graphdef", inputs).as_numpy("OUTPUT1").shape == (1, 16)


# ---------------------------------------------------------------- TF_INIT_OPS_FILE
def infer_variable(http, model: str) -> np.ndarray:
    inp = httpclient.InferInput("INPUT", [1], "INT32")
    inp.set_data_from_numpy(np.array([10], np.int32))
    return http.infer(model, [inp]).as_numpy("OUTPUT")


def test_init_ops_file_initializes_variables_at_load(http):
    np.testing.assert_array_equal(infer_variable(http, "init_ops"), [17])   # 10 + VARIABLE (7)


def test_without_init_ops_the_variable_is_uninitialized(http):
    with pytest.raises(InferenceServerException) as ei:
        infer_variable(http, "no_init_ops")
    assert ei.value.status() == "500"
    # the text Triton's own test (qa/L0_tf_parameters) expects
    assert "Could not find variable VARIABLE. This could mean that the variable has been " \
           "deleted. In TF1, it can also mean the variable is uninitialized." \
           in ei.value.message()


# ------------------------------------------------------------------ failures to load
def test_models_that_fail_to_load_beside_good_ones(http, repo):
    idx = {e["name"]: e for e in http.get_model_repository_index()}
    for name in BROKEN:
        assert idx[name]["state"] == "UNAVAILABLE", idx[name]
        assert idx[name]["reason"] == BROKEN_REASONS[name].format(repo=repo[0]), idx[name]
        assert not http.is_model_ready(name)
    assert all(http.is_model_ready(m) for m in GOOD)


# ------------------------------------------------ load errors, on the backend in-process
def param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


def load_backend(root, name: str, config: str, kind: str = "KIND_CPU"):
    cfg = cfgmod.autocomplete(cfgmod.parse_pbtxt(config), root / name, name)
    return create_backend(cfg, LoadModel(model=name, version=1, model_dir=str(root / name),
                                         config=b"", instance_name=f"{name}_0", kind=kind,
                                         autocomplete=True))


def load_error(root, name: str, config: str, kind: str = "KIND_CPU") -> TriremeError:
    with pytest.raises(TriremeError) as ei:
        load_backend(root, name, config, kind)
    return ei.value


GD_IO = ('input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [16] }]\n'
         'output [{ name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }]\n')


@pytest.mark.parametrize("config,message", [
    ('input [{ name: "X", data_type: TYPE_FP32, dims: [16] }]\n'
     'output [{ name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }]\n',
     "unexpected inference input 'X', allowed inputs are: INPUT0, INPUT1"),
    ('input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [16] }]\n'
     'output [{ name: "INPUT1", data_type: TYPE_FP32, dims: [16] }]\n',
     "unexpected inference output 'INPUT1', allowed outputs are: MatMul, "
     "MatMul/ReadVariableOp, OUTPUT0, OUTPUT1, add, sub, w"),
    ('input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [16] },'
     ' { name: "INPUT1", data_type: TYPE_FP32, dims: [16] },'
     ' { name: "INPUT2", data_type: TYPE_FP32, dims: [16] }]\n'
     'output [{ name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }]\n',
     "unable to load model 'gd', configuration expects 3 inputs, model provides at most 2"),
    ('input [{ name: "INPUT0", data_type: TYPE_INT32, dims: [16] }]\n'
     'output [{ name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }]\n',
     "unable to load model 'gd', configuration expects datatype TYPE_INT32 for input 'INPUT0', "
     "model provides TYPE_FP32"),
    (param("TF_NUM_INTRA_THREADS", "-1") + GD_IO,
     "parameter 'TF_NUM_INTRA_THREADS' must be non-negative number for TensorFlow model 'gd'"),
])
def test_graphdef_config_checked_against_graph(tmp_path, config, message):
    models_tf.graphdef(tmp_path / "gd")
    err = load_error(tmp_path, "gd", config)
    assert (err.code, err.message) == (Code.INVALID_ARG, message)


def test_graphdef_empty_network(tmp_path):
    (tmp_path / "gd" / "1").mkdir(parents=True)
    (tmp_path / "gd" / "1" / "model.graphdef").write_bytes(b"")
    err = load_error(tmp_path, "gd", GD_IO)
    assert (err.code, err.message) == (Code.INVALID_ARG, "model gd has an empty network")


def test_savedmodel_signature_choice(tmp_path):
    models_tf.savedmodel(tmp_path / "sm")
    cfg = load_backend(tmp_path, "sm", param("TF_SIGNATURE_DEF", "strings")).config
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [
        ("TEXT", mc.TYPE_STRING, [2])]
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [
        ("LENGTH", mc.TYPE_INT32, [2]), ("UPPER", mc.TYPE_STRING, [2])]
    assert cfg.max_batch_size == 4 and cfg.HasField("dynamic_batching")
    err = load_error(tmp_path, "sm", param("TF_SIGNATURE_DEF", "nope"))
    assert err.message == "unable to load model 'sm', expected 'nope' signature"
    err = load_error(tmp_path, "sm", param("TF_GRAPH_TAG", "train"))
    assert err.message.startswith("unable to auto-complete model configuration for 'sm', failed "
                                  "to load model: ") and "'train'" in err.message
    # A config whose dims contradict the signature is refused (complete_io's check).
    err = load_error(tmp_path, "sm", 'max_batch_size: 8\ninput [{ name: "INPUT0", data_type: '
                                     'TYPE_FP32, dims: [2, 16] }]')
    assert (err.code, err.message) == (Code.INVALID_ARG, (
        "model 'sm', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,16]) but the "
        "model configuration specifies 3 dimensions (an initial batch dimension because "
        "max_batch_size > 0 followed by the explicit tensor shape, making complete shape "
        "[-1,2,16])"))


def test_outputs_default_to_the_configs(tmp_path):
    """No output asked for means the config's outputs, not every output of the signature: the
    worker passes them (tests/e2e/test_output_rule.py), and the backend computes only those."""
    module = models_tf.savedmodel(tmp_path / "sm")
    backend = load_backend(tmp_path, "sm", f"max_batch_size: 8\n{FP32_IN}"
                           'output [{ name: "OUTPUT1", data_type: TYPE_INT32, dims: [16] }]')
    a, b = (np.full((2, 16), v, np.float32) for v in (1.0, 0.5))
    out = backend.execute({"INPUT0": a, "INPUT1": b}, [o.name for o in backend.config.output])
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"], module.serve(a, b)["OUTPUT1"].numpy())
    backend.close()


VARIABLE_IO = ('platform: "tensorflow_graphdef"\n'
               'input [{ name: "INPUT", data_type: TYPE_INT32, dims: [1] }]\n'
               'output [{ name: "OUTPUT", data_type: TYPE_INT32, dims: [1] }]\n')


def test_init_ops_file_in_the_model_folder(tmp_path):
    # Variables live in the process's resource manager: a name of its own for this test.
    models_tf.variable_graphdef(tmp_path / "m", value=-4, variable="MODEL_FOLDER_VARIABLE")
    (tmp_path / "m" / "ops.json").write_text('{"init_ops": ["init"]}')
    b = load_backend(tmp_path, "m", VARIABLE_IO + param("TF_INIT_OPS_FILE", "ops.json"))
    out = b.execute({"INPUT": np.array([10], np.int32)}, ["OUTPUT"])
    np.testing.assert_array_equal(out["OUTPUT"], [6])
    b.close()


@pytest.mark.parametrize("content,message", [
    (None, "unable to load model 'm': TF_INIT_OPS_FILE 'ops.json' is neither in "
           "'{root}/m/1' nor in '{root}/m'"),
    ('{"init_ops": "init"}', "unable to load model 'm': TF_INIT_OPS_FILE '{root}/m/1/ops.json' "
                             "must hold an object with 'init_ops', a list of operation names"),
    ('{"init_ops": ["nope"]}', "unable to load model 'm': initialization operation 'nope' is "
                               "not in the graph"),
])
def test_init_ops_file_errors(tmp_path, content, message):
    models_tf.variable_graphdef(tmp_path / "m", variable="ERRORS_VARIABLE")
    if content is not None:
        (tmp_path / "m" / "1" / "ops.json").write_text(content)
    e = load_error(tmp_path, "m", VARIABLE_IO + param("TF_INIT_OPS_FILE", "ops.json"))
    assert (e.code, e.message) == (Code.INVALID_ARG, message.format(root=tmp_path))


def test_init_ops_file_unparsable_json(tmp_path):
    models_tf.variable_graphdef(tmp_path / "m", variable="JSON_VARIABLE")
    (tmp_path / "m" / "1" / "ops.json").write_text("{init_ops: [")
    e = load_error(tmp_path, "m", VARIABLE_IO + param("TF_INIT_OPS_FILE", "ops.json"))
    assert e.message.startswith(f"unable to load model 'm': failed to read TF_INIT_OPS_FILE "
                                f"'{tmp_path}/m/1/ops.json': Expecting property name")


def test_init_ops_file_with_a_tf1_savedmodel(tmp_path):
    models_tf.tf1_savedmodel(tmp_path / "m", variable="TF1_LOCAL")
    (tmp_path / "m" / "1" / "ops.json").write_text('{"init_ops": ["init"]}')
    b = load_backend(tmp_path, "m", param("TF_INIT_OPS_FILE", "ops.json"))
    assert b.config.max_batch_size == 4   # auto-completed from the signature as usual
    out = b.execute({"INPUT": np.array([[1], [2]], np.int32)}, ["OUTPUT"])
    np.testing.assert_array_equal(out["OUTPUT"], [[6], [7]])
    b.close()


def test_init_ops_file_with_a_tf2_savedmodel(tmp_path):
    models_tf.savedmodel(tmp_path / "m")
    (tmp_path / "m" / "ops.json").write_text('{"init_ops": ["init"]}')
    e = load_error(tmp_path, "m", param("TF_INIT_OPS_FILE", "ops.json"))
    assert e.message == ("unable to load model 'm': TF_INIT_OPS_FILE needs a graph whose "
                         "operations can be run by name (a GraphDef or a TensorFlow 1 "
                         "SavedModel); a TensorFlow 2 SavedModel initializes itself when it loads")


def test_kind_gpu_without_a_gpu_fails_the_load(tmp_path):
    import tensorflow as tf
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    models_tf.savedmodel(tmp_path / "sm")
    err = load_error(tmp_path, "sm", "", kind="KIND_GPU")
    assert err.code == Code.UNAVAILABLE
    assert err.message.startswith("model 'sm' asks for KIND_GPU but TensorFlow sees no GPU")
