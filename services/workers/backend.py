"""What a worker needs from a backend, and how a backend module is found.

Each backend lives in its own module and is the only place its framework is imported, so
a worker process holds exactly one framework and the other services hold none.
"""
from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np

from services.common.errors import Code, TriremeError
from services.workers.reshape import Reshape

# backend name -> (module, the extra that installs its framework)
BACKENDS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("services.workers.onnxruntime_backend", "onnx"),
    "pytorch": ("services.workers.pytorch_backend", "torch"),
    "tensorflow": ("services.workers.tensorflow_backend", "tensorflow"),
    "openvino": ("services.workers.openvino_backend", "openvino"),
    "tensorrt": ("services.workers.tensorrt_backend", "tensorrt"),
    "python": ("services.workers.python_backend", ""),
}


class Backend(Protocol):
    config: object
    """The completed inference.ModelConfig (auto-complete runs here, where the framework is)."""

    reshape: Reshape | None
    """The config's reshapes, set by create_backend: the worker applies them around every
    backend (inputs reach ``execute`` in ``reshape.shape``, outputs leave in ``dims``)."""

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run one (possibly batched) execution; ``outputs`` empty means every output."""

    def close(self) -> None: ...


def _missing(name: str, extra: str, e: ImportError) -> TriremeError:
    hint = f" Install it with: pip install \"trireme[{extra}]\"" if extra else ""
    return TriremeError(Code.UNAVAILABLE, f"backend '{name}' is not available: {e}.{hint}")


def create_backend(cfg, load) -> Backend:
    """The backend object for one model instance. A framework that is not installed, whether
    its module imports it at the top or lazily at load, gives one error naming the extra."""
    name = cfg.backend
    entry = BACKENDS.get(name)
    if entry is None:
        raise TriremeError(Code.INVALID_ARG, f"unknown backend '{name}'")
    module_name, extra = entry
    try:
        backend = importlib.import_module(module_name).BACKEND(cfg, load)
    except ImportError as e:
        raise _missing(name, extra, e) from e
    # From the completed config: auto-complete may add tensors (and keeps a user's reshape).
    backend.reshape = Reshape.of(backend.config)
    return backend
