import math
import struct

import ml_dtypes
import numpy as np
import pytest

from services.common import datatypes as dt
from services.common.errors import Code, TriremeError

SAMPLES = {
    "BOOL": [True, False, True, True],
    "UINT8": [0, 1, 255, 7],
    "UINT16": [0, 1, 65535, 7],
    "UINT32": [0, 1, 2**32 - 1, 7],
    "UINT64": [0, 1, 2**64 - 1, 7],
    "INT8": [-128, 0, 127, -1],
    "INT16": [-32768, 0, 32767, -1],
    "INT32": [-(2**31), 0, 2**31 - 1, -1],
    "INT64": [-(2**63), 0, 2**63 - 1, -1],
    "FP16": [0.5, -1.25, 65504.0, 0.0],
    "FP32": [0.5, -1.25, 2.0**100, 1.0],
    "FP64": [0.1, -1.25, 1e300, 2.0],
    "BF16": [0.5, -1.25, 3.0e38, 1.0],
    "BYTES": ["abc", "", "héllo", "x" * 300],
}


def test_table_covers_every_datatype():
    assert set(SAMPLES) == set(dt.DATATYPES)


JSON_TYPES = [d for d in SAMPLES if d not in ("FP16", "BF16")]   # Triton: binary only


@pytest.mark.parametrize("datatype", JSON_TYPES)
def test_json_round_trip(datatype):
    values = SAMPLES[datatype]
    buf = dt.json_to_buffer("IN", datatype, [2, 2], values)
    assert isinstance(buf, (bytes, bytearray))
    if datatype != "BYTES":
        assert len(buf) == dt.expected_byte_size(datatype, [2, 2])
    back = dt.buffer_to_json(datatype, [2, 2], buf)
    assert back == values
    assert all(type(a) is type(b) for a, b in zip(back, values))
    arr = dt.as_array(datatype, [2, 2], buf)
    assert arr.shape == (2, 2)
    assert arr.dtype == dt.numpy_dtype(datatype)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_fp16_and_bf16_json_is_refused_with_tritons_text(datatype):
    with pytest.raises(TriremeError) as e:
        dt.json_to_buffer("IN", datatype, [2], [1.0, 2.0])
    assert e.value.code == Code.INVALID_ARG
    assert e.value.message == (f"receiving {datatype} data via JSON is not supported. Please "
                               f"use the binary data format for input IN")
    assert dt.json_to_buffer("IN", datatype, [0], [1.0]) == b""   # nothing read: no refusal
    assert dt.json_send_refused_text(datatype) == (
        f"sending {datatype} data via JSON is not supported. Please use the binary data "
        f"format for output")


@pytest.mark.parametrize("datatype", [d for d in JSON_TYPES if d != "BYTES"])
def test_nested_and_flat_json_give_same_bytes(datatype):
    flat = SAMPLES[datatype]
    nested = [flat[:2], flat[2:]]
    assert dt.json_to_buffer("x", datatype, [2, 2], nested) == \
        dt.json_to_buffer("x", datatype, [4], flat)


def test_ragged_nesting_is_walked_in_order():
    buf = dt.json_to_buffer("x", "INT32", [3], [[1, 2], [], [3]])
    assert np.frombuffer(buf, "<i4").tolist() == [1, 2, 3]


def test_bytes_nested_elements():
    buf = dt.json_to_buffer("x", "BYTES", [2, 1], [["a"], ["é"]])
    assert dt.deserialize_bytes_tensor(buf).tolist() == [b"a", "é".encode()]


def test_wire_layout_is_little_endian_and_bool_is_one_byte():
    assert dt.json_to_buffer("x", "INT32", [2], [1, -2]) == struct.pack("<ii", 1, -2)
    assert dt.json_to_buffer("x", "BOOL", [3], [True, False, True]) == b"\x01\x00\x01"
    assert dt.json_to_buffer("x", "FP32", [2], [1, 2]) == struct.pack("<ff", 1.0, 2.0)


def test_scalar_data_is_refused_and_empty_tensor_reads_nothing():
    with pytest.raises(TriremeError) as e:
        dt.json_to_buffer("x", "FP32", [1], 2.5)
    assert e.value.message == "Unable to parse 'data': attempt to access JSON non-array as array"
    assert dt.json_to_buffer("x", "INT64", [0, 3], []) == b""
    assert dt.json_to_buffer("x", "FP32", [0], "anything") == b""
    assert dt.json_to_buffer("x", "BYTES", [0], []) == b""
    assert dt.buffer_to_json("INT64", [0, 3], b"") == []


SHAPE_TEXT = "Unable to parse 'data': Shape does not match true shape of 'data' field"


def test_wrong_element_count_is_tritons_shape_text():
    for data in ([1.0] * 5, [1.0] * 7, [[1.0] * 3, [1.0] * 2]):
        with pytest.raises(TriremeError) as e:
            dt.json_to_buffer("INPUT0", "FP32", [2, 3], data)
        assert e.value.code == Code.INVALID_ARG
        assert e.value.message == SHAPE_TEXT
    # BYTES: any count is read; the request's validation compares it with the shape
    assert dt.deserialize_bytes_tensor(dt.json_to_buffer("S", "BYTES", [2], ["a"])).size == 1


@pytest.mark.parametrize("datatype,data,want", [
    ("FP32", [1.0, "2.0"], "non-number as double"),
    ("FP32", [True, False], "non-number as double"),
    ("FP64", [None, 1], "non-number as double"),
    ("INT32", [1, 2.5], "non-signed-integer as signed-integer"),
    ("INT32", [1, 2.0], "non-signed-integer as signed-integer"),
    ("INT8", [True, 1], "non-signed-integer as signed-integer"),
    ("INT64", [2**63, 1], "non-signed-integer as signed-integer"),
    ("UINT8", [-1, 2], "non-unsigned-integer as unsigned-integer"),
    ("UINT8", [{"a": 1}, 2], "non-unsigned-integer as unsigned-integer"),
    ("UINT64", [2**64, 2], "non-unsigned-integer as unsigned-integer"),
    ("BOOL", [1, 0], "non-boolean as boolean"),
])
def test_wrong_value_type_is_tritons_accessor_text(datatype, data, want):
    with pytest.raises(TriremeError) as e:
        dt.json_to_buffer("IN", datatype, [2], data)
    assert e.value.code == Code.INVALID_ARG
    assert e.value.message == f"Unable to parse 'data': attempt to access JSON {want}"


def test_first_event_of_the_walk_decides_between_type_and_count():
    with pytest.raises(TriremeError, match="non-signed-integer"):    # bad value first
        dt.json_to_buffer("IN", "INT32", [2], ["x", 1, 2])
    with pytest.raises(TriremeError, match="Shape does not match"):  # overrun first
        dt.json_to_buffer("IN", "INT32", [2], [1, 2, "x"])


def test_bytes_refuses_non_strings():
    with pytest.raises(TriremeError) as e:
        dt.json_to_buffer("IN", "BYTES", [2], ["a", 3])
    assert e.value.message == ("Unable to parse JSON bytes array: attempt to access JSON "
                               "non-string as string")


def test_unknown_datatype_text():
    with pytest.raises(TriremeError) as e:
        dt.json_to_buffer("IN", "FOO", [1], [1])
    assert e.value.message == "invalid datatype for input IN"


def test_uint64_beyond_int64_is_exact():
    buf = dt.json_to_buffer("x", "UINT64", [3], [1, 2**64 - 1, 2**63 + 1])
    assert np.frombuffer(buf, "<u8").tolist() == [1, 2**64 - 1, 2**63 + 1]
    buf = dt.json_to_buffer("x", "INT64", [2], [-(2**63), 2**63 - 1])
    assert np.frombuffer(buf, "<i8").tolist() == [-(2**63), 2**63 - 1]


def test_integers_wrap_to_their_width_as_a_c_cast():
    """Triton reads any 64-bit integer and casts it: 300 is 44 as INT8, 256 is 0 as UINT8."""
    assert np.frombuffer(dt.json_to_buffer("IN", "INT8", [2], [300, -200]), "i1").tolist() == \
        [44, 56]
    assert np.frombuffer(dt.json_to_buffer("IN", "UINT8", [2], [256, 2]), "u1").tolist() == \
        [0, 2]
    assert np.frombuffer(dt.json_to_buffer("IN", "UINT32", [1], [2**64 - 1]), "<u4").tolist() \
        == [2**32 - 1]


def test_floats_take_any_number():
    buf = dt.json_to_buffer("IN", "FP32", [3], [1e40, 2**70, -3])
    assert np.frombuffer(buf, "<f4").tolist() == [np.inf, float(np.float32(2.0**70)), -3.0]
    with pytest.raises(TriremeError) as e:
        dt.json_to_buffer("IN", "FP64", [1], [10**400])
    assert e.value.message == ("failed to parse the request JSON buffer: Number too big to be "
                               "stored in double.")


def test_long_flat_list_is_fast_and_exact():
    values = [float(i) for i in range(200_000)]
    buf = dt.json_to_buffer("x", "FP32", [200_000], values)
    assert np.array_equal(np.frombuffer(buf, "<f4"), np.arange(200_000, dtype=np.float32))


def test_bytes_serialize_round_trip_with_empty_and_non_utf8():
    items = [b"", b"\x00\xff\xfe", b"plain", "unicodé", b""]
    arr = np.array(items, dtype=object).reshape(5, 1)
    buf = dt.serialize_bytes_tensor(arr)
    assert buf[:4] == b"\x00\x00\x00\x00"
    assert len(buf) == sum(4 + len(x if isinstance(x, bytes) else x.encode()) for x in items)
    out = dt.deserialize_bytes_tensor(buf)
    assert out.dtype == object and out.shape == (5,)
    assert out.tolist() == [b"", b"\x00\xff\xfe", b"plain", "unicodé".encode(), b""]
    assert dt.bytes_tensor_count(buf) == 5
    assert dt.bytes_tensor_count(memoryview(buf)) == 5
    assert dt.buffer_to_json("BYTES", [5], buf)[1] == "\x00\ufffd\ufffd"
    assert dt.as_array("BYTES", [5, 1], buf).shape == (5, 1)


def test_bytes_to_json_strict_names_the_first_element_that_is_not_utf8():
    buf = dt.serialize_bytes_tensor(np.array([b"ok\x00", b"\xc3\xa9", b"\x1b\x931\xbf\x00"],
                                             dtype=object))
    with pytest.raises(dt.NotText) as e:
        dt.buffer_to_json_array("BYTES", [3], buf, strict=True)
    assert e.value.index == 2
    assert dt.buffer_to_json("BYTES", [3], buf)[2] == "\x1b\ufffd1\ufffd\x00"
    ok = dt.serialize_bytes_tensor(np.array([b"ok\x00", b"\xc3\xa9"], dtype=object))
    assert dt.buffer_to_json_array("BYTES", [2], ok, strict=True) == ["ok\x00", "é"]


def test_serialize_unicode_array_list_and_keeps_trailing_nuls():
    assert dt.serialize_bytes_tensor(np.array(["ab", "c"])) == \
        b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    assert dt.serialize_bytes_tensor([b"a\x00"]) == b"\x02\x00\x00\x00a\x00"
    assert dt.serialize_bytes_tensor(np.array([], dtype=object)) == b""
    assert dt.deserialize_bytes_tensor(b"").shape == (0,)


def test_uniform_width_fast_path_matches_general_parse():
    same = [b"ab\x00", b"\x00\x00\x00", b"xyz"]
    assert dt.deserialize_bytes_tensor(dt.serialize_bytes_tensor(same)).tolist() == same
    # divisible total size but different widths: must not be mistaken for uniform
    mixed = [b"abcd", b"", b"xyzw" + b"1234"]
    assert dt.deserialize_bytes_tensor(dt.serialize_bytes_tensor(mixed)).tolist() == mixed
    assert dt.bytes_tensor_count(dt.serialize_bytes_tensor(mixed)) == 3


@pytest.mark.parametrize("buf", [b"\x05\x00\x00\x00abc", b"\x01\x00\x00\x00a\x02\x00"])
def test_truncated_bytes_buffer_is_invalid_arg(buf):
    for fn in (dt.deserialize_bytes_tensor, dt.bytes_tensor_count):
        with pytest.raises(TriremeError, match="truncated") as e:
            fn(buf)
        assert e.value.code == Code.INVALID_ARG


def test_dense_size_mismatch_is_invalid_arg():
    with pytest.raises(TriremeError, match="needs 8 bytes, got 6"):
        dt.as_array("FP32", [2], b"\x00" * 6)


def test_as_array_is_a_view():
    buf = bytearray(dt.json_to_buffer("x", "INT16", [2, 2], [1, 2, 3, 4]))
    arr = dt.as_array("INT16", [2, 2], buf)
    buf[0] = 9
    assert arr[0, 0] == 9


def test_name_tables():
    for d in dt.DATATYPES:
        assert dt.config_to_api(dt.api_to_config(d)) == d
    assert dt.config_to_api("TYPE_STRING") == "BYTES"
    assert dt.api_to_config("BYTES") == "TYPE_STRING"
    assert dt.config_to_api("TYPE_BF16") == "BF16"
    for bad in (lambda: dt.config_to_api("TYPE_INVALID"), lambda: dt.api_to_config("FP8"),
                lambda: dt.numpy_dtype("STRING")):
        with pytest.raises(TriremeError) as e:
            bad()
        assert e.value.code == Code.INVALID_ARG


def test_numpy_dtype_round_trip():
    for d in dt.DATATYPES:
        assert dt.datatype_of(dt.numpy_dtype(d)) == d
    assert dt.datatype_of(np.dtype(">f4")) == "FP32"
    assert dt.datatype_of(np.bytes_) == "BYTES"
    assert dt.datatype_of(np.str_) == "BYTES"
    assert dt.datatype_of(ml_dtypes.bfloat16) == "BF16"
    assert dt.numpy_dtype("FP32").byteorder in "<="
    with pytest.raises(TriremeError):
        dt.datatype_of(np.complex64)


def test_sizes():
    assert dt.element_size("BOOL") == 1
    assert dt.element_size("BF16") == 2
    assert dt.element_size("UINT64") == 8
    assert dt.element_size("BYTES") is None
    assert dt.expected_byte_size("FP32", [3, 4]) == 48
    assert dt.expected_byte_size("FP32", [-1, 4]) is None
    assert dt.expected_byte_size("BYTES", [3]) is None
    assert dt.expected_byte_size("INT8", []) == math.prod([]) == 1
