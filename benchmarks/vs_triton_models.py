"""Trireme vs Triton 2.51, the model repository (see vs_triton.py).

Every model is a Triton Python-backend model (`backend: "python"`, one KIND_CPU instance),
written into one temp repository that both servers load unchanged:

  add_sub           Triton's examples/add_sub/model.py (tests/models_python.ADD_SUB, verbatim),
                    FP32 [16] x 2 -> sum, difference; max_batch_size 0
  identity_batched  FP32 [-1, 16] -> same; max_batch_size 64, dynamic_batching { }
  identity          FP32 [1, 1048576] (4 MiB) -> same; max_batch_size 0
  scale             FP32 [16] -> 2 x input; max_batch_size 0
  add_sub_scale     ensemble: add_sub, then scale on its sum; OUTPUT0 = 2 (a + b)

The model files only use what numpy 1.24 has (Triton's stub runs on the system numpy).
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_server import ROOT

sys.path.insert(0, str(ROOT))
from tests.models_python import ADD_SUB  # Triton's examples/add_sub/model.py, verbatim

WIDTH = 16
BIG = 1 << 20                    # FP32 elements in the 4 MiB tensor
ENSEMBLE = "add_sub_scale"

IDENTITY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Each request's INPUT0 back as OUTPUT0 (requests of a dynamic batch one by one)."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
'''

SCALE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUTPUT0 = 2 * INPUT0."""

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (x * np.float32(2)).astype(np.float32))]))
        return out
'''


def _tensor(name: str, dims: str) -> str:
    return f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ {dims} ] }}'


def _python_config(name: str, max_batch: int, inputs: dict[str, str], outputs: dict[str, str],
                   extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch}\n'
            f"input [\n  " + ",\n  ".join(_tensor(n, d) for n, d in inputs.items()) + "\n]\n"
            "output [\n  " + ",\n  ".join(_tensor(n, d) for n, d in outputs.items()) + "\n]\n"
            'instance_group [{ kind: KIND_CPU, count: 1 }]\n' + extra)


ENSEMBLE_CONFIG = f'''name: "{ENSEMBLE}"
platform: "ensemble"
max_batch_size: 0
input [
  {_tensor("INPUT0", str(WIDTH))},
  {_tensor("INPUT1", str(WIDTH))}
]
output [
  {_tensor("OUTPUT0", str(WIDTH))}
]
ensemble_scheduling {{
  step [
    {{
      model_name: "add_sub"
      model_version: -1
      input_map {{ key: "INPUT0" value: "INPUT0" }}
      input_map {{ key: "INPUT1" value: "INPUT1" }}
      output_map {{ key: "OUTPUT0" value: "sum" }}
    }},
    {{
      model_name: "scale"
      model_version: -1
      input_map {{ key: "INPUT0" value: "sum" }}
      output_map {{ key: "OUTPUT0" value: "OUTPUT0" }}
    }}
  ]
}}
'''


def _write(repo: Path, name: str, config: str, model_py: str | None) -> None:
    d = repo / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "config.pbtxt").write_text(config)
    if model_py is not None:
        (d / "1" / "model.py").write_text(model_py.lstrip())


def build_repository(root: Path) -> Path:
    repo = root / "models"
    w = str(WIDTH)
    _write(repo, "add_sub", _python_config(
        "add_sub", 0, {"INPUT0": w, "INPUT1": w}, {"OUTPUT0": w, "OUTPUT1": w}), ADD_SUB)
    _write(repo, "identity_batched", _python_config(
        "identity_batched", 64, {"INPUT0": w}, {"OUTPUT0": w}, "dynamic_batching { }\n"),
        IDENTITY)
    big = f"1, {BIG}"
    _write(repo, "identity", _python_config("identity", 0, {"INPUT0": big}, {"OUTPUT0": big}),
           IDENTITY)
    _write(repo, "scale", _python_config("scale", 0, {"INPUT0": w}, {"OUTPUT0": w}), SCALE)
    _write(repo, ENSEMBLE, ENSEMBLE_CONFIG, None)
    return repo


def add_sub_inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.random(WIDTH, dtype=np.float32), rng.random(WIDTH, dtype=np.float32))


def in_process_add_sub(repo: Path, seconds: float) -> tuple[float, float, float, int]:
    """The add_sub model's execute() called directly in this process with Trireme's
    triton_python_backend_utils (one request per call): the ceiling of any server.
    Returns (p50 ms, p99 ms, calls/s, calls)."""
    import triton_python_backend_utils as pb_utils
    spec = importlib.util.spec_from_file_location("add_sub_model", repo / "add_sub/1/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = {"name": "add_sub", "max_batch_size": 0,
           "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [WIDTH]}
                      for n in ("OUTPUT0", "OUTPUT1")]}
    model = mod.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg), "model_name": "add_sub",
                      "model_instance_kind": "CPU", "model_instance_name": "add_sub_0",
                      "model_version": "1", "model_repository": str(repo / "add_sub")})
    a, b = add_sub_inputs()
    req = pb_utils.InferenceRequest(
        model_name="add_sub", inputs=[pb_utils.Tensor("INPUT0", a), pb_utils.Tensor("INPUT1", b)],
        requested_output_names=["OUTPUT0", "OUTPUT1"])
    (resp,) = model.execute([req])
    got = pb_utils.get_output_tensor_by_name(resp, "OUTPUT0").as_numpy()
    if not np.array_equal(got, a + b):
        raise AssertionError("in-process add_sub: wrong output")
    for _ in range(1000):
        model.execute([req])
    lat = []
    end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < end:
        s = time.perf_counter_ns()
        model.execute([req])
        lat.append(time.perf_counter_ns() - s)
    wall = time.perf_counter() - t0
    ms = np.asarray(lat, dtype=np.float64) / 1e6
    return (float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), len(lat) / wall,
            len(lat))
