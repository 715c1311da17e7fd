"""Ragged inputs, batch_input and batch_output (services/workers/batch_io.py) with exact
arrays for given request shapes, and their load checks in services/common/config.py
(Triton's ValidateBatchIO texts)."""
from __future__ import annotations

import numpy as np
import pytest

from protos import model_config_pb2 as mc
from services.common import config as C
from services.common.errors import Code, TriremeError
from services.workers.batch_io import BatchIO, generate

K = mc.BatchInput.Kind
I32, F32 = np.dtype(np.int32), np.dtype(np.float32)
# The proto's own example: a batch-2 request of item shape [3, 1], a batch-1 one of [2, 2].
DOC = [(2, 3, 1), (1, 2, 2)]


def cfg(text: str, mbs: int = 8) -> mc.ModelConfig:
    return C.parse_pbtxt(f'name: "m"\nbackend: "onnxruntime"\nplatform: "onnxruntime_onnx"\n'
                         f'max_batch_size: {mbs}\nversion_policy {{ latest {{ num_versions: 1 }} }}\n'
                         'input [{ name: "X" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true },'
                         ' { name: "Y" data_type: TYPE_FP32 dims: [2] }]\n'
                         'output [{ name: "OUT" data_type: TYPE_FP32 dims: [-1] },'
                         ' { name: "SUM" data_type: TYPE_FP32 dims: [1] }]\n' + text)


def batch_input(kind: str, target: str = "B", dtype: str = "TYPE_INT32", source: str = "X") -> str:
    return (f'batch_input [{{ kind: {kind} target_name: "{target}" data_type: {dtype} '
            f'source_input: "{source}" }}]\n')


def exact(got: np.ndarray, want, dtype=I32) -> None:
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.asarray(want, dtype).reshape(np.shape(want)))
    assert got.shape == np.shape(want)


# ------------------------------------------------------------------------ every kind
@pytest.mark.parametrize("kind,shapes,want", [
    # Triton's ragged batching example: requests [1,3], [1,4], [1,5]
    (K.BATCH_ELEMENT_COUNT, [(1, 3), (1, 4), (1, 5)], [3, 4, 5]),
    (K.BATCH_ACCUMULATED_ELEMENT_COUNT, [(1, 3), (1, 4), (1, 5)], [3, 7, 12]),
    (K.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, [(1, 3), (1, 4), (1, 5)], [0, 3, 7, 12]),
    # counts include the batch dimension: one value per request, not per batch item
    (K.BATCH_ELEMENT_COUNT, DOC, [6, 4]),
    (K.BATCH_ACCUMULATED_ELEMENT_COUNT, DOC, [6, 10]),
    (K.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, DOC, [0, 6, 10]),
    (K.BATCH_ITEM_SHAPE, DOC, [[3, 1], [3, 1], [2, 2]]),
    (K.BATCH_ITEM_SHAPE_FLATTEN, DOC, [3, 1, 3, 1, 2, 2]),
    # Triton's L0_batch_input test: [1,4,1], [1,1,2], [1,1,2], [1,2,2]
    (K.BATCH_ITEM_SHAPE_FLATTEN, [(1, 4, 1), (1, 1, 2), (1, 1, 2), (1, 2, 2)],
     [4, 1, 1, 2, 1, 2, 2, 2]),
    (K.BATCH_ITEM_SHAPE, [(1, 5)], [[5]]),
    (K.BATCH_ITEM_SHAPE, [(2,), (1,)], np.zeros((3, 0))),   # no dims after the batch one
    (K.BATCH_ELEMENT_COUNT, [(1, 0), (1, 2)], [0, 2]),
])
def test_kinds(kind, shapes, want):
    exact(generate(kind, shapes, I32), want)


@pytest.mark.parametrize("shapes,size", [([(1, 3), (1, 5), (1, 4)], 5), (DOC, 6), ([(1, 0)], 0)])
def test_max_element_count_is_a_shape(shapes, size):
    got = generate(K.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE, shapes, F32)
    assert got.shape == (size,) and got.dtype == F32


def test_fp32_kinds():
    exact(generate(K.BATCH_ACCUMULATED_ELEMENT_COUNT, [(1, 3), (1, 4)], F32), [3.0, 7.0], F32)
    exact(generate(K.BATCH_ITEM_SHAPE_FLATTEN, DOC, F32), [3, 1, 3, 1, 2, 2], F32)


# ----------------------------------------------------------------------------- gather
def requests(*lengths: int) -> list[dict[str, np.ndarray]]:
    start, out = 0, []
    for n in lengths:
        out.append({"X": np.arange(start, start + n, dtype=np.float32).reshape(1, n),
                    "Y": np.full((1, 2), n, np.float32)})
        start += n
    return out


def test_plain_config_has_no_batch_io():
    plain = C.parse_pbtxt('name: "m"\ninput [{ name: "X" data_type: TYPE_FP32 dims: [-1] }]')
    assert BatchIO.of(plain) is None
    assert BatchIO.of(cfg("")) is not None   # a ragged input alone is enough


def test_gather_ragged_and_batch_inputs():
    bio = BatchIO(cfg(batch_input("BATCH_ACCUMULATED_ELEMENT_COUNT", "INDEX") +
                      batch_input("BATCH_ELEMENT_COUNT", "COUNT", "TYPE_FP32")))
    got = bio.gather(requests(3, 4, 5))
    exact(got["X"], np.arange(12), F32)            # [total elements], not [3, ...]
    exact(got["Y"], [[3, 3], [4, 4], [5, 5]], F32)  # others: concatenated on the batch dim
    exact(got["INDEX"], [3, 7, 12])
    exact(got["COUNT"], [3, 4, 5], F32)


def test_gather_single_request_copies_nothing():
    bio = BatchIO(cfg(batch_input("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "INDEX")))
    (item,) = requests(4)
    for arr in item.values():
        arr.flags.writeable = False   # as read from shared memory
    got = bio.gather([item])
    assert got["X"].shape == (4,) and np.shares_memory(got["X"], item["X"])
    assert got["Y"] is item["Y"]
    exact(got["INDEX"], [0, 4])
    assert set(item) == {"X", "Y"}   # the request's own dict is left as it was


def test_each_target_gets_its_own_tensor():
    two = ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: ["A", "B"] '
           'data_type: TYPE_INT32 source_input: "X" }]\n')
    got = BatchIO(cfg(two)).gather(requests(2, 3))
    exact(got["A"], [2, 3])
    exact(got["B"], [2, 3])
    assert not np.shares_memory(got["A"], got["B"])


def test_missing_source_input_is_an_error():
    bio = BatchIO(cfg(batch_input("BATCH_ELEMENT_COUNT", "N", source="Y")))
    items = requests(1, 2)
    del items[0]["Y"]   # (an optional input, left out)
    with pytest.raises(TriremeError) as e:
        bio.gather(items)
    assert e.value.code == Code.INVALID_ARG
    assert "'N' of model 'm' is made from input 'Y'" in e.value.message


# ---------------------------------------------------------------------------- scatter
SCATTER = 'batch_output [{ target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" }]\n'


def test_scatter_with_input_shape():
    bio = BatchIO(cfg(SCATTER))
    items = requests(2, 3, 4)
    outputs = {"OUT": np.arange(9, dtype=np.float32) * 10,              # [total elements]
               "SUM": np.array([[1], [2], [3]], np.float32)}            # [batch, 1]
    mine = bio.scatter(outputs, [1, 1, 1], items)
    exact(mine[0]["OUT"], [[0, 10]], F32)
    exact(mine[1]["OUT"], [[20, 30, 40]], F32)
    exact(mine[2]["OUT"], [[50, 60, 70, 80]], F32)
    assert [m["SUM"].tolist() for m in mine] == [[[1]], [[2]], [[3]]]   # by batch size
    assert all(np.shares_memory(m["OUT"], outputs["OUT"]) for m in mine)


def test_scatter_single_request_reshapes_too():
    mine = BatchIO(cfg(SCATTER)).scatter({"OUT": np.arange(3, dtype=np.float32)}, [1], requests(3))
    exact(mine[0]["OUT"], [[0, 1, 2]], F32)


def test_scatter_takes_fixed_dims_from_the_config_and_batch_size_from_the_source():
    text = ('output [{ name: "W" data_type: TYPE_FP32 dims: [-1, 2] }]\n'
            'batch_output [{ target_name: "W" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" }]\n')
    items = [{"X": np.zeros((2, 3), np.float32)}, {"X": np.zeros((1, 1), np.float32)}]
    mine = BatchIO(cfg(text)).scatter({"W": np.arange(14, dtype=np.float32)}, [2, 1], items)
    exact(mine[0]["W"], np.arange(12).reshape(2, 3, 2), F32)
    exact(mine[1]["W"], [[[12, 13]]], F32)


def test_scatter_of_too_small_an_output_is_an_error():
    with pytest.raises(TriremeError) as e:
        BatchIO(cfg(SCATTER)).scatter({"OUT": np.zeros(4, np.float32)}, [1, 1], requests(2, 3))
    assert e.value.code == Code.INTERNAL
    assert "output 'OUT' of model 'm' has 4 elements" in e.value.message


# ------------------------------------------------------------------------ load checks
def load_error(text: str) -> str:
    with pytest.raises(TriremeError) as e:
        C.validate(cfg(text))
    assert e.value.code == Code.INVALID_ARG
    with pytest.raises(TriremeError) as w:   # the worker checks the same way
        BatchIO(cfg(text))
    assert w.value.message == e.value.message
    return e.value.message


@pytest.mark.parametrize("text,message", [
    (batch_input("BATCH_ELEMENT_COUNT", source="NOPE"), "unknown source input name 'NOPE' for m"),
    (batch_input("BATCH_ITEM_SHAPE", dtype="TYPE_INT64"),
     "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
    (batch_input("BATCH_ELEMENT_COUNT", dtype="TYPE_FP16"),
     "batch input data type must be TYPE_INT32 or TYPE_FP32 for m"),
    ('batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_INT32 }]\n',
     "batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 0 for m"),
    ('batch_input [{ kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "B" data_type: TYPE_INT32 '
     'source_input: ["X", "Y"] }]\n',
     "batch input kind 'BATCH_MAX_ELEMENT_COUNT_AS_SHAPE' expects 1 source input, got 2 for m"),
    (batch_input("BATCH_ELEMENT_COUNT", target="Y"),
     "target input name 'Y' is also the name of a model input for m"),
    (batch_input("BATCH_ELEMENT_COUNT", target="B") + batch_input("BATCH_ITEM_SHAPE", target="B"),
     "target input name 'B' can only be specified once for m"),
    ('batch_output [{ target_name: "NOPE" source_input: "X" }]\n',
     "unknown target output name 'NOPE' for m"),
    ('batch_output [{ target_name: "OUT" source_input: "Z" }]\n',
     "unknown source input name 'Z' for m"),
    ('batch_output [{ target_name: ["OUT", "OUT"] source_input: "X" }]\n',
     "target output name 'OUT' can only be specified once for m"),
    ('batch_output [{ target_name: "OUT" }]\n',
     "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got 0 for m"),
])
def test_load_errors(text, message):
    assert load_error(text) == message


def test_valid_batch_io_and_checks_wait_for_the_completed_config():
    good = cfg(batch_input("BATCH_ITEM_SHAPE", dtype="TYPE_FP32") + SCATTER)
    C.validate(good)
    bad = cfg(batch_input("BATCH_ELEMENT_COUNT", source="NOPE"))
    C.validate(bad, require_io=False)   # before a worker completed the inputs


# ------------------------------------------------------------- complete_io (the model file)
def test_complete_io_ragged_input_must_be_one_dimension():
    c = cfg(batch_input("BATCH_ACCUMULATED_ELEMENT_COUNT", "INDEX"))
    outs = [("OUT", "FP32", [-1, -1]), ("SUM", "FP32", [-1, 1])]
    ok = C.complete_io(c, [("X", "FP32", [-1]), ("Y", "FP32", [-1, 2]), ("INDEX", "INT32", [-1])],
                       outs)
    assert [io.name for io in ok.input] == ["X", "Y"]   # INDEX is not a client input
    with pytest.raises(TriremeError) as e:
        C.complete_io(c, [("X", "FP32", [-1, -1]), ("Y", "FP32", [-1, 2]),
                          ("INDEX", "INT32", [-1])], outs)
    assert e.value.message == ("unable to load model 'm', configuration expects model provides "
                               "input with shape [-1]  for ragged input 'X', model provides [-1,-1]")
    with pytest.raises(TriremeError) as e:   # a batch input the model does not take
        C.complete_io(c, [("X", "FP32", [-1]), ("Y", "FP32", [-1, 2])], outs)
    assert e.value.message == "unexpected inference input 'INDEX', allowed inputs are: X, Y"


def test_complete_io_batch_output_shape_is_not_compared():
    c = cfg(SCATTER)
    ins = [("X", "FP32", [-1]), ("Y", "FP32", [-1, 2])]
    C.complete_io(c, ins, [("OUT", "FP32", [-1]), ("SUM", "FP32", [-1, 1])])   # [-1] for [-1, -1]
    with pytest.raises(TriremeError) as e:   # ... its datatype still is
        C.complete_io(c, ins, [("OUT", "INT32", [-1]), ("SUM", "FP32", [-1, 1])])
    assert "configuration expects datatype TYPE_FP32 for output 'OUT'" in e.value.message
