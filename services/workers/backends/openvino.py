"""OpenVINO backend: the only module that imports openvino.

Follows Triton's openvino_backend (src/openvino.cc, openvino_utils.cc): `model.xml` + `.bin`
read with ov.Core, compiled for the CPU device only, Triton's parameter names and error texts,
one infer request per instance. Differs where noted: with max_batch_size > 0 the batch
dimension is made dynamic (Triton fixes it at max_batch_size and refuses smaller batches unless
padding is on; SKIP_OV_DYNAMIC_BATCHSIZE=YES keeps that behaviour), and auto-complete uses the
shared rules of complete_io (a dynamic first dimension means batching) instead of layouts.
String tensors (ov.Type.string) are served as BYTES, which Triton's OpenVINO backend does not do.
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops15  # StringTensorPack / StringTensorUnpack
from openvino.preprocess import PrePostProcessor

from protos import model_config_pb2 as mc
from services.common.config import complete_io
from services.common.datatypes import api_to_config, config_to_api, numpy_dtype
from services.common.errors import (
    Code,
    TriremeError,
    expects_datatype_text,
    expects_inputs_text,
    invalid_arg,
    unexpected_io_text,
    unsupported_io_datatype_text,
)
from services.common.repository import model_file
from services.workers.backends.base import BackendBase
from services.workers.backends.common import all_params, device_unsupported, model_dims, model_inputs

# OpenVINO element type name -> API datatype. Triton's set, plus FP64, BF16 and strings, which
# the CPU plugin runs too.
_TYPES = {
    "boolean": "BOOL", "u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "u64": "UINT64",
    "i8": "INT8", "i16": "INT16", "i32": "INT32", "i64": "INT64",
    "f16": "FP16", "f32": "FP32", "f64": "FP64", "bf16": "BF16", "string": "BYTES",
}
_OV_TYPES = {api: getattr(ov.Type, name) for name, api in _TYPES.items()}
# A string tensor crosses the Python boundary as three plain tensors (StringTensorPack's
# inputs, StringTensorUnpack's outputs): OpenVINO's own string conversion goes through
# numpy's fixed-width bytes, which drop trailing NUL bytes, and decodes outputs as UTF-8.
_PARTS = (":begins", ":ends", ":symbols")


def _ov_message(e: Exception) -> str:
    """OpenVINO's text without its "Exception from src/...:N:" source-location lines."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    keep = [ln for ln in lines if ln and not ln.startswith(("Exception from ", "Check '"))]
    return " ".join(keep) or str(e).strip()


def _ov_error(code: Code, what: str, e: Exception) -> TriremeError:
    return TriremeError(code, f"openvino error in {what} : {_ov_message(e)}")  # Triton's form


# ------------------------------------------------------------------------- parameters
def _flag(params: dict[str, str], key: str) -> bool:
    """Triton's ParseBoolParameter: "yes" in any case is true, anything else false."""
    return params.get(key, "").lower() == "yes"


def _number(key: str, value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise invalid_arg(f"expected the parameter '{key}' to be a non-negative number, got "
                          f"{value}")
    return int(value)


def _properties(params: dict[str, str]) -> dict[str, object]:
    """Triton's ParseParameterHelper: config parameters -> OpenVINO CPU properties.
    Values are compared in lower case and quoted that way in errors, as Triton does."""
    props: dict[str, object] = {}
    for key in ("INFERENCE_NUM_THREADS", "COMPILATION_NUM_THREADS"):
        if value := params.get(key, "").lower():
            props[key] = _number(key, value)
    if value := params.get("HINT_BF16", "").lower():
        if value != "yes":
            raise invalid_arg(f"expected the parameter 'HINT_BF16' to be YES, got {value}")
        props["INFERENCE_PRECISION_HINT"] = ov.Type.bf16
    if value := params.get("NUM_STREAMS", "").lower():
        if value in ("auto", "numa"):
            props["NUM_STREAMS"] = value.upper()
        elif value.isascii() and value.isdigit():
            props["NUM_STREAMS"] = int(value)
        else:
            raise invalid_arg("expected the parameter 'NUM_STREAMS' to be either "
                              f"AUTO/NUMA/<int_value>, got {value}")
    if value := params.get("PERFORMANCE_HINT", "").lower():
        if value not in ("latency", "throughput", "cumulative_throughput"):
            raise invalid_arg("expected the parameter 'PERFORMANCE_HINT' to be "
                              f"LATENCY/THROUGHPUT/CUMULATIVE_THROUGHPUT, got {value}")
        props["PERFORMANCE_HINT"] = value.upper()
    return props


# ---------------------------------------------------------------------------- shapes
def _reshape(model: ov.Model, cfg, static_batch: bool, reshape_io: bool) -> None:
    """Give each input the batch dimension the server needs and, with RESHAPE_IO_LAYERS,
    the config's dims (-1: dynamic) after it."""
    mbs = cfg.max_batch_size
    dims = {io.name: model_dims(io) for io in cfg.input} if reshape_io else {}
    flat = _flat_inputs(cfg)
    new = {}
    for port in model.inputs:
        if flat & port.get_names():   # one dimension of elements, no batch dimension
            continue
        shape = port.get_partial_shape()
        want = list(shape)
        name = next((n for n in port.get_names() if n in dims), "")
        if name:
            off = 1 if mbs > 0 else 0
            if len(want) != off + len(dims[name]):
                raise invalid_arg(f"model '{cfg.name}', tensor '{name}': cannot reshape the "
                                  f"model's shape {shape} to the configuration's dims {dims[name]}")
            want[off:] = [ov.Dimension(d) if d > 0 else ov.Dimension() for d in dims[name]]
        if mbs > 0 and want:
            # Dynamic: any batch up to max_batch_size runs as it is. Static (Triton's only
            # mode): the model is compiled for exactly max_batch_size.
            want[0] = ov.Dimension(mbs) if static_batch else ov.Dimension()
        if ov.PartialShape(want) != shape:
            new[port] = ov.PartialShape(want)
    if new:
        try:
            model.reshape(new)
        except RuntimeError as e:
            what = ", ".join(f"{p.get_any_name()} {s}" for p, s in new.items())
            raise _ov_error(Code.INVALID_ARG, f"reshaping the inputs to {what}", e) from e


def _flat_inputs(cfg) -> set[str]:
    """Inputs the worker feeds as one flat dimension: ragged inputs and batch inputs."""
    return ({io.name for io in cfg.input if io.allow_ragged_batch}
            | {t for b in cfg.batch_input for t in b.target_name})


def _specs(ports, batch: int) -> list[tuple[str, str, list[int]]]:
    """(name, API datatype, shape with -1 for dynamic dims) for complete_io. A first
    dimension fixed at `batch` (a static batch of max_batch_size) is the server's batch
    dimension, so it reads as -1 too."""
    out = []
    for port in ports:
        name = port.get_any_name()
        datatype = _TYPES.get(port.get_element_type().get_type_name())
        if datatype is None:
            raise invalid_arg(f"unsupported OpenVINO element type {port.get_element_type()} for "
                              f"'{name}'")
        shape = [-1 if d.is_dynamic else d.get_length() for d in port.get_partial_shape()]
        if batch and shape and shape[0] == batch:
            shape[0] = -1
        out.append((name, datatype, shape))
    return out


def _string_io(model: ov.Model) -> tuple[set[str], set[str]]:
    """Rewrites, in place, each string input into three (begins, ends, symbols) feeding a
    StringTensorPack, and each string output into the three outputs of a
    StringTensorUnpack; the new tensors are named "<name>:begins" etc. Returns the names
    of the string inputs and outputs (every name each one has)."""
    string = ov.Type.string
    outs: set[str] = set()
    # Outputs first: a string input returned as it is keeps the output's names.
    for result in [r for r in model.get_results() if r.get_element_type() == string]:
        names = result.output(0).get_names()
        unpack = ops15.string_tensor_unpack(result.input_value(0))
        parts = []
        for i, suffix in enumerate(_PARTS):
            unpack.output(i).get_tensor().set_names({n + suffix for n in names})
            parts.append(ops15.result(unpack.output(i)))
        model.remove_result(result)
        model.add_results(parts)
        outs |= names
    ins: set[str] = set()
    for param in [p for p in model.get_parameters() if p.get_element_type() == string]:
        names, shape = param.output(0).get_names(), param.get_partial_shape()
        parts = [ops15.parameter(shape, ov.Type.i32), ops15.parameter(shape, ov.Type.i32),
                 ops15.parameter([-1], ov.Type.u8)]
        for part, suffix in zip(parts, _PARTS):
            part.output(0).get_tensor().set_names({n + suffix for n in names})
        pack = ops15.string_tensor_pack(*(part.output(0) for part in parts))
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(pack.output(0))
        model.remove_parameter(param)
        model.add_parameters(parts)
        ins |= names
    if ins or outs:
        model.validate_nodes_and_infer_types()
    return ins, outs


def _pack(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A BYTES array as (begins, ends, symbols): offsets into one buffer of every element."""
    items = [v.encode() if isinstance(v, str) else v for v in arr.ravel().tolist()]
    lengths = np.fromiter(map(len, items), np.int32, len(items))
    ends = np.cumsum(lengths, dtype=np.int32)
    symbols = np.frombuffer(b"".join(items), np.uint8)
    return (ends - lengths).reshape(arr.shape), ends.reshape(arr.shape), symbols


def _unpack(begins: np.ndarray, ends: np.ndarray, symbols: np.ndarray) -> np.ndarray:
    buf = symbols.tobytes()
    out = np.empty(begins.shape, dtype=object)
    out.reshape(-1)[:] = [buf[b:e] for b, e in zip(begins.ravel().tolist(), ends.ravel().tolist())]
    return out


def _match_config(model: ov.Model, cfg) -> ov.Model:
    """Triton's ValidateInputs/ValidateOutputs: the config names every input, each configured
    tensor exists, and its configured data type becomes the tensor type (OpenVINO inserts the
    conversion)."""
    # (batch inputs too: Triton's OpenVINO backend has none)
    inputs = [(io.name, io.data_type) for io in model_inputs(cfg)]
    if len(inputs) != len(model.inputs):
        raise invalid_arg(expects_inputs_text(cfg.name, len(inputs), len(model.inputs)))
    ppp = PrePostProcessor(model)
    changed = False
    outputs = [(io.name, io.data_type) for io in cfg.output]
    for kind, ios, ports, side in (("input", inputs, model.inputs, ppp.input),
                                   ("output", outputs, model.outputs, ppp.output)):
        names = {n: p for p in ports for n in p.get_names()}
        for name, data_type in ios:
            port = names.get(name)
            if port is None:
                raise invalid_arg(unexpected_io_text(kind, name, [p.get_any_name() for p in ports]))
            config_type = mc.DataType.Name(data_type)
            want = _OV_TYPES.get(config_to_api(config_type))
            if want is None:
                raise invalid_arg(unsupported_io_datatype_text(config_type, kind, name, cfg.name))
            if port.get_element_type() != want:
                if ov.Type.string in (want, port.get_element_type()):   # no conversion exists
                    have = api_to_config(_TYPES[port.get_element_type().get_type_name()])
                    raise invalid_arg(expects_datatype_text(cfg.name, kind, name, config_type,
                                                            have))
                side(name).tensor().set_element_type(want)
                changed = True
    if not changed:
        return model
    try:
        return ppp.build()
    except RuntimeError as e:
        raise _ov_error(Code.INVALID_ARG, "apply model preprocessing", e) from e


# --------------------------------------------------------------------------- backend
class OpenVINOBackend(BackendBase):
    def __init__(self, cfg, load) -> None:
        if load.kind != "KIND_CPU":   # Triton's ModelInstanceState check and text
            raise device_unsupported(cfg.name, "Triton openVINO", "CPU")
        params = all_params(cfg)
        static = _flag(params, "SKIP_OV_DYNAMIC_BATCHSIZE")
        reshape_io = _flag(params, "RESHAPE_IO_LAYERS")
        self._pad = _flag(params, "ENABLE_BATCH_PADDING")
        props = _properties(params)
        path = model_file(cfg, load.model_dir, load.version)
        core = ov.Core()
        if ext := params.get("CPU_EXTENSION_PATH", ""):
            try:
                core.add_extension(ext)
            except RuntimeError as e:
                raise _ov_error(Code.INVALID_ARG, "loading custom CPU extensions", e) from e
        try:
            model = core.read_model(str(path))
        except RuntimeError as e:
            raise _ov_error(Code.INVALID_ARG, "reading model", e) from e
        _reshape(model, cfg, static, reshape_io)
        batch = cfg.max_batch_size if static else 0
        inputs, outputs = _specs(model.inputs, batch), _specs(model.outputs, batch)
        self.config = complete_io(cfg, inputs, outputs) if load.autocomplete else cfg
        if self.config.max_batch_size != cfg.max_batch_size:   # auto-complete turned batching on
            _reshape(model, self.config, static, reshape_io)
        model = _match_config(model, self.config)
        string_in, string_out = _string_io(model)
        try:
            compiled = core.compile_model(model, "CPU", props)
        except RuntimeError as e:
            raise _ov_error(Code.INVALID_ARG, "loading model", e) from e
        # One request: a worker runs one batch at a time (Triton: one per instance too).
        self.request = compiled.create_infer_request()
        # By the config's names (a port may have several): they are what requests use.
        # A string tensor's entry is its three parts.
        self._inputs = {io.name: tuple(compiled.input(io.name + s) for s in _PARTS)
                        if io.name in string_in else compiled.input(io.name)
                        for io in model_inputs(self.config)}
        self._outputs = {io.name: tuple(compiled.output(io.name + s) for s in _PARTS)
                         if io.name in string_out else compiled.output(io.name)
                         for io in self.config.output}
        self._dtypes = {name: numpy_dtype(_TYPES[p.get_element_type().get_type_name()])
                        for name, p in (*self._inputs.items(), *self._outputs.items())
                        if not isinstance(p, tuple)}
        self._static_batch = self.config.max_batch_size if static else 0

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        n = next(iter(inputs.values())).shape[0] if self._static_batch and inputs else 0
        if n and n != self._static_batch:
            if not self._pad:   # Triton's text
                raise TriremeError(Code.INTERNAL, (
                    f"expected requests with batch size '{self._static_batch}', got '{n}'... this "
                    "error can be avoided by setting 'ENABLE_BATCH_PADDING' parameter in model "
                    "configuration to 'YES' at a performance cost."))
            pad = self._static_batch - n
            inputs = {k: np.concatenate([v, np.full((pad, *v.shape[1:]),
                                                    b"" if v.dtype == object else 0, v.dtype)])
                      for k, v in inputs.items()}
        # Every input is set on every run: the request keeps only raw pointers to the last
        # run's buffers, which may be gone by now.
        if inputs.keys() != self._inputs.keys():
            raise TriremeError(Code.INTERNAL, f"model '{self.config.name}' expects inputs "
                               f"{sorted(self._inputs)}, got {sorted(inputs)}")
        tensors = []   # ... and does not keep them alive: held here until the run ends
        for name, arr in inputs.items():
            port = self._inputs[name]
            if isinstance(port, tuple):   # a string tensor: its three parts
                pairs = list(zip(port, _pack(arr)))
            elif arr.dtype != self._dtypes[name]:
                raise TriremeError(Code.INTERNAL, f"input '{name}' is {arr.dtype}, the compiled "
                                                  f"model expects {self._dtypes[name]}")
            else:
                pairs = [(port, arr)]
            for port, arr in pairs:
                # Zero copy, read-only views on shared memory included: the CPU plugin reads
                # the caller's buffer in place only when no node would write to it, and copies
                # otherwise (intel_cpu SyncInferRequest::change_default_ptr). This constructor
                # takes the shape as given, so the array must be exactly it (checked above).
                arr = np.ascontiguousarray(arr)
                raw = arr.reshape(-1).view(np.uint8)   # (any dtype, bf16 included, as bytes)
                tensors.append(ov.Tensor(raw, arr.shape, port.get_element_type()))
                try:
                    self.request.set_tensor(port, tensors[-1])
                except RuntimeError as e:
                    raise _ov_error(Code.INTERNAL, "setting tensor data", e) from e
        try:
            self.request.infer()
        except RuntimeError as e:
            raise _ov_error(Code.INTERNAL, "running inference", e) from e
        results = {}
        for name in outputs:
            port = self._outputs[name]
            if isinstance(port, tuple):   # a string tensor: bytes objects, copied out
                out = _unpack(*(self.request.get_tensor(p).data for p in port))
            else:
                data = self.request.get_tensor(port).data
                # A copy: the request reuses its output buffers on the next run, and an
                # output may even alias an input (an identity). One copy of what was asked
                # for costs less than a fresh request per run. view(): OpenVINO labels bf16
                # as float16.
                out = data.view(self._dtypes[name]).copy()
            results[name] = out[:n] if n else out
        return results

    def close(self) -> None:
        self.request = None


BACKEND = OpenVINOBackend
