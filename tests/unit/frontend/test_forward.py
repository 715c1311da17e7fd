"""services.frontend.forward: Triton's header-forward pattern ("(?i)" + the flag, RE2 flag
groups) in Python's re, and what a forwarded header does to the request's parameters."""
from __future__ import annotations

import pytest

from services.common.errors import Code, TriremeError
from services.frontend.forward import HeaderForward, compile_pattern, grpc_metadata, maybe


@pytest.mark.parametrize(("pattern", "name", "matches"), [
    ("PREFIX_.*", "prefix_a", True),             # case-insensitive by default
    ("PREFIX_", "x-prefix_a", True),             # anywhere in the name (PartialMatch)
    ("^PREFIX_", "x-prefix_a", False),
    ("(?-i)PREFIX_.*", "prefix_a", False),       # Triton's docs: "(?-i)" turns case back on
    ("(?-i)PREFIX_.*", "PREFIX_a", True),
    ("a(?-i)B|c", "AB", True),                   # RE2: the flag holds to the group's end...
    ("a(?-i)B|c", "Ab", False),
    ("a(?-i)B|c", "C", False),                   # ... across its alternatives
    ("(x(?-i)Y)|z", "XY", True),
    ("(x(?-i)Y)|z", "Z", True),                  # outside the group: case-insensitive again
    ("[(?-i)]", "?", True),                      # inside a class it is not a flag group
    (r"\(\?-i\)", "(?-I)", True),
    ("", "anything", True),                      # an empty pattern forwards every header
])
def test_pattern(pattern, name, matches):
    assert (compile_pattern(pattern).search(name) is not None) is matches


def test_forwarded_headers_are_added_after_the_request_parameters():
    params = {"p": 1, "coll": "body"}
    HeaderForward("^(coll|my_)").apply(params, [("My_A", "1"), ("other", "2"), ("coll", "h")])
    assert params == {"p": 1, "coll": "h", "My_A": "1"}


@pytest.mark.parametrize("name", ["sequence_id", "sequence_start", "sequence_end", "priority",
                                  "timeout", "headers", "binary_data_output", "triton_x"])
def test_reserved_names_fail_the_request(name):
    with pytest.raises(TriremeError) as e:
        HeaderForward(".*").apply({}, [("a", "1"), (name, "1")])
    assert e.value.code == Code.INVALID_ARG
    assert e.value.message == f"Header '{name}' is reserved for Triton usage and cannot be forwarded."


def test_reserved_names_are_compared_as_sent():
    params: dict = {}
    HeaderForward(".*").apply(params, [("Priority", "1")])   # (Triton main: exact names)
    assert params == {"Priority": "1"}


def test_no_flag_no_forwarding():
    assert maybe(None) is None
    assert maybe("") is not None


class _Context:
    def __init__(self, metadata):
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata


def test_grpc_metadata_as_triton_sees_it():
    # the native server's headers as sent (a "-bin" value in base64 without padding), and
    # grpc.aio's (a "-bin" value decoded already, as bytes)
    native = _Context((("user-agent", "grpc-python"), ("te", "trailers"), ("x-bin", "enoA/w"),
                       ("grpc-accept-encoding", "gzip"), ("content-type", "application/grpc"),
                       ("b", "2"), ("a", "1")))
    expected = [("a", "1"), ("b", "2"), ("user-agent", "grpc-python"), ("x-bin", "zz")]
    assert grpc_metadata(native) == expected
    aio = _Context((("b", "2"), ("x-bin", b"zz\x00\xff"), ("a", "1"), ("user-agent", "grpc-python")))
    assert grpc_metadata(aio) == expected


def test_grpc_call_without_metadata():
    assert grpc_metadata(object()) == []
