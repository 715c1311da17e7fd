"""Config `reshape`: the load checks (Triton's ValidateIOShape, its texts) and the shape
conversions the worker applies around every backend (services/workers/reshape.py)."""
from __future__ import annotations

import numpy as np
import pytest

from services.common import config as C
from services.common.errors import Code, TriremeError
from services.workers.reshape import Reshape, convert


def cfg(io: str, mbs: int = 8):
    return C.parse_pbtxt(f'name: "m"\nbackend: "onnxruntime"\nplatform: "onnxruntime_onnx"\n'
                         f'max_batch_size: {mbs}\n'
                         f'version_policy {{ latest {{ num_versions: 1 }} }}\n{io}')


def io(kind: str, dims: str, reshape: str | None, name: str = "X") -> str:
    r = f" reshape {{ shape: [{reshape}] }}" if reshape is not None else ""
    return f'{kind} [{{ name: "{name}" data_type: TYPE_FP32 dims: [{dims}]{r} }}]\n'


def both(dims: str, reshape: str) -> str:
    return io("input", dims, reshape) + io("output", dims, reshape, "Y")


@pytest.mark.parametrize("dims,reshape", [
    ("1", ""),              # a scalar per batch item (Triton's common case)
    ("4,4", "16"),
    ("16", "2,2,4"),
    ("2,4,-1,6", "8,-1,1,6"),   # Triton's own example: runs of fixed dims agree
    ("-1", "-1"),
    ("-1,2,2", "-1,4"),
])
def test_valid_reshapes(dims, reshape):
    C.validate(cfg(both(dims, reshape)))


@pytest.mark.parametrize("kind,dims,reshape,mbs,message", [
    ("input", "4,4", "15", 8, "model input 'X' has different size for dims and reshape for m"),
    ("output", "4,4", "15", 8, "model output 'X' has different size for dims and reshape for m"),
    ("input", "2", "", 8, "model input 'X' has different size for dims and reshape for m"),
    ("input", "1", "", 0, "model input 'X' cannot have empty reshape for non-batching model as "
                          "scalar tensors are not supported for m"),
    ("input", "4", "0,4", 8, "model input 'X' reshape dimensions must be integer >= 1, or -1 "
                             "to indicate a variable-size dimension for m"),
    ("input", "-1,4", "4,-1,-1", 8, "model input 'X' has different number of variable-size "
                                    "dimensions for dims and reshape for m"),
    ("input", "-1,4", "-1,2", 8, "model input 'X' has different size for dims and reshape for m"),
    ("input", "-1,4", "16", 8, "model input 'X' has different size for dims and reshape for m"),
])
def test_invalid_reshapes_give_tritons_texts(kind, dims, reshape, mbs, message):
    with pytest.raises(TriremeError) as ei:
        C.validate(cfg(io(kind, dims, reshape), mbs), require_io=False)
    assert ei.value.code == Code.INVALID_ARG
    assert ei.value.message == message


def test_complete_io_keeps_a_users_reshape_and_checks_the_model_against_it():
    c = cfg(io("input", "4,4", "16") + io("output", "2,8", "16", "Y"))
    c.ClearField("version_policy")
    out = C.complete_io(c, [("X", "FP32", [-1, 16])], [("Y", "FP32", [-1, 16])])
    assert [list(i.reshape.shape) for i in (*out.input, *out.output)] == [[16], [16]]
    assert [list(i.dims) for i in (*out.input, *out.output)] == [[4, 4], [2, 8]]
    with pytest.raises(TriremeError, match=r"the model expects 2 dimensions \(shape \[-1,16\]\)"):
        C.complete_io(cfg(io("input", "16", "4,4") + io("output", "16", None, "Y")),
                      [("X", "FP32", [-1, 16])], [("Y", "FP32", [-1, 16])])


def test_autocomplete_of_a_scalar_per_item_is_dims_1_reshape_empty():
    c = cfg("", 0)
    out = C.complete_io(c, [("X", "FP32", [-1])], [("Y", "FP32", [-1])])
    for t in (*out.input, *out.output):
        assert list(t.dims) == [1] and t.HasField("reshape") and not t.reshape.shape
    C.validate(out)


@pytest.mark.parametrize("shape,src,dst,batching,want", [
    ((3, 1), (1,), (), True, (3,)),             # dims [1] -> reshape []
    ((3,), (), (1,), True, (3, 1)),             # and back
    ((2, 4, 4), (4, 4), (16,), True, (2, 16)),
    ((4, 4), (4, 4), (16,), False, (16,)),
    ((5, 7, 2, 2), (-1, 2, 2), (-1, 4), True, (5, 7, 4)),
    ((7, 2, 2), (-1, 2, 2), (-1, 4), False, (7, 4)),
    ((5, 2, 4, 9, 6), (2, 4, -1, 6), (8, -1, 1, 6), True, (5, 8, 9, 1, 6)),
])
def test_convert(shape, src, dst, batching, want):
    assert convert(shape, src, dst, batching) == want


def test_reshape_is_none_without_any():
    assert Reshape.of(cfg(io("input", "4", None) + io("output", "4", None, "Y"))) is None


def test_inputs_and_outputs_are_views_in_the_other_shape():
    r = Reshape(cfg(io("input", "4,4", "16") + io("output", "2,8", "16", "Y")))
    x = np.arange(32, dtype=np.float32).reshape(2, 4, 4)
    x.flags.writeable = False            # as shared memory arrives
    got = r.inputs_for_model({"X": x, "Z": x})
    assert got["X"].shape == (2, 16) and np.shares_memory(got["X"], x)
    assert got["Z"] is x                 # a tensor without a reshape is left alone
    [(name, y)] = r.outputs_for_client([("Y", got["X"])])
    assert name == "Y" and y.shape == (2, 2, 8) and np.shares_memory(y, x)


def test_an_output_that_does_not_fit_its_reshape_is_an_error():
    r = Reshape(cfg(io("input", "4,4", "16") + io("output", "2,8", "16", "Y")))
    with pytest.raises(TriremeError) as ei:
        r.outputs_for_client([("Y", np.zeros((2, 15), np.float32))])
    assert ei.value.code == Code.INTERNAL
    assert ei.value.message == ("output 'Y' of model 'm' has shape [2,15], which does not fit "
                                "its reshape [16] (dims [2,8])")
    # Triton relabels an output that holds the right count whatever its layout
    [(_, y)] = r.outputs_for_client([("Y", np.zeros((2, 4, 4), np.float32))])
    assert y.shape == (2, 2, 8)
