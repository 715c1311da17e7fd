"""The classification extension's pure functions (services/dataplane/classification.py).

Expected entries are what Triton 2.51 answered for the same tensors (HTTP and gRPC alike);
the orders of tied values are what libstdc++'s std::sort (GCC 12) gives for the comparator
of Triton's AddClassResults, recorded from a compiled run of it."""
from __future__ import annotations

import math

import numpy as np
import pytest

from services.common.datatypes import deserialize_bytes_tensor
from services.common.errors import Code, TriremeError
from services.dataplane import classification as cls
from services.dataplane.classification import classify, top_indices

LABELS = ["zero", "one", "", "three", "four"]   # index 2: an empty line, no label
NAN = math.nan


def entries(datatype, shape, values, k, labels=LABELS, batching=True):
    data = np.asarray(values, dtype=np.dtype(datatype.lower().replace("fp", "float")))
    out_shape, raw = classify(datatype, shape, data.tobytes(), k, labels, batching)
    items = [b.decode() for b in deserialize_bytes_tensor(raw).tolist()]
    assert len(items) == math.prod(out_shape)
    return out_shape, items


def test_batched_rows_with_labels_and_ties():
    """Triton: value descending, equal values by index (a short row: insertion sort), a
    label where the file has a non-empty line at that index."""
    shape, items = entries("FP32", [2, 6], [1, 5, 3, 5, 2, 0.5, 9, 8, 7, 6, 5, 4], 3)
    assert shape == [2, 3]
    assert items == ["5.000000:1:one", "5.000000:3:three", "3.000000:2",
                     "9.000000:0:zero", "8.000000:1:one", "7.000000:2"]


def test_k_larger_than_the_row_gives_the_whole_row():
    shape, items = entries("FP32", [2, 6], [1, 5, 3, 5, 2, 0.5, 9, 8, 7, 6, 5, 4], 10)
    assert shape == [2, 6]
    assert items[:6] == ["5.000000:1:one", "5.000000:3:three", "3.000000:2", "2.000000:4:four",
                         "1.000000:0:zero", "0.500000:5"]


def test_a_model_without_batching_classifies_the_whole_tensor():
    shape, items = entries("FP32", [2, 3], [1, 5, 3, 5, 2, 0.5], 2, batching=False)
    assert (shape, items) == ([2], ["5.000000:1:one", "5.000000:3:three"])
    shape, items = entries("FP32", [2, 3], [1, 5, 3, 5, 2, 0.5], 10, batching=False)
    assert shape == [6]


def test_without_labels_and_integer_values():
    shape, items = entries("INT32", [1, 4], [1, -5, 3, 7], 2, labels=())
    assert (shape, items) == ([1, 2], ["7:3", "3:2"])
    assert entries("INT64", [1, 3], [-5, 2**62, 7], 2)[1] == ["4611686018427387904:1:one", "7:2"]
    assert entries("UINT8", [1, 3], [200, 3, 7], 2)[1] == ["200:0:zero", "7:2"]
    assert entries("UINT64", [1, 2], [2**64 - 1, 1], 2)[1] == ["18446744073709551615:0:zero",
                                                                "1:1:one"]
    assert entries("INT8", [1, 2], [-128, -1], 2)[1] == ["-1:1:one", "-128:0:zero"]


def test_float_formatting_is_printf_f():
    """std::to_string: "%f"; Triton 2.51 answered exactly these for an FP64 row."""
    _, items = entries("FP64", [1, 6], [NAN, 1e20, -math.inf, 0.1, -0.0, 0.0], 6)
    assert items == ["nan:0:zero", "100000000000000000000.000000:1:one", "0.100000:3:three",
                     "-0.000000:4:four", "0.000000:5", "-inf:2"]
    negative_nan = np.array([-np.nan, 1.0], np.float32)
    assert cls.format_values("FP32", negative_nan) == ["-nan", "1.000000"]
    assert cls.format_values("FP32", np.array([1.5e-7, 3.4028235e38], np.float32)) == \
        ["0.000000", "340282346638528859811704183484516925440.000000"]


@pytest.mark.parametrize("datatype", ["BOOL", "FP16", "BF16", "BYTES"])
def test_unsupported_datatypes_are_refused_with_tritons_text(datatype):
    with pytest.raises(TriremeError) as e:
        classify(datatype, [1, 2], b"\0\0\0\0", 1)
    assert e.value.code == Code.INVALID_ARG
    assert e.value.message == (f"class result not available for output due to unsupported "
                               f"type '{datatype}'")


def test_a_row_beyond_a_million_elements_is_refused():
    with pytest.raises(TriremeError) as e:
        classify("UINT8", [1, cls.MAX_ELEMENTS + 1], bytes(cls.MAX_ELEMENTS + 1), 1,
                 batching=True)
    assert e.value.message == "classification output tensor too large"
    shape, _ = classify("UINT8", [2, cls.MAX_ELEMENTS], bytes(2 * cls.MAX_ELEMENTS), 1,
                        batching=True)
    assert shape == [2, 1]


def test_k_is_a_uint32():
    """Triton casts the count to uint32: 2**32 + 2 asks for 2, 2**32 for none (gRPC; HTTP
    drops a count whose low 32 bits are 0, the output then answered as it is)."""
    assert entries("FP32", [1, 3], [1, 2, 3], 2**32 + 2)[1] == ["3.000000:2", "2.000000:1:one"]
    assert entries("FP32", [1, 3], [1, 2, 3], 2**32) == ([1, 0], [])
    assert cls.class_count(2**63 - 1) == 2**32 - 1


def test_empty_tensors_and_short_buffers():
    assert classify("FP32", [0, 5], b"", 3, batching=True) == ([0], b"")   # no batch: [k']
    assert classify("FP32", [3, 0], b"", 3, batching=True) == ([3, 0], b"")
    # a row the buffer does not hold in full is classified as empty (Triton's loop)
    shape, raw = classify("FP32", [2, 2], np.array([1, 2, 3], np.float32).tobytes(), 1,
                          batching=True)
    assert shape == [2, 1]
    assert deserialize_bytes_tensor(raw).tolist() == [b"2.000000:1"]


def test_memoryview_input():
    data = memoryview(np.array([[0.25, 0.75]], np.float32).tobytes())
    assert classify("FP32", [1, 2], data, 1, ["a", "b"], True)[1] == \
        b"\x0c\x00\x00\x000.750000:1:b"


# ---- the order of ties: libstdc++'s std::sort ----------------------------------------------

STD_SORT = {   # values -> std::sort(idx, probs[a] > probs[b]) as GCC 12 compiled it
    "mod3_40": ([i % 3 for i in range(40)],
                [29, 20, 17, 23, 14, 26, 11, 8, 32, 5, 35, 2, 38, 31, 1, 34, 28, 25, 37, 22, 16,
                 13, 4, 10, 19, 7, 30, 39, 0, 3, 36, 6, 33, 9, 12, 27, 15, 24, 18, 21]),
    "zeros_20": ([0] * 20,
                 [10, 19, 18, 17, 16, 15, 14, 13, 12, 11, 0, 9, 8, 7, 6, 5, 4, 3, 2, 1]),
    "ties_33": ([(i * 7) % 4 for i in range(33)],
                [1, 25, 21, 17, 29, 13, 9, 5, 26, 6, 10, 30, 14, 22, 2, 18, 3, 27, 23, 19, 7,
                 15, 11, 31, 28, 0, 32, 24, 20, 16, 12, 8, 4]),
    "nan_20": ([3, 3, 0, 0, 3, 3, NAN, 1, 3, NAN, NAN, 3, 1, 1, 2, 2, NAN, 0, 3, 3],
               [10, 19, 18, 17, 16, 11, 0, 15, 14, 13, 12, 9, 8, 7, 6, 5, 4, 1, 3, 2]),
    "steps_50": ([(50 - i) // 10 for i in range(50)],
                 [0, 1, 10, 9, 8, 7, 5, 4, 3, 2, 6, 16, 20, 19, 18, 17, 15, 14, 13, 12, 11, 30,
                  29, 28, 27, 25, 24, 23, 22, 21, 26, 38, 40, 39, 37, 36, 35, 34, 33, 32, 31,
                  41, 42, 43, 44, 45, 46, 47, 48, 49]),
}


@pytest.mark.parametrize("case", list(STD_SORT))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ties_are_ordered_as_std_sort_orders_them(case, dtype):
    values, want = STD_SORT[case]
    arr = np.array(values, dtype)
    for k in (1, 5, len(values) // 2, len(values)):
        assert top_indices(arr, k).tolist() == want[:k]


def test_integer_ties_follow_the_same_order():
    values, want = STD_SORT["mod3_40"]
    for dtype in (np.int8, np.uint16, np.int64):
        assert top_indices(np.array(values, dtype), 40).tolist() == want


def test_heap_sort_fallback_is_libstdcxx_partial_sort():
    """Where the introsort's depth limit is reached: std::partial_sort(first, last, last)."""
    values = np.array([(i * 5) % 3 for i in range(30)], np.float32)
    idx = np.arange(30)
    cls.heap_sort(values, idx, 0, 30)
    assert idx.tolist() == [7, 22, 10, 25, 28, 16, 1, 4, 19, 13, 23, 17, 8, 20, 11, 5, 26, 2, 14,
                            29, 15, 3, 18, 9, 21, 24, 12, 0, 6, 27]
    assert values.tolist() == sorted(values.tolist(), reverse=True)


def test_distinct_values_take_the_fast_path_and_agree_with_the_emulation():
    rng = np.random.default_rng(0)
    for n in (17, 100, 5000):
        arr = rng.permutation(n).astype(np.float32)
        for k in (1, 7, n):
            fast = top_indices(arr, k)
            assert fast.tolist() == cls.std_sort_order(arr, k)[:k].tolist()
            assert fast.tolist() == np.argsort(-arr)[:k].tolist()


def test_large_rows_with_ties_stay_fast_enough():
    """Runs past position k are never sorted: a million zeros, top 5, in well under a
    second."""
    arr = np.zeros(1_000_000, np.float32)
    top = top_indices(arr, 5)
    assert top.size == 5 and len(set(top.tolist())) == 5

