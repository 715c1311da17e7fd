"""Triton's identity backend: every output OUTPUTn is the request's input INPUTn, same
datatype and shape. Triton's QA suite serves many of its test models with it (the nop_*
models of L0_infer_zero's ensembles, L0_client_timeout's delayed model, ...). No model file,
no framework.

Rules and texts follow triton-inference-server/identity_backend src/identity.cc:
- the config pairs INPUT<i> with OUTPUT<i> by the name's suffix; a pair must agree on
  datatype and shape (the reshape's shape when there is one);
- each request is answered on its own from its own inputs (so a dynamic batch is never
  gathered into one copy); an output whose input the request lacks is a zero tensor when
  that input is optional, else that request's error;
- parameters: execute_delay_ms (one sleep per execution, times
  instance_wise_delay_multiplier × the instance's index when that is set) and
  creation_delay_sec (one sleep at load).
Outputs are the input arrays themselves (views on the request's memory): the backend
copies nothing; the worker's result path (its output arena, or an inline frame; BYTES
re-serialized) is the only copy. Not done: identity.cc's custom metric and custom trace
activities.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from protos import model_config_pb2 as mc
from services.common.datatypes import config_to_api, numpy_dtype
from services.common.errors import Code, TriremeError, invalid_arg
from services.workers.backends.base import BackendBase
from services.workers.backends.common import int_param, model_dims

_IN, _OUT = "INPUT", "OUTPUT"


def _shape_text(dims: list[int]) -> str:
    return "[" + ",".join(map(str, dims)) + "]"   # backend_common's ShapeToString


def _check_pairs(cfg) -> dict[str, tuple[np.dtype, list[int]]]:
    """identity.cc ValidateModelConfig. Returns the optional inputs: index suffix ->
    (dtype, shape with -1 as 1), what an absent one's output is made of."""
    if len(cfg.input) != len(cfg.output):
        raise invalid_arg("model configuration must have equal input/output pairs")
    inputs: dict[str, tuple[str, list[int]]] = {}
    outputs: dict[str, tuple[str, list[int]]] = {}
    optional: dict[str, tuple[np.dtype, list[int]]] = {}
    for i, o in zip(cfg.input, cfg.output):
        if not i.name.startswith(_IN):
            raise invalid_arg(f"expected input name to follow INPUT<index> pattern, got '{i.name}'")
        if not o.name.startswith(_OUT):
            raise invalid_arg(f"expected output name to follow OUTPUT<index> pattern, got '{o.name}'")
        suffix = i.name[len(_IN):]
        inputs.setdefault(suffix, (mc.DataType.Name(i.data_type), model_dims(i)))
        outputs.setdefault(o.name[len(_OUT):], (mc.DataType.Name(o.data_type), model_dims(o)))
        if i.optional:
            dtype = numpy_dtype(config_to_api(mc.DataType.Name(i.data_type)))
            optional[suffix] = (dtype, [1 if d == -1 else d for d in model_dims(i)])
    for suffix, (out_type, out_dims) in outputs.items():
        if suffix not in inputs:
            raise invalid_arg("expected input and output indices to match")
        in_type, in_dims = inputs[suffix]
        if in_type != out_type:
            raise invalid_arg(f"expected input and output datatype to match, got {in_type} and "
                              f"{out_type}")
        if in_dims != out_dims:
            raise invalid_arg(f"expected input and output shape to match, got "
                              f"{_shape_text(in_dims)} and {_shape_text(out_dims)}")
    return optional


def _instance_index(cfg, instance_name: str) -> int:
    """The instance's place among the model's instances, counted over the groups in order
    (Triton's instance id; instance names are "<group>_<i>")."""
    n = 0
    for group in cfg.instance_group:
        for i in range(group.count):
            if f"{group.name}_{i}" == instance_name:
                return n
            n += 1
    return 0


class IdentityBackend(BackendBase):
    per_request = True   # identity.cc answers each request from its own inputs

    def __init__(self, cfg, load) -> None:
        self.config = cfg
        self._optional = _check_pairs(cfg)
        self._batching = cfg.max_batch_size > 0
        self._all_outputs = [o.name for o in cfg.output]
        delay_ms = int_param(cfg, "execute_delay_ms", 0)
        multiplier = int_param(cfg, "instance_wise_delay_multiplier", 0) if delay_ms else 0
        if multiplier > 0:
            multiplier *= _instance_index(cfg, load.instance_name)
        self.execute_delay_s = delay_ms * max(multiplier, 1) / 1000.0
        """Seconds each execution waits before answering (0: none)."""
        self.sleep: Callable[[float], object] = time.sleep
        """What waits those seconds (a test puts a recorder here)."""
        creation_s = int_param(cfg, "creation_delay_sec", 0)
        if creation_s > 0:
            time.sleep(creation_s)

    def execute_requests(self, items: list, inputs: list[dict[str, np.ndarray]],
                         reply: Callable) -> list:
        """Per request: {OUTPUTn: its INPUTn} for the outputs it asked for (every config
        output when it named none), or its TriremeError."""
        if self.execute_delay_s > 0:
            self.sleep(self.execute_delay_s)
        return [self._answer(item.outputs or self._all_outputs, tensors)
                for item, tensors in zip(items, inputs)]

    def _answer(self, wanted: list[str], tensors: dict[str, np.ndarray]) -> dict | TriremeError:
        out: dict[str, np.ndarray] = {}
        for name in wanted:
            suffix = name[len(_OUT):]
            arr = tensors.get(_IN + suffix)
            if arr is None:
                if suffix not in self._optional:
                    return TriremeError(Code.UNSUPPORTED, f"failed to get input '{_IN}{suffix}'")
                arr = self._zeros(suffix, tensors)
            out[name] = arr
        return out

    def _zeros(self, suffix: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """An absent optional input's output: zeros of its config shape (-1 as 1), with the
        batch size of the request's first input in front when the model batches."""
        dtype, shape = self._optional[suffix]
        first = next(iter(tensors.values()), None)
        if self._batching and first is not None and first.ndim and first.shape[0]:
            shape = [first.shape[0], *shape]
        if dtype == np.object_:
            return np.full(shape, b"", dtype=object)
        return np.zeros(shape, dtype)


BACKEND = IdentityBackend
