"""ONNX Runtime backend: the only module that imports onnxruntime."""
from __future__ import annotations

import ctypes
import logging
import math
from typing import Any

import numpy as np
import onnxruntime as ort

from services.common.config import complete_io
from services.common.datatypes import numpy_dtype
from services.common.errors import Code, TriremeError, invalid_arg
from services.common.repository import model_file
from services.workers.backends.base import BackendBase
from services.workers.backends.common import gpu_unavailable, int_value, param

log = logging.getLogger(__name__)

_BF16 = numpy_dtype("BF16")   # ml_dtypes.bfloat16
_ONNX_BFLOAT16 = 16            # onnx.TensorProto.BFLOAT16 (onnx itself is not a runtime dependency)

_ORT_TYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES", "tensor(bfloat16)": "BF16",
}


def _io(args: list[Any]) -> list[tuple[str, str, list[int]]]:
    out = []
    for a in args:
        datatype = _ORT_TYPES.get(a.type)
        if datatype is None:
            raise invalid_arg(f"unsupported ONNX type {a.type} for '{a.name}'")
        shape = [d if isinstance(d, int) and d >= 0 else -1 for d in (a.shape or [])]
        out.append((a.name, datatype, shape))
    return out


def _int_param(cfg, key: str) -> int | None:
    value = param(cfg, key)
    if not value:   # unset or empty
        return None
    return int_value(value, f"parameter '{key}' must be an integer, got '{value}'")


class OnnxRuntimeBackend(BackendBase):
    def __init__(self, cfg, load) -> None:
        # The repository's rule: default_model_filename, and a model.onnx directory
        # (Triton's large-model layout) means <dir>/model.onnx.
        path = model_file(cfg, load.model_dir, load.version)
        opts = ort.SessionOptions()
        # Triton's onnxruntime backend parameter names.
        intra = _int_param(cfg, "intra_op_thread_count")
        inter = _int_param(cfg, "inter_op_thread_count")
        if intra:
            opts.intra_op_num_threads = intra
        if inter:
            opts.inter_op_num_threads = inter
        # Idle intra-op threads spin for a while after each run by default. Beside frontends
        # and other workers on the same cores that spinning takes CPU they need, so it is
        # off unless the config asks for it (parameter "allow_spinning": "1").
        spin = param(cfg, "allow_spinning", "0")
        opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
        opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
        providers = ["CPUExecutionProvider"]
        if load.kind == "KIND_GPU":
            providers = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), opts, providers=providers)
        if load.kind == "KIND_GPU" and self.session.get_providers()[0] != "CUDAExecutionProvider":
            # ORT silently falls back to the CPU; a KIND_GPU instance on the CPU is a lie.
            raise gpu_unavailable(cfg.name, "ONNX Runtime could not use CUDA (available "
                                  f"providers: {ort.get_available_providers()})",
                                  '"trireme[onnx-gpu]"')
        inputs = _io(self.session.get_inputs())
        outputs = _io(self.session.get_outputs())
        # An initializer that is also a graph input: a config may declare it (optional) and
        # a request may override it (Triton's qa/L0_initializer_as_input).
        overridable = _io(self.session.get_overridable_initializers())
        self.config = complete_io(cfg, inputs, outputs, overridable=overridable) \
            if load.autocomplete else cfg
        self._string_inputs = {n for n, dt, _ in inputs if dt == "BYTES"}
        # ORT's Python API takes and gives no bfloat16 numpy array: a model with BF16 inputs
        # or outputs runs through OrtValues (_run_bf16), the others through run() as before.
        self._bf16 = any(dt == "BF16" for _, dt, _ in (*inputs, *outputs))

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        for name in self._string_inputs & inputs.keys():
            # ORT string tensors want str objects; the wire gives bytes.
            inputs[name] = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(
                inputs[name]) if inputs[name].size else inputs[name]
        try:
            results = self._run_bf16(outputs, inputs) if self._bf16 else \
                self.session.run(outputs, inputs)
        except (ort.capi.onnxruntime_pybind11_state.Fail,
                ort.capi.onnxruntime_pybind11_state.InvalidArgument,
                ort.capi.onnxruntime_pybind11_state.RuntimeException) as e:
            raise TriremeError(Code.INTERNAL, f"onnx runtime error: {e}") from e
        return dict(zip(outputs, results))

    def _run_bf16(self, outputs: list[str], inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """run() through OrtValues: a BF16 array goes in as its 16-bit words typed BFLOAT16,
        and a BF16 result comes out as a copy of its buffer (OrtValue.numpy() has no type
        for it), viewed as ml_dtypes.bfloat16 like every BF16 tensor here."""
        feed = {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(arr).view(np.uint16), _ONNX_BFLOAT16)
                if arr.dtype == _BF16 else ort.OrtValue.ortvalue_from_numpy(arr)
                for name, arr in inputs.items()}
        out = []
        for value in self.session.run_with_ort_values(outputs, feed):
            if value.data_type() == "tensor(bfloat16)":
                shape = value.shape()
                words = np.ctypeslib.as_array(
                    (ctypes.c_uint16 * math.prod(shape)).from_address(value.data_ptr())) \
                    if math.prod(shape) else np.empty(0, np.uint16)
                out.append(words.copy().view(_BF16).reshape(shape))   # (copied: value goes)
            else:
                out.append(value.numpy())
        return out

    def close(self) -> None:
        self.session = None


BACKEND = OnnxRuntimeBackend
