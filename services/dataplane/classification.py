"""Triton's classification extension: an output requested with ``"classification": k`` is
answered as a BYTES tensor of its top-k entries, "<value>:<index>[:<label>]".

Pure functions of (datatype, shape, raw bytes, k, labels, batching), called once by the data
plane (client.py ``_response``) for both protocols. The rules are Triton's (server
src/http_server.cc FinalizeResponse and src/grpc/infer_handler.h, alike; src/classification.cc
TopkClassifications, AddClassResults):

- a model that batches (max_batch_size > 0) classifies each row of the first dimension:
  shape [batch, k'], else the whole tensor: shape [k'], where k' = min(k, elements per row);
- entries are ordered as `std::sort` over the indices with ``probs[i1] > probs[i2]`` leaves
  them: value descending, and among equal values in the order libstdc++'s introsort gives
  (``std_sort_order``: exact, emulated where ties reach the top k', numpy otherwise);
- values are printed by `std::to_string`: "%f" for FP32/FP64, decimal for integers;
- a label is appended when the output's label file has a non-empty line at that index;
- k is Triton's uint32 (a larger request wraps, as the C++ cast does);
- BOOL, FP16, BF16 and BYTES outputs are refused ("class result not available for output due
  to unsupported type ..."; Triton 2.51 crashes on BYTES, later versions answer this text),
  and so is a row of more than 1,000,000 elements (Triton after 2.51: "classification output
  tensor too large").
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from services.common.datatypes import numpy_dtype, serialize_bytes_tensor
from services.common.errors import invalid_arg
from services.common.messages import ModelInfo
from services.dataplane.types import CoreRequest, CoreResponse, OutputTensor

__all__ = ["MAX_ELEMENTS", "class_count", "classify", "format_values", "heap_sort", "std_sort_order",
           "top_indices"]

MAX_ELEMENTS = 1_000_000         # kMaxClassificationElements (server src/classification.cc)
_SUPPORTED = frozenset(("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                        "INT64", "FP32", "FP64"))
_THRESHOLD = 16                  # libstdc++ _S_threshold: introsort leaves runs this short
_NAN_EXACT = 1024                # rows with a NaN up to this long: std::sort step by step


def class_count(value: int) -> int:
    """The requested k as Triton holds it: a uint32 (the C++ cast keeps the low 32 bits)."""
    return int(value) & 0xFFFFFFFF


def unsupported_text(datatype: str) -> str:
    return f"class result not available for output due to unsupported type '{datatype}'"


def classify(datatype: str, shape: Sequence[int], data: Any, k: int,
             labels: Sequence[str] = (), batching: bool = False) -> tuple[list[int], bytes]:
    """Top-k classification of one output -> (shape, BYTES tensor bytes). ``k`` as requested
    (wrapped to uint32 here); ``labels`` the output's label lines; ``batching`` whether the
    model batches (its first dimension is then the batch). Raises INVALID_ARG for a datatype
    Triton refuses."""
    k = class_count(k)
    batch = int(shape[0]) if batching and len(shape) > 0 else 0
    per_row = math.prod(int(d) for d in (shape[1:] if batch else shape))
    if datatype == "BYTES":           # (Triton's order: no element size, then the cap)
        raise invalid_arg(unsupported_text(datatype))
    if per_row > MAX_ELEMENTS:
        raise invalid_arg("classification output tensor too large")
    if datatype not in _SUPPORTED:
        raise invalid_arg(unsupported_text(datatype))
    dtype = numpy_dtype(datatype)
    row_bytes = per_row * dtype.itemsize
    nbytes = memoryview(data).nbytes
    entries: list[str] = []
    for row in range(max(1, batch)):
        offset = row * row_bytes
        # Triton classifies a row the buffer does not hold in full as an empty one
        count = per_row if offset + row_bytes <= nbytes else 0
        values = np.frombuffer(data, dtype=dtype, count=count, offset=offset if count else 0)
        top = top_indices(values, min(k, count))
        texts = format_values(datatype, values[top])
        for index, text in zip(top.tolist(), texts):
            label = labels[index] if index < len(labels) else ""
            entries.append(f"{text}:{index}:{label}" if label else f"{text}:{index}")
    out_shape = ([batch] if batch else []) + [min(k, per_row)]
    return out_shape, serialize_bytes_tensor(entries)


def format_values(datatype: str, values: np.ndarray) -> list[str]:
    """Each value as std::to_string writes it: printf's "%f" for floats (glibc: "-nan" for
    a NaN with its sign bit set), the decimal integer otherwise."""
    if datatype not in ("FP32", "FP64"):
        return [str(v) for v in values.tolist()]
    out = list(map("{:f}".format, values.tolist()))
    if np.isnan(values).any():
        for i in np.flatnonzero(np.isnan(values) & np.signbit(values)).tolist():
            out[i] = "-nan"
    return out


# ---- the order std::sort gives -----------------------------------------------------------

def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` indices of ``std::sort(idx, probs[i1] > probs[i2])`` over ``values``.

    Without ties among the values that reach the top k (and no NaN) the order is unique and
    numpy finds it (argpartition, then a sort of k). Otherwise libstdc++'s algorithm is
    followed step by step (``std_sort_order``), since which of several equal values comes
    first is whatever its introsort leaves."""
    n = values.size
    if k <= 0 or n == 0:
        return np.zeros(0, np.intp)
    floating = values.dtype.kind == "f"
    if n > _THRESHOLD and not (floating and np.isnan(values).any()):
        part = np.argpartition(values, n - k)[n - k:]
        top = values[part]
        threshold = top.min()
        # unique iff the top k are distinct and nothing outside them equals the k-th
        if np.count_nonzero(values == threshold) == 1 and np.unique(top).size == k:
            return part[np.argsort(top)[::-1]]
    return std_sort_order(values, k)[:k]


def std_sort_order(values: np.ndarray, k: int) -> np.ndarray:
    """libstdc++'s std::sort (GCC: __introsort_loop with __unguarded_partition_pivot and
    __move_median_to_first, __partial_sort when the depth limit is reached, then
    __final_insertion_sort) of the indices 0..n-1 under ``values[i1] > values[i2]``; exact in
    its first ``k`` positions.

    Without NaN the introsort leaves runs (of at most 16, or heap-sorted), each holding
    values no greater than any earlier run's, and the final insertion sort moves no value
    out of its run: so a range wholly at or past position k is left unsorted, and the
    insertion sort is a stable sort of the whole by value, descending. A NaN orders nothing
    (a NaN pivot splits a range anyhow): rows of up to _NAN_EXACT values with one are sorted
    step by step, longer ones as without it (the NaN first: Triton's order may differ)."""
    n = values.size
    v = values.copy()
    idx = np.arange(n, dtype=np.intp)
    literal = n <= _THRESHOLD or (v.dtype.kind == "f" and n <= _NAN_EXACT and
                                  bool(np.isnan(v).any()))
    reach = n if literal else k
    stack = [(0, n, 2 * (n.bit_length() - 1))] if n > 1 else []
    while stack:
        first, last, depth = stack.pop()
        while first < reach and last - first > _THRESHOLD:
            if depth == 0:
                heap_sort(v, idx, first, last)
                break
            depth -= 1
            cut = _partition_pivot(v, idx, first, last)
            stack.append((cut, last, depth))
            last = cut
    if literal:
        return idx[_insertion_sort(v)]
    order = np.argsort(v[::-1], kind="stable")[::-1]
    return idx[n - 1 - order]


def _partition_pivot(v: np.ndarray, idx: np.ndarray, first: int, last: int) -> int:
    """__unguarded_partition_pivot: the median of (first+1, mid, last-1) moved to first, then
    __unguarded_partition of [first+1, last) around it. The Hoare scans are vectorised: the
    i-th swap pairs the i-th element from the left not greater than the pivot with the i-th
    from the right not less than it, for as long as the left one is the nearer."""
    mid = first + (last - first) // 2
    _move_median_to_first(v, idx, first, first + 1, mid, last - 1)
    pivot = v[first]
    seg = v[first + 1:last]
    left = np.flatnonzero(~(seg > pivot))
    right = np.flatnonzero(~(pivot > seg))[::-1]
    t = min(left.size, right.size)
    crossed = np.flatnonzero(left[:t] >= right[:t])
    m = int(crossed[0]) if crossed.size else t
    stop = int(left[m]) if m < left.size else seg.size
    if m > 0:
        stop = min(stop, int(right[m - 1]))
        a, b = left[:m] + first + 1, right[:m] + first + 1
        v[a], v[b] = v[b], v[a].copy()
        idx[a], idx[b] = idx[b], idx[a].copy()
    return first + 1 + stop


def _move_median_to_first(v: np.ndarray, idx: np.ndarray, result: int, a: int, b: int,
                          c: int) -> None:
    va, vb, vc = v[a], v[b], v[c]
    if va > vb:
        pick = b if vb > vc else c if va > vc else a
    else:
        pick = a if va > vc else c if vb > vc else b
    v[result], v[pick] = v[pick], v[result]
    idx[result], idx[pick] = idx[pick], idx[result]


def heap_sort(v: np.ndarray, idx: np.ndarray, first: int, last: int) -> None:
    """std::__partial_sort(first, last, last): __make_heap then __sort_heap, as libstdc++
    writes them (the depth limit of the introsort was reached: rare, and short runs)."""
    vals = v[first:last].tolist()
    ids = idx[first:last].tolist()
    items = list(zip(vals, ids))
    n = len(items)

    def adjust(hole: int, length: int, value: tuple) -> None:       # __adjust_heap
        top = second = hole
        while second < (length - 1) // 2:
            second = 2 * (second + 1)
            if items[second][0] > items[second - 1][0]:
                second -= 1
            items[hole] = items[second]
            hole = second
        if length & 1 == 0 and second == (length - 2) // 2:
            second = 2 * (second + 1)
            items[hole] = items[second - 1]
            hole = second - 1
        parent = (hole - 1) // 2                                     # __push_heap
        while hole > top and items[parent][0] > value[0]:
            items[hole] = items[parent]
            hole = parent
            parent = (hole - 1) // 2
        items[hole] = value

    if n >= 2:
        for parent in range((n - 2) // 2, -1, -1):                  # __make_heap
            adjust(parent, n, items[parent])
    end = n
    while end > 1:                                                   # __sort_heap
        end -= 1
        value = items[end]
        items[end] = items[0]
        adjust(0, end, value)
    v[first:last] = [x[0] for x in items]
    idx[first:last] = [x[1] for x in items]


def _insertion_sort(v: np.ndarray) -> np.ndarray:
    """The order __final_insertion_sort leaves: in the first 16 positions an element greater
    than the first moves to the front, any other (and every later one) moves left past the
    elements it is greater than (libstdc++'s unguarded loop would run off the front only
    where a NaN broke the ordering: kept in bounds here)."""
    vals = v.tolist()
    order = list(range(len(vals)))
    for i in range(1, len(vals)):
        val, pos = vals[i], order[i]
        if i < _THRESHOLD and val > vals[0]:
            vals[1:i + 1], order[1:i + 1] = vals[0:i], order[0:i]
            vals[0], order[0] = val, pos
            continue
        j = i
        while j > 0 and val > vals[j - 1]:
            vals[j], order[j] = vals[j - 1], order[j - 1]
            j -= 1
        vals[j], order[j] = val, pos
    return np.asarray(order, dtype=np.intp)


def classify_outputs(req: CoreRequest, info: ModelInfo, resp: CoreResponse) -> None:
    """The outputs ``req`` asked for with "classification": k become their top-k entries
    (BYTES) in ``resp``, once here for every protocol. Raises TriremeError for a datatype
    Triton refuses."""
    wanted = {o.name: o.parameters["classification"] for o in req.outputs or ()
              if "classification" in o.parameters}
    if not wanted:
        return
    batching = info.max_batch_size > 0
    for i, out in enumerate(resp.outputs):
        k = wanted.get(out.name)
        if k is not None:
            shape, data = classify(out.datatype, out.shape, out.data, k,
                                   info.labels.get(out.name, ()), batching)
            resp.outputs[i] = OutputTensor(out.name, "BYTES", shape, data)
