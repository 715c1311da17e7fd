"""The one table of tensor datatypes, and conversions between wire, JSON and numpy.

API datatype strings ("FP32", "BYTES") are what clients send; config names ("TYPE_FP32",
"TYPE_STRING") are what config.pbtxt holds. Raw tensor bytes are little-endian, row-major,
unpadded; BOOL is one byte; BYTES elements are a 4-byte little-endian length + the bytes.
Decoding always goes through numpy.frombuffer or a memoryview, never element by element,
except BYTES.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any, Literal

import ml_dtypes
import numpy as np

from services.common.errors import JSON_NOT_ARRAY, JSON_NOT_STRING, TriremeError, invalid_arg

# API datatype -> numpy dtype (explicitly little-endian: it is the wire order).
_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
DATATYPES: tuple[str, ...] = tuple(_NUMPY)

_API_TO_CONFIG: dict[str, str] = {
    dt: ("TYPE_STRING" if dt == "BYTES" else f"TYPE_{dt}") for dt in DATATYPES
}
_CONFIG_TO_API: dict[str, str] = {cfg: dt for dt, cfg in _API_TO_CONFIG.items()}

# numpy (kind, itemsize) -> API datatype, so any byte order maps back.
_BY_KIND: dict[tuple[str, int], str] = {
    (d.kind, d.itemsize): name for name, d in _NUMPY.items() if d.kind in "biuf"
}
_BF16 = _NUMPY["BF16"]


_U32 = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"  # memoryview native formats are then the wire order


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype for an API datatype; BYTES is the object dtype."""
    try:
        return _NUMPY[datatype]
    except (KeyError, TypeError):
        raise invalid_arg(f"unsupported datatype '{datatype}'") from None


def datatype_of(dtype: Any) -> str:
    """API datatype for a numpy dtype (or anything np.dtype() accepts)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise invalid_arg(f"unsupported numpy dtype {dtype!r}") from None
    if dt.kind in "OSU":
        return "BYTES"
    if dt == _BF16:
        return "BF16"
    name = _BY_KIND.get((dt.kind, dt.itemsize))
    if name is None:
        raise invalid_arg(f"unsupported numpy dtype {dt}")
    return name


def config_to_api(name: str) -> str:
    """"TYPE_FP32" -> "FP32", "TYPE_STRING" -> "BYTES"."""
    try:
        return _CONFIG_TO_API[name]
    except (KeyError, TypeError):
        raise invalid_arg(f"unsupported data type '{name}'") from None


def api_to_config(datatype: str) -> str:
    """"FP32" -> "TYPE_FP32", "BYTES" -> "TYPE_STRING"."""
    try:
        return _API_TO_CONFIG[datatype]
    except (KeyError, TypeError):
        raise invalid_arg(f"unsupported datatype '{datatype}'") from None


def element_size(datatype: str) -> int | None:
    """Bytes per element; None for BYTES (variable length)."""
    if datatype == "BYTES":
        return None
    return numpy_dtype(datatype).itemsize


def expected_byte_size(datatype: str, shape: Sequence[int]) -> int | None:
    """Byte size of a dense tensor; None for BYTES or a shape with a wildcard (-1)."""
    size = element_size(datatype)
    if size is None or any(d < 0 for d in shape):
        return None
    return size * math.prod(shape)


# ---- BYTES wire format ---------------------------------------------------------------

def _to_bytes(x: Any) -> bytes:
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode("utf-8")
    if isinstance(x, (bytearray, memoryview)):
        return bytes(x)
    return str(x).encode("utf-8")  # what tritonclient does for other objects


def _join_framed(items: list[bytes]) -> bytes:
    # One C-level join over (length, payload) pairs: no per-element concatenation.
    return b"".join(chain.from_iterable(zip(map(_U32.pack, map(len, items)), items)))


def serialize_bytes_tensor(arr: np.ndarray | Iterable[Any]) -> bytes:
    """Elements in C order, each as <u4 length + bytes; str is encoded as UTF-8."""
    if not isinstance(arr, np.ndarray):
        arr = np.array(arr, dtype=object)  # not np.asarray: dtype "S" drops trailing NULs
    items = arr.ravel(order="C").tolist()
    if not all(type(x) is bytes for x in items):  # len() must be the byte count
        items = [_to_bytes(x) for x in items]
    return _join_framed(items)


def _truncated(index: int, off: int, n: int) -> TriremeError:
    return invalid_arg(f"BYTES tensor buffer is truncated: element {index} at byte {off} "
                       f"overruns the {n}-byte buffer")


def _split(buf: Any) -> list[bytes]:
    """The elements of a BYTES buffer, validating its framing."""
    data = buf if isinstance(buf, bytes) else bytes(buf)
    n = len(data)
    if n >= 4:  # fast path: every element the same length (fixed-width strings, ids)
        (width,) = _U32.unpack_from(data, 0)
        if width and n % (4 + width) == 0:
            rec = np.frombuffer(data, dtype=[("n", "<u4"), ("d", f"V{width}")])
            if (rec["n"] == width).all():
                return rec["d"].tolist()  # void -> bytes, trailing NULs kept
    out: list[bytes] = []
    append, unpack, off = out.append, _U32.unpack_from, 0
    try:
        while off < n:
            end = off + 4 + unpack(data, off)[0]
            if end > n:
                raise _truncated(len(out), off, n)
            append(data[off + 4:end])
            off = end
    except struct.error:  # fewer than 4 length bytes left
        raise _truncated(len(out), off, n) from None
    return out


def deserialize_bytes_tensor(buf: Any) -> np.ndarray:
    """1-D object array of `bytes` from the BYTES wire format."""
    items = _split(buf)
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def bytes_tensor_count(buf: Any) -> int:
    """Number of elements in a BYTES buffer, validating its framing."""
    data = buf if isinstance(buf, (bytes, bytearray)) else memoryview(buf).cast("B")
    n, off, count = len(data), 0, 0
    unpack = _U32.unpack_from
    try:
        while off < n:
            end = off + 4 + unpack(data, off)[0]
            if end > n:
                raise _truncated(count, off, n)
            off = end
            count += 1
    except struct.error:
        raise _truncated(count, off, n) from None
    return count


# ---- JSON <-> raw buffers ------------------------------------------------------------
# A tensor's JSON "data" is read as Triton's HTTP server reads it (src/http_server.cc
# ReadDataFromJson, JsonBytesArrayByteSize; TritonJson's accessors): an array, nested or
# not, walked in order; BOOL takes only true/false, the integer types only JSON integers
# that fit 64 bits (unsigned for UINT*), wrapped to their width as a C cast does (300 is
# 44 as INT8), the float types any number; BYTES only strings (the element count is the
# request validation's to check); FP16 and BF16 are refused, binary data being the way to
# send them. The texts are Triton's. Triton answers the type and count errors with 500
# (TritonJson's error passes through as INTERNAL): they are the client's, so here 400.

DATA_NOT_ARRAY_TEXT = f"Unable to parse 'data': {JSON_NOT_ARRAY}"
DATA_SHAPE_TEXT = "Unable to parse 'data': Shape does not match true shape of 'data' field"
BYTES_NOT_STRING_TEXT = f"Unable to parse JSON bytes array: {JSON_NOT_STRING}"
NUMBER_TOO_BIG_TEXT = ("failed to parse the request JSON buffer: Number too big to be stored "
                       "in double.")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT64 = (0, (1 << 64) - 1)


def json_receive_refused_text(datatype: str, name: str) -> str:
    """Triton's refusal of FP16/BF16 input data as JSON."""
    return (f"receiving {datatype} data via JSON is not supported. Please use the binary "
            f"data format for input {name}")


def json_send_refused_text(datatype: str) -> str:
    """Triton's refusal of an FP16/BF16 output as JSON."""
    return (f"sending {datatype} data via JSON is not supported. Please use the binary data "
            f"format for output")


def _flatten_into(out: list[Any], seq: Iterable[Any]) -> None:
    for x in seq:
        if type(x) is list:
            _flatten_into(out, x)
        else:
            out.append(x)


def _flat(data: list[Any]) -> list[Any]:
    if list in map(type, data):
        out: list[Any] = []
        _flatten_into(out, data)
        return out
    return data


def _element_count(name: str, shape: Sequence[int]) -> int:
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise invalid_arg(f"input '{name}' has invalid shape {list(shape)}")
    return math.prod(shape)


def _accessor(datatype: str) -> tuple[str, Any]:
    """TritonJson's accessor for ``datatype``: what its error says it refused, and a test
    of one value."""
    if datatype == "BOOL":
        return "non-boolean as boolean", lambda v: type(v) is bool
    if datatype[0] == "U":
        return ("non-unsigned-integer as unsigned-integer",
                lambda v: type(v) is int and _UINT64[0] <= v <= _UINT64[1])
    if datatype[0] == "I":
        return ("non-signed-integer as signed-integer",
                lambda v: type(v) is int and _INT64[0] <= v <= _INT64[1])
    return "non-number as double", lambda v: type(v) is int or type(v) is float


def _all_accepted(datatype: str, flat: list[Any]) -> bool:
    """Whether every value passes ``datatype``'s accessor, at C speed where it can."""
    types = set(map(type, flat))
    if datatype == "BOOL":
        return types <= {bool}
    if datatype[0] in "UI":
        lo, hi = _UINT64 if datatype[0] == "U" else _INT64
        return types <= {int} and (not flat or (lo <= min(flat) and max(flat) <= hi))
    return types <= {int, float}


def json_to_buffer(name: str, datatype: str, shape: Sequence[int], data: Any) -> bytes:
    """A tensor's KServe v2 JSON `data` -> raw little-endian bytes, as Triton reads it
    (above). A tensor without elements reads nothing (Triton does not look at its data)."""
    count = _element_count(name, shape)
    if count == 0:
        return b""
    if type(data) is not list:
        raise invalid_arg(DATA_NOT_ARRAY_TEXT)
    if datatype == "BYTES":
        items = _flat(data)
        if not all(type(x) is str for x in items):
            raise invalid_arg(BYTES_NOT_STRING_TEXT)
        return _join_framed([x.encode("utf-8") for x in items])
    if datatype in ("FP16", "BF16"):
        raise invalid_arg(json_receive_refused_text(datatype, name))
    if datatype not in _NUMPY:
        raise invalid_arg(f"invalid datatype for input {name}")
    flat = _flat(data)
    if not _all_accepted(datatype, flat) or len(flat) != count:
        # Triton's walk: element by element, the first overrun or refused value ends it.
        what, ok = _accessor(datatype)
        for i, v in enumerate(flat):
            if i >= count:
                break
            if not ok(v):
                raise invalid_arg(f"Unable to parse 'data': attempt to access JSON {what}")
        raise invalid_arg(DATA_SHAPE_TEXT)
    dtype = _NUMPY[datatype]
    if datatype == "BOOL":
        return np.array(flat, np.bool_).tobytes()
    if dtype.kind in "iu":   # through 64 bits, then a wrapping cast to the width
        wide = np.array(flat, np.uint64 if dtype.kind == "u" else np.int64)
        return wide.astype(dtype, copy=False).tobytes()
    try:
        wide = np.array(flat, np.float64)
    except OverflowError:    # an integer beyond any double: Triton's parser refuses it
        raise invalid_arg(NUMBER_TOO_BIG_TEXT) from None
    with np.errstate(over="ignore"):  # 1e40 -> inf in FP32, as a C cast would do
        return wide.astype(dtype, copy=False).tobytes()


# struct codes of the datatypes numbers_to_buffer packs directly ("<": little-endian, no
# padding). The range checks of struct are the datatypes' own: a value out of range fails.
# struct/memoryview format codes (a Literal: memoryview.cast's stub accepts no plain str)
_Code = Literal["b", "h", "i", "q", "B", "H", "I", "Q", "f", "d"]
_PACK_CODES: dict[str, _Code] = {
    "INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q",
    "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "FP32": "f", "FP64": "d",
}
# High byte (sign + top exponent bits) of each element: all of them in this set means every
# |value| < 2**53 (FP32: exponent <= 179) or < 2**49 (FP64: exponent <= 1071). Below 2**53
# every int is exact in a double, so packing it is plainly what json_to_buffer does; larger
# ones take json_to_buffer (the same bytes: both round int -> double -> float).
_SMALL_HIGH_BYTES = {
    "f": (4, bytes(b for b in range(256) if b & 0x7F <= 0x59)),
    "d": (8, bytes(b for b in range(256) if b & 0x7F <= 0x42)),
}


@functools.lru_cache(maxsize=256)
def _packer(code: str, count: int) -> Any:
    return struct.Struct(f"<{count}{code}").pack


def numbers_to_buffer(name: str, datatype: str, shape: Sequence[int],
                      values: list[int | float]) -> bytes:
    """json_to_buffer for a flat list of Python ints and floats only (no bool, no nesting,
    as a typed JSON decoder yields it): the same bytes and errors, in one struct.pack for
    the integer types, FP32 and FP64 where no int could round differently. Anything else
    goes through json_to_buffer."""
    code = _PACK_CODES.get(datatype)
    if code is not None and len(values) == _element_count(name, shape):
        try:
            out = _packer(code, len(values))(*values)
        except (struct.error, OverflowError):  # out of range, a float for an int type
            return json_to_buffer(name, datatype, shape, values)
        check = _SMALL_HIGH_BYTES.get(code)
        if check is None or not out[check[0] - 1::check[0]].translate(None, check[1]):
            return out
    return json_to_buffer(name, datatype, shape, values)


def _dense_view(datatype: str, shape: Sequence[int], buf: Any) -> np.ndarray:
    dtype = numpy_dtype(datatype)
    want = math.prod(shape) * dtype.itemsize
    got = memoryview(buf).nbytes
    if got != want:
        raise invalid_arg(f"{datatype} tensor of shape {list(shape)} needs {want} bytes, "
                          f"got {got}")
    return np.frombuffer(buf, dtype=dtype)


# memoryview formats whose tolist() gives what numpy's does (BOOL, FP16, BF16: numpy).
_VIEW_CODES: dict[str, tuple[_Code, int]] = {
    dt: (c, _NUMPY[dt].itemsize) for dt, c in _PACK_CODES.items()} if _LITTLE else {}


class NotText(ValueError):
    """A BYTES element that is not UTF-8, where the caller asked for text only (``strict``);
    ``index``: the element's."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


def buffer_to_json(datatype: str, shape: Sequence[int], buf: Any,
                   strict: bool = False) -> list[Any]:
    """Raw bytes -> flat list of JSON-ready Python values (BYTES as UTF-8 text; an element
    that is not UTF-8 raises NotText when ``strict``, else has U+FFFD for its bad bytes)."""
    fmt = _VIEW_CODES.get(datatype)
    if fmt is not None:  # memoryview.tolist: no numpy array around the buffer
        view = memoryview(buf)
        if view.c_contiguous and view.nbytes == math.prod(shape) * fmt[1]:
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            return view.cast(fmt[0]).tolist()
    if datatype == "BYTES":
        items = _split(buf)
        if len(items) != math.prod(shape):
            raise invalid_arg(f"BYTES tensor of shape {list(shape)} holds {len(items)} elements")
        try:
            return [b.decode("utf-8") for b in items]
        except UnicodeDecodeError:
            if strict:
                for i, b in enumerate(items):
                    try:
                        b.decode("utf-8")
                    except UnicodeDecodeError:
                        raise NotText(i) from None
            return [b.decode("utf-8", "replace") for b in items]
    return _dense_view(datatype, shape, buf).tolist()  # FP16/BF16 -> float, BOOL -> bool


def buffer_to_json_array(datatype: str, shape: Sequence[int], buf: Any,
                         strict: bool = False) -> np.ndarray | list[Any]:
    """buffer_to_json for an encoder that writes numpy arrays itself (orjson with
    OPT_SERIALIZE_NUMPY): no Python object per element. Floats of every width become
    float64, so each value is written as Triton writes it (the double's shortest form, as
    buffer_to_json's Python floats are); BYTES stays a list of text."""
    if datatype == "BYTES":
        return buffer_to_json(datatype, shape, buf, strict)
    arr = _dense_view(datatype, shape, buf)
    if datatype in ("FP32", "FP16", "BF16"):
        arr = arr.astype(np.float64)
    return arr


def as_array(datatype: str, shape: Sequence[int], buf: Any) -> np.ndarray:
    """numpy view of a raw buffer (no copy; read-only if buf is); BYTES is decoded."""
    if datatype == "BYTES":
        arr = deserialize_bytes_tensor(buf)
        if arr.size != math.prod(shape):
            raise invalid_arg(f"BYTES tensor of shape {list(shape)} holds {arr.size} elements")
        return arr.reshape(shape)
    return _dense_view(datatype, shape, buf).reshape(shape)
