"""What a worker needs from a backend, and how a backend module is found.

Each backend lives in its own module and is the only place its framework is imported, so
a worker process holds exactly one framework and the other services hold none.
"""
from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np

from services.common.errors import Code, TriremeError

# backend name -> (module, the extra that installs its framework)
BACKENDS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("services.workers.onnxruntime_backend", "onnx"),
}


class Backend(Protocol):
    config: object
    """The completed inference.ModelConfig (auto-complete runs here, where the framework is)."""

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run one (possibly batched) execution; ``outputs`` empty means every output."""

    def close(self) -> None: ...


def backend_class(name: str) -> type:
    entry = BACKENDS.get(name)
    if entry is None:
        raise TriremeError(Code.INVALID_ARG, f"unknown backend '{name}'")
    module_name, extra = entry
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TriremeError(
            Code.UNAVAILABLE,
            f"backend '{name}' is not available: {e}. Install it with: "
            f"pip install \"trireme[{extra}]\"") from e
    return module.BACKEND
