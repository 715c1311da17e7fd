"""json_syntax.scan against Triton 2.51's answers: each document below was sent to a real
Triton as an infer body, `{"inputs":<value>}` or as it stands, and its "failed to parse the
request JSON buffer: <reason> at <offset>" written down (None: Triton parsed it, and went on
to say that "inputs" is not an array). json_body.decode_json reads what rapidjson reads."""
from __future__ import annotations

import math

import pytest

from services.common.errors import TriremeError
from services.frontend.http.json_body import decode_json
from services.frontend.http.json_syntax import scan

EMPTY = "The document is empty."
INVALID = "Invalid value."
MISS_NAME = "Missing a name for object member."
COMMA_OBJECT = "Missing a comma or '}' after an object member."
COMMA_ARRAY = "Missing a comma or ']' after an array element."
ESCAPE = "Invalid escape character in string."
SURROGATE = "The surrogate pair in string is invalid."
TOO_BIG = "Number too big to be stored in double."

INPUTS = [   # the value of "inputs" -> rapidjson's error (offsets count from the '{')
    ('"\\udc00"', None), ('"\\ud800"', (SURROGATE, 11)), ('"\\ud800\\u0041"', (SURROGATE, 11)),
    ('"\\ud800\\udc00"', None), ("-NaN", None), ("Inf", None), ("-Infinity", None),
    ("Infin", (INVALID, 15)), ("NaNx", (COMMA_OBJECT, 13)), ("0e400", (TOO_BIG, 10)),
    ("1e308", None), ("1.8e308", None), ("[1,]", (INVALID, 13)), ("01", (COMMA_OBJECT, 11)),
    ("-01", (COMMA_OBJECT, 12)), ("1.e5", ("Miss fraction part in number.", 12)),
    ("1e+", ("Miss exponent in number.", 13)), (".5", (INVALID, 10)), ("+1", (INVALID, 10)),
    ("1E5", None), ("tru", (INVALID, 13)), ("nul", (INVALID, 13)), ("[1 2]", (COMMA_ARRAY, 13)),
    ('"a\x01b"', (ESCAPE, 12)), ('"\\u12"', ("Incorrect hex digit after \\u escape in string.", 11)),
    ("-", (INVALID, 11)), ("", (INVALID, 10)), ("[1,2", (COMMA_ARRAY, 14)),
]


@pytest.mark.parametrize("value, error", INPUTS)
def test_inputs_values(value, error):
    doc = b'{"inputs":' + value.encode() + (b"" if value == "[1,2" else b"}")
    # (the offsets above were taken with the closing brace; "[1,2" was sent without it)
    assert scan(doc) == (error if error is not None else (None, len(doc)))


@pytest.mark.parametrize("doc, error", [
    (b"", (EMPTY, 0)), (b"  \x00", (EMPTY, 2)), (b"\x00abc", (EMPTY, 0)), (b"xyz", (INVALID, 0)),
    (b"{", (MISS_NAME, 1)), (b"{'inputs':[]}", (MISS_NAME, 1)), (b'{"inputs":[],}', (MISS_NAME, 13)),
    (b'{"inputs" []}', ("Missing a colon after a name of object member.", 10)),
    (b'{"inputs":[] "id":"x"}', (COMMA_OBJECT, 13)),
    (b"{} {}", ("The document root must not be followed by other values.", 3)),
    (b'{"inputs":"abc', ("Missing a closing quotation mark in string.", 14)),
    (b'{"inputs":"\\q"}', (ESCAPE, 11)),
])
def test_documents(doc, error):
    assert scan(doc) == error


def test_a_nul_byte_ends_the_document():
    assert scan(b'{"a":1}\x00 anything') == (None, 7)
    assert decode_json(b'{"a":1}\x00 anything') == {"a": 1}


def test_rapidjson_numbers_are_read():
    doc = decode_json(b'[NaN, -NaN, Inf, -Inf, Infinity, -Infinity, "Inf", 1e308]')
    assert math.isnan(doc[0]) and math.isnan(doc[1])
    assert doc[2:6] == [math.inf, -math.inf, math.inf, -math.inf] and doc[6:] == ["Inf", 1e308]


def test_errors_deep_in_a_large_body():
    """Plain elements are skipped by one expression: the error after a million of them is
    found, at its offset."""
    head = b'{"inputs":[' + b"1.5," * 1_000_000 + b'"x\\"y",' * 1000
    assert scan(head + b"1 2]}") == (COMMA_ARRAY, len(head) + 2)
    assert scan(head + b"1e400]}") == (TOO_BIG, len(head))
    with pytest.raises(TriremeError) as e:
        decode_json(head + b"]}")
    assert e.value.message == f"failed to parse the request JSON buffer: {INVALID} at {len(head)}"


def test_depth_costs_no_recursion():
    assert scan(b"[" * 200_000 + b"]" * 200_000) == (None, 400_000)
    assert scan(b"[" * 200_000) == (INVALID, 200_000)
