"""pb_utils.Tensor and DLPack, BF16 included (services/workers/python/dlpack.py): Triton's
Python backend hands a BF16 tensor out through DLPack only, and takes any DLPack tensor in."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from services.workers.python import pb_utils

torch = pytest.importorskip("torch")

BF16 = np.array([[1.5, -2.0, 3.0e38]], ml_dtypes.bfloat16)


def floats(t: pb_utils.Tensor) -> list:
    """A tensor's values as a model reads a BF16 one: through DLPack, in torch."""
    return torch.from_dlpack(t).float().tolist()


def test_as_numpy_refuses_bf16_with_tritons_text():
    t = pb_utils.Tensor("X", BF16)
    with pytest.raises(pb_utils.TritonModelException) as e:
        t.as_numpy()
    assert str(e.value) == ("Tensor dtype is BF16 and cannot be converted to NumPy. Use "
                            "to_dlpack() and from_dlpack() instead.")
    assert (t.datatype(), t.shape(), t.triton_dtype()) == ("BF16", [1, 3], 14)


def test_bf16_to_torch_and_back_without_copies():
    t = pb_utils.Tensor("X", BF16.copy())
    tt = torch.utils.dlpack.from_dlpack(t.to_dlpack())
    assert tt.dtype == torch.bfloat16 and tt.shape == (1, 3)
    assert tt.view(torch.int16).tolist() == BF16.view(np.int16).tolist()
    back = pb_utils.Tensor.from_dlpack("Y", torch.utils.dlpack.to_dlpack(tt))
    assert back.datatype() == "BF16"
    assert floats(back) == BF16.astype(np.float32).tolist()
    tt[0, 0] = 7                                          # one memory throughout
    assert floats(back)[0][0] == floats(t)[0][0] == 7.0


def test_torch_reads_a_tensor_directly_and_from_dlpack_takes_a_torch_tensor():
    t = pb_utils.Tensor("X", BF16.copy())
    tt = torch.from_dlpack(t)                            # __dlpack__ / __dlpack_device__
    assert tt.dtype == torch.bfloat16
    out = pb_utils.Tensor.from_dlpack("Y", tt * 2)       # an object with __dlpack__
    assert floats(out)[0][:2] == [3.0, -4.0]
    versioned = (tt + 1).__dlpack__(max_version=(1, 0))  # a DLPack 1.0 capsule
    assert floats(pb_utils.Tensor.from_dlpack("Z", versioned))[0][0] == 2.5


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8, np.bool_])
def test_other_dtypes_round_trip(dtype):
    arr = np.array([1, 0, 1], dtype)
    t = pb_utils.Tensor("X", arr)
    back = pb_utils.Tensor.from_dlpack("Y", t.to_dlpack())
    assert back.as_numpy().dtype == arr.dtype and back.as_numpy().tolist() == arr.tolist()
    assert torch.utils.dlpack.from_dlpack(t.to_dlpack()).tolist() == arr.tolist()


def test_read_only_input_is_copied_for_dlpack():
    arr = np.frombuffer(BF16.tobytes(), ml_dtypes.bfloat16)
    tt = torch.utils.dlpack.from_dlpack(pb_utils.Tensor("X", arr).to_dlpack())
    assert tt.view(torch.int16).tolist() == BF16.view(np.int16).ravel().tolist()


def test_errors():
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.Tensor.from_dlpack("X", [1, 2])
    assert str(e.value) == ("Provided tensor is not supported. Tensor must be a DLPack capsule "
                            "        or have `__dlpack__` and `__dlpack_device__` attributes")
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.Tensor.from_dlpack("", torch.zeros(1))
    assert str(e.value) == "Tensor name cannot be an empty string."
    with pytest.raises(pb_utils.TritonModelException) as e:
        pb_utils.Tensor("S", np.array([b"a"], object)).to_dlpack()
    assert str(e.value) == "DLPack does not have support for string tensors."
    capsule = torch.utils.dlpack.to_dlpack(torch.zeros(2))
    pb_utils.Tensor.from_dlpack("A", capsule)
    with pytest.raises(pb_utils.TritonModelException, match="already consumed"):
        pb_utils.Tensor.from_dlpack("B", capsule)
