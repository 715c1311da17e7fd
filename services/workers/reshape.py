"""Config `reshape`: the shape clients use (`dims`) against the shape the model sees
(`reshape.shape`), applied once in the worker for every backend.

Triton does it in its core, not in the backends: InferenceRequest::Normalize turns each
input's shape into `reshape.shape` before the backend runs, and InferenceResponse::AddOutput
(Output::Reshape) turns each output computed with `reshape.shape` back into `dims`. The batch
dimension, when the model batches, stays in front either way. Variable dimensions (-1) take
their sizes, in order, from the variable dimensions of the shape being converted; the load
check (services/common/config.py) makes the element counts of both shapes agree.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.errors import Code, TriremeError, invalid_arg

Shape = tuple[int, ...]
Named = list[tuple[str, np.ndarray]]


def convert(shape: Sequence[int], src: Sequence[int], dst: Sequence[int],
            batching: bool) -> Shape | None:
    """`shape` (a tensor laid out as `src`, batch dimension first when `batching`) laid out
    as `dst`; None when the variable dimensions do not line up (too few in `shape`).
    Triton's rule: the batch dimension is shape[0] when there is one."""
    off = 1 if batching and len(shape) > 0 else 0
    out: list[int] = [shape[0]] if off else []
    variable = []
    for i, d in enumerate(src):
        if d == -1:
            if i + off >= len(shape):
                return None
            variable.append(shape[i + off])
    it = iter(variable)
    for d in dst:
        if d == -1:
            v = next(it, None)
            if v is None:
                return None
            out.append(v)
        else:
            out.append(d)
    return tuple(out)


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


class Reshape:
    """The reshapes of one model's config. `of(cfg)` is None when no tensor has one, so a
    worker pays nothing for models without."""

    __slots__ = ("batching", "inputs", "model", "outputs")

    def __init__(self, cfg) -> None:
        self.model = cfg.name
        self.batching = cfg.max_batch_size > 0
        # name -> (from, to): inputs go dims -> reshape, outputs reshape -> dims
        self.inputs = {io.name: (tuple(io.dims), tuple(io.reshape.shape))
                       for io in cfg.input if io.HasField("reshape")}
        self.outputs = {io.name: (tuple(io.reshape.shape), tuple(io.dims))
                        for io in cfg.output if io.HasField("reshape")}

    @classmethod
    def of(cls, cfg) -> Reshape | None:
        if any(io.HasField("reshape") for io in (*cfg.input, *cfg.output)):
            return cls(cfg)
        return None

    def inputs_for_model(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's inputs (client shapes) as the model takes them. Views, no copies."""
        if not self.inputs.keys() & arrays.keys():
            return arrays
        out = dict(arrays)
        for name, (src, dst) in self.inputs.items():
            arr = arrays.get(name)
            if arr is None:
                continue
            shape = convert(arr.shape, src, dst, self.batching)
            if shape is None or _count(shape) != arr.size:
                # The frontend checks shapes against dims; this is a request that skipped it.
                raise invalid_arg(
                    f"unexpected shape for input '{name}' for model '{self.model}'. Expected "
                    f"{_fmt(((-1,) if self.batching else ()) + src)}, got {_fmt(arr.shape)}")
            out[name] = arr.reshape(shape)
        return out

    def outputs_for_client(self, outputs: Named) -> Named:
        """Outputs the model computed with `reshape.shape`, as clients see them (`dims`).
        Triton relabels the shape without a check; a model whose output does not hold
        as many elements as the new shape gets an error here instead of a broken response."""
        result = []
        for name, arr in outputs:
            io = self.outputs.get(name)
            if io is not None:
                src, dst = io
                shape = convert(arr.shape, src, dst, self.batching)
                if shape is None or _count(shape) != arr.size:
                    raise TriremeError(Code.INTERNAL, (
                        f"output '{name}' of model '{self.model}' has shape {_fmt(arr.shape)}, "
                        f"which does not fit its reshape {_fmt(src)} (dims {_fmt(dst)})"))
                arr = arr.reshape(shape)
            result.append((name, arr))
        return result


def _count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
