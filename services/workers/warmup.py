"""Model warmup: the config's `model_warmup` samples, run on this instance while it loads.

    Worker.load ─▶ create_backend ─▶ run(backend, batch_io, load) ─▶ ModelLoaded (or its error)

As Triton's core does for each instance it creates (core src/backend_model_instance.cc,
GenerateWarmupData then WarmUp):

1. Every sample's requests are built and checked first, in the config's order; an error
   fails the load before any sample runs. A sample of `batch_size` 0 is skipped. Its inputs
   come from `zero_data`, `random_data` (one random buffer per sample, which every random
   input reads from its start; STRING gets zeros: empty strings) or `input_data_file`, read
   from `<model dir>/warmup/` (STRING: the whole file, a 4-byte little-endian length and
   the bytes per element; other types: the first bytes the shape needs). Their `dims` have
   no batch dimension: a model that batches gets [1] in front. Inputs the model has are
   checked as a client's request would be (Triton's Normalize, here
   services.dataplane.validation); the others are control inputs (a sequence model's
   START, READY, ...), passed as given.
2. Each sample runs `count` times (0: once): its `batch_size` requests, of batch 1 each, in
   one execution, handed to the backend the way Worker.execute hands a batch over (config
   reshape, ragged and batch inputs, one execute over the batch or one request each for a
   per-request backend), without the scheduler: no queue, no response cache, no statistics.
   Outputs are discarded. Every error a response carries is collected; a run with any fails
   the load: "failed to run warmup sample '<s>': <e1>; <e2>; " (INVALID_ARG).

A decoupled model's run ends when each request's final response has come (from any thread).
An instance restarted after a crash loads again, so it warms up again.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.common.config import input_shape
from services.common.datatypes import config_to_api, deserialize_bytes_tensor, numpy_dtype
from services.common.errors import Code, TriremeError, invalid_arg
from services.dataplane.types import CoreRequest, InputTensor
from services.dataplane.validation import validate_infer

if TYPE_CHECKING:
    from services.workers.backends.base import Backend
    from services.workers.batch_io import BatchIO

log = logging.getLogger("trireme.worker")

WARMUP_DIR = "warmup"           # Triton's kWarmupDataFolder, inside the model's directory
_RID = "[request id: <id_unknown>] "   # LogRequest() of a warmup request (it has no id)
_INVALID = "INVALID"            # the datatype of an input whose data_type is not set


@dataclass
class Sample:
    """One sample of `model_warmup`, ready to run: each request's inputs (all alike)."""
    name: str
    count: int
    requests: list[dict[str, np.ndarray]]


def run(backend: Backend, batch_io: BatchIO | None, load: m.LoadModel) -> None:
    """Warm this instance up with the samples of its (completed) config; raises the
    TriremeError that fails its load."""
    cfg: Any = backend.config
    if not cfg.model_warmup:
        return
    for sample in samples(cfg, load.model, load.model_dir):   # every one checked before any runs
        for n in range(1, sample.count + 1):
            log.debug("model '%s' instance %s is running warmup sample '%s' for iteration %d",
                      load.model, load.instance_name, sample.name, n)
            errors = _execute(backend, batch_io, load.instance_name, sample.requests)
            if errors:
                log.debug("model '%s' instance %s failed to run warmup sample '%s'",
                          load.model, load.instance_name, sample.name)
                raise invalid_arg(f"failed to run warmup sample '{sample.name}': "
                                  + "".join(f"{e}; " for e in errors))


# ------------------------------------------------------------------------------ samples
def samples(cfg: Any, model: str, model_dir: str) -> list[Sample]:
    """Every sample of ``cfg.model_warmup`` to run, built and checked (Triton's
    GenerateWarmupData: the first error fails them all)."""
    info = _model_info(cfg, model)
    own = {s.name for s in info.inputs}
    out = []
    for ws in cfg.model_warmup:
        if ws.batch_size == 0:
            log.debug("Skipping batch 0 warmup sample '%s'", ws.name)
            continue
        log.debug("Generating warmup sample data for '%s'", ws.name)
        inputs = _inputs(ws, cfg.max_batch_size, Path(model_dir))
        # Normalize: the model's own inputs must make a request it accepts
        validate_infer(info, CoreRequest(model, inputs=[t for t in inputs if t.name in own]))
        arrays = {t.name: _array(t) for t in inputs}
        # (one set of arrays: the requests only read them, as Triton's share their buffers)
        out.append(Sample(ws.name, max(ws.count, 1), [arrays] * ws.batch_size))
    return out


def _model_info(cfg: Any, model: str) -> m.ModelInfo:
    """What request validation needs of the model: its inputs as clients see them."""
    mbs = cfg.max_batch_size
    return m.ModelInfo(0, model, max_batch_size=mbs, inputs=[
        m.IOSpec(io.name, config_to_api(mc.DataType.Name(io.data_type)), input_shape(io, mbs),
                 bool(io.optional)) for io in cfg.input])


def _inputs(ws: Any, max_batch_size: int, model_dir: Path) -> list[InputTensor]:
    """One request's inputs of sample ``ws``, as raw bytes (Triton's two passes: the sizes
    first, and with them the variable-size check of every input, then the data)."""
    sizes: dict[str, int] = {}
    random_size = 0
    for name, spec in ws.inputs.items():
        if any(d < 0 for d in spec.dims):
            raise invalid_arg("warmup setting expects all variable-size dimensions are "
                              f"specified for input '{name}'")
        sizes[name] = size = _byte_size(spec)
        if spec.WhichOneof("input_data_type") == "random_data" and spec.data_type != mc.TYPE_STRING:
            random_size = max(random_size, size)
    random = np.random.default_rng().bytes(random_size)
    batch = [1] if max_batch_size > 0 else []
    out = []
    for name, spec in ws.inputs.items():
        size = sizes[name]
        kind = spec.WhichOneof("input_data_type")
        if kind == "zero_data" or (kind == "random_data" and spec.data_type == mc.TYPE_STRING):
            data = bytes(size)   # STRING: `size` / 4 zero lengths, each an empty string
        elif kind == "random_data":
            data = random[:size]
        elif kind == "input_data_file":
            data = _read(model_dir / WARMUP_DIR / spec.input_data_file)
            if spec.data_type != mc.TYPE_STRING:
                if size > len(data):
                    raise invalid_arg(f"{_RID}warmup setting expects {size} bytes, but the data "
                                      f"provided from {spec.input_data_file}only has {len(data)} "
                                      "bytes")
                data = data[:size]
        else:
            raise invalid_arg(f"{_RID}warmup setting expects input '{name}' to have "
                              "input_data_type set")
        out.append(InputTensor(name, _datatype(spec.data_type), [*batch, *spec.dims], data))
    return out


def _byte_size(spec: Any) -> int:
    """Triton's GetByteSize of a warmup input: STRING counts 4 bytes (a length) per element;
    an input without a data type has none."""
    count = int(np.prod(spec.dims, dtype=np.int64)) if spec.dims else 1
    if spec.data_type == mc.TYPE_STRING:
        return 4 * count
    if spec.data_type == mc.TYPE_INVALID:
        return 0
    return count * numpy_dtype(_datatype(spec.data_type)).itemsize


def _datatype(data_type: int) -> str:
    return _INVALID if data_type == mc.TYPE_INVALID else config_to_api(mc.DataType.Name(data_type))


def _read(path: Path) -> bytes:
    """Triton's ReadTextFile, with its error (INTERNAL)."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise TriremeError(Code.INTERNAL, f"failed to open text file for read {path}: "
                                          f"{e.strerror}") from None


def _array(t: InputTensor) -> np.ndarray:
    """An input as the worker hands inputs to a backend (Worker._array)."""
    data = t.data if t.data is not None else b""
    if t.datatype == "BYTES":
        return deserialize_bytes_tensor(data).reshape(t.shape)
    return np.frombuffer(data, dtype=numpy_dtype(t.datatype)).reshape(t.shape)


# ------------------------------------------------------------------------------ execution
def _execute(backend: Backend, batch_io: BatchIO | None, instance: str,
             requests: list[dict[str, np.ndarray]]) -> list[str]:
    """One execution of the requests; the error message of each response that has one."""
    cfg: Any = backend.config
    n, mbs = len(requests), cfg.max_batch_size
    if n != 1 and n > mbs:   # every Triton backend's own check of the batch it is handed
        return [f"batch size {n} for '{instance}', max allowed is {mbs}"] * n
    try:
        per_item = requests
        if backend.reshape is not None:   # config reshape: the model sees reshape.shape
            per_item = [backend.reshape.inputs_for_model(p) for p in per_item]
        if backend.per_request:
            return _execute_requests(backend, per_item)
        if batch_io is not None:          # ragged inputs flattened, batch inputs generated
            inputs = batch_io.gather(per_item)
        elif n == 1:
            inputs = dict(per_item[0])   # (the next iteration hands the same arrays over)
        else:
            inputs = {name: np.concatenate([p[name] for p in per_item]) for name in per_item[0]}
        backend.execute(inputs, [io.name for io in cfg.output])
    except TriremeError as e:
        return [e.message] * n
    except Exception as e:  # noqa: BLE001 - a framework's error fails every request, as in execute
        return [str(e)] * n
    return []


class _Answers:
    """A per-request backend's responses to one run, from any thread: their errors, and
    which requests still wait for their final response."""

    def __init__(self, n: int) -> None:
        self.errors: list[str] = []
        self.open = set(range(n))
        self._done = threading.Condition()

    def reply(self, index: int, outputs: Any, error: TriremeError | None, final: bool) -> None:
        with self._done:
            if error is not None:
                self.errors.append(error.message)
            if final:
                self.open.discard(index)
                self._done.notify_all()

    def wait(self) -> list[str]:
        with self._done:
            self._done.wait_for(lambda: not self.open)
            return self.errors


def _execute_requests(backend: Backend, per_item: list[dict[str, np.ndarray]]) -> list[str]:
    """A per-request backend (Python): requests answered now, or later through their
    response senders (a decoupled model), which this waits for."""
    answers = _Answers(len(per_item))
    items = [m.BatchItem("warmup", i, []) for i in range(len(per_item))]
    returned = backend.execute_requests(items, per_item, answers.reply)
    for i, answer in enumerate(returned):
        if answer is not None:   # None: its response sender answers (now or later)
            answers.reply(i, None, answer if isinstance(answer, TriremeError) else None, True)
    return answers.wait()
