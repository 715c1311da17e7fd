"""Triton's identity backend (services/workers/backends/identity.py), driven directly: the
config checks and texts of identity.cc, OUTPUTn = INPUTn for every datatype, zero-size and
batched tensors, optional inputs, the execute delay."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from services.common import config as C
from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.workers.backends.base import create_backend

TYPES = {   # config type -> an example array of one batch row
    "TYPE_BOOL": np.array([True, False, True]),
    "TYPE_UINT8": np.array([0, 7, 255], np.uint8),
    "TYPE_UINT16": np.array([1, 2, 65535], np.uint16),
    "TYPE_UINT32": np.array([1, 2, 2**32 - 1], np.uint32),
    "TYPE_UINT64": np.array([1, 2, 2**64 - 1], np.uint64),
    "TYPE_INT8": np.array([-128, 0, 127], np.int8),
    "TYPE_INT16": np.array([-3, 0, 3], np.int16),
    "TYPE_INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
    "TYPE_INT64": np.array([-(2**63), 0, 2**63 - 1], np.int64),
    "TYPE_FP16": np.array([0.5, -1.0, np.inf], np.float16),
    "TYPE_FP32": np.array([1.5, np.nan, -0.0], np.float32),
    "TYPE_FP64": np.array([1e300, -2.0, 0.0], np.float64),
    "TYPE_BF16": np.array([1.0, 2.5, -3.0], ml_dtypes.bfloat16),
    "TYPE_STRING": np.array([b"a", "wörld".encode(), b""], dtype=object),
}


def pair(i: int, dtype: str, dims: str = "-1", optional: bool = False) -> str:
    opt = " optional: true" if optional else ""
    return (f'input [{{ name: "INPUT{i}" data_type: {dtype} dims: [{dims}]{opt} }}]\n'
            f'output [{{ name: "OUTPUT{i}" data_type: {dtype} dims: [{dims}] }}]\n')


def config(io: str, mbs: int = 8, params: dict[str, str] | None = None, groups: str = ""):
    text = (f'name: "nop"\nbackend: "identity"\nmax_batch_size: {mbs}\n{groups}\n{io}'
            + "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
                      for k, v in (params or {}).items()))
    return C.parse_pbtxt(text)


def backend(cfg, instance: str = "nop_0"):
    return create_backend(cfg, m.LoadModel("nop", 1, "/nonexistent", cfg.SerializeToString(),
                                           instance))


def item(*outputs: str) -> m.BatchItem:
    return m.BatchItem("frontend", 1, [], outputs=list(outputs))


def run(b, *requests: tuple[m.BatchItem, dict]) -> list:
    return b.execute_requests([r[0] for r in requests], [r[1] for r in requests], _no_reply)


def _no_reply(*args):
    raise AssertionError("the identity backend answers at once")


def test_needs_no_model_file_and_keeps_the_config():
    cfg = config(pair(0, "TYPE_FP32"))
    b = backend(cfg)
    assert b.config is cfg and b.per_request and b.cancels is None


@pytest.mark.parametrize("dtype", sorted(TYPES))
def test_every_datatype_comes_back_as_sent_by_reference(dtype):
    row = TYPES[dtype]
    x = np.stack([row, row[::-1]])              # batch of 2
    [out] = run(backend(config(pair(0, dtype))), (item(), {"INPUT0": x}))
    assert list(out) == ["OUTPUT0"]
    assert out["OUTPUT0"] is x                  # no copy: the worker's arena copy is the only one
    assert out["OUTPUT0"].dtype == row.dtype


def test_pairs_by_index_and_answers_only_the_outputs_asked_for():
    b = backend(config(pair(0, "TYPE_INT32") + pair(1, "TYPE_FP32") + pair(2, "TYPE_STRING")))
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    f = np.ones((2, 1), np.float32)
    s = np.array([[b"x"], [b"y"]], dtype=object)
    full, some = run(b, (item(), {"INPUT0": a, "INPUT1": f, "INPUT2": s}),
                     (item("OUTPUT2", "OUTPUT0"), {"INPUT0": a, "INPUT1": f, "INPUT2": s}))
    assert list(full) == ["OUTPUT0", "OUTPUT1", "OUTPUT2"]   # none named: every config output
    assert full["OUTPUT0"] is a and full["OUTPUT1"] is f and full["OUTPUT2"] is s
    assert list(some) == ["OUTPUT2", "OUTPUT0"] and some["OUTPUT2"] is s


@pytest.mark.parametrize("shape", [(0,), (1, 0), (0, 3), (4, 0, 2)])
def test_zero_sized_tensors(shape):
    dims = ",".join(["-1"] * (len(shape) - 1)) or "-1"
    mbs = 0 if len(shape) == 1 else 8
    b = backend(config(pair(0, "TYPE_FP32", dims) + pair(1, "TYPE_STRING", dims), mbs))
    x, s = np.zeros(shape, np.float32), np.empty(shape, dtype=object)
    [out] = run(b, (item(), {"INPUT0": x, "INPUT1": s}))
    assert out["OUTPUT0"].shape == shape and out["OUTPUT1"].shape == shape


def test_a_batch_of_requests_keeps_each_requests_own_shape():
    b = backend(config(pair(0, "TYPE_INT64", "-1")))
    tensors = [np.arange(n * 2, dtype=np.int64).reshape(n, 2) for n in (1, 3, 4)]
    outs = run(b, *((item(), {"INPUT0": t}) for t in tensors))
    assert [o["OUTPUT0"].shape for o in outs] == [(1, 2), (3, 2), (4, 2)]
    for t, o in zip(tensors, outs):
        np.testing.assert_array_equal(o["OUTPUT0"], t)


def test_a_missing_input_fails_only_its_request():
    b = backend(config(pair(0, "TYPE_FP32") + pair(1, "TYPE_FP32")))
    x = np.ones((1, 2), np.float32)
    bad, good = run(b, (item("OUTPUT1"), {"INPUT0": x}), (item("OUTPUT0"), {"INPUT0": x}))
    assert isinstance(bad, TriremeError) and bad.code == Code.UNSUPPORTED
    assert bad.message == "failed to get input 'INPUT1'"
    assert good["OUTPUT0"] is x


def test_an_absent_optional_input_gives_zeros_with_the_requests_batch():
    b = backend(config(pair(0, "TYPE_FP32", "2") + pair(1, "TYPE_INT32", "-1,3", optional=True)
                       + pair(2, "TYPE_STRING", "2", optional=True)))
    [out] = run(b, (item(), {"INPUT0": np.ones((5, 2), np.float32)}))
    np.testing.assert_array_equal(out["OUTPUT1"], np.zeros((5, 1, 3), np.int32))
    assert out["OUTPUT2"].shape == (5, 2) and out["OUTPUT2"].tolist() == [[b"", b""]] * 5
    nobatch = backend(config(pair(0, "TYPE_FP32", "2") + pair(1, "TYPE_FP16", "4", optional=True), 0))
    [out] = run(nobatch, (item("OUTPUT1"), {"INPUT0": np.ones(2, np.float32)}))
    assert out["OUTPUT1"].shape == (4,) and out["OUTPUT1"].dtype == np.float16


@pytest.mark.parametrize("io,message", [
    (pair(0, "TYPE_FP32") + 'input [{ name: "INPUT1" data_type: TYPE_FP32 dims: [1] }]',
     "model configuration must have equal input/output pairs"),
    ('input [{ name: "X" data_type: TYPE_FP32 dims: [1] }]\n'
     'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [1] }]',
     "expected input name to follow INPUT<index> pattern, got 'X'"),
    ('input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [1] }]\n'
     'output [{ name: "Y" data_type: TYPE_FP32 dims: [1] }]',
     "expected output name to follow OUTPUT<index> pattern, got 'Y'"),
    ('input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [1] }]\n'
     'output [{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [1] }]',
     "expected input and output indices to match"),
    ('input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [1] }]\n'
     'output [{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [1] }]',
     "expected input and output datatype to match, got TYPE_FP32 and TYPE_INT32"),
    ('input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [-1, 2] }]\n'
     'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [2] }]',
     "expected input and output shape to match, got [-1,2] and [2]"),
])
def test_config_checks_give_identity_cc_texts(io, message):
    with pytest.raises(TriremeError) as ei:
        backend(config(io))
    assert ei.value.code == Code.INVALID_ARG
    assert ei.value.message == message


def test_a_reshape_is_the_shape_compared():
    io = ('input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [4] reshape { shape: [2, 2] } }]\n'
          'output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [2, 2] }]')
    assert backend(config(io)).reshape is not None


def _delayed(params: dict[str, str], instance: str = "nop_0", groups: str = ""):
    b = backend(config(pair(0, "TYPE_INT32"), params=params, groups=groups), instance)
    waits: list[float] = []
    b.sleep = waits.append
    run(b, (item(), {"INPUT0": np.ones((1, 1), np.int32)}),
        (item(), {"INPUT0": np.ones((1, 1), np.int32)}))
    return waits


def test_execute_delay_once_per_execution():
    assert _delayed({}) == []
    assert _delayed({"execute_delay_ms": "250"}) == [0.25]


def test_instance_wise_delay_multiplier_counts_instances_over_groups():
    groups = ('instance_group [{ name: "a" count: 2 kind: KIND_CPU }, '
              '{ name: "b" count: 2 kind: KIND_CPU }]')
    params = {"execute_delay_ms": "10", "instance_wise_delay_multiplier": "4"}
    assert _delayed(params, "a_0", groups) == [0.01]       # instance 0: max(4 * 0, 1)
    assert _delayed(params, "a_1", groups) == [0.04]
    assert _delayed(params, "b_1", groups) == [0.12]       # the fourth instance


def test_a_bad_parameter_fails_the_load():
    with pytest.raises(TriremeError) as ei:
        backend(config(pair(0, "TYPE_INT32"), params={"execute_delay_ms": "soon"}))
    assert ei.value.code == Code.INVALID_ARG
