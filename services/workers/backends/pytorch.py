"""PyTorch backend: the only module that imports torch.

A TorchScript `model.pt` (platform pytorch_libtorch) is bound and run the way Triton's
pytorch_backend does it (src/model_instance_state.cc: GetNamingConvention, ValidateInputs,
ValidateOutputs, Execute, ReadOutputTensors; src/model_state.cc: LoadModel, ParseParameters;
src/libtorch_utils.cc: the datatype table). Error texts are Triton's. A `model.pt2` written
by torch.export.save (platform torch_aoti) runs through ExportedProgram.module() with the same
binding rules, and its signature auto-completes the config, which TorchScript cannot do.
"""
from __future__ import annotations

import logging
import zipfile
from typing import Any

import numpy as np
import torch

from protos import model_config_pb2 as mc
from services.common.config import TORCH_AOTI, complete_io
from services.common.datatypes import numpy_dtype
from services.common.errors import (
    Code,
    TriremeError,
    expects_inputs_text,
    invalid_arg,
    unsupported_io_datatype_text,
)
from services.common.repository import model_file
from services.workers.backends.base import BackendBase
from services.workers.backends.common import (
    bool_param,
    gpu_unavailable,
    ignore_read_only_warning,
    int_param,
    model_dims,
    model_inputs,
    param,
)

log = logging.getLogger(__name__)

# Inputs are read-only views on shared memory, wrapped without a copy; models that write
# to their inputs get a copy (_tensor).
ignore_read_only_warning()

_TORCH_TYPES = {  # config datatype -> torch dtype (Triton's table, plus BF16)
    "TYPE_BOOL": torch.bool, "TYPE_UINT8": torch.uint8, "TYPE_INT8": torch.int8,
    "TYPE_INT16": torch.int16, "TYPE_INT32": torch.int32, "TYPE_INT64": torch.int64,
    "TYPE_FP16": torch.float16, "TYPE_FP32": torch.float32, "TYPE_FP64": torch.float64,
    "TYPE_BF16": torch.bfloat16,
}
_CONFIG_TYPES = {v: k for k, v in _TORCH_TYPES.items()}
_API_TYPES = {"TYPE_STRING": "BYTES", **{k: k.removeprefix("TYPE_") for k in _TORCH_TYPES}}
_BF16 = numpy_dtype("BF16")

# Triton's JIT switches: applied only when the config sets them (process-wide, which is
# fine: a worker process holds one model instance).
_JIT_SWITCHES = {
    "DISABLE_OPTIMIZED_EXECUTION": lambda on: torch._C._set_graph_executor_optimize(not on),
    "ENABLE_TENSOR_FUSER": torch._C._jit_set_texpr_fuser_enabled,
    "ENABLE_JIT_PROFILING": torch._C._jit_set_profiling_mode,
    "ENABLE_JIT_EXECUTOR": torch._C._jit_set_profiling_executor,
    "DISABLE_CUDNN": lambda on: setattr(torch.backends.cudnn, "enabled", not on),
}


def _index(name: str) -> int | None:
    """The index of a `<name>__<index>` name (Triton: text after the first "__", all digits)."""
    at = name.find("__")
    if at < 0:
        return None
    digits = name[at + 2:]
    if digits and not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits or 0)


def _none_specified(kind: str) -> TriremeError:
    return invalid_arg(f"model configuration must contain at least one {kind}, none were "
                       "specified.")


def _check_types(cfg, kind: str, ios) -> None:
    for io in ios:
        dtype = mc.DataType.Name(io.data_type)
        if dtype not in _TORCH_TYPES and dtype != "TYPE_STRING":
            raise invalid_arg(unsupported_io_datatype_text(dtype, kind, io.name, cfg.name))
        if dtype == "TYPE_STRING" and len(model_dims(io)) + (cfg.max_batch_size > 0) > 1:
            raise invalid_arg(f"Triton only supports 1 dimensional List of String as {kind} for "
                              f"'{io.name}' for model '{cfg.name}'")


def _bind_inputs(cfg, args: list[str], warn: bool = True) -> list[str]:
    """Config input names in forward() argument order (ValidateInputs + GetNamingConvention)."""
    n = cfg.name
    # Batch inputs come after the config's inputs (Triton: index i + number of inputs).
    names = [io.name for io in model_inputs(cfg)]
    controls = [c.name for c in cfg.sequence_batching.control_input]
    if len(args) != len(names) + len(controls):
        raise invalid_arg(expects_inputs_text(n, len(names) + len(controls), len(args)))
    if not cfg.input:
        raise _none_specified("input")
    if all(name in args for name in names):
        pos = {name: args.index(name) for name in names}
    elif all(_index(name) is not None for name in names):
        pos = {name: _index(name) for name in names}
    else:
        if warn:
            log.warning("input '%s' or previous input(s) are neither an input argument to the model "
                        "'%s' nor do they follow the <name>__<index> naming convention. Falling "
                        "back to enforcing strict ordering from model configuration.",
                        next(x for x in names if _index(x) is None), n)
        pos = {name: i for i, name in enumerate(names)}
    for name in controls:  # sequence control tensors always bind by index
        if _index(name) is None:
            raise invalid_arg(f"input '{name}' does not follow <name>__<index> naming convention.")
        pos[name] = _index(name)
    slots: list[str | None] = [None] * len(args)
    for name, i in pos.items():  # Triton does not check these; a bad index would crash it
        if i >= len(slots):
            raise invalid_arg(f"unable to load model '{n}', input '{name}' refers to argument "
                              f"{i} of forward(), which takes {len(slots)} inputs")
        if slots[i] is not None:
            raise invalid_arg(f"unable to load model '{n}', inputs '{slots[i]}' and '{name}' both "
                              f"refer to argument {i} of forward()")
        slots[i] = name
    return slots


def _bind_outputs(cfg, warn: bool = True) -> dict[str, int]:
    """Config output name -> index into the returned tuple (ValidateOutputs)."""
    names = [io.name for io in cfg.output]
    if not names:
        raise _none_specified("output")
    if all(_index(name) is not None for name in names):
        return {name: _index(name) for name in names}
    if warn:
        log.warning("output '%s' or previous output(s) of the model '%s' do not follow the "
                    "<name>__<index> naming convention. Falling back to enforcing strict ordering "
                    "from model configuration.", next(x for x in names if _index(x) is None), cfg.name)
    return {name: i for i, name in enumerate(names)}


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


def _results(value: Any) -> list[Any]:
    """forward()'s return value as a list of outputs (Tensor or List[str]), as Execute does."""
    if isinstance(value, torch.Tensor) or _is_str_list(value):
        return [value]
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            if not (isinstance(v, torch.Tensor) or _is_str_list(v)):
                raise TypeError(f"output at index {i} must be of type Tensor or List[str], "
                                f"received {type(v).__name__}")
        return list(value)
    if isinstance(value, list):
        raise TypeError("output must be of type Tensor or List[str], received "
                        f"List[{type(value[0]).__name__}]")
    raise TypeError("output must be of type Tensor, List[str] or Tuple containing one of these "
                    "two types. It should not be a List / Dictionary of Tensors or a Scalar")


def _spec(name: str, t: Any) -> tuple[str, str, list[int]]:
    """(name, API datatype, shape with -1 for dynamic dims) of an exported tensor."""
    dtype = _CONFIG_TYPES.get(getattr(t, "dtype", None))
    if dtype is None:
        raise invalid_arg(f"unsupported type {getattr(t, 'dtype', type(t).__name__)} for '{name}' "
                          "in the exported program")
    return name, _API_TYPES[dtype], [d if isinstance(d, int) else -1 for d in t.shape]


def _load_exported(path: str, device: torch.device):
    """(module, forward argument names, input specs, output specs, writes inputs)."""
    with zipfile.ZipFile(path) as z:   # torch.export.load's own error on these says nothing
        if any("/data/aotinductor/" in n for n in z.namelist()):
            raise ValueError("it is an AOTInductor package, which this backend does not run "
                             "yet; save the program with torch.export.save instead")
    ep = torch.export.load(path)
    if device.type != "cpu":
        from torch.export.passes import move_to_device_pass  # not loaded by `import torch`
        ep = move_to_device_pass(ep, device)
    sig = ep.graph_signature
    nodes = {n.name: n for n in ep.graph.nodes}
    args = list(ep.module_call_graph[0].signature.forward_arg_names)
    inputs = [_spec(a, nodes[p].meta["val"]) for a, p in zip(args, sig.user_inputs)]
    returned = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    user = [r for r in returned if getattr(r, "name", None) in set(sig.user_outputs)]
    outputs = [_spec(f"OUTPUT__{i}", r.meta["val"]) for i, r in enumerate(user)]
    # (no eval(): an exported graph has its train/eval behaviour fixed at export)
    return ep.module(), args, inputs, outputs, bool(sig.user_inputs_to_mutate)


def _named_like(cfg, args: list[str], ins: list, outs: list) -> tuple[list, list]:
    """The exported tensors renamed to the config's names where the config binds them, so
    complete_io checks the config's datatypes and shapes against the right tensors."""
    if cfg.input:
        slots = _bind_inputs(cfg, args, warn=False)   # _bind warns, once
        ins = [(slot, dt, shape) for slot, (_, dt, shape) in zip(slots, ins)]
    if cfg.output:
        by_index = {i: name for name, i in _bind_outputs(cfg, warn=False).items()}
        outs = [(by_index.get(i, name), dt, shape) for i, (name, dt, shape) in enumerate(outs)]
    return ins, outs


def _load_script(path: str, device: torch.device | None):
    """(module, forward argument types by name, writes inputs) of a TorchScript file."""
    module = torch.jit.load(path, map_location=device).eval()
    schema = module.forward.schema.arguments
    args = {a.name: a.type for a in schema if a.type.kind() != "ClassType"}  # not `self`
    graph = module.forward.inlined_graph
    alias = graph.alias_db()
    writes = any(alias.has_writers(v) for v in graph.inputs() if v.type().kind() != "ClassType")
    return module, args, writes


class PyTorchBackend(BackendBase):
    def __init__(self, cfg, load) -> None:
        if load.kind == "KIND_GPU":
            if not torch.cuda.is_available():
                raise gpu_unavailable(cfg.name, f"PyTorch cannot use CUDA (torch "
                                      f"{torch.__version__}, CUDA build: "
                                      f"{torch.version.cuda or 'none'})", "a CUDA build of torch")
            self.device = torch.device("cuda:0")   # CUDA_VISIBLE_DEVICES holds our one GPU
        else:
            self.device = torch.device("cpu")
        self._parse_parameters(cfg)
        exported = cfg.platform == TORCH_AOTI or cfg.default_model_filename.endswith(".pt2")
        path = model_file(cfg, load.model_dir, load.version)
        try:
            with torch.inference_mode(self.inference_mode):
                if exported:
                    self.module, args, ins, outs, self._writes = _load_exported(str(path), self.device)
                    arg_types = dict.fromkeys(args)
                else:
                    # KIND_MODEL: the devices saved in the file (Triton); inputs come on the CPU
                    where = None if load.kind == "KIND_MODEL" else self.device
                    self.module, arg_types, self._writes = _load_script(str(path), where)
                    ins = outs = None
        except Exception as e:
            raise invalid_arg(f"failed to load model '{cfg.name}': {e}") from e
        # Triton's pytorch backend skips auto-complete (TorchScript keeps no IO metadata);
        # an exported program has it.
        self.config = complete_io(cfg, *_named_like(cfg, args, ins, outs)) \
            if exported and load.autocomplete else cfg
        self._bind(self.config, arg_types)

    def _parse_parameters(self, cfg) -> None:
        self.inference_mode = bool_param(cfg, "INFERENCE_MODE", True)
        self.cache_cleaning = bool_param(cfg, "ENABLE_CACHE_CLEANING", False)
        bool_param(cfg, "ENABLE_WEIGHT_SHARING", False)  # validated; one process per instance
        for key, switch in _JIT_SWITCHES.items():
            if param(cfg, key) is not None:
                switch(bool_param(cfg, key, False))
        intra = int_param(cfg, "INTRA_OP_THREAD_COUNT", -1)
        inter = int_param(cfg, "INTER_OP_THREAD_COUNT", -1)
        if intra > 0:
            torch.set_num_threads(intra)
        if inter > 0:
            try:   # settable once, before any inter-op work: true in a fresh worker
                torch.set_num_interop_threads(inter)
            except RuntimeError as e:
                log.warning("INTER_OP_THREAD_COUNT of '%s' not applied: %s", cfg.name, e)

    def _bind(self, cfg, arg_types: dict[str, Any]) -> None:
        if cfg.sequence_batching.state:
            raise TriremeError(Code.UNSUPPORTED, f"model '{cfg.name}': sequence state is not "
                                                 "supported by the pytorch backend yet")
        kinds = [t.kind() if t is not None else "TensorType" for t in arg_types.values()]
        # Triton: a single Dict(str, Tensor) argument takes every input by name.
        self._dict_input = kinds == ["DictType"]
        if not self._dict_input:
            if "DictType" in kinds[1:]:
                raise invalid_arg("Multiple inputs of kind DictType were detected. Only a single "
                                  "input of type Dict(str, Tensor) is supported.")
            for t, kind in zip(arg_types.values(), kinds):
                if kind not in ("TensorType", "ListType"):
                    raise invalid_arg(f"An input of type '{t}' was detected in the model. Only a "
                                      "single input of type Dict(str, Tensor) or input(s) of type "
                                      "Tensor are supported.")
            self._slots = _bind_inputs(cfg, list(arg_types))
        elif not cfg.input:
            raise _none_specified("input")
        _check_types(cfg, "input", cfg.input)
        self._outputs = _bind_outputs(cfg)
        _check_types(cfg, "output", cfg.output)
        self._out_types = {io.name: mc.DataType.Name(io.data_type) for io in cfg.output}

    # ------------------------------------------------------------------ execute
    def _tensor(self, arr: np.ndarray) -> Any:
        if arr.dtype == object:   # TYPE_STRING: Triton passes a List[str]
            return [b.decode("utf-8", "replace") for b in arr.ravel().tolist()]
        if self._writes and not arr.flags.writeable:
            arr = arr.copy()      # the model writes into its inputs: never into shared memory
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if arr.dtype == _BF16 \
            else torch.from_numpy(arr)
        return t.to(self.device) if self.device.type != "cpu" else t

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        try:
            # Triton enters both; inference mode already implies no grad, and each costs µs.
            with torch.inference_mode() if self.inference_mode else torch.no_grad():
                if self._dict_input:
                    result = self.module({k: self._tensor(v) for k, v in inputs.items()})
                else:
                    result = self.module(*[self._tensor(inputs[n]) for n in self._slots])
                results = _results(result)
        except Exception as e:
            raise TriremeError(Code.INTERNAL, f"PyTorch execute failure: {e}") from e
        finally:
            if self.cache_cleaning and self.device.type == "cuda":
                torch.cuda.empty_cache()
        for name, i in self._outputs.items():
            if i >= len(results):
                raise invalid_arg(f"The output {name} in the model configuration refers to an "
                                  "output index which doesn't exist. This model has "
                                  f"{len(results)} outputs")
            value = results[i]
            got = _CONFIG_TYPES.get(value.dtype, "TYPE_INVALID") \
                if isinstance(value, torch.Tensor) else "TYPE_STRING"
            if got != self._out_types[name]:
                raise invalid_arg(f"configuration expects datatype {self._out_types[name]} for "
                                  f"output '{name}', model provides {got}")
        return {name: self._array(name, results[self._outputs[name]]) for name in outputs}

    @staticmethod
    def _array(name: str, value: Any) -> np.ndarray:
        if isinstance(value, list):   # List[str] -> BYTES
            arr = np.empty(len(value), dtype=object)
            arr[:] = [s.encode("utf-8") for s in value]
            return arr
        if value.dim() == 0:
            raise invalid_arg(f"output '{name}' is a scalar which is not supported.")
        t = value.detach() if value.requires_grad else value   # a parameter returned as is
        t = t.cpu() if t.device.type != "cpu" else t
        return t.view(torch.int16).numpy().view(_BF16) if t.dtype == torch.bfloat16 else t.numpy()

    def close(self) -> None:
        self.module = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


BACKEND = PyTorchBackend
