"""Triton's HTTP rules for an inference request's own "parameters" (server
src/http_server.cc, HTTPAPIServer::ParseJsonTritonParams and
SetTritonParameterFromJsonParameter), checked before anything is queued.

The texts are Triton's. Triton answers a wrongly typed sequence_id / sequence_start /
sequence_end / priority / timeout / binary_data_output with 500 (TritonJson's error passes
through as INTERNAL); it is the client's mistake, so Trireme answers 400 with the same text
(docs/compat.md).
"""
from __future__ import annotations

from typing import Any

from services.common.errors import JSON_NOT_BOOL as _NOT_BOOL
from services.common.errors import JSON_NOT_STRING as _NOT_STRING
from services.common.errors import JSON_NOT_UINT as _NOT_UINT
from services.common.errors import invalid_arg

_UINT64_MAX = 2**64 - 1
RESERVED_TEXT = ("parameter keys starting with 'triton_' are reserved for Triton usage and "
                 "should not be specified.")


def _uint(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _UINT64_MAX


def check_request_params(params: dict[str, Any]) -> None:
    """Raise Triton's 400 for the first parameter it would refuse, in request order."""
    for key, value in params.items():
        if key == "sequence_id":
            ok, why = _uint(value) or type(value) is str, _NOT_STRING
        elif key in ("sequence_start", "sequence_end", "binary_data_output"):
            ok, why = type(value) is bool, _NOT_BOOL
        elif key in ("priority", "timeout"):
            ok, why = _uint(value), _NOT_UINT
        elif key.startswith("triton_"):
            raise invalid_arg(RESERVED_TEXT)
        else:
            if value is None or type(value) in (dict, list):
                raise invalid_arg(f"parameter '{key}' has invalid type. It should be either "
                                  f"'int', 'bool', or 'string'.")
            continue
        if not ok:
            raise invalid_arg(f"Unable to parse '{key}': {why}")
