"""What the framework backends share: config parameters, the config's view of the model's
tensors, and the texts of instance-kind refusals. Imports no framework.

Parameter parsing follows Triton's backend_common.cc (ParseBoolValue, ParseLongLongValue);
a backend whose Triton counterpart has its own rule or text (OpenVINO's "yes" flags,
TensorFlow's thread counts) keeps that rule and builds on `param` / `int_value`.
"""
from __future__ import annotations

import warnings

from protos import model_config_pb2 as mc
from services.common.errors import Code, TriremeError, invalid_arg

_TRUE, _FALSE = ("true", "on", "1"), ("false", "off", "0")


# ------------------------------------------------------------------------- parameters
def param(cfg, key: str, default: str | None = None) -> str | None:
    """The string_value of the config's parameter ``key``; ``default`` when it is not set."""
    p = cfg.parameters.get(key)
    return p.string_value if p is not None else default


def all_params(cfg) -> dict[str, str]:
    """Every config parameter, key -> string_value."""
    return {k: v.string_value for k, v in cfg.parameters.items()}


def bool_value(value: str) -> bool:
    """Triton's ParseBoolValue: true/on/1 or false/off/0, in any case."""
    lower = value.lower()
    if lower not in _TRUE + _FALSE:
        raise invalid_arg(f"failed to convert '{value}' to boolean")
    return lower in _TRUE


def int_value(value: str, error: str | None = None) -> int:
    """Triton's ParseLongLongValue; ``error`` replaces Triton's text where a backend's own
    counterpart words it differently."""
    try:
        return int(value)
    except ValueError:
        raise invalid_arg(error or f"failed to convert '{value}' to integral number") from None


def bool_param(cfg, key: str, default: bool) -> bool:
    value = param(cfg, key)
    return default if value is None else bool_value(value)


def int_param(cfg, key: str, default: int) -> int:
    value = param(cfg, key)
    return default if value is None else int_value(value)


# ------------------------------------------------------------------- config tensors
def model_dims(io) -> list[int]:
    """The dims the model sees for a config input or output: its reshape when it has one."""
    return list(io.reshape.shape if io.HasField("reshape") else io.dims)


def model_inputs(cfg) -> list:
    """Every input the worker feeds the model: the config's, then each batch input target
    (Triton numbers those after the config's inputs), as ModelInput (name, data_type)."""
    return [*cfg.input, *(mc.ModelInput(name=t, data_type=b.data_type)
                          for b in cfg.batch_input for t in b.target_name)]


# ------------------------------------------------------------------- instance kinds
def gpu_unavailable(model: str, why: str, install: str) -> TriremeError:
    """A KIND_GPU instance whose framework cannot reach a GPU: refused, never run on the CPU."""
    return TriremeError(Code.UNAVAILABLE, f"model '{model}' asks for KIND_GPU but {why}; install "
                                          f"{install} on a machine with a GPU or set KIND_CPU")


def device_unsupported(model: str, backend: str, device: str) -> TriremeError:
    """Triton's ModelInstanceState refusal of an instance kind its backend cannot run."""
    return invalid_arg(f"unable to load model '{model}', {backend} backend supports only "
                       f"{device} device")


# --------------------------------------------------------------------------- torch
def ignore_read_only_warning() -> None:
    """Inputs are read-only views on shared memory that torch.from_numpy wraps without a
    copy; torch warns (once) that writing to them is undefined. Backends that wrap them
    never write to them (a model that writes its inputs gets a copy)."""
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                            category=UserWarning)
