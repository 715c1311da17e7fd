"""The TensorRT backend.

Here (no NVIDIA GPU, no TensorRT wheel): a tensorrt_plan model fails to load with the install
hint while an ONNX model beside it serves, and the backend's pure helpers (compute-capability
file choice, datatype table, batch limits) work without tensorrt. Where TensorRT and a GPU
exist, the `gpu` tests build engines from ONNX at test time and serve them.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from services.common.config import parse_pbtxt
from services.common.errors import Code, TriremeError
from services.common.repository import model_file
from services.workers.backends import tensorrt as trtb
from tests import models
from tests.conftest import start_server, wait_settled

HAS_TRT = importlib.util.find_spec("tensorrt") is not None
NO_GPU = "TensorRT is not installable on this machine (no NVIDIA GPU / no wheel)"
INSTALL_HINT = ("backend 'tensorrt' is not available: No module named 'tensorrt'. "
                'Install it with: pip install "trireme[tensorrt]"')
IO = ('input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [16] },'
      '       { name: "INPUT1", data_type: TYPE_FP32, dims: [16] }]\n'
      'output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [16] },'
      '        { name: "OUTPUT1", data_type: TYPE_FP32, dims: [16] }]\n')


def _gpu_ready() -> bool:
    if not HAS_TRT:
        return False
    import torch
    return torch.cuda.is_available()


def add_sub_inputs(batch: int, seed: int = 0) -> tuple[list, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b = rng.random((batch, 16), dtype=np.float32), rng.random((batch, 16), dtype=np.float32)
    ins = [httpclient.InferInput("INPUT0", [batch, 16], "FP32"),
           httpclient.InferInput("INPUT1", [batch, 16], "FP32")]
    ins[0].set_data_from_numpy(a)
    ins[1].set_data_from_numpy(b)
    return ins, a, b


def settled(srv, ready: tuple[str, ...], failed: tuple[str, ...]) -> dict[str, dict]:
    c = httpclient.InferenceServerClient(srv.http_url)
    try:
        def check():
            idx = {e["name"]: e for e in c.get_model_repository_index()}
            ok = all(c.is_model_ready(n) for n in ready) and \
                all(idx.get(n, {}).get("state") == "UNAVAILABLE" for n in failed)
            return idx if ok else None
        return wait_settled(srv, c, check, "models to settle")
    finally:
        c.close()


# ------------------------------------------------------------------ without TensorRT
@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed: the install hint cannot show")
def test_plan_unavailable_with_install_hint_beside_onnx(tmp_path):
    root = tmp_path / "models"
    for name in ("plan", "plan_by_file"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.plan").write_bytes(b"not an engine")
    models.write_config(root / "plan", f'platform: "tensorrt_plan"\nmax_batch_size: 8\n{IO}')
    models.add_sub(root / "add_sub")
    models.write_config(root / "add_sub", 'max_batch_size: 8\n'
                        'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
    with start_server(root, "--exit-on-error", "false", ready=False) as srv:
        idx = settled(srv, ("add_sub",), ("plan", "plan_by_file"))
        for name in ("plan", "plan_by_file"):   # by platform, and by the file alone
            assert (idx[name]["state"], idx[name]["reason"]) == ("UNAVAILABLE", INSTALL_HINT)
        c = httpclient.InferenceServerClient(srv.http_url)
        try:
            ins, a, b = add_sub_inputs(3)
            res = c.infer("add_sub", ins)
            np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(res.as_numpy("OUTPUT1"), a - b)
        finally:
            c.close()


def test_module_imports_without_tensorrt():
    assert trtb.BACKEND is trtb.TensorRTBackend
    assert "tensorrt" not in sys.modules or HAS_TRT


def test_cc_model_filenames_choice(tmp_path):
    (tmp_path / "1").mkdir()
    for f in ("model.plan", "model_sm86.plan"):
        (tmp_path / "1" / f).write_bytes(b"")
    cfg = parse_pbtxt('name: "m"\nbackend: "tensorrt"\ndefault_model_filename: "model.plan"\n'
                      'cc_model_filenames { key: "8.6" value: "model_sm86.plan" }\n')
    def chosen(major: int, minor: int) -> str:
        return model_file(cfg, tmp_path, 1, cc=trtb.compute_capability(major, minor)).name
    assert chosen(8, 6) == "model_sm86.plan"
    assert chosen(9, 0) == "model.plan"   # no entry for this GPU: the default file


def test_datatype_table():
    assert {t: trtb.api_datatype(t, "x") for t in trtb.TRT_TYPES} == {
        "FLOAT": "FP32", "HALF": "FP16", "BF16": "BF16", "INT8": "INT8", "UINT8": "UINT8",
        "INT32": "INT32", "INT64": "INT64", "BOOL": "BOOL"}
    with pytest.raises(TriremeError) as e:
        trtb.api_datatype("FP8", "scores")
    assert (e.value.code, e.value.message) == (
        Code.INVALID_ARG, "unsupported TensorRT datatype FP8 for tensor 'scores'")


def test_batch_limits():
    assert trtb.engine_max_batch([32, 8, 16]) == 8
    assert trtb.engine_max_batch([]) == 0
    trtb.check_max_batch("m", 8, 8)
    with pytest.raises(TriremeError) as e:
        trtb.check_max_batch("m", 16, 8)
    assert e.value.message == ("autofill failed for model 'm': configuration specified "
                               "max-batch 16 but TensorRT engine only supports max-batch 8")


# -------------------------------------------------------------------- with a GPU
def build_plan(onnx_path: Path, plan_path: Path, max_batch: int = 8) -> None:
    """An engine from an ONNX file, with one profile for batches 1..max_batch."""
    import tensorrt as trt
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse(onnx_path.read_bytes()), \
        [parser.get_error(i) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        rest = list(t.shape)[1:]
        profile.set_shape(t.name, [1, *rest], [max_batch, *rest], [max_batch, *rest])
    config.add_optimization_profile(profile)
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(builder.build_serialized_network(network, config)))


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    if not _gpu_ready():
        pytest.skip(NO_GPU)
    import torch
    cc = trtb.compute_capability(*torch.cuda.get_device_capability(0))
    root = tmp_path_factory.mktemp("tensorrt") / "models"
    onnx_dir = root.parent / "onnx"
    models.add_sub(onnx_dir)
    build_plan(onnx_dir / "1" / "model.onnx", root / "auto" / "1" / "model.plan")
    models.write_config(root / "auto", "instance_group [{ kind: KIND_GPU, count: 1 }]\n")
    # Served only if the GPU's entry of cc_model_filenames is the file picked.
    build_plan(onnx_dir / "1" / "model.onnx", root / "by_cc" / "1" / "for_this_gpu.plan", 4)
    models.write_config(root / "by_cc", (
        f'platform: "tensorrt_plan"\nmax_batch_size: 4\ndefault_model_filename: "absent.plan"\n'
        f'cc_model_filenames {{ key: "{cc}" value: "for_this_gpu.plan" }}\n{IO}'
        'instance_group [{ kind: KIND_GPU, count: 1 }]\n'))
    with start_server(root, "--exit-on-error", "false", ready=False) as srv:
        settled(srv, ("auto", "by_cc"), ())
        yield srv


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason=NO_GPU)
def test_auto_completed_from_engine(gpu_server):
    c = httpclient.InferenceServerClient(gpu_server.http_url)
    try:
        cfg = c.get_model_config("auto")
        assert (cfg["platform"], cfg["backend"], cfg["max_batch_size"]) == \
            ("tensorrt_plan", "tensorrt", 8)
        assert "dynamic_batching" in cfg
        assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == \
            [("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])]
    finally:
        c.close()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_ready(), reason=NO_GPU)
@pytest.mark.parametrize("model,batch", [("auto", 1), ("auto", 8), ("by_cc", 3)])
def test_plan_results(gpu_server, model, batch):
    c = httpclient.InferenceServerClient(gpu_server.http_url)
    try:
        ins, a, b = add_sub_inputs(batch, seed=batch)
        res = c.infer(model, ins)
        np.testing.assert_allclose(res.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
        np.testing.assert_allclose(res.as_numpy("OUTPUT1"), a - b, rtol=1e-6)
    finally:
        c.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRT, reason=NO_GPU)
def test_kind_cpu_refused(tmp_path):
    from services.common import messages as m
    cfg = parse_pbtxt('name: "m"\nplatform: "tensorrt_plan"\nbackend: "tensorrt"\n')
    load = m.LoadModel("m", 1, str(tmp_path), cfg.SerializeToString(), "m_0", kind="KIND_CPU")
    with pytest.raises(TriremeError) as e:
        trtb.TensorRTBackend(cfg, load)
    assert (e.value.code, e.value.message) == (
        Code.INVALID_ARG, "unable to load model 'm', TensorRT backend supports only GPU device")
