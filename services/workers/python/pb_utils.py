"""`triton_python_backend_utils` as a Python model sees it (imported as pb_utils).

The names, signatures and texts follow Triton's python_backend (../shared/reference/protocol.md §8)
so that Triton's own example models run unmodified. The worker installs this module under
the name ``triton_python_backend_utils`` before it imports a model.py; the top-level shim
of the same name makes it importable elsewhere (tests, a model author's editor).

Tensors wrap numpy arrays without copies: a request's inputs are views on the message's
frame or shared-memory block they arrived in, valid for as long as the model holds them.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from services.common import datatypes as dt
from services.common.errors import expects_datatype_text
from services.workers.python import dlpack as _dlpack
from services.workers.python.pb_errors import TritonError as TritonError
from services.workers.python.pb_errors import TritonModelException as TritonModelException
from services.workers.python.pb_metrics import Metric as Metric
from services.workers.python.pb_metrics import MetricFamily as MetricFamily

# --------------------------------------------------------------------------- constants
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_CPU, TRITONSERVER_MEMORY_CPU_PINNED, TRITONSERVER_MEMORY_GPU = 0, 1, 2

# TYPE_* names and numbers of model_config.proto (triton_dtype() returns the number)
_TYPE_NUMBERS = {"TYPE_BOOL": 1, "TYPE_UINT8": 2, "TYPE_UINT16": 3, "TYPE_UINT32": 4,
                 "TYPE_UINT64": 5, "TYPE_INT8": 6, "TYPE_INT16": 7, "TYPE_INT32": 8,
                 "TYPE_INT64": 9, "TYPE_FP16": 10, "TYPE_FP32": 11, "TYPE_FP64": 12,
                 "TYPE_STRING": 13, "TYPE_BF16": 14}
_API_OF_NUMBER = {n: ("BYTES" if k == "TYPE_STRING" else k[5:]) for k, n in _TYPE_NUMBERS.items()}

def _no_bls() -> Any:
    raise TritonModelException("BLS and model control need a running Trireme worker")


# The worker fills these in (services/workers/python/backend.py); models never touch them.
_bls: Any = _no_bls         # () -> the BLS client of this worker, started on first use
_model_name = ""


# ------------------------------------------------------------------------------ tensors
class Tensor:
    """A named numpy array. BF16 tensors hold an ml_dtypes.bfloat16 array, which as
    Triton's Python backend does they hand out through DLPack only (as_numpy() refuses
    them with Triton's text; torch.from_dlpack(t.to_dlpack()) is a torch.bfloat16 tensor)."""

    def __init__(self, name: str, array: Any, *_: Any) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(
                f"Tensor '{name}' expects a numpy array; use Tensor.from_dlpack for other types")
        if array.dtype.kind in "SU":   # fixed-width strings: keep every byte (see serialize)
            array = array.astype(object)
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._array.dtype == _dlpack.BF16:
            raise TritonModelException("Tensor dtype is BF16 and cannot be converted to NumPy. "
                                       "Use to_dlpack() and from_dlpack() instead.")
        return self._array

    def _numpy(self) -> np.ndarray:
        """The array whatever its dtype: the worker's own use (BF16 included)."""
        return self._array

    def triton_dtype(self) -> int:
        return _TYPE_NUMBERS["TYPE_STRING" if self.datatype() == "BYTES" else f"TYPE_{self.datatype()}"]

    def datatype(self) -> str:
        return dt.datatype_of(self._array.dtype)

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        arr = self._array
        if arr.dtype == object:
            raise TritonModelException("DLPack does not have support for string tensors.")
        if not arr.flags.writeable:   # DLPack cannot say "read-only": hand out a copy
            arr = arr.copy()
        return _dlpack.to_capsule(arr)

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self.to_dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)   # kDLCPU, device 0

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor on the memory of a DLPack capsule, or of an object with __dlpack__ and
        __dlpack_device__ (a torch tensor: torch.bfloat16 becomes BF16), without a copy."""
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        try:
            return Tensor(name, _dlpack.from_object(capsule))
        except _dlpack.DLPackError as e:
            raise TritonModelException(str(e)) from None

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self.datatype()}, {self.shape()})"


# ------------------------------------------------------------------------------ requests
class InferenceTrace:
    """A request's trace, as a model sees it: Triton's only method, get_context() (the
    OpenTelemetry context; None here). Passed on to a BLS request it makes no child trace,
    as Triton 2.51 writes none."""

    def get_context(self) -> str | None:
        return None


class InferenceRequest:
    """A request the model receives in execute(), or one it builds for BLS (exec)."""

    def __init__(self, model_name: str = "", inputs: Iterable[Tensor] = (),
                 requested_output_names: Iterable[str] = (), request_id: str = "",
                 correlation_id: int | str = 0, model_version: int = -1, flags: int = 0,
                 timeout: int = 0, preferred_memory: Any = None, trace: Any = None,
                 parameters: dict | str | None = None, **_: Any) -> None:
        self._model_name, self._model_version = model_name, model_version
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)
        self._id, self._corr, self._flags, self._timeout = request_id, correlation_id, flags, timeout
        if isinstance(parameters, str):
            parameters = json.loads(parameters)
        self._parameters = dict(parameters or {})
        self._sender: InferenceResponseSender | None = None
        self._flag: Any = None   # the worker's cancel flag (services/workers/python/cancel.py)
        self._trace = trace if trace is not None else InferenceTrace()

    def trace(self) -> InferenceTrace:
        return self._trace

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._corr

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return json.dumps(self._parameters, separators=(",", ":"))   # (compact, as Triton's)

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("get_response_sender is only available for requests "
                                       "the model receives in execute()")
        return self._sender

    def is_cancelled(self) -> bool:
        """True once the client went away (a cancelled gRPC call or stream, a deadline, a
        closed connection); the model may stop and answer with TritonError.CANCELLED."""
        flag = self._flag
        return flag is not None and flag.cancelled

    def set_release_flags(self, flags: int) -> None:
        """Request rescheduling is not supported: the request is released after execute."""

    def exec(self, decoupled: bool = False) -> Any:
        """BLS: run this request on another model through the scheduler. Returns an
        InferenceResponse (errors inside it), or an iterator of them when decoupled."""
        return _bls().exec(self, decoupled)

    async def async_exec(self, decoupled: bool = False) -> Any:
        return await _bls().async_exec(self, decoupled)


class InferenceResponse:
    def __init__(self, output_tensors: Iterable[Tensor] = (), error: TritonError | None = None,
                 parameters: dict | str | None = None) -> None:
        self._outputs = list(output_tensors)
        self._error = error
        if isinstance(parameters, str):
            parameters = json.loads(parameters)
        self._parameters = dict(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters, separators=(",", ":"))   # (compact, as Triton's)


class InferenceResponseSender:
    """Sends a request's responses as the model makes them (decoupled models, or any model
    whose execute returns None); the last send carries TRITONSERVER_RESPONSE_COMPLETE_FINAL."""

    def __init__(self, send: Any, flag: Any = None) -> None:
        self._send = send        # (response | None, final: bool) -> None, thread-safe
        self._closed = False
        self._flag = flag        # shared with the request (see InferenceRequest.is_cancelled)

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("Inference Response object must be provided when the "
                                       "response flags is not TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        self._closed = final
        self._send(response, final)

    def is_cancelled(self) -> bool:
        flag = self._flag
        return flag is not None and flag.cancelled


# ------------------------------------------------------------------------------ helpers
def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((c for c in model_config.get("input", []) if c["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((c for c in model_config.get("output", []) if c["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_string_to_numpy(triton_type_string: str) -> Any:
    if triton_type_string == "TYPE_STRING":
        return np.object_
    if triton_type_string == "TYPE_BOOL":
        return bool
    return dt.numpy_dtype(triton_type_string[5:]).type


def triton_to_numpy_type(data_type: int) -> Any:
    api = _API_OF_NUMBER.get(data_type)
    return None if api is None else (np.object_ if api == "BYTES" else dt.numpy_dtype(api).type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    try:
        api = dt.datatype_of(np.dtype(data_type))
    except Exception:  # noqa: BLE001 - not a type numpy or Triton knows: None, as Triton's
        return None
    return _TYPE_NUMBERS["TYPE_STRING" if api == "BYTES" else f"TYPE_{api}"]


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | tuple:
    """Triton's framing (<u4 length + bytes per element, C order) as a uint8 array."""
    if input_tensor.size == 0:
        return ()
    return np.frombuffer(dt.serialize_bytes_tensor(input_tensor), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray:
    return dt.deserialize_bytes_tensor(memoryview(encoded_tensor).cast("B"))


# ------------------------------------------------------------------ model repository (BLS)
def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    _bls().control("load", model_name, config, files or {})


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _bls().control("unload", model_name, unload_dependents)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    return _bls().control("ready", model_name, model_version)


# ------------------------------------------------------------------ auto-complete config
class ModelConfig:
    """What auto_complete_config(auto_complete_model_config) receives and returns: the
    model configuration as Triton's JSON, with the setters Triton allows."""

    def __init__(self, model_config: str | dict) -> None:
        self._cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._cfg.setdefault("input", [])
        self._cfg.setdefault("output", [])
        self._cfg.setdefault("max_batch_size", 0)

    def _name(self) -> str:
        return self._cfg.get("name", "")

    def as_dict(self) -> dict:
        return self._cfg

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if self._cfg["max_batch_size"] > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {self._cfg['max_batch_size']}, "
                             f"but in auto-complete-config function for model '{self._name()}' "
                             f"specified max_batch_size {max_batch_size}")
        self._cfg["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._cfg:
                raise ValueError(f"Configuration specified scheduling_choice as '{other}', but "
                                 f"auto-complete-config function for model '{self._name()}' "
                                 "tries to set scheduling_choice as 'dynamic_batching'")
        self._cfg.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        policy = self._cfg.setdefault("model_transaction_policy", {})
        for key, value in transaction_policy_dict.items():
            if key != "decoupled":
                raise ValueError(f"model transaction property in auto-complete-config function "
                                 f"for model '{self._name()}' contains property other than "
                                 "'decoupled'")
            policy[key] = value

    def add_input(self, input: dict) -> None:
        self._add("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add("output", output, ("name", "data_type", "dims"))

    def _add(self, kind: str, io: dict, allowed: tuple[str, ...]) -> None:
        name, model = io.get("name", ""), self._name()
        if set(io) - set(allowed):
            listed = ", ".join(f"'{a}'" for a in allowed[:-1]) + f" and '{allowed[-1]}'"
            raise ValueError(f"{kind} '{name}' in auto-complete-config function for model "
                             f"'{model}' contains property other than {listed}.")
        if "name" not in io:
            raise ValueError(f"{kind} in auto-complete-config function for model '{model}' is "
                             "missing 'name' property.")
        for prop in ("data_type", "dims"):
            if prop not in io:
                raise ValueError(f"{kind} '{name}' in auto-complete-config function for model "
                                 f"'{model}' is missing '{prop}' property.")
        for cur in self._cfg[kind]:
            if cur["name"] != name:
                continue
            if cur.get("data_type", "TYPE_INVALID") not in ("TYPE_INVALID", io["data_type"]):
                raise ValueError(expects_datatype_text(model, kind, name, cur["data_type"],
                                                       io["data_type"]))
            if cur.get("dims") and [int(d) for d in cur["dims"]] != [int(d) for d in io["dims"]]:
                raise ValueError(f"model '{model}', tensor '{name}': the model expects dims "
                                 f"{list(io['dims'])} but the model configuration specifies dims "
                                 f"{list(cur['dims'])}")
            cur.update(io)
            return
        self._cfg[kind].append(dict(io))


# ------------------------------------------------------------------------------ logging
class LogLevel:
    INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3


_LEVELS = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING,
           LogLevel.ERROR: logging.ERROR, LogLevel.VERBOSE: logging.DEBUG}


class Logger:
    """Lines go to the worker's log, which the server's log collects, tagged by model."""

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        logging.getLogger(f"trireme.model.{_model_name}").log(_LEVELS.get(level, logging.INFO), message)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)
