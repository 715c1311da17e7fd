"""DLPack for pb_utils.Tensor: numpy arrays in and out, BF16 included.

numpy has no bfloat16 (the worker holds BF16 tensors as ml_dtypes.bfloat16 arrays) and its
DLPack refuses any dtype it does not know, while Triton's Python backend hands a BF16 tensor
out through DLPack only (kDLBfloat, 16 bits; torch reads it as torch.bfloat16). So a BF16
array goes out as numpy's DLPack of its uint16 view with the type code set to kDLBfloat, and
a kDLBfloat capsule comes in as a uint16 one, read by numpy and viewed as bfloat16: the
producer's own managed tensor and deleter throughout, no copy, nothing to free here.
"""
from __future__ import annotations

import ctypes
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
_KDL_CPU, _KDL_CUDA_HOST = 1, 3
_KDL_UINT, _KDL_BFLOAT = 1, 4
_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"
# DLManagedTensorVersioned: version (2 x uint32), manager_ctx, deleter, flags, then the
# DLTensor; DLManagedTensor starts with it.
_VERSIONED_OFFSET = 32


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):     # DLTensor, as far as the dtype
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32),
                ("dtype", _DataType)]


_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype, _is_valid.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class DLPackError(ValueError):
    """What pb_utils turns into a TritonModelException."""


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _tensor(capsule: Any) -> _Tensor:
    """The DLTensor of an unconsumed capsule (legacy or versioned)."""
    if _is_valid(capsule, _LEGACY):
        return _Tensor.from_address(_get_pointer(capsule, _LEGACY))
    if _is_valid(capsule, _VERSIONED):
        return _Tensor.from_address(_get_pointer(capsule, _VERSIONED) + _VERSIONED_OFFSET)
    raise DLPackError("the DLPack capsule was already consumed or is not a DLPack tensor")


def to_capsule(arr: np.ndarray) -> Any:
    """A DLPack capsule of ``arr`` (the caller hands a writable array: DLPack cannot say
    read-only)."""
    if arr.dtype != BF16:
        return arr.__dlpack__()
    capsule = arr.view(np.uint16).__dlpack__()
    _tensor(capsule).dtype.code = _KDL_BFLOAT
    return capsule


class _Held:
    """A capsule with the two methods np.from_dlpack asks for."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule, self._device = capsule, device

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def from_capsule(capsule: Any) -> np.ndarray:
    """A numpy array on a DLPack capsule's memory (consuming it); kDLBfloat as bfloat16."""
    t = _tensor(capsule)
    device = (t.device.device_type, t.device.device_id)
    if device[0] not in (_KDL_CPU, _KDL_CUDA_HOST):
        raise DLPackError(f"DLDevice type {device[0]} is not support by Python backend.")
    bf16 = t.dtype.code == _KDL_BFLOAT
    if bf16:
        if t.dtype.bits != 16:
            raise DLPackError(f"Expected BF16 tensor to have 16 bits, but had: {t.dtype.bits}")
        t.dtype.code = _KDL_UINT
    try:
        arr = np.from_dlpack(_Held(capsule, (_KDL_CPU, 0)))
    except BufferError as e:
        raise DLPackError(str(e)) from None
    return arr.view(BF16) if bf16 else arr


def from_object(obj: Any) -> np.ndarray:
    """A numpy array from a DLPack capsule or anything with __dlpack__ and
    __dlpack_device__ (a torch tensor, a numpy array, a pb_utils.Tensor)."""
    if is_capsule(obj):
        return from_capsule(obj)
    if isinstance(obj, np.ndarray) and obj.dtype == BF16:
        return obj
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        raise DLPackError("Provided tensor is not supported. Tensor must be a DLPack capsule "
                          "        or have `__dlpack__` and `__dlpack_device__` attributes")
    device = obj.__dlpack_device__()
    if device[0] not in (_KDL_CPU, _KDL_CUDA_HOST):
        raise DLPackError(f"DLDevice type {device[0]} is not support by Python backend.")
    return from_capsule(obj.__dlpack__(stream=None))
