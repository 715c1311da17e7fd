"""A sequence model's extra inputs, made in the worker from each request's parameters
(`sequence_id`, `sequence_start`, `sequence_end`; the scheduler checked them):

- control inputs (`sequence_batching.control_input`): START, END, READY as the config's
  int32 / fp32 / bool false-true pair, CORRID as its data_type; one element per request
  (shape [1], or [1, 1] for a model that batches), so they batch like any input;
- implicit state (`sequence_batching.state`): the state input of a sequence's first request
  is its initial state (zeros, or `initial_state.data_file` under the model's
  initial_state/ folder); each later one gets what the previous one's state output was.
  Kept per correlation ID (dropped at END), so a sequence's state follows it whichever
  row of a batch it takes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from protos import model_config_pb2 as mc
from services.common.datatypes import config_to_api, numpy_dtype

_Kind = mc.ModelSequenceBatching.Control

START, READY, END, CORRID = (_Kind.CONTROL_SEQUENCE_START, _Kind.CONTROL_SEQUENCE_READY,
                             _Kind.CONTROL_SEQUENCE_END, _Kind.CONTROL_SEQUENCE_CORRID)


class SequenceIO:
    def __init__(self, controls: list[tuple[str, int, Any, Any]],
                 states: list[tuple[str, str, np.ndarray]], batched: bool) -> None:
        self.controls = controls          # (input name, kind, dtype, (false, true) or None)
        self.states = states              # (input name, output name, initial value)
        self.batched = batched
        self.state_outputs = [out for _, out, _ in states]
        self._kept: dict[int | str, dict[str, np.ndarray]] = {}   # corrid -> state inputs

    @classmethod
    def of(cls, cfg: Any, model_dir: str) -> SequenceIO | None:
        if not cfg.HasField("sequence_batching"):
            return None
        sb = cfg.sequence_batching
        controls = []
        for ci in sb.control_input:
            for c in ci.control:
                if c.kind == CORRID:
                    dtype = numpy_dtype(config_to_api(mc.DataType.Name(c.data_type)))
                    controls.append((ci.name, c.kind, dtype, None))
                elif c.int32_false_true:
                    controls.append((ci.name, c.kind, np.int32, tuple(c.int32_false_true)))
                elif c.fp32_false_true:
                    controls.append((ci.name, c.kind, np.float32, tuple(c.fp32_false_true)))
                else:
                    controls.append((ci.name, c.kind, np.bool_, tuple(c.bool_false_true)))
        batched = cfg.max_batch_size > 0
        states = [(st.input_name, st.output_name, _initial(st, model_dir, batched))
                  for st in sb.state]
        return cls(controls, states, batched)

    def inputs(self, params: dict[str, Any]) -> dict[str, np.ndarray]:
        """The control and state inputs of one request."""
        corrid = params.get("sequence_id", 0)
        start = params.get("sequence_start") is True
        end = params.get("sequence_end") is True
        shape = (1, 1) if self.batched else (1,)
        out: dict[str, np.ndarray] = {}
        for name, kind, dtype, pair in self.controls:
            if kind == CORRID:
                out[name] = _corrid(corrid, dtype, shape)
            else:
                flag = start if kind == START else end if kind == END else True
                out[name] = np.full(shape, pair[1] if flag else pair[0], dtype=dtype)
        if self.states:
            kept = None if start else self._kept.get(corrid)
            for name, _, initial in self.states:
                out[name] = kept[name] if kept is not None and name in kept else initial
        return out

    def keep(self, params: dict[str, Any], outputs: dict[str, np.ndarray]) -> None:
        """Remember one request's state outputs as its sequence's next state inputs."""
        if not self.states:
            return
        corrid = params.get("sequence_id", 0)
        if params.get("sequence_end") is True:
            self._kept.pop(corrid, None)
            return
        self._kept[corrid] = {name: np.array(outputs[out], copy=True)
                              for name, out, _ in self.states if out in outputs}


def _initial(st: Any, model_dir: str, batched: bool) -> np.ndarray:
    dtype = numpy_dtype(config_to_api(mc.DataType.Name(st.data_type)))
    init = st.initial_state[0] if st.initial_state else None
    dims = [max(int(d), 1) for d in (init.dims if init is not None else st.dims)]
    shape = ([1] if batched else []) + dims
    if init is not None and init.WhichOneof("state_data") == "data_file":
        data = (Path(model_dir) / "initial_state" / init.data_file).read_bytes()
        count = int(np.prod(shape))
        return np.frombuffer(data, dtype=dtype, count=count).reshape(shape).copy()
    return np.zeros(shape, dtype=dtype)


def _corrid(corrid: int | str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The CORRID control's value. A string ID given to a numeric control is what Triton
    gives it: the first bytes of the string as a BYTES element (a 4-byte little-endian
    length, then its UTF-8), read as that type, zero-padded."""
    if dtype == np.object_:
        return np.full(shape, str(corrid), dtype=dtype)
    if isinstance(corrid, str):
        raw = len(corrid.encode()).to_bytes(4, "little") + corrid.encode()
        size = np.dtype(dtype).itemsize
        return np.full(shape, np.frombuffer(raw[:size].ljust(size, b"\0"), dtype=dtype)[0])
    return np.full(shape, corrid, dtype=dtype)

