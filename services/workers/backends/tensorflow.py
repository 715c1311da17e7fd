"""TensorFlow backend: the only module that imports tensorflow.

Serves a SavedModel (`model.savedmodel/`, platform tensorflow_savedmodel) through one of its
signatures, and a frozen GraphDef (`model.graphdef`, platform tensorflow_graphdef) through a
pruned tf.compat.v1 wrap_function. Follows Triton's tensorflow_backend (src/tensorflow.cc:
ParseParameters, AutoCompleteConfig, ValidateTRITONTFModel; src/tensorflow_backend_tf.cc:
TRITONTF_ModelCreateFromSavedModel / FromGraphDef); error texts are Triton's where it has one.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path

# TensorFlow's C++ runtime logs at INFO/WARNING from its first import on; a worker's log
# should hold our lines. setdefault: TF_CPP_MIN_LOG_LEVEL=0 in the environment still works.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from protos import model_config_pb2 as mc
from services.common.config import TF_GRAPHDEF, complete_io
from services.common.datatypes import api_to_config, config_to_api
from services.common.errors import (
    Code,
    TriremeError,
    expects_datatype_text,
    expects_inputs_text,
    invalid_arg,
    unexpected_io_text,
)
from services.common.repository import model_file
from services.workers.backends.base import BackendBase
from services.workers.backends.common import gpu_unavailable, int_value, model_dims, model_inputs, param

log = logging.getLogger(__name__)
tf.get_logger().setLevel(logging.ERROR)

_TF_TYPES = {
    tf.bool: "BOOL", tf.uint8: "UINT8", tf.uint16: "UINT16", tf.uint32: "UINT32",
    tf.uint64: "UINT64", tf.int8: "INT8", tf.int16: "INT16", tf.int32: "INT32",
    tf.int64: "INT64", tf.float16: "FP16", tf.float32: "FP32", tf.float64: "FP64",
    tf.string: "BYTES", tf.bfloat16: "BF16",
}
_DEFAULT_TAG, _DEFAULT_SIGNATURE = "serve", "serving_default"


def _thread_count(cfg, key: str) -> int:
    """Triton's TF_NUM_INTRA_THREADS / TF_NUM_INTER_THREADS: 0 (the default) lets TF choose."""
    error = f"parameter '{key}' must be non-negative number for TensorFlow model '{cfg.name}'"
    n = int_value(param(cfg, key) or "0", error)
    if n < 0:
        raise invalid_arg(error)
    return n


def _datatype(dtype, kind: str, key: str, model: str) -> str:
    datatype = _TF_TYPES.get(dtype)
    if datatype is None:
        name = types_pb2.DataType.Name(dtype.as_datatype_enum)
        raise invalid_arg(f"unable to process {kind} '{key}' for '{model}', unsupported "
                          f"datatype '{name}'")
    return datatype


def _init_ops(cfg, model_dir: str, version: int) -> list[str]:
    """TF_INIT_OPS_FILE (Triton's tensorflow backend): a JSON file {"init_ops": [names]} in the
    version folder or, failing that, the model folder; the named operations run once after the
    model loads (e.g. tf.compat.v1.global_variables_initializer, named "init")."""
    filename = param(cfg, "TF_INIT_OPS_FILE")
    if not filename:
        return []
    folders = (Path(model_dir) / str(version), Path(model_dir))
    path = next((f / filename for f in folders if (f / filename).is_file()), None)
    if path is None:
        raise invalid_arg(f"unable to load model '{cfg.name}': TF_INIT_OPS_FILE '{filename}' is "
                          f"neither in '{folders[0]}' nor in '{folders[1]}'")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise invalid_arg(f"unable to load model '{cfg.name}': failed to read TF_INIT_OPS_FILE "
                          f"'{path}': {e}") from e
    ops = doc.get("init_ops") if isinstance(doc, dict) else None
    if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
        raise invalid_arg(f"unable to load model '{cfg.name}': TF_INIT_OPS_FILE '{path}' must "
                          "hold an object with 'init_ops', a list of operation names")
    return ops


def _run_init_ops(name: str, graph, prune, ops: list[str]) -> None:
    """Run each initialization operation of a graph once, in order, before serving."""
    for op in ops:
        try:
            target = graph.get_operation_by_name(op)
        except (KeyError, ValueError):
            raise invalid_arg(f"unable to load model '{name}': initialization operation '{op}' "
                              "is not in the graph") from None
        try:
            prune(feeds=[], fetches=[target])()
        except tf.errors.OpError as e:
            raise invalid_arg(f"unable to load model '{name}': initialization operation '{op}' "
                              f"failed: {_op_error_text(e)}") from e


def _setup_runtime(cfg, kind: str) -> str | None:
    """Threads and devices; TF accepts both only before its runtime starts (the first op).
    Returns the device to run on, None to keep the model's own placement (KIND_MODEL)."""
    intra = _thread_count(cfg, "TF_NUM_INTRA_THREADS")
    inter = _thread_count(cfg, "TF_NUM_INTER_THREADS")
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    gpus = tf.config.list_physical_devices("GPU")
    if kind == "KIND_GPU" and not gpus:
        raise gpu_unavailable(cfg.name, "TensorFlow sees no GPU (the package is tensorflow-cpu, "
                              "or no CUDA device is visible)", "tensorflow with CUDA support")
    if kind not in ("KIND_GPU", "KIND_MODEL"):
        if gpus:   # a CPU instance must not take GPU memory
            tf.config.set_visible_devices([], "GPU")
        return "/CPU:0"
    # Triton's default allow_gpu_memory_growth: instances on one GPU share it, none grabs it all.
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    # The scheduler sets CUDA_VISIBLE_DEVICES to the instance's GPU: it is always GPU:0 here.
    return "/GPU:0" if kind == "KIND_GPU" else None


class _SavedModel:
    """One signature of a SavedModel; config names are the signature's input/output keys."""

    def __init__(self, cfg, path, autocomplete: bool) -> None:
        name = cfg.name
        tag = param(cfg, "TF_GRAPH_TAG") or _DEFAULT_TAG
        try:
            self._loaded = tf.saved_model.load(str(path), tags=[tag])
        except Exception as e:   # garbage files, missing variables, unknown tag, unknown op
            if autocomplete:
                raise invalid_arg(f"unable to auto-complete model configuration for '{name}', "
                                  f"failed to load model: {e}") from e
            raise invalid_arg(f"unable to load model '{name}': {e}") from e
        self.fn = self._signature(cfg)
        _, kwargs = self.fn.structured_input_signature
        self.dtypes = {k: spec.dtype for k, spec in kwargs.items()}
        # Signature keys are a map: sorted, so the completed config is the same on every load.
        self.inputs = [(k, _datatype(s.dtype, "input", k, name), s.shape)
                       for k, s in sorted(kwargs.items())]
        self.outputs = [(k, _datatype(s.dtype, "output", k, name), s.shape)
                        for k, s in sorted(self.fn.structured_outputs.items())]

    def _signature(self, cfg):
        sigs = self._loaded.signatures
        wanted = param(cfg, "TF_SIGNATURE_DEF")
        if (wanted or _DEFAULT_SIGNATURE) in sigs:
            return sigs[wanted or _DEFAULT_SIGNATURE]
        if not wanted and sigs:
            # Triton: no "serving_default", so the model's (first) other signature.
            other = min(sigs)
            log.warning("unable to find default serving signature '%s', using signature '%s'",
                        _DEFAULT_SIGNATURE, other)
            return sigs[other]
        raise invalid_arg(f"unable to load model '{cfg.name}', expected "
                          f"'{wanted or _DEFAULT_SIGNATURE}' signature")

    def complete(self, cfg, autocomplete: bool):
        """complete_io from the signature (Triton's rules); without auto-complete a config
        that lists inputs and outputs is still checked against it. A tensor of unknown rank
        takes its shape from the config and cannot be auto-completed (Triton: rank 0)."""
        if not autocomplete and not (cfg.input and cfg.output):
            return cfg   # validate() names what is missing
        batch = [-1] if cfg.max_batch_size > 0 else []
        given = {io.name: io for io in (*cfg.input, *cfg.output)}
        triples: dict[str, list] = {"input": [], "output": []}
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            for key, datatype, shape in tensors:
                if shape.rank is not None:
                    dims = [-1 if d is None else int(d) for d in shape]
                elif key in given and given[key].dims:
                    io = given[key]   # the model sees the reshape when there is one (Triton)
                    dims = batch + model_dims(io)
                else:
                    raise invalid_arg(f"Unable to autofill for '{cfg.name}': the rank of model "
                                      f"tensor '{key}' is 0 which is not supported")
                triples[kind].append((key, datatype, dims))
        completed = complete_io(cfg, triples["input"], triples["output"])
        return completed if autocomplete else cfg

    def initialize(self, name: str, ops: list[str]) -> None:
        # A TF1 SavedModel loads as a wrapped graph, whose operations can be run by name; a
        # TF2 one restores its own state and has no such graph.
        graph, prune = getattr(self._loaded, "graph", None), getattr(self._loaded, "prune", None)
        if graph is None or prune is None:
            raise invalid_arg(f"unable to load model '{name}': TF_INIT_OPS_FILE needs a graph "
                              "whose operations can be run by name (a GraphDef or a TensorFlow 1 "
                              "SavedModel); a TensorFlow 2 SavedModel initializes itself when it "
                              "loads")
        _run_init_ops(name, graph, prune, ops)

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, tf.Tensor]:
        # convert_to_tensor copies: TF never aliases (read-only) shared memory.
        result = self.fn(**{k: tf.convert_to_tensor(v, self.dtypes.get(k))
                            for k, v in inputs.items()})
        return {n: result[n] for n in outputs}


class _GraphDef:
    """A frozen GraphDef: any Placeholder may be an input and any other node an output
    (Triton's "potential" inputs/outputs); tensor "X:0" serves the config name "X"."""

    def __init__(self, cfg, path) -> None:
        name = cfg.name
        graph_def = tf.compat.v1.GraphDef()
        try:
            graph_def.ParseFromString(path.read_bytes())
        except Exception as e:   # protobuf's DecodeError, or an unreadable file
            raise invalid_arg(f"unable to load model '{name}': failed to parse '{path}' as a "
                              f"GraphDef: {e}") from e
        if not graph_def.node:
            raise invalid_arg(f"model {name} has an empty network")
        placeholders = {n.name for n in graph_def.node if n.op == "Placeholder"}
        others = {n.name for n in graph_def.node if n.op != "Placeholder"}
        # Batch inputs are placeholders the worker feeds too: checked like the inputs.
        inputs = model_inputs(cfg)
        if len(inputs) > len(placeholders):
            raise invalid_arg(expects_inputs_text(name, len(inputs),
                                                  f"at most {len(placeholders)}"))
        for kind, ios, allowed in (("input", inputs, placeholders),
                                   ("output", cfg.output, others)):
            for io in ios:
                if io.name not in allowed:
                    raise invalid_arg(unexpected_io_text(kind, io.name, allowed))
        for node in graph_def.node:
            # Triton clears placements that are not the CPU: the instance picks the device.
            if "CPU" not in node.device.upper():
                node.device = ""
        self._wrapped = tf.compat.v1.wrap_function(
            lambda: tf.compat.v1.import_graph_def(graph_def, name=""), [])
        self._pruned: dict[tuple[tuple[str, ...], tuple[str, ...]], object] = {}
        # Triton leaves datatypes to fail at run time; checking them here fails the load instead.
        graph = self._wrapped.graph
        self.dtypes = {}
        for kind, ios in (("input", inputs), ("output", cfg.output)):
            for io in ios:
                self.dtypes[io.name] = graph.get_tensor_by_name(f"{io.name}:0").dtype
                have = _datatype(self.dtypes[io.name], kind, io.name, name)
                want = config_to_api(mc.DataType.Name(io.data_type))
                if have != want:
                    raise invalid_arg(expects_datatype_text(
                        name, kind, io.name, mc.DataType.Name(io.data_type), api_to_config(have)))

    def initialize(self, name: str, ops: list[str]) -> None:
        _run_init_ops(name, self._wrapped.graph, self._wrapped.prune, ops)

    def run(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, tf.Tensor]:
        feeds, fetches = tuple(inputs), tuple(outputs)
        fn = self._pruned.get((feeds, fetches))
        if fn is None:   # one pruned function per (inputs given, outputs asked) combination
            graph = self._wrapped.graph
            fn = self._wrapped.prune(feeds=[graph.get_tensor_by_name(f"{n}:0") for n in feeds],
                                     fetches=[graph.get_tensor_by_name(f"{n}:0") for n in fetches])
            self._pruned[(feeds, fetches)] = fn
        results = fn(*(tf.convert_to_tensor(inputs[n], self.dtypes.get(n)) for n in feeds))
        return dict(zip(fetches, results))


def _op_error_text(e: tf.errors.OpError) -> str:
    """The runtime's own words: TF prefixes them with the Python stack that built the failing
    op (our paths, not the client's business) and suffixes the internal function name."""
    text = e.message.strip().rsplit("\n\n", 1)[-1]
    return re.sub(r"\s*\[Op:[^\]]*\]$", "", text).replace("\n\t", "")


class TensorFlowBackend(BackendBase):
    def __init__(self, cfg, load) -> None:
        path = model_file(cfg, load.model_dir, load.version)
        init_ops = _init_ops(cfg, load.model_dir, load.version)
        self.device = _setup_runtime(cfg, load.kind)
        self.name = cfg.name
        with self._on_device():   # variables and constants land where the instance runs
            if cfg.platform == TF_GRAPHDEF:
                # Triton: a GraphDef carries no shapes/datatypes, so no auto-complete.
                self.model = _GraphDef(cfg, path)
                self.config = cfg
            else:
                self.model = _SavedModel(cfg, path, load.autocomplete)
                self.config = self.model.complete(cfg, load.autocomplete)
            if init_ops:
                self.model.initialize(cfg.name, init_ops)

    def _on_device(self):
        return tf.device(self.device) if self.device else contextlib.nullcontext()

    def execute(self, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        try:
            with self._on_device():
                results = self.model.run(inputs, outputs)
        except tf.errors.OpError as e:
            raise TriremeError(Code.INTERNAL, f"TensorFlow error in model '{self.name}': "
                                              f"{_op_error_text(e)}") from e
        except (TypeError, ValueError) as e:   # inputs the function cannot bind
            raise TriremeError(Code.INTERNAL,
                               f"TensorFlow error in model '{self.name}': {e}") from e
        # np.asarray shares the tensor's buffer (read-only); .numpy() would copy it.
        return {k: np.asarray(v) for k, v in results.items()}

    def close(self) -> None:
        self.model = None


BACKEND = TensorFlowBackend
