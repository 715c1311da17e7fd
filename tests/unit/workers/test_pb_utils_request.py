"""pb_utils.InferenceRequest as a Triton Python model uses it beyond its tensors."""
from __future__ import annotations

import json

from services.workers.python import pb_utils


def test_parameters_are_compact_json_as_triton_writes_them():
    r = pb_utils.InferenceRequest(model_name="m", parameters={"a": 1, "b": "x"})
    assert r.parameters() == '{"a":1,"b":"x"}'
    assert json.loads(pb_utils.InferenceRequest(parameters='{"k": true}').parameters()) == {"k": True}


def test_a_requests_trace_passes_to_a_bls_request():
    """Triton's BLS idiom: InferenceRequest(..., trace=request.trace())."""
    incoming = pb_utils.InferenceRequest(model_name="m")
    trace = incoming.trace()
    assert isinstance(trace, pb_utils.InferenceTrace) and trace.get_context() is None
    assert pb_utils.InferenceRequest(model_name="other", trace=trace).trace() is trace
