"""Ragged inputs, `batch_input` and `batch_output` around one execution of a tensor backend.

Triton does this in each backend with the helpers of triton-inference-server/backend:
- a ragged input (`allow_ragged_batch`) reaches the model as ONE dimension holding every
  request's elements in order, [total elements], whatever max_batch_size is
  (onnxruntime/tensorflow/pytorch SetInputTensors: batchn_shape = {sum of GetElementCount});
- each `batch_input` target is generated from the requests' shapes of its source input
  (backend_input_collector.cc BatchInputShape, ProcessBatchInput, SetElementCount,
  SetAccumulatedElementCount, SetBatchItemShape): int32, or float32 for TYPE_FP32;
- a `batch_output` BATCH_SCATTER_WITH_INPUT_SHAPE output is cut into consecutive pieces, one
  per request, each shaped like the output's config dims with every -1 taken from the same
  dimension of that request's source input (backend_output_responder.cc ProcessBatchOutput).
Here it is done once in the worker for every tensor backend, on the shapes the model sees
(after config reshape, as Triton's core reshapes before a backend runs). Pure numpy.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from protos import model_config_pb2 as mc
from services.common.batch_io_config import validate_batch_io
from services.common.errors import Code, TriremeError, invalid_arg

K = mc.BatchInput.Kind
Shape = tuple[int, ...]


def element_count(shape: Shape) -> int:
    """Triton's GetElementCount of a request's tensor: 0 for a shape without dimensions."""
    return math.prod(shape) if shape else 0


def generate(kind: int, shapes: list[Shape], dtype: np.dtype) -> np.ndarray:
    """The tensor of one batch input kind, from each request's shape of its source input
    (batch dimension first: Triton assumes one for the item-shape kinds)."""
    if kind in (K.BATCH_ITEM_SHAPE, K.BATCH_ITEM_SHAPE_FLATTEN):
        # one row per batch item (a request of batch n gives n equal rows): its shape
        # without the batch dimension
        width = len(shapes[-1]) - 1 if shapes else 0
        rows = [s[1:] for s in shapes for _ in range(s[0])]
        out = np.array(rows, dtype=dtype).reshape(len(rows), width)
        return out.reshape(-1) if kind == K.BATCH_ITEM_SHAPE_FLATTEN else out
    counts = [element_count(s) for s in shapes]
    if kind == K.BATCH_ELEMENT_COUNT:
        return np.array(counts, dtype=dtype)
    if kind == K.BATCH_ACCUMULATED_ELEMENT_COUNT:
        return np.cumsum(counts).astype(dtype)
    if kind == K.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
        return np.cumsum([0, *counts]).astype(dtype)
    if kind == K.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
        # Only the shape carries information; Triton leaves the data uninitialized.
        return np.zeros(max([0, *counts]), dtype=dtype)
    raise TriremeError(Code.INTERNAL, f"unsupported batch input kind {kind}")


class BatchIO:
    """One model's ragged inputs, batch inputs and batch outputs. `of(cfg)` is None when the
    config has none of them, so a worker's plain batches pay nothing."""

    __slots__ = ("inputs", "model", "outputs", "ragged")

    def __init__(self, cfg) -> None:
        validate_batch_io(cfg)   # the worker may see the config before the scheduler checks it
        self.model = cfg.name
        self.ragged = frozenset(io.name for io in cfg.input if io.allow_ragged_batch)
        # (kind, target names, dtype, source input)
        self.inputs = [(b.kind, tuple(b.target_name),
                        np.dtype(np.float32 if b.data_type == mc.TYPE_FP32 else np.int32),
                        b.source_input[0]) for b in cfg.batch_input]
        # output name -> (source input, shape with -1 where the source gives the size)
        batch = (-1,) if cfg.max_batch_size > 0 else ()
        dims = {io.name: tuple(io.reshape.shape if io.HasField("reshape") else io.dims)
                for io in cfg.output}
        self.outputs = {t: (b.source_input[0], batch + dims[t])
                        for b in cfg.batch_output for t in b.target_name}

    @classmethod
    def of(cls, cfg) -> BatchIO | None:
        if cfg.batch_input or cfg.batch_output or any(io.allow_ragged_batch for io in cfg.input):
            return cls(cfg)
        return None

    # ------------------------------------------------------------------ inputs
    def gather(self, per_item: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The model's inputs for a batch: one copy per input at most, none for a single
        request (a flattened ragged input is a view); batch inputs generated once."""
        first = per_item[0]
        if len(per_item) == 1:
            inputs = dict(first)
            for name in self.ragged & first.keys():
                inputs[name] = first[name].reshape(-1)
        else:
            inputs = {name: np.concatenate([p[name].reshape(-1) for p in per_item])
                      if name in self.ragged else np.concatenate([p[name] for p in per_item])
                      for name in first}
        for kind, targets, dtype, source in self.inputs:
            shapes = [self._shape(p, source, "batch input", targets) for p in per_item]
            for target in targets:   # one tensor each: a model may write into its inputs
                inputs[target] = generate(kind, shapes, dtype)
        return inputs

    def _shape(self, item: dict[str, np.ndarray], source: str, what: str, names) -> Shape:
        arr = item.get(source)
        if arr is None:   # an optional source input a request left out
            raise invalid_arg(
                f"{what} {', '.join(repr(n) for n in names)} of model '{self.model}' is made "
                f"from input '{source}', which a request of the batch does not have")
        return arr.shape

    # ----------------------------------------------------------------- outputs
    def scatter(self, outputs: dict[str, Any], batch_sizes: list[int],
                per_item: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Each request's outputs, as views: batch outputs by their source input's shape,
        the others by batch size (as without batch_io)."""
        n = len(per_item)
        mine: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
        for name, arr in outputs.items():
            spec = self.outputs.get(name)
            if spec is not None:
                self._scatter_by_shape(name, arr, spec, per_item, mine)
            elif n == 1:
                mine[0][name] = arr
            else:
                start = 0
                for i, size in enumerate(batch_sizes):
                    mine[i][name] = arr[start:start + size]
                    start += size
        return mine

    def _scatter_by_shape(self, name: str, arr: np.ndarray, spec: tuple[str, Shape],
                          per_item: list[dict[str, np.ndarray]], mine: list[dict]) -> None:
        source, template = spec
        flat = np.ascontiguousarray(arr).reshape(-1)
        start = 0
        for i, item in enumerate(per_item):
            src = self._shape(item, source, "batch output", (name,))
            if len(template) > len(src) and -1 in template[len(src):]:
                raise TriremeError(Code.INTERNAL, (
                    f"batch output '{name}' of model '{self.model}' has more dimensions "
                    f"than its source input '{source}' ({list(template)} and {list(src)})"))
            shape = tuple(src[d] if t == -1 else t for d, t in enumerate(template))
            stop = start + math.prod(shape)
            if stop > flat.size:
                raise TriremeError(Code.INTERNAL, (
                    f"output '{name}' of model '{self.model}' has {flat.size} elements, too "
                    f"few to scatter by the shapes of input '{source}'"))
            mine[i][name] = flat[start:stop].reshape(shape)
            start = stop
