"""What a worker needs from a backend, and how a backend module is found.

Each backend lives in its own module and is the only place its framework is imported, so
a worker process holds exactly one framework and the other services hold none.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from services.common.errors import Code, TriremeError, invalid_arg
from services.workers.reshape import Reshape

if TYPE_CHECKING:
    from services.workers.python.cancel import Cancels

# backend name -> (module, the extra that installs its framework)
BACKENDS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("services.workers.backends.onnxruntime", "onnx"),
    "pytorch": ("services.workers.backends.pytorch", "torch"),
    "tensorflow": ("services.workers.backends.tensorflow", "tensorflow"),
    "openvino": ("services.workers.backends.openvino", "openvino"),
    "tensorrt": ("services.workers.backends.tensorrt", "tensorrt"),
    "python": ("services.workers.python.backend", ""),
    "identity": ("services.workers.backends.identity", ""),   # Triton's test backend
}


class Backend(Protocol):
    """Every hook the worker loop (services/workers/main.py) calls; BackendBase gives the
    defaults, so a backend defines only what it does differently."""

    config: object
    """The completed inference.ModelConfig (auto-complete runs here, where the framework is)."""

    reshape: Reshape | None
    """The config's reshapes, set by create_backend: the worker applies them around every
    backend (inputs reach ``execute`` in ``reshape.shape``, outputs leave in ``dims``)."""

    per_request: bool
    """True: the backend answers each request itself (``execute_requests``, the Python
    backend); False: the worker batches the requests into one ``execute``."""

    cancels: Cancels | None
    """The cancel flags its models read, or None when its models cannot stop early; with
    them the worker opens its cancel channel."""

    probes_ready: bool
    """True: ``is_ready`` is the model's own check, which the scheduler's readiness probes
    call; False: the model is ready while it is loaded."""

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        """Run one (possibly batched) execution; return exactly the ``outputs`` named. The
        list is never empty: for a request that names none the worker passes every output
        of the config (Triton's InferenceRequest::Normalize), never the model file's."""

    def execute_requests(self, items: list, inputs: list[dict[str, np.ndarray]],
                         reply: Callable) -> list:
        """A per-request backend's batch: per request, its outputs, a TriremeError, or None
        when it answers later through ``reply(index, outputs, error, final)``."""

    def is_ready(self) -> bool: ...

    def take_metrics(self) -> list | None:
        """The model's custom metric families when they changed since the last call."""

    def close(self) -> None: ...


class BackendBase:
    """The defaults of Backend's hooks: a tensor backend that runs whole batches, cannot
    stop early, has no readiness check and no metrics of its own."""

    config: object
    reshape: Reshape | None = None
    per_request = False
    cancels: Cancels | None = None
    probes_ready = False

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} answers requests one by one")

    def execute_requests(self, items: list, inputs: list[dict[str, np.ndarray]],
                         reply: Callable) -> list:
        raise NotImplementedError(f"{type(self).__name__} runs whole batches")

    def is_ready(self) -> bool:
        return True

    def take_metrics(self) -> list | None:
        return None

    def close(self) -> None:
        pass


def _missing(name: str, extra: str, e: ImportError) -> TriremeError:
    hint = f" Install it with: pip install \"trireme[{extra}]\"" if extra else ""
    return TriremeError(Code.UNAVAILABLE, f"backend '{name}' is not available: {e}.{hint}")


def create_backend(cfg, load) -> Backend:
    """The backend object for one model instance. A framework that is not installed, whether
    its module imports it at the top or lazily at load, gives one error naming the extra."""
    name = cfg.backend
    entry = BACKENDS.get(name)
    if entry is None:
        raise invalid_arg(f"unknown backend '{name}'")
    module_name, extra = entry
    try:
        backend = importlib.import_module(module_name).BACKEND(cfg, load)
    except ImportError as e:
        raise _missing(name, extra, e) from e
    # From the completed config: auto-complete may add tensors (and keeps a user's reshape).
    backend.reshape = Reshape.of(backend.config)
    return backend
