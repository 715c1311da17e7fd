"""The tensors the requests carry (perf_analyzer's data loader): zeros, random data made once,
perf_analyzer's JSON input-data files, or a directory with one file per input.

A *sample* is one batch-1 set of inputs {name: array without the batch dimension}; a
*stream* is the samples one sequence plays in order (non-sequence models: one stream that
requests walk round robin, `batch_size` consecutive samples stacked per request).
"""
from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np

from services.perf.model import ModelInfo, Tensor

Sample = dict[str, np.ndarray]


class InputError(Exception):
    """The input data cannot be made as asked; the message names the input or file."""


def np_dtype(datatype: str):
    from tritonclient.utils import triton_to_np_dtype  # type: ignore[import-untyped]
    dt = triton_to_np_dtype(datatype)
    if dt is None:
        raise InputError(f"unsupported datatype '{datatype}'")
    return dt


def _shape(t: Tensor, shapes: dict[str, list[int]], what: str = "") -> list[int]:
    shape = shapes.get(t.name, t.dims)
    if any(d < 0 for d in shape):
        raise InputError(f"input '{t.name}' has variable-size dimensions {t.dims}{what}: give "
                         f"its shape with --shape {t.name}:D1,D2,...")
    return list(shape)


def _strings(n: int, length: int, fixed: str | None, rng: np.random.Generator) -> np.ndarray:
    if fixed is not None:
        return np.array([fixed.encode()] * n, dtype=np.object_)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
                            np.uint8)
    raw = rng.choice(letters, size=(n, length))
    return np.array([bytes(r) for r in raw], dtype=np.object_)


def synthetic(model: ModelInfo, kind: str, shapes: dict[str, list[int]], string_length: int,
              string_data: str | None, seed: int = 0) -> list[list[Sample]]:
    """One stream of one sample: zeros or random values (made once, as perf_analyzer)."""
    rng = np.random.default_rng(seed)
    sample: Sample = {}
    for t in model.inputs:
        shape = _shape(t, shapes)
        n = math.prod(shape)
        if t.datatype == "BYTES":
            arr = _strings(n, string_length, "0" * string_length if kind == "zero" and
                           string_data is None else string_data, rng)
        elif kind == "zero":
            arr = np.zeros(n, np_dtype(t.datatype))
        elif t.datatype == "BOOL":
            arr = rng.integers(0, 2, n).astype(np.bool_)
        else:
            dt = np.dtype(np_dtype(t.datatype))
            arr = (rng.random(n).astype(dt) if dt.kind == "f" else
                   rng.integers(0, 100 if dt.kind == "i" or dt.itemsize > 1 else 2, n).astype(dt))
        sample[t.name] = arr.reshape(shape)
    return [[sample]]


def _decode(t: Tensor, value, shapes: dict[str, list[int]], where: str) -> np.ndarray:
    shape = None
    if isinstance(value, dict) and "content" in value:
        shape = value.get("shape")
        value = value["content"]
    dt = np_dtype(t.datatype)
    if isinstance(value, dict) and "b64" in value:
        raw = base64.b64decode(value["b64"])
        if t.datatype == "BYTES":
            from tritonclient.utils import deserialize_bytes_tensor
            arr = deserialize_bytes_tensor(raw)
        else:
            arr = np.frombuffer(raw, dtype=dt)
    elif t.datatype == "BYTES":
        arr = np.array([v.encode() if isinstance(v, str) else bytes(v)
                        for v in np.asarray(value, dtype=object).ravel()], dtype=np.object_)
    else:
        arr = np.asarray(value, dtype=dt).ravel()
    if shape is None:
        shape = shapes.get(t.name, t.dims)
        if sum(d < 0 for d in shape) == 1:   # (one variable dimension: what the data holds)
            shape = [d if d >= 0 else -1 for d in shape]
        elif any(d < 0 for d in shape):
            _shape(t, shapes, f" and {where} gives no \"shape\"")
    try:
        return arr.reshape([int(d) for d in shape])
    except ValueError:
        raise InputError(f"{where}: input '{t.name}' holds {arr.size} elements, which do not "
                         f"fit the shape {list(shape)}") from None


def from_json(model: ModelInfo, path: Path, shapes: dict[str, list[int]]) -> list[list[Sample]]:
    """perf_analyzer's input-data JSON: {"data": [sample, ...]} or, for sequence models,
    {"data": [[sample, ...], ...]} (one list per stream)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"failed to read --input-data {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not doc["data"]:
        raise InputError(f"--input-data {path}: expected {{\"data\": [...]}} with at least one entry")
    if "validation_data" in doc:
        raise InputError(f"--input-data {path}: \"validation_data\" (output validation) is not "
                         "supported by trireme perf")
    entries = doc["data"]
    streams = entries if isinstance(entries[0], list) else [entries]
    out: list[list[Sample]] = []
    for s, stream in enumerate(streams):
        samples: list[Sample] = []
        for i, entry in enumerate(stream):
            where = f"{path} data[{s}][{i}]" if len(streams) > 1 else f"{path} data[{i}]"
            if not isinstance(entry, dict):
                raise InputError(f"{where}: expected an object {{input name: data}}")
            sample = {}
            for t in model.inputs:
                if t.name in entry:
                    sample[t.name] = _decode(t, entry[t.name], shapes, where)
                elif not t.optional:
                    raise InputError(f"{where}: input '{t.name}' is missing")
            unknown = set(entry) - {t.name for t in model.inputs}
            if unknown:
                raise InputError(f"{where}: {sorted(unknown)} are not inputs of model "
                                 f"'{model.name}'")
            samples.append(sample)
        out.append(samples)
    return out


def from_directory(model: ModelInfo, path: Path, shapes: dict[str, list[int]]) -> list[list[Sample]]:
    """One file per input, named as the input: raw row-major bytes, or for BYTES one string
    per line (perf_analyzer's --input-data DIR)."""
    sample: Sample = {}
    for t in model.inputs:
        f = path / t.name
        if not f.is_file():
            if t.optional:
                continue
            raise InputError(f"--input-data {path}: no file for input '{t.name}'")
        shape = _shape(t, shapes)
        if t.datatype == "BYTES":
            lines = f.read_text().splitlines()
            arr = np.array([ln.encode() for ln in lines], dtype=np.object_)
        else:
            arr = np.fromfile(f, dtype=np_dtype(t.datatype))
        if arr.size != math.prod(shape):
            raise InputError(f"{f}: holds {arr.size} elements, input '{t.name}' needs "
                             f"{math.prod(shape)} (shape {shape})")
        sample[t.name] = arr.reshape(shape)
    return [[sample]]


def load(model: ModelInfo, sources: list[str], shapes: dict[str, list[int]],
         string_length: int, string_data: str | None) -> list[list[Sample]]:
    """The streams of every --input-data (default: random)."""
    unknown = set(shapes) - {t.name for t in model.inputs}
    if unknown:
        raise InputError(f"--shape names {sorted(unknown)}, which are not inputs of model "
                         f"'{model.name}'")
    if not sources:
        sources = ["random"]
    streams: list[list[Sample]] = []
    for src in sources:
        if src in ("zero", "random"):
            streams += synthetic(model, src, shapes, string_length, string_data)
        elif Path(src).is_dir():
            streams += from_directory(model, Path(src), shapes)
        elif Path(src).is_file():
            streams += from_json(model, Path(src), shapes)
        else:
            raise InputError(f"Failed to parse --input-data. Unsupported type provided: '{src}'. "
                             "The available options are 'zero', 'random', path to a directory, "
                             "or a json file.")
    return streams


def batch(samples: list[Sample], batch_size: int, batched: bool) -> list[Sample]:
    """The requests' tensors: request k stacks samples k*b .. k*b+b-1 (round robin), with
    the batch dimension when the model batches."""
    if not batched:
        return samples
    n = len(samples)
    out = []
    for k in range(n):
        picked = [samples[(k * batch_size + j) % n] for j in range(batch_size)]
        names = picked[0].keys()
        out.append({name: np.stack([p[name] for p in picked]) for name in names})
    return out
