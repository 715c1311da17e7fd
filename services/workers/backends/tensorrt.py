"""TensorRT backend: the only module that imports tensorrt.

Runs a serialized engine (`model.plan`, or `cc_model_filenames[<major>.<minor>]` for the GPU's
compute capability) through TensorRT's named-tensor API (TensorRT 10 and later): one execution
context on optimization profile 0, input shapes set per batch, execute_async_v3 on one stream.
Follows Triton's tensorrt_backend (src/instance_state.cc, model_state.cc, loader.cc,
tensorrt_utils.cc) for the GPU-only rule, auto-complete from the engine and error texts.

tensorrt (and torch, for CUDA memory) are imported when a backend object is made, so the
pure helpers below import, and are tested, on machines without either.

CUDA memory and streams come from torch.cuda rather than cupy: torch is already one of this
project's extras, its caching allocator makes the per-batch input and output buffers cheap,
it maps every TensorRT data type (BF16 included), and its tensors are what the rest of the
design uses for CUDA IPC.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from services.common.config import complete_io
from services.common.datatypes import numpy_dtype
from services.common.errors import Code, TriremeError, invalid_arg
from services.common.repository import model_file
from services.workers.backends.base import BackendBase
from services.workers.backends.common import device_unsupported, ignore_read_only_warning

log = logging.getLogger(__name__)

# Inputs may be read-only views on shared memory: only ever copied to the GPU, never written.
ignore_read_only_warning()

# TensorRT DataType member name -> API datatype (Triton's ConvertTrtTypeToDataType). FP8, INT4
# and the other packed types have no Triton datatype: such an engine cannot be served.
TRT_TYPES = {
    "FLOAT": "FP32", "HALF": "FP16", "BF16": "BF16", "INT8": "INT8", "UINT8": "UINT8",
    "INT32": "INT32", "INT64": "INT64", "BOOL": "BOOL",
}


def compute_capability(major: int, minor: int) -> str:
    """The key of cc_model_filenames: "<major>.<minor>", e.g. "8.6" (Triton's format)."""
    return f"{major}.{minor}"


def api_datatype(trt_type: str, tensor: str) -> str:
    """API datatype of a tensor whose TensorRT type is named `trt_type` ("FLOAT", ...)."""
    datatype = TRT_TYPES.get(trt_type)
    if datatype is None:
        raise invalid_arg(f"unsupported TensorRT datatype {trt_type} for tensor '{tensor}'")
    return datatype


def engine_max_batch(max_first_dims: Sequence[int]) -> int:
    """Triton's GetProfileMaxBatchSize: the largest batch every input's profile allows
    (the first dimension of each input's kMAX shape), 0 for an engine without inputs."""
    return min(max_first_dims, default=0)


def check_max_batch(name: str, configured: int, engine_max: int) -> None:
    """A configured max_batch_size above what the engine's profile takes (Triton's text)."""
    if configured > engine_max:
        raise invalid_arg(f"autofill failed for model '{name}': configuration specified max-batch "
                          f"{configured} but TensorRT engine only supports max-batch {engine_max}")


def _logger_class(trt):
    class _Logger(trt.ILogger):
        """Forwards TensorRT's log to ours and keeps the last error for load failures
        (Triton's TensorRTLogger::LastErrorMsg)."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.last_error = ""

        def log(self, severity, msg: str) -> None:
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.last_error = msg
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)

    return _Logger


class TensorRTBackend(BackendBase):
    def __init__(self, cfg, load) -> None:
        import tensorrt as trt  # ImportError here -> UNAVAILABLE with the install hint
        import torch

        self._torch = torch
        self.name = load.instance_name
        if load.kind != "KIND_GPU":   # Triton's ModelInstanceState check and text
            raise device_unsupported(cfg.name, "TensorRT", "GPU")
        if not torch.cuda.is_available():   # never run a KIND_GPU instance anywhere else
            raise TriremeError(Code.UNAVAILABLE, (
                f"model '{cfg.name}' needs a CUDA GPU for TensorRT, but torch sees none "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda}); install "
                "\"trireme[tensorrt]\" with a CUDA build of torch on a machine with a GPU"))
        # The scheduler sets CUDA_VISIBLE_DEVICES to the instance's GPU: it is always cuda:0.
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        cc = compute_capability(*torch.cuda.get_device_capability(self.device))
        path = model_file(cfg, load.model_dir, load.version, cc=cc)

        self._logger = _logger_class(trt)()
        self.runtime = trt.Runtime(self._logger)
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:   # Triton's LoadPlan text
            raise invalid_arg(f"unable to create TensorRT engine: {self._logger.last_error}")

        inputs, outputs, max_dims = [], [], []
        for i in range(self.engine.num_io_tensors):
            tname = self.engine.get_tensor_name(i)
            if self.engine.is_shape_inference_io(tname):
                raise invalid_arg(f"model '{cfg.name}': shape tensor '{tname}' is not supported")
            shape = list(self.engine.get_tensor_shape(tname))
            spec = (tname, api_datatype(self.engine.get_tensor_dtype(tname).name, tname), shape)
            if self.engine.get_tensor_mode(tname) == trt.TensorIOMode.INPUT:
                inputs.append(spec)
                if shape:   # a static first dimension is its own limit
                    top = self.engine.get_tensor_profile_shape(tname, 0)[2]
                    max_dims.append(shape[0] if shape[0] >= 0 else top[0])
            else:
                outputs.append(spec)
        engine_max = engine_max_batch(max_dims)
        # Triton fills max_batch_size with the profile's largest batch (not a default of 4).
        self.config = (complete_io(cfg, inputs, outputs, default_max_batch_size=engine_max)
                       if load.autocomplete else cfg)
        check_max_batch(cfg.name, self.config.max_batch_size, engine_max)

        self._types = {n: dt for n, dt, _ in (*inputs, *outputs)}
        self._inputs = [n for n, _, _ in inputs]
        self._outputs = [n for n, _, _ in outputs]
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream(self.device)
        self.context.set_optimization_profile_async(0, self.stream.cuda_stream)

    def _torch_dtype(self, datatype: str):
        torch = self._torch
        return {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16,
                "INT8": torch.int8, "UINT8": torch.uint8, "INT32": torch.int32,
                "INT64": torch.int64, "BOOL": torch.bool}[datatype]

    def _to_device(self, arr: np.ndarray):
        torch = self._torch
        arr = np.ascontiguousarray(arr)
        bf16 = arr.dtype == numpy_dtype("BF16")   # numpy has no bf16 torch knows: move bits
        host = torch.from_numpy(arr.view(np.int16) if bf16 else arr)
        dev = host.to(self.device, non_blocking=True)
        return dev.view(torch.bfloat16) if bf16 else dev

    def _to_host(self, t) -> np.ndarray:
        if t.dtype == self._torch.bfloat16:
            return t.view(self._torch.int16).numpy().view(numpy_dtype("BF16"))
        return t.numpy()

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        torch = self._torch
        missing = [n for n in self._inputs if n not in inputs]
        if missing:
            raise TriremeError(Code.INTERNAL, f"missing inputs {missing} for {self.name}")
        buffers = {}   # device tensors, held until the stream is done with them
        with torch.cuda.stream(self.stream):
            for name in self._inputs:
                arr = inputs[name]
                if arr.dtype != numpy_dtype(self._types[name]):   # TensorRT reads raw bytes
                    raise TriremeError(Code.INTERNAL, (
                        f"input '{name}' is {arr.dtype}, the engine of {self.name} expects "
                        f"{self._types[name]}"))
                buffers[name] = self._to_device(arr)
                if not self.context.set_input_shape(name, tuple(arr.shape)):
                    raise TriremeError(Code.INTERNAL, (   # (TensorRT logs why)
                        f"trt failed to set the shape {list(arr.shape)} for input '{name}' for "
                        f"{self.name}"))
                self.context.set_tensor_address(name, buffers[name].data_ptr())
            for name in self._outputs:   # every output needs an address, asked for or not
                shape = tuple(self.context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise TriremeError(Code.INTERNAL, (
                        f"output '{name}' of {self.name} has a data-dependent shape "
                        f"{list(shape)}, which this backend does not support"))
                buffers[name] = torch.empty(shape, dtype=self._torch_dtype(self._types[name]),
                                            device=self.device)
                self.context.set_tensor_address(name, buffers[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):   # Triton's text
                raise TriremeError(Code.INTERNAL, f"unable to enqueue for inference {self.name}")
            host = {n: buffers[n].to("cpu", non_blocking=True) for n in outputs}
        self.stream.synchronize()
        return {n: self._to_host(t) for n, t in host.items()}

    def close(self) -> None:
        # TensorRT wants the context gone before its engine, and the engine before its runtime.
        self.context = None
        self.engine = None
        self.runtime = None


BACKEND = TensorRTBackend
