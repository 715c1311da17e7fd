"""One repository, every framework at once: ONNX, TorchScript, SavedModel, OpenVINO and
Python models served side by side, each in its own worker, each worker holding only its
own framework (and the frontend and scheduler none)."""
from __future__ import annotations

import numpy as np
import psutil
import pytest

for framework in ("torch", "tensorflow", "openvino"):
    pytest.importorskip(framework, reason=f"the mixed repository needs {framework}")

import tritonclient.http as httpclient  # noqa: E402

from tests import models, models_openvino, models_python, models_tf, models_torch  # noqa: E402
from tests.conftest import start_server  # noqa: E402

ONE_CPU = "instance_group [{ kind: KIND_CPU, count: 1 }]\n"
# What each framework maps into a process that imports it.
LIBRARIES = {"onnxruntime": "onnxruntime_pybind11", "pytorch": "libtorch_cpu",
             "tensorflow": "libtensorflow_framework",
             "openvino": "libopenvino.so"}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed") / "models"
    models.add_sub(root / "onnx")
    models.write_config(root / "onnx", f"max_batch_size: 8\n{ONE_CPU}")
    models_torch.save_script(models_torch.AddSub(), root / "torch")
    models.write_config(root / "torch", (
        'backend: "pytorch"\nmax_batch_size: 8\n' + ONE_CPU
        + "".join(models_torch.io("input", f"INPUT__{i}", "TYPE_FP32", "[ 16 ]") for i in (0, 1))
        + "".join(models_torch.io("output", f"OUTPUT__{i}", "TYPE_FP32", "[ 16 ]") for i in (0, 1))))
    tf_module = models_tf.savedmodel(root / "tf")
    models.write_config(root / "tf", ONE_CPU)       # inputs and outputs auto-completed
    models_openvino.add_sub(root / "openvino")       # no config at all
    models_python.python_model(root, "python", models_python.ADD_SUB,
                               models_python.ADD_SUB_CONFIG.format(name="python", batching=""))
    with start_server(root) as srv:
        yield srv, tf_module


def _infer(client, model, named: dict[str, np.ndarray]) -> httpclient.InferResult:
    inputs = []
    for name, arr in named.items():
        i = httpclient.InferInput(name, list(arr.shape), "FP32")
        i.set_data_from_numpy(arr)
        inputs.append(i)
    return client.infer(model, inputs)


def test_every_framework_serves_at_once(mixed):
    srv, tf_module = mixed
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((2, 16)).astype(np.float32) for _ in range(2))
    c = httpclient.InferenceServerClient(srv.http_url)
    try:
        for model, (in0, in1, out0, out1) in {
                "onnx": ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1"),
                "torch": ("INPUT__0", "INPUT__1", "OUTPUT__0", "OUTPUT__1"),
                "openvino": ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1")}.items():
            r = _infer(c, model, {in0: a, in1: b})
            np.testing.assert_allclose(r.as_numpy(out0), a + b, rtol=1e-6, err_msg=model)
            np.testing.assert_allclose(r.as_numpy(out1), a - b, rtol=1e-6, err_msg=model)
        r = _infer(c, "tf", {"INPUT0": a, "INPUT1": b})
        want = tf_module.serve(a, b)
        np.testing.assert_allclose(r.as_numpy("OUTPUT0"), want["OUTPUT0"].numpy(), rtol=1e-5)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), want["OUTPUT1"].numpy())
        r = _infer(c, "python", {"INPUT0": a[0, :4].copy(), "INPUT1": b[0, :4].copy()})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a[0, :4] + b[0, :4])
        platforms = {m: c.get_model_metadata(m)["platform"] for m in
                     ("onnx", "torch", "tf", "openvino", "python")}
        assert platforms == {"onnx": "onnxruntime_onnx", "torch": "pytorch_libtorch",
                             "tf": "tensorflow_savedmodel", "openvino": "openvino",
                             "python": "python"}
    finally:
        c.close()


def test_each_process_maps_only_its_own_framework(mixed):
    srv, _ = mixed
    seen = {}
    for pid in srv.family():
        p = psutil.Process(pid)
        title = " ".join(p.cmdline())
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        loaded = sorted(fw for fw, lib in LIBRARIES.items() if lib in maps)
        seen[title.split("(")[-1].split(" ")[0] if "worker" in title else title.split()[1]] = loaded
    assert seen == {"serve": [], "frontend": [], "onnx": ["onnxruntime"], "torch": ["pytorch"],
                    "tf": ["tensorflow"], "openvino": ["openvino"], "python": []}, seen
