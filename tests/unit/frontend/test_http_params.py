"""An HTTP inference request's own parameters, checked as Triton 2.51 checks them (each
case's text is what Triton answered to the same body; Trireme answers 400 where Triton's
is 500, docs/compat.md)."""
from __future__ import annotations

import pytest

from services.common.errors import Code, TriremeError
from services.frontend.http.params import check_request_params


@pytest.mark.parametrize("params,text", [
    ({"triton_foo": 1}, "parameter keys starting with 'triton_' are reserved for Triton usage "
                        "and should not be specified."),
    ({"triton_enable_empty_final_response": True}, "parameter keys starting with 'triton_' are "
     "reserved for Triton usage and should not be specified."),
    ({"priority": "high"}, "Unable to parse 'priority': attempt to access JSON "
                           "non-unsigned-integer as unsigned-integer"),
    ({"priority": -1}, "Unable to parse 'priority': attempt to access JSON non-unsigned-integer "
                       "as unsigned-integer"),
    ({"timeout": 1.5}, "Unable to parse 'timeout': attempt to access JSON non-unsigned-integer "
                       "as unsigned-integer"),
    ({"sequence_id": 1.5}, "Unable to parse 'sequence_id': attempt to access JSON non-string as "
                           "string"),
    ({"sequence_id": -1}, "Unable to parse 'sequence_id': attempt to access JSON non-string as "
                          "string"),
    ({"sequence_start": 1}, "Unable to parse 'sequence_start': attempt to access JSON "
                            "non-boolean as boolean"),
    ({"binary_data_output": "yes"}, "Unable to parse 'binary_data_output': attempt to access "
                                    "JSON non-boolean as boolean"),
    ({"custom": None}, "parameter 'custom' has invalid type. It should be either 'int', 'bool', "
                       "or 'string'."),
    ({"custom": [1]}, "parameter 'custom' has invalid type. It should be either 'int', 'bool', "
                      "or 'string'."),
    ({"ok": 1, "custom": {"a": 1}}, "parameter 'custom' has invalid type. It should be either "
                                    "'int', 'bool', or 'string'."),
])
def test_refused_as_triton_refuses(params, text):
    with pytest.raises(TriremeError) as e:
        check_request_params(params)
    assert (e.value.code, e.value.message) == (Code.INVALID_ARG, text)


def test_accepted():
    check_request_params({"priority": 2, "timeout": 0, "sequence_id": "abc", "custom": 1.5,
                          "sequence_start": True, "sequence_end": False, "s": "x", "b": True,
                          "binary_data_output": True, "big": 2**64 - 1})
