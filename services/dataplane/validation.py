"""Request validation against cached model metadata, before anything is queued.

Checks run in the order Triton runs them and fail with Triton's wording and codes, because
clients and Triton's own tests match on these strings. Sources (triton-inference-server):
- core src/infer_request.{h,cc}: InferenceRequest::AddOriginalInput /
  AddOriginalRequestedOutput (duplicates), Normalize, ValidateRequestInputs,
  ValidateBytesInputs. These messages start with LogRequest(): "[request id: <id>] ",
  "<id_unknown>" when the request has no id.
- core src/model.cc: Model::GetInput / GetOutput ("unexpected inference input|output").
- core src/model_repository_manager/model_lifecycle.cc (GetModel) and
  model_repository_manager.cc (which prefixes "Request for unknown model: ").
- server src/common.cc: GetModelVersionFromString.
- backend src/backend_common.cc: "incomplete string data ..." (the core leaves a truncated
  last BYTES element to the backend; we reject it here, with the backend's text).

Pure functions: nothing is cached between calls, so a model reload can never leave stale
state behind. No Python loop touches fixed-size tensor data; BYTES framing is walked once
per element (unavoidable: element offsets are sequential), stopping early like Triton.
"""

from __future__ import annotations

import re
import struct

from services.common.datatypes import DATATYPES, element_size
from services.common.errors import (
    Code,
    TriremeError,
    bad_version_string_text,
    invalid_arg,
    not_ready_text,
    unknown_model,
)
from services.common.messages import ModelInfo
from services.common.states import ModelState
from services.dataplane.types import CoreRequest

__all__ = ["check_parameters", "parameter_range_text", "resolve_version", "unknown_model_error",
           "validate_infer"]

_READY = ModelState.READY
_WILDCARD = -1
_KNOWN_DATATYPES = frozenset(DATATYPES)
_ELEMENT_SIZE = {dt: element_size(dt) for dt in DATATYPES}   # BYTES: None
_U32 = struct.Struct("<I").unpack_from
# What std::stol accepts: leading whitespace, an optional sign, digits (rest ignored).
_STOL = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_INT64_MAX = (1 << 63) - 1
_INT64_MIN = -_INT64_MAX - 1
_UINT64_MAX = (1 << 64) - 1
_SCALARS = (str, bool, float)   # parameter values that always cross as they are
_BATCH_NOTE = (
    "NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
    "dimension to be prepended to each input shape. If you want to specify the full shape "
    "including the batch dim in your input dims config, try setting max_batch_size to zero. "
    "See the model configuration docs for more info on max_batch_size.")


def _dims(shape) -> str:
    """triton::common::DimsListToString: "[1,-1,3]" (no spaces)."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names(names) -> str:
    """ValidateRequestInputs' list rendering: "['a','b']"; Triton's pop_back on an empty
    list drops the "[" itself, so an empty list renders as "]" (reproduced on purpose)."""
    s = "[" + "".join(f"'{n}'," for n in names)
    return s[:-1] + "]"


unknown_model_error = unknown_model   # Triton's answer for a model name the repository does not know


# ------------------------------------------------------------------------------- versions
def resolve_version(info: ModelInfo, version: str) -> int:
    """The concrete version a request for ``version`` ("" = default) runs on."""
    name = info.name
    if info.error is not None:
        raise TriremeError(info.error.code, info.error.message)
    if not version:
        ready = [v for v, state in info.versions.items() if state == _READY]
        if not ready:
            raise TriremeError(
                Code.NOT_FOUND, f"Request for unknown model: '{name}' has no available versions")
        return max(ready)
    m = _STOL.match(version)
    v = int(m.group(1)) if m else None
    if v is None or not -_INT64_MAX - 1 <= v <= _INT64_MAX:
        raise invalid_arg(bad_version_string_text(version, "stol"))
    if v < 0:
        raise invalid_arg(f"invalid model version specified '{version}' , version should be an "
                          f"integral value > 0")
    state = info.versions.get(v)
    if state is None:
        raise TriremeError(Code.NOT_FOUND,
                           f"Request for unknown model: '{name}' version {v} is not found")
    if state != _READY:
        raise TriremeError(Code.UNAVAILABLE,
                           f"Request for unknown model: {not_ready_text(name, v)}")
    return v


# ------------------------------------------------------------------------------ parameters
def parameter_range_text(key: str) -> str:
    return (f"parameter '{key}' is out of range: an integer parameter must fit in int64 or "
            f"uint64 ([-2^63, 2^64-1])")


def check_parameters(params: dict) -> None:
    """Request parameters travel to the scheduler and the model as msgpack, which holds an
    integer only within [-2**63, 2**64 - 1] (gRPC's int64_param / uint64_param; JSON has no
    bound). A value outside, anywhere in a parameter, is the client's error, named here so
    the request fails alone before it is queued with others."""
    for key, value in params.items():
        t = type(value)
        if t is int:
            if _INT64_MIN <= value <= _UINT64_MAX:
                continue
        elif t in _SCALARS or value is None or _ints_fit(value):
            continue
        raise invalid_arg(parameter_range_text(key))


def _ints_fit(value) -> bool:
    """Every integer in a nested value (lists, dicts, their keys) within 64 bits; walked
    with a stack, so a deeply nested value costs no recursion."""
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is int:
            if not _INT64_MIN <= v <= _UINT64_MAX:
                return False
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return True


# ------------------------------------------------------------------------------- requests
def validate_infer(info: ModelInfo, req: CoreRequest) -> int:
    """Check ``req`` against ``info``; return its batch size (1 for a non-batching model)."""
    model = info.name
    inputs = req.inputs
    if req.parameters:   # read while the request is built, before anything else (Triton's order)
        check_parameters(req.parameters)
    specs = {}
    n_required = 0
    for s in info.inputs:
        specs[s.name] = s
        if not s.optional:
            n_required += 1

    # 1. Duplicates, caught by Triton while the request is being built (inputs, then outputs).
    seen = {t.name for t in inputs}
    if len(seen) != len(inputs):
        _raise_duplicate(req, inputs, "input")
    if req.outputs:
        out_names = {o.name for o in req.outputs}
        if len(out_names) != len(req.outputs):   # Triton keeps the first, answers it once
            once: dict = {}
            for o in req.outputs:
                once.setdefault(o.name, o)
            req.outputs = list(once.values())
        # 2. Requested outputs (Triton walks a std::set: sorted order).
        known_outputs = {s.name for s in info.outputs}
        if not out_names <= known_outputs:
            for name in sorted(out_names):
                if name not in known_outputs:
                    raise invalid_arg(f"unexpected inference output '{name}' for model '{model}'")

    # From here Triton walks its inputs in a std::unordered_map, which (libstdc++, a few
    # entries) yields the last one added first: its errors name inputs in that order.
    inputs = inputs[::-1] if len(inputs) > 1 else inputs

    # 3. Input count (ValidateRequestInputs).
    n, n_cfg = len(inputs), len(info.inputs)
    if n > n_cfg or n < n_required:
        raise _count_error(_rid(req), info, seen, inputs, n_required)

    # 4. Batch dimension; unknown inputs surface here, in request order, as in Triton.
    mbs = info.max_batch_size
    batch = 0
    given_required = 0
    for t in inputs:
        spec = specs.get(t.name)
        if spec is None:
            raise invalid_arg(f"unexpected inference input '{t.name}' for model '{model}'")
        if not spec.optional:
            given_required += 1
        if mbs > 0:
            if not t.shape:
                raise invalid_arg(f"{_rid(req)}input '{t.name}' has no shape but model requires "
                                  f"batch dimension for '{model}'")
            d0 = t.shape[0]
            if d0 > _INT64_MAX:   # kept in 32 bits below: the byte-size check cannot see it
                raise _dim_range_error(_rid(req), model, t)
            if batch == 0:
                batch = d0 & 0xFFFFFFFF          # Triton keeps it in a uint32
            elif d0 != batch:
                raise invalid_arg(f"{_rid(req)}input '{t.name}' batch size does not match other "
                                  f"inputs for '{model}'")
    # Triton only counts inputs; a required input replaced by an optional one would reach
    # the backend. Reject it here with the same message. (As many required inputs given as
    # required: none can be missing, so the walk over the config is skipped.)
    if given_required < n_required and any(not s.optional and s.name not in seen
                                           for s in info.inputs):
        raise _count_error(_rid(req), info, seen, inputs, n_required)
    if batch > mbs:
        raise invalid_arg(f"{_rid(req)}inference request batch-size must be <= {mbs} for "
                          f"'{model}'")

    # 5. Per input: datatype, shape, then byte size.
    first = 1 if mbs > 0 else 0
    for t in inputs:
        spec = specs[t.name]
        if t.datatype != spec.datatype:
            got = t.datatype if t.datatype in _KNOWN_DATATYPES else "<invalid>"
            raise invalid_arg(f"{_rid(req)}inference input '{t.name}' data-type is '{got}', but "
                              f"model '{model}' expects '{spec.datatype}'")
        shape, cfg = t.shape, spec.shape
        # Triton's order: a wildcard in the request fails at once, a mismatch ends the
        # walk (shape error), and any other negative dim fails after the walk.
        count, negative, matched = 1, False, False
        if len(shape) - first == max(len(cfg) - first, 0):
            for i in range(first, len(shape)):
                d, c = shape[i], cfg[i]
                if d == _WILDCARD:
                    raise _all_dims_error(_rid(req), model, t)
                if c != _WILDCARD and c != d:
                    break
                if d < 0:
                    negative = True
                count *= d
            else:
                matched = True
        if not matched:
            raise invalid_arg(f"{_rid(req)}unexpected shape for input '{t.name}' for model "
                              f"'{model}'. Expected {_dims(spec.shape)}, got {_dims(shape)}. "
                              f"{_BATCH_NOTE if mbs > 0 else ''}")
        if negative:                             # -2 etc. under a wildcard config dim
            raise _all_dims_error(_rid(req), model, t)
        if not count and max(shape) > _INT64_MAX:   # no elements: the byte size is 0 anyway
            raise _dim_range_error(_rid(req), model, t)
        if mbs > 0:
            count *= batch or 1
        try:
            size = _ELEMENT_SIZE[spec.datatype]
        except KeyError:
            size = element_size(spec.datatype)   # raises Triton's unsupported-datatype error
        if size is None:
            _check_bytes(_rid(req), model, t, count)
        else:
            _check_byte_size(req, model, t, count * size)

    if mbs > 0 and batch == 0:
        # Triton would run a zero-row batch as if the model did not batch; we cannot.
        raise invalid_arg(f"{_rid(req)}inference request batch-size must be >= 1 for '{model}'")
    return batch if mbs > 0 else 1


def _rid(req: CoreRequest) -> str:
    """LogRequest()'s prefix of Triton's request errors (built only for an error)."""
    return f"[request id: {req.id or '<id_unknown>'}] "


def _raise_duplicate(req: CoreRequest, items, kind: str) -> None:
    seen: set[str] = set()
    for x in items:
        if x.name in seen:
            raise invalid_arg(f"{_rid(req)}{kind} '{x.name}' already exists in request")
        seen.add(x.name)


def _count_error(rid, info, given, inputs, n_required) -> TriremeError:
    n_cfg = len(info.inputs)
    missing = _names(s.name for s in info.inputs if not s.optional and s.name not in given)
    got = _names(t.name for t in inputs) if inputs else "[]"
    if n_cfg == n_required:
        head = f"expected {n_cfg} inputs"
    else:
        head = f"expected number of inputs between {n_required} and {n_cfg}"
    return invalid_arg(f"{rid}{head} but got {len(inputs)} inputs for model '{info.name}'. Got "
                       f"input(s) {got}, but missing required input(s) {missing}. Please provide "
                       f"all required input(s).")


def _dim_range_error(rid, model, t) -> TriremeError:
    """A dimension beyond int64 (Triton's dims are int64; none can cross to the model).
    Any other dimension that large fails the byte-size check."""
    return invalid_arg(f"{rid}unexpected shape for input '{t.name}' for model '{model}': a "
                       f"dimension is out of range (dimensions must fit in int64), got "
                       f"{_dims(t.shape)}")


def _all_dims_error(rid, model, t) -> TriremeError:
    return invalid_arg(f"{rid}All input dimensions should be specified for input '{t.name}' for "
                       f"model '{model}', got {_dims(t.shape)}")


def _check_byte_size(req, model, t, expected: int) -> None:
    data = t.data
    if data is None:
        got = t.parameters.get("shared_memory_byte_size")
        if got is None:
            if "shared_memory_region" in t.parameters:
                return                           # size unknown here; the region check owns it
            got = 0                              # no data at all: Triton sees 0 bytes
    else:
        got = data.nbytes if isinstance(data, memoryview) else len(data)
    if got != expected:   # (a raw request's input keeps the name Triton's HTTP server gives it)
        name = "raw_input" if req.raw else t.name
        raise invalid_arg(f"{_rid(req)}input byte size mismatch for input '{name}' for model "
                          f"'{model}'. Expected {expected}, got {got}")


def _check_bytes(rid, model, t, count: int) -> None:
    """ValidateBytesInputs over one contiguous buffer: 4-byte LE length + payload each."""
    data = t.data
    if data is None:
        if "shared_memory_region" in t.parameters:
            return                               # region contents are not readable here
        data = b""
    if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1):
        data = data.cast("B")
    where = f"for inference input '{t.name}' for model '{model}'"
    n, off, checked = len(data), 0, 0
    while off < n:
        if n - off < 4:
            raise invalid_arg(f"{rid}incomplete string length indicator {where}, expecting 4 "
                              f"bytes but only {n - off} bytes available. Please make sure the "
                              f"string length indicator is in one buffer.")
        length = _U32(data, off)[0]
        checked += 1
        if checked > count:
            raise invalid_arg(f"{rid}unexpected number of string elements {checked} {where}, "
                              f"expecting {count}")
        off += 4 + length
    if checked != count:
        raise invalid_arg(f"{rid}expected {count} string elements {where}, got {checked}")
    if off > n:                                  # last element runs past the buffer
        avail = n - (off - length)
        raise invalid_arg(f"incomplete string data for inference input '{t.name}', expecting "
                          f"string of length {length} but only {avail} bytes available")
