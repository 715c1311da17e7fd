"""End to end: the model repository as a Triton user sees it, through the official clients.

Two servers per module run:
- `none_server` (--model-control-mode none, two --model-repository flags, strict readiness):
  version policies, ignored version folders, auto-complete, broken models beside good
  ones, a name found in both repositories, and load/unload refused.
- `explicit_server` (--model-control-mode explicit --load-model add_sub): load, unload,
  load with a config override.
Every model uses one CPU instance unless the test is about the default instance count.
"""
from __future__ import annotations

import glob
import json
import shutil
import tempfile

import models
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import start_server, wait_settled
from tritonclient.utils import InferenceServerException

ONE_CPU = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
DEADLINE_S = 60.0

BROKEN = ("broken_onnx", "broken_config", "dup")
GOOD = ("vp_latest", "vp_all", "vp_specific", "auto_full", "auto_partial", "second")


# ------------------------------------------------------------------------------ helpers
def add_sub_infer(client, model: str, version: str = "", batch: int = 1, seed: int = 0):
    """Infer add_sub-shaped model -> (OUTPUT0 - (a + b)) as one float: the version offset."""
    rng = np.random.default_rng(seed)
    a = rng.random((batch, 16), dtype=np.float32)
    b = rng.random((batch, 16), dtype=np.float32)
    mod = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    inputs = [mod.InferInput("INPUT0", [batch, 16], "FP32"), mod.InferInput("INPUT1", [batch, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    res = client.infer(model, inputs, model_version=version)
    out0, out1 = res.as_numpy("OUTPUT0"), res.as_numpy("OUTPUT1")
    np.testing.assert_allclose(out1, a - b, rtol=1e-6)
    off = out0 - (a + b)
    np.testing.assert_allclose(off, np.full_like(off, off.flat[0]), atol=1e-5)
    return round(float(off.flat[0]), 4)


def index_by_name(client) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in client.get_model_repository_index():
        out.setdefault(e["name"], []).append(e)
    return out


def http_error(fn, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as ei:
        fn(*args, **kwargs)
    return ei.value


# ------------------------------------------------------------------------------ none mode
@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    base = tmp_path_factory.mktemp("repository")
    r1, r2 = base / "repo1", base / "repo2"
    # version policies over versions 1, 2, 3 (version v adds v - 1 to OUTPUT0)
    for name, policy in (("vp_latest", "latest { num_versions: 2 }"), ("vp_all", "all { }"),
                         ("vp_specific", "specific { versions: [1, 3] }")):
        models.add_sub(r1 / name, versions=(1, 2, 3), offset_per_version=True)
        models.write_config(r1 / name, f'backend: "onnxruntime"\nmax_batch_size: 8\n'
                                       f'version_policy: {{ {policy} }}\n{ONE_CPU}')
    # folders that are not versions: a leading zero, not a number, warmup. Each holds a
    # loadable model, so serving any of them would show up as an extra version.
    for folder in ("01", "04", "abc", "warmup"):
        (r1 / "vp_all" / folder).mkdir()
        shutil.copy(r1 / "vp_all" / "3" / "model.onnx", r1 / "vp_all" / folder / "model.onnx")
    # auto-complete: no config at all, and a config with only max_batch_size
    models.add_sub(r1 / "auto_full")
    models.add_sub(r1 / "auto_partial")
    models.write_config(r1 / "auto_partial", "max_batch_size: 2\n")
    # broken beside good: a model file of random bytes, a config that does not parse
    (r1 / "broken_onnx" / "1").mkdir(parents=True)
    (r1 / "broken_onnx" / "1" / "model.onnx").write_bytes(np.random.default_rng(7).bytes(4096))
    models.write_config(r1 / "broken_onnx", f'backend: "onnxruntime"\nmax_batch_size: 8\n{ONE_CPU}')
    models.add_sub(r1 / "broken_config")
    models.write_config(r1 / "broken_config", "max_batch_size: 8\ninstance_group [{ kind: KIND_CPU,,, \n")
    # a second repository: one model of its own, one whose name is also in the first
    models.add_sub(r2 / "second", versions=(5,))
    models.write_config(r2 / "second", f"max_batch_size: 8\n{ONE_CPU}")
    for r in (r1, r2):
        models.add_sub(r / "dup")
        models.write_config(r / "dup", f"max_batch_size: 8\n{ONE_CPU}")
    return r1, r2


@pytest.fixture(scope="module")
def none_server(repos):
    r1, r2 = repos
    # Strict readiness: a model failed, so /v2/health/ready stays false; wait for live,
    # then for every model to have settled.
    with start_server(r1, "--model-repository", str(r2), "--exit-on-error", "false",
                      ready=False) as srv:
        c = httpclient.InferenceServerClient(srv.http_url)

        def settled():
            idx = index_by_name(c)
            if not all(c.is_model_ready(m) for m in GOOD):
                return False
            return all(idx.get(m) and all(e.get("state") == "UNAVAILABLE" for e in idx[m])
                       for m in BROKEN)
        wait_settled(srv, c, settled, "repository to settle", DEADLINE_S)
        c.close()
        yield srv


@pytest.fixture(scope="module")
def http(none_server):
    c = httpclient.InferenceServerClient(none_server.http_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc(none_server):
    c = grpcclient.InferenceServerClient(none_server.grpc_url)
    yield c
    c.close()


@pytest.mark.parametrize("model,versions,default", [
    ("vp_latest", ["2", "3"], 3), ("vp_all", ["1", "2", "3"], 3), ("vp_specific", ["1", "3"], 3)])
def test_version_policy(http, grpc, model, versions, default):
    assert http.get_model_metadata(model)["versions"] == versions
    assert list(grpc.get_model_metadata(model).versions) == versions
    for v in ("1", "2", "3"):
        assert http.is_model_ready(model, v) == (v in versions), v
        assert grpc.is_model_ready(model, v) == (v in versions), v
    for v in versions:
        assert add_sub_infer(http, model, v) == int(v) - 1
        assert add_sub_infer(grpc, model, v) == int(v) - 1
        assert http.get_model_metadata(model, v)["versions"] == versions
    # the default version is the highest one served
    assert add_sub_infer(http, model) == default - 1
    assert add_sub_infer(grpc, model) == default - 1
    for v in {"1", "2", "3"} - set(versions):
        e = http_error(add_sub_infer, http, model, v)
        assert e.status() == "404"
        assert e.message() == f"Request for unknown model: '{model}' version {v} is not found"
        assert not http.is_model_ready(model, v)


def test_non_version_folders_ignored(http):
    # 01 / 04 (leading zero), abc, warmup hold model files but are not versions
    assert http.get_model_metadata("vp_all")["versions"] == ["1", "2", "3"]
    idx = index_by_name(http)["vp_all"]
    assert sorted(e["version"] for e in idx) == ["1", "2", "3"]
    assert not http.is_model_ready("vp_all", "4")
    # a request names a version as an integer (Triton: std::stol), so "01" means 1
    assert http.is_model_ready("vp_all", "01")


def test_auto_complete_without_config(http, grpc):
    cfg = http.get_model_config("auto_full")
    assert cfg["name"] == "auto_full"
    assert cfg["platform"] == "onnxruntime_onnx"
    assert cfg["backend"] == "onnxruntime"
    assert cfg["default_model_filename"] == "model.onnx"
    assert cfg["max_batch_size"] == 4
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    io = lambda ios: sorted((i["name"], i["data_type"], i["dims"]) for i in ios)  # noqa: E731
    assert io(cfg["input"]) == [("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])]
    assert io(cfg["output"]) == [("OUTPUT0", "TYPE_FP32", [16]), ("OUTPUT1", "TYPE_FP32", [16])]
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4]
    groups = cfg["instance_group"]
    assert len(groups) == 1
    assert groups[0]["count"] == 2 and groups[0]["kind"] == "KIND_CPU"
    # the same over gRPC
    g = grpc.get_model_config("auto_full", as_json=True)["config"]
    assert g["max_batch_size"] == 4 and g["platform"] == "onnxruntime_onnx"
    assert g["instance_group"][0]["count"] == 2
    meta = http.get_model_metadata("auto_full")
    assert meta["platform"] == "onnxruntime_onnx"
    assert {i["name"]: i["shape"] for i in meta["inputs"]} == {"INPUT0": [-1, 16], "INPUT1": [-1, 16]}
    assert add_sub_infer(http, "auto_full", batch=4) == 0
    e = http_error(add_sub_infer, http, "auto_full", batch=5)
    assert "inference request batch-size must be <= 4 for 'auto_full'" in e.message()


def test_auto_complete_partial_config(http):
    cfg = http.get_model_config("auto_partial")
    assert cfg["name"] == "auto_partial"
    assert cfg["platform"] == "onnxruntime_onnx" and cfg["backend"] == "onnxruntime"
    assert cfg["max_batch_size"] == 2                      # kept from the file
    assert [i["name"] for i in cfg["input"]] == ["INPUT0", "INPUT1"]
    assert all(i["dims"] == [16] for i in cfg["input"] + cfg["output"])
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [2]
    assert cfg["instance_group"][0]["count"] == 2 and cfg["instance_group"][0]["kind"] == "KIND_CPU"
    assert add_sub_infer(http, "auto_partial", batch=2) == 0


def test_broken_models_beside_good_ones(none_server, http, grpc):
    assert http.is_server_live()
    assert not http.is_server_ready()   # strict readiness: a model failed to load
    idx = index_by_name(http)
    for name in ("broken_onnx", "broken_config"):
        for e in idx[name]:
            assert e["state"] == "UNAVAILABLE" and e["reason"], e
    assert [e.get("version") for e in idx["broken_onnx"]] == ["1"]
    assert "failed to load 'broken_onnx' version 1" in idx["broken_onnx"][0]["reason"]
    assert "broken_config" in idx["broken_config"][0]["reason"]
    assert "config.pbtxt" in idx["broken_config"][0]["reason"]
    # good models are unaffected
    for name in GOOD:
        assert idx[name][0]["state"] == "READY", idx[name]
    assert add_sub_infer(http, "vp_latest") == 2
    # gRPC index agrees
    g = {(m.name, m.version): m for m in grpc.get_model_repository_index().models}
    assert g[("broken_onnx", "1")].state == "UNAVAILABLE" and g[("broken_onnx", "1")].reason
    assert g[("broken_config", "")].state == "UNAVAILABLE"
    # inference on them: an error right away, never a hang
    for name in ("broken_onnx", "broken_config"):
        assert not http.is_model_ready(name)
        e = http_error(add_sub_infer, http, name)
        assert e.status() == "404"
        assert e.message() == f"Request for unknown model: '{name}' has no available versions"
        with pytest.raises(InferenceServerException) as ei:
            add_sub_infer(grpc, name)
        assert ei.value.status() == "StatusCode.NOT_FOUND"
        assert "has no available versions" in ei.value.message()
    # an explicit version of a model whose load failed: not at ready state
    e = http_error(add_sub_infer, http, "broken_onnx", "1")
    assert e.status() == "503"
    assert e.message() == "Request for unknown model: 'broken_onnx' version 1 is not at ready state"
    e = http_error(http.get_model_metadata, "broken_onnx")
    assert e.status() == "404"


def test_two_repositories(http):
    assert http.get_model_metadata("second")["versions"] == ["5"]
    assert add_sub_infer(http, "second") == 0
    idx = index_by_name(http)
    assert idx["dup"] == [{"name": "dup", "state": "UNAVAILABLE",
                           "reason": "model appears in two or more repositories"}]
    assert not http.is_model_ready("dup")
    e = http_error(add_sub_infer, http, "dup")
    assert e.status() == "404"   # (Triton 2.51: never loaded, so not found)
    assert e.message() == "Request for unknown model: 'dup' is not found"


def test_load_unload_refused_in_mode_none(http, grpc):
    text = "explicit model load / unload is not allowed if polling is enabled"
    for call in (http.load_model, http.unload_model):
        e = http_error(call, "vp_latest")
        assert e.status() == "503" and e.message() == text
    for call in (grpc.load_model, grpc.unload_model):
        with pytest.raises(InferenceServerException) as ei:
            call("vp_latest")
        assert ei.value.status() == "StatusCode.UNAVAILABLE"
        assert text in ei.value.message()
    assert http.is_model_ready("vp_latest")   # nothing happened to it
    assert add_sub_infer(http, "vp_latest") == 2


# ------------------------------------------------------------------------------ explicit
@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("explicit") / "models"
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", f"max_batch_size: 8\n{ONE_CPU}")
    models.identity(root / "other", "fp32")
    models.write_config(root / "other", f"max_batch_size: 8\n{ONE_CPU}")
    with start_server(root, "--model-control-mode", "explicit", "--load-model", "add_sub") as srv:
        yield srv


def identity_infer(client, n: int = 5) -> None:
    x = np.arange(n, dtype=np.float32).reshape(1, n)
    mod = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    inp = mod.InferInput("INPUT0", [1, n], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("other", [inp]).as_numpy("OUTPUT0"), x)


def test_explicit_mode(explicit_server):
    http = httpclient.InferenceServerClient(explicit_server.http_url)
    grpc = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    try:
        # only the model named on the command line is loaded
        assert http.is_server_ready()
        idx = index_by_name(http)
        assert idx == {"add_sub": [{"name": "add_sub", "version": "1", "state": "READY"}],
                       "other": [{"name": "other"}]}
        assert http.is_model_ready("add_sub") and not http.is_model_ready("other")
        e = http_error(identity_infer, http)
        assert e.status() == "404"
        assert e.message() == "Request for unknown model: 'other' is not found"   # never loaded
        assert http.get_model_repository_index() == [
            {"name": "add_sub", "version": "1", "state": "READY"}, {"name": "other"}]

        # load another model, then it serves
        http.load_model("other")
        assert http.is_model_ready("other")
        identity_infer(http)
        identity_infer(grpc)
        assert index_by_name(http)["other"] == [
            {"name": "other", "version": "1", "state": "READY"}]

        # unload: UNAVAILABLE "unloaded", inference fails
        http.unload_model("add_sub")
        assert index_by_name(http)["add_sub"] == [
            {"name": "add_sub", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
        assert not http.is_model_ready("add_sub")
        e = http_error(add_sub_infer, http, "add_sub")
        assert e.status() == "404"
        assert e.message() == "Request for unknown model: 'add_sub' has no available versions"
        assert http.is_server_ready()   # an unloaded model does not make the server unready
        # unloading twice is not an error
        http.unload_model("add_sub")

        # load with a config override: it replaces config.pbtxt
        override = {"backend": "onnxruntime", "max_batch_size": 2,
                    "instance_group": [{"kind": "KIND_CPU", "count": 1}]}
        http.load_model("add_sub", config=json.dumps(override))
        assert http.is_model_ready("add_sub")
        cfg = http.get_model_config("add_sub")
        assert cfg["max_batch_size"] == 2
        assert cfg["dynamic_batching"]["preferred_batch_size"] == [2]
        assert grpc.get_model_config("add_sub", as_json=True)["config"]["max_batch_size"] == 2
        assert add_sub_infer(http, "add_sub", batch=2) == 0
        e = http_error(add_sub_infer, http, "add_sub", batch=3)
        assert e.status() == "400"
        assert "inference request batch-size must be <= 2 for 'add_sub'" in e.message()

        # gRPC unload / load round trip
        grpc.unload_model("other")
        assert not grpc.is_model_ready("other")
        grpc.load_model("other")
        assert grpc.is_model_ready("other")
        identity_infer(grpc)

        # a model that is not in the repository; a config override that does not parse
        # (Triton's simple_http_model_control sends both): Triton's text and code
        e = http_error(http.load_model, "nope")
        assert e.status() == "500"
        assert e.message() == "failed to load 'nope', failed to poll from model repository"
        e = http_error(http.load_model, "add_sub",
                       config='"parameters": {"config": {{"max_batch_size": "16"}}}')
        assert e.status() == "500"
        assert e.message() == "failed to load 'add_sub', failed to poll from model repository"
        assert http.is_model_ready("add_sub")     # the loaded version keeps serving
        # names Triton refuses before looking (its ValidateModelName)
        for name, text in ((" ", "Model name cannot be empty. Please enter a valid name to "
                                 "deploy."),
                           ("../etc", "invalid model name '../etc', model name must not "
                                      "contain path traversal characters")):
            with pytest.raises(InferenceServerException) as info:
                grpc.load_model(name)
            assert (info.value.status(), info.value.message()) == (
                "StatusCode.INVALID_ARGUMENT", text)
    finally:
        http.close()
        grpc.close()


def test_explicit_load_with_file_override(explicit_server, tmp_path):
    """Load parameters "file:<version>/<name>" (with "config") give the model files to serve
    instead of those in the repository (Triton's override model directory)."""
    models.add_sub(tmp_path / "upload", versions=(6,), offset_per_version=True)   # adds 5
    onnx_bytes = (tmp_path / "upload" / "6" / "model.onnx").read_bytes()
    cfg = json.dumps({"backend": "onnxruntime", "max_batch_size": 8,
                      "instance_group": [{"kind": "KIND_CPU", "count": 1}]})
    http = httpclient.InferenceServerClient(explicit_server.http_url)
    try:
        e = http_error(http.load_model, "add_sub", files={"file:1/model.onnx": onnx_bytes})
        assert e.status() == "400" and "model configuration must be provided" in e.message()
        http.load_model("add_sub", config=cfg, files={"file:1/model.onnx": onnx_bytes})
        assert http.is_model_ready("add_sub")
        assert add_sub_infer(http, "add_sub") == 5   # the uploaded model, not the repository's
        # the uploaded files live in a directory of the server's own while loaded ...
        pid = explicit_server.proc.pid
        assert glob.glob(f"{tempfile.gettempdir()}/trireme-{pid}-model-*/add_sub/1/model.onnx")
        # ... and a reload without files serves the repository's model again
        http.load_model("add_sub")
        assert add_sub_infer(http, "add_sub") == 0
        assert not glob.glob(f"{tempfile.gettempdir()}/trireme-{pid}-model-*")
        # file names may not leave the model directory
        e = http_error(http.load_model, "add_sub", config=cfg,
                       files={"file:../../escape/model.onnx": onnx_bytes})
        assert e.status() == "400" and "invalid file parameter" in e.message(), e
        assert add_sub_infer(http, "add_sub") == 0   # a failed reload keeps the model serving
    finally:
        http.close()
